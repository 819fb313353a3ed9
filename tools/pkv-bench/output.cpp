// The tables and the JSON (output.hpp); docs/benchmarks.md describes both.
#include "output.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

namespace bench {

namespace {

std::string json_str(const std::string &s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += (char)c;
    else if (c < 0x20) o += strf("\\u%04x", c);
    else o += (char)c;
  }
  return o + "\"";
}
std::string json_num(double x, const char *fmt = "%.6g") { return std::isfinite(x) ? strf(fmt, x) : "null"; }

} // namespace

void print_decode_header() {
  std::printf("%-24s %-10s %-10s %4s %-20s %10s %8s %7s %6s %10s %6s\n", "workload", "shape", "k/v", "page",
              "lengths", "time us", "MB", "GB/s", "% bw", "base us", "ratio");
}

void print_decode_row(const DecodeResult &r) {
  const Workload &w = *r.w;
  std::printf("%-24s %-10s %-10s %4u %-20s ", w.name.c_str(), w.shape->name, w.fmt->name, w.page,
              lengths_summary(w.lens).c_str());
  if (r.status != "ok") {
    std::printf("%s: %s\n", r.status.c_str(), r.reason.c_str());
  } else {
    std::printf("%10.1f %8.1f %7.2f %6s ", r.us, r.bytes / 1e6, r.gbs, r.pct > 0 ? strf("%.1f", r.pct).c_str() : "-");
    if (r.base_reason.empty()) std::printf("%10.1f %6.2f\n", r.base_us, r.ratio);
    else std::printf("%10s %6s  (baseline skipped: %s)\n", "-", "-", r.base_reason.c_str());
  }
  std::fflush(stdout);
}

void print_left_to_full(const std::vector<Workload> &run, const std::string &filter) {
  std::set<std::string> ran;
  for (const Workload &w : run) ran.insert(w.id);
  std::vector<Workload> whole = expand(full_matrix());
  std::vector<std::string> lines;
  for (size_t i = 0; i < whole.size();) {
    size_t j = i, left = 0, n = 0;
    for (; j < whole.size() && whole[j].group == whole[i].group; j++) {
      if (!filter.empty() && whole[j].id.find(filter) == std::string::npos) continue;
      n++;
      if (!ran.count(whole[j].id)) left++;
    }
    if (left)
      lines.push_back(strf("  %-16s %3zu of %3zu not run: %s", whole[i].group.c_str(), left, n, whole[i].cpu_note));
    i = j;
  }
  if (!lines.empty()) {
    std::printf("\nskipped (need --full: the whole matrix is sized for a GPU):\n");
    for (auto &l : lines) std::printf("%s\n", l.c_str());
  }
}

void print_append_header() {
  std::printf("\n%-38s %6s %10s %12s %10s %10s %10s %8s  %s\n", "append (host f16 source)", "rows", "time us", "rows/s",
              "src GB/s", "page GB/s", "copy GB/s", "% copy", "(copy: the source's bytes into device memory)");
}

void print_append_row(const AppendResult &r) {
  if (r.status == "ok")
    std::printf("%-38s %6u %10.1f %12.0f %10.2f %10.2f %10.2f %8.1f\n", r.id.c_str(), r.rows, r.us, r.rows_per_s,
                r.src_gbs, r.page_gbs, r.copy_gbs, 100.0 * r.src_gbs / r.copy_gbs);
  else
    std::printf("%-38s %s: %s\n", r.id.c_str(), r.status.c_str(), r.reason.c_str());
  std::fflush(stdout);
}

void print_overhead_header() {
  std::printf("\n%-34s %10s  %s\n", "host overhead", "per call", "what");
}

void print_overhead_row(const OverheadResult &r) {
  if (r.status == "ok")
    std::printf("%-34s %7.*f %s  %s\n", r.id.c_str(), r.unit == "us" ? 2 : 0, r.value, r.unit.c_str(), r.what.c_str());
  else
    std::printf("%-34s %s: %s\n", r.id.c_str(), r.status.c_str(), r.reason.c_str());
}

void print_transfer_header() {
  std::printf("\n%-34s %10s %10s %8s %10s %8s  %s\n", "sequence images", "MB", "time us", "GB/s", "copy GB/s", "% copy",
              "(copy: the same bytes, same direction)");
}

void print_transfer_row(const TransferResult &r) {
  if (r.status == "ok")
    std::printf("%-34s %10.1f %10.1f %8.2f %10.2f %8.1f\n", r.id.c_str(), r.bytes / 1e6, r.us, r.gbs, r.copy_gbs, r.pct);
  else
    std::printf("%-34s %s: %s\n", r.id.c_str(), r.status.c_str(), r.reason.c_str());
  std::fflush(stdout);
}

