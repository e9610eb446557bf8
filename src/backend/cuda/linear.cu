// bf16 and W4A16 GEMV/GEMM for M = 1 … a few hundred rows (decode, tree verify, prefill), dense and
// per-expert. One warp owns R output rows × up to MT input rows: each lane walks the 16-byte weight
// chunks c = lane, lane + 32, … (8 bf16, or one INT4 group of 32 nibbles + its scale), multiplies
// them with the fp32 activations, and the warp reduces with a butterfly. The reduction order of an
// output depends only on the inner dimension, so the M-tile variant (MT = 1 for decode, wider for
// verify/prefill) never changes a row's bits — the row invariance DDTree needs (DESIGN.md §2).
#include "backend/cuda/common.cuh"
#include "backend/cuda/env.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

#include <cstdio>
#include <cstdlib>
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

// ---- Staged INT4 expert kernel (configs 1…, see kExpertConfigs) -------------------------------------
// The register kernel above keeps one chunk a row in flight per lane (a 16-byte load per weight row,
// double-buffered in registers: 243 registers, 2 blocks ≈ 32 KB in flight an SM) and streams only
// ≈ 2.5 TB/s. Here the weights never pass through registers on their way in: the block copies its
// W·R rows × 32 chunks (512 bytes a row, the "step"), their 32 scales a row and the step's 1024 x
// values of each token into a shared-memory stage with cp.async, ST stages deep, so (ST − 1) stages
// per block are in flight while one is computed — bytes in flight an SM = blocks/SM × (ST − 1) ×
// stage, with ~80–200 registers a thread. A token's x slice is loaded once a block (not once a warp).
// The arithmetic is the register kernel's, term for term: lane l owns chunks l, l + 32, … of a row
// (step s gives it chunk 32·s + l, ascending), the same nibble trick per chunk, fmaf into acc in
// chunk order, the same butterfly and epilogue — so every config writes the very bits config 0
// writes (the sweep test asserts it), whatever W, R, MT or ST. Needs cols % 1024 == 0 and a 16-byte
// expert stride; other shapes run config 0.
template <int W, int R, int MT, int ST>
struct Staged {
  static constexpr int rows = W * R, threads = W * 32;
  static constexpr int w_bytes = rows * 512, s_bytes = rows * 64, x_bytes = MT * 4096;
  static constexpr int stage = w_bytes + s_bytes + x_bytes, smem = ST * stage;
  static_assert(ST >= 2 && R % 2 == 0, "double buffering at least; swiglu pairs rows inside a warp");
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// One block's copy schedule, shared by the staged kernels: step j = token tile j / S (MT of the
// expert's tokens) × 1024-column step j % S. Stage layout: weights [W·R rows][32 chunks × 16 B];
// scales [W·R][32 × bf16]; x [MT][32 chunks × 32 fp32], the 16-byte quarters of chunk c stored at
// quarter q ^ (c & 7) so the 8 lanes of a shared-memory phase read 8 different bank groups.
template <int W, int R, int MT, int ST>
struct StageLoader {
  using C = Staged<W, R, MT, ST>;
  uint8_t* smem;
  const uint8_t* wb;  // INT4 [rows, cols / 2 bytes] of this expert
  const uint8_t* sb;  // bf16 [rows, cols / 32] of this expert
  const float* x;
  const int32_t* in_row;
  int64_t ldx, tile0, nrows, row_bytes, srow_bytes;
  int S, nsteps, off, cnt;

