// The tensor-core extend (sm_80 and newer) over F16/BF16 pages: many new tokens of a sequence attend
// causally over its positions, as in a prefill, a prompt chunk or a prefix-cache hit. Where decode
// spreads a stage's tokens over the warps (few query rows, every warp all of them), here each of the
// block's four warps takes 16 query rows of the tile and every token of a stage, so a K/V row read
// into shared memory serves 64 query rows (a sequence's new tokens times the GQA group).
//  - An item is (sequence, KV head, tile of 64 rows); a block takes one, over every position up to
//    its last row's (no split: a prefill has items enough to fill the device). K and V rows stream
//    through shared-memory stages of 64 positions by cp.async; q waits there in 16-bit parts.
//  - S = Q K^T and O = P V on the tensor cores (m16n8k16, fp32 accumulation). q enters in one part
//    where its format is K's pages' (exact), else as a high and a low part; P always as two parts,
//    of V's format: ~16-22 bits, the precision decode keeps. Scores are in log2 units, times the
//    scale in fp32 (q unscaled, so its parts keep their bits whatever the scale).
//  - Only the stages that reach past the tile's first row's position mask (causal, and the rows past
//    the tile's end); the others check nothing.
#include <math.h>

#include "tensor_core/float_parts.cuh"
#include "tensor_core/online_softmax.cuh"
#include "tensor_core/ptx.cuh"

using namespace pkv_mma;

namespace {

constexpr int ROWS = PKV_EXTEND_ROWS, KEYS = PKV_EXTEND_KEYS, NS = PKV_EXTEND_STAGES;
constexpr int EXTEND_THREADS = ROWS / 16 * 32;

// A block's shared memory: NS stages of K rows then V rows, then q's QP parts.
template <int D, int QP> struct Layout {
  static constexpr uint32_t STRIDE = 2 * D + 16;       // bytes a row
  static constexpr uint32_t STAGE = 2 * KEYS * STRIDE; // K rows, then V rows
  static_assert(pkv_extend_shared_bytes(D, QP) == NS * STAGE + QP * ROWS * STRIDE, "the host sizes shared memory alike");
};

// KF, VF: the pages' formats (F16 or BF16); QP: q's parts.
template <int D, uint32_t KF, uint32_t VF, int QP> __device__ void extend_mma(const PkvExtendParams &p) {
  constexpr bool KH = KF == F16, VH = VF == F16; // each MMA in its pages' format
  constexpr uint32_t STRIDE = Layout<D, QP>::STRIDE, STAGE = Layout<D, QP>::STAGE;
  constexpr int PIECES = 2 * D / 16; // 16-byte pieces a row
  constexpr int DT = D / 8;          // the output's n-tiles
  extern __shared__ uint4 smem_words[];
  uint8_t *const smem = reinterpret_cast<uint8_t *>(smem_words);
  uint8_t *const q_sm = smem + NS * STAGE; // [part][row]

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
  const uint32_t in_page = pool.page_size - 1, row_bytes = pool.k.row_data_bytes;
  // Queues stage `tile` into slot `slot`: each thread the same pieces of a few positions' K and V rows
  // (one page lookup serves both); positions past the tile's last are zeros.
  auto issue = [&](int tile, int slot) {
    if (tile < tiles) {
      uint8_t *stage = smem + slot * STAGE;
#pragma unroll
      for (int i = 0; i < KEYS * PIECES / EXTEND_THREADS; i++) {
        const int e = tid + i * EXTEND_THREADS, key = e / PIECES, piece = e % PIECES;
        const uint32_t t = uint32_t(tile) * KEYS + key;
        const uint32_t page = t < keys ? table[t >> pool.page_shift] : pool.pages;
        const bool valid = page < pool.pages;
        const uint8_t *src = layer_base + (valid ? uint64_t(page) * pool.block_bytes : 0) +
                             uint64_t((it.head << pool.page_shift) + (t & in_page)) * row_bytes + piece * 16;
        uint8_t *dst = stage + key * STRIDE + piece * 16;
        cp_async_zfill(dst, valid ? src : layer_base, valid);
        cp_async_zfill(dst + KEYS * STRIDE, valid ? src + pool.k_bytes : layer_base, valid);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < NS - 1; s++) issue(s, s);

  // q into shared memory in K's 16-bit format, QP parts (zeros past the tile's rows), while the first
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
  const float mul = p.scale * kLog2e;
  // Matrix-load addresses of this lane: q's 16 x 16 blocks (rows + lane % 16, values + 8 (lane / 16)),
  // K's 8 positions x 32 values (positions + lane % 8, values + 8 (lane / 8)), V's 16 positions x 16
  // values, transposed (positions + lane % 16, values + 8 (lane / 16)).
  const uint8_t *q_lane = q_sm + (16 * warp + lane % 16) * STRIDE + lane / 16 * 16;
  const uint32_t k_lane = lane % 8 * STRIDE + lane / 8 * 16, v_lane = KEYS * STRIDE + lane % 16 * STRIDE + lane / 16 * 16;

  for (int tile = 0; tile < tiles; tile++) {
    const int slot = tile % NS;
    issue(tile + NS - 1, (tile + NS - 1) % NS);
    cp_async_wait<NS - 1>();
    __syncthreads(); // the stage (and, the first time, q) is in place
    const uint8_t *stage = smem + slot * STAGE;

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
        ldmatrix<4, false>(b, stage + k_lane + 8 * n * STRIDE + 64 * kp);
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

    // O += P V, 16 positions a k-step: P's A fragment is two n-tiles of s, in two parts.
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; kk++) {
      uint32_t a[2][4];
      split_pair<VH>(s[2 * kk][0], s[2 * kk][1], &a[0][0], 4);
      split_pair<VH>(s[2 * kk][2], s[2 * kk][3], &a[0][1], 4);
      split_pair<VH>(s[2 * kk + 1][0], s[2 * kk + 1][1], &a[0][2], 4);
      split_pair<VH>(s[2 * kk + 1][2], s[2 * kk + 1][3], &a[0][3], 4);
#pragma unroll
      for (int jp = 0; jp < DT / 2; jp++) {
        uint32_t b[4]; // n-tile 2 jp: b[0], b[1]; 2 jp + 1: b[2], b[3]
        ldmatrix<4, true>(b, stage + v_lane + 16 * kk * STRIDE + 32 * jp);
#pragma unroll
        for (int part = 0; part < 2; part++) {
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
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
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

// pkv_extend_mma_<head_dim>_<k format>_<v format>_<q parts>, formats numbered as in pkv_format.
#define PKV_EXTEND_KERNEL(D, KF, VF, QP)                                                                     \
  extern "C" __global__ void __launch_bounds__(EXTEND_THREADS)                                               \
      pkv_extend_mma_##D##_##KF##_##VF##_##QP(PkvExtendParams p) {                                           \
    extend_mma<D, KF, VF, QP>(p);                                                                            \
  }
#define PKV_EXTEND_Q(D, KF, VF) PKV_EXTEND_KERNEL(D, KF, VF, 1) PKV_EXTEND_KERNEL(D, KF, VF, 2)
#define PKV_EXTEND_KV(D) PKV_EXTEND_Q(D, 2, 2) PKV_EXTEND_Q(D, 2, 3) PKV_EXTEND_Q(D, 3, 2) PKV_EXTEND_Q(D, 3, 3)
PKV_EXTEND_KV(64)
PKV_EXTEND_KV(128)
PKV_EXTEND_KV(256)
