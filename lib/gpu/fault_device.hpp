// Fault injection builds only (lib/fault.hpp): the GPU runtime's calls as points of
// fault::Kind::gpu_call, for both vendors at once. A gpu::Device over the vendor's that asks
// fault::fails before each call that may fail at run time and, where it says so, answers out of
// memory without calling the runtime. Calls that release (free, host_free, module_unload,
// stream_destroy, event_destroy, leave) never fail: they are cleanup.
#pragma once

#include <memory>

#include "gpu_device.hpp"

namespace pkv {
namespace gpu {

std::unique_ptr<Device> with_faults(std::unique_ptr<Device> device);

} // namespace gpu
} // namespace pkv
