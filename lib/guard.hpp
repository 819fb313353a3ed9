// The C boundary's one rule, shared by every exported function: run the body, and turn whatever it
// throws into a status plus this thread's last-error text (prefixed with the function's name).
#pragma once

#include <new>
#include <string>

#include "error.hpp"

namespace pkv {

template <class Fn> pkv_status guarded(const char *function, Fn &&fn) noexcept {
  try {
    fn();
    clear_last_error();
    return PKV_OK;
  } catch (const Error &e) {
    set_last_error(e.status, std::string(function) + ": " + e.message);
    return e.status;
  } catch (const std::bad_alloc &) {
    set_last_error(PKV_ERR_OUT_OF_MEMORY, std::string(function) + ": host memory exhausted");
    return PKV_ERR_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    set_last_error(PKV_ERR_INTERNAL, std::string(function) + ": " + e.what());
    return PKV_ERR_INTERNAL;
  } catch (...) {
    set_last_error(PKV_ERR_INTERNAL, std::string(function) + ": unknown exception");
    return PKV_ERR_INTERNAL;
  }
}

} // namespace pkv
