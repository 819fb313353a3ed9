// The group tile (sm_90a): a block's four warps as one warpgroup on the warpgroup MMA.
#pragma once

#include "float_parts.cuh"
#include "online_softmax.cuh"
#include "quant_fragments.cuh"
#include "tile_base.cuh"

namespace pkv_mma {

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
                        uint32_t t_warp, uint32_t token_end, const RowLimits<TROWS> &limits, int lane, int warp) {
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
    auto token_of = [&](int e) { return t_warp + gid + 8 * (e % 4 / 2); };
#pragma unroll
    for (int i = 0; i < TROWS; i++) tile_max[i] = -INFINITY;
#pragma unroll
    for (int e = 0; e < 4 * NT; e++) {
      s[e] = acc[e / 4][e % 4];
      if (MASK) s[e] = limits.score(row_of(e), token_of(e), token_end, s[e]);
    }
    if (!MASK && limits.item.vary.change) // one uniform test a stage
#pragma unroll
      for (int e = 0; e < 4 * NT; e++) s[e] = limits.change(row_of(e), token_of(e), s[e]);
#pragma unroll
    for (int e = 0; e < 4 * NT; e++) tile_max[row_of(e)] = fmaxf(tile_max[row_of(e)], s[e]);
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

} // namespace pkv_mma
