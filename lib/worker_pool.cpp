#include "worker_pool.hpp"

#include <cerrno>
#include <system_error>
#include <utility>

#include "error.hpp"
#include "fault.hpp"

namespace pkv {

// A thread that cannot start stops the ones already started before the error leaves: the destructor
// does not run for a constructor that throws, and a joinable std::thread destroyed terminates.
WorkerPool::WorkerPool(uint32_t threads) {
  try {
    workers_.reserve(threads - 1);
    for (uint32_t i = 1; i < threads; i++) {
      if (fault::fails(fault::Kind::thread)) throw std::system_error(EAGAIN, std::generic_category());
      workers_.emplace_back([this, i] { work_loop(i); });
    }
  } catch (const std::system_error &e) {
    const uint32_t started = uint32_t(workers_.size());
    stop();
    fail(PKV_ERR_OUT_OF_MEMORY, "could not start worker thread %u of %u: %s", started + 1, threads - 1, e.what());
  } catch (...) {
    stop();
    throw;
  }
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto &t : workers_) t.join();
  workers_.clear();
}

// Takes items until none is left; each finished item is counted so run() knows when to return.
void WorkerPool::drain(uint32_t worker) {
  std::unique_lock<std::mutex> lock(mu_);
  while (next_ < n_) {
    const uint32_t i = next_++;
    lock.unlock();
    try {
      (*fn_)(i, worker);
    } catch (...) {
      std::lock_guard<std::mutex> first(error_mu_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    if (++finished_ == n_) done_.notify_all();
  }
}

void WorkerPool::work_loop(uint32_t worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || round_ != seen; });
      if (stop_) return;
      seen = round_;
    }
    drain(worker);
  }
}

void WorkerPool::run(uint32_t n, const std::function<void(uint32_t, uint32_t)> &fn) {
  if (n == 0) return;
  std::lock_guard<std::mutex> one_at_a_time(run_mu_); // the caller is worker 0 either way
  if (workers_.empty() || n == 1) {
    for (uint32_t i = 0; i < n; i++) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    finished_ = 0;
    round_++;
  }
  wake_.notify_all();
  drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return finished_ == n_; });
  fn_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

} // namespace pkv
