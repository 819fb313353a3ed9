// The C boundary's one rule, shared by every exported function: run the body, and turn whatever it
// throws into a status plus this thread's last-error text (prefixed with the function's name). The
// handlers allocate nothing: a bad_alloc must come back as a status, not a second one.
#pragma once

#include <new>
#include <stdexcept>

#include "error.hpp"

namespace pkv {

template <class Fn> pkv_status guarded(const char *function, Fn &&fn) noexcept {
  try {
    fn();
    clear_last_error();
    return PKV_OK;
  } catch (const Error &e) {
    set_last_error(e.status, function, e.message.c_str());
    return e.status;
  } catch (const std::bad_alloc &) {
    set_last_error(PKV_ERR_OUT_OF_MEMORY, function, "host memory exhausted");
    return PKV_ERR_OUT_OF_MEMORY;
  } catch (const std::length_error &) { // a container asked for more than it can ever hold
    set_last_error(PKV_ERR_OUT_OF_MEMORY, function, "a size too large to allocate");
    return PKV_ERR_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    set_last_error(PKV_ERR_INTERNAL, function, e.what());
    return PKV_ERR_INTERNAL;
  } catch (...) {
    set_last_error(PKV_ERR_INTERNAL, function, "unknown exception");
    return PKV_ERR_INTERNAL;
  }
}

} // namespace pkv
