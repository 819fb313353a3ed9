// The generic split-K paged decode, for every head_dim and page format: a partial kernel computes each
// chunk's attention for the query heads of one KV head (normalised output and log-sum-exp per head;
// a sequence's only chunk writes the result itself), and a merge kernel combines the chunks of split
// sequences through their log-sum-exp. The host plan (lib/plan.cpp) decides the chunks. The merge
// also serves the specialised kernels of decode_cuda_core.cu.
#include <math.h>

#include "compensated_sum.cuh"
#include "device_format.cuh"
#include "variants.cuh"

using namespace pkv_dev;

namespace {

__device__ __forceinline__ float warp_sum(float x) {
  for (int m = 16; m > 0; m >>= 1) x += shfl_xor(x, m);
  return x;
}

// Block: PKV_DECODE_WARPS warps take the chunk's tokens in turn; lane l holds dims l, l + 32, ... of
// every row, which for Q8_0/Q4_0 is element l of each 32-value group. Grid: (chunk, KV head, tile of
// up to PKV_HEAD_TILE query heads). NV = head_dim / 32.
template <int NV> __device__ void decode_partial(const PkvDecodeParams &p) {
  constexpr int T = PKV_HEAD_TILE, W = PKV_DECODE_WARPS, D = NV * 32;
  __shared__ float sm_m[W][T], sm_l[W][T];
  __shared__ float sm_acc[W][T][D];

  const PkvPool &pool = p.pool;
  const PkvRecord c = reinterpret_cast<const PkvRecord *>(p.records)[blockIdx.x];
  // The block's rows: query (token, head of the group) pairs g0 .. g0 + gt of the record's tokens * group.
  const uint32_t h = blockIdx.y, group = p.q_heads / pool.kv_heads, rows = c.tokens * group, g0 = blockIdx.z * T;
  if (g0 >= rows) return; // a tile past a record of fewer tokens
  const uint32_t gt = min(uint32_t(T), rows - g0);
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const ScoreVariants vary = score_variants(p, 1.0f); // scores in natural units
  const float k_scale = plane_scale(pool, false, p.layer, h), v_scale = plane_scale(pool, true, p.layer, h);

  // l and acc carry compensation terms (Kahan): beside a dominant token's weight of 1, the weights
  // of thousands of tokens ~17 logits below (4e-8 each) fall under half an ulp and would each be
  // dropped, taking a quarter of the sum's tail and 1.7e-4 off lse at 16K tokens.
  float q[T][NV], acc[T][NV], acc_lost[T][NV], m[T], l[T], l_lost[T], slope[T];
  uint32_t visible[T]; // positions below this are the row's context (counted from c.start)
  const uint8_t *tree[T]; // the row's tree-mask bits, or null
#pragma unroll
  for (int g = 0; g < T; g++) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    l_lost[g] = 0.0f;
    const uint32_t tok = (g0 + g) / group;
    visible[g] = c.length - c.tokens + tok + 1;
    slope[g] = g < gt ? row_slope(p, h * group + (g0 + g) % group, 1.0f) : 0.0f;
    tree[g] = g < gt ? tree_row(p, c, tok) : nullptr;
    const uint64_t head = (uint64_t(c.q_row) + tok) * p.q_heads + h * group + (g0 + g) % group;
#pragma unroll
    for (int j = 0; j < NV; j++) {
      acc[g][j] = acc_lost[g][j] = 0.0f;
      const uint64_t qi = head * D + lane + 32 * j;
      q[g][j] = g < gt ? load_io(p.q_format, reinterpret_cast<const void *>(p.q), qi) * p.scale : 0.0f;
    }
  }

  const uint32_t *row = reinterpret_cast<const uint32_t *>(pool.table) + uint64_t(c.slot) * pool.table_stride;
  // 64-bit positions: a chunk ending within W tokens of 2^32 would wrap a 32-bit one forever.
  for (uint64_t t = c.token_begin + warp; t < c.token_end; t += W) {
    const uint64_t at = c.start + t;
    const uint32_t page = row[at / pool.page_size], slot = uint32_t(at % pool.page_size);
    if (page >= pool.pages) continue; // a corrupted table must not read outside the pool
    const uint8_t *kp = part(pool, p.layer, page, false), *vp = part(pool, p.layer, page, true);
    float kv[NV], vv[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) {
      kv[j] = load_value(pool.k, pool, kp, h, slot, lane + 32 * j, k_scale);
      vv[j] = load_value(pool.v, pool, vp, h, slot, lane + 32 * j, v_scale);
    }
#pragma unroll
    for (int g = 0; g < T; g++) {
      if (g >= gt) break;
      if (t >= visible[g] || tree_hides(tree[g], c.new_begin, uint32_t(at))) continue;
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < NV; j++) s += q[g][j] * kv[j];
      s = warp_sum(s);
      if (vary.on) {
        s = vary_score(s, uint32_t(t), visible[g], slope[g], vary);
        if (s == -INFINITY) continue; // the window hides it (alike in every lane)
      }
      const float m_new = fmaxf(m[g], s);
      const float correction = expf(m[g] - m_new), w = expf(s - m_new);
      compensated_step(l[g], l_lost[g], correction, w);
#pragma unroll
      for (int j = 0; j < NV; j++) compensated_step(acc[g][j], acc_lost[g][j], correction, w * vv[j]);
      m[g] = m_new;
    }
  }

