// bf16 and W4A16 GEMV/GEMM for M = 1 … a few hundred rows (decode, tree verify, prefill), dense and
// per-expert. One warp owns R output rows × up to MT input rows: each lane walks the 16-byte weight
// chunks c = lane, lane + 32, … (8 bf16, or one INT4 group of 32 nibbles + its scale), multiplies
// them with the fp32 activations, and the warp reduces with a butterfly. The reduction order of an
// output depends only on the inner dimension, so the M-tile variant (MT = 1 for decode, wider for
// verify/prefill) never changes a row's bits — the row invariance DDTree needs (DESIGN.md §2).
// Production runs bf16 matrices of ≥ kMmaMinRows rows on the tensor cores instead (mma.cu) and INT4
// experts on the integer tensor cores (expert_imma.cu); the staged/lean CUDA-core INT4 expert kernels
// that used to live here are retired (docs/perf.md, "Retired kernels (issue 13)").
#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

#include <cstdio>
#include <string>
#include <type_traits>

namespace kd::cuda {

namespace {

constexpr int kWarps = 4;  // warps per block: small blocks keep many in flight on 132 SMs

// acc[m][r] = Σ_k x_m[k] · W[row0 + r, k] in the fixed lane/chunk order, per lane (not yet reduced).
// Chunks c0, c0 + cstep, … of the row (c0 = lane, cstep = 32 unless the K dimension is split).
template <bool INT4, int R, int MT>
__device__ __forceinline__ void warp_dot(const void* wbase, const uint16_t* sbase, int64_t cols, int64_t row0,
                                         int64_t nrows, const float* const (&xs)[MT], int mcount, float (&acc)[MT][R],
                                         int64_t c0, int64_t cstep) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  if constexpr (!INT4) {
    const int64_t nch = cols / 8;
    const uint4* wp[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      wp[r] = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(wbase) + min(row0 + r, nrows - 1) * cols);
    // Unrolled so several iterations' weight loads are in flight per warp: a narrow matrix (kv_a's
    // 576 rows, the router's 384) has too few warps to hide memory latency otherwise.
#pragma unroll 4
    for (int64_t c = c0; c < nch; c += cstep) {
      uint4 wv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) wv[r] = __ldg(wp[r] + c);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= mcount) break;
        const float4* xp = reinterpret_cast<const float4*>(xs[m] + c * 8);
        const float4 a = xp[0], b = xp[1];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float t = acc[m][r];
          t = fmaf(bf16_lo(wv[r].x), a.x, t);
          t = fmaf(bf16_hi(wv[r].x), a.y, t);
          t = fmaf(bf16_lo(wv[r].y), a.z, t);
          t = fmaf(bf16_hi(wv[r].y), a.w, t);
          t = fmaf(bf16_lo(wv[r].z), b.x, t);
          t = fmaf(bf16_hi(wv[r].z), b.y, t);
          t = fmaf(bf16_lo(wv[r].w), b.z, t);
          t = fmaf(bf16_hi(wv[r].w), b.w, t);
          acc[m][r] = t;
        }
      }
    }
  } else {
    const int64_t nch = cols / 32, words = cols / 8;
    const uint4* wp[R];
    const uint16_t* sp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = min(row0 + r, nrows - 1);
      wp[r] = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(wbase) + row * words);
      sp[r] = sbase + row * nch;
    }
    // Register double buffer: the next chunk's weights are in flight while this one is unpacked.
    uint4 nw[R];
    uint16_t ns[R];
    if (c0 < nch)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        nw[r] = __ldg(wp[r] + c0);
        ns[r] = __ldg(sp[r] + c0);
      }
