// Dot products for the CPU linear, one per weight encoding, all with ONE accumulation structure:
// element i goes to lane i mod 64 (acc[lane] = fma(w_i, x_i, acc[lane]) in order of i), then the 64
// lanes are summed by a fixed halving tree. Dequantised weights are exact in fp32 (bf16 widening;
// INT4 (u − 8) · bf16 scale needs ≤ 12 significant bits), so dot_bf16 / dot_int4 give bit-identical
// results to dequantising the row first and calling dot_f32 — the property that lets linear() pick
// the fused path for small batches and the staged path for large ones without breaking row
// invariance (DESIGN.md §2).
#pragma once
#include <cstdint>

namespace kd::cpu {

float dot_f32(const float* w, const float* x, int64_t n);
float dot_bf16(const uint16_t* w, const float* x, int64_t n);
// out[j] = dot_f32(x, rows[j], n) for j < count, bit for bit: each row keeps dot_f32's 64 lanes,
// and the halving tree runs on 16 rows at once (reduce64's steps as vertical adds between shuffled
// registers) — the short dots of attention scores (64 and 32 elements a head), where a dot_f32 per
// key spent as much on its reduction and call as on its products.
void dot_f32_rows(const float* x, const float* const* rows, int64_t count, int64_t n, float* out);
// out[d] = fma(w[t], rows[t][d], out[d]) for t = 0 … count − 1 in order, d < n — attention's
// weighted sum of value rows, each element's FMAs in order of t as the loop `out[d] += w[t] ·
// rows[t][d]` compiles where FMA exists (contracted), with the sums held in registers across the
// rows instead of stored and reloaded for every row (a store-to-load chain that bound prefill).
void accumulate_rows(const float* w, const float* const* rows, int64_t count, int64_t n, float* out);
// out = {w0·x0, w0·x1, w1·x0, w1·x1}, each bit-identical to dot_f32 (shared loads: ~2× the FLOP rate).
void dot_f32_2x2(const float* w0, const float* w1, const float* x0, const float* x1, int64_t n, float* out);
// words: [n / 8] packed nibbles (LSB first, value − 8); scales: bf16 [n / group].
// Requires n % 64 == 0 and group % 16 == 0 (the caller falls back to dequant + dot_f32 otherwise).
float dot_int4(const uint32_t* words, const uint16_t* scales, int32_t group, const float* x, int64_t n);
bool dot_int4_supported(int64_t n, int32_t group);

}  // namespace kd::cpu
