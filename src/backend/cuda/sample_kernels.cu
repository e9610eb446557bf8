// Kernels of a DDTree round kept on the device (draft_top_k.cpp; the argmax outputs of
// model/deepseek_v3_cuda.cpp): the draft logits' top-k with bounds on the CPU tree builder's
// softmax normaliser, and the gather of the
// verify rows' argmax values. See draft_top_k.h for why the bounds make the result bit-identical.
#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"

namespace kd::cuda {

namespace {

constexpr int kTopKThreads = 512;
constexpr int kTile = 1024;  // terms per tile of the in-order sum (two tiles of lo/hi pairs: 32 KiB)
constexpr int64_t kMaxChunkK = 128;  // larger k: one pass over the whole row per rank

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

constexpr int kChunk = 1024;        // elements per warp in the chunk pass: 32 a lane, in registers
constexpr int kChunkWarps = kTopKThreads / 32;

// S + b[0] + b[2] + … + b[2(n − 1)] added left to right in round-to-nearest — the bits a single
// thread's loop gives — by a whole warp, 256 terms a step. Why a step can be done at once: while
// S stays in one binade [2^e, 2^(e+1)), every double there is a multiple of g = 2^(e−52), S is one,
// and fl(S + t) = S + g·rint(t / g) unless t / g ends in exactly .5 (a tie: the even rule then
// reads S's last bit). So S after the step is S + g·Σ rint(t / g), an exact integer sum in any
// order, provided no term ties and the total stays below the binade's top (then no partial sum
// crosses it either: the terms are ≥ 0). A step that ties, crosses a binade, or starts from S
// below 2^-900 (or a short last step) is added one term at a time by lane 0. Terms ≥ 0, finite.
// sequential: every step one at a time (the reference the tests compare against).
__device__ double warp_ordered_sum(const double* b, int64_t n, double S, bool sequential) {
  constexpr int kPer = 8, kStep = 32 * kPer;
  const int lane = threadIdx.x & 31;
  for (int64_t s0 = 0; s0 < n; s0 += kStep) {
    const int64_t m = n - s0 < kStep ? n - s0 : kStep;
    if (!sequential && m == kStep && S >= 0x1p-900) {
      const int up = 52 - ilogb(S);  // S · 2^up is an integer in [2^52, 2^53)
      long long sum = 0;
      bool odd = false;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const double q = ldexp(b[2 * (s0 + i * 32 + lane)], up);  // exact: a power-of-two scale
        if (!(q < 0x1p52)) {
          odd = true;  // a term this large crosses the binade anyway
          continue;
        }
        odd |= __dsub_rn(q, floor(q)) == 0.5;  // exact below 2^52
        sum += static_cast<long long>(rint(q));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      odd = __any_sync(0xffffffffu, odd);
      const long long n0 = static_cast<long long>(ldexp(S, up));
      if (!odd && n0 + sum < (1ll << 53)) {
        S = ldexp(static_cast<double>(n0 + sum), -up);
        continue;
      }
    }
    if (lane == 0)
      for (int64_t i = 0; i < m; ++i) S = __dadd_rn(S, b[2 * (s0 + i)]);
    S = __shfl_sync(0xffffffffu, S, 0);
  }
  return S;
}

// The row's Σ exp(double(x) − max) in token order, as the CPU sums it, twice: with each term
// widened down (lo) and up (hi) by more than the possible difference between this exp and the
// host's. Round-to-nearest addition is monotone in both operands, so lo ≤ the CPU's sum ≤ hi
// exactly. Also the max and the first NaN / +inf index. Warp 0 adds the lower terms, warp 1 the
// upper ones (warp_ordered_sum: the CPU's order, bit for bit); the other warps compute the next
// tile's terms meanwhile.
__device__ void row_sum_bounds(const float* x, int64_t V, DraftRowInfo* info, bool sequential) {
  __shared__ float shf[32];
  __shared__ int bad_sh;
  __shared__ double2 terms[2][kTile];
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
    if (threadIdx.x == 0) *info = DraftRowInfo{0.0, 0.0, mx, bad == 0x7fffffff ? -1 : bad};
    return;
  }
  const double m = mx;
  // |exp_cuda − e| ≤ 1 ulp (CUDA's documented bound), |exp_glibc − e| ≤ 1 ulp: the two differ by
  // ≤ 2^-51 of the term; widened by 2^-46 (32× that) plus 2^-1060 for subnormal results.
  const double rel_lo = 1.0 - 0x1p-46, rel_hi = 1.0 + 0x1p-46, tiny = 0x1p-1060;
  auto fill = [&](int64_t tile, double2* buf, int first, int stride) {
    const int64_t base = tile * kTile, n = V - base < kTile ? V - base : kTile;
    for (int64_t i = int(threadIdx.x) - first; i < n; i += stride) {
      const double t = exp(__dsub_rn(double(x[base + i]), m));
      buf[i] = make_double2(fmax(0.0, __dsub_rd(__dmul_rd(t, rel_lo), tiny)), __dadd_ru(__dmul_ru(t, rel_hi), tiny));
    }
  };
  const int64_t tiles = (V + kTile - 1) / kTile;
  fill(0, terms[0], 0, int(blockDim.x));
  __syncthreads();
  double acc = 0.0;  // warp 0: lo; warp 1: hi
  for (int64_t tile = 0; tile < tiles; ++tile) {
    if (threadIdx.x < 64) {
      const double* b = reinterpret_cast<const double*>(terms[tile & 1]) + (threadIdx.x >> 5);
      const int64_t n = V - tile * kTile < kTile ? V - tile * kTile : kTile;
      acc = warp_ordered_sum(b, n, acc, sequential);
    } else if (threadIdx.x >= 64 && tile + 1 < tiles) {
      fill(tile + 1, terms[(tile + 1) & 1], 64, int(blockDim.x) - 64);
    }
    __syncthreads();
  }
  __shared__ double hi_sh;
  if (threadIdx.x == 32) hi_sh = acc;
  __syncthreads();
  const double lo = acc, hi = hi_sh;
  if (threadIdx.x == 0) *info = DraftRowInfo{lo, hi, mx, -1};
}

// Grid (chunk blocks + 1, rows). The last block of a row: row_sum_bounds. The others: each warp
// takes a chunk of kChunk tokens and writes its k best packed entries (0: none left) to
// cand[row, chunk, ·] by k warp-wide passes, each taking the best entry ranked after the previous.
// The row's k best are among its chunks' k best. Skipped (no chunk blocks) when cand is null.
__global__ void draft_chunk_kernel(const float* logits, int64_t V, int64_t k, unsigned long long* cand,
                                   int64_t n_chunks, DraftRowInfo* info, bool sequential) {
  const int64_t row = blockIdx.y;
  const float* x = logits + row * V;
  if (blockIdx.x == gridDim.x - 1) {
    row_sum_bounds(x, V, info + row, sequential);
    return;
  }
  const int lane = threadIdx.x & 31;
  const int64_t chunk = int64_t(blockIdx.x) * kChunkWarps + (threadIdx.x >> 5);
  if (chunk >= n_chunks) return;  // whole warps leave together
  unsigned long long key[kChunk / 32];
#pragma unroll
  for (int i = 0; i < kChunk / 32; ++i) {
    const int64_t j = chunk * kChunk + i * 32 + lane;
    key[i] = j < V ? pack(order_key(x[j]), j) : 0ull;
  }
  unsigned long long prev = ~0ull;
  unsigned long long* out = cand + (row * n_chunks + chunk) * k;
  for (int64_t r = 0; r < k; ++r) {
    unsigned long long best = 0;
#pragma unroll
    for (int i = 0; i < kChunk / 32; ++i)
      if (key[i] < prev && key[i] > best) best = key[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long w = __shfl_xor_sync(0xffffffffu, best, o);
      best = w > best ? w : best;
    }
    if (lane == 0) out[r] = best;
    prev = best;
    if (best == 0) {  // the chunk is exhausted: the rest stay "none"
      for (int64_t q = r + 1 + lane; q < k; q += 32) out[q] = 0;
      break;
    }
  }
}

// One block per row: the k best (logit desc, id asc) by k passes, each taking the best entry
// ranked after the previous one, over the chunks' candidates cand[row, ·] (n of them) — or, when
// cand is null, over the whole row. NaN rows give unspecified picks: the host falls back.
__global__ void draft_select_kernel(const float* logits, int64_t V, int64_t k, const unsigned long long* cand,
                                    int64_t n, int32_t* ids, float* vals) {
  __shared__ unsigned long long sh[32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  const unsigned long long* c = cand ? cand + row * n : nullptr;
  const int64_t m = cand ? n : V;
  unsigned long long prev = ~0ull;
  for (int64_t r = 0; r < k; ++r) {
    unsigned long long best = 0;
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
      const unsigned long long p = c ? c[j] : pack(order_key(x[j]), j);
      if (p < prev && p > best) best = p;
    }
    // Packed 0 (key 0, id 0xffffffff) is never a real entry (V < 2^31): it means "none".
    best = block_max_u64(best, sh);
    const int32_t id = int32_t(0xffffffffu - uint32_t(best & 0xffffffffu));
    if (threadIdx.x == 0) {
      ids[row * k + r] = id;
      vals[row * k + r] = (best != 0 && id >= 0 && id < V) ? x[id] : __int_as_float(0x7fc00000);
    }
    prev = best;
  }
}

__global__ void gather_values_kernel(const float* logits, int64_t V, const int32_t* ids, int64_t n, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t id = ids[i];
  out[i] = (id >= 0 && id < V) ? logits[i * V + id] : __int_as_float(0x7fc00000);
}

}  // namespace

