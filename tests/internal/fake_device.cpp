#include "fake_device.hpp"

#include "kernels/kernel_params.h"
#include "seq_image.hpp"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>

using pkv::DevPtr;
using pkv::gpu::Call;

namespace {

constexpr uint8_t kDevicePattern = 0xa5, kPinnedPattern = 0x5a;

uint64_t fnv1a(const void *p, size_t bytes) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < bytes; i++) h = (h ^ static_cast<const uint8_t *>(p)[i]) * 1099511628211ull;
  return h;
}

} // namespace

std::string FakeLedger::alive() const {
  static const char *const names[kThings] = {"device allocation", "pinned buffer", "stream", "event", "module"};
  std::string s;
  for (int t = 0; t < kThings; t++)
    if (live[t] != 0)
      s += (s.empty() ? "" : ", ") + std::to_string(live[t]) + " " + names[t] + (live[t] == 1 ? "" : "s");
  return s;
}

void FakeDevice::record(const char *format, ...) {
  if (!ledger_->recording) return;
  char line[256];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  ledger_->writes.emplace_back(line);
}

uint8_t *FakeDevice::at(DevPtr p, uint64_t bytes) {
  auto it = memory_.upper_bound(p);
  if (it == memory_.begin()) return nullptr;
  --it;
  const uint64_t offset = p - it->first;
  return offset + bytes <= it->second.size() ? it->second.data() + offset : nullptr;
}

FakeDevice::Pinned *FakeDevice::pinned(const void *p) {
  const uint8_t *at = static_cast<const uint8_t *>(p);
  auto it = pinned_.upper_bound(at);
  if (it == pinned_.begin()) return nullptr;
  --it;
  return at < it->first + it->second.bytes.size() ? &it->second : nullptr;
}

Call FakeDevice::end(const void *h, FakeLedger::Thing thing, const char *what) {
  auto it = things_.find(reinterpret_cast<uintptr_t>(h));
  if (it == things_.end() || it->second != thing) return {1, what};
  things_.erase(it);
  ledger_->live[thing]--;
  return ok(what);
}

Call FakeDevice::enter(int *token) {
  *token = 0;
  return ok("enter");
}

Call FakeDevice::attribute(pkv::gpu::Attribute a, int *value) {
  *value = a == pkv::gpu::Attribute::multiprocessors ? 132 : 32;
  return ok("attribute");
}

Call FakeDevice::stream_create(pkv::gpu::Stream *s) {
  *s = handle<pkv::gpu::Stream>(FakeLedger::stream);
  return ok("stream_create");
}
Call FakeDevice::stream_synchronize(pkv::gpu::Stream) {
  done_ = queued_;
  return ok("stream_synchronize");
}
Call FakeDevice::stream_destroy(pkv::gpu::Stream s) { return end(s, FakeLedger::stream, "stream_destroy"); }
Call FakeDevice::stream_capture_status(pkv::gpu::Stream, int *status) {
  *status = 0;
  return ok("capture_status");
}
Call FakeDevice::event_create(pkv::gpu::Event *e, bool) {
  *e = handle<pkv::gpu::Event>(FakeLedger::event);
  return ok("event_create");
}
Call FakeDevice::event_destroy(pkv::gpu::Event e) {
  recorded_.erase(e);
  return end(e, FakeLedger::event, "event_destroy");
}
Call FakeDevice::event_record(pkv::gpu::Event e, pkv::gpu::Stream) {
  recorded_[e] = queued_;
  return ok("event_record");
}
Call FakeDevice::event_synchronize(pkv::gpu::Event e) {
  done_ = std::max(done_, recorded_[e]);
  return ok("event_synchronize");
}
Call FakeDevice::event_elapsed_ms(float *ms, pkv::gpu::Event, pkv::gpu::Event) {
  *ms = 1.0f;
  return ok("event_elapsed");
}

Call FakeDevice::alloc(DevPtr *ptr, size_t bytes) {
  *ptr = next_;
  memory_[next_].assign(bytes, kDevicePattern);
  next_ += (bytes + 0xffff) / 0x10000 * 0x10000 + 0x10000; // a gap: overruns hit no neighbour
  ledger_->live[FakeLedger::device_memory]++;
  return ok("alloc");
}
Call FakeDevice::free(DevPtr ptr) {
  if (!memory_.erase(ptr)) return {1, "free (no such allocation)"};
  ledger_->live[FakeLedger::device_memory]--;
  return ok("free");
}
Call FakeDevice::host_alloc(void **ptr, size_t bytes) {
  FakeVector<uint8_t> buffer(bytes, kPinnedPattern);
  const uint8_t *at = buffer.data();
  *ptr = buffer.data();
  pinned_.emplace(at, Pinned{std::move(buffer), {}});
  ledger_->live[FakeLedger::pinned_memory]++;
  return ok("host_alloc");
}
Call FakeDevice::host_free(void *ptr) {
  if (!pinned_.erase(static_cast<const uint8_t *>(ptr))) return {1, "host_free (no such buffer)"};
  ledger_->live[FakeLedger::pinned_memory]--;
  return ok("host_free");
}

