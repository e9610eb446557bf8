// Helpers shared by the gtest files.
#pragma once
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace kd::test {

// Whether this build runs under AddressSanitizer (clang's __has_feature, GCC's macro). The sanitized
// ctest (scripts/test step 2) runs the same tests 5-20x slower; the exhaustive sweeps (every budget
// x mode x seed on every fixture) shrink there to a subset that still reaches every code path, since
// that build exists to find invalid accesses and UB, and the release build runs the whole sweep.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// A whole tensor of a golden/fixture file copied out as T (the file's dtype must match T's size).
template <class T>
std::vector<T> read_tensor(const SafetensorsFile& f, const std::string& name) {
  const TensorInfo* t = f.find(name);
  if (!t) throw std::runtime_error(f.path() + ": no tensor " + name);
  std::vector<T> out(static_cast<size_t>(t->nbytes() / sizeof(T)));
  std::memcpy(out.data(), f.data(*t), t->nbytes());
  return out;
}

}  // namespace kd::test