  __device__ __forceinline__ StageLoader(uint8_t* sm, const ExpertBatch& b, int a, const float* xx, int64_t ld)
      : smem(sm), x(xx), in_row(b.in_row), ldx(ld), tile0(int64_t(blockIdx.x) * C::rows), nrows(b.w.rows) {
    const int64_t e = b.act_expert[a], cols = b.w.cols;
    off = b.act_off[a];
    cnt = b.act_cnt[a];
    wb = static_cast<const uint8_t*>(b.w.w) + e * b.w_stride_bytes;
    sb = reinterpret_cast<const uint8_t*>(b.w.scales + e * b.scale_stride_elems);
    row_bytes = cols / 2;
    srow_bytes = cols / 16;
    S = int(cols / 1024);
    nsteps = (cnt + MT - 1) / MT * S;
  }
  __device__ __forceinline__ const uint8_t* stage(int j) const { return smem + (j % ST) * C::stage; }
  // Weights and scales of 1024-column step s into stage st.
  __device__ __forceinline__ void copy_ws(uint8_t* st, int s) const {
#pragma unroll
    for (int k = 0; k < R; ++k) {  // W·R·32 copies over W·32 threads
      const int i = int(threadIdx.x) + k * C::threads, r = i >> 5, c = i & 31;
      const int64_t row = min(tile0 + r, nrows - 1);  // a partial last tile re-reads the last row
      cp_async16(st + i * 16, wb + row * row_bytes + int64_t(s) * 512 + c * 16);
    }
    for (int i = int(threadIdx.x); i < C::rows * 4; i += C::threads) {
      const int r = i >> 2, c = i & 3;
      const int64_t row = min(tile0 + r, nrows - 1);
      cp_async16(st + C::w_bytes + i * 16, sb + row * srow_bytes + int64_t(s) * 64 + c * 16);
    }
  }
  // x of step s for the tile's tokens, token m's row at xr[m] (issue_at; issue() keeps its own x loop,
  // which looks in_row up per copy: hoisting it changed the staged configs' registers as swept).
  __device__ __forceinline__ void copy_x(uint8_t* st, int s, const float* const (&xr)[MT]) const {
    static_assert(256 % C::threads == 0, "a token's 256 copies split evenly over the block");
#pragma unroll
    for (int k = 0; k < MT * 256 / C::threads; ++k) {  // token m = k·threads / 256, a constant: xr stays in registers
      const int m = k * C::threads / 256, i = int(threadIdx.x) + k * C::threads, ch = (i >> 3) & 31, q = i & 7;
      cp_async16(st + C::w_bytes + C::s_bytes + m * 4096 + ch * 128 + ((q ^ (ch & 7)) * 16),
                 xr[m] + int64_t(s) * 1024 + ch * 32 + q * 4);
    }
  }
  // The x rows of token tile t (a short last tile repeats its last token).
  __device__ __forceinline__ void tile_rows(int t, const float* (&xr)[MT]) const {
    const int mc = min(MT, cnt - t * MT);
#pragma unroll
    for (int m = 0; m < MT; ++m) xr[m] = x + int64_t(in_row[off + t * MT + min(m, mc - 1)]) * ldx;
  }
  __device__ __forceinline__ void issue(int j) const {
    if (j < nsteps) {
      uint8_t* st = smem + (j % ST) * C::stage;
      const int t = j / S, s = j % S;
      copy_ws(st, s);
      const int mc = min(MT, cnt - t * MT);
      for (int i = int(threadIdx.x); i < MT * 256; i += C::threads) {
        const int m = i >> 8, ch = (i >> 3) & 31, q = i & 7;
        const int jj = off + t * MT + min(m, mc - 1);
        const float* src = x + int64_t(in_row[jj]) * ldx + int64_t(s) * 1024 + ch * 32 + q * 4;
        cp_async16(st + C::w_bytes + C::s_bytes + m * 4096 + ch * 128 + ((q ^ (ch & 7)) * 16), src);
      }
    }
    cp_async_commit();  // empty groups too, so wait_group<ST − 2> always means "step j has landed"
  }
  // issue(j) for a caller that tracks step j's column step s and its tile's x rows: no integer
  // division and no in_row load a step (the lean kernel).
  __device__ __forceinline__ void issue_at(int j, int s, const float* const (&xr)[MT]) const {
    if (j < nsteps) {
      uint8_t* st = smem + (j % ST) * C::stage;
      copy_ws(st, s);
      copy_x(st, s, xr);
    }
    cp_async_commit();  // empty groups too, so wait_group<ST − 2> always means "step j has landed"
  }
};

// grid (ceil(rows / (W·R)), max_active); block W warps; dynamic shared memory Staged::smem.
template <int W, int R, int MT, int ST, int MINB>
__global__ void __launch_bounds__(W * 32, MINB) expert_kernel_staged(ExpertBatch b, const float* __restrict__ x, int64_t ldx,
                                                             float* y, int64_t ldy, int ep) {
  using C = Staged<W, R, MT, ST>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int a = int(blockIdx.y);
  if (a >= *b.n_active) return;
  const StageLoader<W, R, MT, ST> ld(smem, b, a, x, ldx);
  const int64_t tile0 = ld.tile0, nrows = ld.nrows;
  const int off = ld.off, cnt = ld.cnt, S = ld.S, nsteps = ld.nsteps;
#pragma unroll
  for (int j = 0; j < ST - 1; ++j) ld.issue(j);

  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int64_t row0 = tile0 + warp * R;
  float acc[MT][R];
#pragma unroll 1
  for (int j = 0; j < nsteps; ++j) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // step j visible to all; everyone is done with step j − 1's stage
    ld.issue(j + ST - 1);  // into step j − 1's stage
    const uint8_t* st = ld.stage(j);
    const int t = j / S, s = j % S;
    const int mc = min(MT, cnt - t * MT);
    if (s == 0)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    uint4 wv[R];
    float sc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wv[r] = *reinterpret_cast<const uint4*>(st + (warp * R + r) * 512 + lane * 16);
      sc[r] = bf16_f(*reinterpret_cast<const uint16_t*>(st + C::w_bytes + (warp * R + r) * 64 + lane * 2));
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= mc) break;
      const float4* xp = reinterpret_cast<const float4*>(st + C::w_bytes + C::s_bytes + m * 4096 + lane * 128);
      // As warp_dot: x · 2^80 and Σx of the group, ascending.
      float xv[32], xsum = 0.0f;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float4 v = xp[q ^ (lane & 7)];
        xsum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(xsum, v.x), v.y), v.z), v.w);
        xv[4 * q] = __fmul_rn(v.x, 0x1p80f);
        xv[4 * q + 1] = __fmul_rn(v.y, 0x1p80f);
        xv[4 * q + 2] = __fmul_rn(v.z, 0x1p80f);
        xv[4 * q + 3] = __fmul_rn(v.w, 0x1p80f);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t qw[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
        float g = 0.0f;  // Σ n·x, the nibble as the denormal n·2^-149 (see warp_dot)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t lo = qw[q] & 0x0F0F0F0Fu, hi = (qw[q] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            g = fmaf(__uint_as_float(__byte_perm(lo, 0u, 0x4440u + k)), xv[8 * q + 2 * k], g);
            g = fmaf(__uint_as_float(__byte_perm(hi, 0u, 0x4440u + k)), xv[8 * q + 2 * k + 1], g);
          }
        }
        const float gv = __fsub_rn(__fmul_rn(g, 0x1p69f), __fmul_rn(8.0f, xsum));
        acc[m][r] = fmaf(sc[r], gv, acc[m][r]);
      }
    }
    if (s == S - 1) {
      float* ys[MT];
#pragma unroll
      for (int m = 0; m < MT; ++m) ys[m] = y + int64_t(b.out_row[off + t * MT + min(m, mc - 1)]) * ldy;
      finish<R, MT>(acc, mc, row0, nrows, ys, ep, lane);  // rows ≥ nrows are skipped by store()
    }
  }
}

