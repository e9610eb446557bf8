// Kernels of a DDTree round kept on the device (draft_top_k.cpp, cuda_generate.cpp): the draft
// logits' top-k with bounds on the CPU tree builder's softmax normaliser, and the gather of the
// verify rows' argmax values. See draft_top_k.h for why the bounds make the result bit-identical.
#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"

namespace kd::cuda {

namespace {

constexpr int kTopKThreads = 256;
constexpr int kTile = 2048;  // terms per sequential-sum tile: 2 × 16 KiB of shared memory

// Order key of a non-NaN float: larger value ↔ larger key, and −0 == +0 (the CPU compares floats,
// so the two zeros tie and the lower id wins).
__device__ __forceinline__ uint32_t order_key(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) == 0) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (key, id) packed so that the larger packed value ranks first: higher logit, then lower id.
__device__ __forceinline__ unsigned long long pack(uint32_t key, int64_t id) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - uint32_t(id));
}

__device__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < nw; ++w) v = sh[w] > v ? sh[w] : v;
    sh[0] = v;
  }
  __syncthreads();
  const unsigned long long r = sh[0];
  __syncthreads();
  return r;
}

// Grid (rows, 2). y = 0: the k best (logit desc, id asc) by k passes over the row, each taking the
// best entry ranked after the previous one (NaN rows give unspecified picks: the host falls back).
// y = 1: the row's max and first NaN / +inf index, then Σ exp(double(x) − max) in token order as
// the CPU sums it, twice, with each term widened down (lo) and up (hi) by more than the possible
// difference between this exp and the host's: round-to-nearest addition is monotone in both
// operands, so lo ≤ the CPU's sum ≤ hi exactly.
__global__ void draft_top_k_kernel(const float* logits, int64_t V, int64_t k, int32_t* ids, float* vals,
                                   DraftRowInfo* info) {
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  if (blockIdx.y == 0) {
    __shared__ unsigned long long sh[32];
    unsigned long long prev = 0;
    for (int64_t r = 0; r < k; ++r) {
      unsigned long long best = 0;
      bool have = false;
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const unsigned long long p = pack(order_key(x[j]), j);
        if ((r == 0 || p < prev) && (!have || p > best)) {
          best = p;
          have = true;
        }
      }
      // Entry (key 0, id 0xffffffff) is never real (V < 2^31), so 0 means "none" in the max.
      best = block_max_u64(have ? best : 0ull, sh);
      const int32_t id = int32_t(0xffffffffu - uint32_t(best & 0xffffffffu));
      if (threadIdx.x == 0) {
        ids[row * k + r] = id;
        vals[row * k + r] = (id >= 0 && id < V) ? x[id] : __int_as_float(0x7fc00000);
      }
      prev = best;
    }
    return;
  }

  __shared__ float shf[32];
  __shared__ int bad_sh;
  __shared__ double tlo[kTile], thi[kTile];
  if (threadIdx.x == 0) bad_sh = 0x7fffffff;
  __syncthreads();
  float mx = -__int_as_float(0x7f800000);
  int bad = 0x7fffffff;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = x[j];
    if (v != v || v == __int_as_float(0x7f800000)) {
      if (int(j) < bad) bad = int(j);
    } else {
      mx = fmaxf(mx, v);
    }
  }
  if (bad != 0x7fffffff) atomicMin(&bad_sh, bad);
  mx = block_max(mx, shf);  // syncs: bad_sh is complete after it
  bad = bad_sh;
  if (bad != 0x7fffffff || mx == -__int_as_float(0x7f800000)) {
    if (threadIdx.x == 0) info[row] = DraftRowInfo{0.0, 0.0, mx, bad == 0x7fffffff ? -1 : bad};
    return;
  }
  const double m = mx;
  // |exp_cuda − e| ≤ 1 ulp (CUDA's documented bound), |exp_glibc − e| ≤ 1 ulp: the two differ by
  // ≤ 2^-51 of the term; widened by 2^-46 (32× that) plus 2^-1060 for subnormal results.
  const double rel_lo = 1.0 - 0x1p-46, rel_hi = 1.0 + 0x1p-46, tiny = 0x1p-1060;
  double lo = 0.0, hi = 0.0;
  for (int64_t base = 0; base < V; base += kTile) {
    const int64_t n = V - base < kTile ? V - base : kTile;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const double t = exp(__dsub_rn(double(x[base + i]), m));
      tlo[i] = fmax(0.0, __dsub_rd(__dmul_rd(t, rel_lo), tiny));
      thi[i] = __dadd_ru(__dmul_ru(t, rel_hi), tiny);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll 8
      for (int64_t i = 0; i < n; ++i) {
        lo = __dadd_rn(lo, tlo[i]);
        hi = __dadd_rn(hi, thi[i]);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) info[row] = DraftRowInfo{lo, hi, mx, -1};
}

__global__ void gather_values_kernel(const float* logits, int64_t V, const int32_t* ids, int64_t n, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t id = ids[i];
  out[i] = (id >= 0 && id < V) ? logits[i * V + id] : __int_as_float(0x7fc00000);
}

}  // namespace

void draft_top_k(const float* logits, int64_t rows, int64_t V, int64_t k, int32_t* ids, float* vals,
                 DraftRowInfo* info, cudaStream_t s) {
  if (rows <= 0) return;
  draft_top_k_kernel<<<dim3(unsigned(rows), 2), kTopKThreads, 0, s>>>(logits, V, k, ids, vals, info);
  check_launch("draft_top_k");
}

void gather_row_values(const float* logits, int64_t V, const int32_t* ids, int64_t n, float* out, cudaStream_t s) {
  if (n <= 0) return;
  gather_values_kernel<<<unsigned((n + 127) / 128), 128, 0, s>>>(logits, V, ids, n, out);
  check_launch("gather_row_values");
}

}  // namespace kd::cuda
