// The tensor-core extend (sm_80 and newer) over F16, BF16, Q8_0, Q4_0 and FP8 pages: many new tokens of a sequence attend
// causally over its positions, as in a prefill, a prompt chunk or a prefix-cache hit. Where decode
// spreads a stage's tokens over the warps (few query rows, every warp all of them), here each of the
// block's four warps takes 16 query rows of the tile and every token of a stage, so a K/V row read
// into shared memory serves 64 query rows (a sequence's new tokens times the GQA group).
//  - An item is (sequence, KV head, tile of 64 rows); a block takes one, over every position up to
//    its last row's (no split: a prefill has items enough to fill the device). K and V rows stream
//    through shared-memory stages of 64 positions by cp.async; q waits there in 16-bit parts.
//  - Q8_0, Q4_0 and FP8 rows arrive as the pages hold them and are widened once a stage into F16 rows
//    in shared memory (each value times its group's scale, rounded to f16; FP8 values exactly, the
//    plane's scale multiplying the scores and the output instead), which all 64 query rows then read.
//  - S = Q K^T and O = P V on the tensor cores (m16n8k16, fp32 accumulation). q enters in one part
//    where its format is the one K's MMAs take (exact), or where K is quantized (its f16 values are
//    rounded already), else as a high and a low part; P as two parts of the format V's MMAs take
//    (~16-22 bits, the precision decode keeps), or one where K is quantized: its logits are off by
//    ~0.4% of their spread already (tests/support/oracle.c), P's rounding to f16 by 2^-12. Scores
//    are in log2 units, times the scale in fp32 (q unscaled, so its parts keep their bits whatever
//    the scale).
//  - Only the stages that reach past the tile's first row's position mask (causal, and the rows past
//    the tile's end); the others check nothing.
#include <math.h>

#include "tensor_core/float_parts.cuh"
#include "tensor_core/online_softmax.cuh"
#include "tensor_core/ptx.cuh"
#include "tensor_core/widen_rows.cuh"

using namespace pkv_mma;

namespace {

constexpr int ROWS = PKV_EXTEND_ROWS, KEYS = PKV_EXTEND_KEYS, NS = PKV_EXTEND_STAGES;
constexpr int EXTEND_THREADS = ROWS / 16 * 32;

// A plane's rows in format F as a stage holds them (pkv_extend_row_bytes): `wide` ones (F16, BF16)
// as the MMAs take them, the others widened to F16 rows first.
template <uint32_t F, int D> struct Stored {
  static constexpr bool wide = pkv_extend_wide(F);
  static constexpr uint32_t mma_format = wide ? F : F16;
  static constexpr uint32_t data = F == Q4_0 ? D / 2 : F == Q8_0 || F == FP8_E4M3 || F == FP8_E5M2 ? D : 2 * D;
  static constexpr uint32_t scales = F == Q8_0 || F == Q4_0 ? D / 16 : 0; // an f16 scale a group of 32
  static constexpr uint32_t stride = pkv_extend_row_bytes(D, F);
  static constexpr int pieces = int(data / 16); // 16-byte pieces of data a row
};

// Two int8 (or, with BIAS 8, 4-bit) values in the low bytes of x's halves 0x00XX as f16: placed in the
// mantissa of 1024 (exact below 2048), then the offset taken off.
template <int BIAS> __device__ __forceinline__ __half2 small_ints_f16(uint32_t bytes_0x00xx) {
  const uint32_t h = bytes_0x00xx | 0x64006400u;
  return __hsub2(*reinterpret_cast<const __half2 *>(&h), __float2half2_rn(1024.0f + BIAS));
}

// Widens a stage's KEYS rows stored as F (Q8_0, Q4_0, FP8) at `src` into F16 rows STRIDE bytes apart
// at `dst`, 16 values a thread at a time.
template <uint32_t F, int D, uint32_t STRIDE> __device__ __forceinline__ void widen(const uint8_t *src, uint8_t *dst, int tid) {
  using S = Stored<F, D>;
  constexpr int CHUNKS = D / 16;
  for (int e = tid; e < KEYS * CHUNKS; e += EXTEND_THREADS) {
    const int key = e / CHUNKS, c = e % CHUNKS;
    const uint8_t *row = src + key * S::stride;
    uint32_t y[8];
    if constexpr (F == Q8_0 || F == Q4_0) {
      const uint16_t scale = reinterpret_cast<const uint16_t *>(row + S::data)[c / 2];
      const __half2 s2 = __halves2half2(__ushort_as_half(scale), __ushort_as_half(scale));
      // Q8_0: values 16 c.. are bytes 16 c.., as int8 (offset by 128). Q4_0: group c / 2's 16 bytes,
      // low nibbles values 0-15, high nibbles 16-31 (offset by 8).
      const uint4 x = *reinterpret_cast<const uint4 *>(row + (F == Q8_0 ? 16 * c : 16 * (c / 2)));
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const uint32_t b = F == Q8_0 ? w[i] ^ 0x80808080u : (c % 2 ? w[i] >> 4 : w[i]) & 0x0f0f0f0fu;
        constexpr int BIAS = F == Q8_0 ? 128 : 8;
        const __half2 lo = __hmul2(small_ints_f16<BIAS>(__byte_perm(b, 0, 0x4140)), s2);
        const __half2 hi = __hmul2(small_ints_f16<BIAS>(__byte_perm(b, 0, 0x4342)), s2);
        y[2 * i] = *reinterpret_cast<const uint32_t *>(&lo);
        y[2 * i + 1] = *reinterpret_cast<const uint32_t *>(&hi);
      }
    } else {
      const uint4 x = *reinterpret_cast<const uint4 *>(row + 16 * c);
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int i = 0; i < 4; i++) y[2 * i] = fp8x2_to_f16x2<F>(w[i]), y[2 * i + 1] = fp8x2_to_f16x2<F>(w[i] >> 16);
    }
    uint4 *out = reinterpret_cast<uint4 *>(dst + key * STRIDE + 32 * c);
    out[0] = make_uint4(y[0], y[1], y[2], y[3]);
    out[1] = make_uint4(y[4], y[5], y[6], y[7]);
  }
}

