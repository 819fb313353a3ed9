// The matrix and its expansion into workloads (workloads.hpp).
#include "workloads.hpp"

#include "../batch_notation.hpp"
#include "common.hpp"

#include <algorithm>
#include <utility>

namespace bench {

const Shape kShapes[4] = {
    {"gqa4-d128", 32, 8, 128, true},
    {"gqa6-d256", 24, 4, 256, true},
    {"gqa8-d128", 64, 8, 128, false},
    {"mha-d64", 16, 16, 64, false},
};

const Formats kFormats[7] = {
    {PKV_FORMAT_F16, PKV_FORMAT_F16, "f16", false},
    {PKV_FORMAT_BF16, PKV_FORMAT_BF16, "bf16", false},
    {PKV_FORMAT_Q8_0, PKV_FORMAT_Q8_0, "q8_0", true},
    {PKV_FORMAT_Q4_0, PKV_FORMAT_Q4_0, "q4_0", true},
    {PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0, "q8_0/q4_0", true},
    {PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E4M3, "fp8_e4m3", true},
    {PKV_FORMAT_FP8_E5M2, PKV_FORMAT_FP8_E5M2, "fp8_e5m2", true},
};

namespace {

// Bit masks over kShapes and kFormats, in their order.
enum : unsigned { ALL_SHAPES = 0xf, GQA4 = 0x1 };
enum : unsigned { F16 = 0x1, FLOATS = 0x3, QUANT = 0x1c, FP8 = 0x60, ALL_FORMATS = 0x7f };

std::string tokens_label(uint32_t n) { return n % 1024 == 0 ? strf("%uK", n / 1024) : strf("%u", n); }

std::vector<std::string> cross(std::vector<uint32_t> bs, std::vector<uint32_t> ls) {
  std::vector<std::string> out;
  for (uint32_t b : bs)
    for (uint32_t l : ls) out.push_back(strf("%ux", b) + tokens_label(l));
  return out;
}

const uint32_t K1 = 1024;

} // namespace

uint64_t row_bytes(pkv_format f, uint32_t d) {
  switch (f) {
  case PKV_FORMAT_F32: return 4ull * d;
  case PKV_FORMAT_F16:
  case PKV_FORMAT_BF16: return 2ull * d;
  case PKV_FORMAT_Q8_0: return d / 32 * 34ull;
  case PKV_FORMAT_Q4_0: return d / 32 * 18ull;
  case PKV_FORMAT_FP8_E4M3:
  case PKV_FORMAT_FP8_E5M2: return d;
  default: return 0;
  }
}
uint64_t token_bytes(const Shape &s, pkv_format k, pkv_format v) {
  return s.hkv * (row_bytes(k, s.d) + row_bytes(v, s.d));
}

pkv_format io_format(const Formats &f) { return f.k == PKV_FORMAT_BF16 ? PKV_FORMAT_BF16 : PKV_FORMAT_F16; }

std::vector<Tmpl> full_matrix() {
  return {
      {"uniform-%s", cross({1, 8, 32, 128}, {K1, 4 * K1, 32 * K1, 128 * K1}), ALL_SHAPES, ALL_FORMATS,
       {16}, {1}, "default run: gqa4-d128 f16 at 1x1K, 1x4K, 8x1K, 8x4K, 8x8K; 8x1K for the other shapes, formats"},
      {"ragged-long", {"1x128K+7x8K"}, ALL_SHAPES, ALL_FORMATS, {16}, {1}, "128K context: --full only"},
      {"ragged-short", {"1x4K+7x256"}, ALL_SHAPES, ALL_FORMATS, {16}, {1}, "default run: f16 only"},
      {"ragged-serving", {"64~16..32K"}, ALL_SHAPES, ALL_FORMATS, {16}, {1},
       "default run: ragged-serving-small (16 sequences in [16, 2K], gqa4-d128 f16)"},
      {"page-size-%s", {"8x32K"}, GQA4, ALL_FORMATS, {8, 16, 32, 64, 128}, {1},
       "default run: page-size-1x4K, f16"},
      {"spec-verify-%s", {"8x32K"}, GQA4, ALL_FORMATS, {16}, {2, 4, 8}, "default run: spec-verify-8x4K, f16"},
      {"variants-%s", {"8x32K", "1x128K"}, GQA4, F16 | QUANT | FP8, {16}, {1, 8}, "default run: variants-1x4K, f16",
       Variant::scores},
      {"window4K-%s", {"8x32K", "1x128K"}, GQA4, F16, {16}, {1}, "default run: window4K-1x16K", Variant::window4K},
  };
}

std::vector<Tmpl> cpu_matrix() {
  return {
      {"uniform-%s", {"1x1K", "1x4K", "8x1K", "8x4K", "8x8K"}, GQA4, F16, {16}, {1}, ""},
      {"uniform-%s", {"8x1K"}, ALL_SHAPES & ~GQA4, FLOATS, {16}, {1}, ""},
      {"uniform-%s", {"8x1K"}, GQA4, ALL_FORMATS & ~F16, {16}, {1}, ""},
      {"ragged-short", {"1x4K+7x256"}, ALL_SHAPES, F16, {16}, {1}, ""},
      {"ragged-serving-small", {"16~16..2K"}, GQA4, F16, {16}, {1}, ""},
      {"page-size-%s", {"1x4K"}, GQA4, F16, {8, 16, 32, 64, 128}, {1}, ""},
      {"spec-verify-%s", {"8x4K"}, GQA4, F16, {16}, {2, 4, 8}, ""},
      {"variants-%s", {"1x4K"}, GQA4, F16, {16}, {1}, "", Variant::scores},
      {"window4K-%s", {"1x16K"}, GQA4, F16, {16}, {1}, "", Variant::window4K},
  };
}

std::vector<Workload> expand(const std::vector<Tmpl> &tmpls) {
  std::vector<Workload> out;
  for (const Tmpl &t : tmpls)
    for (const std::string &batch : t.batches)
      for (size_t si = 0; si < sizeof kShapes / sizeof kShapes[0]; si++)
        for (size_t fi = 0; fi < sizeof kFormats / sizeof kFormats[0]; fi++)
          for (uint32_t page : t.pages)
            for (uint32_t q : t.qtokens) {
              if (!(t.shapes >> si & 1) || !(t.formats >> fi & 1)) continue;
              if (kFormats[fi].quant && !kShapes[si].main) continue;
              Workload w;
              std::string pattern = t.name;
              size_t p = pattern.find("%s");
              w.group = pattern.substr(0, p == std::string::npos ? pattern.size() : p);
              if (!w.group.empty() && w.group.back() == '-') w.group.pop_back();
              w.name = p == std::string::npos ? pattern : pattern.replace(p, 2, batch);
              if (q > 1) w.name += strf("-q%u", q);
              w.batch = batch;
              w.shape = &kShapes[si];
              w.fmt = &kFormats[fi];
              w.page = page;
              w.qtok = q;
              w.lens = batch_notation::parse_batch(batch);
              w.cpu_note = t.cpu_note;
              w.variant = t.variant;
              w.id = w.name + "/" + w.shape->name + "/" + w.fmt->name + strf("/p%u", page);
              out.push_back(w);
            }
  return out;
}

std::string lengths_summary(const std::vector<uint32_t> &lens) {
  std::vector<std::pair<uint32_t, uint32_t>> runs;
  for (uint32_t l : lens) {
    if (!runs.empty() && runs.back().second == l) runs.back().first++;
    else runs.push_back({1, l});
  }
  if (runs.size() <= 3) {
    std::string s;
    for (auto &r : runs) s += (s.empty() ? "" : "+") + strf("%ux%u", r.first, r.second);
    return s;
  }
  auto mm = std::minmax_element(lens.begin(), lens.end());
  return strf("%zu in %u..%u", lens.size(), *mm.first, *mm.second);
}

} // namespace bench
