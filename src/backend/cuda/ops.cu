// Small kernels of the CUDA forward: embedding, RMSNorm, RoPE and the latent-cache write, MoE
// routing / dispatch / combine, argmax, KV compaction, random fills for benchmarks. Each output is
// produced by one thread or one block in a fixed order (row invariance, DESIGN.md §2); the
// arithmetic mirrors the CPU reference (src/backend/cpu/ops.cpp, src/model/deepseek_v3.cpp) with
// explicit roundings (__fmul_rn / __fadd_rn) where the CPU keeps separate multiplies and adds.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kd::cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA: ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
void check_launch(const char* what) { check(cudaGetLastError(), what); }

bool pdl_supported() {
  static const bool ok = [] {
    int dev = 0, major = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    return major >= 9;
  }();
  return ok;
}
int pdl_mode() {
  static const int mode = [] {
    const char* e = std::getenv("KDTREE_CUDA_PDL");
    const std::string v = e ? e : "";
    if (!v.empty() && v != "0" && v != "1" && v != "2")
      fail("KDTREE_CUDA_PDL must be 0 (every kernel waits for the one before, the default), 1 (the overlap for launches outside "
           "CUDA graphs) or 2 (inside captured graphs too), not '", v, "'");
    if (v.empty() || v == "0" || !pdl_supported()) return 0;
    return v == "2" ? 2 : 1;
  }();
  return mode;
}
bool pdl_for(cudaStream_t s) {
  const int m = pdl_mode();
  if (m != 1) return m == 2;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(s, &st), "cudaStreamIsCapturing");
  return st == cudaStreamCaptureStatusNone;
}

namespace {

__global__ void embed_kernel(const uint16_t* __restrict__ table, int64_t dim, const int32_t* ids, float* __restrict__ out) {
  pdl_wait();  // (common.cuh)
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const uint16_t* row = table + int64_t(ids[i]) * dim;
#pragma unroll 8
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) out[i * dim + d] = bf16_f(row[d]);
}

// A block of kNormThreads a row.
constexpr int kNormThreads = 512, kNormRun = 16;  // 8192 elements a row in one run
__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const float* x, int64_t ldx, const float* w, int64_t dim,
                                                               double eps, float* out, int64_t ldo) {
  // The first run's weights before the wait: a norm's weights are never written by a kernel, so their
  // memory round trip overlaps the kernel before (common.cuh).
  float w0[kNormRun];
#pragma unroll
  for (int j = 0; j < kNormRun; ++j) w0[j] = threadIdx.x + j * blockDim.x < dim ? w[threadIdx.x + j * blockDim.x] : 0.0f;
  pdl_wait();
  pdl_trigger();
  __shared__ double sh[32];
  const float* xr = x + int64_t(blockIdx.x) * ldx;
  float* o = out + int64_t(blockIdx.x) * ldo;
  // Runs of kNormRun elements a thread (element i = c + j · blockDim.x of run c): every load of a
  // run is issued before its stores — out may be x itself, so the compiler may not hoist a load
  // above an earlier store, and one element at a time cost a memory round trip each (10.5 µs for a
  // 7168-wide row, docs/perf.md). The sum of squares still runs in i order, as before.
  const int64_t step = int64_t(blockDim.x) * kNormRun;
  double ss = 0;
  for (int64_t c = threadIdx.x; c < dim; c += step) {
    float v[kNormRun];
#pragma unroll
    for (int j = 0; j < kNormRun; ++j) v[j] = c + j * blockDim.x < dim ? xr[c + j * blockDim.x] : 0.0f;
#pragma unroll
    for (int j = 0; j < kNormRun; ++j) ss += double(v[j]) * double(v[j]);  // exact products; zeros past the end add nothing
  }
  ss = block_sum(ss, sh);
  const float inv = float(1.0 / sqrt(ss / double(dim) + eps));
  for (int64_t c = threadIdx.x; c < dim; c += step) {
    float v[kNormRun], wv[kNormRun];
#pragma unroll
    for (int j = 0; j < kNormRun; ++j) {
      const bool in = c + j * blockDim.x < dim;
      v[j] = in ? xr[c + j * blockDim.x] : 0.0f;
      wv[j] = c == threadIdx.x ? w0[j] : in ? w[c + j * blockDim.x] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kNormRun; ++j) {
      const int64_t i = c + j * blockDim.x;
      if (i >= dim) break;
      o[i] = __fmul_rn(wv[j], __fmul_rn(v[j], inv));
    }
  }
}

