// The tensor-core split-K decode (sm_80 and newer), one kernel per head_dim 64/128/256 and K/V format
// pair. A work item is (chunk, KV head, tile of query rows: the GQA group's heads times the query
// tokens); blocks take items in turn, so any grid covers any plan (a captured launch replays
// correctly after the plan changes).
//  - K/V rows stream through shared-memory stages of 64 tokens: on sm_90 float rows by bulk copies
//    of 8 rows (an eighth of the stage that lies in one page piece) or of one row, the others with
//    16-byte cp.async; where K and V are both quantized each warp copies the rows it computes, and
//    a round waits for its own warps only.
//    A block serves one narrow tile of 8 query rows (speculative tokens times the GQA group) or 1 or
//    2 wide tiles of 16, with 4 warps each, a warp taking 16 tokens of every stage (Narrow and Wide
//    below), or on sm_90a 32 rows as one warpgroup (Group). Rows past the chunk are zero-filled, so
//    every MMA input is finite.
//  - Scores S = Q K^T and the output O = P V run on the tensor cores with fp32 accumulation. Float
//    operands keep ~16-22 bits by splitting: q (and P) are sums of two f16 (F16 pages) or bf16 parts,
//    each multiplied against the exact page values; q in the pages' own format enters whole.
//  - Q8_0/Q4_0 K: q is quantized to int8 per 32-group once per item, in two parts (the second
//    quantizes the first's error), and dotted as int8 (m16n8k32), scaled per (row, group) and
//    (token, group) in fp32. Matrix loads give the K bytes in the MMA's layout.
//  - Q8_0/Q4_0 V: the integers go to the MMA exactly (f16); each token's group scale multiplies P
//    instead, and P is one f16 part where K is quantized too (then scaled in f16). Transposing
//    matrix loads give each thread two tokens' bytes of a few values, which become f16 pairs by a
//    logic operation and a subtraction; the output columns follow those values (pair_value), and the
//    final write puts them in place.
//  - scores are in log2 units (scale * log2 e multiplies q, or the scores where q enters whole); the
//    warps' partial results combine in shared memory; a split sequence's last finishing chunk merges
//    all its chunks (a counter per sequence, KV head and row tile), in chunk order, so results are the
//    same bits every run.
#include <math.h>
#include <stddef.h>

#include <type_traits>

#include "device_format.cuh"

using namespace pkv_dev;

namespace {

constexpr int WARPS = PKV_MMA_WARPS, THREADS = WARPS * 32; // per tile of query rows
constexpr int SUB = PKV_MMA_TOKENS;   // tokens per warp per stage
constexpr int TILE = WARPS * SUB;     // tokens per stage
static_assert(THREADS == 2 * TILE, "a row tile's threads copy a stage: half K rows, half V rows");

__device__ __forceinline__ void cp_async_zfill(void *smem, const void *global, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global), "r"(src_bytes));
}
template <int BYTES> __device__ __forceinline__ void cp_async_small_zfill(void *smem, const void *global, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? BYTES : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(global), "n"(BYTES), "r"(src_bytes));
}
// Bulk copies (sm_90): one instruction moves a whole row into shared memory and completes on an
// mbarrier, which counts the bytes it expects. They need fewer L2 requests than 16-byte cp.async
// pieces: float head_dim 128 5-8% faster on the H200, 256 0-5% (docs/perf/2026-12-01-h200-cuda-bulk.md).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkCopies = true;
#else
constexpr bool kBulkCopies = false;
#endif
// [[maybe_unused]]: GPUs before sm_90 compile none of their callers.
#define PKV_BULK_HELPER [[maybe_unused]] __device__ __forceinline__
PKV_BULK_HELPER unsigned smem_addr(const void *p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
PKV_BULK_HELPER void mbar_init(uint64_t *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
PKV_BULK_HELPER void mbar_arrive(uint64_t *bar, unsigned tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(tx_bytes)
               : "memory");
}
PKV_BULK_HELPER void mbar_wait(uint64_t *bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
}
// Orders this thread's shared-memory writes before later bulk copies into the same bytes.
PKV_BULK_HELPER void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
PKV_BULK_HELPER void bulk_copy(void *smem, const void *global, unsigned bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(global), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
#undef PKV_BULK_HELPER
// The old value; the add releases this thread's earlier writes (and those a barrier ordered before
// it) to the GPU and acquires what other blocks released with theirs.
__device__ __forceinline__ uint32_t atomic_add_acq_rel(uint32_t *p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// N (2 or 4) 8x8 matrices of 16-bit values, lanes 8i .. 8i + 7 giving the rows of matrix i: lane
// (g, t) receives row g, columns 2t, 2t + 1 of each, or with TRANS rows 2t, 2t + 1 of column g.
template <int N, bool TRANS> __device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void *smem) {
  static_assert(N == 2 || N == 4, "two or four matrices");
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (N == 4 && TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else if constexpr (N == 4)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// The transpose of an 8x8 matrix of 16-bit pairs held as one fragment (lane (g, t): row g, columns
// 2t, 2t + 1).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// d += a b for one 16x8 tile, 16-bit float inputs (f16 when F16, else bf16).
template <bool F16> __device__ __forceinline__ void mma16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = c + a b for one 16x8 tile of int8 inputs, k = 32.
__device__ __forceinline__ void mma_s8(int d[4], const uint32_t a[4], uint32_t b0, uint32_t b1, const int c[4]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%10,%11,%12,%13};\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]),
                 "r"(c[3]));
}

// Two floats as a packed pair of 16-bit floats (x low, y high), rounded: one conversion for both.
template <bool F16> __device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (F16) {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t *>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t *>(&h);
  }
}

// Splits x and y into hi + lo 16-bit parts each and packs them (x low, y high): hi[0] the high parts,
// hi[stride] the low ones. bf16: hi rounded, read back by a shift. f16: hi keeps 11 significant bits
// (Veltkamp's split, explicitly rounded operations), so it converts exactly; lo is the remainder.
// Two conversions a pair either way (the conversion unit is the scarce one).
template <bool F16> __device__ __forceinline__ void split_pair(float x, float y, uint32_t *out, int stride) {
  float hx, hy;
  if constexpr (F16) {
    const float tx = __fmul_rn(x, 8193.0f), ty = __fmul_rn(y, 8193.0f); // 2^13 + 1: keeps 24 - 13 bits
    hx = __fsub_rn(tx, __fsub_rn(tx, x));
    hy = __fsub_rn(ty, __fsub_rn(ty, y));
    out[0] = pack2<true>(hx, hy);
  } else {
    const uint32_t h = pack2<false>(x, y);
    out[0] = h;
    hx = __uint_as_float(h << 16);
    hy = __uint_as_float(h & 0xffff0000u);
  }
  out[stride] = pack2<F16>(__fsub_rn(x, hx), __fsub_rn(y, hy));
}
// x and y in PARTS packed 16-bit parts: one rounded pair, or split_pair's two.
template <bool F16, int PARTS> __device__ __forceinline__ void pair_parts(float x, float y, uint32_t *out, int stride) {
  static_assert(PARTS == 1 || PARTS == 2, "one or two parts");
  if constexpr (PARTS == 1) out[0] = pack2<F16>(x, y);
  else split_pair<F16>(x, y, out, stride);
}

constexpr bool quantized_format(uint32_t f) { return f == Q8_0 || f == Q4_0; }

// Which of a stage's TILE tokens the warps' MMA rows take. SPREAD (K or V rows are float): the eight
// rows one matrix load reads are eight tokens apart, in eight blocks of Row's layout: row m of warp
// w is token 8 (m % 8) + 2 w + m / 8. Otherwise in order: token 16 w + m (the quantized kernels,
// bound by their instructions, measured 1-3% slower with rows spread and padded on the H200:
// docs/perf/2026-12-01-h200-cuda-blocks.md).
template <bool SPREAD> struct Tokens {
  static constexpr bool spread = SPREAD;
  __device__ static uint32_t warp_first(int w) { return SPREAD ? 2 * w : SUB * w; }
  // of_row(a + b) = of_row(a) + of_row(b) while a % 8 + b % 8 < 8: the masks take a thread's part once.
  __device__ static uint32_t of_row(int m) { return SPREAD ? 8 * (m % 8) + m / 8 : m; }
};

template <uint32_t F, int D, bool SPREAD> struct Row {
  static constexpr uint32_t format = F;
  static constexpr bool quantized = quantized_format(format);
  static constexpr uint32_t data = F == Q8_0 ? D : F == Q4_0 ? D / 2 : 2 * D;
  static constexpr uint32_t scales = quantized ? D / 32 * 2 : 0;
  // Float rows as the page holds them, by token, in blocks of 8 (an eighth of the stage, often 8
  // rows of one page, copied whole) each followed by 16 bytes of padding: the eight rows a matrix
  // load reads are in eight blocks, so in different banks. Quantized rows (data then scales, padded
  // to an odd number of 16-byte units, so the 8 rows a matrix load reads fall in different banks)
  // by MMA row: warp w's row m at slot 16 w + m.
  static constexpr uint32_t units = (data + scales + 15) / 16;
  static constexpr uint32_t stride = quantized ? (units % 2 ? units : units + 1) * 16 : data;
  static constexpr uint32_t block = quantized ? 8 * stride : 8 * stride + 16;
  static constexpr uint32_t bytes = 8 * block;
  static_assert(bytes == pkv_mma_part_bytes(data + scales, quantized), "the host sizes shared memory alike");
  // Where the stage's token t lies in its part (quantized: its slot is SPREAD's inverse).
  __device__ static uint32_t of_token(uint32_t t) {
    if constexpr (!quantized) return t / 8 * block + t % 8 * stride;
    return (SPREAD ? SUB * (t % 8 / 2) + 8 * (t % 2) + t / 8 : t) * stride;
  }
  // Where warp w's rows begin in a stage part.
  __device__ static const uint8_t *warp_rows(const uint8_t *part, int w) {
    return part + (quantized ? 2 * block : 2 * stride) * w;
  }
  // MMA row r + 8 h (r < 8, h < 2): callers give the parts, which no division need recover.
  __device__ static const uint8_t *row(const uint8_t *rows, int r, int h) {
    return rows + (quantized ? h * block + r * stride : r * block + h * stride);
  }
  __device__ static float scale(const uint8_t *row, int group) {
    return half_to_float(reinterpret_cast<const uint16_t *>(row + data)[group]);
  }
  // All of a row's group scales in one shared-memory load (D / 16 bytes); group g's is at(g).
  struct Scales {
    static constexpr int N = (D / 32 + 1) / 2; // words, two f16 scales each
    uint32_t w[N];
    __device__ float at(int g) const { return half_to_float(uint16_t(w[g / 2] >> (16 * (g % 2)))); }
    __device__ uint32_t pair(int g) const { return __byte_perm(w[g / 2], 0, g % 2 ? 0x3232 : 0x1010); } // (at(g), at(g)) in f16
  };
  __device__ static Scales scales_of(const uint8_t *row) {
    Scales s;
    const uint32_t *p = reinterpret_cast<const uint32_t *>(row + data);
    if constexpr (Scales::N == 4) *reinterpret_cast<uint4 *>(s.w) = *reinterpret_cast<const uint4 *>(p);
    else if constexpr (Scales::N == 2) *reinterpret_cast<uint2 *>(s.w) = *reinterpret_cast<const uint2 *>(p);
    else s.w[0] = p[0];
    return s;
  }
};

