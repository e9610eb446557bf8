// compressed-tensors pack-quantized INT4 (SPEC-MODEL.md §3), the writing side: symmetric
// group quantisation and LSB-first nibble packing along the input dim. The reading side is
// cpu::dequant_row. Used by make-model and by the tests' round trips.
#pragma once
#include <cstdint>

namespace kd {

// Quantises one row of `cols` weights in groups of `group` along cols: scale = absmax / 8 rounded to
// bf16 first (as the checkpoint stores it), q = clamp(round(w / scale), −8, 7).
// q: [cols] int8; scales: [cols / group] bf16 bits. A zero group gets scale 0 and q 0.
void quantize_int4_row(const float* w, int64_t cols, int32_t group, int8_t* q, uint16_t* scales);

// Packs q ∈ [−8, 7] as u = q + 8, eight per word, value k in bits 4·(k mod 8) of word k / 8.
// words: [ceil(cols / 8)]; a ragged last word is zero-padded.
void pack_int4_row(const int8_t* q, int64_t cols, uint32_t* words);

}  // namespace kd
