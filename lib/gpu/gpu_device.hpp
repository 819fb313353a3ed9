// What the GPU backend (gpu_backend.cpp) needs of a vendor runtime, for one device: the CUDA driver
// (lib/cuda/cuda_device.cpp) and the HIP runtime (lib/hip/hip_device.cpp) each provide it. HIP's
// module API mirrors the CUDA driver's call for call, so most methods are one runtime call each;
// where the two differ (how a device is made current, attribute numbers, error texts) the adapter
// translates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../geometry.hpp"
#include "pagedkv.h"

namespace pkv {
namespace gpu {

// Runtime handles, as the adapters' runtimes define them (pointers to their own opaque types).
using Stream = struct Stream_ *;
using Event = struct Event_ *;
using Module = struct Module_ *;
using Function = struct Function_ *;

// What a runtime call answered, and the call's name for messages. Both runtimes number results
// alike where the backend looks: 0 is success, 2 out of memory, 500 a name a module lacks; a
// stream's capture status 0 is "not capturing".
struct Call {
  int result;
  const char *name;
};
constexpr int kSuccess = 0;
constexpr int kOutOfMemory = 2;
constexpr int kNotFound = 500;

enum class Attribute { multiprocessors, warp_size };

// The kernel images built for the runtime (lib/kernels/*.cu compiled by nvcc or hipcc), and the
// targets they hold, for messages. `tensor_core` (decode) and `extend` are null where those kernels
// do not exist (HIP).
struct Images {
  const unsigned char *pages, *generic, *cuda_core, *tensor_core, *extend;
  const char *targets;
};

// Calls only the tensor-core kernels need, so only a runtime that has them provides them.
class TensorCores {
 public:
  virtual Call set_shared_limit(Function f, int bytes) = 0; // opt in to more dynamic shared memory
  virtual Call shared_per_block(int *bytes) = 0;             // the most a block may opt in to, in all
  virtual Call static_shared(Function f, int *bytes) = 0;    // what f's own __shared__ arrays take
  virtual Call occupancy(int *blocks, Function f, int threads, size_t shared_bytes) = 0;

 protected:
  ~TensorCores() = default;
};

// One device of a runtime, opened by the adapter and released when destroyed.
class Device {
 public:
  virtual ~Device() = default;
  virtual pkv_backend kind() const = 0;
  virtual const char *name() const = 0; // "CUDA", "HIP"
  virtual const Images &images() const = 0;
  virtual TensorCores *tensor_cores() { return nullptr; }
  // "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for a result.
  virtual std::string describe(int result) const = 0;
  // The device as a failure to load its kernels should name it ("sm_90, driver 13.0").
  virtual std::string identity() const = 0;

  // Makes the device current on the calling thread until leave(token), with the token enter set:
  // CUDA pushes the device's primary context; HIP sets the current device, the token remembering
  // the one before.
  virtual Call enter(int *token) = 0;
  virtual void leave(int token) noexcept = 0;
  virtual Call attribute(Attribute a, int *value) = 0;

  virtual Call stream_create(Stream *s) = 0; // not synchronising with the legacy default stream
  virtual Call stream_destroy(Stream s) = 0;
  virtual Call stream_synchronize(Stream s) = 0;
  virtual Call stream_capture_status(Stream s, int *status) = 0;
  virtual Call event_create(Event *e, bool timing) = 0;
  virtual Call event_destroy(Event e) = 0;
  virtual Call event_record(Event e, Stream s) = 0;
  virtual Call event_synchronize(Event e) = 0;
  virtual Call event_elapsed_ms(float *ms, Event start, Event end) = 0;

  virtual Call alloc(DevPtr *ptr, size_t bytes) = 0;
  virtual Call free(DevPtr ptr) = 0;
  virtual Call host_alloc(void **ptr, size_t bytes) = 0; // pinned, usable from every context
  virtual Call host_free(void *ptr) = 0;
  virtual Call copy_to_device(DevPtr dst, const void *src, size_t bytes, Stream s) = 0;
  virtual Call copy_to_host(void *dst, DevPtr src, size_t bytes, Stream s) = 0;
  virtual Call fill32(DevPtr dst, uint32_t value, size_t count, Stream s) = 0;

  virtual Call module_load(Module *m, const void *image) = 0;
  virtual Call module_unload(Module m) = 0;
  virtual Call function(Function *f, Module m, const char *name) = 0;
  virtual Call launch(Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                      unsigned shared_bytes, Stream s, void **params) = 0;
};

} // namespace gpu
} // namespace pkv
