// ggml-attention-bench: ggml's CPU flash attention (ggml_flash_attn_ext through ggml_graph_compute)
// on the decode workloads of pkv-bench's default CPU run, so pagedkv's CPU decode can be compared
// with it (docs/perf/peer-cpu.md). Built against ggml from llama.cpp's source by
// tools/peer/ggml-attention-bench.sh; not part of pagedkv's build.
//
// Each workload is B sequences of K/V (lengths from tools/batch_notation.hpp), Hq query heads over
// Hkv KV heads of head_dim D, and T query tokens per sequence; query token t of a sequence of length
// L sees positions [0, L - T + t], as pkv_decode does. K/V are stored the way llama.cpp's cache
// stores a layer: one row per token holding every KV head, ggml_flash_attn_ext reading it through a
// [D, tokens, Hkv, B] view. Before the timings a small case of every format pair is checked
// against a float64 reference.
#include "ggml-cpu.h"
#include "ggml.h"

#include "batch_notation.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// The workloads: pkv-bench's shapes and format pairs (tools/pkv-bench/workloads.cpp) and its
// default CPU matrix, less the page-size rows (ggml's cache has no pages).

struct Shape {
  const char *name;
  uint32_t hq, hkv, d;
};
const Shape kShapes[4] = {
    {"gqa4-d128", 32, 8, 128},
    {"gqa6-d256", 24, 4, 256},
    {"gqa8-d128", 64, 8, 128},
    {"mha-d64", 16, 16, 64},
};

struct Formats {
  ggml_type k, v;
  const char *name;
};
const Formats kFormats[5] = {
    {GGML_TYPE_F16, GGML_TYPE_F16, "f16"},
    {GGML_TYPE_BF16, GGML_TYPE_BF16, "bf16"},
    {GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, "q8_0"},
    {GGML_TYPE_Q4_0, GGML_TYPE_Q4_0, "q4_0"},
    {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, "q8_0/q4_0"},
};

struct Workload {
  std::string id, name, batch;
  const Shape *shape;
  const Formats *fmt;
  uint32_t qtok;
  std::vector<uint32_t> lens;
};

Workload make_workload(const std::string &name, const std::string &batch, const Shape &s, const Formats &f,
                       uint32_t qtok) {
  Workload w;
  w.name = name + (qtok > 1 ? "-q" + std::to_string(qtok) : "");
  w.id = w.name + "/" + s.name + "/" + f.name;
  w.batch = batch;
  w.shape = &s;
  w.fmt = &f;
  w.qtok = qtok;
  w.lens = batch_notation::parse_batch(batch);
  return w;
}