// A block's shared memory: NS stages (K rows, then V rows), the widened rows of planes that are not
// F16 or BF16 (K's, then V's), q's QP parts.
template <int D, uint32_t SKF, uint32_t SVF, int QP> struct Layout {
  static constexpr uint32_t STRIDE = 2 * D + 16; // bytes a 16-bit row
  static constexpr uint32_t STAGE = KEYS * (Stored<SKF, D>::stride + Stored<SVF, D>::stride);
  static constexpr uint32_t WIDENED = KEYS * STRIDE * (!Stored<SKF, D>::wide + !Stored<SVF, D>::wide);
  static_assert(pkv_extend_shared_bytes(D, SKF, SVF, QP) == NS * STAGE + WIDENED + QP * ROWS * STRIDE,
                "the host sizes shared memory alike");
};

// SKF, SVF: the pages' formats; QP: q's parts.
template <int D, uint32_t SKF, uint32_t SVF, int QP> __device__ void extend_mma(const PkvExtendParams &p) {
  using SK = Stored<SKF, D>;
  using SV = Stored<SVF, D>;
  using L = Layout<D, SKF, SVF, QP>;
  constexpr bool KH = SK::mma_format == F16, VH = SV::mma_format == F16; // each MMA in its rows' format
  constexpr uint32_t STRIDE = L::STRIDE, STAGE = L::STAGE, WIDENED = L::WIDENED;
  constexpr int DT = D / 8; // the output's n-tiles
  constexpr int PP = SKF == Q8_0 || SKF == Q4_0 ? 1 : 2; // P's parts
  extern __shared__ uint4 smem_words[];
  uint8_t *const smem = reinterpret_cast<uint8_t *>(smem_words);
  uint8_t *const widened = smem + NS * STAGE; // K's widened rows (if any), then V's
  uint8_t *const q_sm = widened + WIDENED;      // [part][row]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gid = lane / 4, tig = lane % 4;
  const PkvPool &pool = p.pool;
  const PkvExtendItem it = reinterpret_cast<const PkvExtendItem *>(p.items)[blockIdx.x];
  const uint32_t group = p.q_heads / pool.kv_heads, rows = it.tokens * group, r0 = it.tile * ROWS;
  const uint32_t first = it.length - it.tokens; // the first new token's position
  const uint32_t last_row = min(rows, r0 + ROWS) - 1;
  const uint32_t keys = first + last_row / group + 1; // the positions the tile's last row sees
  const int tiles = int((keys + KEYS - 1) / KEYS);
  // Stages before this one are seen whole by every row of the tile.
  const int plain_tiles = int((first + r0 / group + 1) / KEYS);

  // Where query row r (of the tile) lies in q and out.
  auto q_head = [&](uint32_t r) {
    const uint32_t row = r0 + r;
    return (uint64_t(it.q_row) + row / group) * p.q_heads + it.head * group + row % group;
  };

  const uint32_t *table = reinterpret_cast<const uint32_t *>(pool.table) + uint64_t(it.slot) * pool.table_stride;
  const uint8_t *layer_base = reinterpret_cast<const uint8_t *>(pool.base) + uint64_t(p.layer) * pool.pages * pool.block_bytes;
  const uint32_t in_page = pool.page_size - 1;
  // Queues K's (or, v, V's) rows of stage `tile` stored as S at `rows`: each thread the same 16-byte
  // pieces of a few positions' rows, a thread a row for a quantized row's scales; positions past the
  // tile's last (and a corrupted table entry's) are zeros.
  auto queue = [&](auto plane, bool v, int tile, uint8_t *rows) {
    using S = decltype(plane);
    const uint64_t part = v ? pool.k_bytes : 0;
    const uint32_t row_bytes = v ? pool.v.row_data_bytes : pool.k.row_data_bytes;
    auto where = [&](int key, const uint8_t **row_part, uint32_t *row) { // false: nothing to read
      const uint32_t t = uint32_t(tile) * KEYS + key;
      const uint32_t page = t < keys ? table[t >> pool.page_shift] : pool.pages;
      *row_part = layer_base + (page < pool.pages ? uint64_t(page) * pool.block_bytes : 0) + part;
      *row = (it.head << pool.page_shift) + (t & in_page);
      return page < pool.pages;
    };
#pragma unroll
    for (int i = 0; i < (KEYS * S::pieces + EXTEND_THREADS - 1) / EXTEND_THREADS; i++) {
      const int e = tid + i * EXTEND_THREADS, key = e / S::pieces, piece = e % S::pieces;
      if (KEYS * S::pieces % EXTEND_THREADS && e >= KEYS * S::pieces) break;
      const uint8_t *row_part;
      uint32_t row;
      const bool valid = where(key, &row_part, &row);
      cp_async_zfill(rows + key * S::stride + piece * 16, row_part + uint64_t(row) * row_bytes + piece * 16, valid);
    }
    if constexpr (S::scales != 0) {
      const int key = tid - (v ? KEYS : 0); // K's scales by threads 0-63, V's by 64-127
      if (key >= 0 && key < KEYS) {
        const uint8_t *row_part;
        uint32_t row;
        const bool valid = where(key, &row_part, &row);
        const uint64_t at = (v ? pool.v.scale_offset : pool.k.scale_offset) + uint64_t(row) * S::scales;
        if constexpr (S::scales == 16) cp_async_zfill(rows + key * S::stride + S::data, row_part + at, valid);
        else cp_async_small_zfill<S::scales>(rows + key * S::stride + S::data, row_part + at, valid);
      }
    }
  };
  // Queues stage `tile` into slot `slot`.
  auto issue = [&](int tile, int slot) {
    if (tile < tiles) {
      uint8_t *stage = smem + slot * STAGE;
      queue(SK{}, false, tile, stage);
      queue(SV{}, true, tile, stage + KEYS * SK::stride);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < NS - 1; s++) issue(s, s);

  // q into shared memory in the format of K's MMAs, QP parts (zeros past the tile's rows), while the first
  // stages load: 8 values a thread at a time.
  for (int e = tid; e < ROWS * D / 8; e += EXTEND_THREADS) {
    const uint32_t r = e / (D / 8), d0 = e % (D / 8) * 8;
    float v[8];
    const bool valid = r0 + r < rows;
    const uint64_t at = valid ? q_head(r) * D + d0 : 0;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = valid ? load_io(p.q_format, reinterpret_cast<const void *>(p.q), at + i) : 0.0f;
    uint32_t w[QP][4];
#pragma unroll
    for (int i = 0; i < 4; i++) pair_parts<KH, QP>(v[2 * i], v[2 * i + 1], &w[0][i], 4);
#pragma unroll
    for (int part = 0; part < QP; part++)
      *reinterpret_cast<uint4 *>(q_sm + (part * ROWS + r) * STRIDE + d0 * 2) =
          make_uint4(w[part][0], w[part][1], w[part][2], w[part][3]);
  }

  // This warp's rows 16 warp + gid (i = 0) and + 8 (i = 1): their positions, running max (log2 units)
  // and sum, and their D outputs (o[j][2 i + c]: row i, value 8 j + 2 tig + c).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[DT][4] = {};
  uint32_t seen[2]; // positions up to this one are seen; 0 past the tile's rows (nothing written)
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const uint32_t row = r0 + 16 * warp + gid + 8 * i;
    seen[i] = row < rows ? first + row / group + 1 : 0;
  }
  // FP8 pages: the planes' scales of this KV head, K's on the scores, V's on the output.
  const float mul = p.scale * kLog2e * plane_scale(pool, false, p.layer, it.head);
  const float v_scale = plane_scale(pool, true, p.layer, it.head);
  // Matrix-load addresses of this lane: q's 16 x 16 blocks (rows + lane % 16, values + 8 (lane / 16)),
  // K's 8 positions x 32 values (positions + lane % 8, values + 8 (lane / 8)), V's 16 positions x 16
  // values, transposed (positions + lane % 16, values + 8 (lane / 16)).
  const uint8_t *q_lane = q_sm + (16 * warp + lane % 16) * STRIDE + lane / 16 * 16;
  const uint32_t k_lane = lane % 8 * STRIDE + lane / 8 * 16, v_lane = lane % 16 * STRIDE + lane / 16 * 16;

  for (int tile = 0; tile < tiles; tile++) {
    const int slot = tile % NS;
    issue(tile + NS - 1, (tile + NS - 1) % NS);
    cp_async_wait<NS - 1>();
    __syncthreads(); // the stage (and, the first time, q) is in place
    const uint8_t *stage = smem + slot * STAGE;
    if constexpr (!SK::wide || !SV::wide) {
      if constexpr (!SK::wide) widen<SKF, D, STRIDE>(stage, widened, tid);
      if constexpr (!SV::wide) widen<SVF, D, STRIDE>(stage + KEYS * SK::stride, widened + (SK::wide ? 0 : KEYS * STRIDE), tid);
      __syncthreads();
    }
    // Where the MMAs find K's and V's 16-bit rows.
    const uint8_t *k_rows = SK::wide ? stage : widened;
    const uint8_t *v_rows = SV::wide ? stage + KEYS * SK::stride : widened + (SK::wide ? 0 : KEYS * STRIDE);

    // S = q K^T over the stage's 64 positions: s[n][e] row gid + 8 (e / 2), position 8 n + 2 tig + e % 2.
    float s[KEYS / 8][4] = {};
#pragma unroll
    for (int kp = 0; kp < D / 32; kp++) { // two k-steps
      uint32_t a[QP][2][4];
#pragma unroll
      for (int part = 0; part < QP; part++)
#pragma unroll
        for (int h = 0; h < 2; h++) ldmatrix<4, false>(a[part][h], q_lane + part * ROWS * STRIDE + (32 * kp + 16 * h) * 2);
#pragma unroll
      for (int n = 0; n < KEYS / 8; n++) {
        uint32_t b[4]; // k-step 2 kp: b[0], b[1]; 2 kp + 1: b[2], b[3]
        ldmatrix<4, false>(b, k_rows + k_lane + 8 * n * STRIDE + 64 * kp);
#pragma unroll
        for (int part = 0; part < QP; part++) {
          mma16<KH>(s[n], a[part][0], b[0], b[1]);
          mma16<KH>(s[n], a[part][1], b[2], b[3]);
        }
      }
    }
    const bool mask = tile >= plain_tiles;
    float top[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < KEYS / 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const uint32_t t = uint32_t(tile) * KEYS + 8 * n + 2 * tig + e % 2;
        s[n][e] = mask && t >= seen[e / 2] ? -INFINITY : s[n][e] * mul;
        top[e / 2] = fmaxf(top[e / 2], s[n][e]);
      }
    float base[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      top[i] = lanes_max<3>(top[i]);
      const float m_new = fmaxf(m[i], top[i]);
      const float correction = m_new == -INFINITY || m[i] == m_new ? 1.0f : exp2_ftz(m[i] - m_new);
      m[i] = m_new;
      base[i] = m_new == -INFINITY ? 0.0f : m_new;
      l[i] *= correction;
#pragma unroll
      for (int j = 0; j < DT; j++) o[j][2 * i] *= correction, o[j][2 * i + 1] *= correction;
    }
#pragma unroll
    for (int n = 0; n < KEYS / 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        s[n][e] = exp2_ftz(s[n][e] - base[e / 2]);
        l[e / 2] += s[n][e];
      }

    // O += P V, 16 positions a k-step: P's A fragment is two n-tiles of s, in PP parts.
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; kk++) {
      uint32_t a[PP][4];
      pair_parts<VH, PP>(s[2 * kk][0], s[2 * kk][1], &a[0][0], 4);
      pair_parts<VH, PP>(s[2 * kk][2], s[2 * kk][3], &a[0][1], 4);
      pair_parts<VH, PP>(s[2 * kk + 1][0], s[2 * kk + 1][1], &a[0][2], 4);
      pair_parts<VH, PP>(s[2 * kk + 1][2], s[2 * kk + 1][3], &a[0][3], 4);
#pragma unroll
      for (int jp = 0; jp < DT / 2; jp++) {
        uint32_t b[4]; // n-tile 2 jp: b[0], b[1]; 2 jp + 1: b[2], b[3]
        ldmatrix<4, true>(b, v_rows + v_lane + 16 * kk * STRIDE + 32 * jp);
#pragma unroll
        for (int part = 0; part < PP; part++) {
          mma16<VH>(o[2 * jp], a[part], b[0], b[1]);
          mma16<VH>(o[2 * jp + 1], a[part], b[2], b[3]);
        }
      }
    }
    __syncthreads(); // the stage is refilled next
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; i++) {
    const uint32_t r = 16 * warp + gid + 8 * i;
    const float sum = lanes_sum<3>(l[i]);
    if (!seen[i]) continue;
    const uint64_t head = q_head(r);
    const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
#pragma unroll
    for (int j = 0; j < DT; j++)
#pragma unroll
      for (int c = 0; c < 2; c++)
        store_io(p.out_format, reinterpret_cast<void *>(p.out), head * D + 8 * j + 2 * tig + c, o[j][2 * i + c] * inv);
    if (tig == 0 && p.lse)
      reinterpret_cast<float *>(p.lse)[head] = sum > 0.0f ? (m[i] + log2f(sum)) * 0.6931471805599453f : -INFINITY;
  }
}

} // namespace