// A warp's 16 quantized rows (R) of one 32-value group by matrix loads: w[h][i] holds bytes
// [16 i, 16 i + 16) of the group (Q8_0; Q4_0's group is its 16 bytes, i = 0) of MMA rows 8h .. 8h + 7;
// lane (c, t) gets bytes 4t .. 4t + 3 of row c, or TRANS, bytes 2c, 2c + 1 of rows 2t and 2t + 1
// (the first row's in the low half). Q4_0 byte j holds value j in its low nibble and value j + 16 in
// its high one, each stored plus 8.
template <class R, bool TRANS>
__device__ __forceinline__ void group_words(const uint8_t *rows, int g, int lane, uint32_t (&w)[2][2]) {
  const uint8_t *row = R::row(rows, lane % 8, (lane / 8) % 2);
  if constexpr (R::format == Q8_0) { // two matrices a row
    uint32_t x[4];
    ldmatrix<4, TRANS>(x, row + 32 * g + 16 * (lane / 16));
    w[0][0] = x[0], w[1][0] = x[1], w[0][1] = x[2], w[1][1] = x[3];
  } else {
    uint32_t x[2];
    ldmatrix<2, TRANS>(x, row + 16 * g);
    w[0][0] = x[0], w[1][0] = x[1], w[0][1] = w[1][1] = 0;
  }
}
// (x & M) ^ C (XOR) or (x & M) | C; ONE: as one LOP3 (ptxas keeps C in a register for the loop;
// written in C it takes two LOP3s with an immediate each).
template <uint32_t M, uint32_t C, bool XOR, bool ONE> __device__ __forceinline__ uint32_t mask_then(uint32_t x) {
  if constexpr (!ONE) return XOR ? (x & M) ^ C : (x & M) | C;
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(y) : "r"(x), "n"(M), "n"(C), "n"(XOR ? 0x6a : 0xea));
  return y;
}
// K as int8 MMA operands: w[h][i] holds values 16 i + 4t .. 16 i + 4t + 3 of MMA row c + 8h, a byte
// each; Q4_0's as 16 times the value: a nibble n (the value n - 8) in a byte's high half with its top
// bit flipped is 16 (n - 8) in two's complement, one logic op (after a shift for a low nibble), so
// the dot products need no correction for the 8 (q's scale carries the 1/16).
template <class R> __device__ __forceinline__ void k_group(const uint8_t *rows, int g, int lane, uint32_t (&w)[2][2]) {
  group_words<R, false>(rows, g, lane, w);
  if constexpr (R::format == Q4_0)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      w[h][1] = mask_then<0xf0f0f0f0u, 0x80808080u, true, true>(w[h][0]);
      w[h][0] = mask_then<0xf0f0f0f0u, 0x80808080u, true, true>(w[h][0] << 4);
    }
}
// Quantized values as an f16 pair, exactly: V's value pair_value(c, j) of the two tokens in
// group_words<R, true>'s w[h] (K's in Narrow's f16 path, from group_words<R, false>), without a
// conversion instruction: a mask and a logic operation put the value into an f16 whose
// mantissa counts it (0x64nn = 1024 + nn: Q8_0 its byte with the sign bit flipped, nn = value + 128;
// a low Q4_0 nibble n; 0x54n0 = 64 + n for a high nibble left in place: 64's mantissa counts
// sixteenths), one f16 subtraction leaves the value. The masking in one instruction measured 1-3%
// faster where V is Q4_0 at head_dim 128 (the narrow loop 548 -> 515 instructions), but 5% slower
// for Q4_0 at 256 (8x32K), which ptxas then schedules worse, and mixed for Q8_0 (-1.5% to +5%; H200,
// docs/perf/2026-12-02-h200-cuda-session14.md).
template <uint32_t F, int D> __device__ __forceinline__ uint32_t pair_f16(const uint32_t (&w)[2], int j) {
  constexpr bool ONE = F == Q4_0 && D == 128;
  const uint32_t x = (F == Q8_0 ? w[j % 2] : w[0]) >> (8 * (j / 2));
  uint32_t y, bias;
  if (F == Q8_0) y = mask_then<0x00ff00ffu, 0x64806480u, true, ONE>(x), bias = 0x64806480u; // 1152 = 1024 + 128
  else if (j % 2 == 0) y = mask_then<0x000f000fu, 0x64006400u, false, ONE>(x), bias = 0x64086408u; // 1032 = 1024 + 8
  else y = mask_then<0x00f000f0u, 0x54005400u, false, ONE>(x), bias = 0x54805480u;               // 72 = 64 + 8
  const __half2 v = __hsub2(*reinterpret_cast<const __half2 *>(&y), *reinterpret_cast<const __half2 *>(&bias));
  return *reinterpret_cast<const uint32_t *>(&v);
}
// Which of its group's values pair_f16(w, j) gives the thread with c = lane / 4.
__device__ __forceinline__ int pair_value(int c, int j) { return 2 * c + 16 * (j % 2) + j / 2; }

// Each pair of tokens' V scales for group c (= lane / 4) where group_words' words hold the tokens'
// values: s[h] = (scale of token 2t (+ 8h), of 2t + 1), an f16 pair; a group's pairs are then a
// shuffle away (group_scales).
template <class R> __device__ __forceinline__ void pair_scales(const uint8_t *rows, int lane, uint32_t (&s)[2]) {
  static_assert(R::stride - R::data >= 16, "a matrix row from the scales stays within the row slot");
  ldmatrix<2, true>(s, R::row(rows, lane % 8, (lane / 8) % 2) + R::data);
}
__device__ __forceinline__ uint32_t group_scales(uint32_t s, int g, int lane) {
  return __shfl_sync(0xffffffffu, s, 4 * g + lane % 4);
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  const __half2 v = __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b));
  return *reinterpret_cast<const uint32_t *>(&v);
}

// Where token t0 + r of a stage lies: the part of its page in the layer (the layer's first part
// when there is nothing to read: past the chunk, or a corrupted table entry) and its row there.
// Looked up once per token and stage, a stage ahead, so queuing a stage's copies waits on no load.
struct alignas(16) StageRow {
  const uint8_t *part;
  uint32_t row, read; // one of the values below
  // kNone: the row stays zero; kRow: the row is read; kEighth: the row and the rest of its eighth of
  // the stage, 8 rows of one page in order (one bulk copy).
  enum : uint32_t { kNone = 0, kRow = 1, kEighth = 3 };
  // One 16-byte shared-memory load (a copy of the struct takes two).
  __device__ static StageRow load(const StageRow *p) {
    const uint4 w = *reinterpret_cast<const uint4 *>(p);
    return {reinterpret_cast<const uint8_t *>(uint64_t(w.y) << 32 | w.x), w.z, w.w};
  }
};
static_assert(sizeof(StageRow) == 16 && offsetof(StageRow, row) == 8, "StageRow::load's layout");

// Queues NR rows of a stage from `first` on into shared memory, for each of PARTS parts of the same
// layout (K's rows, or V's: offset k_bytes into the block), NT threads (j: this one): TPR threads per
// row take its 16-byte pieces in turn, so a thread computes the addresses of its rows and issues all
// of its copies from them with constant offsets. A warp instruction reads whole 128-byte lines (TPR *
// 16 bytes of a row, or whole rows when shorter): the L2 serves a line as one request; half lines
// double the requests, and the L2 becomes the limit. Quantized rows' scales: copy_scales.
template <class R, int NT, int NR, int PARTS>
__device__ __forceinline__ void copy_rows(uint8_t *const (&dst)[PARTS], const uint64_t (&part_offset)[PARTS],
                                          const StageRow *rows, int first, int j) {
  constexpr int P = R::data / 16, TPR = P < 8 ? P : 8, STEP = NT / TPR, N = NR / STEP;
  static_assert(NT % TPR == 0 && NR % STEP == 0, "the threads cover whole rows");
  const int p0 = j % TPR;
  StageRow s[N]; // all loaded first: the copies then wait on no shared-memory load
#pragma unroll
  for (int i = 0; i < N; i++) s[i] = StageRow::load(&rows[first + j / TPR + STEP * i]);
#pragma unroll
  for (int i = 0; i < N; i++) {
    const uint8_t *src = s[i].part + uint64_t(s[i].row) * R::data + p0 * 16;
    const uint32_t d = R::of_token(first + j / TPR + STEP * i) + p0 * 16;
#pragma unroll
    for (int part = 0; part < PARTS; part++)
#pragma unroll
      for (int k = 0; k < P / TPR; k++)
        cp_async_zfill(dst[part] + d + TPR * 16 * k, src + part_offset[part] + TPR * 16 * k,
                       s[i].read != StageRow::kNone);
  }
}
// Queues a row's BYTES of scales to `dst` from the scales at `offset` in its page part.
template <uint32_t BYTES> __device__ __forceinline__ void copy_scales(uint8_t *dst, const StageRow *row, uint64_t offset) {
  const StageRow s = StageRow::load(row);
  cp_async_small_zfill<BYTES>(dst, s.part + offset + uint64_t(s.row) * BYTES, s.read != StageRow::kNone);
}

// Queues float row i of a stage with bulk copies completing on `bar`: an eighth of the stage read
// from one page is one copy, by its first row's thread; otherwise each row is (zeros when there is
// nothing to read). Every copying thread arrives once.
template <class R>
__device__ __forceinline__ void bulk_row(uint8_t *dst, const StageRow *rows, uint64_t part_offset, int i, uint64_t *bar) {
  const StageRow s = StageRow::load(&rows[i]);
  uint8_t *d = dst + R::of_token(i);
  if (s.read == StageRow::kEighth) {
    const bool mine = i % 8 == 0;
    mbar_arrive(bar, mine ? 8 * R::data : 0);
    if (mine) bulk_copy(d, s.part + part_offset + uint64_t(s.row) * R::data, 8 * R::data, bar);
  } else if (s.read != StageRow::kNone) {
    mbar_arrive(bar, R::data);
    bulk_copy(d, s.part + part_offset + uint64_t(s.row) * R::data, R::data, bar);
  } else {
#pragma unroll
    for (uint32_t b = 0; b < R::data; b += 16) *reinterpret_cast<uint4 *>(d + b) = make_uint4(0, 0, 0, 0);
    mbar_arrive(bar, 0);
  }
}

// 2^x with results below 2^-126 flushed to zero (one MUFU instruction; exp2f adds three more a call to
// keep subnormal results, which no weight here needs).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax over a warp's 16 tokens of a stage, NE scores a thread: score e belongs to the
// thread's row row_of(e) (of NR) and to token token_of(e). MASK: hides what a row may not see (tokens
// past the chunk, past a speculative token's position, every token from a padding row), and leaves
// the weights P = 2^(s - m) in s. LAZY: a row's base m moves only when a score passes it, to that
// stage's max (`reduce` takes the max over the lanes that share the row) plus kMaxSlack; else it is
// the running max, reduced every stage. The output is rescaled through rescale(correction) when a
// base moves. Weights stay at most 1 either way; lazily, most stages, whose scores stay under the
// base, take no reduction over the lanes (a serial chain of shuffles) and no exponential of a
// correction, only a vote before them (where a stage's time is its serial chain, as in the float
// narrow tile at one block a multiprocessor, that measured 1-2% slower than reducing every stage).
constexpr float kMaxSlack = 1.0f; // log2 units
template <bool MASK, bool LAZY, int NE, int NR, class RowOf, class TokenOf, class Reduce, class Rescale>
__device__ __forceinline__ void online_softmax(float (&s)[NE], float (&m)[NR], float (&l)[NR], const uint32_t (&visible)[NR],
                                               uint32_t token_end, RowOf row_of, TokenOf token_of, Reduce reduce,
                                               Rescale rescale) {
  float tile_max[NR];
  bool passed = false, moved = false;
#pragma unroll
  for (int i = 0; i < NR; i++) tile_max[i] = -INFINITY;
#pragma unroll
  for (int e = 0; e < NE; e++) {
    if (MASK) {
      const uint32_t t = token_of(e);
      s[e] = t < token_end && t < visible[row_of(e)] ? s[e] : -INFINITY;
    }
    tile_max[row_of(e)] = fmaxf(tile_max[row_of(e)], s[e]);
  }
#pragma unroll
  for (int i = 0; i < NR; i++) passed |= tile_max[i] > m[i];
  if (!LAZY || __any_sync(0xffffffffu, passed)) {
    float correction[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) {
      const float top = reduce(tile_max[i]), m_new = top > m[i] ? top + (LAZY ? kMaxSlack : 0.0f) : m[i];
      // 1 where the base stays (a row that has seen nothing, a padding row of the tile, too).
      correction[i] = m_new == m[i] ? 1.0f : exp2_ftz(m[i] - m_new);
      moved |= correction[i] != 1.0f;
      m[i] = m_new;
      l[i] *= correction[i];
    }
    if (LAZY || __any_sync(0xffffffffu, moved)) rescale(correction);
  }
#pragma unroll
  for (int e = 0; e < NE; e++) {
    s[e] = exp2_ftz(s[e] - (m[row_of(e)] == -INFINITY ? 0.0f : m[row_of(e)])); // nothing seen yet: weights 0
    l[row_of(e)] += s[e];
  }
}

