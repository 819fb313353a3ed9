// An exported sequence's image (docs/design.md, "Sequence images"): its 128-byte header, written and
// checked here, and the checksum of header and payload. The payload is the sequence's pages as the
// pool stores them, [layer][page] blocks of K part then V part; a backend moves those bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "geometry.hpp"
#include "pagedkv.h"

namespace pkv {

constexpr uint32_t kImageHeaderBytes = PKV_SEQ_IMAGE_HEADER_BYTES;
// Where the payload checksum sits in the header: after the words the header checksum covers.
constexpr uint32_t kImagePayloadChecksumAt = 112;
constexpr uint32_t kImageHeaderChecksumAt = 120;

// The fields of a header. Geometry fields are the exporting pool's.
struct ImageHeader {
  uint32_t version = PKV_SEQ_IMAGE_VERSION;
  uint32_t layers = 0, first_layer = 0, layer_count = 0;
  uint32_t kv_heads = 0, head_dim = 0, page_size = 0;
  pkv_format k_format = PKV_FORMAT_INVALID, v_format = PKV_FORMAT_INVALID;
  uint32_t length = 0, pages = 0;
  uint64_t k_part_bytes = 0, v_part_bytes = 0; // one page's K (V) part of one layer, padding included
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;

  uint64_t block_bytes() const { return k_part_bytes + v_part_bytes; }
  uint64_t image_bytes() const { return kImageHeaderBytes + payload_bytes; }
};

// The header of a sequence of `length` tokens over `pages` pages, layers [first, first + count) of a
// pool of geometry g; payload_checksum 0 (filled in where the payload is).
ImageHeader make_image_header(const PoolGeometry &g, uint32_t length, uint32_t pages, uint32_t first,
                              uint32_t count);

// The 128 bytes of a header, little-endian, its header checksum set.
void encode_image_header(const ImageHeader &h, uint8_t out[kImageHeaderBytes]);

// The header of an image of image_bytes bytes, checked on its own (magic, header checksum, version,
// consistent sizes, the image not truncated); throws PKV_ERR_INVALID_ARGUMENT or, for a newer
// version, PKV_ERR_VERSION, naming what is wrong.
ImageHeader decode_image_header(const uint8_t in[kImageHeaderBytes], uint64_t image_bytes);

// Throws PKV_ERR_INVALID_ARGUMENT naming the first field in which the image's geometry differs from
// the pool's.
void check_image_fits(const ImageHeader &h, const PoolGeometry &g);

// The checksum of header and payload: the sum, modulo 2^64, of mix(w_i, i) over the little-endian
// 64-bit words w_i of the bytes, i counted from first_word. A sum, so parts add up in any order:
// threads and GPU blocks sum their own words (lib/kernels/pages.cu computes the same).
inline uint64_t image_word_term(uint64_t word, uint64_t index) {
  uint64_t z = word + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// n_bytes is a multiple of 8.
uint64_t image_checksum(const uint8_t *bytes, uint64_t n_bytes, uint64_t first_word);
// Writes a payload checksum into an encoded header (little-endian, as every field).
void set_payload_checksum(uint8_t header[kImageHeaderBytes], uint64_t sum);

} // namespace pkv