// pkv-bench's cpu_matrix(), in its order.
std::vector<Workload> default_workloads() {
  std::vector<Workload> out;
  for (const char *b : {"1x1K", "1x4K", "8x1K", "8x4K", "8x8K"})
    out.push_back(make_workload(std::string("uniform-") + b, b, kShapes[0], kFormats[0], 1));
  for (int s = 1; s < 4; s++)
    for (int f = 0; f < 2; f++) out.push_back(make_workload("uniform-8x1K", "8x1K", kShapes[s], kFormats[f], 1));
  for (int f = 1; f < 5; f++) out.push_back(make_workload("uniform-8x1K", "8x1K", kShapes[0], kFormats[f], 1));
  for (const Shape &s : kShapes) out.push_back(make_workload("ragged-short", "1x4K+7x256", s, kFormats[0], 1));
  out.push_back(make_workload("ragged-serving-small", "16~16..2K", kShapes[0], kFormats[0], 1));
  for (uint32_t q : {2u, 4u, 8u}) out.push_back(make_workload("spec-verify-8x4K", "8x4K", kShapes[0], kFormats[0], q));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Options.

enum class Layout { batched, per_seq };
enum class MaskMode { always, needed };

struct Options {
  int threads = 2;
  uint32_t iters = 50;
  uint64_t rotate_bytes = 128ull << 20;
  Layout layout = Layout::batched;
  MaskMode mask = MaskMode::always;
  ggml_prec prec = GGML_PREC_DEFAULT;
  std::string filter, json_path = "ggml-attention-bench.jsonl", peer = "unknown";
  bool list = false;
};

void usage() {
  std::printf(
      "usage: ggml-attention-bench [options]\n"
      "  --threads N       ggml_graph_compute threads (default 2)\n"
      "  --iters N         timed calls per workload (default 50)\n"
      "  --filter TEXT     only workloads whose id contains TEXT\n"
      "  --list            list the selected workload ids and exit\n"
      "  --json PATH       JSON lines, one per workload (default ggml-attention-bench.jsonl)\n"
      "  --rotate-mb N     calls rotate over K/V sets of at least N MiB together (default 128)\n"
      "  --layout L        batched: one ggml_flash_attn_ext over all sequences (K/V [D, longest, Hkv, B],\n"
      "                    shorter sequences masked, as llama.cpp's per-sequence cache streams are);\n"
      "                    per-seq: one ggml_flash_attn_ext per sequence in one graph, no padding\n"
      "                    (default batched)\n"
      "  --mask M          always: every call has a KQ mask, as llama.cpp's graphs do; needed: only\n"
      "                    where positions are hidden (T > 1, or padding in the batched layout)\n"
      "                    (default always)\n"
      "  --prec P          default|f32: ggml_flash_attn_ext_set_prec (default: not set)\n"
      "  --peer TEXT       what ggml was built from, recorded in the JSON (the script passes it)\n"
      "Columns: time us: median of --iters ggml_graph_compute calls after warm-up; MB: K and V bytes\n"
      "stored for the live tokens (10^6 bytes; F16/BF16 2 B a value, Q8_0 34 B and Q4_0 18 B per 32);\n"
      "GB/s: MB / time.\n");
}

unsigned long parse_number(const char *opt, const char *text, unsigned long lo, unsigned long hi) {
  char *end = nullptr;
  unsigned long v = std::strtoul(text, &end, 10);
  if (!*text || *text == '-' || *end || v < lo || v > hi) {
    std::fprintf(stderr, "ggml-attention-bench: %s is '%s': expected a whole number from %lu to %lu\n", opt, text,
                 lo, hi);
    std::exit(2);
  }
  return v;
}

Options parse_options(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto value = [&]() -> const char * {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ggml-attention-bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--threads") o.threads = (int)parse_number("--threads", value(), 1, GGML_MAX_N_THREADS);
    else if (a == "--iters") o.iters = (uint32_t)parse_number("--iters", value(), 1, 1000000);
    else if (a == "--filter") o.filter = value();
    else if (a == "--list") o.list = true;
    else if (a == "--json") o.json_path = value();
    else if (a == "--rotate-mb") o.rotate_bytes = (uint64_t)parse_number("--rotate-mb", value(), 0, 1u << 20) << 20;
    else if (a == "--peer") o.peer = value();
    else if (a == "--layout" || a == "--mask" || a == "--prec") {
      std::string v = value();
      if (a == "--layout" && (v == "batched" || v == "per-seq")) o.layout = v == "batched" ? Layout::batched : Layout::per_seq;
      else if (a == "--mask" && (v == "always" || v == "needed")) o.mask = v == "always" ? MaskMode::always : MaskMode::needed;
      else if (a == "--prec" && (v == "default" || v == "f32")) o.prec = v == "f32" ? GGML_PREC_F32 : GGML_PREC_DEFAULT;
      else {
        std::fprintf(stderr, "ggml-attention-bench: %s: unknown value '%s'\n", a.c_str(), v.c_str());
        std::exit(2);
      }
    } else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "ggml-attention-bench: unknown option %s\n", a.c_str());
      usage();
      std::exit(2);
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// Random values, never zero: [-1, -0.05] U [0.05, 1], as pkv-bench fills its pools.

struct Random {
  batch_notation::Rng rng{20261207};
  float value() {
    float u = (float)rng.unit();
    float m = 0.05f + 0.95f * u;
    return (rng.next() & 1) ? m : -m;
  }
};

// A bank of random floats; K/V rows are converted or quantized from random offsets in it, so a
// large cache fills quickly and no two sets are alike.
struct Bank {
  std::vector<float> v;
  explicit Bank(Random &r) : v(4u << 20) {
    for (float &x : v) x = r.value();
  }
};

// Fills `rows` rows of d values of type t at dst from the bank.
void fill_rows(ggml_type t, void *dst, uint64_t rows, uint32_t d, const Bank &bank, Random &r) {
  const uint64_t chunk = std::max<uint64_t>(1, (1u << 20) / d); // rows per conversion
  char *out = (char *)dst;
  const size_t row_bytes = ggml_row_size(t, d);
  for (uint64_t done = 0; done < rows;) {
    uint64_t n = std::min(chunk, rows - done);
    const float *src = bank.v.data() + r.rng.next() % (bank.v.size() - n * d + 1);
    if (t == GGML_TYPE_F16) ggml_fp32_to_fp16_row(src, (ggml_fp16_t *)out, (int64_t)(n * d));
    else if (t == GGML_TYPE_BF16) ggml_fp32_to_bf16_row(src, (ggml_bf16_t *)out, (int64_t)(n * d));
    else ggml_quantize_chunk(t, src, out, 0, (int64_t)n, d, nullptr);
    out += n * row_bytes;
    done += n;
  }
}

// ---------------------------------------------------------------------------------------------
// One workload's graphs: a set of K/V per rotation copy, each with its own graph, all sharing q and
// the masks.

struct Problem {
  const Shape &s;
  const Formats &f;
  std::vector<uint32_t> lens;
  uint32_t T;
  Layout layout;
  bool masked;
};

bool needs_mask(const Problem &p, MaskMode mode) {
  bool ragged = std::adjacent_find(p.lens.begin(), p.lens.end(), std::not_equal_to<uint32_t>()) != p.lens.end();
  return mode == MaskMode::always || p.T > 1 || (p.layout == Layout::batched && ragged);
}

// Bytes stored for the live tokens of one set.
uint64_t live_bytes(const Problem &p) {
  uint64_t tokens = 0;
  for (uint32_t l : p.lens) tokens += l;
  return tokens * p.s.hkv * (ggml_row_size(p.f.k, p.s.d) + ggml_row_size(p.f.v, p.s.d));
}

// Fills a contiguous F16 mask [n_kv, T] of a sequence of length len: 0 where query t sees the
// position (j <= len - T + t), -inf elsewhere (later tokens and padding).
void fill_mask(ggml_tensor *m, uint32_t len, uint32_t T, size_t offset) {
  ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), hidden = ggml_fp32_to_fp16(-INFINITY);
  ggml_fp16_t *p = (ggml_fp16_t *)((char *)m->data + offset);
  const int64_t n_kv = m->ne[0];
  for (uint32_t t = 0; t < T; t++)
    for (int64_t j = 0; j < n_kv; j++) p[t * n_kv + j] = j <= (int64_t)len - T + t ? zero : hidden;
}

struct Graphs {
  ggml_context *ctx = nullptr;
  ggml_tensor *q = nullptr;
  std::vector<ggml_tensor *> kstore, vstore; // per copy: [Hkv * D, longest, B], a row per token
  std::vector<std::vector<ggml_tensor *>> outs; // per copy: the attention outputs
  std::vector<ggml_cgraph *> graphs;
  Graphs() = default;
  Graphs(const Graphs &) = delete;
  Graphs &operator=(const Graphs &) = delete;
  ~Graphs() {
    if (ctx) ggml_free(ctx);
  }

  void build(const Problem &p, uint32_t copies, ggml_prec prec, const Bank &bank, Random &r) {
    const Shape &s = p.s;
    const int64_t B = (int64_t)p.lens.size(), T = p.T, D = s.d;
    const int64_t longest = *std::max_element(p.lens.begin(), p.lens.end());
    const size_t krow = ggml_row_size(p.f.k, D), vrow = ggml_row_size(p.f.v, D);
    const uint64_t kv_bytes = (uint64_t)B * longest * s.hkv * (krow + vrow);
    const uint64_t q_bytes = (uint64_t)B * T * s.hq * D * 4; // q, and the outputs of each set
    const uint64_t mask_bytes = p.masked ? (uint64_t)B * longest * T * 2 : 0;
    // Tensor headers: storage, views and outputs of a set, with room to spare; then q and masks.
    const size_t tensors = 8 + 8 * (size_t)B, graph_size = 16 + 8 * (size_t)B;
    ggml_init_params ip = {};
    ip.mem_size = (size_t)(copies * (kv_bytes + q_bytes) + q_bytes + mask_bytes +
                           (copies + 1) * tensors * (ggml_tensor_overhead() + GGML_MEM_ALIGN) +
                           copies * ggml_graph_overhead_custom(graph_size, false));
    ip.no_alloc = false;
    ctx = ggml_init(ip);
    if (!ctx) {
      std::fprintf(stderr, "ggml-attention-bench: ggml_init of %zu bytes failed\n", ip.mem_size);
      std::exit(1);
    }

    q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, T, s.hq, B);
    for (int64_t i = 0; i < ggml_nelements(q); i++) ((float *)q->data)[i] = r.value();

    // Masks: one [longest, T, 1, B] for the batched layout, one [len, T] per sequence for per-seq.
    ggml_tensor *batch_mask = nullptr;
    std::vector<ggml_tensor *> seq_masks;
    if (p.masked && p.layout == Layout::batched) {
      batch_mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, longest, T, 1, B);
      for (int64_t b = 0; b < B; b++) fill_mask(batch_mask, p.lens[b], p.T, b * batch_mask->nb[3]);
    } else if (p.masked) {
      for (int64_t b = 0; b < B; b++) {
        seq_masks.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F16, p.lens[b], T));
        fill_mask(seq_masks.back(), p.lens[b], p.T, 0);
      }
    }

    const float scale = 1.0f / std::sqrt((float)D);
    outs.resize(copies);
    for (uint32_t c = 0; c < copies; c++) {
      ggml_tensor *ks = ggml_new_tensor_3d(ctx, p.f.k, (int64_t)s.hkv * D, longest, B);
      ggml_tensor *vs = ggml_new_tensor_3d(ctx, p.f.v, (int64_t)s.hkv * D, longest, B);
      fill_rows(p.f.k, ks->data, (uint64_t)B * longest * s.hkv, s.d, bank, r);
      fill_rows(p.f.v, vs->data, (uint64_t)B * longest * s.hkv, s.d, bank, r);
      kstore.push_back(ks);
      vstore.push_back(vs);
      ggml_cgraph *g = ggml_new_graph_custom(ctx, graph_size, false);
      // A [D, n_kv, Hkv, nseq] view of sequences first..first+nseq-1: a head's rows are a token
      // row apart, a sequence's heads a head row apart.
      auto view = [&](ggml_tensor *store, size_t row, int64_t n_kv, int64_t first, int64_t nseq) {
        return ggml_view_4d(ctx, store, D, n_kv, s.hkv, nseq, store->nb[1], row, store->nb[2], first * store->nb[2]);
      };
      auto attend = [&](ggml_tensor *qv, ggml_tensor *k, ggml_tensor *v, ggml_tensor *mask) {
        ggml_tensor *o = ggml_flash_attn_ext(ctx, qv, k, v, mask, scale, 0.0f, 0.0f);
        if (prec != GGML_PREC_DEFAULT) ggml_flash_attn_ext_set_prec(o, prec);
        outs[c].push_back(o);
        ggml_build_forward_expand(g, o);
      };
      if (p.layout == Layout::batched) {
        attend(q, view(ks, krow, longest, 0, B), view(vs, vrow, longest, 0, B), batch_mask);
      } else {
        for (int64_t b = 0; b < B; b++) {
          ggml_tensor *qb = ggml_view_4d(ctx, q, D, T, s.hq, 1, q->nb[1], q->nb[2], q->nb[3], b * q->nb[3]);
          attend(qb, view(ks, krow, p.lens[b], b, 1), view(vs, vrow, p.lens[b], b, 1),
                 p.masked ? seq_masks[b] : nullptr);
        }
      }
      graphs.push_back(g);
    }
  }

  // The output of sequence b, query token t, head h, dimension i of copy c.
  float out(uint32_t c, const Problem &p, int64_t b, int64_t t, int64_t h, int64_t i) const {
    // Outputs are [D, Hq, T, nseq]: the batched layout's one holds every sequence.
    const ggml_tensor *o = p.layout == Layout::batched ? outs[c][0] : outs[c][b];
    const int64_t bb = p.layout == Layout::batched ? b : 0;
    return *(const float *)((const char *)o->data + i * o->nb[0] + h * o->nb[1] + t * o->nb[2] + bb * o->nb[3]);
  }
};