// The max (or sum) of x over the lanes whose lane bits outside `MASK` agree.
template <int MASK> __device__ __forceinline__ float lanes_max(float x) {
#pragma unroll
  for (int b = 1; b < 32; b *= 2)
    if (MASK & b) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, b));
  return x;
}
template <int MASK> __device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int b = 1; b < 32; b *= 2)
    if (MASK & b) x += __shfl_xor_sync(0xffffffffu, x, b);
  return x;
}

// Float K: how q enters the score MMAs. Where q's format is the pages' own 16-bit format, q goes
// unscaled in one part (exact) and the fp32 scores are multiplied by the scale; otherwise q times the
// scale is split into SPLIT parts (split) and `mul` is 1.
struct QParts {
  bool split;
  float mul;
};

// A warp's share of one stage, in one of two shapes. Both hold: ROWS query rows a tile; the output
// accumulators o (acc_row, acc_col: where each lies), the running max m and sum l of the thread's
// two rows (row_of_thread(lane, i), shared with the lanes differing in ROW_LANES); q_slot(r, k),
// where word k (of 8) of row r's 16 values (float K) or 32 values (quantized K) lies among a lane's
// QW words of a k-step's q fragment; stage(), which adds 16 tokens. Their comments number a warp's
// tokens by MMA row; Tokens says which of the stage's tokens each is.

// What both tile shapes share: the page rows' layouts and the steps over q.
template <int D, uint32_t KF, uint32_t VF> struct TileBase {
  using Tok = Tokens<!quantized_format(KF) || !quantized_format(VF)>;
  using K = Row<KF, D, Tok::spread>;
  using V = Row<VF, D, Tok::spread>;
  // Float operands that are not page values (q, P) go to the MMA as hi + lo parts, f16 or bf16.
  static constexpr int SPLIT = 2;
  // P enters the MMA as f16 where V is quantized (its integers too) or F16, else bf16; in one part
  // where K and V are quantized (q's and K's rounding move the logits far more than P's 11 bits do),
  // else SPLIT.
  static constexpr bool P_F16 = quantized_format(VF) || VF == F16;
  static constexpr int P_PARTS = quantized_format(KF) && quantized_format(VF) ? 1 : SPLIT;
  enum : int { KSTEPS = D / 16, GROUPS = D / 32 }; // 16-wide k-steps, 32-value groups
  // The narrow tile's base moves lazily (online_softmax) where a page format is quantized; the wide
  // tile's always.
  static constexpr bool LAZY_MAX = quantized_format(KF) || quantized_format(VF);
  static constexpr bool Q_F16 = false; // q in the layouts above (Narrow's many n-tiles: one f16 part)
  // Group: the block's warps compute a stage together (barriers a round, shared bases) and hold
  // one output, which the combine takes from the first warp's place.
  static constexpr bool GROUPED = false;
  static constexpr int COMBINE_WARPS = WARPS;
  static constexpr uint32_t SCRATCH_BYTES = 16; // Group's static shared memory (none used elsewhere)
};

// Wide: 16 query rows on the MMA's M dimension, tokens on N. For a tile of many rows (large GQA
// groups, speculative tokens): a thread holds rows gid, gid + 8.
template <int D, uint32_t KF, uint32_t VF> struct Wide : TileBase<D, KF, VF> {
  using B = TileBase<D, KF, VF>;
  using typename B::K, typename B::V, typename B::Tok, B::SPLIT, B::P_F16, B::P_PARTS, B::KSTEPS, B::GROUPS;
  static constexpr int ROWS = PKV_MMA_ROWS, QW = 4, NT = D / 8, MAX_TILES = 2; // row tiles a block
  static constexpr int TROWS = 2; // rows a thread holds
  float o[NT][4], m[TROWS], l[TROWS];

  __device__ static int row_of_thread(int lane, int i) { return lane / 4 + 8 * i; }
  static constexpr int ROW_LANES = 3; // the lane bits of the threads sharing a row
  // Word `reg` of lane (g, t) holds row g + 8 (reg & 1), values 2t, 2t + 1 (+ 8 when reg >= 2) of a
  // 16-wide k-step; for int8 k32 steps 4t .. 4t + 3 (+ 16).
  __device__ static int q_slot(int r, int k) { return ((r % 8) * 4 + k % 4) * QW + r / 8 + 2 * (k / 4); }
  // Quantized K: where word `slot` (q_slot) of part `part` of group g's q fragment lies: by part, then
  // lane (a lane's words one 16-byte read, a warp's reads contiguous); the rows whose q scales a
  // thread reads as one float4 (gid, gid + 8), and row r's place in it.
  __device__ static int q_word(int g, int part, int slot) { return (g * 2 + part) * 32 * QW + slot; }
  __device__ static int scale_pair(int r) { return r % 8; }
  __device__ static int scale_half(int r) { return r / 8; }

  template <bool MASK>
  __device__ void stage(const uint8_t *k_rows, const uint8_t *v_rows, const uint32_t *q_frag, const float *q_scale,
                        const QParts &qp, uint32_t t_warp, uint32_t token_end, const uint32_t (&visible)[2], int lane) {
    const int gid = lane / 4, tig = lane % 4;
    auto krow = [&](int r, int h) { return K::row(k_rows, r, h); };
    auto vrow = [&](int r, int h) { return V::row(v_rows, r, h); };
    // S for this warp's 16 tokens: s[4j + e], n-tile j holding tokens 8j .. 8j + 7; thread: rows
    // gid, gid + 8 (e / 2), tokens 8j + 2 tig, + 1 (e % 2).
    float s[8] = {};
    if constexpr (K::quantized) {
#pragma unroll
      for (int g = 0; g < GROUPS; g++) {
        uint32_t a[2][4];
#pragma unroll
        for (int part = 0; part < 2; part++) {
          const uint4 a4 = reinterpret_cast<const uint4 *>(q_frag)[(g * 2 + part) * 32 + lane];
          a[part][0] = a4.x, a[part][1] = a4.y, a[part][2] = a4.z, a[part][3] = a4.w;
        }
        const float2 qs = reinterpret_cast<const float2 *>(q_scale)[g * ROWS / 2 + gid]; // rows gid, gid + 8
        const int c[4] = {0, 0, 0, 0};
        uint32_t w[2][2];
        k_group<K>(k_rows, g, lane, w);
#pragma unroll
        for (int j = 0; j < 2; j++) {
          int acc[2][4];
          mma_s8(acc[0], a[0], w[j][0], w[j][1], c);
          mma_s8(acc[1], a[1], w[j][0], w[j][1], c);
          const float ks[2] = {K::scale(krow(2 * tig, j), g), K::scale(krow(2 * tig + 1, j), g)};
#pragma unroll
          for (int e = 0; e < 4; e++)
            s[4 * j + e] += float(acc[0][e] * 128 + acc[1][e]) * ((e / 2 ? qs.y : qs.x) * ks[e & 1]);
        }
      }
    } else {
      // Four accumulators per n-tile (q part x k-step parity): short dependency chains.
      float part[2][4][4] = {};
#pragma unroll
      for (int kk = 0; kk < KSTEPS; kk += 2) {
        uint32_t b[2][4]; // [n-tile][k-step kk, kk + 1 halves]
#pragma unroll
        for (int j = 0; j < 2; j++) ldmatrix<4, false>(b[j], krow(lane % 8, j) + (kk * 16 + (lane / 8) * 8) * 2);
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++) {
          if (sp && !qp.split) break;
#pragma unroll
          for (int half = 0; half < 2; half++) {
            const uint4 a4 = reinterpret_cast<const uint4 *>(q_frag)[(sp * KSTEPS + kk + half) * 32 + lane];
            const uint32_t a[4] = {a4.x, a4.y, a4.z, a4.w};
            mma16<KF == F16>(part[0][2 * sp + half], a, b[0][2 * half], b[0][2 * half + 1]);
            mma16<KF == F16>(part[1][2 * sp + half], a, b[1][2 * half], b[1][2 * half + 1]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          s[4 * j + e] = ((part[j][3][e] + part[j][2][e]) + (part[j][1][e] + part[j][0][e])) * qp.mul;
    }

    online_softmax<MASK, true>(
        s, m, l, visible, token_end, [](int e) { return (e / 2) % 2; },
        [t0 = t_warp + Tok::of_row(2 * tig)](int e) { return t0 + Tok::of_row(8 * (e / 4) + e % 2); },
        lanes_max<ROW_LANES>,
        [&](const float (&c)[2]) {
#pragma unroll
          for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[nt][e] *= c[e / 2];
        });

    // O += P V. P as an A-fragment: word 0 row gid tokens 2tig, +1; word 1 row gid + 8; words 2, 3
    // the same for tokens 8 + 2tig, + 1.
    if constexpr (V::quantized) {
      // Each token's group scale multiplies P: in f16, on P rounded once, where P is one part; else
      // in float before the split.
      uint32_t p[4], sc[2];
      if constexpr (P_PARTS == 1) {
        p[0] = pack2<true>(s[0], s[1]), p[1] = pack2<true>(s[2], s[3]);
        p[2] = pack2<true>(s[4], s[5]), p[3] = pack2<true>(s[6], s[7]);
        pair_scales<V>(v_rows, lane, sc);
      }
#pragma unroll
      for (int g = 0; g < GROUPS; g++) {
        uint32_t a[P_PARTS][4];
        if constexpr (P_PARTS == 1) {
#pragma unroll
          for (int i = 0; i < 4; i++) a[0][i] = hmul2(p[i], group_scales(sc[i / 2], g, lane));
        } else {
          float vs[4]; // tokens 2 tig + i % 2 (+ 8)
#pragma unroll
          for (int i = 0; i < 4; i++) vs[i] = V::scale(vrow(2 * tig + i % 2, i / 2), g);
          pair_parts<P_F16, P_PARTS>(s[0] * vs[0], s[1] * vs[1], &a[0][0], 4);
          pair_parts<P_F16, P_PARTS>(s[2] * vs[0], s[3] * vs[1], &a[0][1], 4);
          pair_parts<P_F16, P_PARTS>(s[4] * vs[2], s[5] * vs[3], &a[0][2], 4);
          pair_parts<P_F16, P_PARTS>(s[6] * vs[2], s[7] * vs[3], &a[0][3], 4);
        }
        uint32_t w[2][2];
        group_words<V, true>(v_rows, g, lane, w);
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const uint32_t b0 = pair_f16<VF, D>(w[0], j), b1 = pair_f16<VF, D>(w[1], j);
#pragma unroll
          for (int sp = 0; sp < P_PARTS; sp++) mma16<true>(o[4 * g + j], a[sp], b0, b1);
        }
      }
    } else {
      constexpr bool f16 = VF == F16;
      uint32_t a[SPLIT][4];
      split_pair<f16>(s[0], s[1], &a[0][0], 4);
      split_pair<f16>(s[2], s[3], &a[0][1], 4);
      split_pair<f16>(s[4], s[5], &a[0][2], 4);
      split_pair<f16>(s[6], s[7], &a[0][3], 4);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        uint32_t b[4];
        ldmatrix<4, true>(b, vrow(lane % 8, (lane / 8) % 2) + (nt + lane / 16) * 16);
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++) {
          mma16<f16>(o[nt], a[sp], b[0], b[1]);
          mma16<f16>(o[nt + 1], a[sp], b[2], b[3]);
        }
      }
    }
  }

  // Where accumulator e of o[n] lies: its query row and output column.
  __device__ static int acc_row(int lane, int, int e) { return lane / 4 + 8 * (e / 2); }
  __device__ static int acc_col(int lane, int, int n, int e) {
    const int c = 2 * (lane % 4) + (e & 1); // column within the n-tile
    return V::quantized ? (n / 4) * 32 + pair_value(c, n % 4) : n * 8 + c;
  }
};