#pragma unroll
  for (int g = 0; g < T; g++) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g] - l_lost[g];
    }
#pragma unroll
    for (int j = 0; j < NV; j++) sm_acc[warp][g][lane + 32 * j] = acc[g][j] - acc_lost[g][j];
  }
  __syncthreads();

  const bool single = c.part == kNoPart;
  for (uint32_t i = threadIdx.x; i < gt * D; i += blockDim.x) {
    const uint32_t g = i / D, d = i % D;
    float top = -INFINITY;
    for (int w = 0; w < W; w++) top = fmaxf(top, sm_m[w][g]);
    float sum = 0.0f, o = 0.0f;
    for (int w = 0; w < W; w++) {
      const float weight = sm_m[w][g] == -INFINITY ? 0.0f : expf(sm_m[w][g] - top);
      sum += weight * sm_l[w][g];
      o += weight * sm_acc[w][g][d];
    }
    if (single) o *= join_sink<false>(top, sum, row_sink(p, h * group + (g0 + g) % group, 1.0f)); // once a row
    const float value = sum > 0.0f ? o / sum : 0.0f, lse = sum > 0.0f ? top + logf(sum) : -INFINITY;
    const uint32_t tok = (g0 + g) / group;
    const uint64_t head = (uint64_t(c.q_row) + tok) * p.q_heads + h * group + (g0 + g) % group;
    if (single) { // the sequence's only chunk: this is the result
      store_io(p.out_format, reinterpret_cast<void *>(p.out), head * D + d, value);
      if (d == 0 && p.lse) reinterpret_cast<float *>(p.lse)[head] = lse;
    } else {
      const uint64_t part = (uint64_t(c.part) * p.q_tokens + tok) * p.q_heads + h * group + (g0 + g) % group;
      reinterpret_cast<float *>(p.part_out)[part * D + d] = value;
      if (d == 0) reinterpret_cast<float *>(p.part_lse)[part] = lse;
    }
  }
}

} // namespace

#define PKV_DECODE_PARTIAL(NV)                                                                                     \
  extern "C" __global__ void __launch_bounds__(PKV_DECODE_WARPS * 32) pkv_decode_partial_##NV(PkvDecodeParams p) { \
    decode_partial<NV>(p);                                                                                         \
  }
PKV_DECODE_PARTIAL(1)
PKV_DECODE_PARTIAL(2)
PKV_DECODE_PARTIAL(3)
PKV_DECODE_PARTIAL(4)
PKV_DECODE_PARTIAL(5)
PKV_DECODE_PARTIAL(6)
PKV_DECODE_PARTIAL(7)
PKV_DECODE_PARTIAL(8)

// Grid: (sequence x query token, query head), q_tokens being the most a sequence of the plan has;
// thread d < head_dim. Chunks are combined in order, so the result is the same bits every run; a
// chunk the row sees nothing of has lse -inf and weighs nothing. A sequence with a single chunk (an
// empty one too) was written by the partial kernel.
extern "C" __global__ void pkv_decode_merge(PkvDecodeParams p) {
  const uint32_t s = blockIdx.x / p.q_tokens, tok = blockIdx.x % p.q_tokens, qh = blockIdx.y, D = p.pool.head_dim;
  const uint32_t *seq_chunks = reinterpret_cast<const uint32_t *>(p.seq_chunks);
  const uint32_t c0 = seq_chunks[s], c1 = seq_chunks[s + 1];
  const PkvRecord *chunks = reinterpret_cast<const PkvRecord *>(p.records);
  if (c1 - c0 == 1 || tok >= chunks[c0].tokens) return;
  const float *part_lse = reinterpret_cast<const float *>(p.part_lse);
  const float *part_out = reinterpret_cast<const float *>(p.part_out);
  auto part = [&](uint32_t c) { return (uint64_t(chunks[c].part) * p.q_tokens + tok) * p.q_heads + qh; };
  float first_top = -INFINITY;
  for (uint32_t c = c0; c < c1; c++) first_top = fmaxf(first_top, part_lse[part(c)]);
  for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) {
    float top = first_top, sum = 0.0f, o = 0.0f;
    for (uint32_t c = c0; c < c1; c++) {
      const float lse = part_lse[part(c)];
      const float w = lse == -INFINITY ? 0.0f : expf(lse - top);
      sum += w;
      o += w * part_out[part(c) * D + d];
    }
    o *= join_sink<false>(top, sum, row_sink(p, qh, 1.0f)); // the chunks' partials hold none
    const uint64_t i = (uint64_t(chunks[c0].q_row) + tok) * p.q_heads + qh;
    store_io(p.out_format, reinterpret_cast<void *>(p.out), i * D + d, sum > 0.0f ? o / sum : 0.0f);
    if (d == 0 && p.lse) reinterpret_cast<float *>(p.lse)[i] = sum > 0.0f ? top + logf(sum) : -INFINITY;
  }
}