// Runs the graphs with one thread pool, kept for the whole run as an engine keeps its own.
struct Runner {
  int threads;
  ggml_threadpool *pool;
  std::vector<uint8_t> work;
  explicit Runner(int n) : threads(n) {
    ggml_threadpool_params tp = ggml_threadpool_params_default(n);
    pool = ggml_threadpool_new(&tp);
  }
  ~Runner() { ggml_threadpool_free(pool); }
  Runner(const Runner &) = delete;
  Runner &operator=(const Runner &) = delete;

  void compute(ggml_cgraph *g) {
    ggml_cplan plan = ggml_graph_plan(g, threads, pool);
    if (plan.work_size > work.size()) work.resize(plan.work_size);
    plan.work_data = work.data();
    if (ggml_graph_compute(g, &plan) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "ggml-attention-bench: ggml_graph_compute failed\n");
      std::exit(1);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The check: every format pair on small cases, against attention computed in float64 from the
// values ggml stores (K/V dequantized by ggml's own to_float) and the F32 queries. The error
// includes ggml's rounding of q to K's dot-product type (F16, BF16, Q8_0) and its F16 output
// accumulation for F16 V.

double max_error(const Graphs &g, const Problem &p) {
  const Shape &s = p.s;
  const int64_t D = s.d, T = p.T, longest = g.kstore[0]->ne[1];
  const uint32_t group = s.hq / s.hkv;
  const ggml_to_float_t k_float = ggml_get_type_traits(p.f.k)->to_float;
  const ggml_to_float_t v_float = ggml_get_type_traits(p.f.v)->to_float;
  std::vector<float> krow(D), vrow(D);
  std::vector<double> kd, vd, acc(D), w;
  double worst = 0;
  for (size_t b = 0; b < p.lens.size(); b++) {
    const int64_t L = p.lens[b];
    for (uint32_t kh = 0; kh < s.hkv; kh++) {
      // This sequence's K and V of head kh in float64.
      kd.assign(L * D, 0);
      vd.assign(L * D, 0);
      for (int64_t j = 0; j < L; j++) {
        const size_t row = ((size_t)b * longest + j) * s.hkv + kh;
        k_float((const char *)g.kstore[0]->data + row * ggml_row_size(p.f.k, D), krow.data(), D);
        v_float((const char *)g.vstore[0]->data + row * ggml_row_size(p.f.v, D), vrow.data(), D);
        std::copy(krow.begin(), krow.end(), kd.begin() + j * D);
        std::copy(vrow.begin(), vrow.end(), vd.begin() + j * D);
      }
      for (uint32_t h = kh * group; h < (kh + 1) * group; h++)
        for (int64_t t = 0; t < T; t++) {
          const float *qv = (const float *)g.q->data + ((b * s.hq + h) * T + t) * D;
          const int64_t visible = L - T + t + 1;
          w.assign(visible, 0);
          double m = -INFINITY, sum = 0;
          for (int64_t j = 0; j < visible; j++) {
            double dot = 0;
            for (int64_t i = 0; i < D; i++) dot += (double)qv[i] * kd[j * D + i];
            w[j] = dot / std::sqrt((double)D);
            m = std::max(m, w[j]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = 0; j < visible; j++) {
            w[j] = std::exp(w[j] - m);
            sum += w[j];
            for (int64_t i = 0; i < D; i++) acc[i] += w[j] * vd[j * D + i];
          }
          for (int64_t i = 0; i < D; i++)
            worst = std::max(worst, std::fabs(acc[i] / sum - (double)g.out(0, p, b, t, h, i)));
        }
    }
  }
  return worst;
}

// Tolerance of the check, by K/V type: ggml rounds q to K's dot-product type (F16, BF16, Q8_0)
// and, for F16 V, accumulates the output in F16; outputs here are below 1 in magnitude. Measured
// errors are 3 to 10 times smaller.
double tolerance(const Formats &f) { return f.v == GGML_TYPE_F16 ? 2e-3 : 1e-3; }

bool check(Runner &run, const Options &o, const Bank &bank, Random &r) {
  struct Case {
    const char *what;
    std::vector<uint32_t> lens;
    uint32_t T;
    Shape s;
  };
  // A single long sequence takes ggml's split-KV decode path (F16 K/V, one sequence, one query
  // token, 512 or more positions); the ragged batch with T = 4 the row-parallel path with a causal
  // mask and padding.
  const Case cases[] = {
      {"1x600 T=1", {600}, 1, {"gqa4-d128", 8, 2, 128}},
      {"3x(300,77,129) T=4", {300, 77, 129}, 4, {"gqa2-d64", 4, 2, 64}},
  };
  bool ok = true;
  std::printf("check against a float64 reference (max abs error, tolerance):\n");
  for (const Case &c : cases)
    for (const Formats &f : kFormats) {
      Problem p{c.s, f, c.lens, c.T, o.layout, false};
      p.masked = needs_mask(p, o.mask);
      Graphs g;
      g.build(p, 1, o.prec, bank, r);
      run.compute(g.graphs[0]);
      double err = max_error(g, p), tol = tolerance(f);
      ok = ok && err <= tol;
      std::printf("  %-20s %-10s %.2e  %.0e %s\n", c.what, f.name, err, tol, err <= tol ? "ok" : "FAILED");
    }
  return ok;
}

// ---------------------------------------------------------------------------------------------
// The measurement.

using Clock = std::chrono::steady_clock;

struct Result {
  uint32_t copies = 0;
  uint64_t bytes = 0;
  double us = 0, min_us = 0, gbs = 0;
  bool masked = false;
};

Result measure(Runner &run, const Options &o, const Workload &w, const Bank &bank, Random &r) {
  Problem p{*w.shape, *w.fmt, w.lens, w.qtok, o.layout, false};
  p.masked = needs_mask(p, o.mask);
  Result res;
  res.masked = p.masked;
  res.bytes = live_bytes(p);
  // pkv-bench's rule: sets of the batch totalling at least --rotate-mb, at most 64.
  res.copies = (uint32_t)std::min<uint64_t>(64, std::max<uint64_t>(1, (o.rotate_bytes + res.bytes - 1) / res.bytes));
  Graphs g;
  g.build(p, res.copies, o.prec, bank, r);
  const uint32_t warm = std::max<uint32_t>(res.copies, 5);
  for (uint32_t i = 0; i < warm; i++) run.compute(g.graphs[i % res.copies]);
  std::vector<double> t;
  for (uint32_t i = warm; i < warm + o.iters; i++) {
    auto t0 = Clock::now();
    run.compute(g.graphs[i % res.copies]);
    t.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  res.us = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
  res.min_us = t.front();
  res.gbs = (double)res.bytes / res.us / 1e3;
  return res;
}

std::string lengths_text(const std::vector<uint32_t> &lens) {
  std::vector<std::pair<uint32_t, uint32_t>> runs; // (count, length)
  for (uint32_t l : lens) {
    if (!runs.empty() && runs.back().second == l) runs.back().first++;
    else runs.push_back({1, l});
  }
  std::string s;
  if (runs.size() <= 3) {
    for (auto &x : runs) s += (s.empty() ? "" : "+") + std::to_string(x.first) + "x" + std::to_string(x.second);
    return s;
  }
  auto mm = std::minmax_element(lens.begin(), lens.end());
  return std::to_string(lens.size()) + " in " + std::to_string(*mm.first) + ".." + std::to_string(*mm.second);
}

std::string json_escape(const std::string &s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if ((unsigned char)c >= 0x20) out += c;
  }
  return out;
}

void write_json_line(FILE *f, const Options &o, const Workload &w, const Result &r) {
  const Shape &s = *w.shape;
  std::string lens;
  for (uint32_t l : w.lens) lens += (lens.empty() ? "" : ",") + std::to_string(l);
  uint64_t tokens = 0;
  for (uint32_t l : w.lens) tokens += l;
  std::fprintf(f,
               "{\"id\":\"%s\",\"pkv_bench_id\":\"%s/p16\",\"name\":\"%s\",\"batch\":\"%s\","
               "\"shape\":{\"name\":\"%s\",\"q_heads\":%u,\"kv_heads\":%u,\"head_dim\":%u},"
               "\"k_format\":\"%s\",\"v_format\":\"%s\",\"q_tokens\":%u,\"lengths\":[%s],\"tokens\":%llu,"
               "\"layout\":\"%s\",\"mask\":%s,\"precision\":\"%s\",\"threads\":%d,\"iters\":%u,\"copies\":%u,"
               "\"time_us\":%.3f,\"time_min_us\":%.3f,\"bytes\":%llu,\"gbs\":%.4f,"
               "\"peer\":\"ggml_flash_attn_ext (CPU)\",\"peer_source\":\"%s\"}\n",
               w.id.c_str(), w.id.c_str(), w.name.c_str(), w.batch.c_str(), s.name, s.hq, s.hkv, s.d,
               ggml_type_name(w.fmt->k), ggml_type_name(w.fmt->v), w.qtok, lens.c_str(), (unsigned long long)tokens,
               o.layout == Layout::batched ? "batched" : "per-seq", r.masked ? "true" : "false",
               o.prec == GGML_PREC_F32 ? "f32" : "default", o.threads, o.iters, r.copies, r.us, r.min_us,
               (unsigned long long)r.bytes, r.gbs, json_escape(o.peer).c_str());
  std::fflush(f);
}

} // namespace

int main(int argc, char **argv) {
  Options o = parse_options(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<Workload> run;
  for (const Workload &w : default_workloads())
    if (o.filter.empty() || w.id.find(o.filter) != std::string::npos) run.push_back(w);
  if (o.list) {
    for (const Workload &w : run) std::printf("%s\n", w.id.c_str());
    return 0;
  }
  if (run.empty()) {
    std::fprintf(stderr, "ggml-attention-bench: --filter '%s' matches no workload; --list shows them\n",
                 o.filter.c_str());
    return 2;
  }

  std::printf("ggml-attention-bench: ggml_flash_attn_ext on the CPU, %s; %d threads, %s layout, mask %s, "
              "precision %s, %u timed calls\n",
              o.peer.c_str(), o.threads, o.layout == Layout::batched ? "batched" : "per-seq",
              o.mask == MaskMode::always ? "always" : "where needed", o.prec == GGML_PREC_F32 ? "f32" : "default",
              o.iters);
  Random r;
  Bank bank(r);
  Runner runner(o.threads);
  if (!check(runner, o, bank, r)) {
    std::fprintf(stderr, "ggml-attention-bench: the check failed: the timings would not be of a correct attention\n");
    return 1;
  }

  FILE *json = std::fopen(o.json_path.c_str(), "w");
  if (!json) {
    std::fprintf(stderr, "ggml-attention-bench: cannot write %s\n", o.json_path.c_str());
    return 1;
  }
  std::printf("\n%-44s %-16s %6s %10s %9s %8s\n", "workload", "lengths", "copies", "time us", "MB", "GB/s");
  for (const Workload &w : run) {
    Result res = measure(runner, o, w, bank, r);
    std::printf("%-44s %-16s %6u %10.1f %9.2f %8.2f\n", w.id.c_str(), lengths_text(w.lens).c_str(), res.copies,
                res.us, res.bytes / 1e6, res.gbs);
    write_json_line(json, o, w, res);
  }
  std::fclose(json);
  std::printf("\nwrote %s\n", o.json_path.c_str());
  return 0;
}