// Narrow: query rows on the MMA's N dimension, NT n-tiles of 8, the warp's 16 tokens on M
// (S^T = K Q^T, O^T = V^T P^T). One n-tile serves the common decode of one token and a GQA group of
// up to 8: no MMA row is padding when the group is 8, and half the MMAs, scale products and softmax
// work of Wide. Two or four serve speculative tokens where K and V are quantized: each K and V
// fragment, converted once, serves every n-tile, where Wide converts it again for each row tile
// and each 16 rows. A thread holds tokens gid, gid + 8 of rows 8 nt + 2 tig, + 1; P goes back to the
// MMA as the B operand through a register transpose (movmatrix) of each 8x8 half.
//  - Quantized K with one n-tile: int8 MMAs against q's two int8 parts (TileBase). With more: each K
//    pair becomes f16 (pair_f16) times its token's group scale, dotted against q in one f16 part:
//    the int8 path's per-group scale products grow with the rows, this conversion does not (K's
//    values are rounded to f16 after scaling, q to f16: ~11 bits each, more than Q8_0/Q4_0 keep).
template <int D, uint32_t KF, uint32_t VF, int NT> struct Narrow : TileBase<D, KF, VF> {
  using B = TileBase<D, KF, VF>;
  using typename B::K, typename B::V, typename B::Tok, B::SPLIT, B::P_F16, B::P_PARTS, B::KSTEPS, B::GROUPS;
  static_assert(NT == 1 || (K::quantized && V::quantized), "several n-tiles where K and V are quantized");
  static constexpr int ROWS = PKV_MMA_NARROW_ROWS * NT, QW = 2, MT = D / 16, MAX_TILES = 1, TROWS = 2 * NT;
  static constexpr bool Q_F16 = NT > 1; // q in one f16 part (above), else as TileBase says
  // o[NT * mt + nt]: dims 16 mt + gid (+ 8 for e >= 2), rows 8 nt + 2 tig + e % 2; m, l: row_of_thread.
  float o[MT * NT][4], m[TROWS], l[TROWS];

  __device__ static int row_of_thread(int lane, int i) { return 8 * (i / 2) + 2 * (lane % 4) + i % 2; }
  static constexpr int ROW_LANES = 28; // the lane bits of the threads sharing a row
  // A B-fragment: word `reg` of lane (g, t) holds row g, values 2t, 2t + 1 (+ 8 when reg = 1) of a
  // 16-wide k-step; for int8 k32 steps 4t .. 4t + 3 (+ 16).
  __device__ static int q_slot(int r, int k) { return (r * 4 + k % 4) * QW + k / 4; }
  // As Wide, but a lane's two parts together (one 16-byte read); rows 2 tig, + 1 share a float4.
  __device__ static int q_word(int g, int part, int slot) { return ((g * 32 + slot / QW) * 2 + part) * QW + slot % QW; }
  __device__ static int scale_pair(int r) { return r / 2; }
  __device__ static int scale_half(int r) { return r % 2; }
  // Q_F16: where q's f16 pair of values 16 st + 4t + {b, b + 2} (st < 2, t < 4, b < 2) of group g of row
  // r lies: the two k-steps of a group's B-fragments a lane takes for one n-tile in one 16-byte read
  // (word 2 st + b): the values stage() puts at the same places of K's A-fragments.
  __device__ static int q_f16_word(int g, int r, int st, int t, int b) {
    return ((g * NT + r / 8) * 32 + (r % 8) * 4 + t) * 4 + 2 * st + b;
  }

  template <bool MASK>
  __device__ void stage(const uint8_t *k_rows, const uint8_t *v_rows, const uint32_t *q_frag, const float *q_scale,
                        const QParts &qp, uint32_t t_warp, uint32_t token_end, const uint32_t (&visible)[TROWS],
                        int lane) {
    const int gid = lane / 4, tig = lane % 4;
    auto krow = [&](int r, int h) { return K::row(k_rows, r, h); };
    auto vrow = [&](int r, int h) { return V::row(v_rows, r, h); };
    // S^T: s[4 nt + e] token gid + 8 (e / 2), row 8 nt + 2 tig + e % 2.
    float s[4 * NT] = {};
    if constexpr (K::quantized && Q_F16) {
      const typename K::Scales ks0 = K::scales_of(krow(gid, 0)), ks1 = K::scales_of(krow(gid, 1));
      float part[NT][2][4] = {}; // [n-tile][k-step parity]: short dependency chains
#pragma unroll
      for (int g = 0; g < GROUPS; g++) {
        uint32_t w[2][2];
        group_words<K, false>(k_rows, g, lane, w);
        const uint32_t sc0 = ks0.pair(g), sc1 = ks1.pair(g);
        uint4 b[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) b[nt] = reinterpret_cast<const uint4 *>(q_frag)[(g * NT + nt) * 32 + lane];
#pragma unroll
        for (int st = 0; st < 2; st++) {
          // Values 16 st + 4 tig + {0, 2} (a[0], a[1]) and + {1, 3} (a[2], a[3]) of tokens gid, gid + 8.
          const uint32_t a[4] = {hmul2(pair_f16<KF, D>(w[0], st), sc0), hmul2(pair_f16<KF, D>(w[1], st), sc1),
                                 hmul2(pair_f16<KF, D>(w[0], st + 2), sc0), hmul2(pair_f16<KF, D>(w[1], st + 2), sc1)};
#pragma unroll
          for (int nt = 0; nt < NT; nt++)
            mma16<true>(part[nt][st], a, st ? b[nt].z : b[nt].x, st ? b[nt].w : b[nt].y);
        }
      }
#pragma unroll
      for (int e = 0; e < 4 * NT; e++) s[e] = part[e / 4][0][e % 4] + part[e / 4][1][e % 4];
    } else if constexpr (K::quantized) {
      const typename K::Scales ks0 = K::scales_of(krow(gid, 0)), ks1 = K::scales_of(krow(gid, 1));
#pragma unroll
      for (int g = 0; g < GROUPS; g++) {
        uint32_t w[2][2];
        k_group<K>(k_rows, g, lane, w);
        const uint32_t a[4] = {w[0][0], w[1][0], w[0][1], w[1][1]};
        const uint4 b = reinterpret_cast<const uint4 *>(q_frag)[g * 32 + lane]; // both parts
        const float2 sb = reinterpret_cast<const float2 *>(q_scale)[g * ROWS / 2 + tig]; // rows 2 tig, + 1
        const int c[4] = {0, 0, 0, 0};
        int acc[2][4];
        mma_s8(acc[0], a, b.x, b.y, c);
        mma_s8(acc[1], a, b.z, b.w, c);
        const float ks[2] = {ks0.at(g), ks1.at(g)};
        const float scale[4] = {ks[0] * sb.x, ks[0] * sb.y, ks[1] * sb.x, ks[1] * sb.y};
#pragma unroll
        for (int e = 0; e < 4; e++) s[e] += float(acc[0][e] * 128 + acc[1][e]) * scale[e];
      }
    } else {
      float part[4][4] = {}; // [q part x k-step parity]: short dependency chains
#pragma unroll
      for (int kk = 0; kk < KSTEPS; kk++) {
        uint32_t a[4]; // tokens 0-7 / 8-15 (lanes 8-15, 24-31) at values +0 / +8 (lanes 16-31)
        ldmatrix<4, false>(a, krow(lane % 8, (lane / 8) % 2) + (kk * 16 + 8 * (lane / 16)) * 2);
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++) {
          if (sp && !qp.split) break;
          const uint2 b = reinterpret_cast<const uint2 *>(q_frag)[(sp * KSTEPS + kk) * 32 + lane];
          mma16<KF == F16>(part[2 * sp + kk % 2], a, b.x, b.y);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; e++) s[e] = ((part[3][e] + part[2][e]) + (part[1][e] + part[0][e])) * qp.mul;
    }

    online_softmax<MASK, B::LAZY_MAX>(
        s, m, l, visible, token_end, [](int e) { return 2 * (e / 4) + e % 2; },
        [t0 = t_warp + Tok::of_row(gid)](int e) { return t0 + Tok::of_row(8 * (e % 4 / 2)); }, lanes_max<ROW_LANES>,
        [&](const float (&c)[TROWS]) {
#pragma unroll
          for (int n = 0; n < MT * NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[n][e] *= c[2 * (n % NT) + e % 2];
        });

    // O^T += V^T P^T. P^T's B-fragments (tokens 2 tig, + 1 (+ 8) of row 8 nt + gid) are the transposes
    // of what the thread holds, an 8x8 half (tokens gid or gid + 8) at a time, in P_PARTS parts each.
    auto p_fragment = [&](int nt, float scale0, float scale1, uint32_t (&b)[P_PARTS][2]) {
      uint32_t x[P_PARTS][2];
      pair_parts<P_F16, P_PARTS>(s[4 * nt] * scale0, s[4 * nt + 1] * scale0, &x[0][0], 2);
      pair_parts<P_F16, P_PARTS>(s[4 * nt + 2] * scale1, s[4 * nt + 3] * scale1, &x[0][1], 2);
#pragma unroll
      for (int sp = 0; sp < P_PARTS; sp++)
#pragma unroll
        for (int h = 0; h < 2; h++) b[sp][h] = transpose8x8(x[sp][h]);
    };
    if constexpr (V::quantized) {
      // Each token's group scale multiplies P (as Wide: in f16 after the transpose where P is one
      // part); m-tile 2g + u takes pair_f16's pairs 2u (rows gid) and 2u + 1 (rows gid + 8).
      uint32_t b[NT][P_PARTS][2], sc[2];
      if constexpr (P_PARTS == 1) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) p_fragment(nt, 1.0f, 1.0f, b[nt]);
        pair_scales<V>(v_rows, lane, sc);
      }
#pragma unroll
      for (int g = 0; g < GROUPS; g++) {
        uint32_t bg[NT][P_PARTS][2];
        if constexpr (P_PARTS == 1) {
          const uint32_t gs[2] = {group_scales(sc[0], g, lane), group_scales(sc[1], g, lane)};
#pragma unroll
          for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++) bg[nt][0][h] = hmul2(b[nt][0][h], gs[h]);
        } else {
          p_fragment(0, V::scale(vrow(gid, 0), g), V::scale(vrow(gid, 1), g), bg[0]);
        }
        uint32_t w[2][2];
        group_words<V, true>(v_rows, g, lane, w);
#pragma unroll
        for (int u = 0; u < 2; u++) {
          const uint32_t a[4] = {pair_f16<VF, D>(w[0], 2 * u), pair_f16<VF, D>(w[0], 2 * u + 1),
                                 pair_f16<VF, D>(w[1], 2 * u), pair_f16<VF, D>(w[1], 2 * u + 1)};
#pragma unroll
          for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int sp = 0; sp < P_PARTS; sp++) mma16<true>(o[NT * (2 * g + u) + nt], a, bg[nt][sp][0], bg[nt][sp][1]);
        }
      }
    } else {
      constexpr bool f16 = VF == F16;
      uint32_t b[P_PARTS][2];
      p_fragment(0, 1.0f, 1.0f, b);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        uint32_t a[4]; // values +0 / +8 (lanes 8-15, 24-31) of tokens 0-7 / 8-15 (lanes 16-31), transposed
        ldmatrix<4, true>(a, vrow(lane % 8, lane / 16) + (16 * mt + 8 * ((lane / 8) % 2)) * 2);
#pragma unroll
        for (int sp = 0; sp < P_PARTS; sp++) mma16<f16>(o[mt], a, b[sp][0], b[sp][1]);
      }
    }
  }

  __device__ static int acc_row(int lane, int n, int e) { return 8 * (n % NT) + 2 * (lane % 4) + e % 2; }
  __device__ static int acc_col(int lane, int, int n, int e) {
    const int gid = lane / 4, mt = n / NT;
    return V::quantized ? (mt / 2) * 32 + pair_value(gid, 2 * (mt % 2) + e / 2) : 16 * mt + gid + 8 * (e / 2);
  }
};
// The narrow tile of 1, 2 or 4 n-tiles, as the kernels below name it.
template <int D, uint32_t KF, uint32_t VF> using Narrow1 = Narrow<D, KF, VF, 1>;
template <int D, uint32_t KF, uint32_t VF> using Narrow2 = Narrow<D, KF, VF, 2>;
template <int D, uint32_t KF, uint32_t VF> using Narrow4 = Narrow<D, KF, VF, 4>;

