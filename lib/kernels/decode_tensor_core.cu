// The tensor-core split-K decode (sm_80 and newer), one kernel per head_dim 64/128/256 and K/V format
// pair. A work item is (chunk, KV head, tile of query rows: the GQA group's heads times the query
// tokens); blocks take items in turn, so any grid covers any plan (a captured launch replays
// correctly after the plan changes).
//  - K/V rows stream through shared-memory stages of 64 tokens: on sm_90 float rows by bulk copies
//    of 8 rows (an eighth of the stage that lies in one page piece) or of one row, the others with
//    16-byte cp.async; where K and V are both quantized each warp copies the rows it computes, and
//    a round waits for its own warps only.
//    A block serves one narrow tile of 8 query rows (speculative tokens times the GQA group) or 1 or
//    2 wide tiles of 16, with 4 warps each, a warp taking 16 tokens of every stage (Narrow and Wide),
//    or on sm_90a 32 rows as one warpgroup (Group); tensor_core/tile_*.cuh. Rows past the chunk,
//    and before the item's first window, are zero-filled, so no row hidden from every query row
//    brings a NaN into the MMAs.
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
//  - FP8 pages: the stage's rows are copied as the pages hold them and widened to F16 rows in shared
//    memory before the round computes them (tensor_core/widen_rows.cuh), which then runs as for F16
//    pages; the plane's scale multiplies the scores (K) and the output (V).
//  - scores are in log2 units (scale * log2 e multiplies q, or the scores where q enters whole); the
//    warps' partial results combine in shared memory; a split sequence's last finishing chunk merges
//    all its chunks (a counter per sequence, KV head and row tile), in chunk order, so results are the
//    same bits every run.
#include <math.h>

#include <type_traits>

#include "tensor_core/stage_copy.cuh"
#include "tensor_core/tile_group.cuh"
#include "tensor_core/tile_narrow.cuh"
#include "tensor_core/tile_wide.cuh"
#include "tensor_core/widen_rows.cuh"

using namespace pkv_mma;