// ---- Lean staged INT4 expert kernel (configs 16…) ---------------------------------------------------
// The staged kernel spends ≈ 3 issued instructions a weight and token: PRMT + FFMA a weight, 3 integer
// ops a word to split even/odd nibbles, and per (token, chunk) 8 LDS + 32 FMUL + 32 FADD of x prep
// shared by only R rows. Same copies and the very same bits, fewer instructions:
//  - unpack by mask: nibble t of a word, masked in place (w & 0xF << 4t), is the float n·2^(4t − 149)
//    — a bit pattern below 2^24 reads as pattern·2^-149 whether it lands on the denormal or the first
//    normal binade. Nibbles 6 and 7 come from w >> 8 (bits 16–23). x of that column is prescaled by
//    2^(80 − p) (p = the nibble's bit position), so every product is n·x·2^-69, the same exact real the
//    FFMA of the staged kernel rounds: the chain g is bit-identical. 8 LOP3 + 1 SHF a word, not 11.
//  - the correction g·2^69 − 8·Σx as one FFMA: g·2^69 is exact (a power-of-two scale), so the single
//    rounding equals __fsub_rn(__fmul_rn(g, 2^69), 8·Σx).
//  - a row's weights are read from shared memory when the row is computed, so R = 16 (x prep shared by
//    twice the rows) fits without spilling; the step's tile and x rows are tracked, not divided out.
//  - MT = 2: both tokens of a tile use each unpacked weight; a one-token tile runs the one-token body.
// Same bits while every |x| < 2^48 (beyond it the staged kernel's x·2^80 overflows to inf, the lean
// one's x·2^60 not always); the sweep and ConfigsPartialTiles assert config 0's bits.

