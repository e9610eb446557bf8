// Settings of the CUDA backend read once from the environment (host side; sweeps and benchmarks
// force kernel choices this way). A malformed value is an error naming the variable and the range.
#pragma once
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace kd::cuda {

// "0" or "1"; `unset` when the variable is unset or empty.
inline int env_switch(const char* name, int unset) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return unset;
  const std::string v(e);
  if (v == "0" || v == "1") return v == "1";
  fail(name, " must be 0 or 1, not '", v, "'");
}

// An index in [0, count) (a kernel configuration); −1 when the variable is unset or empty.
inline int env_index(const char* name, int count) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return -1;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  if (*end != '\0' || v < 0 || v >= count) fail(name, "='", std::string(e), "' is not a config number in [0, ", count, ")");
  return int(v);
}

}  // namespace kd::cuda
