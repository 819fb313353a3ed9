#include "seq_image.hpp"

#include <cstring>

#include "error.hpp"

namespace pkv {

namespace {

// "pkvimage" in its first eight bytes.
constexpr uint8_t kMagic[8] = {'p', 'k', 'v', 'i', 'm', 'a', 'g', 'e'};

// Header fields at fixed offsets; bytes 88..111 are reserved and zero.
enum : uint32_t {
  kVersionAt = 8, kHeaderBytesAt = 12, kLayersAt = 16, kFirstLayerAt = 20, kLayerCountAt = 24, kKvHeadsAt = 28,
  kHeadDimAt = 32, kPageSizeAt = 36, kKFormatAt = 40, kVFormatAt = 44, kLengthAt = 48, kPagesAt = 52,
  kKPartAt = 56, kVPartAt = 64, kPayloadAt = 72, kReservedAt = 80
};

void put32(uint8_t *p, uint32_t x) {
  for (int i = 0; i < 4; i++) p[i] = uint8_t(x >> (8 * i));
}
void put64(uint8_t *p, uint64_t x) {
  for (int i = 0; i < 8; i++) p[i] = uint8_t(x >> (8 * i));
}
uint32_t get32(const uint8_t *p) {
  uint32_t x = 0;
  for (int i = 0; i < 4; i++) x |= uint32_t(p[i]) << (8 * i);
  return x;
}
// A little-endian host (every one pagedkv builds for) loads the word as it is.
uint64_t get64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t x;
  std::memcpy(&x, p, 8);
  return x;
#else
  uint64_t x = 0;
  for (int i = 0; i < 8; i++) x |= uint64_t(p[i]) << (8 * i);
  return x;
#endif
}

uint64_t header_checksum(const uint8_t *h) { return image_checksum(h, kImagePayloadChecksumAt, 0); }

} // namespace

uint64_t image_checksum(const uint8_t *bytes, uint64_t n_bytes, uint64_t first_word) {
  uint64_t sum = 0;
  for (uint64_t i = 0; i < n_bytes / 8; i++) sum += image_word_term(get64(bytes + 8 * i), first_word + i);
  return sum;
}

void set_payload_checksum(uint8_t header[kImageHeaderBytes], uint64_t sum) {
  put64(header + kImagePayloadChecksumAt, sum);
}

ImageHeader make_image_header(const PoolGeometry &g, uint32_t length, uint32_t pages, uint32_t first,
                              uint32_t count) {
  ImageHeader h;
  h.layers = g.layers;
  h.first_layer = first;
  h.layer_count = count;
  h.kv_heads = g.kv_heads;
  h.head_dim = g.head_dim;
  h.page_size = g.page_size;
  h.k_format = g.k.format;
  h.v_format = g.v.format;
  h.length = length;
  h.pages = pages;
  h.k_part_bytes = g.k.bytes;
  h.v_part_bytes = g.v.bytes;
  h.payload_bytes = uint64_t(count) * pages * g.block_bytes;
  return h;
}

void encode_image_header(const ImageHeader &h, uint8_t out[kImageHeaderBytes]) {
  std::memset(out, 0, kImageHeaderBytes);
  std::memcpy(out, kMagic, sizeof kMagic);
  put32(out + kVersionAt, h.version);
  put32(out + kHeaderBytesAt, kImageHeaderBytes);
  put32(out + kLayersAt, h.layers);
  put32(out + kFirstLayerAt, h.first_layer);
  put32(out + kLayerCountAt, h.layer_count);
  put32(out + kKvHeadsAt, h.kv_heads);
  put32(out + kHeadDimAt, h.head_dim);
  put32(out + kPageSizeAt, h.page_size);
  put32(out + kKFormatAt, uint32_t(h.k_format));
  put32(out + kVFormatAt, uint32_t(h.v_format));
  put32(out + kLengthAt, h.length);
  put32(out + kPagesAt, h.pages);
  put64(out + kKPartAt, h.k_part_bytes);
  put64(out + kVPartAt, h.v_part_bytes);
  put64(out + kPayloadAt, h.payload_bytes);
  put64(out + kImagePayloadChecksumAt, h.payload_checksum);
  put64(out + kImageHeaderChecksumAt, header_checksum(out));
}