// 2^(80 − p) for nibble t of a word, p its bit position after the mask (t ≥ 6 come from w >> 8).
__device__ __forceinline__ constexpr float lean_xscale(int t) {
  return t == 0 ? 0x1p80f : t == 1 ? 0x1p76f : t == 2 ? 0x1p72f : t == 3 ? 0x1p68f : t == 4 ? 0x1p64f : t == 5 ? 0x1p60f
         : t == 6 ? 0x1p64f : 0x1p60f;
}

// acc[m][r] += scale · Σ_group (n − 8)·x for the T (≤ MT) tokens of this step, rows warp·R … + R − 1.
template <int W, int R, int MT, int ST, int T>
__device__ __forceinline__ void lean_step(const uint8_t* st, int warp, int lane, float (&acc)[MT][R]) {
  using C = Staged<W, R, MT, ST>;
  float xv[T][32], x8[T];
#pragma unroll
  for (int m = 0; m < T; ++m) {
    const float4* xp = reinterpret_cast<const float4*>(st + C::w_bytes + C::s_bytes + m * 4096 + lane * 128);
    float xsum = 0.0f;  // Σx of the group, ascending (as warp_dot)
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float4 v = xp[q ^ (lane & 7)];
      xsum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(xsum, v.x), v.y), v.z), v.w);
      const int t = (4 * q) & 7;  // column 4q + i is nibble t + i of its word
      xv[m][4 * q] = __fmul_rn(v.x, lean_xscale(t));
      xv[m][4 * q + 1] = __fmul_rn(v.y, lean_xscale(t + 1));
      xv[m][4 * q + 2] = __fmul_rn(v.z, lean_xscale(t + 2));
      xv[m][4 * q + 3] = __fmul_rn(v.w, lean_xscale(t + 3));
    }
    x8[m] = __fmul_rn(8.0f, xsum);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = warp * R + r;
    const uint4 wv = *reinterpret_cast<const uint4*>(st + row * 512 + lane * 16);
    const float sc = bf16_f(*reinterpret_cast<const uint16_t*>(st + C::w_bytes + row * 64 + lane * 2));
    const uint32_t qw[4] = {wv.x, wv.y, wv.z, wv.w};
    float g[T];
#pragma unroll
    for (int m = 0; m < T; ++m) g[m] = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t w = qw[q], h = w >> 8;
      const float f[8] = {__uint_as_float(w & 0xFu),     __uint_as_float(w & 0xF0u),     __uint_as_float(w & 0xF00u),
                          __uint_as_float(w & 0xF000u),  __uint_as_float(w & 0xF0000u),  __uint_as_float(w & 0xF00000u),
                          __uint_as_float(h & 0xF0000u), __uint_as_float(h & 0xF00000u)};
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int m = 0; m < T; ++m) g[m] = fmaf(f[t], xv[m][8 * q + t], g[m]);  // columns ascending
    }
#pragma unroll
    for (int m = 0; m < T; ++m) acc[m][r] = fmaf(sc, fmaf(g[m], 0x1p69f, -x8[m]), acc[m][r]);
  }
}

// grid (ceil(rows / (W·R)), max_active); block W warps; dynamic shared memory Staged::smem. The
// schedule and epilogue of expert_kernel_staged; only the per-step arithmetic differs (lean_step).
template <int W, int R, int MT, int ST, int MINB>
__global__ void __launch_bounds__(W * 32, MINB) expert_kernel_lean(ExpertBatch b, const float* __restrict__ x, int64_t ldx,
                                                           float* y, int64_t ldy, int ep) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int a = int(blockIdx.y);
  if (a >= *b.n_active) return;
  const StageLoader<W, R, MT, ST> ld(smem, b, a, x, ldx);
  // Issue side: step ji, its column step si and token tile ti, the tile's x rows (loaded once a tile).
  int ji = 0, si = 0, ti = 0;
  const float* xr[MT];
  ld.tile_rows(0, xr);
  auto issue_next = [&] {
    ld.issue_at(ji, si, xr);
    ++ji;
    if (++si == ld.S) {
      si = 0;
      if (++ti * MT < ld.cnt) ld.tile_rows(ti, xr);
    }
  };
