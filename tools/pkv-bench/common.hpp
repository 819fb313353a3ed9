// What every part of pkv-bench shares: errors, the clock, statistics, formatting, the run's
// environment and its random values.
#pragma once

#include "pagedkv.h"

#include "../batch_notation.hpp"
#include "bench_device.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <new>
#include <string>
#include <vector>

namespace bench {

// ---------------------------------------------------------------------------------------------
// Errors: every status is checked. Unsupported and out-of-memory skip a workload; the rest fail it.

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Skipped : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(pkv_status st, const char *what);

// Runs a row's measurement: Skipped or a host out of memory marks the row skipped, a Failure an
// error, each with its reason.
template <class Row, class Measure> void measure_row(Row &r, Measure measure) {
  try {
    measure();
  } catch (const Skipped &x) {
    r.status = "skipped";
    r.reason = x.what();
  } catch (const std::bad_alloc &) {
    r.status = "skipped";
    r.reason = "host out of memory";
  } catch (const Failure &x) {
    r.status = "error";
    r.reason = x.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Small helpers: clock, statistics, formatting.

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0);

double median(std::vector<double> v);
uint64_t sum_of(const std::vector<uint32_t> &v);

// MinGW formats through its own C99 printf, which its gcc checks as gnu_printf (lib/error.hpp's
// PKV_PRINTF_LIKE does the same; this program uses the public API only, so it says it again).
#if defined(__MINGW32__)
std::string strf(const char *fmt, ...) __attribute__((format(__MINGW_PRINTF_FORMAT, 1, 2)));
#else
std::string strf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#endif

// ---------------------------------------------------------------------------------------------
// The run's environment.

struct Env {
  pkv_context *ctx = nullptr;
  pkv_backend backend = PKV_BACKEND_AUTO;
  std::string device;
  bool cpu = false;
  unsigned threads = 0;        // pkv_context_desc.threads (0: the library's choice)
  uint32_t iters = 50;
  uint32_t chunk_pages = 0;    // pkv_decode_args.chunk_pages: 0, the planner's split
  uint64_t rotate_bytes = 128ull << 20;
  uint64_t mem_avail = 0;      // host bytes available for pools (CPU backend); 0: unknown
  double bw_gbs = 0;           // measured (or given) read bandwidth, GB/s; 0: none
  std::string bw_method;
  std::vector<uint16_t> bank;  // random F16 K/V source values
  std::unique_ptr<BenchDevice> dev; // GPU backends: the bench's stream, q/out buffers and timing events
  batch_notation::Rng rng{12345};
};

// MemAvailable from /proc/meminfo in bytes; 0 where the system does not say.
uint64_t mem_available();

// Random, never-zero values in [-1, -0.05] U [0.05, 1], encoded in fmt (F16 or BF16).
std::vector<uint16_t> random_values(Env &e, pkv_format fmt, size_t n);

} // namespace bench