// sm_90a's warpgroup MMA (wgmma): the four warps of a block issue one asynchronous MMA of 64 rows;
// A comes from each warp's registers (its 16 rows, in mma.sync's A layout), B from shared memory
// through a descriptor; a warp goes on issuing while the MMA runs, until it waits for the group.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// A K-major B operand without swizzling: core matrices of 8 rows (N) x 16 bytes (8 values of K),
// `lead` bytes apart along K, `stride` bytes apart along N.
__device__ __forceinline__ uint64_t wgmma_desc(const void *smem, uint32_t lead, uint32_t stride) {
  return uint64_t((smem_addr(smem) & 0x3ffffu) >> 4) | uint64_t(lead >> 4) << 16 | uint64_t(stride >> 4) << 32;
}
// d[J0 .. J0 + 3] (the warpgroup's 64 x 32 f32 accumulators; d[J0 + j][e]: the mma.sync C layout of
// n-tile j) = a (64 x 16 f16) b (16 x 32 f16), plus d where ACC.
template <int J0, bool ACC, int N>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[N][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, %21, 1, 1, 0;\n"
               : "+f"(d[J0][0]), "+f"(d[J0][1]), "+f"(d[J0][2]), "+f"(d[J0][3]), "+f"(d[J0 + 1][0]), "+f"(d[J0 + 1][1]),
                 "+f"(d[J0 + 1][2]), "+f"(d[J0 + 1][3]), "+f"(d[J0 + 2][0]), "+f"(d[J0 + 2][1]), "+f"(d[J0 + 2][2]),
                 "+f"(d[J0 + 2][3]), "+f"(d[J0 + 3][0]), "+f"(d[J0 + 3][1]), "+f"(d[J0 + 3][2]), "+f"(d[J0 + 3][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(int(ACC))
               : "memory");
}

// Group: the block's four warps as one warpgroup on wgmma, 32 query rows (speculative tokens),
// quantized K and V, head_dim 128. S^T = K Q^T: each warp's 16 tokens of the stage (K converted to
// f16 times its group scale, as Narrow's several n-tiles do) against q in shared memory. Then
// O^T = V^T P^T over all 64 tokens of the stage, P^T through shared memory: warp w converts V's
// group w (times the tokens' scales) for every token, so the output is the warpgroup's, 32
// accumulators a thread where Narrow<4> holds 128, and the rows' bases are the block's: a stage
// whose scores pass them agrees on new ones through shared memory (rare after the first stages).
//  - S^T's accumulators: s[nt][e] token gid + 8 (e / 2), row 8 nt + 2 tig + e % 2, as Narrow's.
//  - O^T's: o[4 u + j][e] row 8 j + 2 tig + e % 2, value 32 w + pair_value(gid, 2 u + e / 2).
//  - q and P^T lie as wgmma's B operand: a k-step (16 values of K, or 16 tokens) of 32 rows in 1 KB,
//    core matrices (rows 8 j.., k-half h) at (2 j + h) * 128 bytes, row r % 8 at 16 (r % 8).
template <int D, uint32_t KF, uint32_t VF> struct Group : TileBase<D, KF, VF> {
  using B = TileBase<D, KF, VF>;
  using typename B::K, typename B::V, B::GROUPS;
  static_assert(D == 128 && K::quantized && V::quantized && WARPS == D / 32, "a warp a 32-value group of V");
  static constexpr int NT = 4, ROWS = PKV_MMA_NARROW_ROWS * NT, QW = 2, TROWS = 2 * NT;
  static constexpr bool Q_F16 = true, GROUPED = true;
  static constexpr int COMBINE_WARPS = 1;
  static constexpr uint32_t KSTEP_BYTES = 16 * ROWS * 2;
  // Static shared memory: P^T of a stage, then the warps' row maxima where bases move.
  static constexpr uint32_t SCRATCH_BYTES = TILE * ROWS * 2 + WARPS * ROWS * 4;
  float o[2 * NT][4], m[TROWS], l[TROWS];

  __device__ static int row_of_thread(int lane, int i) { return 8 * (i / 2) + 2 * (lane % 4) + i % 2; }
  static constexpr int ROW_LANES = 28;
  // q's pair of values 16 st + 4 t + {b, b + 2} of group g of row r: k-step 2 g + st, k 2 t, 2 t + 1
  // (b = 0) or 8 + 2 t, 9 + 2 t (b = 1), where stage() puts those values of K's A-fragments.
  __device__ static int q_f16_word(int g, int r, int st, int t, int b) {
    return (((2 * g + st) * 8 + 2 * (r / 8) + b) * 8 + r % 8) * 4 + t;
  }

  template <bool MASK>
  __device__ void stage(const uint8_t *k_rows, const uint8_t *v_part, const uint32_t *q_frag, uint8_t *scratch,
                        uint32_t t_warp, uint32_t token_end, const uint32_t (&visible)[TROWS], int lane, int warp) {
    const int gid = lane / 4, tig = lane % 4;
    float acc[NT][4]; // the first k-step's MMA overwrites it
    {
      const typename K::Scales ks0 = K::scales_of(K::row(k_rows, gid, 0)), ks1 = K::scales_of(K::row(k_rows, gid, 1));
      uint32_t a[2 * GROUPS][4]; // k-step 2 g + st
#pragma unroll
      for (int g = 0; g < GROUPS; g++) {
        uint32_t w[2][2];
        group_words<K, false>(k_rows, g, lane, w);
        const uint32_t sc0 = ks0.pair(g), sc1 = ks1.pair(g);
#pragma unroll
        for (int st = 0; st < 2; st++) {
          a[2 * g + st][0] = hmul2(pair_f16<KF, D>(w[0], st), sc0);
          a[2 * g + st][1] = hmul2(pair_f16<KF, D>(w[1], st), sc1);
          a[2 * g + st][2] = hmul2(pair_f16<KF, D>(w[0], st + 2), sc0);
          a[2 * g + st][3] = hmul2(pair_f16<KF, D>(w[1], st + 2), sc1);
        }
      }
      // All fragments first, one fence: issuing each group's MMAs as it is converted measured 2.5% slower.
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 2 * GROUPS; ks++) {
        const uint64_t b = wgmma_desc(reinterpret_cast<const uint8_t *>(q_frag) + ks * KSTEP_BYTES, 128, 256);
        if (ks == 0) wgmma_m64n32k16<0, false>(acc, a[0], b);
        else wgmma_m64n32k16<0, true>(acc, a[ks], b);
      }
      wgmma_commit();
      wgmma_wait();
    }
    float s[4 * NT], tile_max[TROWS];
    auto row_of = [](int e) { return 2 * (e / 4) + e % 2; };
#pragma unroll
    for (int i = 0; i < TROWS; i++) tile_max[i] = -INFINITY;
#pragma unroll
    for (int e = 0; e < 4 * NT; e++) {
      s[e] = acc[e / 4][e % 4];
      if (MASK) {
        const uint32_t t = t_warp + gid + 8 * (e % 4 / 2);
        s[e] = t < token_end && t < visible[row_of(e)] ? s[e] : -INFINITY;
      }
      tile_max[row_of(e)] = fmaxf(tile_max[row_of(e)], s[e]);
    }
    bool passed = false;
#pragma unroll
    for (int i = 0; i < TROWS; i++) passed |= tile_max[i] > m[i];
    // P^T against the bases as they are; where some score passed its base, against the new ones.
    uint32_t *pt = reinterpret_cast<uint32_t *>(scratch) + warp * (KSTEP_BYTES / 4);
    float p[4 * NT];
    auto weights = [&] {
#pragma unroll
      for (int e = 0; e < 4 * NT; e++) p[e] = exp2_ftz(s[e] - (m[row_of(e)] == -INFINITY ? 0.0f : m[row_of(e)]));
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++) // tokens 2 tig, + 1 (+ 8 h) of row 8 nt + gid
          pt[((2 * nt + h) * 8 + gid) * 4 + tig] = transpose8x8(pack2<true>(p[4 * nt + 2 * h], p[4 * nt + 2 * h + 1]));
      fence_proxy_async();
    };
    weights();
    if (__syncthreads_or(passed)) {
      float *top = reinterpret_cast<float *>(scratch + TILE * ROWS * 2); // [warp][row]
#pragma unroll
      for (int i = 0; i < TROWS; i++) {
        const float t = lanes_max<ROW_LANES>(tile_max[i]);
        if (gid == 0) top[warp * ROWS + row_of_thread(lane, i)] = t;
      }
      __syncthreads();
      float correction[TROWS];
#pragma unroll
      for (int i = 0; i < TROWS; i++) {
        float t = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++) t = fmaxf(t, top[w * ROWS + row_of_thread(lane, i)]);
        const float m_new = t > m[i] ? t + kMaxSlack : m[i];
        correction[i] = m_new == m[i] ? 1.0f : exp2_ftz(m[i] - m_new);
        m[i] = m_new;
        l[i] *= correction[i];
      }
#pragma unroll
      for (int n = 0; n < 2 * NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] *= correction[2 * (n % NT) + e % 2];
      weights();
      __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < 4 * NT; e++) l[row_of(e)] += p[e];

    // O^T += V^T P^T: k-step kt is warp kt's 16 tokens; m-tile u takes pair_f16's pairs 2u (value
    // rows gid) and 2u + 1 (gid + 8) of group `warp`, each times its two tokens' scales.
    uint32_t a[TILE / 16][2][4];
