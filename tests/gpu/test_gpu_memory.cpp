// Device pointers, as engines pass them: K/V rows written from device memory, rows read back into
// it, q (also at an address off 16-byte alignment), out and lse in it. The results must be the same
// bits as the same calls with host pointers. Sequence images in device and pinned host memory, and
// pages moved span by span as a transfer engine moves them.
// And decode and extend captured in a CUDA graph on the engine's stream: replayed after the batch grew
// (and pkv_decode_prepare or pkv_extend_prepare put the new plans on the device), they must give the
// same bits as a direct call; on the HIP backend, which has no kernel that can be captured, the
// capture is refused; nor where the tensor-core kernel does not fit the device's shared memory.
// Skipped (visibly) unless the backend in use is CUDA, or HIP on the test stand-in for the HIP runtime
// (PKV_TEST_HIP_STANDIN set: its device memory is the CUDA driver's too); device memory comes from the
// CUDA driver through the library's own loader sources, compiled into this test.
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <csetjmp>
extern "C" {
#include <cmocka.h>
#include "tu_run.h"
}

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_driver.hpp"
extern "C" {
#include "poolutil.h"
#include "testutil.h"
}

namespace {

using namespace pkv::cu;

void check_cu(const Driver &cu, CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) fail_msg("%s: %s", what, cu.describe(r).c_str());
}

// Device buffers in the device's primary context, which the library's context shares.
struct DeviceMemory {
  const Driver &cu;
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  std::vector<CUdeviceptr> buffers;

