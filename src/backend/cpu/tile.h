// Multi-row linear kernels: y[i, r] = w[r] · x[i] for a tile of up to kTileRows inputs at once, so a
// verify of N rows reads each weight row from memory once and decodes it once per tile, with the
// tile's accumulators held in registers (docs/perf.md: before this a verify of N rows cost nearly N
// times one row on the CPU).
//
// Row invariance: each (weight row, input) pair keeps its own 64 accumulator lanes with element i
// going to lane i mod 64 in order of i, then the fixed halving tree of dot.h — the structure of
// dot_f32 on the dequantised row — so its bits do not depend on the tile it sits in, on m, or on the
// thread split. The lanes are held in a permuted register order (below) that makes decoding cheap;
// they are put back in natural order before the tree, which changes no sum.
//
// Register layout of one 64-element chunk (what both decoders produce without shuffling weights):
//   v0 = elements 0, 2, …, 30   v1 = 1, 3, …, 31   v2 = 32, 34, …, 62   v3 = 33, 35, …, 63
// bf16: a 32-bit load holds elements 2j (low half) and 2j + 1 (high half) → shift / mask.
// INT4: byte j holds nibbles 2j (low) and 2j + 1 (high) → zero-extend, shift, then a 16-entry
// table lookup {(q − 8) · scale} (vpermps reads only the index's low 4 bits, so no mask); the table
// value is the same fp32 product the staged dequantisation forms (exact: ≤ 12 significant bits).
// The inputs are permuted once per call into the same order (permute_inputs), not per weight row,
// and laid out tile by tile, chunk-major within a tile: [chunk][input of the tile][64], so a tile's
// x operands for one chunk are contiguous (one pointer + constant offsets, streamed in order).
#pragma once
#include <cstdint>

#include "core/weight.h"

namespace kd::cpu {

// Inputs in one register tile: 4 accumulators each plus the decoded weights fit AVX-512's 32 registers.
inline constexpr int64_t kTileRows = 6;

// True when tiled_rows handles `w`: an AVX-512 build, and BF16 (any cols) or INT4 with a
// power-of-two group ≥ 32 dividing cols. A ragged last chunk (cols % 64) goes to its lanes by
// masked FMAs, as dot.h's finish() adds a tail.
bool tiled_supported(const Weight& w);

// Floats of one permuted input row: k rounded up to whole 64-element chunks (the tail zero-padded).
inline int64_t padded_cols(int64_t k) { return (k + 63) / 64 * 64; }

// xp[m · padded_cols(k)] = x[m, k] with every 64-element chunk reordered as the register layout
// above, in tiles of kTileRows inputs (the last one ragged), chunk-major within a tile.
void permute_inputs(const float* x, int64_t m, int64_t k, float* xp);

// y[i · y_stride + r] = w[r] · x[i] for r in [r_begin, r_end), i in [0, m); xp from permute_inputs.
// Bit-identical to dot_bf16 / dot_int4 / dequant_row + dot_f32 of the same (row, input).
void tiled_rows(const Weight& w, const float* xp, int64_t m, int64_t r_begin, int64_t r_end, float* y, int64_t y_stride);

}  // namespace kd::cpu