#pragma unroll 1
    for (int64_t c = c0; c < nch; c += cstep) {
      uint4 wv[R];
      float sc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[r] = nw[r];
        sc[r] = bf16_f(ns[r]);
      }
      if (c + cstep < nch)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          nw[r] = __ldg(wp[r] + c + cstep);
          ns[r] = __ldg(sp[r] + c + cstep);
        }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= mcount) break;
        const float4* xp = reinterpret_cast<const float4*>(xs[m] + c * 32);
        // x · 2^80 (exact) and Σx of the group, ascending: shared by the R rows below.
        float xv[32], xsum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float4 v = xp[j];
          xsum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(xsum, v.x), v.y), v.z), v.w);
          xv[4 * j] = __fmul_rn(v.x, 0x1p80f);
          xv[4 * j + 1] = __fmul_rn(v.y, 0x1p80f);
          xv[4 * j + 2] = __fmul_rn(v.z, 0x1p80f);
          xv[4 * j + 3] = __fmul_rn(v.w, 0x1p80f);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t q[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
          // Σ n·x with the nibble n used as the denormal float n·2^-149 (its bits are just n): one
          // PRMT and one FFMA a weight. n·2^-149 × x·2^80 = n·x·2^-69 is exact inside the FMA and
          // stays a normal float for |x| > 2^-57 (smaller activations contribute nothing).
          float g = 0.0f;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t lo = q[j] & 0x0F0F0F0Fu, hi = (q[j] >> 4) & 0x0F0F0F0Fu;  // even / odd nibbles
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              g = fmaf(__uint_as_float(__byte_perm(lo, 0u, 0x4440u + b)), xv[8 * j + 2 * b], g);
              g = fmaf(__uint_as_float(__byte_perm(hi, 0u, 0x4440u + b)), xv[8 * j + 2 * b + 1], g);
            }
          }
          // Σ (n − 8)·x = Σ n·x − 8·Σx, then times the group's scale.
          const float gv = __fsub_rn(__fmul_rn(g, 0x1p69f), __fmul_rn(8.0f, xsum));
          acc[m][r] = fmaf(sc[r], gv, acc[m][r]);
        }
      }
    }
  }
}

// Epilogue of reduced sums (called by one thread).
template <int R, int MT>
__device__ __forceinline__ void store(const float (&acc)[MT][R], int mcount, int64_t row0, int64_t nrows, float* const (&ys)[MT],
                                      int ep) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= mcount) break;
    float* y = ys[m];
    if (ep == int(Epilogue::swiglu)) {
#pragma unroll
      for (int r = 0; r + 1 < R; r += 2) {
        if (row0 + r + 1 >= nrows) break;
        const float g = acc[m][r], u = acc[m][r + 1];
        y[(row0 + r) / 2] = g / (1.0f + expf(-g)) * u;  // silu(g) · u, as the CPU writes it
      }
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row0 + r >= nrows) break;
        if (ep == int(Epilogue::add))
          y[row0 + r] = __fadd_rn(y[row0 + r], acc[m][r]);
        else
          y[row0 + r] = acc[m][r];
      }
    }
  }
}

template <int R, int MT>
__device__ __forceinline__ void finish(float (&acc)[MT][R], int mcount, int64_t row0, int64_t nrows, float* const (&ys)[MT],
                                       int ep, int lane) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
  if (lane == 0) store<R, MT>(acc, mcount, row0, nrows, ys, ep);
}

// grid (ceil(M / MT), ceil(rows / (kWarps·R))) when m_fast, else the transpose; KS = kWarps: the
// block's warps split one row group's chunks (interleaved) and their partial sums are added in
// warp order — for matrices with few rows (q_a, kv_a, the router), which otherwise leave most SMs
// idle. Whether a matrix is split depends on its shape only, never on M (row invariance).
// m_fast: the M-tiles of one row group are neighbouring blocks, so they run at about the same
// time and all but the first find the weights in L2. With the row groups fastest (before), each
// M-tile streamed the whole matrix from HBM again (lm_head's 2.35 GB does not fit a 60 MiB L2).
// Which block computes a tile never changes its arithmetic, so rows keep their bits.
template <bool INT4, int R, int MT, int KS>
__global__ void __launch_bounds__(kWarps * 32) linear_kernel(DevMatrix w, const float* __restrict__ x, int64_t ldx, int64_t M,
                                                           float* y, int64_t ldy, int ep, bool m_fast) {
  static_assert(KS == 1 || KS == kWarps, "split across the whole block or not at all");
  pdl_wait();  // before the early return below (common.cuh)
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bx = m_fast ? blockIdx.y : blockIdx.x, by = m_fast ? blockIdx.x : blockIdx.y;
  const int64_t row0 = KS == 1 ? (bx * kWarps + warp) * R : bx * R;
  if (row0 >= w.rows) return;
  const int64_t m0 = by * MT;
  const int mcount = int(M - m0 < MT ? M - m0 : int64_t(MT));
  const float* xs[MT];
  float* ys[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int64_t row = m0 + int64_t(m < mcount ? m : mcount - 1);
    xs[m] = x + row * ldx;
    ys[m] = y + row * ldy;
  }
  float acc[MT][R];
  if constexpr (KS == 1) {
    warp_dot<INT4, R, MT>(w.w, w.scales, w.cols, row0, w.rows, xs, mcount, acc, lane, 32);
    finish<R, MT>(acc, mcount, row0, w.rows, ys, ep, lane);
  } else {
    __shared__ float part[KS][MT][R];
    warp_dot<INT4, R, MT>(w.w, w.scales, w.cols, row0, w.rows, xs, mcount, acc, lane + 32 * warp, 32 * KS);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[m][r]);
        if (lane == 0) part[warp][m][r] = v;
      }
    __syncthreads();
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float t = part[0][m][r];
#pragma unroll
        for (int k = 1; k < KS; ++k) t = __fadd_rn(t, part[k][m][r]);
        acc[m][r] = t;
      }
    store<R, MT>(acc, mcount, row0, w.rows, ys, ep);
  }
}

