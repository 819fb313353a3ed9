// What every part of the GPU backend does with the device: run a call and turn its failure into an
// error naming the call, look a kernel up, launch one on the backend's stream, and make the device
// current for a scope.
#pragma once

#include <string>

#include "../error.hpp"
#include "gpu_device.hpp"

namespace pkv {
namespace gpu {

struct Runtime {
  Device *dev = nullptr;
  Stream stream = nullptr;

  // `what` follows the call's name in the message: "cuMemAlloc (scratch)".
  void check(Call c, const char *what = "") const {
    if (c.result == kSuccess) return;
    fail(c.result == kOutOfMemory ? PKV_ERR_OUT_OF_MEMORY : PKV_ERR_BACKEND, "%s%s: %s", c.name, what,
         dev->describe(c.result).c_str());
  }

  Function function(Module module, const char *name) const {
    Function f = nullptr;
    check(dev->function(&f, module, name), (" " + std::string(name)).c_str());
    return f;
  }

  template <class Params>
  void launch(Function f, unsigned gx, unsigned gy, unsigned gz, Params *params, unsigned bx, unsigned by = 1,
              unsigned bz = 1, unsigned shared_bytes = 0) const {
    void *args[] = {params};
    check(dev->launch(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, args));
  }
};

// Makes the device current on this thread for a scope of cleanup, which cannot fail: where the device
// cannot be made current, what the scope releases is released all the same (both runtimes free
// memory, modules, streams and events by their handles), since keeping it would be a certain leak.
class CurrentForCleanup {
 public:
  explicit CurrentForCleanup(Device *dev) noexcept : dev_(dev), entered_(dev->enter(&token_).result == kSuccess) {}
  ~CurrentForCleanup() {
    if (entered_) dev_->leave(token_);
  }
  CurrentForCleanup(const CurrentForCleanup &) = delete;
  CurrentForCleanup &operator=(const CurrentForCleanup &) = delete;

 private:
  Device *dev_;
  int token_ = 0;
  bool entered_;
};

// Makes the device current on this thread for the scope.
class Current {
 public:
  explicit Current(const Runtime &rt) : rt_(rt) { rt_.check(rt_.dev->enter(&token_)); }
  ~Current() { rt_.dev->leave(token_); }
  Current(const Current &) = delete;
  Current &operator=(const Current &) = delete;

 private:
  const Runtime &rt_;
  int token_ = 0;
};

} // namespace gpu
} // namespace pkv
