// A C++ program linked against libpagedkv.a, as C++ engines link it: it has its own exception
// handling data, which the archive's must not displace (tools/static-archive). Errors inside the
// library travel as exceptions up to its boundary, so a failing call exercises exactly that.
#include <cstdio>
#include <stdexcept>

#include "pagedkv.h"

int main() {
  try { // this program's own exceptions work too
    throw std::runtime_error("engine");
  } catch (const std::runtime_error &) {
  }
  pkv_context *ctx = nullptr;
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  cd.backend = PKV_BACKEND_CPU;
  if (pkv_context_create(&cd, &ctx) != PKV_OK) return 1;
  pkv_pool_desc pd = PKV_POOL_DESC_INIT;
  pd.layers = 1;
  pd.kv_heads = 1;
  pd.head_dim = 64;
  pd.pages = 4;
  pkv_pool *pool = nullptr;
  if (pkv_pool_create(ctx, &pd, &pool) != PKV_OK) return 1;
  const pkv_status st = pkv_seq_free(pool, pkv_seq{0});
  std::printf("pkv_seq_free(zero handle): %s\n", pkv_last_error());
  const bool ok = st == PKV_ERR_STALE_HANDLE && pkv_last_error()[0] != '\0';
  pkv_pool_destroy(pool);
  pkv_context_destroy(ctx);
  return ok ? 0 : 1;
}