#pragma unroll
    for (int kt = 0; kt < TILE / 16; kt++) {
      const uint8_t *rows = V::warp_rows(v_part, kt);
      uint32_t w[2][2], sc[2];
      group_words<V, true>(rows, warp, lane, w);
      pair_scales<V>(rows, lane, sc);
      const uint32_t gs[2] = {group_scales(sc[0], warp, lane), group_scales(sc[1], warp, lane)};
#pragma unroll
      for (int u = 0; u < 2; u++) {
        a[kt][u][0] = hmul2(pair_f16<VF, D>(w[0], 2 * u), gs[0]);
        a[kt][u][1] = hmul2(pair_f16<VF, D>(w[0], 2 * u + 1), gs[0]);
        a[kt][u][2] = hmul2(pair_f16<VF, D>(w[1], 2 * u), gs[1]);
        a[kt][u][3] = hmul2(pair_f16<VF, D>(w[1], 2 * u + 1), gs[1]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < TILE / 16; kt++) {
      const uint64_t b = wgmma_desc(scratch + kt * KSTEP_BYTES, 128, 256);
      wgmma_m64n32k16<0, true>(o, a[kt][0], b);
      wgmma_m64n32k16<NT, true>(o, a[kt][1], b);
    }
    // Waited for here: ptxas serialises the MMAs (C7513) where the next stage's conversions write
    // registers while these run, and that measured 3-10% slower.
    wgmma_commit();
    wgmma_wait();
  }

  __device__ static int acc_row(int lane, int n, int e) { return 8 * (n % NT) + 2 * (lane % 4) + e % 2; }
  __device__ static int acc_col(int lane, int warp, int n, int e) {
    return 32 * warp + pair_value(lane / 4, 2 * (n / NT) + e / 2);
  }
};
#endif

template <int D, uint32_t KF, uint32_t VF, int STAGES, class T> struct Mma {
  using K = typename T::K;
  using V = typename T::V;
  static constexpr int NS = STAGES; // as pkv_mma_stages or pkv_mma_fewer_stages
  static constexpr int ROWS = T::ROWS, KSTEPS = T::KSTEPS, GROUPS = T::GROUPS, SPLIT = T::SPLIT;
  static constexpr uint32_t stage_bytes = K::bytes + V::bytes;
  // q fragments: float K [split][kstep][lane][QW words]; quantized K by group (T::q_word), then per
  // group a float2 for each pair of rows a thread takes (T::scale_pair): their scales; T::Q_F16 one
  // f16 a value (T::q_f16_word).
  static constexpr uint32_t q_words = T::Q_F16 ? D * ROWS / 2 : (K::quantized ? 2 * GROUPS : SPLIT * KSTEPS) * 32 * T::QW;
  static constexpr uint32_t q_bytes = q_words * 4 + (K::quantized && !T::Q_F16 ? GROUPS * ROWS * 4 : 0);
  static_assert(q_bytes == pkv_mma_q_bytes(D, ROWS, K::quantized, T::Q_F16), "the host sizes shared memory alike");
  static constexpr int CO_STRIDE = D + 8; // floats per row of the warps' combine area
  // The warps' combine area reuses the stages and the q fragments once a chunk is done.
  static constexpr uint32_t combine_tile_bytes = (T::COMBINE_WARPS * ROWS * CO_STRIDE + 2 * WARPS * ROWS) * 4;
  static_assert(combine_tile_bytes == pkv_mma_combine_bytes(D, ROWS, T::COMBINE_WARPS),
                "the host sizes shared memory alike");
  static constexpr uint32_t combine_bytes = 2 * combine_tile_bytes; // 2 row tiles
  static constexpr uint32_t loop_bytes = NS * stage_bytes + 2 * q_bytes;
  // The most the host reserves (two row tiles; mma_shared_bytes in gpu_backend.cpp).
  static constexpr uint32_t shared_bytes = loop_bytes > combine_bytes ? loop_bytes : combine_bytes;
  static_assert(shared_bytes <= 227 * 1024, "a block fits a multiprocessor's shared memory");
};