#pragma unroll
  for (int j = 0; j < ST - 1; ++j) issue_next();
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int64_t row0 = ld.tile0 + warp * R;
  float acc[MT][R];
  int t = 0, s = 0;  // compute side: token tile and column step of step j
#pragma unroll 1
  for (int j = 0; j < ld.nsteps; ++j) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // step j visible to all; everyone is done with step j − 1's stage
    issue_next();     // step j + ST − 1, into step j − 1's stage
    const uint8_t* st = ld.stage(j);
    const int mc = min(MT, ld.cnt - t * MT);
    if (s == 0)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    if constexpr (MT == 1) {
      lean_step<W, R, MT, ST, 1>(st, warp, lane, acc);
    } else {
      static_assert(MT == 2, "lean tiles hold one or two tokens");
      if (mc == 2)
        lean_step<W, R, MT, ST, 2>(st, warp, lane, acc);
      else
        lean_step<W, R, MT, ST, 1>(st, warp, lane, acc);
    }
    if (s == ld.S - 1) {
      float* ys[MT];
#pragma unroll
      for (int m = 0; m < MT; ++m) ys[m] = y + int64_t(b.out_row[ld.off + t * MT + min(m, mc - 1)]) * ldy;
      finish<R, MT>(acc, mc, row0, ld.nrows, ys, ep, lane);  // rows ≥ nrows are skipped by store()
    }
    if (++s == ld.S) {
      s = 0;
      ++t;
    }
  }
}

void check_shape(const DevMatrix& w, const float* x, int64_t ldx, const char* what) {
  const int64_t unit = w.int4 ? 32 : 8;
  if (w.cols % unit != 0) fail("CUDA ", what, ": ", w.cols, " inputs is not a multiple of ", unit, " (", w.int4 ? "INT4 group" : "16-byte bf16 chunk", ")");
  if (ldx % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) fail("CUDA ", what, ": activations are not 16-byte aligned");
}