// grid (ceil(rows / (kWarps·R)), max_active): block y serves the y-th active expert, all its rows
// in tiles of MT (each tile re-reads the expert's weights, mostly from L2).
template <bool INT4, int R, int MT>
__global__ void __launch_bounds__(kWarps * 32) expert_kernel(ExpertBatch b, const float* __restrict__ x, int64_t ldx,
                                                           float* y, int64_t ldy, int ep) {
  pdl_wait();
  const int a = int(blockIdx.y);
  if (a >= *b.n_active) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + warp) * R;
  if (row0 >= b.w.rows) return;
  const int64_t e = b.act_expert[a];
  const int off = b.act_off[a], cnt = b.act_cnt[a];
  const void* wbase = static_cast<const uint8_t*>(b.w.w) + e * b.w_stride_bytes;
  const uint16_t* sbase = INT4 ? b.w.scales + e * b.scale_stride_elems : nullptr;
  for (int t0 = 0; t0 < cnt; t0 += MT) {
    const int mcount = min(MT, cnt - t0);
    const float* xs[MT];
    float* ys[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const int j = off + t0 + min(m, mcount - 1);
      xs[m] = x + int64_t(b.in_row[j]) * ldx;
      ys[m] = y + int64_t(b.out_row[j]) * ldy;
    }
    float acc[MT][R];
    warp_dot<INT4, R, MT>(wbase, sbase, b.w.cols, row0, b.w.rows, xs, mcount, acc, lane, 32);
    finish<R, MT>(acc, mcount, row0, b.w.rows, ys, ep, lane);
  }
}

void check_shape(const DevMatrix& w, const float* x, int64_t ldx, const char* what) {
  const int64_t unit = w.int4 ? 32 : 8;
  if (w.cols % unit != 0) fail("CUDA ", what, ": ", w.cols, " inputs is not a multiple of ", unit, " (", w.int4 ? "INT4 group" : "16-byte bf16 chunk", ")");
  if (ldx % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) fail("CUDA ", what, ": activations are not 16-byte aligned");
}


// The one CUDA-core INT4 expert kernel kept (ExpertPath::cores; kernel_config.h says why): 8 rows a
// warp, one token row at a time (an expert's later rows re-read its weights from L2). Measured on
// k2-slice against 4 rows a warp / M-tiles of 4: decode 3.92 → 3.53 ms a token, verify of 16 nodes
// 41.1 → 30.9 ms; token pairs (MT = 2) spilled at R = 8 (243 registers a thread) and were slower at
// every N. R only decides which rows a warp owns, never the order a row is reduced in.
constexpr int kExpertInt4Rows = 8;

}  // namespace

void check_linear_config(const LinearConfig& cfg) {
  if (cfg.mma_min_rows < 0) fail("CUDA linear: mma_min_rows ", cfg.mma_min_rows, " is negative");
  if (cfg.mma_gemm_min_m < 0) fail("CUDA linear: mma_gemm_min_m ", cfg.mma_gemm_min_m, " is negative");
  if (cfg.mma_gemm_blocks < 0 || cfg.mma_gemm_blocks > 2)
    fail("CUDA linear: mma_gemm_blocks ", cfg.mma_gemm_blocks, " is not 0 (the default), 1 or 2");
  if (cfg.mma_tile < -1 || cfg.mma_tile >= kMmaTileCount)
    fail("CUDA linear: MMA tile ", cfg.mma_tile, " does not exist (−1: by shape, 0 … ", kMmaTileCount - 1, ")");
}