  explicit DeviceMemory(const Driver &d) : cu(d) {
    check_cu(cu, cu.cuDeviceGet(&device, 0), "cuDeviceGet");
    check_cu(cu, cu.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain");
    check_cu(cu, cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
  }
  ~DeviceMemory() {
    for (CUdeviceptr p : buffers) cu.cuMemFree(p);
    CUcontext popped;
    cu.cuCtxPopCurrent(&popped);
    cu.cuDevicePrimaryCtxRelease(device);
  }
  void *alloc(size_t bytes) {
    CUdeviceptr p = 0;
    check_cu(cu, cu.cuMemAlloc(&p, bytes), "cuMemAlloc");
    buffers.push_back(p);
    return reinterpret_cast<void *>(p);
  }
  void *upload(const void *src, size_t bytes) {
    void *dst = alloc(bytes);
    check_cu(cu, cu.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, nullptr), "cuMemcpyHtoDAsync");
    check_cu(cu, cu.cuStreamSynchronize(nullptr), "cuStreamSynchronize");
    return dst;
  }
  template <class T> std::vector<T> download(const void *src, size_t n) {
    std::vector<T> out(n);
    check_cu(cu, cu.cuMemcpyDtoHAsync(out.data(), reinterpret_cast<CUdeviceptr>(src), n * sizeof(T), nullptr),
             "cuMemcpyDtoHAsync");
    check_cu(cu, cu.cuStreamSynchronize(nullptr), "cuStreamSynchronize");
    return out;
  }
};

void device_pointers_match_host_pointers(void **) {
  enum : uint32_t { KV = 2, Q = 8, D = 128, B = 3 };
  tu_rng rng = tu_rng_make(tu_seed());
  const pkv_pool_desc d = pu_desc(2, KV, D, 16, 64, B, PKV_FORMAT_Q8_0, PKV_FORMAT_F16);
  pkv_context *ctx;
  pkv_pool *host_pool, *dev_pool;
  pu_open(&d, &ctx, &host_pool);
  pkv_backend backend;
  CHECK_OK(pkv_context_backend(ctx, &backend));
  if (backend != PKV_BACKEND_CUDA && !(backend == PKV_BACKEND_HIP && std::getenv("PKV_TEST_HIP_STANDIN"))) {
    pu_close(ctx, host_pool);
    skip();
  }
  CHECK_OK(pkv_pool_create(ctx, &d, &dev_pool));
  std::string why;
  const Driver *cu = pkv::cuda_driver(&why);
  if (!cu) fail_msg("%s", why.c_str());
  DeviceMemory mem(*cu);

  const uint32_t len[B] = {1 + tu_below(&rng, 30), 100 + tu_below(&rng, 200), 0};
  const size_t rows = len[0] + len[1];
  std::vector<float> k(rows * KV * D), v(rows * KV * D), q(size_t(B) * Q * D);
  tu_fill_uniform(&rng, k.data(), k.size(), -2, 2);
  tu_fill_uniform(&rng, v.data(), v.size(), -2, 2);
  tu_fill_uniform(&rng, q.data(), q.size(), -2, 2);
  pkv_seq hs[B], ds[B];
  for (uint32_t b = 0; b < B; b++) {
    CHECK_OK(pkv_seq_alloc(host_pool, &hs[b]));
    CHECK_OK(pkv_seq_alloc(dev_pool, &ds[b]));
  }
  CHECK_OK(pkv_append(host_pool, hs, len, B));
  CHECK_OK(pkv_append(dev_pool, ds, len, B));

  pkv_write_args w = pu_write_args(1, hs, len, B, PKV_FORMAT_F32, k.data(), v.data());
  CHECK_OK(pkv_write(host_pool, &w));
  w.seqs = ds;
  w.memory = PKV_MEMORY_DEVICE;
  w.k = mem.upload(k.data(), k.size() * 4);
  w.v = mem.upload(v.data(), v.size() * 4);
  CHECK_OK(pkv_write(dev_pool, &w));

  // Rows read back into device memory equal rows read into host memory.
  std::vector<float> host_k(size_t(len[1]) * KV * D);
  CHECK_OK(pu_read(host_pool, 1, hs[1], 0, len[1], PKV_FORMAT_F32, host_k.data(), nullptr));
  pkv_read_args r = pu_read_args(1, ds[1], 0, len[1], PKV_FORMAT_F32, mem.alloc(host_k.size() * 4), nullptr);
  r.memory = PKV_MEMORY_DEVICE;
  CHECK_OK(pkv_read(dev_pool, &r));
  if (std::memcmp(mem.download<float>(r.k, host_k.size()).data(), host_k.data(), host_k.size() * 4) != 0)
    fail_msg("rows read into device memory differ from rows read into host memory");

  // Decode with host pointers, then with device pointers: the same bits.
  std::vector<float> out(q.size(), NAN), lse(size_t(B) * Q, NAN);
  pkv_decode_args a = pu_decode_args(1, hs, B, Q, q.data(), out.data(), lse.data());
  CHECK_OK(pkv_decode(host_pool, &a));
  a.seqs = ds;
  a.memory = PKV_MEMORY_DEVICE;
  a.q = mem.upload(q.data(), q.size() * 4);
  std::vector<float> poison(q.size(), NAN);
  a.out = mem.upload(poison.data(), poison.size() * 4);
  a.lse = static_cast<float *>(mem.upload(poison.data(), lse.size() * 4));
  CHECK_OK(pkv_decode(dev_pool, &a));
  CHECK_OK(pkv_context_synchronize(ctx));
  if (std::memcmp(mem.download<float>(a.out, out.size()).data(), out.data(), out.size() * 4) != 0 ||
      std::memcmp(mem.download<float>(a.lse, lse.size()).data(), lse.data(), lse.size() * 4) != 0)
    fail_msg("decode with device pointers differs from decode with host pointers");
  for (float x : out)
    if (std::isnan(x)) fail_msg("an output was not written");

  // F16 q read from a device address 4 bytes past a 16-byte boundary (an engine's slice of a larger
  // buffer): the kernels must not assume 16-byte alignment, and the bits equal the host decode's.
  std::vector<uint16_t> q16(q.size());
  CHECK_OK(pkv_convert_from_f32(PKV_FORMAT_F16, q.data(), q.size(), q16.data()));
  std::vector<float> out16(q.size(), NAN);
  a.seqs = hs;
  a.memory = PKV_MEMORY_HOST;
  a.q_format = PKV_FORMAT_F16;
  a.q = q16.data();
  a.out = out16.data();
  a.lse = nullptr;
  CHECK_OK(pkv_decode(host_pool, &a));
  a.seqs = ds;
  a.memory = PKV_MEMORY_DEVICE;
  a.q = static_cast<uint8_t *>(mem.alloc(q16.size() * 2 + 16)) + 4;
  check_cu(mem.cu, mem.cu.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(a.q), q16.data(), q16.size() * 2, nullptr),
           "cuMemcpyHtoDAsync");
  check_cu(mem.cu, mem.cu.cuStreamSynchronize(nullptr), "cuStreamSynchronize");
  a.out = mem.upload(poison.data(), poison.size() * 4);
  CHECK_OK(pkv_decode(dev_pool, &a));
  CHECK_OK(pkv_context_synchronize(ctx));
  if (std::memcmp(mem.download<float>(a.out, out16.size()).data(), out16.data(), out16.size() * 4) != 0)
    fail_msg("decode of an unaligned device q differs from decode of host q");

  CHECK_OK(pkv_pool_destroy(dev_pool));
  pu_close(ctx, host_pool);
}

// The CUDA driver, or null. Nothing of this call outlives it: a cmocka skip() leaves the test by
// longjmp, past every destructor, and LeakSanitizer would report a string left behind.
const Driver *driver_or_null() {
  std::string why;
  return pkv::cuda_driver(&why);
}

