// The wide tile: 16 query rows on the MMA's M dimension.
#pragma once

#include "float_parts.cuh"
#include "online_softmax.cuh"
#include "quant_fragments.cuh"
#include "tile_base.cuh"

namespace pkv_mma {

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
                        const QParts &qp, uint32_t t_warp, uint32_t token_end, const RowLimits<2> &limits, int lane) {
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
        s, m, l, limits, token_end, [](int e) { return (e / 2) % 2; },
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

} // namespace pkv_mma
