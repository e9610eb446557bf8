// Kernels of the DFlash drafter on the GPU (model/dflash_cuda.cpp): the per-head q/k RMSNorm with the
// drafter's neox (half-split) RoPE, the non-causal block attention over [context K/V | block], and
// the dflash_config scale / softcap of the embeddings and logits.
// fp32 throughout, as the CPU reference (src/model/dflash.cpp); explicit _rn arithmetic so the
// compiler cannot contract differently from one build to the next.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"

namespace kd::cuda {

namespace {

// One warp per (row, head): x[row, head, 0 … hd) ← RoPE(RMSNorm(x) · w) at position first + row.
__global__ void head_norm_rope_kernel(float* x, int64_t heads, int64_t hd, const float* w, double eps,
                                      const float* inv_freq, int64_t first, float scaling) {
  const int64_t row = blockIdx.x / heads;
  float* v = x + int64_t(blockIdx.x) * hd;
  const int lane = threadIdx.x;
  double ss = 0;
  for (int64_t i = lane; i < hd; i += 32) ss += double(v[i]) * double(v[i]);
  ss = warp_sum(ss);
  const float inv = float(1.0 / sqrt(ss / double(hd) + eps));
  for (int64_t i = lane; i < hd; i += 32) v[i] = __fmul_rn(w[i], __fmul_rn(v[i], inv));
  __syncwarp();
  const int64_t half = hd / 2;
  const float pos = float(first + row);
  for (int64_t j = lane; j < half; j += 32) {
    const float angle = __fmul_rn(inv_freq[j], pos);
    const float c = __fmul_rn(cosf(angle), scaling), s = __fmul_rn(sinf(angle), scaling);
    const float a = v[j], b = v[j + half];
    v[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}

__global__ void scale_softcap_kernel(float* x, int64_t n, float mul, float softcap) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v = __fmul_rn(x[i], mul);
    if (softcap > 0) v = __fmul_rn(tanhf(__fdiv_rn(v, softcap)), softcap);
    x[i] = v;
  }
}

// One block per (head, query): scores over all S keys into scratch, softmax, then P·V with each
// output element summed over the keys in ascending order by one thread.
__global__ void block_attention_kernel(const float* q, const float* k, const float* v, float* out, float* scores,
                                       int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t S, float scale) {
  __shared__ float red[32];
  const int64_t h = blockIdx.x, i = blockIdx.y, g = h / (nh / nkv), kvd = nkv * hd;
  const float* qi = q + (i * nh + h) * hd;
  float* sc = scores + (i * nh + h) * S;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int64_t s = warp; s < S; s += nw) {
    const float* ks = k + s * kvd + g * hd;
    float d = 0;
    for (int64_t j = lane; j < hd; j += 32) d = __fmaf_rn(qi[j], ks[j], d);
    d = warp_sum(d);
    if (lane == 0) sc[s] = __fmul_rn(d, scale);
  }
  __syncthreads();
  float mx = -__int_as_float(0x7f800000);
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x) mx = fmaxf(mx, sc[s]);
  mx = block_max(mx, red);
  float sum = 0;
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
    const float e = expf(__fsub_rn(sc[s], mx));
    sc[s] = e;
    sum = __fadd_rn(sum, e);
  }
  sum = block_sum(sum, red);
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0;
    for (int64_t s = 0; s < S; ++s) acc = __fmaf_rn(__fdiv_rn(sc[s], sum), v[s * kvd + g * hd + d], acc);
    out[(i * nh + h) * hd + d] = acc;
  }
}

}  // namespace

void head_norm_rope(float* x, int64_t rows, int64_t heads, int64_t hd, const float* w, double eps, const float* inv_freq,
                    int64_t first, float scaling, cudaStream_t s) {
  if (rows <= 0) return;
  head_norm_rope_kernel<<<unsigned(rows * heads), 32, 0, s>>>(x, heads, hd, w, eps, inv_freq, first, scaling);
  check_launch("head_norm_rope");
}

void block_attention(const float* q, const float* k, const float* v, float* out, float* scores, int64_t B, int64_t nh,
                     int64_t nkv, int64_t hd, int64_t S, float scale, cudaStream_t s) {
  block_attention_kernel<<<dim3(unsigned(nh), unsigned(B)), 128, 0, s>>>(q, k, v, out, scores, B, nh, nkv, hd, S, scale);
  check_launch("block_attention");
}

void scale_softcap(float* x, int64_t n, float mul, float softcap, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 4096);
  scale_softcap_kernel<<<unsigned(blocks), 256, 0, s>>>(x, n, mul, softcap);
  check_launch("scale_softcap");
}

}  // namespace kd::cuda