// Appends n[b] tokens of fresh random K/V to each sequence and writes them into every layer.
void grow(pkv_pool *pool, const pkv_seq *seqs, const uint32_t *n, uint32_t count, uint32_t layers, uint32_t width,
          tu_rng *rng) {
  CHECK_OK(pkv_append(pool, seqs, n, count));
  size_t rows = 0;
  for (uint32_t b = 0; b < count; b++) rows += n[b];
  std::vector<float> k(rows * width), v(rows * width);
  for (uint32_t layer = 0; layer < layers; layer++) {
    tu_fill_uniform(rng, k.data(), k.size(), -2, 2);
    tu_fill_uniform(rng, v.data(), v.size(), -2, 2);
    CHECK_OK(pu_write(pool, layer, seqs, n, count, PKV_FORMAT_F32, k.data(), v.data()));
  }
}

// Sequence images in device memory and in pinned host memory: the same bytes as the host-memory image
// of the sequence (so the kernel's checksum is the host's formula: a CPU context imports the image),
// and each imports into another pool to pages that export to those bytes again. Then the decode
// side of a transfer engine: a sequence of the same length appended in that pool, the exporting
// pool's spans copied device to device into its spans, and its decode the exporting pool's, bit for
// bit (the queued page-table changes applied by the decode).
void images_in_device_and_pinned_memory(void **) {
  enum : uint32_t { KV = 2, Q = 8, D = 128, LAYERS = 3 };
  tu_rng rng = tu_rng_make(tu_seed());
  pkv_pool_desc d = pu_desc(LAYERS, KV, D, 16, 96, 4, PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0);
  d.page_order_seed = 5;
  pkv_context *ctx;
  pkv_pool *a, *b;
  pu_open(&d, &ctx, &a);
  pkv_backend backend;
  CHECK_OK(pkv_context_backend(ctx, &backend));
  if (backend != PKV_BACKEND_CUDA && !(backend == PKV_BACKEND_HIP && std::getenv("PKV_TEST_HIP_STANDIN"))) {
    pu_close(ctx, a);
    skip();
  }
  d.page_order_seed = 77;
  CHECK_OK(pkv_pool_create(ctx, &d, &b));
  std::string why;
  const Driver *cu = pkv::cuda_driver(&why);
  if (!cu) fail_msg("%s", why.c_str());
  DeviceMemory mem(*cu);

  pkv_seq s;
  CHECK_OK(pkv_seq_alloc(a, &s));
  const uint32_t len = 300 + tu_below(&rng, 400);
  grow(a, &s, &len, 1, LAYERS, KV * D, &rng);
  pkv_export_args e = PKV_EXPORT_ARGS_INIT;
  e.seq = s;
  uint64_t bytes = 0;
  CHECK_OK(pkv_seq_export_size(a, &e, &bytes));
  std::vector<uint8_t> host(bytes), again(bytes), back(bytes);
  e.image = host.data();
  e.image_bytes = bytes;
  CHECK_OK(pkv_seq_export(a, &e));

  void *device = mem.alloc(bytes), *pinned = nullptr;
  check_cu(*cu, cu->cuMemHostAlloc(&pinned, bytes, 0), "cuMemHostAlloc");
  struct {
    pkv_memory memory;
    void *image;
    const char *name;
  } kinds[] = {{PKV_MEMORY_HOST, again.data(), "host"}, {PKV_MEMORY_DEVICE, device, "device"},
               {PKV_MEMORY_HOST_PINNED, pinned, "pinned host"}};
  for (auto &k : kinds) {
    e.memory = k.memory;
    e.image = k.image;
    CHECK_OK(pkv_seq_export(a, &e));
    CHECK_OK(pkv_context_synchronize(ctx));
    const std::vector<uint8_t> got = k.memory == PKV_MEMORY_DEVICE
                                         ? mem.download<uint8_t>(k.image, bytes)
                                         : std::vector<uint8_t>(static_cast<uint8_t *>(k.image),
                                                                static_cast<uint8_t *>(k.image) + bytes);
    if (got != host) fail_msg("the image exported to %s memory differs from the first host memory one", k.name);
    pkv_import_args in = PKV_IMPORT_ARGS_INIT;
    in.memory = k.memory;
    in.image = k.image;
    in.image_bytes = bytes;
    pkv_seq t;
    CHECK_OK(pkv_seq_import(b, &in, &t));
    pkv_export_args out = e;
    out.seq = t;
    out.memory = PKV_MEMORY_HOST;
    out.image = back.data();
    CHECK_OK(pkv_seq_export(b, &out));
    if (back != host) fail_msg("the sequence imported from %s memory exports another image", k.name);
    CHECK_OK(pkv_seq_free(b, t));
  }
  cu->cuMemFreeHost(pinned);

  // The checksum the device summed is the one the host computes: a CPU pool imports the image.
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  cd.backend = PKV_BACKEND_CPU;
  pkv_context *cpu;
  pkv_pool *c;
  CHECK_OK(pkv_context_create(&cd, &cpu));
  CHECK_OK(pkv_pool_create(cpu, &d, &c));
  pkv_import_args in = PKV_IMPORT_ARGS_INIT;
  in.image = host.data();
  in.image_bytes = bytes;
  pkv_seq on_cpu;
  CHECK_OK(pkv_seq_import(c, &in, &on_cpu));
  CHECK_OK(pkv_pool_destroy(c));
  CHECK_OK(pkv_context_destroy(cpu));

  // A transfer engine's moves: span i of a into span i of b's fresh sequence, device to device.
  pkv_seq t;
  CHECK_OK(pkv_seq_alloc(b, &t));
  CHECK_OK(pkv_append(b, &t, &len, 1));
  pkv_memory_region ra, rb;
  uint32_t n_regions = 0;
  CHECK_OK(pkv_pool_regions(a, &ra, 1, &n_regions));
  CHECK_OK(pkv_pool_regions(b, &rb, 1, &n_regions));
  uint64_t n = 0;
  CHECK_OK(pkv_seq_page_spans(a, s, 0, 0, nullptr, 0, &n));
  std::vector<pkv_page_span> sa(n), sb(n);
  CHECK_OK(pkv_seq_page_spans(a, s, 0, 0, sa.data(), n, &n));
  CHECK_OK(pkv_seq_page_spans(b, t, 0, 0, sb.data(), n, &n));
  CHECK_OK(pkv_context_synchronize(ctx)); // a's writes are done before the engine reads its pages
  for (uint64_t i = 0; i < n; i++)
    check_cu(*cu, cu->cuMemcpyDtoDAsync(rb.address + sb[i].offset, ra.address + sa[i].offset, sa[i].bytes, nullptr),
             "cuMemcpyDtoDAsync");
  check_cu(*cu, cu->cuStreamSynchronize(nullptr), "cuStreamSynchronize");
  std::vector<float> q(size_t(Q) * D), out_a(q.size(), NAN), out_b(q.size(), NAN);
  tu_fill_uniform(&rng, q.data(), q.size(), -1, 1);
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    pkv_decode_args da = pu_decode_args(layer, &s, 1, Q, q.data(), out_a.data(), nullptr);
    CHECK_OK(pkv_decode(a, &da));
    pkv_decode_args db = pu_decode_args(layer, &t, 1, Q, q.data(), out_b.data(), nullptr);
    CHECK_OK(pkv_decode(b, &db));
    if (std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4) != 0)
      fail_msg("layer %u: the sequence moved span by span decodes differently", layer);
  }
  CHECK_OK(pkv_pool_destroy(b));
  pu_close(ctx, a);
}