// The INT4 expert configs: 0 is the register kernel, 1… the staged kernel <W warps, R rows a warp, MT
// tokens a tile, ST stages, MINB min blocks an SM for the register cap>. Blocks/SM = min(65536 regs /
// (regs × threads), 228 KB / shared memory); MINB is set to the shared-memory bound (left free, ptxas
// took 120–160 registers and registers bound instead); weight bytes in flight an SM ≈ blocks × (ST − 1) × W·R·576 B (≈ 30 KB keeps 4.5 TB/s busy by
// Little's law at ~0.9 µs loaded latency; more covers the block start-up and the tail). The
// ConfigSweep test prints the runtime's registers, spills and occupancy beside its timings.
struct StagedConfig {
  int W, R, MT, ST, MINB;  // MINB: __launch_bounds__ min blocks an SM, registers ≤ 65536 / (MINB · 32·W)
  int V = 0;               // 0: expert_kernel_staged, 1: expert_kernel_lean (same bits, fewer instructions)
};
constexpr StagedConfig kStaged[] = {
    // W  R MT ST MINB     blocks/SM (by shared memory or MINB's register cap) → weight KB in flight an SM
    {4, 8, 1, 2, 4},   // 1: stage 22 KB; 4 blocks (≤ 128 regs) → 74 KB
    {4, 8, 1, 3, 3},   // 2: 3 blocks (smem 66 KB) → 110 KB
    {4, 8, 1, 4, 2},   // 3: 2 blocks (smem 88 KB) → 110 KB
    {4, 4, 1, 3, 4},   // 4: stage 13 KB; 4 blocks (≤ 128 regs) → 74 KB; 16-row blocks: 2× the blocks, a shorter tail
    {4, 4, 1, 4, 4},   // 5: 4 blocks (smem 53 KB) → 110 KB
    {8, 4, 1, 3, 2},   // 6: 2 blocks (≤ 128 regs) → 74 KB, 16 warps
    {4, 4, 1, 3, 5},   // 7: 5 blocks (smem 40 KB, ≤ 102 regs) → 92 KB
    {8, 4, 1, 4, 2},   // 8: 2 blocks (smem 88 KB) → 110 KB
    {4, 4, 2, 4, 2},   // 9: ~196 regs → 2 blocks → 55 KB; token pairs share each weight stage
    {4, 2, 1, 6, 4},   // 10: 8-row blocks; 4 blocks (smem 52 KB) → 92 KB
    {2, 8, 1, 4, 4},   // 11: 4 blocks (smem 53 KB) → 110 KB, only 8 warps/SM
    {4, 2, 1, 4, 6},   // 12: 6 blocks (smem 34 KB, ≤ 85 regs) → 83 KB, x is half of each stage
    {2, 4, 1, 4, 6},   // 13: 64-thread blocks; 6 blocks (smem 34 KB) → 83 KB
    {8, 4, 1, 3, 3},   // 14: 3 blocks (smem 66 KB, ≤ 85 regs) → 110 KB, 24 warps
    {4, 8, 1, 2, 5},   // 15: 5 blocks (smem 44 KB, ≤ 102 regs: spills ~24 B) → 92 KB
    // Lean kernel (V = 1): mask unpack + fused correction, ≈ 2.7 → 2.5 issued instructions a weight.
    {4, 8, 1, 2, 4, 1},   // 16: config 1's tiles, lean arithmetic: the direct A/B against 1
    {4, 8, 1, 2, 5, 1},   // 17: config 15's 5 blocks (≤ 102 regs): spills 4 B where 15 spills 24 B
    {2, 16, 1, 2, 4, 1},  // 18: 16 rows a warp: x prep (73 instructions a token-chunk) shared by 16 rows; smem 45 KB
                          //     → 5 blocks if ≤ 204 regs (MINB 5 made ptxas stop at 168 and spill)
    {4, 16, 1, 2, 2, 1},  // 19: 64-row blocks (smem 82 KB → 2 blocks, 8 warps/SM): fewer x copies per weight
    {4, 8, 2, 2, 3, 1},   // 20: token pairs share each unpacked weight (experts with ≥ 2 rows; N ≥ 16)
    {2, 8, 2, 2, 6, 1},   // 21: pairs in 16-row blocks, 6 blocks (smem 34 KB, ≤ 170 regs) → 12 warps/SM
    {2, 16, 2, 2, 4, 1},  // 22: pairs × 16 rows a warp: both amortisations
    {8, 8, 1, 2, 2, 1},   // 23: 16's warps in 64-row blocks (smem 82 KB, 2 blocks, 16 warps/SM): half the x copies
    // Lean, 3 stages: a down matrix (K = 2048) is 2 column steps a block, so with 2 stages a block
    // waits for its first step uncovered; with 3 both steps are in flight from the start.
    {4, 8, 1, 3, 3, 1},   // 24: config 16 with 3 stages (smem 66 KB → 3 blocks)
    {4, 4, 1, 3, 5, 1},   // 25: 16-row blocks, 3 stages (smem 40 KB → 5 blocks, ≤ 102 regs)
    {2, 8, 1, 3, 5, 1},   // 26: 16-row blocks of 2 warps, 3 stages (smem 40 KB → 5 blocks)
};
constexpr int kExpertConfigs = 1 + int(sizeof(kStaged) / sizeof(kStaged[0]));

using ExpertKernel = void (*)(ExpertBatch, const float*, int64_t, float*, int64_t, int);
template <int W, int R, int MT, int ST, int MINB, int V>
constexpr ExpertKernel staged_kernel() {
  if constexpr (V == 0)
    return expert_kernel_staged<W, R, MT, ST, MINB>;
  else
    return expert_kernel_lean<W, R, MT, ST, MINB>;
}

template <int W, int R, int MT, int ST, int MINB, int V>
void launch_staged(const ExpertBatch& b, const float* x, int64_t ldx, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  using C = Staged<W, R, MT, ST>;
  constexpr ExpertKernel k = staged_kernel<W, R, MT, ST, MINB, V>();
  static const bool attr_set = [] {  // above 48 KB of dynamic shared memory needs the opt-in
    check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem), "expert_kernel_staged shared memory");
    return true;
  }();
  (void)attr_set;
  const unsigned gx = unsigned((b.w.rows + C::rows - 1) / C::rows);
  k<<<dim3(gx, unsigned(b.max_active)), dim3(C::threads), C::smem, s>>>(b, x, ldx, y, ldy, int(ep));
}

