// plan-table: the decode plans the library makes for batches, on this machine's default backend
// (or the one named), with the library's own defaults: it opens a context and a pool of the given
// shape, asks the backend for its decode configuration, and plans each batch as a pkv_decode does.
// --gpu-workers plans as the GPU backend's tensor-core kernel does for a device's worker counts
// instead (a planner change checked over the benchmark's batches before measuring it, without that
// device). Internal (linked with the library's objects), not
// installed.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "batch_notation.hpp"
#include "context.hpp"
#include "gpu/gpu_backend.hpp"
#include "plan.hpp"
#include "pool.hpp"
#include "pagedkv.h"

namespace {

void usage(FILE *f) {
  std::fprintf(f,
               "usage: plan-table [options] BATCH...\n"
               "  BATCH                pkv-bench's notation: 8x32K, 1x128K+7x8K, 64~16..32K\n"
               "  --backend NAME       auto (default), cpu, cuda or hip\n"
               "  --kv-heads N         KV heads (default 8)\n"
               "  --head-dim N         (default 128)\n"
               "  --format NAME        the pages' K and V format: f16 (default), bf16, q8_0, q4_0, f32\n"
               "  --page-size N        tokens a page (default 16)\n"
               "  --group N            query heads a KV head (default 4)\n"
               "  --q-tokens N         query tokens a sequence (default 1)\n"
               "  --chunk-pages N      an explicit chunk size, as pkv_decode_args.chunk_pages (default 0)\n"
               "  --gpu-workers W[/F]  plan as the GPU's tensor-core kernel does with W workers, F of them\n"
               "                       at the full rate (multiprocessors x blocks: docs/design.md)\n"
               "  --balance KIND       with --gpu-workers: uniform (default), cheaper or balanced, as PKV_PLAN\n"
               "The backend's switches (PKV_PLAN, PKV_KERNEL_FAMILY, ...: docs/testing.md) apply.\n");
}

[[noreturn]] void die(const std::string &what) {
  std::fprintf(stderr, "plan-table: %s\n", what.c_str());
  std::exit(2);
}

uint32_t number(const std::string &option, const std::string &text) {
  char *end = nullptr;
  const unsigned long v = std::strtoul(text.c_str(), &end, 10);
  if (text.empty() || *end || v == 0 || v > UINT32_MAX) die(option + " needs a positive number, not \"" + text + "\"");
  return uint32_t(v);
}

void check(pkv_status s, const char *what) {
  if (s != PKV_OK) die(std::string(what) + ": " + pkv_status_string(s) + ": " + pkv_last_error());
}

const char *family_name(pkv::KernelFamily f) {
  switch (f) {
  case pkv::KernelFamily::cpu: return "cpu";
  case pkv::KernelFamily::generic: return "generic";
  case pkv::KernelFamily::cuda_core: return "cuda-core";
  case pkv::KernelFamily::tensor_core: return "tensor-core";
  }
  return "?";
}

} // namespace