__global__ void latent_write_kernel(const float* kv, int64_t Lr, int64_t dr, const float* norm_w, double eps,
                                    const float* inv_freq, const int32_t* positions, float scaling, uint16_t* cache,
                                    const int32_t* wrow) {
  pdl_wait();
  pdl_trigger();
  __shared__ double sh[32];
  const int64_t i = blockIdx.x, D = Lr + dr;
  const float* x = kv + i * D;
  uint16_t* out = cache + int64_t(wrow[i]) * D;
  double ss = 0;
  for (int64_t d = threadIdx.x; d < Lr; d += blockDim.x) ss += double(x[d]) * double(x[d]);
  ss = block_sum(ss, sh);
  const float inv = float(1.0 / sqrt(ss / double(Lr) + eps));
  for (int64_t d = threadIdx.x; d < Lr; d += blockDim.x) out[d] = f_bf16(__fmul_rn(norm_w[d], __fmul_rn(x[d], inv)));
  for (int64_t p = threadIdx.x; p < dr / 2; p += blockDim.x) {
    float a = x[Lr + 2 * p], b = x[Lr + 2 * p + 1];
    rope_pair(a, b, inv_freq[p], positions[i], scaling);
    out[Lr + 2 * p] = f_bf16(a);
    out[Lr + 2 * p + 1] = f_bf16(b);
  }
}

// "a before b": higher value first, lower id on ties (the CPU's `better`).
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

// One warp per row. Shared: score[E], choice[E], taken[E] (as floats), group data [2G].
__global__ void route_kernel(const float* logits, const float* bias, RouteParams p, int32_t* chosen, float* weights) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ float sm[];
  const int E = int(p.E), K = int(p.K), G = int(p.G), lane = threadIdx.x;
  float* score = sm;
  float* choice = sm + E;
  float* taken = sm + 2 * E;
  float* gscore = sm + 3 * E;
  const float* lg = logits + int64_t(blockIdx.x) * E;
#pragma unroll 4
  for (int e = lane; e < E; e += 32) {
    const float s = 1.0f / (1.0f + expf(-lg[e]));
    score[e] = s;
    choice[e] = __fadd_rn(s, bias[e]);
    taken[e] = 0.0f;
  }
  __syncwarp();
  if (G > 1 && lane == 0) {
    // Group-limited routing: a group scores the sum of its best two biased scores; keep topk_group.
    const int per = E / G;
    for (int g = 0; g < G; ++g) {
      int b1 = -1, b2 = -1;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (b1 < 0 || better(choice[e], e, choice[b1], b1)) {
          b2 = b1;
          b1 = e;
        } else if (b2 < 0 || better(choice[e], e, choice[b2], b2)) {
          b2 = e;
        }
      }
      gscore[g] = __fadd_rn(choice[b1], choice[b2]);
      gscore[G + g] = 0.0f;  // kept?
    }
    for (int k = 0; k < p.topk_group; ++k) {
      int best = -1;
      for (int g = 0; g < G; ++g)
        if (gscore[G + g] == 0.0f && (best < 0 || better(gscore[g], g, gscore[best], best))) best = g;
      gscore[G + best] = 1.0f;
    }
    for (int e = 0; e < E; ++e)
      if (gscore[G + e / per] == 0.0f) choice[e] = -__int_as_float(0x7f800000);
  }
  __syncwarp();
  __shared__ int sel[64];
  for (int k = 0; k < K; ++k) {
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    for (int e = lane; e < E; e += 32)
      if (taken[e] == 0.0f && better(choice[e], e, bv, bi)) {
        bv = choice[e];
        bi = e;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      sel[k] = bi;
      taken[bi] = 1.0f;
    }
    __syncwarp();
  }
  if (lane != 0) return;
  for (int a = 1; a < K; ++a)  // ascending id: the order the experts are summed in
    for (int b = a; b > 0 && sel[b - 1] > sel[b]; --b) {
      const int t = sel[b];
      sel[b] = sel[b - 1];
      sel[b - 1] = t;
    }
  float w[64], sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    w[k] = score[sel[k]];  // unbiased: the bias only chooses
    sum = __fadd_rn(sum, w[k]);
  }
  for (int k = 0; k < K; ++k) {
    float v = w[k];
    if (p.norm_topk_prob) v = __fdiv_rn(v, __fadd_rn(sum, 1e-20f));
    v = __fmul_rn(v, p.routed_scaling);
    chosen[int64_t(blockIdx.x) * K + k] = sel[k];
    weights[int64_t(blockIdx.x) * K + k] = v;
  }
}

