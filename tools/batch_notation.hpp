// The notation pkv-bench and plan-table write batches in: "8x4K" (8 sequences of 4096 tokens), runs
// joined by '+' ("1x4K+7x256"), or "32~16..4K": 32 lengths drawn log-uniform in [16, 4096] from a
// fixed seed, so every run and every device sees the same lengths.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace batch_notation {

struct Rng { // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double unit() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
};

// "4K" = 4096, "256" = 256.
inline uint32_t parse_tokens(const std::string &s) {
  uint32_t v = (uint32_t)std::strtoul(s.c_str(), nullptr, 10);
  return (!s.empty() && s.back() == 'K') ? v * 1024 : v;
}

// The lengths of a batch; an empty list where any run does not parse.
inline std::vector<uint32_t> parse_batch(const std::string &text) {
  std::vector<uint32_t> lens;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find('+', pos);
    if (end == std::string::npos) end = text.size();
    std::string run = text.substr(pos, end - pos);
    size_t x = run.find('x'), t = run.find('~');
    if (x != std::string::npos) {
      uint32_t n = parse_tokens(run.substr(0, x)), len = parse_tokens(run.substr(x + 1));
      lens.insert(lens.end(), n, len);
    } else if (t != std::string::npos) {
      size_t dots = run.find("..");
      uint32_t n = parse_tokens(run.substr(0, t));
      double lo = std::log((double)parse_tokens(run.substr(t + 1, dots - t - 1)));
      double hi = std::log((double)parse_tokens(run.substr(dots + 2)));
      Rng rng{20261129};
      for (uint32_t i = 0; i < n; i++) lens.push_back((uint32_t)std::lround(std::exp(lo + (hi - lo) * rng.unit())));
    } else {
      return {};
    }
    pos = end + 1;
  }
  return lens;
}

} // namespace batch_notation