int main(int argc, char **argv) {
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  pkv_pool_desc pd = PKV_POOL_DESC_INIT;
  pd.layers = 1;
  pd.kv_heads = 8;
  pd.head_dim = 128;
  pd.page_size = 16;
  pd.k_format = pd.v_format = PKV_FORMAT_F16;
  uint32_t group = 4, q_tokens = 1, chunk_pages = 0, workers = 0, full_rate = 0;
  pkv::Balance balance = pkv::Balance::never;
  std::vector<std::string> batches;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a.rfind("--", 0) != 0) {
      batches.push_back(a);
      continue;
    }
    if (i + 1 >= argc) die(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--backend") {
      const char *names[] = {"auto", "cpu", "cuda", "hip"};
      const pkv_backend kinds[] = {PKV_BACKEND_AUTO, PKV_BACKEND_CPU, PKV_BACKEND_CUDA, PKV_BACKEND_HIP};
      auto at = std::find_if(std::begin(names), std::end(names), [&](const char *n) { return v == n; });
      if (at == std::end(names)) die("--backend takes auto, cpu, cuda or hip, not \"" + v + "\"");
      cd.backend = kinds[at - std::begin(names)];
    } else if (a == "--format") {
      const pkv_format formats[] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16, PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0};
      auto at = std::find_if(std::begin(formats), std::end(formats), [&](pkv_format f) { return v == pkv_format_name(f); });
      if (at == std::end(formats)) die("--format takes f32, f16, bf16, q8_0 or q4_0, not \"" + v + "\"");
      pd.k_format = pd.v_format = *at;
    } else if (a == "--balance") {
      if (v == "uniform") balance = pkv::Balance::never;
      else if (v == "cheaper") balance = pkv::Balance::cheaper;
      else if (v == "balanced") balance = pkv::Balance::always;
      else die("--balance takes uniform, cheaper or balanced, not \"" + v + "\"");
    } else if (a == "--gpu-workers") {
      const size_t slash = v.find('/');
      workers = number(a, v.substr(0, slash));
      full_rate = slash == std::string::npos ? workers : number(a, v.substr(slash + 1));
    } else if (a == "--kv-heads") pd.kv_heads = number(a, v);
    else if (a == "--head-dim") pd.head_dim = number(a, v);
    else if (a == "--page-size") pd.page_size = number(a, v);
    else if (a == "--group") group = number(a, v);
    else if (a == "--q-tokens") q_tokens = number(a, v);
    else if (a == "--chunk-pages") chunk_pages = number(a, v);
    else {
      usage(stderr);
      die("unknown option " + a);
    }
  }
  if (batches.empty()) {
    usage(stderr);
    return 2;
  }
  std::vector<std::vector<uint32_t>> lengths;
  for (const std::string &b : batches) {
    lengths.push_back(batch_notation::parse_batch(b));
    if (lengths.back().empty()) die("\"" + b + "\" is no batch (8x32K, 1x128K+7x8K, 64~16..32K)");
    pd.max_sequences = std::max<uint32_t>(pd.max_sequences, uint32_t(lengths.back().size()));
  }
  pd.pages = 1; // the plan depends on the pool's shape and capacity, not on its pages

  pkv_context *ctx = nullptr;
  pkv_pool *pool = nullptr;
  check(pkv_context_create(&cd, &ctx), "pkv_context_create");
  check(pkv_pool_create(ctx, &pd, &pool), "pkv_pool_create");
  const pkv::PoolGeometry &g = pool->geometry();
  pkv::DecodeConfig config = ctx->backend->decode_config(g, group * q_tokens);
  if (workers) {
    config = pkv::DecodeConfig{};
    config.family = pkv::KernelFamily::tensor_core;
    config.plan.workers = workers;
    config.plan.full_rate_workers = full_rate;
    config.plan.fixed_cost_tokens = config.plan.granule_tokens = pkv::kGpuChunkTokens;
    config.plan.limits = pkv::chosen_plan_bounds(pd.max_sequences, pd.kv_heads, workers);
    config.plan.balance = balance;
    config.plan.record_per_head = true;
  }
  const std::string backend = workers ? std::string("as a GPU") : pkv_backend_name(ctx->backend->kind()) + std::string(" backend");
  std::printf("%s, %s kernel: %u workers, %u at the full rate, fixed cost %u tokens, granule %u tokens\n",
              backend.c_str(), family_name(config.family), config.plan.workers,
              config.plan.full_rate_workers, config.plan.fixed_cost_tokens, config.plan.granule_tokens);

  // Items: a worker's units, (chunk, KV head); a balanced plan's fillers left out.
  std::printf("%-24s %6s %9s %8s %8s %7s %8s %7s\n", "batch", "seqs", "plan", "chunk", "chunks", "parts", "items",
              "rounds");
  for (size_t b = 0; b < batches.size(); b++) {
    const uint32_t count = uint32_t(lengths[b].size());
    std::vector<uint32_t> slots(count);
    for (uint32_t i = 0; i < count; i++) slots[i] = i;
    const pkv::DecodePlan plan =
        pkv::make_plan(config.plan, {lengths[b].data(), slots.data(), count, pd.page_size, pd.kv_heads, chunk_pages});
    const uint64_t records = uint64_t(std::count_if(plan.records.begin(), plan.records.end(),
                                                    [](const pkv::PlanRecord &r) { return r.seq != pkv::kNoSeq; }));
    const uint64_t items = plan.records_per_chunk == 1 && !plan.workers ? records * pd.kv_heads : records;
    const uint64_t rounds = plan.workers ? plan.records.size() / plan.workers
                                         : (items + config.plan.workers - 1) / config.plan.workers;
    const std::string kind = plan.workers ? "bal/" + std::to_string(plan.workers) : "uniform";
    std::printf("%-24s %6u %9s %8u %8u %7u %8llu %7llu\n", batches[b].c_str(), count, kind.c_str(),
                (plan.chunk_tokens + pd.page_size - 1) / pd.page_size, plan.workers ? unsigned(records) : plan.chunks(),
                plan.parts, (unsigned long long)items, (unsigned long long)rounds);
  }
  pkv_pool_destroy(pool);
  pkv_context_destroy(ctx);
  return 0;
}
