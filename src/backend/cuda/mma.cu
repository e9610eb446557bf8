// Tensor-core path (mma.sync m16n8k16, bf16 × bf16 → fp32) of cuda::linear for bf16 weights of
// ≥ LinearConfig::mma_min_rows rows. It serves every M of such a matrix, 1 included, so a row's bits
// never depend on the batch (DESIGN.md §2). Its tile table is kernel_config.h's kMmaTiles. (INT4
// experts: expert_imma.cu; a bf16-MMA expert kernel that lived here was removed once the integer one
// beat it at every batch, and the tiles the sweeps did not ship in issue 13 — docs/perf.md.)
//
// Orientation: the MMA's 16 "rows" are 16 weight rows (outputs), its 8 "columns" are 8 token rows,
// D[16 × 8] = W[16 × k16] · xᵀ[k16 × 8]. The k16 step's 16 positions are a fixed permutation of the
// physical columns, the same for A and B, so each lane fills its fragments with 16-byte loads:
// lane (g = lane / 4, t = lane % 4) loads W[row g | g + 8][k0 + 8t … k0 + 8t + 7] and the same
// 8 columns of token g's fp32 x — one k32 block is 2 MMA steps (s = 0, 1); step s's logical
// columns 2t, 2t+1 | 2t+8, 2t+9 are the physical columns k0 + 8t + 4s + 0, 1 | 2, 3.
//
// Precision: x stays fp32. Each x is split exactly as hi + mid + lo, three bf16 (bit truncation:
// hi = top 16 bits of x, mid = top 16 bits of x − hi, lo = the rest, which has ≤ 8 significant bits;
// exact for |x| ≥ 2^-103), and every k16 step runs three MMAs (lo, mid, hi into one fresh fp32
// fragment; the bf16 products are exact in the tensor core). That fragment is then added to the fp32
// accumulator with one IEEE add (__fadd_rn): the tensor core's own (truncating) accumulation only
// ever spans 48 products of one k16 step, so its error stays at the size of that step's partial sum,
// not of the running total. Two parts (16 bits of x) would round x at 2^-17, about the whole error
// budget of a plain fp32 dot at K = 7168 (bench/mma_model.py: ≈ 1e-5 vs 1.6e-6 plain, three parts ≈ 2e-7
// under a truncating tensor-core model); the op-parity test (tests/gpu/test_cuda_mma.cpp) checks
// the three-part version against fp64 and a plain fp32 loop.
//
// Row invariance: the reduction order of an output is fixed by K and the matrix shape alone — warp
// w of a block (KS warps, KS a rule of the row count) takes k32 blocks w, w + KS, …; each k16 step's
// three MMAs start from zero and are added to the warp's accumulator in k order; the KS partials are
// added in warp order through shared memory. The token tile (8 · NT rows), the weight rows a block
// owns (16 · RT), the unroll depth and which block runs a tile only choose who computes an output,
// never how: an MMA output element depends only on its own row of A, column of B and accumulator
// (the hardware's contract as we read it; tests/gpu/test_cuda_mma*.cpp check it bit for bit).
// Inputs with Inf give NaN here (x − hi is Inf − Inf); the CUDA-core path may give ±Inf.

#include "backend/cuda/common.cuh"
#include "backend/cuda/env.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kd::cuda {

namespace {

// x of one k32 block at physical column k (= kb · 32 + 8t) for NT token tiles: xv[nt] = the 8
// floats of token g of tile nt (xr[nt], null past the batch: zeros); columns ≥ K read zeros.
template <int NT>
__device__ __forceinline__ void x_load(const float* const (&xr)[NT], int64_t K, int64_t k, float4 (&xv)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xv[nt][0] = xv[nt][1] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (xr[nt] != nullptr && k < K) {
      const float4* p = reinterpret_cast<const float4*>(xr[nt] + k);
      xv[nt][0] = p[0];
      xv[nt][1] = p[1];
    }
  }
}

