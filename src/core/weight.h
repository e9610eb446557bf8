// A weight matrix viewed where it lies (the checkpoint's mmap), row-major [rows = out, cols = in].
// Dense weights are F32/BF16/F16; INT4 weights are compressed-tensors pack-quantized
// (SPEC-MODEL.md §3): `data` is uint32 [rows, ceil(cols/8)] with 8 LSB-first nibbles per word along
// cols, value = nibble − 8, times the bf16 `scales` [rows, cols/group] of its group along cols.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace kd {

struct Weight {
  std::string name;          // checkpoint name, for messages
  int64_t rows = 0, cols = 0;
  DType dtype = DType::BF16;  // element type of dense weights (ignored when int4)
  bool int4 = false;
  const void* data = nullptr;     // dense: [rows, cols]; int4: uint32 [rows, words_per_row()]
  const uint16_t* scales = nullptr;  // int4 only: bf16 [rows, cols / group]
  int32_t group = 32;             // int4 only

  int64_t words_per_row() const { return (cols + 7) / 8; }
  // Bytes a full pass over the matrix reads (weights plus scales), for GB/s reports.
  uint64_t bytes() const {
    if (int4) return uint64_t(rows) * uint64_t(words_per_row()) * 4 + uint64_t(rows) * uint64_t(cols / group) * 2;
    return uint64_t(rows) * uint64_t(cols) * dtype_size(dtype);
  }
  uint64_t params() const { return uint64_t(rows) * uint64_t(cols); }
};

}  // namespace kd