// Exclusive prefix sum over the block (blockDim.x ≤ 1024, a multiple of 32); *total gets the sum.
__device__ int block_exclusive_scan(int v, int* sh, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += t;
  }
  if (lane == 31) sh[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nw ? sh[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += t;
    }
    if (lane < nw) sh[lane] = w;  // inclusive warp totals
  }
  __syncthreads();
  const int before = (warp > 0 ? sh[warp - 1] : 0) + inc - v;
  *total = sh[nw - 1];
  __syncthreads();
  return before;
}

// One block, a thread per expert (E ≤ 1024): counts, two block scans (slots, active experts), then
// each active expert writes its entries in ascending row order. The choices are read through
// shared memory a chunk at a time (every thread scans all of them; from global memory that was
// nK dependent L1 round trips a thread).
__global__ void __launch_bounds__(1024) dispatch_kernel(const int32_t* chosen, int nK, int K, int E, Dispatch d,
                                                        int32_t* active_log) {
  pdl_wait();
  pdl_trigger();
  constexpr int kChunk = 4096;
  __shared__ int sh[32];
  __shared__ int16_t ch[kChunk];  // expert ids (E ≤ 1024)
  const int e = threadIdx.x;
  int c = 0;
  for (int j0 = 0; j0 < nK; j0 += kChunk) {
    const int m = min(kChunk, nK - j0);
    __syncthreads();
    for (int j = e; j < m; j += blockDim.x) ch[j] = int16_t(chosen[j0 + j]);
    __syncthreads();
    if (e < E)
      for (int j = 0; j < m; ++j) c += ch[j] == e;
  }
  int total = 0, n_act = 0;
  const int off = block_exclusive_scan(c, sh, &total);
  const int a = block_exclusive_scan(c > 0 ? 1 : 0, sh, &n_act);
  if (e == 0) {
    *d.n_active = n_act;
    if (active_log) *active_log = n_act;
  }
  if (c > 0 && e < E) {
    d.act_expert[a] = e;
    d.act_off[a] = off;
    d.act_cnt[a] = c;
  }
  int p = off;
  for (int j0 = 0; j0 < nK; j0 += kChunk) {  // every thread takes part in the chunk loads
    const int m = min(kChunk, nK - j0);
    if (nK > kChunk) {  // one chunk (every decode, verify and prefill step of ≤ 512 rows) is still there
      __syncthreads();
      for (int j = e; j < m; j += blockDim.x) ch[j] = int16_t(chosen[j0 + j]);
      __syncthreads();
    }
    if (c > 0 && e < E)
      for (int j = 0; j < m; ++j)
        if (ch[j] == e) {
          d.entry_token[p] = (j0 + j) / K;
          d.entry_slot[p] = j0 + j;
          ++p;
        }
  }
}

__global__ void combine_kernel(float* x, const float* y, const float* w, const float* shared, int64_t n, int64_t K, int64_t hid) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n * hid) return;
  const int64_t i = t / hid, d = t % hid;
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = __fadd_rn(acc, __fmul_rn(y[(i * K + k) * hid + d], w[i * K + k]));
  if (shared) acc = __fadd_rn(acc, shared[t]);
  x[t] = __fadd_rn(x[t], acc);
}

__global__ void rank_sum_kernel(RankBuffers b, int64_t begin, int64_t end) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= end) return;
  float acc = b.p[0][i];
  for (int32_t r = 1; r < b.ranks; ++r) acc = __fadd_rn(acc, b.p[r][i]);
  for (int32_t r = 0; r < b.ranks; ++r) b.p[r][i] = acc;
}

__global__ void rank_sum_gathered_kernel(const float* g, int32_t ranks, int64_t n, float* out) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = g[i];
  for (int32_t r = 1; r < ranks; ++r) acc = __fadd_rn(acc, g[int64_t(r) * n + i]);
  out[i] = acc;
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}

