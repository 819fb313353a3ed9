// pkv-bench's shared helpers (common.hpp).
#include "common.hpp"

#include <algorithm>
#include <cstdarg>
#include <cstdio>

namespace bench {

void check(pkv_status st, const char *what) {
  if (st == PKV_OK) return;
  std::string detail = pkv_last_error(); // copied first: the next pagedkv call may replace it
  std::string name = pkv_status_string(st);
  name = name.substr(0, name.find(':'));
  if (detail.compare(0, name.size(), name) != 0) detail = detail.empty() ? name : name + ": " + detail;
  std::string msg = std::string(what) + ": " + detail;
  if (st == PKV_ERR_UNSUPPORTED || st == PKV_ERR_OUT_OF_MEMORY) throw Skipped(msg);
  throw Failure(msg);
}

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

uint64_t sum_of(const std::vector<uint32_t> &v) {
  uint64_t s = 0;
  for (uint32_t x : v) s += x;
  return s;
}

std::string strf(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

uint64_t mem_available() {
  FILE *f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
  std::fclose(f);
  return kb * 1024ull;
}

std::vector<uint16_t> random_values(Env &e, pkv_format fmt, size_t n) {
  std::vector<float> f(n);
  for (float &x : f) {
    uint64_t r = e.rng.next();
    x = (float)((0.05 + 0.95 * (double)(r >> 12) / 4503599627370496.0) * ((r & 1) ? 1 : -1));
  }
  std::vector<uint16_t> out(n);
  check(pkv_convert_from_f32(fmt, f.data(), n, out.data()), "pkv_convert_from_f32");
  return out;
}

} // namespace bench
