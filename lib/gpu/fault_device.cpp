#include "fault_device.hpp"

#include "../fault.hpp"

namespace pkv {
namespace gpu {

namespace {

class FaultDevice final : public Device, public TensorCores {
 public:
  explicit FaultDevice(std::unique_ptr<Device> inner) : in_(std::move(inner)), tc_(in_->tensor_cores()) {}

  pkv_backend kind() const override { return in_->kind(); }
  const char *name() const override { return in_->name(); }
  const Images &images() const override { return in_->images(); }
  TensorCores *tensor_cores() override { return tc_ ? this : nullptr; }
  std::string describe(int result) const override { return in_->describe(result); }
  std::string identity() const override { return in_->identity(); }

  Call enter(int *token) override { return fails() ? injected("enter (injected)") : in_->enter(token); }
  void leave(int token) noexcept override { in_->leave(token); }
  Call attribute(Attribute a, int *value) override {
    return fails() ? injected("attribute (injected)") : in_->attribute(a, value);
  }

  Call stream_create(Stream *s) override {
    return fails() ? injected("stream_create (injected)") : in_->stream_create(s);
  }
  Call stream_destroy(Stream s) override { return in_->stream_destroy(s); }
  Call stream_synchronize(Stream s) override {
    return fails() ? injected("stream_synchronize (injected)") : in_->stream_synchronize(s);
  }
  Call stream_capture_status(Stream s, int *status) override {
    return fails() ? injected("stream_capture_status (injected)") : in_->stream_capture_status(s, status);
  }
  Call event_create(Event *e, bool timing) override {
    return fails() ? injected("event_create (injected)") : in_->event_create(e, timing);
  }
  Call event_destroy(Event e) override { return in_->event_destroy(e); }
  Call event_record(Event e, Stream s) override {
    return fails() ? injected("event_record (injected)") : in_->event_record(e, s);
  }
  Call event_synchronize(Event e) override {
    return fails() ? injected("event_synchronize (injected)") : in_->event_synchronize(e);
  }
  Call event_elapsed_ms(float *ms, Event start, Event end) override {
    return fails() ? injected("event_elapsed_ms (injected)") : in_->event_elapsed_ms(ms, start, end);
  }

  Call alloc(DevPtr *ptr, size_t bytes) override {
    return fails() ? injected("alloc (injected)") : in_->alloc(ptr, bytes);
  }
  Call free(DevPtr ptr) override { return in_->free(ptr); }
  Call host_alloc(void **ptr, size_t bytes) override {
    return fails() ? injected("host_alloc (injected)") : in_->host_alloc(ptr, bytes);
  }
  Call host_free(void *ptr) override { return in_->host_free(ptr); }
  Call copy_to_device(DevPtr dst, const void *src, size_t bytes, Stream s) override {
    return fails() ? injected("copy_to_device (injected)") : in_->copy_to_device(dst, src, bytes, s);
  }
  Call copy_to_host(void *dst, DevPtr src, size_t bytes, Stream s) override {
    return fails() ? injected("copy_to_host (injected)") : in_->copy_to_host(dst, src, bytes, s);
  }
  Call fill32(DevPtr dst, uint32_t value, size_t count, Stream s) override {
    return fails() ? injected("fill32 (injected)") : in_->fill32(dst, value, count, s);
  }

  Call module_load(Module *m, const void *image) override {
    return fails() ? injected("module_load (injected)") : in_->module_load(m, image);
  }
  Call module_unload(Module m) override { return in_->module_unload(m); }
  Call function(Function *f, Module m, const char *name) override {
    return fails() ? injected("function (injected)") : in_->function(f, m, name);
  }
  Call launch(Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
              unsigned shared_bytes, Stream s, void **params) override {
    return fails() ? injected("launch (injected)") : in_->launch(f, gx, gy, gz, bx, by, bz, shared_bytes, s, params);
  }

  Call set_shared_limit(Function f, int bytes) override {
    return fails() ? injected("set_shared_limit (injected)") : tc_->set_shared_limit(f, bytes);
  }
  Call shared_per_block(int *bytes) override {
    return fails() ? injected("shared_per_block (injected)") : tc_->shared_per_block(bytes);
  }
  Call static_shared(Function f, int *bytes) override {
    return fails() ? injected("static_shared (injected)") : tc_->static_shared(f, bytes);
  }
  Call occupancy(int *blocks, Function f, int threads, size_t shared_bytes) override {
    return fails() ? injected("occupancy (injected)") : tc_->occupancy(blocks, f, threads, shared_bytes);
  }

 private:
  static bool fails() { return fault::fails(fault::Kind::gpu_call); }
  // The runtime's out-of-memory answer, named for the message as the call the fault stood in for.
  static Call injected(const char *call) { return {kOutOfMemory, call}; }

  std::unique_ptr<Device> in_;
  TensorCores *tc_; // the inner device's, or null
};

} // namespace

std::unique_ptr<Device> with_faults(std::unique_ptr<Device> device) {
  return std::make_unique<FaultDevice>(std::move(device));
}

} // namespace gpu
} // namespace pkv