// Their B fragments: [tile][step][part: hi, mid, lo][register: columns 2t, 2t+1 | 2t+8, 2t+9].
template <bool INT4, int NT>
__device__ __forceinline__ void x_split(const float4 (&xv)[NT][2], uint32_t (&bf)[NT][2][3][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float4 x0 = xv[nt][0], x1 = xv[nt][1];
    // bf16: step s pairs physical columns (4s, 4s+1), (4s+2, 4s+3); INT4: (s', s'+4), (s'+1, s'+5), s' = 2s.
    const Split3 p00 = INT4 ? split3(x0.x, x1.x) : split3(x0.x, x0.y);
    const Split3 p01 = INT4 ? split3(x0.y, x1.y) : split3(x0.z, x0.w);
    const Split3 p10 = INT4 ? split3(x0.z, x1.z) : split3(x1.x, x1.y);
    const Split3 p11 = INT4 ? split3(x0.w, x1.w) : split3(x1.z, x1.w);
    bf[nt][0][0][0] = p00.hi, bf[nt][0][1][0] = p00.mid, bf[nt][0][2][0] = p00.lo;
    bf[nt][0][0][1] = p01.hi, bf[nt][0][1][1] = p01.mid, bf[nt][0][2][1] = p01.lo;
    bf[nt][1][0][0] = p10.hi, bf[nt][1][1][0] = p10.mid, bf[nt][1][2][0] = p10.lo;
    bf[nt][1][0][1] = p11.hi, bf[nt][1][1][1] = p11.mid, bf[nt][1][2][1] = p11.lo;
  }
}

// d += A · (lo, mid, hi parts of B): small parts first.
__device__ __forceinline__ void mma3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[3][2]) {
  mma_bf16(d, a, b[2][0], b[2][1]);
  mma_bf16(d, a, b[1][0], b[1][1]);
  mma_bf16(d, a, b[0][0], b[0][1]);
}

// acc += one k32 block: w[rt][h] = the lane's 16 weight bytes of row g + 8·h of 16-row tile rt (columns
// 8t … 8t + 7), bf = the tokens' B fragments (x_split). Each k16 step's three MMAs go into a fresh
// fragment, added to acc — the one place both kernels below do their MMAs, so their bits agree.
template <int RT, int NT>
__device__ __forceinline__ void mma_k32(const uint4 (&w)[RT][2], const uint32_t (&bf)[NT][2][3][2], float (&acc)[RT][NT][4]) {
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      // A: rows g | g + 8, logical columns 2t, 2t+1 (physical +0, +1) then 2t+8, 2t+9 (+2, +3).
      const uint4 wg = w[rt][0], wg8 = w[rt][1];
      const uint32_t a[4] = {s ? wg.z : wg.x, s ? wg8.z : wg8.x, s ? wg.w : wg.y, s ? wg8.w : wg8.y};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma3(d, a, bf[nt][s]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][nt][i] = __fadd_rn(acc[rt][nt][i], d[i]);
      }
    }
}

// One 16-byte weight load. LD 1: ld.global.nc with L1::no_allocate (streamed weights do not evict x, which every block re-reads, from L1); 2: the
// same plus the L2::256B prefetch hint (a 64-byte request fetches its whole 256-byte run from HBM).
// volatile: the compiler must not speculate the load out of its `k < K` guard (past the buffer).
template <int LD>
__device__ __forceinline__ uint4 load_w(const uint16_t* p) {
  uint4 v;
  if constexpr (LD == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  } else {
    static_assert(LD == 2, "weight load flavour: 1 or 2");
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  }
  return v;
}

// One warp's share of a 16·RT (weight rows) × 8·NT (tokens) bf16 tile: acc[rt][nt][i] (D fragment
// layout: element i of lane (g, t) is weight row g + 8·(i / 2), token 2t + i % 2) over k32 blocks
// w, w + KS, … (each 64 contiguous bytes a row), in k order; each k16 step's three MMAs go into a
// fresh fragment, added to acc. U: k32 blocks whose weight loads are issued together, software-
// pipelined — the next U blocks' loads are issued before this batch's MMAs (twice the registers, but
// the warp never waits on HBM with nothing in flight). KC: the warp takes runs of U consecutive k32
// blocks instead (runs w, w + KS, …: a batch's loads fill whole 128-byte lines of each row) — then
// U is part of the order. None of LD, RT, NT (nor U without KC) changes the order.
// Lane (g, t)'s weight rows g and g + 8 of each of the RT 16-row tiles from row0 (clamped to the
// matrix), at column 8t; and the tile's accumulators zeroed.
template <int RT, int NT>
__device__ __forceinline__ void tile_start(const uint16_t* w16, int64_t rows, int64_t K, int64_t row0, int g, int t,
                                           const uint16_t* (&wp)[RT][2], float (&acc)[RT][NT][4]) {
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) wp[rt][h] = w16 + min(row0 + rt * 16 + g + 8 * h, rows - 1) * K + 8 * t;
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.0f;
}