constexpr int kArgmaxRun = 8;
__global__ void __launch_bounds__(1024) argmax_kernel(const float* logits, int64_t V, int32_t* out) {
  pdl_wait();
  pdl_trigger();
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ int nan_seen;
  if (threadIdx.x == 0) nan_seen = 0;
  __syncthreads();
  const float* row = logits + int64_t(blockIdx.x) * V;
  float bv = -__int_as_float(0x7f800000);
  int bi = 0x7fffffff;
  bool nan = false;
  auto take = [&](float v, int64_t j) {
    if (v != v) nan = true;
    else if (better(v, int(j), bv, bi)) {
      bv = v;
      bi = int(j);
    }
  };
  // The largest value with the lowest index is the same whoever scans which elements, so the scan
  // may read 16-byte quads, kArgmaxRun of them in flight a thread (one float at a time, one SM
  // read a 163840-wide row in 42 µs: docs/perf.md).
  int64_t done = 0;
  if (V % 4 == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const float4* q = reinterpret_cast<const float4*>(row);
    const int64_t nq = V / 4, step = int64_t(blockDim.x) * kArgmaxRun;
    for (int64_t c = threadIdx.x; c < nq; c += step) {
      float4 v[kArgmaxRun];
#pragma unroll
      for (int u = 0; u < kArgmaxRun; ++u) {
        const int64_t k = c + u * blockDim.x;
        v[u] = k < nq ? q[k] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kArgmaxRun; ++u) {
        const int64_t k = c + u * blockDim.x;
        if (k >= nq) break;
        take(v[u].x, 4 * k);
        take(v[u].y, 4 * k + 1);
        take(v[u].z, 4 * k + 2);
        take(v[u].w, 4 * k + 3);
      }
    }
    done = V;
  }
  for (int64_t j = done + threadIdx.x; j < V; j += blockDim.x) take(row[j], j);
  if (nan) nan_seen = 1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w)
      if (better(sv[w], si[w], bv, bi)) {
        bv = sv[w];
        bi = si[w];
      }
    out[blockIdx.x] = (nan_seen || bi == 0x7fffffff) ? -1 : bi;
  }
}

__global__ void __launch_bounds__(1024) compact_kernel(uint16_t* cache, int64_t layers, int64_t stride, int64_t dim,
                                                       const int32_t* src_rows, const int32_t* dst_rows, int64_t n_keep) {
  pdl_wait();
  pdl_trigger();
  for (int64_t k = 0; k < n_keep; ++k) {
    const int64_t src = src_rows[k], dst = dst_rows[k];
    if (src != dst)
      for (int64_t t = threadIdx.x; t < layers * dim; t += blockDim.x) {
        const int64_t l = t / dim, d = t % dim;
        cache[l * stride + dst * dim + d] = cache[l * stride + src * dim + d];
      }
    __syncthreads();  // row k is final before a later k may read past it
  }
}

__global__ void gather_kernel(const float* __restrict__ x, int64_t dim, const int32_t* rows, float* __restrict__ out) {
  pdl_wait();
  pdl_trigger();
  const float* src = x + int64_t(rows[blockIdx.x]) * dim;
  float* dst = out + int64_t(blockIdx.x) * dim;
#pragma unroll 8
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}

__global__ void single_step_kernel(int32_t* positions, int32_t* cnt, int32_t* wrow, const int32_t* start) {
  pdl_wait();
  pdl_trigger();
  positions[0] = *start;
  wrow[0] = *start;
  cnt[0] = 1;
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float unit(uint64_t seed, int64_t i) {  // [0, 1)
  return float(mix64(seed + uint64_t(i) * 0x9e3779b97f4a7c15ull) >> 40) * 0x1p-24f;
}
__global__ void fill_bf16_kernel(uint16_t* p, int64_t n, float a, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = f_bf16((2.0f * unit(seed, i) - 1.0f) * a);
}
__global__ void fill_f32_kernel(float* p, int64_t n, float lo, float hi, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * unit(seed, i);
}
__global__ void fill_words_kernel(uint32_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(mix64(seed + uint64_t(i) * 0x9e3779b97f4a7c15ull));
}

__global__ void read_kernel(const float4* p, int64_t n, float* out) {
  float acc = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = __ldcs(p + i);
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 1.2345f) *out = acc;  // keeps the loads alive; never true for the data written
}

// Step `step` of measure_kernel_chain: reads the nb slots step − 1 wrote (buffer step % 2), counts the
// ones not yet written, writes its own slot of the other buffer.
__global__ void chain_kernel(int32_t* buf, int32_t* stale, int32_t step, int32_t nb) {
  pdl_wait();
  pdl_trigger();
  const int32_t* in = buf + (step & 1) * nb;
  int32_t* out = buf + ((step + 1) & 1) * nb;
  int bad = 0;
  for (int j = int(threadIdx.x); j < nb; j += int(blockDim.x)) bad += in[j] != step;
  if (bad) atomicAdd(stale, bad);
  if (threadIdx.x == 0) out[blockIdx.x] = step + 1;
}

