// Single CUDA ops on host buffers, for op-parity tests against the CPU backend and fp64 references
// (each call uploads, runs the same kernel the forward runs, downloads, and frees). Plain C++.
#pragma once
#include <cstdint>
#include <vector>

#include "core/weight.h"

namespace kd::cuda_ops {

// y[m, w.rows] = x[m, w.cols] · wᵀ with the forward's linear kernel (BF16 or INT4 g32 weights).
void linear(const Weight& w, const float* x, int64_t m, float* y);

// Absorbed MLA attention (kernels.h MlaParams): q [n, H, dn + dr]; cache bf16 [rows, Lr + dr];
// kv_b bf16 [H·(dn + dv), Lr]; vis_rows [n, n] / vis_cnt [n] (offsets from start); out [n, H·dv].
struct MlaShape {
  int64_t n = 0, start = 0, H = 0, dn = 0, dr = 0, dv = 0, Lr = 0;
  float softmax_scale = 1.0f;
};
void mla_attention(const MlaShape& s, const float* q, const std::vector<uint16_t>& cache, const std::vector<uint16_t>& kv_b,
                   const std::vector<int32_t>& vis_rows, const std::vector<int32_t>& vis_cnt, float* out);

// MoE routing of n rows of router logits [n, E] (see kernels.h route()).
void route(const float* logits, const float* bias, int64_t n, int64_t E, int64_t K, int64_t G, int64_t topk_group,
           bool norm_topk_prob, float routed_scaling, int32_t* chosen, float* weights);

}  // namespace kd::cuda_ops
