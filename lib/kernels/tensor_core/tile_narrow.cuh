// The narrow tile: query rows on the MMA's N dimension, 1, 2 or 4 n-tiles of 8.
#pragma once

#include "float_parts.cuh"
#include "online_softmax.cuh"
#include "quant_fragments.cuh"
#include "tile_base.cuh"

namespace pkv_mma {

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
                        const QParts &qp, uint32_t t_warp, uint32_t token_end, const RowLimits<TROWS> &limits,
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
        s, m, l, limits, token_end, [](int e) { return 2 * (e / 4) + e % 2; },
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

} // namespace pkv_mma