int64_t draft_top_k_scratch(int64_t rows, int64_t V, int64_t k) {
  return k <= kMaxChunkK ? rows * ((V + kChunk - 1) / kChunk) * k : 0;
}

void draft_top_k(const float* logits, int64_t rows, int64_t V, int64_t k, unsigned long long* scratch, int32_t* ids,
                 float* vals, DraftRowInfo* info, bool sequential_sum, cudaStream_t s) {
  if (rows <= 0) return;
  const bool chunked = k <= kMaxChunkK;
  const int64_t n_chunks = (V + kChunk - 1) / kChunk;
  const int64_t chunk_blocks = chunked ? (n_chunks + kChunkWarps - 1) / kChunkWarps : 0;
  draft_chunk_kernel<<<dim3(unsigned(chunk_blocks + 1), unsigned(rows)), kTopKThreads, 0, s>>>(logits, V, k, scratch,
                                                                                              n_chunks, info, sequential_sum);
  check_launch("draft_top_k chunks");
  draft_select_kernel<<<unsigned(rows), kTopKThreads, 0, s>>>(logits, V, k, chunked ? scratch : nullptr,
                                                              n_chunks * k, ids, vals);
  check_launch("draft_top_k select");
}

void gather_row_values(const float* logits, int64_t V, const int32_t* ids, int64_t n, float* out, cudaStream_t s) {
  if (n <= 0) return;
  gather_values_kernel<<<unsigned((n + 127) / 128), 128, 0, s>>>(logits, V, ids, n, out);
  check_launch("gather_row_values");
}

}  // namespace kd::cuda
