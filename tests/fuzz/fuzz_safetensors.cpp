// libFuzzer target: the safetensors header parser must either accept a header whose every tensor
// lies inside the data section, or throw kd::Error — never crash, hang or read out of bounds.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    kd::SafetensorsHeader h = kd::parse_safetensors_header(data, size, size, "fuzz.safetensors");
    const uint64_t data_size = size - h.data_offset;
    for (const auto& t : h.tensors) {
      if (t.begin > t.end || t.end > data_size) std::abort();  // validation let a bad range through
      if (uint64_t(t.numel()) * kd::dtype_size(t.dtype) != t.nbytes()) std::abort();
    }
  } catch (const kd::Error&) {
  }
  return 0;
}
