// Helpers shared by the gtest files.
#pragma once
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace kd::test {

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
