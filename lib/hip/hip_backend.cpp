#include "hip_backend.hpp"

#include "../error.hpp"
#include "../loader/hip_runtime.hpp"

namespace pkv {

namespace {

using namespace hip;

const Runtime &runtime_or_fail() {
  std::string why;
  const Runtime *r = hip_runtime(&why);
  if (!r) fail(PKV_ERR_NO_DEVICE, "%s", why.c_str());
  return *r;
}

std::string version_text(int v) { return std::to_string(v / 10000000) + "." + std::to_string(v / 100000 % 100); }

} // namespace

std::unique_ptr<Backend> make_hip_backend(int ordinal, void *) {
  const Runtime &r = runtime_or_fail();
  int count = 0;
  const hipError_t e = r.hipGetDeviceCount(&count);
  if (e != hipSuccess || count == 0)
    fail(PKV_ERR_NO_DEVICE, "the HIP runtime (%s) found no device%s%s", r.library.c_str(), e ? ": " : "",
         e ? r.describe(e).c_str() : "");
  if (ordinal < 0 || ordinal >= count)
    fail(PKV_ERR_NO_DEVICE, "device %d does not exist: the HIP runtime found %d device%s", ordinal, count,
         count == 1 ? "" : "s");
  fail(PKV_ERR_UNSUPPORTED, "the HIP backend's host code is not in this build yet (the kernels are, for %s)",
       PKV_HIP_TARGETS);
}

int hip_devices(std::string *detail) {
  std::string why;
  const Runtime *r = hip_runtime(&why);
  if (!r) {
    *detail = why;
    return 0;
  }
  int count = 0;
  if (r->hipGetDeviceCount(&count) != hipSuccess) count = 0;
  *detail = r->library + ", HIP " + version_text(r->version);
  for (int i = 0; i < count; i++) {
    hipDevice_t dev;
    char name[128] = {0};
    int major = 0, minor = 0, cus = 0, wave = 0;
    size_t bytes = 0;
    r->hipDeviceGet(&dev, i);
    r->hipDeviceGetName(name, sizeof name - 1, dev);
    r->hipDeviceGetAttribute(&major, hipDeviceAttributeComputeCapabilityMajor, dev);
    r->hipDeviceGetAttribute(&minor, hipDeviceAttributeComputeCapabilityMinor, dev);
    r->hipDeviceGetAttribute(&cus, hipDeviceAttributeMultiprocessorCount, dev);
    r->hipDeviceGetAttribute(&wave, hipDeviceAttributeWarpSize, dev);
    r->hipDeviceTotalMem(&bytes, dev);
    *detail += "; " + std::to_string(i) + ": " + name + " (arch " + std::to_string(major) + "." +
               std::to_string(minor) + ", " + std::to_string(cus) + " CUs, wave" + std::to_string(wave) + ", " +
               std::to_string(bytes >> 30) + " GiB)";
  }
  if (count == 0) *detail += "; no device";
  return count;
}

} // namespace pkv
