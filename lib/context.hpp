// A context: one backend on one device with its stream. Pools hold a reference count on it.
#pragma once

#include <atomic>
#include <memory>

#include "backend.hpp"

struct pkv_context {
  std::unique_ptr<pkv::Backend> backend;
  std::atomic<uint32_t> pools{0};
};