template <bool INT4, int R>
void launch_linear(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  const dim3 block(kWarps * 32);
  // Split K when the matrix has too few row groups to fill the GPU twice over (a shape rule).
  const bool split = w.rows <= 4096;
  const unsigned gx = split ? unsigned((w.rows + R - 1) / R) : unsigned((w.rows + kWarps * R - 1) / (kWarps * R));
  // The M-tile only sets how many rows share a weight load; each row's arithmetic is the same.
  auto go = [&](auto mt) {
    constexpr int MT = decltype(mt)::value;
    const unsigned gm = unsigned((M + MT - 1) / MT);
    // Grid y is limited to 65535 blocks; every K2 matrix (lm_head: 20480 row groups) fits m_fast.
    const bool m_fast = gm > 1 && gx <= 65535u;
    const dim3 grid = m_fast ? dim3(gm, gx) : dim3(gx, gm);
    if (split)
      launch("linear", linear_kernel<INT4, R, MT, kWarps>, grid, block, 0, s, w, x, ldx, M, y, ldy, int(ep), m_fast);
    else
      launch("linear", linear_kernel<INT4, R, MT, 1>, grid, block, 0, s, w, x, ldx, M, y, ldy, int(ep), m_fast);
  };
  if (M == 1)
    go(std::integral_constant<int, 1>{});
  else if (!INT4 && M == 2)
    go(std::integral_constant<int, 2>{});
  else if (!INT4 && M <= 4)
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 8>{});
}

void linear(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, cudaStream_t s,
            const LinearConfig& cfg) {
  check_linear_config(cfg);
  if (M <= 0 || w.rows <= 0) return;
  check_shape(w, x, ldx, "linear");
  if (linear_mma(w, x, ldx, M, y, ldy, ep, s, cfg)) return;  // tensor cores for eligible bf16 matrices (mma.cu)
  if (w.int4)
    launch_linear<true, 4>(w, x, ldx, M, y, ldy, ep, s);
  else if (M > 4)
    // 4 rows a warp for wide batches (verify N ≥ 4, prefill): each x chunk loaded from L1 serves 4
    // weight rows instead of 2 — with 8 token rows a tile, the x loads (32 B a row a chunk) were
    // 8× the weight bytes. R never changes a row's reduction order (row invariance).
    launch_linear<false, 4>(w, x, ldx, M, y, ldy, ep, s);
  else
    launch_linear<false, 2>(w, x, ldx, M, y, ldy, ep, s);
  check_launch("linear");
}

void expert_linear(const ExpertBatch& b, const float* x, int64_t ldx, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  if (b.path != ExpertPath::imma && b.path != ExpertPath::cores) fail("CUDA expert_linear: unknown path ", int(b.path));
  if (b.imma_tile < -1 || b.imma_tile >= kImmaTileCount)
    fail("CUDA expert_linear: IMMA tile ", b.imma_tile, " does not exist (−1: the rule, 0 … ", kImmaTileCount - 1, ")");
  if (b.max_active <= 0) return;
  check_shape(b.w, x, ldx, "expert_linear");
  if (b.w.int4 && b.path == ExpertPath::imma) {  // integer tensor cores (expert_imma.cu)
    expert_linear_imma(b, x, ldx, y, ldy, ep, s);
    return;
  }
  const dim3 block(kWarps * 32);
  const unsigned gy = unsigned(b.max_active);
  if (b.w.int4) {
    constexpr int R = kExpertInt4Rows;
    const unsigned gx = unsigned((b.w.rows + kWarps * R - 1) / (kWarps * R));
    launch("expert_linear", expert_kernel<true, R, 1>, dim3(gx, gy), block, 0, s, b, x, ldx, y, ldy, int(ep));
  } else {
    // bf16 experts: one token per expert (decode) needs no M-tile; wider tiles share each weight load.
    constexpr int R = 2;
    const unsigned gx = unsigned((b.w.rows + kWarps * R - 1) / (kWarps * R));
    if (b.max_rows_per_expert <= 1)
      launch("expert_linear", expert_kernel<false, R, 1>, dim3(gx, gy), block, 0, s, b, x, ldx, y, ldy, int(ep));
    else
      launch("expert_linear", expert_kernel<false, R, 4>, dim3(gx, gy), block, 0, s, b, x, ldx, y, ldy, int(ep));
  }
}

std::string expert_cores_describe() {
  constexpr auto k = expert_kernel<true, kExpertInt4Rows, 1>;
  cudaFuncAttributes fa{};
  check(cudaFuncGetAttributes(&fa, k), "cudaFuncGetAttributes");
  int blocks = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, kWarps * 32, 0), "occupancy");
  char buf[160];
  std::snprintf(buf, sizeof buf, "register kernel W%d R%d MT1: %d regs, %d spill B, %d blk/SM, %.0f KB w in flight/SM", kWarps,
                kExpertInt4Rows, fa.numRegs, int(fa.localSizeBytes), blocks, blocks * kWarps * kExpertInt4Rows * 32 * 18 / 1024.0);
  return buf;
}

}  // namespace kd::cuda