Call FakeDevice::copy_to_device(DevPtr dst, const void *src, size_t bytes, pkv::gpu::Stream) {
  uint8_t *d = at(dst, bytes);
  if (!d) return {1, "copy_to_device (past the end of its allocation)"};
  Pinned *from = pinned(src);
  const uint64_t begin = from ? uint64_t(static_cast<const uint8_t *>(src) - from->bytes.data()) : 0, end = begin + bytes;
  if (from) {
    FakeVector<Read> &reads = from->reads;
    reads.erase(std::remove_if(reads.begin(), reads.end(), [&](const Read &r) { return r.by <= done_; }), reads.end());
    for (const Read &r : reads)
      if (r.begin < end && begin < r.end) return {1, "copy_to_device (from pinned memory a transfer may still read)"};
  }
  std::memcpy(d, src, bytes);
  queued_++;
  if (ledger_->recording) // the hash only where it is kept: it costs more than the copy
    record("copy to %llu: %zu bytes, hash %016llx", (unsigned long long)(dst - std::prev(memory_.upper_bound(dst))->first),
           bytes, (unsigned long long)fnv1a(src, bytes));
  if (from) from->reads.push_back({begin, end, queued_});
  return ok("copy_to_device");
}
Call FakeDevice::copy_to_host(void *dst, DevPtr src, size_t bytes, pkv::gpu::Stream) {
  const uint8_t *s = at(src, bytes);
  if (!s) return {1, "copy_to_host (past the end of its allocation)"};
  std::memcpy(dst, s, bytes);
  queued_++;
  return ok("copy_to_host");
}
Call FakeDevice::fill32(DevPtr dst, uint32_t value, size_t count, pkv::gpu::Stream) {
  uint8_t *d = at(dst, count * 4);
  if (!d) return {1, "fill32 (past the end of its allocation)"};
  for (size_t i = 0; i < count; i++) std::memcpy(d + 4 * i, &value, 4);
  return ok("fill32");
}

Call FakeDevice::module_load(pkv::gpu::Module *m, const void *) {
  *m = handle<pkv::gpu::Module>(FakeLedger::module);
  return ok("module_load");
}
Call FakeDevice::module_unload(pkv::gpu::Module m) { return end(m, FakeLedger::module, "module_unload"); }
Call FakeDevice::function(pkv::gpu::Function *f, pkv::gpu::Module, const char *name) {
  *f = reinterpret_cast<pkv::gpu::Function>(++handles_);
  functions_[*f] = FakeString(name);
  return ok("function");
}
Call FakeDevice::launch(pkv::gpu::Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared_bytes, pkv::gpu::Stream, void **params) {
  auto it = functions_.find(f);
  if (it == functions_.end()) return {1, "launch (no such function)"};
  // The decode kernels count finished chunks in `counters`, which must be zero as a decode starts.
  if (it->second.compare(0, 10, "pkv_decode") == 0) {
    const PkvDecodeParams &p = *static_cast<const PkvDecodeParams *>(params[0]);
    if (p.counters) {
      auto counters = std::prev(memory_.upper_bound(p.counters));
      if (std::any_of(counters->second.begin(), counters->second.end(), [](uint8_t b) { return b != 0; }))
        return {1, "launch (of a decode whose chunk counters are not zero)"};
    }
  }
  if (it->second == "pkv_copy_image" && !copy_image(*static_cast<const PkvImageParams *>(params[0])))
    return {1, "launch (of an image copy past the end of an allocation)"};
  record("launch %s: %ux%ux%u blocks of %ux%ux%u, %u bytes shared", it->second.c_str(), gx, gy, gz, bx, by, bz,
         shared_bytes);
  return ok("launch");
}

// What pkv_copy_image does (lib/kernels/pages.cu), so that images pass through the stand-in whole.
bool FakeDevice::copy_image(const PkvImageParams &p) {
  const uint64_t block = p.pool.block_bytes, blocks = p.blocks;
  const uint8_t *pages = at(p.pages, uint64_t(p.count) * 4);
  uint8_t *sum = at(p.sum, 8), *payload = at(p.payload, blocks * block);
  if (!pages || !sum || !payload) return false;
  uint64_t total;
  std::memcpy(&total, sum, 8);
  for (uint64_t i = 0; i < blocks; i++) {
    const uint64_t b = p.first_block + i;
    uint32_t page;
    std::memcpy(&page, pages + 4 * (b % p.count), 4);
    const uint32_t layer = p.first_layer + uint32_t(b / p.count);
    uint8_t *in_pool = at(p.pool.base + (uint64_t(layer) * p.pool.pages + page) * block, block);
    if (!in_pool) return false;
    uint8_t *in_payload = payload + i * block;
    if (p.to_image) std::memcpy(in_payload, in_pool, block);
    else std::memcpy(in_pool, in_payload, block);
    total += pkv::image_checksum(in_payload, block, b * block / 8);
  }
  std::memcpy(sum, &total, 8);
  return true;
}

Call FakeDevice::shared_per_block(int *bytes) {
  *bytes = 227 * 1024;
  return ok("shared_per_block");
}
Call FakeDevice::static_shared(pkv::gpu::Function, int *bytes) {
  *bytes = 0;
  return ok("static_shared");
}
Call FakeDevice::occupancy(int *blocks, pkv::gpu::Function, int threads, size_t shared_bytes) {
  *blocks = int(std::min<size_t>(228 * 1024 / (shared_bytes + 1024), size_t(2048 / threads)));
  return ok("occupancy");
}