// Calls f(W, R, MT, ST, MINB, V as integral constants) for staged config `cfg` (1 …).
template <class F>
void with_staged(int cfg, F&& f) {
#define KD_STAGED(i)                                                                                              \
  case i:                                                                                                         \
    f(std::integral_constant<int, kStaged[i - 1].W>{}, std::integral_constant<int, kStaged[i - 1].R>{},           \
      std::integral_constant<int, kStaged[i - 1].MT>{}, std::integral_constant<int, kStaged[i - 1].ST>{},         \
      std::integral_constant<int, kStaged[i - 1].MINB>{}, std::integral_constant<int, kStaged[i - 1].V>{});     \
    return;
  switch (cfg) {
    KD_STAGED(1) KD_STAGED(2) KD_STAGED(3) KD_STAGED(4) KD_STAGED(5) KD_STAGED(6) KD_STAGED(7)
    KD_STAGED(8) KD_STAGED(9) KD_STAGED(10) KD_STAGED(11) KD_STAGED(12) KD_STAGED(13) KD_STAGED(14)
    KD_STAGED(15) KD_STAGED(16) KD_STAGED(17) KD_STAGED(18) KD_STAGED(19) KD_STAGED(20) KD_STAGED(21)
    KD_STAGED(22) KD_STAGED(23) KD_STAGED(24) KD_STAGED(25) KD_STAGED(26)
    default:
      fail("CUDA expert config ", cfg, " does not exist (0 … ", kExpertConfigs - 1, ")");
  }
#undef KD_STAGED
}
static_assert(kExpertConfigs == 27, "with_staged lists every staged config");

int g_expert_config = -2;  // -2: not read yet (KDTREE_CUDA_EXPERT_CONFIG); -1: by matrix; else forced

}  // namespace

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
      linear_kernel<INT4, R, MT, kWarps><<<grid, block, 0, s>>>(w, x, ldx, M, y, ldy, int(ep), m_fast);
    else
      linear_kernel<INT4, R, MT, 1><<<grid, block, 0, s>>>(w, x, ldx, M, y, ldy, int(ep), m_fast);
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

void linear(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  if (M <= 0 || w.rows <= 0) return;
  check_shape(w, x, ldx, "linear");
  if (linear_mma(w, x, ldx, M, y, ldy, ep, s)) return;  // tensor cores when switched on (mma.cu)
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
  if (b.max_active <= 0) return;
  check_shape(b.w, x, ldx, "expert_linear");
  const int forced = expert_config();
  if (b.w.int4 && forced < 0 && expert_imma_enabled()) {  // integer tensor cores (expert_imma.cu)
    expert_linear_imma(b, x, ldx, y, ldy, ep, s);
    return;
  }
  const dim3 block(kWarps * 32);
  const unsigned gy = unsigned(b.max_active);
  // One token per expert (decode) needs no M-tile; wider tiles share each weight load across rows.
  const bool single = b.max_rows_per_expert <= 1;
  // By the matrix and the batch (every lean config writes the same bits): token pairs pay off once
  // most experts serve two or more rows — the sweep's crossover is between 17 and 33 rows for
  // gate/up, between 33 and 128 for down.
  const bool down = b.w.rows > b.w.cols;
  const int64_t n = b.max_rows_per_expert;
  const int cfg = forced >= 0 ? forced
                  : down      ? (n >= kWideDownRows ? kExpertConfigWide : kExpertConfigDown)
                              : (n >= kWideGateUpRows ? kExpertConfigWide : kExpertConfigGateUp);
  if (b.w.int4 && cfg != 0 && expert_config_fits(b)) {
    with_staged(cfg, [&](auto w, auto r, auto mt, auto st, auto mb, auto v) {
      launch_staged<decltype(w)::value, decltype(r)::value, decltype(mt)::value, decltype(st)::value, decltype(mb)::value,
                    decltype(v)::value>(b, x, ldx, y, ldy, ep, s);
    });
  } else if (b.w.int4) {
    // INT4 (config 0): 8 rows a warp, one token row at a time (an expert's later rows re-read its weights from
    // L2). Measured on k2-slice against 4 rows a warp / M-tiles of 4: decode 3.92 → 3.53 ms a token,
    // verify of 16 nodes 41.1 → 30.9 ms. Token rows in pairs (MT = 2, each weight load serving
    // both) was measured too: R = 8 already uses 243 registers a thread, MT = 2 spilled (396 bytes
    // even without the register double buffer) and verify got slower at every N (N = 1: 4.48 →
    // 5.67 ms, N = 16: 25.9 → 32.9 ms). R only decides which rows a warp owns, never the order a
    // row is reduced in, so rows stay bit-identical whatever the batch.
    constexpr int R = 8;
    const unsigned gx = unsigned((b.w.rows + kWarps * R - 1) / (kWarps * R));
    expert_kernel<true, R, 1><<<dim3(gx, gy), block, 0, s>>>(b, x, ldx, y, ldy, int(ep));
  } else {
    constexpr int R = 2;
    const unsigned gx = unsigned((b.w.rows + kWarps * R - 1) / (kWarps * R));
    if (single)
      expert_kernel<false, R, 1><<<dim3(gx, gy), block, 0, s>>>(b, x, ldx, y, ldy, int(ep));
    else
      expert_kernel<false, R, 4><<<dim3(gx, gy), block, 0, s>>>(b, x, ldx, y, ldy, int(ep));
  }
  check_launch("expert_linear");
}

