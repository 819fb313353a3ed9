#include "decode_policy.hpp"

#include <cstdlib>
#include <cstring>

#include "../error.hpp"

namespace pkv {
namespace gpu {

namespace {

// The value of a set, non-empty variable, else null.
const char *setting(const char *name) {
  const char *v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// The index of `value` among `names`, or a failure listing them.
template <size_t N> uint32_t choose(const char *variable, const char *value, const char *const (&names)[N]) {
  for (uint32_t i = 0; i < N; i++)
    if (std::strcmp(value, names[i]) == 0) return i;
  std::string list;
  for (size_t i = 0; i < N; i++) list += std::string(i ? (i + 1 == N ? " or " : ", ") : "") + names[i];
  fail(PKV_ERR_INVALID_ARGUMENT, "%s=%s: expected %s (or unset)", variable, value, list.c_str());
}

} // namespace

DecodePolicy read_decode_policy() {
  DecodePolicy p;
  if (const char *v = setting("PKV_KERNEL_FAMILY")) {
    static const char *const names[] = {"tensor_core", "cuda_core", "generic"};
    static const KernelFamily families[] = {KernelFamily::tensor_core, KernelFamily::cuda_core, KernelFamily::generic};
    p.family = families[choose("PKV_KERNEL_FAMILY", v, names)];
    p.family_set = true;
    if (p.family == KernelFamily::tensor_core) p.tensor_core_switch = std::string("PKV_KERNEL_FAMILY=") + v;
  }
  if (const char *v = setting("PKV_TENSOR_CORE_TILES")) {
    static const char *const names[] = {"wide", "narrow", "ntiles", "all"};
    p.tiles = TileSet(choose("PKV_TENSOR_CORE_TILES", v, names));
    if (p.tensor_core_switch.empty()) p.tensor_core_switch = std::string("PKV_TENSOR_CORE_TILES=") + v;
  }
  if (const char *v = setting("PKV_FOUR_BLOCK")) {
    static const char *const names[] = {"off", "on"};
    p.four_block = choose("PKV_FOUR_BLOCK", v, names) == 1;
    if (p.tensor_core_switch.empty()) p.tensor_core_switch = std::string("PKV_FOUR_BLOCK=") + v;
  }
  if (const char *v = setting("PKV_PLAN")) {
    static const char *const names[] = {"uniform", "cheaper", "balanced"};
    static const Balance plans[] = {Balance::never, Balance::cheaper, Balance::always};
    p.plan = plans[choose("PKV_PLAN", v, names)];
  }
  if (const char *v = setting("PKV_SHARED_LIMIT")) {
    char *end = nullptr;
    const long bytes = std::strtol(v, &end, 10);
    if (*end || bytes <= 0 || bytes > (1 << 30))
      fail(PKV_ERR_INVALID_ARGUMENT, "PKV_SHARED_LIMIT=%s: expected a number of bytes (or unset)", v);
    p.shared_limit = int(bytes);
  }
  if (const char *v = setting("PKV_EXTEND_KERNEL")) {
    static const char *const names[] = {"auto", "tiles", "blocks"};
    static const ExtendTiles kinds[] = {ExtendTiles::filling, ExtendTiles::always, ExtendTiles::never};
    p.extend_tiles = kinds[choose("PKV_EXTEND_KERNEL", v, names)];
  }
  return p;
}

} // namespace gpu
} // namespace pkv
