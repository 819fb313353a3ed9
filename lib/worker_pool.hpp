// A fixed set of threads that run the items of one parallel loop at a time; the calling thread
// works too. The CPU backend's attention runs on one, so a decode call costs no thread creation; the
// GPU backend packs large uploads on one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pkv {

class WorkerPool {
 public:
  // threads: total threads including the caller, >= 1. Throws PKV_ERR_OUT_OF_MEMORY when the system
  // refuses a thread, with none left running.
  explicit WorkerPool(uint32_t threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool &) = delete;
  WorkerPool &operator=(const WorkerPool &) = delete;

  uint32_t threads() const { return uint32_t(workers_.size()) + 1; }
  // Runs fn(i, worker) for every i < n, spread over the threads (worker < threads(): which thread
  // runs it, the caller being 0, so per-thread buffers can live in the caller's arrays rather than
  // in thread_local objects: under MinGW their destructors crashed now and then at thread exit);
  // returns when all are done, rethrowing the first exception an item threw.
  void run(uint32_t n, const std::function<void(uint32_t item, uint32_t worker)> &fn);

 private:
  void stop() noexcept; // ends and joins every worker thread
  void work_loop(uint32_t worker);
  void drain(uint32_t worker);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::mutex run_mu_; // one loop at a time
  const std::function<void(uint32_t, uint32_t)> *fn_ = nullptr;
  uint32_t n_ = 0, next_ = 0, finished_ = 0;
  uint64_t round_ = 0;
  bool stop_ = false;
  std::mutex error_mu_;
  std::exception_ptr error_;
};

} // namespace pkv