// pkv_extend_mma_<head_dim>_<k format>_<v format>_<q parts>, formats numbered as in pkv_format: F16 or
// BF16 K with F16 or BF16 V, q in two parts or one; quantized K with any V but FP8 and F32, q in one
// part (Q4_0 K at head_dim 256 only); FP8 K with FP8 V, q in two parts or one. (Float K with quantized
// V is left to the decode kernels: a widened V value's rounding to f16 would pass the precision float K
// keeps. So is Q4_0 K at head_dim 64 and 128: KernelChoice::extend says why.)
#define PKV_EXTEND_KERNEL(D, KF, VF, QP)                                                                     \
  extern "C" __global__ void __launch_bounds__(EXTEND_THREADS)                                               \
      pkv_extend_mma_##D##_##KF##_##VF##_##QP(PkvExtendParams p) {                                           \
    extend_mma<D, KF, VF, QP>(p);                                                                            \
  }
#define PKV_EXTEND_Q(D, KF, VF) PKV_EXTEND_KERNEL(D, KF, VF, 1) PKV_EXTEND_KERNEL(D, KF, VF, 2)
#define PKV_EXTEND_Q1(D, KF, VF) PKV_EXTEND_KERNEL(D, KF, VF, 1)
#define PKV_EXTEND_QV(D, KF) PKV_EXTEND_Q1(D, KF, 2) PKV_EXTEND_Q1(D, KF, 3) PKV_EXTEND_Q1(D, KF, 4) PKV_EXTEND_Q1(D, KF, 5)
#define PKV_EXTEND_D(D)                                                                                      \
  PKV_EXTEND_Q(D, 2, 2) PKV_EXTEND_Q(D, 2, 3) PKV_EXTEND_Q(D, 3, 2) PKV_EXTEND_Q(D, 3, 3) PKV_EXTEND_QV(D, 4)  \
  PKV_EXTEND_Q(D, 6, 6) PKV_EXTEND_Q(D, 6, 7) PKV_EXTEND_Q(D, 7, 6) PKV_EXTEND_Q(D, 7, 7)
PKV_EXTEND_D(64)
PKV_EXTEND_D(128)
PKV_EXTEND_D(256)
PKV_EXTEND_QV(256, 5)
