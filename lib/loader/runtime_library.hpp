// A GPU runtime library opened once per process (the CUDA driver, the HIP runtime): the first
// candidate that opens, its function table resolved, then initialised. Once a library has opened it
// stays loaded for the life of the process, whatever follows: an init call may have started threads
// and exit handlers of the runtime's own, which must not find their code unloaded.
#pragma once

#include <string>
#include <vector>

#include "dynlib.hpp"

namespace pkv {

template <class Table> struct RuntimeLibrary {
  DynLib lib;
  Table table; // has a std::string `library`: what was opened
  std::string why; // empty when the table is ready
};

// resolve(lib, &table, &why) and init(&table, &why) return false with why set on failure; `what`
// names the library for a failure to open any candidate ("CUDA driver library"). Internal to each
// file that uses it: the library's static archive and a tool compiling the loader too must not share
// an instantiation.
template <class Table, class Resolve, class Init>
static RuntimeLibrary<Table> *open_runtime_library(const std::vector<std::string> &candidates, const char *what,
                                            Resolve resolve, Init init) {
  auto *out = new RuntimeLibrary<Table>(); // never destroyed: the library is never unloaded
  std::string name, tried;
  out->lib = DynLib::open_first(candidates, &name, &tried);
  if (!out->lib) {
    out->why = std::string("no ") + what + " could be opened (" + tried + ")";
    return out;
  }
  // What was tried before the library that opened belongs to the story of a failure.
  const std::string before = tried.empty() ? "" : " (not opened: " + tried + ")";
  out->table.library = name;
  std::string why;
  if (!resolve(out->lib, &out->table, &why) || !init(&out->table, &why)) out->why = why + before;
  return out;
}

} // namespace pkv