template <int RT, int NT, int KS, int U, int LD, bool KC>
__device__ __forceinline__ void bf16_warp(const uint16_t* w16, int64_t rows, int64_t K, int64_t row0,
                                          const float* const (&xr)[NT], float (&acc)[RT][NT][4], int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* wp[RT][2];
  tile_start<RT, NT>(w16, rows, K, row0, g, t, wp, acc);
  const int64_t nkb = (K + 31) / 32, stride = int64_t(U) * KS, first = KC ? int64_t(warp) * U : int64_t(warp);
  constexpr int USTEP = KC ? 1 : KS;  // k32 blocks between a batch's consecutive loads
  // x of a whole batch is loaded before its first split when that stays small (U · NT · 8 registers).
  constexpr bool XPRE = U * NT <= 4;

  auto load = [&](int64_t kb0, uint4 (&wv)[U][RT][2]) {  // columns ≥ K (blocks past the end) read zeros
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = (kb0 + int64_t(u) * USTEP) * 32;
      const bool in = k + 8 * t < K;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = in ? load_w<LD>(wp[rt][h] + k) : make_uint4(0, 0, 0, 0);
    }
  };
  auto compute = [&](int64_t kb0, const uint4 (&wv)[U][RT][2]) {
    float4 xv[XPRE ? U : 1][NT][2];
    if constexpr (XPRE) {
#pragma unroll
      for (int u = 0; u < U; ++u) x_load<NT>(xr, K, (kb0 + int64_t(u) * USTEP) * 32 + 8 * t, xv[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t kb = kb0 + int64_t(u) * USTEP;
      if (kb >= nkb) break;  // warp-uniform: every lane runs the MMAs
      uint32_t bf[NT][2][3][2];
      if constexpr (XPRE) {
        x_split<false, NT>(xv[u], bf);
      } else {
        x_load<NT>(xr, K, kb * 32 + 8 * t, xv[0]);
        x_split<false, NT>(xv[0], bf);
      }
      mma_k32<RT, NT>(wv[u], bf, acc);
    }
  };

  uint4 wv[U][RT][2];
  load(first, wv);
  pdl_wait();  // the first weight batch is in flight while the kernel before finishes (common.cuh)
  pdl_trigger();
  for (int64_t kb0 = first; kb0 < nkb; kb0 += stride) {
    uint4 nx[U][RT][2];
    load(kb0 + stride, nx);  // past the end: predicated off, zeros
    compute(kb0, wv);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = nx[u][rt][h];
  }
}

// The epilogue of a TOK × ROWS tile: total(tok, r) is the finished sum of token tok, weight row
// row0 + r; token tok's output row is yrow(tok) (nothing is written for tok ≥ mcount or rows past the
// matrix); threads tid of nthreads share the work. One function for both kernels below, so their
// outputs agree bit for bit.
template <int ROWS, int TOK, class Total, class YRow>
__device__ __forceinline__ void write_tile(Total total, int64_t row0, int64_t rows, int mcount, int ep, YRow yrow, int tid,
                                           int nthreads) {
  if (ep == int(Epilogue::swiglu)) {
    for (int e = tid; e < TOK * (ROWS / 2); e += nthreads) {
      const int tok = e / (ROWS / 2), j = e % (ROWS / 2);
      if (tok >= mcount || row0 + 2 * j + 1 >= rows) continue;
      const float gv = total(tok, 2 * j), uv = total(tok, 2 * j + 1);
      yrow(tok)[(row0 + 2 * j) / 2] = gv / (1.0f + expf(-gv)) * uv;  // silu(g) · u, as linear.cu
    }
  } else {
    for (int e = tid; e < TOK * ROWS; e += nthreads) {
      const int tok = e / ROWS, r = e % ROWS;
      if (tok >= mcount || row0 + r >= rows) continue;
      float* out = yrow(tok) + row0 + r;
      const float v = total(tok, r);
      *out = ep == int(Epilogue::add) ? __fadd_rn(*out, v) : v;
    }
  }
}

// The KS partials of one group of KS warps (shared memory, added in warp order) and the epilogue;
// tid: the thread's index within its group (threadIdx.x when the block is one group). Ends with a
// barrier (every group of the block calls it together) so the caller may reuse `part`.
template <int RT, int NT, int KS, class YRow>
__device__ __forceinline__ void finish_tile(float (&part)[KS][8 * NT][16 * RT + 4], const float (&acc)[RT][NT][4], int64_t row0,
                                            int64_t rows, int mcount, int ep, YRow yrow, int tid) {
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[warp][nt * 8 + 2 * t + (i & 1)][rt * 16 + g + 8 * (i >> 1)] = acc[rt][nt][i];
  __syncthreads();
  auto total = [&](int tok, int r) {
    float v = part[0][tok][r];
#pragma unroll
    for (int k = 1; k < KS; ++k) v = __fadd_rn(v, part[k][tok][r]);
    return v;
  };
  write_tile<16 * RT, 8 * NT>(total, row0, rows, mcount, ep, yrow, tid, KS * 32);
  __syncthreads();
}

// grid (ceil(M / (8·NT)), ceil(rows / (16·RT))) when m_fast (a row group's token tiles are
// neighbouring blocks, sharing its weights through L2), else the transpose. Block: KS warps, each a
// K-slice of the same 16·RT weight rows × 8·NT tokens. MINB: blocks an SM must hold (ptxas caps
// registers at 65536 / (MINB · 32 · KS) a thread), so that the grid's blocks fit in whole waves.
template <int RT, int NT, int KS, int U, int LD, bool KC, int MINB>
__global__ void __launch_bounds__(KS * 32, MINB) mma_linear_kernel(DevMatrix w, const float* __restrict__ x, int64_t ldx,
                                                                 int64_t M, float* y, int64_t ldy, int ep, bool m_fast) {
  static_assert(sizeof(float) * KS * 8 * NT * (16 * RT + 4) <= 48 * 1024, "partials exceed 48 KB of static shared memory");
  __shared__ float part[KS][8 * NT][16 * RT + 4];  // per warp: [token][weight row]; +4: conflict-free stores
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  const int64_t bx = m_fast ? blockIdx.y : blockIdx.x, by = m_fast ? blockIdx.x : blockIdx.y;
  const int64_t row0 = bx * 16 * RT, m0 = by * 8 * NT;
  const int mcount = int(M - m0 < 8 * NT ? M - m0 : int64_t(8 * NT));
  const float* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xr[nt] = nt * 8 + g < mcount ? x + (m0 + nt * 8 + g) * ldx : nullptr;
  float acc[RT][NT][4];
  bf16_warp<RT, NT, KS, U, LD, KC>(static_cast<const uint16_t*>(w.w), w.rows, w.cols, row0, xr, acc, warp, lane);
  finish_tile<RT, NT, KS>(part, acc, row0, w.rows, mcount, ep, [&](int tok) { return y + (m0 + tok) * ldy; }, int(threadIdx.x));
}

template <int RT, int NT, int KS, int U, int LD, bool KC, int MINB>
void launch_tile(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  const unsigned gx = unsigned((w.rows + 16 * RT - 1) / (16 * RT)), gm = unsigned((M + 8 * NT - 1) / (8 * NT));
  const bool m_fast = gm > 1 && gx <= 65535u;
  const dim3 grid = m_fast ? dim3(gm, gx) : dim3(gx, gm);
  launch("linear (MMA)", mma_linear_kernel<RT, NT, KS, U, LD, KC, MINB>, grid, dim3(KS * 32), 0, s, w, x, ldx, M, y, ldy, int(ep),
         m_fast);
}

// ---- Prefill GEMM: the tiles' reduction order, staged in shared memory ----------------------------
// For wide batches the tile kernel above re-reads each weight slab once per 32 tokens and x once per
// 32 weight rows, through L2 and without sharing (docs/perf.md, "Where a 4096-token prefill goes":
// 210 registers, 12.5 % occupancy, 21 % of the mma.sync rate at 4096 tokens). This kernel stages a
// block's 128 weight rows × 64 tokens in shared memory (cp.async, kGemmStages stages of two k32
// blocks; 2 row warps × 4 token warps of 64 rows × 16 tokens) and keeps every output's order. The
// tile path's warp w reduces the k32 blocks of K-slice w in k order and the KS partials are then added
// in warp order; here each thread walks the slices one after another — slice 0's blocks in k order
// into a fresh accumulator, then slice 1's, … — and adds each finished slice to a running total
// (total = slice 0, then total + slice 1, …): the same fp32 operations on the same values, in the same
// order, with two accumulators an output instead of KS. Each lane reads the tile path's 16 weight and
// 32 x bytes (from shared memory instead of global), both kernels do their MMAs in mma_k32 and their
// epilogue in write_tile, so an output's bits do not depend on which kernel ran
// (tests/gpu/test_cuda_mma.cpp, PrefillGemmBits). Which kernel runs is mma_gemm_blocks_for's rule
// (scheduling only).

// The k32 blocks of a K of nkb blocks in a tile's reduction order: K-slice w (of KS) holds the runs
// of UE consecutive blocks that start at (w + j·KS)·UE, j = 0, 1, …, in k order; the slices follow
// one another. next() moves on and says how many slices that finished: 0, or 1 plus the empty ones
// after it (a short K leaves the last slices without a block; the tile path adds their zero partials).
template <int KS, int UE>
struct SliceOrder {
  int nkb, w = 0, r = 0, u = 0;  // the current block: (w + r·KS)·UE + u
  __device__ explicit SliceOrder(int n) : nkb(n) {}
  __device__ bool done() const { return w >= KS; }
  __device__ int kb() const { return (w + r * KS) * UE + u; }
  __device__ int next() {
    if (u + 1 < UE && kb() + 1 < nkb) {
      ++u;
      return 0;
    }
    u = 0;
    if ((w + ++r * KS) * UE < nkb) return 0;
    r = 0;
    if (++w < KS && w * UE < nkb) return 1;
    const int finished = 1 + KS - w;
    w = KS;
    return finished;
  }
};

constexpr int kGemmRows = 128, kGemmTokens = 64, kGemmThreads = 256, kGemmStageBlocks = 2, kGemmStages = 3;
constexpr int kGemmWPitch = 64, kGemmXPitch = 144;  // bytes a weight row / token row of one k32 block (+16: no bank conflicts)
constexpr int kGemmWBytes = kGemmRows * kGemmWPitch, kGemmXBytes = kGemmTokens * kGemmXPitch;
constexpr int kGemmStage = kGemmStageBlocks * (kGemmWBytes + kGemmXBytes);
constexpr int kGemmSmem = kGemmStages * kGemmStage;  // 104448 B: two blocks an SM
constexpr int kGemmTotPitch = kGemmRows + 4;         // floats a token row of the finished totals
static_assert(kGemmTokens * kGemmTotPitch * 4 <= kGemmSmem, "the totals reuse the stages' shared memory");
static_assert(kGemmRows * 4 % kGemmThreads == 0 && kGemmTokens * 8 % kGemmThreads == 0, "whole copy pieces a thread");

// MINB: blocks an SM asked of ptxas (2: 128 registers, a few spilled; 1: none spilled, 8 warps an SM).
template <int KS, int UE, int MINB>
__global__ void __launch_bounds__(kGemmThreads, MINB) mma_gemm_kernel(DevMatrix w, const float* __restrict__ x, int64_t ldx,
                                                                  int64_t M, float* y, int64_t ldy, int ep, bool m_fast) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wr = warp & 1, wt = warp >> 1;  // this warp's 64 rows (of 128) and 16 tokens (of 64)
  const int64_t bx = m_fast ? blockIdx.y : blockIdx.x, by = m_fast ? blockIdx.x : blockIdx.y;
  const int64_t row0 = bx * kGemmRows, m0 = by * kGemmTokens, K = w.cols, rows = w.rows;
  const int nkb = int((K + 31) / 32), mcount = int(min(M - m0, int64_t(kGemmTokens)));
  const uint16_t* w16 = static_cast<const uint16_t*>(w.w);
  pdl_wait();
  pdl_trigger();

  // The next kGemmStageBlocks blocks of the order into stage `slot`: weight piece i (16 B) is row
  // i / 4, columns 8·(i % 4) …; x piece i is token i / 8, columns 4·(i % 8) …; outside the matrix,
  // the batch or K: zeros (the tile path reads zeros there too).
  SliceOrder<KS, UE> order_in(nkb);
  auto issue = [&](int slot) {
    uint8_t* st = smem + slot * kGemmStage;
#pragma unroll
    for (int e = 0; e < kGemmStageBlocks; ++e) {
      if (order_in.done()) break;
      const int64_t k0 = int64_t(order_in.kb()) * 32;
      uint8_t* ws = st + e * kGemmWBytes;
      uint8_t* xs = st + kGemmStageBlocks * kGemmWBytes + e * kGemmXBytes;
#pragma unroll
      for (int q = 0; q < kGemmRows * 4 / kGemmThreads; ++q) {
        const int i = tid + q * kGemmThreads, r = i >> 2, c = i & 3;
        const bool in = row0 + r < rows && k0 + 8 * c < K;
        cp16_zfill(ws + r * kGemmWPitch + 16 * c, in ? w16 + (row0 + r) * K + k0 + 8 * c : w16, in);
      }
#pragma unroll
      for (int q = 0; q < kGemmTokens * 8 / kGemmThreads; ++q) {
        const int i = tid + q * kGemmThreads, tok = i >> 3, c = i & 7;
        const bool in = m0 + tok < M && k0 + 4 * c < K;
        cp16_zfill(xs + tok * kGemmXPitch + 16 * c, in ? x + (m0 + tok) * ldx + k0 + 4 * c : x, in);
      }
      order_in.next();
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");  // empty groups too: wait_group counts stages
  };
#pragma unroll
  for (int j = 0; j < kGemmStages - 1; ++j) issue(j);

  float acc[4][2][4], tot[4][2][4];
#pragma unroll
  for (int rt = 0; rt < 4; ++rt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.0f, tot[rt][nt][i] = 0.0f;
  bool first = true;  // the first finished slice starts the total (the tile path's part[0])
  auto fold = [&] {
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          tot[rt][nt][i] = first ? acc[rt][nt][i] : __fadd_rn(tot[rt][nt][i], acc[rt][nt][i]);
          acc[rt][nt][i] = 0.0f;
        }
    first = false;
  };

  SliceOrder<KS, UE> order(nkb);
  const int nstages = (nkb + kGemmStageBlocks - 1) / kGemmStageBlocks;
#pragma unroll 1
  for (int j = 0; j < nstages; ++j) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kGemmStages - 2) : "memory");
    __syncthreads();  // stage j visible to all; everyone is done with stage j − 1's slot
    issue((j + kGemmStages - 1) % kGemmStages);
    const uint8_t* st = smem + (j % kGemmStages) * kGemmStage;