void print_extend_header() {
  std::printf("\n%-40s %10s %10s %8s  %s\n", "extend", "GFLOP", "time us", "TFLOP/s",
              "(causal FLOPs: 4 x q_heads x head_dim per position a query sees)");
}

void print_extend_row(const ExtendResult &r) {
  if (r.status == "ok")
    std::printf("%-40s %10.2f %10.1f %8.3f\n", r.id.c_str(), r.flops / 1e9, r.us, r.tflops);
  else
    std::printf("%-40s %s: %s\n", r.id.c_str(), r.status.c_str(), r.reason.c_str());
  std::fflush(stdout);
}

void write_json(const char *path, const Env &e, const Meta &m, const std::vector<DecodeResult> &dec,
                const std::vector<AppendResult> &app, const std::vector<OverheadResult> &ovh,
                const std::vector<TransferResult> &xfer, const std::vector<ExtendResult> &ext) {
  // Written whole after every row, through a temporary file, so the file is always complete JSON.
  const std::string tmp = std::string(path) + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "pkv-bench: cannot write %s: %s\n", tmp.c_str(), std::strerror(errno));
    return;
  }
  std::string common = strf("\"device\": %s, \"backend\": %s, \"library_version\": %s, \"git_revision\": %s",
                            json_str(m.device).c_str(), json_str(m.backend).c_str(),
                            json_str(m.version).c_str(), json_str(m.rev).c_str());
  std::fprintf(f, "{\n  \"tool\": \"pkv-bench\",\n  %s,\n", common.c_str());
  std::fprintf(f, "  \"date\": %s,\n  \"command\": %s,\n  \"threads\": %u,\n  \"iters\": %u,\n",
               json_str(m.date).c_str(), json_str(m.command).c_str(), e.threads, e.iters);
  std::fprintf(f, "  \"bandwidth\": {\"gbs\": %s, \"method\": %s},\n",
               e.bw_gbs > 0 ? json_num(e.bw_gbs, "%.3f").c_str() : "null", json_str(e.bw_method).c_str());

  std::fprintf(f, "  \"decode\": [");
  for (size_t i = 0; i < dec.size(); i++) {
    const DecodeResult &r = dec[i];
    const Workload &w = *r.w;
    std::string lens;
    if (w.lens.size() <= 16) {
      for (uint32_t l : w.lens) lens += (lens.empty() ? "" : ", ") + strf("%u", l);
      lens = "[" + lens + "]";
    } else {
      auto mm = std::minmax_element(w.lens.begin(), w.lens.end());
      lens = strf("{\"count\": %zu, \"min\": %u, \"max\": %u, \"total\": %llu, \"spec\": %s}", w.lens.size(),
                  *mm.first, *mm.second, (unsigned long long)sum_of(w.lens), json_str(w.batch).c_str());
    }
    bool ok = r.status == "ok", base = ok && r.base_reason.empty();
    std::fprintf(f, "%s\n    {\"id\": %s, \"name\": %s, \"status\": %s, \"reason\": %s,\n", i ? "," : "",
                 json_str(w.id).c_str(), json_str(w.name).c_str(), json_str(r.status).c_str(),
                 json_str(r.reason).c_str());
    std::fprintf(f, "     \"shape\": {\"name\": %s, \"q_heads\": %u, \"kv_heads\": %u, \"head_dim\": %u},\n",
                 json_str(w.shape->name).c_str(), w.shape->hq, w.shape->hkv, w.shape->d);
    std::fprintf(f, "     \"k_format\": %s, \"v_format\": %s, \"io_format\": %s, \"page_size\": %u, \"q_tokens\": %u,\n",
                 json_str(pkv_format_name(w.fmt->k)).c_str(), json_str(pkv_format_name(w.fmt->v)).c_str(),
                 json_str(pkv_format_name(io_format(*w.fmt))).c_str(), w.page, w.qtok);
    std::fprintf(f, "     \"batch\": %zu, \"lengths\": %s, \"tokens\": %llu, \"copies\": %u, \"baseline_copies\": %u,\n",
                 w.lens.size(), lens.c_str(), (unsigned long long)sum_of(w.lens), r.copies, r.base_copies);
    std::fprintf(f, "     \"time_us\": %s, \"time_min_us\": %s, \"bytes\": %llu, \"gbs\": %s, \"pct_of_bw\": %s,\n",
                 ok ? json_num(r.us).c_str() : "null", ok ? json_num(r.min_us).c_str() : "null",
                 (unsigned long long)r.bytes, ok ? json_num(r.gbs).c_str() : "null",
                 ok && r.pct > 0 ? json_num(r.pct, "%.2f").c_str() : "null");
    std::fprintf(f, "     \"baseline_time_us\": %s, \"baseline_bytes\": %llu, \"ratio\": %s, \"baseline_reason\": %s,\n",
                 base ? json_num(r.base_us).c_str() : "null", (unsigned long long)r.base_bytes,
                 base ? json_num(r.ratio, "%.4f").c_str() : "null", json_str(r.base_reason).c_str());
    std::fprintf(f, "     %s}", common.c_str());
  }
  std::fprintf(f, "\n  ],\n  \"append\": [");
  for (size_t i = 0; i < app.size(); i++) {
    const AppendResult &r = app[i];
    bool ok = r.status == "ok";
    std::fprintf(f, "%s\n    {\"id\": %s, \"status\": %s, \"reason\": %s, \"page_format\": %s, \"src_format\": \"f16\", "
                    "\"rows_per_call\": %u, \"time_us\": %s, \"rows_per_s\": %s, \"src_gbs\": %s, \"page_gbs\": %s, "
                    "\"copy_time_us\": %s, \"copy_gbs\": %s}",
                 i ? "," : "", json_str(r.id).c_str(), json_str(r.status).c_str(), json_str(r.reason).c_str(),
                 json_str(pkv_format_name(r.fmt)).c_str(), r.rows, ok ? json_num(r.us).c_str() : "null",
                 ok ? json_num(r.rows_per_s).c_str() : "null", ok ? json_num(r.src_gbs).c_str() : "null",
                 ok ? json_num(r.page_gbs).c_str() : "null", ok ? json_num(r.copy_us).c_str() : "null",
                 ok ? json_num(r.copy_gbs).c_str() : "null");
  }
  std::fprintf(f, "\n  ],\n  \"overhead\": [");
  for (size_t i = 0; i < ovh.size(); i++) {
    const OverheadResult &r = ovh[i];
    std::fprintf(f, "%s\n    {\"id\": %s, \"what\": %s, \"status\": %s, \"reason\": %s, \"value\": %s, \"unit\": %s}",
                 i ? "," : "", json_str(r.id).c_str(), json_str(r.what).c_str(), json_str(r.status).c_str(),
                 json_str(r.reason).c_str(), r.status == "ok" ? json_num(r.value).c_str() : "null",
                 json_str(r.unit).c_str());
  }
  std::fprintf(f, "\n  ],\n  \"transfer\": [");
  for (size_t i = 0; i < xfer.size(); i++) {
    const TransferResult &r = xfer[i];
    const bool ok = r.status == "ok";
    std::fprintf(f, "%s\n    {\"id\": %s, \"status\": %s, \"reason\": %s, \"op\": %s, \"memory\": %s, \"bytes\": %llu, "
                    "\"time_us\": %s, \"gbs\": %s, \"copy_time_us\": %s, \"copy_gbs\": %s, \"pct_of_copy\": %s}",
                 i ? "," : "", json_str(r.id).c_str(), json_str(r.status).c_str(), json_str(r.reason).c_str(),
                 json_str(r.item->op).c_str(), json_str(r.item->where).c_str(), (unsigned long long)r.bytes,
                 ok ? json_num(r.us).c_str() : "null", ok ? json_num(r.gbs).c_str() : "null",
                 ok ? json_num(r.copy_us).c_str() : "null", ok ? json_num(r.copy_gbs).c_str() : "null",
                 ok ? json_num(r.pct, "%.2f").c_str() : "null");
  }
  std::fprintf(f, "\n  ],\n  \"extend\": [");
  for (size_t i = 0; i < ext.size(); i++) {
    const ExtendResult &r = ext[i];
    const bool ok = r.status == "ok";
    std::fprintf(f, "%s\n    {\"id\": %s, \"status\": %s, \"reason\": %s, \"sequences\": %u, \"cached\": %u, "
                    "\"new\": %u, \"prefix\": %s, \"tree\": %s, \"flops\": %.0f, \"time_us\": %s, \"tflops\": %s}",
                 i ? "," : "", json_str(r.id).c_str(), json_str(r.status).c_str(), json_str(r.reason).c_str(),
                 r.item->count, r.item->cached, r.item->fresh, r.item->prefix ? "true" : "false",
                 r.item->tree ? "true" : "false", r.flops, ok ? json_num(r.us).c_str() : "null",
                 ok ? json_num(r.tflops, "%.4f").c_str() : "null");
  }
  std::fprintf(f, "\n  ]\n}\n");
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path) != 0)
    std::fprintf(stderr, "pkv-bench: error writing %s: %s\n", path, std::strerror(errno));
}

} // namespace bench
