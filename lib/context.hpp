// A context: one backend on one device with its stream. Pools hold a reference count on it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "backend.hpp"

struct pkv_context {
  std::unique_ptr<pkv::Backend> backend;
  std::atomic<uint32_t> pools{0};
  // One backend call at a time: the context's pools share its backend (scratch buffers, worker
  // threads, staging memory). Taken after a pool's own lock, never before it.
  std::mutex mu;
};
