// The specialised split-K decode for head_dim 64/128/256 and F16/BF16/Q8_0/Q4_0 pages (one kernel per
// head_dim and K/V format pair). One block serves one (chunk, KV head, tile of query heads):
//  - every K/V row of the chunk is loaded once, with 16-byte cp.async into a ring of shared-memory
//    stages several tiles deep, and serves every query head of the GQA group;
//  - thread (x, y, z): x covers 8 values of head_dim, y one query row (a query token's head of the
//    group: speculative verification shares the K/V loads too), z every BDZ-th token of a tile;
//  - scores in the log2 domain (q pre-scaled by scale * log2 e), one softmax rescale per tile;
//  - a sequence that has one chunk is written straight to out/lse; split ones leave partials for the
//    merge kernel (decode_generic.cu), so unsplit batches need no second launch.
#include <math.h>

#include "compensated_sum.cuh"
#include "device_format.cuh"
#include "variants.cuh"

using namespace pkv_dev;

namespace {

constexpr int VEC = 8;          // values of a row per thread
constexpr int TT = PKV_CUDA_CORE_TT; // tokens per z per tile
constexpr int NS = PKV_CUDA_CORE_STAGES;

// Values [8x, 8x + 8) of a row held in shared memory (data, then scales).
template <uint32_t F, int D> __device__ __forceinline__ void load8(const uint8_t *row, int x, float *out) {
  if constexpr (F == F16 || F == BF16) {
    const uint4 raw = *reinterpret_cast<const uint4 *>(row + x * 16);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if constexpr (F == F16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      } else {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  } else {
    constexpr int data = F == Q8_0 ? D : D / 2;
    const int group = x / 4; // 32 values a scale, 8 a thread
    const float scale = half_to_float(reinterpret_cast<const uint16_t *>(row + data)[group]);
    if constexpr (F == Q8_0) {
      const uint2 raw = *reinterpret_cast<const uint2 *>(row + x * 8);
      const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
      for (int i = 0; i < 8; i++) out[i] = float(int8_t(w[i / 4] >> (8 * (i % 4)))) * scale;
    } else {
      // Element e of a group sits in byte e % 16, low nibble for e < 16: 8 consecutive values come
      // from 8 consecutive bytes, all low or all high.
      const int e = (x % 4) * 8;
      const uint2 raw = *reinterpret_cast<const uint2 *>(row + group * 16 + (e % 16));
      const uint32_t w[2] = {raw.x, raw.y};
      const int shift = e < 16 ? 0 : 4;
#pragma unroll
      for (int i = 0; i < 8; i++) out[i] = float(int((w[i / 4] >> (8 * (i % 4) + shift)) & 15u) - 8) * scale;
    }
  }
}

template <uint32_t F, int D> struct Row {
  static constexpr uint32_t data = F == Q8_0 ? D : F == Q4_0 ? D / 2 : 2 * D;
  static constexpr uint32_t scales = (F == Q8_0 || F == Q4_0) ? D / 32 * 2 : 0;
  static constexpr uint32_t stride = (data + scales + 15) / 16 * 16; // in shared memory
};

template <int D, uint32_t KF, uint32_t VF> __device__ void decode_cuda_core(const PkvDecodeParams &p) {
  using KRow = Row<KF, D>;
  using VRow = Row<VF, D>;
  constexpr int BDX = D / VEC;
  const int BDY = blockDim.y, BDZ = blockDim.z;
  const int x = threadIdx.x, y = threadIdx.y, z = threadIdx.z;
  const int tid = x + BDX * (y + BDY * z), threads = BDX * BDY * BDZ;
  const int tile_tokens = TT * BDZ;
  const uint32_t stage_bytes = tile_tokens * (KRow::stride + VRow::stride);
  extern __shared__ uint4 smem_words[];
  uint8_t *smem = reinterpret_cast<uint8_t *>(smem_words);

  const PkvPool &pool = p.pool;
  const PkvRecord c = reinterpret_cast<const PkvRecord *>(p.records)[blockIdx.x];
  const uint32_t h = blockIdx.y, group = p.q_heads / pool.kv_heads;
  const uint32_t row = blockIdx.z * BDY + y; // this thread's query row: token row / group, head row % group
  const bool head_valid = row < c.tokens * group;
  const uint32_t tok = row / group, g = row % group;
  const uint64_t head = (uint64_t(c.q_row) + tok) * p.q_heads + h * group + g;
  const uint32_t visible = c.length - c.tokens + tok + 1; // counted from c.start
  const ScoreVariants vary = score_variants(p, kLog2e);
  const float slope = head_valid ? row_slope(p, h * group + g, kLog2e) : 0.0f;
  const uint8_t *tree = head_valid ? tree_row(p, c, tok) : nullptr;

  // l and acc take each tile's sums with compensation (compensated_sum.cuh): a tile's few weights
  // add plainly, the running sums carry what each tile's addition lost.
  float q[VEC], acc[VEC], acc_lost[VEC];
  const float q_scale = p.scale * kLog2e; // scores in log2 units
#pragma unroll
  for (int j = 0; j < VEC; j++) {
    q[j] = head_valid ? load_io(p.q_format, reinterpret_cast<const void *>(p.q), head * D + x * VEC + j) * q_scale : 0.0f;
    acc[j] = acc_lost[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f, l_lost = 0.0f;

  const uint32_t *table = reinterpret_cast<const uint32_t *>(pool.table) + uint64_t(c.slot) * pool.table_stride;
  const uint8_t *layer_base = reinterpret_cast<const uint8_t *>(pool.base) + uint64_t(p.layer) * pool.pages * pool.block_bytes;
  const uint32_t n = c.token_end - c.token_begin;
  const int tiles = int((n + tile_tokens - 1) / tile_tokens);

  // Queues the copies of tile `tile` into its stage, or nothing past the end (the group stays empty).
  auto issue = [&](int tile) {
    if (tile < tiles) {
      uint8_t *stage = smem + (tile % NS) * stage_bytes;
      const uint32_t t0 = c.token_begin + tile * tile_tokens;
      constexpr int k_pieces = KRow::data / 16, v_pieces = VRow::data / 16;
      constexpr int pieces = k_pieces + v_pieces + (KRow::scales ? 1 : 0) + (VRow::scales ? 1 : 0);
      for (int i = tid; i < tile_tokens * pieces; i += threads) {
        const int r = i / pieces, piece = i % pieces;
        const uint32_t t = t0 + r;
        if (t >= c.token_end) continue;
        const uint32_t at = c.start + t;
        const uint32_t page = table[at >> pool.page_shift];
        if (page >= pool.pages) continue; // a corrupted table must not read outside the pool (the row
                                          // then holds stale bytes: a corrupted table gives garbage, safely)
        const uint64_t row = (uint64_t(h) << pool.page_shift) + (at & (pool.page_size - 1));
        const uint8_t *k_part = layer_base + uint64_t(page) * pool.block_bytes, *v_part = k_part + pool.k_bytes;
        uint8_t *k_row = stage + r * KRow::stride, *v_row = stage + tile_tokens * KRow::stride + r * VRow::stride;
        if (piece < k_pieces) cp_async(k_row + piece * 16, k_part + row * KRow::data + piece * 16, 16);
        else if (piece < k_pieces + v_pieces)
          cp_async(v_row + (piece - k_pieces) * 16, v_part + row * VRow::data + (piece - k_pieces) * 16, 16);
        else if (KRow::scales && piece == k_pieces + v_pieces)
          cp_async(k_row + KRow::data, k_part + pool.k.scale_offset + row * KRow::scales, KRow::scales);
        else
          cp_async(v_row + VRow::data, v_part + pool.v.scale_offset + row * VRow::scales, VRow::scales);
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < NS - 1; s++) issue(s);
  for (int tile = 0; tile < tiles; tile++) {
    issue(tile + NS - 1);
    cp_async_wait<NS - 1>();
    __syncthreads();
    const uint8_t *stage = smem + (tile % NS) * stage_bytes;
    const uint32_t t0 = c.token_begin + tile * tile_tokens;
    float s[TT];
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < TT; i++) {
      const int r = z + BDZ * i;
      const uint32_t t = t0 + r;
      float k[VEC];
      load8<KF, D>(stage + r * KRow::stride, x, k);
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < VEC; j++) dot += q[j] * k[j];
#pragma unroll
      for (int o = BDX / 2; o > 0; o /= 2) dot += shfl_xor(dot, o, BDX);
      s[i] = t < c.token_end && t < visible && !tree_hides(tree, c.new_begin, c.start + t) ? dot : -INFINITY;
      if (vary.on && s[i] != -INFINITY) s[i] = vary_score(s[i], t, visible, slope, vary);
      tile_max = fmaxf(tile_max, s[i]);
    }
    const float m_new = fmaxf(m, tile_max);
    if (m_new != -INFINITY) {
      const float correction = exp2f(m - m_new);
      float tile_l = 0.0f, tile_acc[VEC] = {};
#pragma unroll
      for (int i = 0; i < TT; i++) {
        if (s[i] == -INFINITY) continue; // past the chunk: its stage bytes are stale
        const float w = exp2f(s[i] - m_new);
        float v[VEC];
        load8<VF, D>(stage + tile_tokens * KRow::stride + (z + BDZ * i) * VRow::stride, x, v);
        tile_l += w;
#pragma unroll
        for (int j = 0; j < VEC; j++) tile_acc[j] += w * v[j];
      }
      compensated_step(l, l_lost, correction, tile_l);
#pragma unroll
      for (int j = 0; j < VEC; j++) compensated_step(acc[j], acc_lost[j], correction, tile_acc[j]);
      m = m_new;
    }
    __syncthreads(); // the stage is refilled next
  }
  cp_async_wait<0>();
  __syncthreads();

  // Combine the z slices through shared memory (the stages are free now); z = 0 writes.
  float *sm_acc = reinterpret_cast<float *>(smem);           // [BDZ][BDY][D]
  float *sm_ml = sm_acc + size_t(BDZ) * BDY * D;             // [BDZ][BDY][2]
#pragma unroll
  for (int j = 0; j < VEC; j++) sm_acc[(size_t(z) * BDY + y) * D + x * VEC + j] = acc[j] - acc_lost[j];
  if (x == 0) {
    sm_ml[(z * BDY + y) * 2] = m;
    sm_ml[(z * BDY + y) * 2 + 1] = l - l_lost;
  }
  __syncthreads();
  if (z != 0 || !head_valid) return;
  float top = -INFINITY;
  for (int w = 0; w < BDZ; w++) top = fmaxf(top, sm_ml[(w * BDY + y) * 2]);
  float sum = 0.0f, o[VEC] = {}; // a row that saw nothing of the chunk keeps sum 0: lse -inf
  for (int w = 0; w < BDZ; w++) {
    const float mw = sm_ml[(w * BDY + y) * 2];
    const float weight = mw == -INFINITY ? 0.0f : exp2f(mw - top);
    sum += weight * sm_ml[(w * BDY + y) * 2 + 1];
#pragma unroll
    for (int j = 0; j < VEC; j++) o[j] += weight * sm_acc[(size_t(w) * BDY + y) * D + x * VEC + j];
  }
  if (c.part == kNoPart) { // the sink joins the sequence's result once (the merge joins a split one's)
    const float rescale = join_sink<true>(top, sum, row_sink(p, h * group + g, kLog2e));
#pragma unroll
    for (int j = 0; j < VEC; j++) o[j] *= rescale;
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const float lse = sum > 0.0f ? (top + log2f(sum)) * 0.6931471805599453f : -INFINITY; // natural log
  if (c.part == kNoPart) {
#pragma unroll
    for (int j = 0; j < VEC; j++) store_io(p.out_format, reinterpret_cast<void *>(p.out), head * D + x * VEC + j, o[j] * inv);
    if (x == 0 && p.lse) reinterpret_cast<float *>(p.lse)[head] = lse;
  } else {
    const uint64_t part = (uint64_t(c.part) * p.q_tokens + tok) * p.q_heads + h * group + g;
#pragma unroll
    for (int j = 0; j < VEC; j++) reinterpret_cast<float *>(p.part_out)[part * D + x * VEC + j] = o[j] * inv;
    if (x == 0) reinterpret_cast<float *>(p.part_lse)[part] = lse;
  }
}

} // namespace

// pkv_decode_cuda_core_<head_dim>_<k format>_<v format>, format numbers as in pkv_format.
#define PKV_FAST(D, KF, VF)                                                                        \
  extern "C" __global__ void __launch_bounds__(PKV_CUDA_CORE_MAX_THREADS)                               \
      pkv_decode_cuda_core_##D##_##KF##_##VF(PkvDecodeParams p) {                                       \
    decode_cuda_core<D, KF, VF>(p);                                                                     \
  }
#define PKV_CUDA_CORE_V(D, KF) PKV_FAST(D, KF, 2) PKV_FAST(D, KF, 3) PKV_FAST(D, KF, 4) PKV_FAST(D, KF, 5)
#define PKV_CUDA_CORE_KV(D) PKV_CUDA_CORE_V(D, 2) PKV_CUDA_CORE_V(D, 3) PKV_CUDA_CORE_V(D, 4) PKV_CUDA_CORE_V(D, 5)
PKV_CUDA_CORE_KV(64)
PKV_CUDA_CORE_KV(128)
PKV_CUDA_CORE_KV(256)