unsigned blocks_for(int64_t n, int threads) { return unsigned(std::min<int64_t>((n + threads - 1) / threads, 1 << 16)); }

}  // namespace

void embed(const uint16_t* table, int64_t dim, const int32_t* ids, int64_t n, float* out, cudaStream_t s) {
  launch("embed", embed_kernel, dim3(unsigned(n)), dim3(256), 0, s, table, dim, ids, out);
}

void rmsnorm(const float* x, int64_t ldx, const float* w, int64_t rows, int64_t dim, double eps, float* out, int64_t ldo,
             cudaStream_t s) {
  if (rows <= 0) return;
  launch("rmsnorm", rmsnorm_kernel, dim3(unsigned(rows)), dim3(kNormThreads), 0, s, x, ldx, w, dim, eps, out, ldo);
}

void latent_write(const float* kv, int64_t n, int64_t Lr, int64_t dr, const float* norm_w, double eps, const float* inv_freq,
                  const int32_t* positions, float attn_scaling, uint16_t* cache_layer, const int32_t* wrow, cudaStream_t s) {
  launch("latent_write", latent_write_kernel, dim3(unsigned(n)), dim3(256), 0, s, kv, Lr, dr, norm_w, eps, inv_freq, positions,
         attn_scaling, cache_layer, wrow);
}

void route(const float* logits, const float* bias, int64_t n, const RouteParams& p, int32_t* chosen, float* weights,
           cudaStream_t s) {
  if (p.K > 64) fail("CUDA router: num_experts_per_tok ", p.K, " exceeds 64");
  const size_t smem = size_t(3 * p.E + 2 * p.G) * sizeof(float);
  launch("route", route_kernel, dim3(unsigned(n)), dim3(32), smem, s, logits, bias, p, chosen, weights);
}

void dispatch(const int32_t* chosen, int64_t n, int64_t K, int64_t E, const Dispatch& d, int32_t* active_log, cudaStream_t s) {
  if (E > 1024) fail("CUDA dispatch: ", E, " routed experts exceed 1024");
  const int threads = int(std::max<int64_t>(32, (E + 31) / 32 * 32));
  launch("dispatch", dispatch_kernel, dim3(1), dim3(unsigned(threads)), 0, s, chosen, int(n * K), int(K), int(E), d, active_log);
}

void moe_combine(float* x, const float* y, const float* w, const float* shared, int64_t n, int64_t K, int64_t hid, cudaStream_t s) {
  launch("moe_combine", combine_kernel, dim3(unsigned((n * hid + 255) / 256)), dim3(256), 0, s, x, y, w, shared, n, K, hid);
}

void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out, cudaStream_t s) {
  launch("argmax", argmax_kernel, dim3(unsigned(rows)), dim3(1024), 0, s, logits, V, out);
}

void compact_rows(uint16_t* cache, int64_t layers, int64_t layer_stride_elems, int64_t dim, const int32_t* src,
                  const int32_t* dst, int64_t n_keep, cudaStream_t s) {
  launch("compact", compact_kernel, dim3(1), dim3(1024), 0, s, cache, layers, layer_stride_elems, dim, src, dst, n_keep);
}

void rank_order_sum(const RankBuffers& b, int64_t begin, int64_t end, cudaStream_t s) {
  if (b.ranks < 1 || b.ranks > kMaxRanks) fail("rank_order_sum: ", b.ranks, " ranks (1 … ", kMaxRanks, ")");
  if (end <= begin) return;
  launch("rank_order_sum", rank_sum_kernel, dim3(unsigned((end - begin + 255) / 256)), dim3(256), 0, s, b, begin, end);
}

void rank_order_sum_gathered(const float* gathered, int32_t ranks, int64_t n, float* out, cudaStream_t s) {
  if (n <= 0) return;
  launch("rank_order_sum_gathered", rank_sum_gathered_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, gathered, ranks, n, out);
}

void add_rows(float* x, const float* y, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  launch("add_rows", add_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, x, y, n);
}

void gather_rows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out, cudaStream_t s) {
  if (n <= 0) return;
  launch("gather_rows", gather_kernel, dim3(unsigned(n)), dim3(256), 0, s, x, dim, rows, out);
}

