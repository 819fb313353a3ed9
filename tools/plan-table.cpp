// plan-table: the decode plans lib/plan.cpp makes for batches under given worker counts, without a
// device or a pool: to check a planner change over the benchmark's batches before measuring it.
// Internal (compiled with lib/plan.cpp), not installed. The worker counts are the backend's for the
// pool's kernel (on an H200, multiprocessors x blocks: docs/design.md "Decode plan").
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "batch_notation.hpp"
#include "gpu/gpu_backend.hpp"
#include "plan.hpp"

namespace {

void usage(FILE *f) {
  std::fprintf(f,
               "usage: plan-table [options] WORKERS[/FULL_RATE] BATCH...\n"
               "  WORKERS      work items that run at once (FULL_RATE of them at the full rate; default all)\n"
               "  BATCH        pkv-bench's notation: 8x32K, 1x128K+7x8K, 64~16..32K\n"
               "  --kv-heads N          KV heads (default 8)\n"
               "  --page-size N         tokens a page (default 16)\n"
               "  --chunk-pages N       an explicit chunk size, as pkv_decode_args.chunk_pages (default 0)\n"
               "  --min-chunk-tokens N  the backend's shortest worthwhile chunk (default %u, the GPU's)\n"
               "  --granule-tokens N    the backend's granule (default %u, the GPU's; the CPU's: 256 and 1)\n"
               "  --plan KIND           cheaper (default: the tensor-core kernel's choice for one row tile),\n"
               "                        uniform (the older kernels', the CPU's) or balanced (PKV_PLAN)\n",
               pkv::kGpuChunkTokens, pkv::kGpuChunkTokens);
}

uint32_t number(const char *option, const char *text) {
  char *end = nullptr;
  const unsigned long v = std::strtoul(text, &end, 10);
  if (!*text || *end || v == 0 || v > UINT32_MAX) {
    std::fprintf(stderr, "plan-table: %s needs a positive number, not \"%s\"\n", option, text);
    std::exit(2);
  }
  return uint32_t(v);
}

} // namespace

int main(int argc, char **argv) {
  uint32_t kv_heads = 8, page_size = 16, chunk_pages = 0;
  uint32_t min_chunk = pkv::kGpuChunkTokens, granule = pkv::kGpuChunkTokens;
  pkv::Balance balance = pkv::Balance::cheaper;
  std::vector<std::string> args;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a.rfind("--", 0) != 0) {
      args.push_back(a);
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "plan-table: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--plan") {
      const std::string kind = argv[++i];
      if (kind == "cheaper") balance = pkv::Balance::cheaper;
      else if (kind == "uniform") balance = pkv::Balance::never;
      else if (kind == "balanced") balance = pkv::Balance::always;
      else {
        std::fprintf(stderr, "plan-table: --plan takes cheaper, uniform or balanced, not \"%s\"\n", kind.c_str());
        return 2;
      }
      continue;
    }
    const uint32_t v = number(a.c_str(), argv[++i]);
    if (a == "--kv-heads") kv_heads = v;
    else if (a == "--page-size") page_size = v;
    else if (a == "--chunk-pages") chunk_pages = v;
    else if (a == "--min-chunk-tokens") min_chunk = v;
    else if (a == "--granule-tokens") granule = v;
    else {
      std::fprintf(stderr, "plan-table: unknown option %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (args.size() < 2) {
    usage(stderr);
    return 2;
  }
  const size_t slash = args[0].find('/');
  const uint32_t workers = number("WORKERS", args[0].substr(0, slash).c_str());
  const uint32_t full = slash == std::string::npos ? workers : number("FULL_RATE", args[0].substr(slash + 1).c_str());

  // Balanced plans: chunks are the pieces (fillers left out), each one item.
  std::printf("%-24s %6s %9s %8s %8s %7s %8s %7s\n", "batch", "seqs", "plan", "chunk", "chunks", "parts", "items",
              "rounds");
  for (size_t b = 1; b < args.size(); b++) {
    const std::vector<uint32_t> lengths = batch_notation::parse_batch(args[b]);
    if (lengths.empty()) {
      std::fprintf(stderr, "plan-table: \"%s\" is no batch (8x32K, 1x128K+7x8K, 64~16..32K)\n", args[b].c_str());
      return 2;
    }
    const uint32_t count = uint32_t(lengths.size());
    const pkv::PlanRequest req{lengths.data(), count, page_size, kv_heads, chunk_pages, workers, full, min_chunk,
                               granule, pkv::chosen_plan_bounds(count, kv_heads, workers), balance};
    const pkv::DecodePlan plan = pkv::make_plan(req);
    size_t chunks = plan.chunks.size();
    if (plan.workers)
      chunks = size_t(std::count_if(plan.chunks.begin(), plan.chunks.end(),
                                    [](const pkv::DecodeChunk &c) { return c.seq != pkv::kNoSeq; }));
    const unsigned long long items = plan.workers ? chunks : (unsigned long long)chunks * kv_heads;
    const unsigned long long rounds = plan.workers ? plan.chunks.size() / plan.workers : (items + workers - 1) / workers;
    const std::string kind = plan.workers ? "bal/" + std::to_string(plan.workers) : "uniform";
    std::printf("%-24s %6u %9s %8u %8zu %7u %8llu %7llu\n", args[b].c_str(), count, kind.c_str(),
                (plan.chunk_tokens + page_size - 1) / page_size, chunks, plan.parts, items, rounds);
  }
  return 0;
}