template <int D, uint32_t KF, uint32_t VF, int NS, class T> __device__ void decode_mma(const PkvDecodeParams &p) {
  using M = Mma<D, KF, VF, NS, T>;
  using K = typename M::K;
  using V = typename M::V;
  constexpr int ROWS = M::ROWS;
  extern __shared__ uint4 smem_words[];
  uint8_t *smem = reinterpret_cast<uint8_t *>(smem_words);
  __shared__ int s_last;
  __shared__ StageRow stage_rows[M::NS][TILE];
  // Bulk copies: a stage's mbarrier; each copying thread arrives once per use.
  constexpr bool KB = kBulkCopies && !K::quantized, VB = kBulkCopies && !V::quantized;
  __shared__ uint64_t stage_bar[M::NS];
  __shared__ alignas(128) uint8_t group_scratch[T::SCRATCH_BYTES];
  uint32_t bar_parity = 0; // bit s: the phase of stage s's next completion
  if constexpr (KB || VB) {
    if (threadIdx.x == 0)
      for (int s = 0; s < M::NS; s++) mbar_init(&stage_bar[s], (KB ? TILE : 0) + (VB ? TILE : 0));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();
  }

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // The block's MT tiles of ROWS query rows, WARPS warps each, every warp taking 16 tokens of a stage:
  // each K/V row in shared memory serves all the block's rows.
  const int MT = int(p.mtiles), mt = warp / WARPS, slice = warp % WARPS, threads = int(blockDim.x);
  const uint32_t block_rows = ROWS * MT;
  // Quantized K and V rows lie in MMA-row order (warp w's 16 tokens from row 16 w): a warp copies the
  // rows it computes (the first row tile's warp; the other tile's warp of the slice shares them), so
  // a round waits for its slice's warps (the warp itself, or a named barrier of two), not the block's.
  // `my_token`: the token of the stage whose page this thread looks up, if any.
  constexpr bool kPrivate = !T::Tok::spread;
  const int my_token = kPrivate ? (mt == 0 && lane < SUB ? slice * SUB + lane : -1) : (tid < TILE ? tid : -1);
  auto sync_rows = [&] {
    if constexpr (T::GROUPED) __syncthreads(); // a warp reads every warp's V rows
    else if constexpr (kPrivate && T::MAX_TILES == 1) __syncwarp();
    else if constexpr (kPrivate) asm volatile("bar.sync %0, %1;\n" ::"r"(1 + slice), "r"(32 * MT) : "memory");
    else __syncthreads();
  };
  // Row tile i's q fragments and (quantized K) scales.
  auto q_frag_of = [&](int i) { return reinterpret_cast<uint32_t *>(smem + M::NS * M::stage_bytes + i * M::q_bytes); };
  auto q_scale_of = [&](int i) { return reinterpret_cast<float *>(q_frag_of(i) + M::q_words); };
  const uint32_t *q_frag = q_frag_of(mt);
  const float *q_scale_sm = q_scale_of(mt);
  const PkvPool &pool = p.pool;
  const uint32_t group = p.q_heads / pool.kv_heads, rows = p.q_tokens * group;
  const PkvChunk *chunks = reinterpret_cast<const PkvChunk *>(p.chunks); // one KV head's each
  // The first item's chunk is read alongside the chunk count, not after it: the grid covers the plan
  // it was launched for, so the chunk lies in the plan buffer.
  PkvChunk c = chunks[blockIdx.x / p.row_tiles];
  const uint32_t n_chunks = reinterpret_cast<const PkvPlanHeader *>(p.plan)->n_chunks;
  const uint8_t *layer_base = reinterpret_cast<const uint8_t *>(pool.base) + uint64_t(p.layer) * pool.pages * pool.block_bytes;
  const float q_mul = p.scale * kLog2e; // scores in log2 units
  const bool q_exact = !K::quantized && p.q_format == KF;
  const QParts qp{!q_exact, q_exact ? q_mul : 1.0f};
  const float q_pre = q_exact ? 1.0f : q_mul; // what q_values multiplies q by

  for (uint32_t item = blockIdx.x; item < n_chunks * p.row_tiles; item += gridDim.x) {
    const uint32_t z = item % p.row_tiles;
    if (item != blockIdx.x) c = chunks[item / p.row_tiles];
    if (c.seq == kNoSeq) continue; // a balanced plan's filler (every thread skips it)
    const uint32_t h = c.head;
    const uint32_t length = c.length;
    // Query row r of this tile: (token, head of the group), or nothing past the group's rows.
    auto q_head = [&](uint32_t r) {
      const uint32_t row = z * block_rows + r, tok = row / group;
      return (uint64_t(c.seq) * p.q_tokens + tok) * p.q_heads + h * group + row % group;
    };
    auto row_valid = [&](uint32_t r) { return z * block_rows + r < rows; };
    // Values [d0, d0 + N) of query row r, times q_pre (zeros past the rows).
    auto q_values = [&](uint32_t r, uint32_t d0, auto &out) {
      constexpr int N = sizeof(out) / sizeof(out[0]);
      if (!row_valid(r)) {
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = 0.0f;
        return;
      }
      const uint64_t at = q_head(r) * D + d0;
      if (p.q_aligned && p.q_format != F32) { // 16-byte loads of 8 values
        const uint4 *src = reinterpret_cast<const uint4 *>(reinterpret_cast<const uint16_t *>(p.q) + at);
#pragma unroll
        for (int i = 0; i < N / 8; i++) {
          const uint4 raw = src[i];
          const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int j = 0; j < 8; j++) {
            const uint16_t h = uint16_t(w[j / 2] >> (16 * (j % 2)));
            out[8 * i + j] = (p.q_format == F16 ? half_to_float(h) : bf16_to_float(h)) * q_pre;
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = load_io(p.q_format, reinterpret_cast<const void *>(p.q), at + i) * q_pre;
      }
    };

    // Positions each of this thread's two rows sees.
    uint32_t visible[T::TROWS];
#pragma unroll
    for (int i = 0; i < T::TROWS; i++) {
      const uint32_t r = mt * ROWS + T::row_of_thread(lane, i), tok = (z * block_rows + r) / group;
      visible[i] = row_valid(r) ? length - p.q_tokens + tok + 1 : 0;
    }

    const uint32_t *table = reinterpret_cast<const uint32_t *>(pool.table) + uint64_t(c.slot) * pool.table_stride;
    const uint32_t n = c.token_end - c.token_begin;
    const int tiles = int((n + TILE - 1) / TILE);

    // The page of token `my_token` of tile `tile` (threads with my_token >= 0), and where its row lies there.
    // `in_chunk`: the tile is whole and in the chunk.
    auto page_of = [&](int tile, bool in_chunk) {
      const uint32_t t = c.token_begin + tile * TILE + my_token;
      return in_chunk || (tile < tiles && t < c.token_end) ? table[t >> pool.page_shift] : pool.pages;
    };
    auto locate = [&](int tile, uint32_t page) {
      const uint32_t t = c.token_begin + tile * TILE + my_token, first = t - uint32_t(my_token) % 8, in_page = pool.page_size - 1;
      const bool valid = page < pool.pages;
      // The eighth's rows share this row's page (and so its validity) when they share its page index.
      const bool eighth = (KB || VB) && valid && first + 7 < c.token_end && (first & in_page) + 7 <= in_page;
      return StageRow{layer_base + (valid ? uint64_t(page) * pool.block_bytes : 0),
                      (h << pool.page_shift) + (t & in_page), valid + 2u * eighth}; // kNone, kRow or kEighth
    };
    // Queues tile `tile` into its stage `slot` (every thread commits, so the group counts agree). The
    // first row tile's warps copy: with private rows each the K and V rows of its own 16 tokens, else
    // warps 0-1 all K rows, warps 2-3 all V rows.
    auto issue = [&](int tile, int slot, bool in_chunk) {
      if (in_chunk || tile < tiles) {
        uint8_t *stage = smem + slot * M::stage_bytes;
        const StageRow *rows = stage_rows[slot];
        if constexpr (kPrivate) {
          // K's and V's pieces by every lane (uniform instructions; one row lookup for both where
          // they have one format); lanes 0-15 K's scales, 16-31 V's.
          if (mt == 0) {
            const int first = slice * SUB, r = first + lane % SUB;
            if constexpr (std::is_same_v<K, V>) {
              copy_rows<K, 32, SUB, 2>({stage, stage + K::bytes}, {0, pool.k_bytes}, rows, first, lane);
            } else {
              copy_rows<K, 32, SUB, 1>({stage}, {0}, rows, first, lane);
              copy_rows<V, 32, SUB, 1>({stage + K::bytes}, {pool.k_bytes}, rows, first, lane);
            }
            static_assert(K::scales == V::scales, "both quantized");
            const bool k = lane < SUB;
            copy_scales<K::scales>(stage + (k ? K::of_token(r) + K::data : K::bytes + V::of_token(r) + V::data), &rows[r],
                                   k ? pool.k.scale_offset : pool.k_bytes + pool.v.scale_offset);
          }
        } else if (tid < TILE) {
          if constexpr (KB) bulk_row<K>(stage, rows, 0, tid, &stage_bar[slot]);
          else copy_rows<K, TILE, TILE, 1>({stage}, {0}, rows, 0, tid);
          if constexpr (K::scales != 0) copy_scales<K::scales>(stage + K::of_token(tid) + K::data, &rows[tid], pool.k.scale_offset);
        } else if (tid < 2 * TILE) {
          const int i = tid - TILE;
          if constexpr (VB) bulk_row<V>(stage + K::bytes, rows, pool.k_bytes, i, &stage_bar[slot]);
          else copy_rows<V, TILE, TILE, 1>({stage + K::bytes}, {pool.k_bytes}, rows, 0, i);
          if constexpr (V::scales != 0)
            copy_scales<V::scales>(stage + K::bytes + V::of_token(i) + V::data, &rows[i], pool.k_bytes + pool.v.scale_offset);
        }
      }
      cp_async_commit();
    };

    T acc;
#pragma unroll
    for (int i = 0; i < T::TROWS; i++) acc.m[i] = -INFINITY, acc.l[i] = 0.0f;
    for (auto &o : acc.o) o[0] = o[1] = o[2] = o[3] = 0.0f;

    if (my_token >= 0)
#pragma unroll
      for (int s = 0; s < M::NS; s++) stage_rows[s][my_token] = locate(s, page_of(s, false));
    __syncthreads();
#pragma unroll
    for (int s = 0; s < M::NS - 1; s++) issue(s, s, false);

    // While the first stages load: q as MMA fragments (word k of row r at T::q_slot(r, k)).
    if constexpr (T::Q_F16) {
      for (int e = tid; e < M::GROUPS * 2 * ROWS; e += threads) { // 16 values of a row a thread
        const int g = e / (2 * ROWS), st = e / ROWS % 2, r = e % ROWS;
        float v[16];
        q_values(r, g * 32 + st * 16, v);
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
          for (int b = 0; b < 2; b++) q_frag_of(0)[T::q_f16_word(g, r, st, t, b)] = pack2<true>(v[4 * t + b], v[4 * t + b + 2]);
      }
    } else if constexpr (K::quantized) {
      // Two int8 parts per (row, group): q ~ s (128 q1 + q2), q1 = round(q / 128 s) and q2 quantizing
      // what q1 missed (|q2| <= 64), so the dot product keeps ~15 bits of q and the two int32 dot
      // products combine exactly before one conversion to float. Four threads a (row, group), eight
      // values each, the group's largest magnitude by two shuffles: every thread takes part (with a
      // thread a group, a quarter of the block did it all: quantized K's 1x1K 3-4% slower, H200,
      // docs/perf/2026-12-04-h200-cuda-session21.md).
      static_assert(M::GROUPS * ROWS * 4 % 32 == 0, "a warp's lanes all take part");
      for (int e = tid; e < MT * M::GROUPS * ROWS * 4; e += threads) {
        const int quarter = e % 4, x = e / 4, i_tile = x / (M::GROUPS * ROWS), g = x / ROWS % M::GROUPS, r = x % ROWS;
        uint32_t *frag = q_frag_of(i_tile);
        float v[8], amax = 0.0f;
        q_values(i_tile * ROWS + r, g * 32 + quarter * 8, v);
#pragma unroll
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f; // q1 steps of amax / 127
        // Q4_0's K values enter as 16 times their value (k_group).
        if (quarter == 0)
          q_scale_of(i_tile)[(g * ROWS / 2 + T::scale_pair(r)) * 2 + T::scale_half(r)] =
              amax / (127.0f * 128.0f * (KF == Q4_0 ? 16.0f : 1.0f));
#pragma unroll
        for (int k = 0; k < 2; k++) { // four values a word
          uint32_t w[2] = {0, 0};
#pragma unroll
          for (int b = 0; b < 4; b++) {
            const float x = v[4 * k + b] * inv;
            const int q1 = __float2int_rn(x), q2 = __float2int_rn((x - float(q1)) * 128.0f);
            w[0] |= uint32_t(uint8_t(int8_t(q1))) << (8 * b);
            w[1] |= uint32_t(uint8_t(int8_t(q2))) << (8 * b);
          }
#pragma unroll
          for (int part = 0; part < 2; part++) frag[T::q_word(g, part, T::q_slot(r, 2 * quarter + k))] = w[part];
        }
      }
    } else {
      for (int e = tid; e < MT * M::KSTEPS * ROWS; e += threads) {
        const int i_tile = e / (M::KSTEPS * ROWS), kk = e / ROWS % M::KSTEPS, r = e % ROWS;
        float v[16];
        q_values(i_tile * ROWS + r, kk * 16, v);
#pragma unroll
        for (int k = 0; k < 8; k++) // two values a word
          split_pair<KF == F16>(v[2 * k], v[2 * k + 1], &q_frag_of(i_tile)[kk * 32 * T::QW + T::q_slot(r, k)],
                                M::KSTEPS * 32 * T::QW);
      }
    }
    if constexpr (T::GROUPED) fence_proxy_async(); // q is read by wgmma
    if constexpr (kPrivate) __syncthreads(); // the q fragments: the rounds' barriers join only a slice

    // Round `tile` computes stage `slot` (tile % NS) and queues tile + NS - 1 into `last`, the stage
    // the round before freed. A plain round, whose tiles up to tile + NS are whole and in the chunk,
    // checks nothing: with one warp a scheduler, a round takes as long as its instructions.
    int slot = 0, last = M::NS - 1;
    auto round = [&](int tile, auto plain_round) {
      constexpr bool plain = decltype(plain_round)::value;
      if constexpr (!T::GROUPED) issue(tile + M::NS - 1, last, plain);
      // Tile + NS's pages, read while this tile computes; located into the slot this tile frees.
      const uint32_t next_page = my_token >= 0 ? page_of(tile + M::NS, plain) : 0;
      if constexpr (T::GROUPED) cp_async_wait<M::NS - 2>();
      else cp_async_wait<M::NS - 1>();
      if constexpr (KB || VB) {
        mbar_wait(&stage_bar[slot], (bar_parity >> slot) & 1);
        bar_parity ^= 1u << slot;
      }
      sync_rows();
      // Group: the barrier above also frees the stage the round before computed, so a round has one
      // besides the stage's vote (a second at its end measured 2-3% slower where a format is Q8_0,
      // even with Q4_0 pages).
      if constexpr (T::GROUPED) issue(tile + M::NS - 1, last, plain);
      const uint8_t *stage = smem + slot * M::stage_bytes;
      // This warp's 16 tokens of the stage: its MMA row m is token t_warp + Tok::of_row(m).
      // A plain round's tokens are all visible to every row: none is within NS tiles of the chunk's end
      // (a speculative row sees all but the last few tokens of the sequence); padding rows' weights
      // go nowhere.
      const uint32_t t_warp = c.token_begin + tile * TILE + T::Tok::warp_first(slice);
      if constexpr (T::GROUPED)
        acc.template stage<!plain>(K::warp_rows(stage, slice), stage + K::bytes, q_frag, group_scratch, t_warp,
                                   c.token_end, visible, lane, warp);
      else
        acc.template stage<!plain>(K::warp_rows(stage, slice), V::warp_rows(stage + K::bytes, slice), q_frag,
                                   q_scale_sm, qp, t_warp, c.token_end, visible, lane);
      if (my_token >= 0) stage_rows[slot][my_token] = locate(tile + M::NS, next_page);
      if constexpr (KB || VB) fence_proxy_async();
      if constexpr (!T::GROUPED) sync_rows(); // the stage is refilled next
      last = slot, slot = slot + 1 == M::NS ? 0 : slot + 1;
    };
    int tile = 0;
    for (; tile + M::NS + 1 < tiles; tile++) round(tile, std::true_type{});
    for (; tile < tiles; tile++) round(tile, std::false_type{});
    cp_async_wait<0>();

    // Combine the warps through shared memory (the stages are free now).
    __syncthreads();
    float *co = reinterpret_cast<float *>(smem);            // [WARPS][ROWS][CO_STRIDE]
    float *cm = co + MT * T::COMBINE_WARPS * ROWS * M::CO_STRIDE, *cl = cm + MT * WARPS * ROWS; // [warp][ROWS]
#pragma unroll
    for (int i = 0; i < T::TROWS; i++) acc.l[i] = lanes_sum<T::ROW_LANES>(acc.l[i]);
    constexpr int NACC = sizeof(acc.o) / sizeof(acc.o[0]);
#pragma unroll
    for (int n = 0; n < NACC; n++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        co[((T::GROUPED ? 0 : warp) * ROWS + T::acc_row(lane, n, e)) * M::CO_STRIDE + T::acc_col(lane, warp, n, e)] =
            acc.o[n][e];
    if ((lane & T::ROW_LANES) == 0) { // one lane of those sharing each row
#pragma unroll
      for (int i = 0; i < T::TROWS; i++) {
        cm[warp * ROWS + T::row_of_thread(lane, i)] = acc.m[i];
        cl[warp * ROWS + T::row_of_thread(lane, i)] = acc.l[i];
      }
    }
    __syncthreads();

    const bool split = c.part != kNoPart;
    const uint32_t first_part = c.first_part;
    const uint32_t my_rows = min(block_rows, rows - z * block_rows);
    // Each row's warps' weights (normalised) and its lse, once a row, in place of their max and sum.
    if (tid < my_rows) {
      const uint32_t r = tid % ROWS, w0 = tid / ROWS * WARPS; // warps w0.. hold row tid
      float top = -INFINITY;
#pragma unroll
      for (int w = w0; w < w0 + WARPS; w++) top = fmaxf(top, cm[w * ROWS + r]);
      float weight[WARPS], sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; w++) {
        weight[w] = top == -INFINITY ? 0.0f : exp2f(cm[(w0 + w) * ROWS + r] - top);
        sum += weight[w] * cl[(w0 + w) * ROWS + r];
      }
#pragma unroll
      for (int w = 0; w < WARPS; w++) cm[(w0 + w) * ROWS + r] = sum > 0.0f ? weight[w] / sum : 0.0f;
      cl[w0 * ROWS + r] = sum > 0.0f ? (top + log2f(sum)) * 0.6931471805599453f : -INFINITY; // natural log
    }
    __syncthreads();
    // Four consecutive values of a row a thread (16-byte shared-memory reads and partial writes).
    for (uint32_t e = tid; e < my_rows * D / 4; e += threads) {
      const uint32_t rb = e / (D / 4), d = e % (D / 4) * 4, r = rb % ROWS, w0 = rb / ROWS * WARPS;
      float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = w0; w < w0 + T::COMBINE_WARPS; w++) { // Group: the first warp's place holds the output
        const float weight = cm[w * ROWS + r];
        const float4 o = *reinterpret_cast<const float4 *>(&co[(w * ROWS + r) * M::CO_STRIDE + d]);
        value.x += weight * o.x, value.y += weight * o.y, value.z += weight * o.z, value.w += weight * o.w;
      }
      const float lse = cl[w0 * ROWS + r];
      const uint64_t head = q_head(rb);
      if (!split) {
        const float v[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
        for (int i = 0; i < 4; i++) store_io(p.out_format, reinterpret_cast<void *>(p.out), head * D + d + i, v[i]);
        if (d == 0 && p.lse) reinterpret_cast<float *>(p.lse)[head] = lse;
      } else {
        const uint64_t part = uint64_t(c.part) * p.q_tokens * p.q_heads + (head - uint64_t(c.seq) * p.q_tokens * p.q_heads);
        *reinterpret_cast<float4 *>(reinterpret_cast<float *>(p.part_out) + part * D + d) = value;
        if (d == 0) reinterpret_cast<float *>(p.part_lse)[part] = lse;
      }
    }
    if (split) {
      // The last of the sequence's chunks to finish (for this KV head and row tile) merges them all.
      // One thread counts for the block: the barrier orders the block's partial writes before its
      // release, and the last block's acquire orders them before its reads.
      const uint32_t chunks_of_seq = c.siblings;
      __syncthreads();
      if (tid == 0) {
        uint32_t *counter = reinterpret_cast<uint32_t *>(p.counters) + (uint64_t(first_part) * pool.kv_heads + h) * p.row_tiles + z;
        s_last = atomic_add_acq_rel(counter, 1u) + 1 == chunks_of_seq;
        if (s_last) *counter = 0; // every other chunk has counted: ready for the next call
      }
      __syncthreads();
      if (s_last) {
        // The lse of the block's rows in every chunk go to shared memory, loaded alongside the first
        // U chunks' values; one barrier; then each thread merges one row's chunks for a few of its
        // float4s (strided, so a row's threads read whole lines), computing that row's weights
        // itself, in chunk order (the same bits every run). One block merges, so its round trips
        // and barriers are the merge's cost: weights computed once a row by groups of threads and
        // shared through shared memory had put two more barriers and two chains of shuffles on it
        // (H200: head_dim 256 1x1K 9-12% faster, head_dim 128 1x1K 2%; docs/perf/2026-12-04-h200-cuda-session21.md).
        constexpr uint32_t V4 = D / 4, EPT = M::ROWS * V4 / THREADS; // float4s a row, most a thread takes
        const uint64_t stride = uint64_t(p.q_tokens) * p.q_heads;  // a part's rows
        // Chunk k's partial of row r: lse at part_lse[(first_part + k) * stride + in_seq(r)], values
        // at part_out[that * D].
        auto in_seq = [&](uint32_t r) { return q_head(r) - uint64_t(c.seq) * stride; };
        const uint32_t per_row = uint32_t(threads) / my_rows, r = min(tid / per_row, my_rows - 1), j0 = tid % per_row;
        const bool mine = tid / per_row < my_rows;
        const uint64_t head = q_head(r);
        const float4 *values_of = reinterpret_cast<const float4 *>(p.part_out) + (first_part * stride + in_seq(r)) * V4 + j0;
        float *lse_sm = reinterpret_cast<float *>(smem); // [chunk][my_rows]
        const uint32_t batch = max(M::NS * M::stage_bytes, MT * M::combine_tile_bytes) / (my_rows * 4);
        // E float4s a thread, U chunks' loads at once.
        auto merge = [&](auto ept) {
          constexpr uint32_t E = decltype(ept)::value, U = (D == 256 ? 32 : 16) / E;
          float acc[E][4] = {}, top = -INFINITY, sum = 0.0f;
          float4 v[U][E];
          auto load = [&](uint32_t k1, uint32_t end) {
#pragma unroll
            for (uint32_t u = 0; u < U; u++)
#pragma unroll
              for (uint32_t j = 0; j < E; j++)
                v[u][j] = mine && k1 + u < end && j0 + j * per_row < V4
                              ? __ldcg(values_of + (k1 + u) * stride * V4 + j * per_row)
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          };
          for (uint32_t k0 = 0; k0 < chunks_of_seq; k0 += batch) {
            const uint32_t end = min(chunks_of_seq, k0 + batch);
            load(k0, end);
            for (uint32_t i = tid; i < (end - k0) * my_rows; i += threads)
              lse_sm[i] = __ldcg(reinterpret_cast<const float *>(p.part_lse) + (first_part + k0 + i / my_rows) * stride +
                                 in_seq(i % my_rows));
            __syncthreads();
            // The batch's largest lse (four chains: short dependencies); an empty chunk's (-inf) weighs 0.
            const float *lse_row = lse_sm + r;
            float t0 = top, t1 = -INFINITY, t2 = -INFINITY, t3 = -INFINITY;
            uint32_t k = 0;
            for (; k + 4 <= end - k0; k += 4) {
              t0 = fmaxf(t0, lse_row[k * my_rows]), t1 = fmaxf(t1, lse_row[(k + 1) * my_rows]);
              t2 = fmaxf(t2, lse_row[(k + 2) * my_rows]), t3 = fmaxf(t3, lse_row[(k + 3) * my_rows]);
            }
            for (; k < end - k0; k++) t0 = fmaxf(t0, lse_row[k * my_rows]);
            const float batch_top = fmaxf(fmaxf(t0, t1), fmaxf(t2, t3));
            if (batch_top > top) {
              const float rescale = top == -INFINITY ? 0.0f : exp2_ftz((top - batch_top) * kLog2e);
              sum *= rescale;
#pragma unroll
              for (uint32_t j = 0; j < E; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[j][i] *= rescale;
              top = batch_top;
            }
            for (uint32_t k1 = k0; k1 < end; k1 += U) {
              if (k1 != k0) load(k1, end);
#pragma unroll
              for (uint32_t u = 0; u < U; u++) {
                const float l = k1 + u < end ? lse_sm[(k1 + u - k0) * my_rows + r] : -INFINITY;
                const float w = l == -INFINITY ? 0.0f : exp2_ftz((l - top) * kLog2e);
                sum += w;
#pragma unroll
                for (uint32_t j = 0; j < E; j++) {
                  acc[j][0] += w * v[u][j].x, acc[j][1] += w * v[u][j].y;
                  acc[j][2] += w * v[u][j].z, acc[j][3] += w * v[u][j].w;
                }
              }
            }
            __syncthreads(); // the next batch overwrites lse_sm
          }
          if (!mine) return;
          const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
          for (uint32_t j = 0; j < E; j++) {
            const uint32_t d = (j0 + j * per_row) * 4;
            if (d >= D) break;
#pragma unroll
            for (int i = 0; i < 4; i++) store_io(p.out_format, reinterpret_cast<void *>(p.out), head * D + d + i, acc[j][i] * inv);
          }
          if (j0 == 0 && p.lse) reinterpret_cast<float *>(p.lse)[head] = sum > 0.0f ? top + logf(sum) : -INFINITY;
        };
        if (per_row >= V4) merge(std::integral_constant<uint32_t, 1>{});
        else merge(std::integral_constant<uint32_t, EPT>{});
      }
    }
    if constexpr (KB || VB) fence_proxy_async();
    __syncthreads(); // shared memory is reused by the next item
  }
}

} // namespace

// Registers a thread may use: as many blocks of one row tile per multiprocessor as shared memory
// allows on sm_90 (head_dim 64: 4; 128: 3, or 2 for float pages with three stages; 256: 1), 65536
// registers shared, allocated 8 at a time. ptxas, left to itself, may take a few more and lose a
// block (128 with 3 blocks: 170 would leave 2).
constexpr int mma_registers(int d, int blocks) { return d == 64 ? 128 : blocks == 3 ? 168 : 255; }
constexpr int mma_blocks(int d, int stages, bool float_pages) {
  return d == 64 ? 4 : d == 256 ? 1 : float_pages && stages == 3 ? 2 : 3;
}

#define PKV_MMA_KERNEL(NAME, REGISTERS, T, D, KF, VF, NS)                                                    \
  extern "C" __global__ void __maxnreg__(REGISTERS) NAME(PkvDecodeParams p) {                                \
    decode_mma<D, KF, VF, NS, T<D, KF, VF>>(p);                                                              \
  }
// pkv_decode_mma<rows>_<head_dim>_<k format>_<v format>_<stages>: rows 16 (Wide) or 8 (Narrow) a
// tile, format numbers as in pkv_format.
#define PKV_MMA_TILE(T, R, D, KF, VF, NS)                                                                    \
  PKV_MMA_KERNEL(pkv_decode_mma##R##_##D##_##KF##_##VF##_##NS,                                               \
                 mma_registers(D, mma_blocks(D, NS, KF <= BF16 && VF <= BF16)), T, D, KF, VF, NS)
#define PKV_MMA(D, KF, VF, NS) PKV_MMA_TILE(Wide, 16, D, KF, VF, NS) PKV_MMA_TILE(Narrow1, 8, D, KF, VF, NS)
#define PKV_MMA_V(D, KF, NS) PKV_MMA(D, KF, 2, NS) PKV_MMA(D, KF, 3, NS) PKV_MMA(D, KF, 4, NS) PKV_MMA(D, KF, 5, NS)
#define PKV_MMA_KV(D, NS) PKV_MMA_V(D, 2, NS) PKV_MMA_V(D, 3, NS) PKV_MMA_V(D, 4, NS) PKV_MMA_V(D, 5, NS)
PKV_MMA_KV(64, 3)
PKV_MMA_KV(128, 3)
PKV_MMA_KV(256, 2)
// Float head_dim 128 with two stages (pkv_mma_fewer_stages).
PKV_MMA(128, 2, 2, 2) PKV_MMA(128, 2, 3, 2) PKV_MMA(128, 3, 2, 2) PKV_MMA(128, 3, 3, 2)
// The narrow head_dim 128 kernels with quantized K and Q4_0 V at 128 registers, four blocks a
// multiprocessor instead of three (pkv_decode_mma8_128_<k format>_5_3_4blocks): bound by instruction
// issue, they gain from the fourth block's warps, and the host plans for four blocks (H200: 32x4K
// Q4_0 16% faster, 128-sequence batches 5-15%, short batches even; 96 registers and five blocks
// lost 3-10% everywhere: docs/perf/2026-12-02-h200-cuda-session14.md).
PKV_MMA_KERNEL(pkv_decode_mma8_128_4_5_3_4blocks, 128, Narrow1, 128, 4, 5, 3)
PKV_MMA_KERNEL(pkv_decode_mma8_128_5_5_3_4blocks, 128, Narrow1, 128, 5, 5, 3)
// The narrow tile of 2 and 4 n-tiles (16 and 32 query rows) where K and V are quantized, head_dim 64
// and 128: pkv_decode_mma8x<n-tiles>_<head_dim>_<k format>_<v format>_3.
#define PKV_MMA_NARROW_NT(D, KF, VF)                                                                         \
  PKV_MMA_KERNEL(pkv_decode_mma8x2_##D##_##KF##_##VF##_3, mma_registers(D, 3), Narrow2, D, KF, VF, 3)      \
  PKV_MMA_KERNEL(pkv_decode_mma8x4_##D##_##KF##_##VF##_3, D == 64 ? 168 : 255, Narrow4, D, KF, VF, 3)
#define PKV_MMA_NARROW_Q(D) PKV_MMA_NARROW_NT(D, 4, 4) PKV_MMA_NARROW_NT(D, 4, 5) PKV_MMA_NARROW_NT(D, 5, 4) PKV_MMA_NARROW_NT(D, 5, 5)
PKV_MMA_NARROW_Q(64)
PKV_MMA_NARROW_Q(128)
// The group tile (sm_90a: the warpgroup MMA) for 32 query rows of Q4_0 K and V at head_dim 128,
// at 168 registers (three blocks a multiprocessor; at 128, four blocks, it spills and measured
// 1-13% slower): pkv_decode_mmag_128_5_5_3. Where Q8_0 is one of the formats it was no faster
// (-0.4% to +2%) than Narrow<4>, which keeps those. Other images lack it; the host then takes
// Narrow<4>.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
PKV_MMA_KERNEL(pkv_decode_mmag_128_5_5_3, 168, Group, 128, 5, 5, 3)
#endif