void single_step_setup(int32_t* positions, int32_t* cnt, int32_t* wrow, const int32_t* start, cudaStream_t s) {
  launch("single_step_setup", single_step_kernel, dim3(1), dim3(1), 0, s, positions, cnt, wrow, start);
}

__global__ void advance_kernel(int32_t* c, int32_t by) {
  pdl_wait();
  pdl_trigger();
  *c += by;
}
void advance(int32_t* counter, int32_t by, cudaStream_t s) {
  launch("advance", advance_kernel, dim3(1), dim3(1), 0, s, counter, by);
}

void fill_bf16(uint16_t* p, int64_t n, float a, uint64_t seed, cudaStream_t s) {
  fill_bf16_kernel<<<blocks_for(n, 256), 256, 0, s>>>(p, n, a, seed);
  check_launch("fill_bf16");
}
void fill_f32(float* p, int64_t n, float lo, float hi, uint64_t seed, cudaStream_t s) {
  fill_f32_kernel<<<blocks_for(n, 256), 256, 0, s>>>(p, n, lo, hi, seed);
  check_launch("fill_f32");
}
void fill_words(uint32_t* p, int64_t n, uint64_t seed, cudaStream_t s) {
  fill_words_kernel<<<blocks_for(n, 256), 256, 0, s>>>(p, n, seed);
  check_launch("fill_words");
}

ChainTiming measure_kernel_chain(int kernels, int blocks, int reps) {
  if (kernels < 2 || blocks < 1 || reps < 1) fail("measure_kernel_chain: ", kernels, " kernels, ", blocks, " blocks, ", reps, " repetitions");
  int32_t* buf = nullptr;
  int32_t* stale = nullptr;
  check(cudaMalloc(&buf, size_t(2 * blocks) * 4), "cudaMalloc (kernel chain)");
  check(cudaMalloc(&stale, 4), "cudaMalloc (kernel chain)");
  check(cudaMemset(stale, 0, 4), "cudaMemset");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  ChainTiming out;
  out.overlap_available = pdl_supported();
  for (const bool pdl : {false, true}) {
    cudaGraph_t g;
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    check(cudaMemsetAsync(buf, 0, size_t(blocks) * 4, s), "cudaMemsetAsync");  // step 0 reads zeros
    for (int k = 0; k < kernels; ++k)
      launch_as(pdl && out.overlap_available, "kernel chain", chain_kernel, dim3(unsigned(blocks)), dim3(128), 0, s, buf, stale,
                int32_t(k), int32_t(blocks));
    check(cudaStreamEndCapture(s, &g), "cudaStreamEndCapture");
    cudaGraphExec_t ge;
    check(cudaGraphInstantiate(&ge, g, 0), "cudaGraphInstantiate");
    std::vector<double> us;
    for (int r = 0; r < reps + 1; ++r) {
      check(cudaEventRecord(a, s), "cudaEventRecord");
      check(cudaGraphLaunch(ge, s), "cudaGraphLaunch");
      check(cudaEventRecord(b, s), "cudaEventRecord");
      check(cudaEventSynchronize(b), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      if (r > 0) us.push_back(double(ms) * 1e3 / kernels);
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    std::sort(us.begin(), us.end());
    (pdl ? out.us_per_kernel_overlap : out.us_per_kernel_serial) = us[us.size() / 2];
  }
  int32_t bad = 0;
  check(cudaMemcpy(&bad, stale, 4, cudaMemcpyDeviceToHost), "cudaMemcpy (kernel chain)");
  out.stale = bad;
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  cudaFree(buf);
  cudaFree(stale);
  return out;
}

double measure_read_gbps(int64_t bytes, int reps) {
  const int64_t n4 = bytes / 16;
  float4* buf = nullptr;
  float* sink = nullptr;
  check(cudaMalloc(&buf, size_t(n4) * 16), "cudaMalloc (bandwidth probe)");
  check(cudaMalloc(&sink, sizeof(float)), "cudaMalloc (bandwidth probe)");
  fill_words(reinterpret_cast<uint32_t*>(buf), n4 * 4, 7, nullptr);
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> gbps;
  for (int r = 0; r < reps + 1; ++r) {
    check(cudaEventRecord(a), "cudaEventRecord");
    read_kernel<<<unsigned(sms * 8), 512>>>(buf, n4, sink);
    check_launch("read_kernel");
    check(cudaEventRecord(b), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (r > 0) gbps.push_back(double(n4) * 16 / (double(ms) * 1e-3) / 1e9);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(buf);
  cudaFree(sink);
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

}  // namespace kd::cuda
