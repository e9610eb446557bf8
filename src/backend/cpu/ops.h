// The CPU backend: fp32 activations and accumulation, weights read as stored and widened on the
// fly (DESIGN.md §4). Every output element is computed by one thread in a fixed order whatever the
// number of rows m, so a row's result never depends on its batch (row invariance, DESIGN.md §2).
#pragma once
#include <cstdint>

#include "backend/cpu/dot.h"
#include "core/weight.h"

namespace kd::cpu {

// out[cols] = row `r` of w as fp32 (dequantised for INT4).
void dequant_row(const Weight& w, int64_t r, float* out);

// y[m, w.rows] = x[m, w.cols] · wᵀ.
void linear(const Weight& w, const float* x, int64_t m, float* y);

// out[n, w.cols] = rows ids[0..n) of w (embedding lookup). ids must be in range (checked by callers).
void embed(const Weight& w, const int32_t* ids, int64_t n, float* out);

// out[i] = x[i] · rsqrt(mean(x[i]²) + eps) · weight, per row of `dim` values; out may alias x.
void rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps, float* out);

// GPT-J (interleaved pair) rotary embedding of one vector of 2·half values at one position:
// (v[2i], v[2i+1]) rotated by position·inv_freq[i]; cos/sin scaled by `attn_scaling` (YaRN).
void rope_gptj(float* v, int64_t half, const float* inv_freq, int64_t position, float attn_scaling);

// SwiGLU: h[i] = silu(g[i]) · u[i].
void swiglu(const float* g, const float* u, int64_t n, float* h);

}  // namespace kd::cpu