ImageHeader decode_image_header(const uint8_t in[kImageHeaderBytes], uint64_t image_bytes) {
  if (std::memcmp(in, kMagic, sizeof kMagic) != 0)
    fail(PKV_ERR_INVALID_ARGUMENT, "image does not start with the magic \"pkvimage\": not a sequence image");
  const uint32_t version = get32(in + kVersionAt);
  // A newer version may lay out its header otherwise, so its version is all that is read of it.
  if (version > PKV_SEQ_IMAGE_VERSION || version == 0)
    fail(PKV_ERR_VERSION, "the image has version %u; this library reads version %u", version,
         unsigned(PKV_SEQ_IMAGE_VERSION));
  const uint64_t stored = get64(in + kImageHeaderChecksumAt), computed = header_checksum(in);
  if (stored != computed)
    fail(PKV_ERR_INVALID_ARGUMENT, "the image header's checksum is %016llx, its bytes sum to %016llx: the header "
         "is corrupted", (unsigned long long)stored, (unsigned long long)computed);
  if (get32(in + kHeaderBytesAt) != kImageHeaderBytes)
    fail(PKV_ERR_INVALID_ARGUMENT, "the image header says it has %u bytes; version %u headers have %u",
         get32(in + kHeaderBytesAt), version, kImageHeaderBytes);
  ImageHeader h;
  h.version = version;
  h.layers = get32(in + kLayersAt);
  h.first_layer = get32(in + kFirstLayerAt);
  h.layer_count = get32(in + kLayerCountAt);
  h.kv_heads = get32(in + kKvHeadsAt);
  h.head_dim = get32(in + kHeadDimAt);
  h.page_size = get32(in + kPageSizeAt);
  h.k_format = pkv_format(get32(in + kKFormatAt));
  h.v_format = pkv_format(get32(in + kVFormatAt));
  h.length = get32(in + kLengthAt);
  h.pages = get32(in + kPagesAt);
  h.k_part_bytes = get64(in + kKPartAt);
  h.v_part_bytes = get64(in + kVPartAt);
  h.payload_bytes = get64(in + kPayloadAt);
  h.payload_checksum = get64(in + kImagePayloadChecksumAt);
  for (uint32_t at = kReservedAt; at < kImagePayloadChecksumAt; at += 8)
    if (get64(in + at) != 0) fail(PKV_ERR_INVALID_ARGUMENT, "the image header's reserved bytes %u..%u are not zero", at, at + 7);
  if (h.layer_count == 0 || uint64_t(h.first_layer) + h.layer_count > h.layers)
    fail(PKV_ERR_INVALID_ARGUMENT, "the image header's layers [%u, %llu) do not lie within its pool's %u layers",
         h.first_layer, (unsigned long long)h.first_layer + h.layer_count, h.layers);
  if (h.page_size == 0 || h.pages != (uint64_t(h.length) + h.page_size - 1) / h.page_size)
    fail(PKV_ERR_INVALID_ARGUMENT, "the image header says %u pages for %u tokens of %u a page", h.pages, h.length,
         h.page_size);
  // Part sizes fit the geometry's (checked against the pool's later), so this product cannot wrap.
  if (h.k_part_bytes > (uint64_t(1) << 40) || h.v_part_bytes > (uint64_t(1) << 40) ||
      h.payload_bytes != uint64_t(h.layer_count) * h.pages * h.block_bytes())
    fail(PKV_ERR_INVALID_ARGUMENT, "the image header's payload of %llu bytes is not %u layers x %u pages x %llu bytes",
         (unsigned long long)h.payload_bytes, h.layer_count, h.pages, (unsigned long long)h.block_bytes());
  if (image_bytes < h.image_bytes())
    fail(PKV_ERR_INVALID_ARGUMENT, "image_bytes is %llu but the image takes %llu bytes (its header and %llu bytes of "
         "payload): it is truncated", (unsigned long long)image_bytes, (unsigned long long)h.image_bytes(),
         (unsigned long long)h.payload_bytes);
  return h;
}

void check_image_fits(const ImageHeader &h, const PoolGeometry &g) {
  struct Field {
    const char *name;
    uint64_t image, pool;
  };
  const Field fields[] = {
      {"layers", h.layers, g.layers},
      {"kv_heads", h.kv_heads, g.kv_heads},
      {"head_dim", h.head_dim, g.head_dim},
      {"page_size", h.page_size, g.page_size},
  };
  for (const Field &f : fields)
    if (f.image != f.pool)
      fail(PKV_ERR_INVALID_ARGUMENT, "the image's %s is %llu, the pool's %llu", f.name, (unsigned long long)f.image,
           (unsigned long long)f.pool);
  const struct {
    const char *name;
    pkv_format image, pool;
  } formats[] = {{"k_format", h.k_format, g.k.format}, {"v_format", h.v_format, g.v.format}};
  for (const auto &f : formats)
    if (f.image != f.pool)
      fail(PKV_ERR_INVALID_ARGUMENT, "the image's %s is %s (%d), the pool's %s", f.name, pkv_format_name(f.image),
           int(f.image), pkv_format_name(f.pool));
  if (h.k_part_bytes != g.k.bytes || h.v_part_bytes != g.v.bytes)
    fail(PKV_ERR_INVALID_ARGUMENT, "the image's page parts are %llu + %llu bytes, the pool's %llu + %llu",
         (unsigned long long)h.k_part_bytes, (unsigned long long)h.v_part_bytes, (unsigned long long)g.k.bytes,
         (unsigned long long)g.v.bytes);
}

} // namespace pkv