namespace {

// SKF, SVF: the formats the pages store; T computes in its own (widened_format).
template <int D, int STAGES, class T, uint32_t SKF, uint32_t SVF> struct Mma {
  using K = typename T::K;
  using V = typename T::V;
  using SK = Row<SKF, D, T::Tok::spread>; // the rows as a stage holds them
  using SV = Row<SVF, D, T::Tok::spread>;
  static constexpr bool WIDEN = SKF != K::format || SVF != V::format;
  static_assert(!WIDEN || (SKF != K::format && SVF != V::format), "FP8 K and V");
  static constexpr int NS = STAGES; // as pkv_mma_stages or pkv_mma_fewer_stages
  static constexpr int ROWS = T::ROWS, KSTEPS = T::KSTEPS, GROUPS = T::GROUPS, SPLIT = T::SPLIT;
  static constexpr uint32_t stage_bytes = SK::bytes + SV::bytes;
  static constexpr uint32_t widened_bytes = WIDEN ? K::bytes + V::bytes : 0; // after the stages
  static_assert(widened_bytes == pkv_mma_widened_bytes(D, WIDEN), "the host sizes shared memory alike");
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
  static constexpr uint32_t loop_bytes = NS * stage_bytes + widened_bytes + 2 * q_bytes;
  // The most the host reserves (two row tiles; mma_shared_bytes in gpu_backend.cpp).
  static constexpr uint32_t shared_bytes = loop_bytes > combine_bytes ? loop_bytes : combine_bytes;
  static_assert(shared_bytes <= 227 * 1024, "a block fits a multiprocessor's shared memory");
};

// KF, VF: the formats T computes in; SKF, SVF: the pages'.
template <int D, uint32_t KF, uint32_t VF, int NS, class T, uint32_t SKF, uint32_t SVF>
__device__ void decode_mma(const PkvDecodeParams &p) {
  using M = Mma<D, NS, T, SKF, SVF>;
  using K = typename M::K;
  using V = typename M::V;
  using SK = typename M::SK;
  using SV = typename M::SV;
  constexpr int ROWS = M::ROWS;
  extern __shared__ uint4 smem_words[];
  uint8_t *smem = reinterpret_cast<uint8_t *>(smem_words);
  __shared__ int s_last;
  __shared__ ItemLimits s_item;
  __shared__ StageRow stage_rows[M::NS][TILE];
  // Bulk copies: a stage's mbarrier; each copying thread arrives once per use.
  constexpr bool KB = kBulkCopies && !SK::quantized, VB = kBulkCopies && !SV::quantized;
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
  uint8_t *const widened = smem + M::NS * M::stage_bytes;
  auto q_frag_of = [&](int i) { return reinterpret_cast<uint32_t *>(widened + M::widened_bytes + i * M::q_bytes); };
  auto q_scale_of = [&](int i) { return reinterpret_cast<float *>(q_frag_of(i) + M::q_words); };
  const uint32_t *q_frag = q_frag_of(mt);
  const float *q_scale_sm = q_scale_of(mt);
  const PkvPool &pool = p.pool;
  const uint32_t group = p.q_heads / pool.kv_heads;
  const PkvRecord *records = reinterpret_cast<const PkvRecord *>(p.records); // one KV head's each
  // The first item's record is read alongside the record count, not after it: the grid covers the
  // plan it was launched for, so the record lies in the plan buffer.
  PkvRecord c = records[blockIdx.x / p.row_tiles];
  const uint32_t n_records = reinterpret_cast<const PkvPlanHeader *>(p.plan)->n_records;
  const uint8_t *layer_base = reinterpret_cast<const uint8_t *>(pool.base) + uint64_t(p.layer) * pool.pages * pool.block_bytes;
  const float q_mul = p.scale * kLog2e; // scores in log2 units
  // Float K: q enters unscaled and the fp32 scores take the scale, so the f16 parts of q keep their
  // precision whatever the scale (q times a small scale fell into f16's subnormal range). Quantized K:
  // q times the scale (its int8 parts are scaled per group in fp32).
  const bool q_exact = !K::quantized && p.q_format == KF;
  QParts qp{!q_exact, K::quantized ? 1.0f : q_mul};
  const float q_pre = K::quantized ? q_mul : 1.0f; // what q_values multiplies q by

  for (uint32_t item = blockIdx.x; item < n_records * p.row_tiles; item += gridDim.x) {
    const uint32_t z = item % p.row_tiles;
    if (item != blockIdx.x) c = records[item / p.row_tiles];
    if (c.seq == kNoSeq) continue; // a balanced plan's filler (every thread skips it)
    const uint32_t rows = c.tokens * group; // the record's query rows: its tokens times the group
    if (z * block_rows >= rows) continue;   // a row tile past them (a record of fewer tokens)
    const uint32_t h = c.head;
    const uint32_t length = c.length;
    // FP8 pages: the planes' scales of this KV head, K's on the scores, V's on the output.
    float v_scale = 1.0f;
    if constexpr (M::WIDEN) qp.mul = q_mul * plane_scale(pool, false, p.layer, h), v_scale = plane_scale(pool, true, p.layer, h);
    // Query row r of this tile: (token, head of the group), or nothing past the group's rows.
    auto q_head = [&](uint32_t r) {
      const uint32_t row = z * block_rows + r, tok = row / group;
      return (uint64_t(c.q_row) + tok) * p.q_heads + h * group + row % group;
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

    // Positions each of this thread's rows sees (counted from c.start), and their variants; what the
    // item's rows share goes to shared memory (written before the barrier below).
    if (tid == 0)
      s_item = {score_variants(p, kLog2e), tree_row(p, c, 0), c.mask_stride, length - c.tokens + 1, c.start, c.new_begin};
    RowLimits<T::TROWS> limits{{}, {}, s_item};
#pragma unroll
    for (int i = 0; i < T::TROWS; i++) {
      const uint32_t r = mt * ROWS + T::row_of_thread(lane, i), row = z * block_rows + r;
      limits.visible[i] = row_valid(r) ? length - c.tokens + row / group + 1 : 0;
      limits.slope[i] = row_valid(r) ? row_slope(p, h * group + row % group, kLog2e) : 0.0f;
    }

    const uint32_t *table = reinterpret_cast<const uint32_t *>(pool.table) + uint64_t(c.slot) * pool.table_stride;
    const uint32_t n = c.token_end - c.token_begin;
    const int tiles = int((n + TILE - 1) / TILE);

    // The page of token `my_token` of tile `tile` (threads with my_token >= 0), and where its row lies there.
    // `in_chunk`: the tile is whole and in the chunk.
    auto page_of = [&](int tile, bool in_chunk) {
      const uint32_t t = c.token_begin + tile * TILE + my_token;
      return in_chunk || (tile < tiles && t < c.token_end) ? table[(c.start + t) >> pool.page_shift] : pool.pages;
    };
    // Positions below the first query row's window (counted from c.start) are hidden from every row of
    // the item: their rows are zeros, not read, since a page's slots before the window (or released
    // positions) may hold anything, NaN too, and a hidden row's weight of 0 would carry it through the
    // MMAs (0 x NaN).
    const uint32_t first_seen = p.window && length - c.tokens + 1 > p.window ? length - c.tokens + 1 - p.window : 0;
    auto locate = [&](int tile, uint32_t page) {
      const uint32_t t = c.token_begin + tile * TILE + my_token, first = t - uint32_t(my_token) % 8, in_page = pool.page_size - 1;
      const bool valid = page < pool.pages && t >= first_seen;
      // The eighth's rows share this row's page (and so its validity) when they share its page index
      // (c.start is a page's first position) and the first of them is seen.
      const bool eighth = (KB || VB) && valid && first >= first_seen && first + 7 < c.token_end &&
                          (first & in_page) + 7 <= in_page;
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
            if constexpr (std::is_same_v<SK, SV>) {
              copy_rows<SK, 32, SUB, 2>({stage, stage + SK::bytes}, {0, pool.k_bytes}, rows, first, lane);
            } else {
              copy_rows<SK, 32, SUB, 1>({stage}, {0}, rows, first, lane);
              copy_rows<SV, 32, SUB, 1>({stage + SK::bytes}, {pool.k_bytes}, rows, first, lane);
            }
            static_assert(SK::scales == SV::scales, "both quantized");
            const bool k = lane < SUB;
            copy_scales<SK::scales>(stage + (k ? SK::of_token(r) + SK::data : SK::bytes + SV::of_token(r) + SV::data), &rows[r],
                                   k ? pool.k.scale_offset : pool.k_bytes + pool.v.scale_offset);
          }
        } else if (tid < TILE) {
          if constexpr (KB) bulk_row<SK>(stage, rows, 0, tid, &stage_bar[slot]);
          else copy_rows<SK, TILE, TILE, 1>({stage}, {0}, rows, 0, tid);
          if constexpr (SK::scales != 0) copy_scales<SK::scales>(stage + SK::of_token(tid) + SK::data, &rows[tid], pool.k.scale_offset);
        } else if (tid < 2 * TILE) {
          const int i = tid - TILE;
          if constexpr (VB) bulk_row<SV>(stage + SK::bytes, rows, pool.k_bytes, i, &stage_bar[slot]);
          else copy_rows<SV, TILE, TILE, 1>({stage + SK::bytes}, {pool.k_bytes}, rows, 0, i);
          if constexpr (SV::scales != 0)
            copy_scales<SV::scales>(stage + SK::bytes + SV::of_token(i) + SV::data, &rows[i], pool.k_bytes + pool.v.scale_offset);
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
      // docs/perf/decisions.md).
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
      if constexpr (M::WIDEN) { // each slice widens the tokens its warps compute
        widen_rows<T::Tok, SK, K>(stage, widened, slice, mt * 32 + lane, 32 * MT);
        widen_rows<T::Tok, SV, V>(stage + SK::bytes, widened + K::bytes, slice, mt * 32 + lane, 32 * MT);
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + slice), "r"(32 * MT) : "memory");
        stage = widened;
      }
      // This warp's 16 tokens of the stage: its MMA row m is token t_warp + Tok::of_row(m).
      // A plain round's tokens are all visible to every row: none is within NS tiles of the chunk's end
      // (a speculative row sees all but the last few tokens of the sequence); padding rows' weights
      // go nowhere.
      const uint32_t t_warp = c.token_begin + tile * TILE + T::Tok::warp_first(slice);
      if constexpr (T::GROUPED)
        acc.template stage<!plain>(K::warp_rows(stage, slice), stage + K::bytes, q_frag, group_scratch, t_warp,
                                   c.token_end, limits, lane, warp);
      else
        acc.template stage<!plain>(K::warp_rows(stage, slice), V::warp_rows(stage + K::bytes, slice), q_frag,
                                   q_scale_sm, qp, t_warp, c.token_end, limits, lane);
      if (my_token >= 0) stage_rows[slot][my_token] = locate(tile + M::NS, next_page);
      if constexpr (KB || VB) fence_proxy_async();
      if constexpr (!T::GROUPED) sync_rows(); // the stage is refilled next
      last = slot, slot = slot + 1 == M::NS ? 0 : slot + 1;
    };
    // Rounds that mask: the last NS + 1 (the chunk's end) and those holding the positions a window may
    // hide: c.start is the window's first page for the record's first query token, a later one's
    // starts up to tokens - 1 positions on.
    const uint32_t window_edge = p.window ? pool.page_size + c.tokens - 1 : 0;
    const int masked_head = window_edge > c.token_begin ? min(tiles, int((window_edge - c.token_begin + TILE - 1) / TILE)) : 0;
    // And under a tree mask, from the tile holding the first new token on.
    const int masked_tail = !c.mask_stride                         ? tiles
                            : c.new_begin <= c.start + c.token_begin ? 0
                                                                     : int((c.new_begin - c.start - c.token_begin) / TILE);
    int tile = 0;
    for (; tile < masked_head; tile++) round(tile, std::false_type{});
    for (; tile + M::NS + 1 < tiles && tile < masked_tail; tile++) round(tile, std::true_type{});
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
      // The sink joins the sequence's result once: here where it has one chunk, else in the merge.
      const float rescale = split ? 1.0f : join_sink<true>(top, sum, row_sink(p, uint32_t(q_head(tid) % p.q_heads), kLog2e));
#pragma unroll
      for (int w = 0; w < WARPS; w++) cm[(w0 + w) * ROWS + r] = sum > 0.0f ? weight[w] * rescale * v_scale / sum : 0.0f;
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
        const uint64_t part = uint64_t(c.part) * p.q_tokens * p.q_heads + (head - uint64_t(c.q_row) * p.q_heads);
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
        // (H200: head_dim 256 1x1K 9-12% faster, head_dim 128 1x1K 2%; docs/perf/decisions.md).
        constexpr uint32_t V4 = D / 4, EPT = M::ROWS * V4 / THREADS; // float4s a row, most a thread takes
        const uint64_t stride = uint64_t(p.q_tokens) * p.q_heads;  // a part's rows
        // Chunk k's partial of row r: lse at part_lse[(first_part + k) * stride + in_seq(r)], values
        // at part_out[that * D].
        auto in_seq = [&](uint32_t r) { return q_head(r) - uint64_t(c.q_row) * p.q_heads; };
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
          const float rescale = join_sink<false>(top, sum, row_sink(p, uint32_t(head % p.q_heads), 1.0f)); // once a row
          const float inv = sum > 0.0f ? rescale / sum : 0.0f;
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

// KF, VF: the pages' formats.
#define PKV_MMA_KERNEL(NAME, REGISTERS, T, D, KF, VF, NS)                                                    \
  extern "C" __global__ void __maxnreg__(REGISTERS) NAME(PkvDecodeParams p) {                                \
    constexpr uint32_t kf = widened_format(KF), vf = widened_format(VF);                                     \
    decode_mma<D, kf, vf, NS, T<D, kf, vf>, KF, VF>(p);                                                      \
  }
// pkv_decode_mma<rows>_<head_dim>_<k format>_<v format>_<stages>: rows 16 (Wide) or 8 (Narrow) a
// tile, format numbers as in pkv_format.
#define PKV_MMA_TILE(T, R, D, KF, VF, NS)                                                                    \
  PKV_MMA_KERNEL(pkv_decode_mma##R##_##D##_##KF##_##VF##_##NS,                                               \
                 mma_registers(D, mma_blocks(D, NS, !quantized_format(KF) && !quantized_format(VF))), T, D, KF, VF, NS)
#define PKV_MMA(D, KF, VF, NS) PKV_MMA_TILE(Wide, 16, D, KF, VF, NS) PKV_MMA_TILE(Narrow1, 8, D, KF, VF, NS)
#define PKV_MMA_V(D, KF, NS) PKV_MMA(D, KF, 2, NS) PKV_MMA(D, KF, 3, NS) PKV_MMA(D, KF, 4, NS) PKV_MMA(D, KF, 5, NS)
#define PKV_MMA_KV(D, NS) PKV_MMA_V(D, 2, NS) PKV_MMA_V(D, 3, NS) PKV_MMA_V(D, 4, NS) PKV_MMA_V(D, 5, NS)
PKV_MMA_KV(64, 3)
PKV_MMA_KV(128, 3)
PKV_MMA_KV(256, 2)
// FP8 K and V, either code in either plane.
#define PKV_MMA_FP8(D, NS) PKV_MMA(D, 6, 6, NS) PKV_MMA(D, 6, 7, NS) PKV_MMA(D, 7, 6, NS) PKV_MMA(D, 7, 7, NS)
PKV_MMA_FP8(64, 3)
PKV_MMA_FP8(128, 2)
PKV_MMA_FP8(256, 2)
// F16/BF16 head_dim 128 with two stages (pkv_mma_fewer_stages).
PKV_MMA(128, 2, 2, 2) PKV_MMA(128, 2, 3, 2) PKV_MMA(128, 3, 2, 2) PKV_MMA(128, 3, 3, 2)
// The narrow head_dim 128 kernels with quantized K and Q4_0 V at 128 registers, four blocks a
// multiprocessor instead of three (pkv_decode_mma8_128_<k format>_5_3_4blocks): bound by instruction
// issue, they gain from the fourth block's warps, and the host plans for four blocks (H200: 32x4K
// Q4_0 16% faster, 128-sequence batches 5-15%, short batches even; 96 registers and five blocks
// lost 3-10% everywhere: docs/perf/decisions.md).
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