#pragma unroll
    for (int e = 0; e < kGemmStageBlocks; ++e) {
      if (order.done()) break;
      const uint8_t* ws = st + e * kGemmWBytes;
      const uint8_t* xs = st + kGemmStageBlocks * kGemmWBytes + e * kGemmXBytes;
      float4 xv[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float4* p = reinterpret_cast<const float4*>(xs + (wt * 16 + nt * 8 + g) * kGemmXPitch + 32 * t);
        xv[nt][0] = p[0];
        xv[nt][1] = p[1];
      }
      uint32_t bf[2][2][3][2];
      x_split<false, 2>(xv, bf);
      uint4 wf[4][2];
#pragma unroll
      for (int rt = 0; rt < 4; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wf[rt][h] = *reinterpret_cast<const uint4*>(ws + (wr * 64 + rt * 16 + g + 8 * h) * kGemmWPitch + 16 * t);
      mma_k32<4, 2>(wf, bf, acc);
      for (int f = order.next(); f > 0; --f) fold();
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();  // every stage consumed: the totals take the shared memory over
  float* tot_s = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int rt = 0; rt < 4; ++rt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        tot_s[(wt * 16 + nt * 8 + 2 * t + (i & 1)) * kGemmTotPitch + wr * 64 + rt * 16 + g + 8 * (i >> 1)] = tot[rt][nt][i];
  __syncthreads();
  write_tile<kGemmRows, kGemmTokens>([&](int tok, int r) { return tot_s[tok * kGemmTotPitch + r]; }, row0, rows, mcount, ep,
                                      [&](int tok) { return y + (m0 + tok) * ldy; }, tid, kGemmThreads);
}

// The > 48 KB opt-in of the GEMM for this order, once a device — on every call of the matrix, GEMM or
// not: a graph may be captured at a batch whose kernel no earlier launch used, and capture must never
// meet a first-time attribute call (as attention.cu's opt-ins).
template <int KS, int UE>
void opt_in_gemm() {
  static std::atomic<uint64_t> opted[2];
  opt_in_smem(mma_gemm_kernel<KS, UE, 1>, kGemmSmem, opted[0], "cudaFuncSetAttribute (MMA prefill GEMM)");
  opt_in_smem(mma_gemm_kernel<KS, UE, 2>, kGemmSmem, opted[1], "cudaFuncSetAttribute (MMA prefill GEMM)");
}

template <int KS, int UE, int MINB>
void launch_gemm_as(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  const unsigned gx = unsigned((w.rows + kGemmRows - 1) / kGemmRows), gm = unsigned((M + kGemmTokens - 1) / kGemmTokens);
  const bool m_fast = gm > 1 && gx <= 65535u;
  const dim3 grid = m_fast ? dim3(gm, gx) : dim3(gx, gm);
  launch("linear (MMA prefill GEMM)", mma_gemm_kernel<KS, UE, MINB>, grid, dim3(kGemmThreads), size_t(kGemmSmem), s, w, x, ldx,
         M, y, ldy, int(ep), m_fast);
}
template <int KS, int UE>
void launch_gemm(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, int blocks,
                 cudaStream_t s) {
  if (blocks == 1)
    launch_gemm_as<KS, UE, 1>(w, x, ldx, M, y, ldy, ep, s);
  else
    launch_gemm_as<KS, UE, 2>(w, x, ldx, M, y, ldy, ep, s);
}

// Tile T of kMmaTiles (kernel_config.h) on a matrix of the given height class (TALL: ≥ 4096 rows,
// KST warps split K; else KSS): M ≤ 8 one 8-token tile, then 16 / 24 / 32-token tiles.
template <int T, bool TALL>
void dispatch_m(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, int gemm,
                cudaStream_t s) {
  constexpr MmaTile C = kMmaTiles[T];
  static_assert(!C.KC || C.U1 == C.UW, "with KC the load batch is part of the reduction order: U1 must equal UW");
  constexpr int KS = TALL ? C.KST : C.KSS;
  constexpr int RT1 = TALL ? C.RT1 : 1, RTW = TALL ? C.RTW : 1, MINB = TALL && C.OCC1 / KS > 1 ? C.OCC1 / KS : 1;
  opt_in_gemm<KS, C.KC ? C.UW : 1>();
  if (gemm > 0)
    launch_gemm<KS, C.KC ? C.UW : 1>(w, x, ldx, M, y, ldy, ep, gemm, s);
  else if (M <= 8)
    launch_tile<RT1, 1, KS, C.U1, C.LD, C.KC, MINB>(w, x, ldx, M, y, ldy, ep, s);
  else if (M <= 16)
    launch_tile<RTW, 2, KS, C.UW, C.LD, C.KC, 1>(w, x, ldx, M, y, ldy, ep, s);
  else if (M <= 24)
    launch_tile<RTW, 3, KS, C.UW, C.LD, C.KC, 1>(w, x, ldx, M, y, ldy, ep, s);
  else
    launch_tile<RTW, 4, KS, C.UW, C.LD, C.KC, 1>(w, x, ldx, M, y, ldy, ep, s);
}

template <int T>
void dispatch(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, int gemm,
              cudaStream_t s) {
  if (w.rows >= 4096)
    dispatch_m<T, true>(w, x, ldx, M, y, ldy, ep, gemm, s);
  else
    dispatch_m<T, false>(w, x, ldx, M, y, ldy, ep, gemm, s);
}

using DispatchFn = void (*)(const DevMatrix&, const float*, int64_t, int64_t, float*, int64_t, Epilogue, int, cudaStream_t);
constexpr DispatchFn kDispatch[] = {&dispatch<0>, &dispatch<1>};
static_assert(int(sizeof(kDispatch) / sizeof(kDispatch[0])) == kMmaTileCount, "kDispatch lists every kMmaTiles entry");

}  // namespace

