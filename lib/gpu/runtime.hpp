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