int expert_config_count() { return kExpertConfigs; }

int expert_config() {
  if (g_expert_config < -1) g_expert_config = env_index("KDTREE_CUDA_EXPERT_CONFIG", kExpertConfigs);
  return g_expert_config;
}

void set_expert_config(int cfg) {
  if (cfg < -1 || cfg >= kExpertConfigs) fail("CUDA expert config ", cfg, " does not exist (0 … ", kExpertConfigs - 1, ")");
  g_expert_config = cfg < 0 ? -1 : cfg;
}

bool expert_config_fits(const ExpertBatch& b) {
  return b.w.int4 && b.w.cols % 1024 == 0 && b.w_stride_bytes % 16 == 0 && (b.scale_stride_elems * 2) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(b.w.w) % 16 == 0 && reinterpret_cast<uintptr_t>(b.w.scales) % 16 == 0;
}

std::string expert_config_describe(int cfg) {
  if (cfg == 0) {
    cudaFuncAttributes fa{};
    check(cudaFuncGetAttributes(&fa, expert_kernel<true, 8, 1>), "cudaFuncGetAttributes");
    int blocks = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, expert_kernel<true, 8, 1>, kWarps * 32, 0), "occupancy");
    char buf[160];
    std::snprintf(buf, sizeof buf, "register kernel W%d R8 MT1: %d regs, %d spill B, %d blk/SM, %.0f KB w in flight/SM", kWarps,
                  fa.numRegs, int(fa.localSizeBytes), blocks, blocks * kWarps * 8 * 32 * 18 / 1024.0);
    return buf;
  }
  std::string out;
  with_staged(cfg, [&](auto w, auto r, auto mt, auto st, auto mb, auto v) {
    constexpr int W = decltype(w)::value, R = decltype(r)::value, MT = decltype(mt)::value, ST = decltype(st)::value,
                  MINB = decltype(mb)::value, V = decltype(v)::value;
    using C = Staged<W, R, MT, ST>;
    constexpr ExpertKernel k = staged_kernel<W, R, MT, ST, MINB, V>();
    cudaFuncAttributes fa{};
    check(cudaFuncGetAttributes(&fa, k), "cudaFuncGetAttributes");
    check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem), "expert_kernel_staged shared memory");
    int blocks = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, C::threads, C::smem), "occupancy");
    const double inflight = double(blocks) * (ST - 1) * (C::w_bytes + C::s_bytes) / 1024.0;
    char buf[160];
    std::snprintf(buf, sizeof buf, "%sW%d R%d MT%d ST%d min%d: %d regs, %d spill B, smem %.0f KB, %d blk/SM, %.0f KB w in flight/SM",
                  V == 0 ? "" : "lean ", W, R, MT, ST, MINB, fa.numRegs, int(fa.localSizeBytes), C::smem / 1024.0, blocks, inflight);
    out = buf;
  });
  return out;
}

}  // namespace kd::cuda
