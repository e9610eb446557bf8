// Device helpers shared by the CUDA backend's .cu files: bf16 and INT4 unpacking, warp and block
// reductions in a fixed order (so a value never depends on how many rows a launch holds).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kd::cuda {

// bf16 → fp32 is exact: the bf16 bits are the top half of the fp32 bits.
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf16_f(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

// fp32 → bf16, round to nearest even (NaN stays NaN).
__device__ __forceinline__ uint16_t f_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Butterfly sum: every lane ends with the same bits (a + b == b + a in IEEE arithmetic).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum / max; blockDim.x a multiple of 32; `sh` holds ≥ 32 values. Order fixed by blockDim.
template <class T>
__device__ T block_sum(T v, T* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T t = lane < nw ? sh[lane] : T(0);
    t = warp_sum(t);
    if (lane == 0) sh[0] = t;
  }
  __syncthreads();
  const T r = sh[0];
  __syncthreads();
  return r;
}
__device__ inline float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nw ? sh[lane] : -__int_as_float(0x7f800000);
    t = warp_max(t);
    if (lane == 0) sh[0] = t;
  }
  __syncthreads();
  const float r = sh[0];
  __syncthreads();
  return r;
}

}  // namespace kd::cuda