int64_t default_mma_min_rows() {
  static const int64_t v = env_count("KDTREE_CUDA_MMA_MIN_ROWS", kMmaMinRows);
  return v;
}

int64_t default_mma_gemm_min_m() {
  static const int64_t v = env_count("KDTREE_CUDA_MMA_GEMM_MIN_M", kMmaGemmMinM);
  return v;
}

int mma_gemm_blocks_for(int64_t M, const LinearConfig& cfg) {
  return M < cfg.mma_gemm_min_m ? 0 : cfg.mma_gemm_blocks > 0 ? cfg.mma_gemm_blocks : kMmaGemmBlocks;
}

bool mma_eligible(const DevMatrix& w, const LinearConfig& cfg) { return !w.int4 && w.rows >= cfg.mma_min_rows && w.cols % 8 == 0; }

bool linear_mma(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep,
                cudaStream_t s, const LinearConfig& cfg) {
  if (!mma_eligible(w, cfg)) return false;
  check_linear_config(cfg);
  if (M <= 0) return true;
  if (ldx % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) fail("CUDA linear (MMA): activations are not 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(w.w) % 16 != 0) fail("CUDA linear (MMA): weights are not 16-byte aligned");
  const int tile = cfg.mma_tile >= 0 ? cfg.mma_tile : w.rows >= kMmaTallRows ? kMmaTallTile : kMmaShortTile;
  kDispatch[tile](w, x, ldx, M, y, ldy, ep, mma_gemm_blocks_for(M, cfg), s);
  return true;
}

// ---- Ceiling probe: the rate of this file's tensor-core instruction --------------------------------
namespace {
// 8 independent accumulator chains of m16n8k16 bf16 MMAs a warp, operands in registers (no memory
// traffic): the issue and tensor-pipe limit every kernel above works against.
__global__ void mma_rate_kernel(float* sink, int iters) {
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ (threadIdx.x * 0x00010001u * (i + 1));
  const uint32_t b0 = 0x3f803f80u + threadIdx.x, b1 = 0x3f803f80u - threadIdx.x;
  float d[8][4] = {};
#pragma unroll 1
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int c = 0; c < 8; ++c) mma_bf16(d[c], a, b0, b1);
  float t = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) t += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  if (t == 1234.5f) *sink = t;  // never true for these operands; keeps the work
}
}  // namespace

double measure_mma_tflops(int reps) {
  float* sink = nullptr;
  check(cudaMalloc(&sink, sizeof(float)), "cudaMalloc (MMA probe)");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  constexpr int kIters = 4096, kWarpsPerBlock = 8, kBlocksPerSm = 4;
  std::vector<double> tflops;
  for (int r = 0; r < reps + 1; ++r) {
    check(cudaEventRecord(a), "cudaEventRecord");
    mma_rate_kernel<<<unsigned(sms * kBlocksPerSm), kWarpsPerBlock * 32>>>(sink, kIters);
    check_launch("mma_rate_kernel");
    check(cudaEventRecord(b), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    const double mmas = double(sms) * kBlocksPerSm * kWarpsPerBlock * kIters * 8;
    if (r > 0) tflops.push_back(mmas * 2.0 * 16 * 8 * 16 / (double(ms) * 1e-3) / 1e12);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(sink);
  std::sort(tflops.begin(), tflops.end());
  return tflops[tflops.size() / 2];
}

}  // namespace kd::cuda