// A context on a stream of the test's own, as an engine makes one, and device memory. Made only after
// every skip: a cmocka skip() leaves the test by longjmp, past destructors.
struct EngineStream {
  const Driver &cu;
  DeviceMemory mem;
  CUstream stream = nullptr;
  pkv_context *ctx = nullptr;
  EngineStream(const Driver &d, pkv_backend backend) : cu(d), mem(d) {
    check_cu(cu, cu.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
    cd.backend = backend;
    cd.stream = stream;
    CHECK_OK(pkv_context_create(&cd, &ctx));
  }
  ~EngineStream() {
    pkv_context_destroy(ctx);
    cu.cuStreamDestroy(stream);
  }
  // A call issued while the stream captures a graph (the graph is dropped): its status, and in *text
  // what pkv_last_error() said.
  template <class Call> pkv_status captured(Call call, std::string *text) {
    check_cu(cu, cu.cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    const pkv_status st = call();
    *text = pkv_last_error();
    CUgraph unused = nullptr;
    cu.cuStreamEndCapture(stream, &unused);
    if (unused) cu.cuGraphDestroy(unused);
    return st;
  }
  pkv_status decode_captured(pkv_pool *pool, const pkv_decode_args &a, std::string *text) {
    return captured([&] { return pkv_decode(pool, &a); }, text);
  }
  pkv_status extend_captured(pkv_pool *pool, const pkv_extend_args &a, std::string *text) {
    return captured([&] { return pkv_extend(pool, &a); }, text);
  }
};

// The CUDA driver where `backend` has a device (the HIP one only on the stand-in, whose device memory
// and streams are the CUDA driver's); skips the test otherwise.
const Driver *driver_or_skip(pkv_backend backend) {
  if (backend == PKV_BACKEND_HIP && !std::getenv("PKV_TEST_HIP_STANDIN")) skip();
  const Driver *cu = driver_or_null();
  if (!cu) skip();
  pkv_backend_info info = PKV_BACKEND_INFO_INIT;
  CHECK_OK(pkv_backend_query(backend, &info));
  if (info.device_count == 0) skip();
  return cu;
}

void captured_decode_replays_after_the_batch_grows(void **) {
  enum : uint32_t { L = 2, KV = 2, Q = 8, B = 4, T = 2 };
  tu_rng rng = tu_rng_make(tu_seed());
  const pkv_format formats[] = {PKV_FORMAT_F16, PKV_FORMAT_BF16, PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0};
  const uint32_t dims[] = {64, 128, 256};
  const uint32_t D = dims[tu_below(&rng, 3)];
  const pkv_pool_desc d = pu_desc(L, KV, D, 16, 2048, B, formats[tu_below(&rng, 4)], formats[tu_below(&rng, 4)]);
  print_message("head_dim %u, K %s, V %s\n", D, pkv_format_name(d.k_format), pkv_format_name(d.v_format));

  const Driver *cu = driver_or_skip(PKV_BACKEND_CUDA);
  EngineStream e(*cu, PKV_BACKEND_CUDA);
  DeviceMemory &mem = e.mem;
  const CUstream stream = e.stream;
  pkv_pool *pool;
  CHECK_OK(pkv_pool_create(e.ctx, &d, &pool));

  pkv_seq seqs[B];
  uint32_t n[B];
  for (uint32_t b = 0; b < B; b++) {
    CHECK_OK(pkv_seq_alloc(pool, &seqs[b]));
    n[b] = T + tu_below(&rng, 100);
  }
  grow(pool, seqs, n, B, L, KV * D, &rng);

  const size_t out_n = size_t(B) * T * Q * D, lse_n = size_t(B) * T * Q;
  std::vector<float> q(out_n), poison(out_n, NAN);
  tu_fill_uniform(&rng, q.data(), q.size(), -2, 2);
  void *graph_out[L], *graph_lse[L], *direct_out = mem.alloc(out_n * 4), *direct_lse = mem.alloc(lse_n * 4);
  for (uint32_t layer = 0; layer < L; layer++) {
    graph_out[layer] = mem.upload(poison.data(), out_n * 4);
    graph_lse[layer] = mem.upload(poison.data(), lse_n * 4);
  }
  pkv_decode_args a =
      pu_decode_args(0, seqs, B, Q, mem.upload(q.data(), out_n * 4), direct_out, static_cast<float *>(direct_lse));
  a.q_tokens = T;
  a.memory = PKV_MEMORY_DEVICE;
  // The attention variants, each half the time, the sinks and slopes in device memory as an engine
  // holds a model's weights: the graph reads them in place.
  std::vector<float> sinks(Q), slopes(Q);
  tu_fill_uniform(&rng, sinks.data(), Q, -3, 3);
  tu_fill_uniform(&rng, slopes.data(), Q, 0, 0.02);
  if (tu_below(&rng, 2)) a.sinks = static_cast<const float *>(mem.upload(sinks.data(), Q * 4));
  if (tu_below(&rng, 2)) a.alibi_slopes = static_cast<const float *>(mem.upload(slopes.data(), Q * 4));
  if (tu_below(&rng, 2)) a.window = 1 + tu_below(&rng, 700);
  if (tu_below(&rng, 2)) a.softcap = float(tu_uniform(&rng, 1, 30));
  print_message("sinks %d, slopes %d, window %u, softcap %g\n", a.sinks != nullptr, a.alibi_slopes != nullptr,
                a.window, double(a.softcap));
  std::vector<float> host_out(out_n), host_lse(lse_n);

  // Capture both layers' decode. The shape is decoded once first (scratch buffers are sized on first
  // use), then prepared.
  CHECK_OK(pkv_decode(pool, &a));
  CHECK_OK(pkv_decode_prepare(pool, &a));
  check_cu(*cu, cu->cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  for (uint32_t layer = 0; layer < L; layer++) {
    a.layer = layer;
    a.out = graph_out[layer];
    a.lse = static_cast<float *>(graph_lse[layer]);
    const pkv_status st = pkv_decode(pool, &a);
    if (st != PKV_OK) {
      CUgraph broken;
      cu->cuStreamEndCapture(stream, &broken);
      fail_msg("decode while capturing: %s", pkv_last_error());
    }
  }
  CUgraph graph;
  CUgraphExec exec;
  check_cu(*cu, cu->cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
  check_cu(*cu, cu->cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiateWithFlags");

  for (int round = 0; round < 4; round++) {
    // Longer contexts: more chunks than the captured launch has blocks, split sequences merged.
    for (uint32_t b = 0; b < B; b++) n[b] = 1 + tu_below(&rng, round == 0 ? 8 : 1500);
    grow(pool, seqs, n, B, L, KV * D, &rng);

    // A decode the stream cannot replay (its plan is not on the device) is refused while capturing.
    std::string text;
    pu_assert_fails(e.decode_captured(pool, a, &text), PKV_ERR_INVALID_ARGUMENT);

    CHECK_OK(pkv_decode_prepare(pool, &a));
    check_cu(*cu, cu->cuGraphLaunch(exec, stream), "cuGraphLaunch");
    for (uint32_t layer = 0; layer < L; layer++) {
      a.layer = layer;
      a.out = direct_out;
      a.lse = static_cast<float *>(direct_lse);
      CHECK_OK(pkv_decode(pool, &a));
      CHECK_OK(pkv_context_synchronize(e.ctx));
      const std::vector<float> got = mem.download<float>(graph_out[layer], out_n);
      for (float x : got)
        if (std::isnan(x)) fail_msg("round %d layer %u: the replay left an output unwritten", round, layer);
      if (std::memcmp(got.data(), mem.download<float>(direct_out, out_n).data(), out_n * 4) != 0 ||
          std::memcmp(mem.download<float>(graph_lse[layer], lse_n).data(),
                      mem.download<float>(direct_lse, lse_n).data(), lse_n * 4) != 0)
        fail_msg("round %d layer %u: the replayed decode differs from a direct decode", round, layer);
      // From host memory (q, sinks and slopes sent with the call) the same kernels give the same bits.
      pkv_decode_args h = a;
      h.memory = PKV_MEMORY_HOST;
      h.q = q.data(), h.out = host_out.data(), h.lse = host_lse.data();
      h.sinks = a.sinks ? sinks.data() : nullptr, h.alibi_slopes = a.alibi_slopes ? slopes.data() : nullptr;
      CHECK_OK(pkv_decode(pool, &h));
      if (std::memcmp(host_out.data(), got.data(), out_n * 4) != 0 ||
          std::memcmp(host_lse.data(), mem.download<float>(direct_lse, lse_n).data(), lse_n * 4) != 0)
        fail_msg("round %d layer %u: a decode from host memory differs from the one from device memory", round, layer);
      // Poisoned again for the next replay.
      check_cu(*cu, cu->cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(graph_out[layer]), poison.data(), out_n * 4,
                                          stream), "cuMemcpyHtoDAsync");
      CHECK_OK(pkv_context_synchronize(e.ctx));
    }
  }
  cu->cuGraphExecDestroy(exec);
  cu->cuGraphDestroy(graph);
  CHECK_OK(pkv_pool_destroy(pool));
}

// An extend captured in a graph: an entry of 64+ new tokens (the extend kernel's tiles where the pool's
// formats take them), one of a few (decode's blocks) and an empty one, in both layers. Each round the
// sequences grow by some context and the same numbers of new tokens, pkv_extend_prepare puts the new
// plans on the device, and the replay must give a direct extend's bits (and those of one from host
// memory). Half the time with a tree mask, which puts every entry on decode's blocks.
void captured_extend_replays_after_the_batch_grows(void **) {
  enum : uint32_t { L = 2, KV = 2, Q = 8, B = 3 };
  tu_rng rng = tu_rng_make(tu_seed());
  const pkv_format formats[] = {PKV_FORMAT_F16, PKV_FORMAT_BF16, PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0};
  const uint32_t dims[] = {64, 128, 256};
  const uint32_t D = dims[tu_below(&rng, 3)];
  const pkv_pool_desc d = pu_desc(L, KV, D, 16, 1024, B, formats[tu_below(&rng, 4)], formats[tu_below(&rng, 4)]);
  const uint32_t tokens[B] = {64 + tu_below(&rng, 100), 1 + tu_below(&rng, 20), 0};
  const bool masked = tu_below(&rng, 2) != 0;
  print_message("head_dim %u, K %s, V %s, new tokens %u and %u, %s\n", D, pkv_format_name(d.k_format),
                pkv_format_name(d.v_format), tokens[0], tokens[1], masked ? "tree mask" : "causal");

  const Driver *cu = driver_or_skip(PKV_BACKEND_CUDA);
  EngineStream e(*cu, PKV_BACKEND_CUDA);
  DeviceMemory &mem = e.mem;
  pkv_pool *pool;
  CHECK_OK(pkv_pool_create(e.ctx, &d, &pool));
  pkv_seq seqs[B];
  uint32_t n[B], offsets[B + 1] = {0};
  for (uint32_t b = 0; b < B; b++) {
    CHECK_OK(pkv_seq_alloc(pool, &seqs[b]));
    n[b] = tokens[b] + tu_below(&rng, 300);
    offsets[b + 1] = offsets[b] + tokens[b];
  }
  grow(pool, seqs, n, B, L, KV * D, &rng);

  // A tree: new token i sees itself and a random choice of the earlier ones.
  std::vector<uint8_t> mask;
  uint64_t mask_offsets[B];
  for (uint32_t b = 0; b < B; b++) {
    const uint32_t t = tokens[b], row = (t + 7) / 8;
    mask_offsets[b] = mask.size();
    mask.resize(mask.size() + size_t(t) * row);
    uint8_t *m = mask.data() + mask_offsets[b];
    for (uint32_t i = 0; i < t; i++)
      for (uint32_t j = 0; j <= i; j++)
        if (j == i || tu_below(&rng, 2)) m[i * row + j / 8] |= uint8_t(1u << (j % 8));
  }

  const size_t rows = size_t(offsets[B]) * Q, out_n = rows * D;
  std::vector<float> q(out_n), poison(out_n, NAN), host_out(out_n), host_lse(rows);
  tu_fill_uniform(&rng, q.data(), q.size(), -2, 2);
  void *graph_out[L], *graph_lse[L], *direct_out = mem.alloc(out_n * 4), *direct_lse = mem.alloc(rows * 4);
  for (uint32_t layer = 0; layer < L; layer++) {
    graph_out[layer] = mem.upload(poison.data(), out_n * 4);
    graph_lse[layer] = mem.upload(poison.data(), rows * 4);
  }
  pkv_extend_args a = pu_extend_args(0, seqs, B, Q, offsets, mem.upload(q.data(), out_n * 4), direct_out,
                                     static_cast<float *>(direct_lse));
  a.memory = PKV_MEMORY_DEVICE;
  if (masked) {
    a.mask = mask.data();
    a.mask_offsets = mask_offsets;
    a.mask_bytes = mask.size();
  }
  pkv_extend_args h = a; // the same from host memory
  h.memory = PKV_MEMORY_HOST;
  h.q = q.data(), h.out = host_out.data(), h.lse = host_lse.data();

  // Once directly; then, the sequences grown, a capture is refused until pkv_extend_prepare, and
  // one from host memory always.
  CHECK_OK(pkv_extend(pool, &a));
  grow(pool, seqs, tokens, B, L, KV * D, &rng);
  std::string text;
  pu_assert_fails(e.extend_captured(pool, a, &text), PKV_ERR_INVALID_ARGUMENT);
  if (text.find("pkv_extend_prepare") == std::string::npos) fail_msg("the refusal does not say why: %s", text.c_str());
  CHECK_OK(pkv_extend_prepare(pool, &a));
  pu_assert_fails(e.extend_captured(pool, h, &text), PKV_ERR_INVALID_ARGUMENT);
  check_cu(*cu, cu->cuStreamBeginCapture(e.stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  for (uint32_t layer = 0; layer < L; layer++) {
    a.layer = layer;
    a.out = graph_out[layer];
    a.lse = static_cast<float *>(graph_lse[layer]);
    if (pkv_extend(pool, &a) != PKV_OK) {
      CUgraph broken;
      cu->cuStreamEndCapture(e.stream, &broken);
      fail_msg("extend while capturing: %s", pkv_last_error());
    }
  }
  CUgraph graph;
  CUgraphExec exec;
  check_cu(*cu, cu->cuStreamEndCapture(e.stream, &graph), "cuStreamEndCapture");
  check_cu(*cu, cu->cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiateWithFlags");

  for (int round = 0; round < 4; round++) {
    for (uint32_t b = 0; b < B; b++) n[b] = tu_below(&rng, round == 0 ? 8 : 600);
    grow(pool, seqs, n, B, L, KV * D, &rng);
    grow(pool, seqs, tokens, B, L, KV * D, &rng);
    pu_assert_fails(e.extend_captured(pool, a, &text), PKV_ERR_INVALID_ARGUMENT);
    CHECK_OK(pkv_extend_prepare(pool, &a));
    check_cu(*cu, cu->cuGraphLaunch(exec, e.stream), "cuGraphLaunch");
    for (uint32_t layer = 0; layer < L; layer++) {
      a.layer = h.layer = layer;
      a.out = direct_out;
      a.lse = static_cast<float *>(direct_lse);
      CHECK_OK(pkv_extend(pool, &a));
      CHECK_OK(pkv_context_synchronize(e.ctx));
      const std::vector<float> got = mem.download<float>(graph_out[layer], out_n);
      const std::vector<float> got_lse = mem.download<float>(graph_lse[layer], rows);
      for (float x : got)
        if (std::isnan(x)) fail_msg("round %d layer %u: the replay left an output unwritten", round, layer);
      if (std::memcmp(got.data(), mem.download<float>(direct_out, out_n).data(), out_n * 4) != 0 ||
          std::memcmp(got_lse.data(), mem.download<float>(direct_lse, rows).data(), rows * 4) != 0)
        fail_msg("round %d layer %u: the replayed extend differs from a direct extend", round, layer);
      CHECK_OK(pkv_extend(pool, &h));
      if (std::memcmp(host_out.data(), got.data(), out_n * 4) != 0 ||
          std::memcmp(host_lse.data(), got_lse.data(), rows * 4) != 0)
        fail_msg("round %d layer %u: an extend from host memory differs from the replay", round, layer);
      check_cu(*cu, cu->cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(graph_out[layer]), poison.data(), out_n * 4,
                                          e.stream), "cuMemcpyHtoDAsync");
      CHECK_OK(pkv_context_synchronize(e.ctx));
    }
  }
  cu->cuGraphExecDestroy(exec);
  cu->cuGraphDestroy(graph);
  CHECK_OK(pkv_pool_destroy(pool));
}

// Decodes two sequences of `n` tokens (fresh random K/V and q) of a pool made by `d` into
// NaN-poisoned device memory, which must be written in full; then the same decode while the stream
// captures must be refused as unsupported, with a text containing `why`.
void capture_is_refused(EngineStream &e, const pkv_pool_desc &d, const uint32_t n[2], const char *why, tu_rng *rng) {
  enum : uint32_t { B = 2, Q = 8 };
  pkv_pool *pool;
  CHECK_OK(pkv_pool_create(e.ctx, &d, &pool));
  pkv_seq seqs[B];
  for (pkv_seq &s : seqs) CHECK_OK(pkv_seq_alloc(pool, &s));
  grow(pool, seqs, n, B, d.layers, d.kv_heads * d.head_dim, rng);

  std::vector<float> q(size_t(B) * Q * d.head_dim), poison(q.size(), NAN);
  tu_fill_uniform(rng, q.data(), q.size(), -2, 2);
  void *device_q = e.mem.upload(q.data(), q.size() * 4);
  pkv_decode_args a = pu_decode_args(0, seqs, B, Q, device_q, e.mem.upload(poison.data(), poison.size() * 4), nullptr);
  a.memory = PKV_MEMORY_DEVICE;
  CHECK_OK(pkv_decode(pool, &a));
  CHECK_OK(pkv_context_synchronize(e.ctx));
  for (float x : e.mem.download<float>(a.out, q.size()))
    if (!std::isfinite(x)) fail_msg("the decode left an output unwritten");

  CHECK_OK(pkv_decode_prepare(pool, &a));
  std::string text;
  pu_assert_fails(e.decode_captured(pool, a, &text), PKV_ERR_UNSUPPORTED);
  if (text.find(why) == std::string::npos) fail_msg("the refusal does not say why: %s", text.c_str());

  // An extend of the sequences' last 1 and 70 tokens, on the decode kernels there: prepared, and its
  // capture refused the same way.
  const uint32_t offsets[B + 1] = {0, 1, 71};
  const size_t x_bytes = size_t(offsets[B]) * Q * d.head_dim * 4;
  pkv_extend_args x = pu_extend_args(0, seqs, B, Q, offsets, e.mem.alloc(x_bytes), e.mem.alloc(x_bytes), nullptr);
  x.memory = PKV_MEMORY_DEVICE;
  CHECK_OK(pkv_extend_prepare(pool, &x));
  pu_assert_fails(e.extend_captured(pool, x, &text), PKV_ERR_UNSUPPORTED);
  if (text.find(why) == std::string::npos) fail_msg("the extend's refusal does not say why: %s", text.c_str());
  CHECK_OK(pkv_pool_destroy(pool));
}

// The HIP backend has no decode kernel a graph can replay (only the tensor-core one, CUDA-only, can).
// Runs on the HIP stand-in, whose streams are the CUDA driver's, so the capture is begun with the
// CUDA driver.
void capture_refused_on_hip(void **) {
  tu_rng rng = tu_rng_make(tu_seed());
  EngineStream e(*driver_or_skip(PKV_BACKEND_HIP), PKV_BACKEND_HIP);
  const uint32_t n[2] = {20, 100};
  capture_is_refused(e, pu_desc(1, 2, 128, 16, 64, 2, PKV_FORMAT_F16, PKV_FORMAT_Q8_0), n, "the HIP backend has none",
                     &rng);
}

// Where a block of the tensor-core kernel does not fit the device's shared memory (head_dim 256 on
// sm_86/sm_89's 99 KB, stood in for by PKV_SHARED_LIMIT), the CUDA-core kernel decodes, and a
// capture is refused. Last in the list: a failure leaves the variable set.
void tensor_core_kernel_needs_its_shared_memory(void **) {
  tu_rng rng = tu_rng_make(tu_seed());
  const Driver *cu = driver_or_skip(PKV_BACKEND_CUDA);
  tu_set_env("PKV_SHARED_LIMIT", "101376"); // sm_86/sm_89: 99 KB a block
  {
    EngineStream e(*cu, PKV_BACKEND_CUDA);
    const uint32_t n[2] = {1 + tu_below(&rng, 50), 200 + tu_below(&rng, 1500)};
    capture_is_refused(e, pu_desc(1, 2, 256, 16, 256, 2, PKV_FORMAT_F16, PKV_FORMAT_F16), n, "shared memory", &rng);
  }
  tu_set_env("PKV_SHARED_LIMIT", nullptr);
}

} // namespace

int main() {
  const struct CMUnitTest tests[] = {cmocka_unit_test(device_pointers_match_host_pointers),
                                     cmocka_unit_test(images_in_device_and_pinned_memory),
                                     cmocka_unit_test(captured_decode_replays_after_the_batch_grows),
                                     cmocka_unit_test(captured_extend_replays_after_the_batch_grows),
                                     cmocka_unit_test(capture_refused_on_hip),
                                     cmocka_unit_test(tensor_core_kernel_needs_its_shared_memory)};
  return tu_run_tests(tests, nullptr, nullptr);
}
