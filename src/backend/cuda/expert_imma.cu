// INT4 g32 routed experts on the integer tensor cores (mma.sync m16n8k32, s8 × s8 → s32): the
// default path of cuda::expert_linear for INT4 experts (kernels.h: ExpertBatch::path). Its tile table
// is kernel_config.h's kImmaTiles.
//
// Why: the CUDA-core kernels (linear.cu) spend ≈ 2.5 issued instructions a weight and token (unpack
// + one FFMA a weight), which makes them issue-bound at ≈ 80 % of the issue slots for the k2-slice
// verify — their time follows the SM clock, not the memory. Here a weight costs ≈ 0.4 instructions
// of unpacking (8 nibbles → two s8x4 registers in 3 integer ops) and one m16n8k32 MMA serves a whole
// group of 32 columns × 16 weight rows × 2 tokens; the per-group epilogue (≈ 8 instructions a lane for
// 16 rows) is what is left.
//
// Exact integer products. Activations are split once per row (digits_kernel) into block floating
// point: for each group of 32 columns, e = the exponent with max|x| < 2^e, x_int = rint(x · 2^(30 − e))
// (|x_int| ≤ 2^30: 30 bits relative to the group's largest value, more than fp32's 24 for every
// element within 2^6 of it), written as four balanced base-256 digits d0 … d3 (s8), x_int =
// d0 + 2^8 d1 + 2^16 d2 + 2^24 d3. The weight nibble n becomes the s8 16·(n − 8) (the nibble moved to
// the byte's high half, its top bit flipped: exact). One MMA gives, per weight row and digit, the
// exact integer Σ 16(n − 8)·d over the group (|·| ≤ 2^19); a lane then holds two digits of one token
// and forms low = c(d0) + 256 c(d1) or high = c(d2) + 256 c(d3) (exact in int32), converts it to fp32
// and adds scale · unit × it to its fp32 accumulator (unit = 2^(e − 34), the 2^-30 of x_int and the
// 16 of the weights; scale · unit is exact). After the last group y = high · 2^16 + low, one
// rounding. Error: x's rounding at 2^-31 of its group's maximum, plus fp32 accumulation over groups
// (the parity test checks it against fp64 and a plain fp32 loop). Non-finite x makes the group's
// unit NaN, so the outputs that read it are NaN.
//
// MMA orientation (PTX fragment layouts of m16n8k32 .s8): A = 16 weight rows × the group's 32
// columns, B = the group × 8 columns = 2 tokens × 4 digits, D = 16 × 8 int32 (a pass of MP token pairs
// runs MP MMAs on each unpacked A). The k positions of the
// MMA are a fixed permutation of the group's columns, the same for A and B: lane (g = lane / 4,
// t = lane % 4) holds word t of its rows' group (columns 8t … 8t + 7); its even-nibble byte vector
// (columns 8t, 8t + 2, 8t + 4, 8t + 6) is k = 4t … 4t + 3, its odd one k = 16 + 4t …; the digit
// layout below stores each token's digits in exactly that order, so B is one 8-byte load a lane.
// Weights reach the A fragments with ldmatrix from a swizzled shared-memory stage (16-byte unit u of
// row r at unit u ^ (r & 7): the 8 rows of an ldmatrix phase hit 8 different bank groups).
//
// Row invariance: an output's value depends on its weight row, its own token's digits and the group
// order only — integer MMAs are exact, so neither the other token of a pair nor the tile nor the
// block configuration can change a bit (tests/gpu/test_cuda_expert_imma.cpp and test_cuda_expert_sweep.cpp
// assert it bitwise). Measured steps and the sweep behind the configs and the rule: docs/perf.md.
#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <type_traits>

namespace kd::cuda {

namespace {

constexpr int kDigits = 4;                  // base-256 digits an activation
constexpr int kGroupBytes = kDigits * 32;   // one row's digits of one group: [digit][32 columns]
constexpr int kMinExp = -60;                // groups with max|x| < 2^-60 are scaled as if it were 2^-60

// x_int = rint(x · 2^(30 − e)) → byte (digit) layout of one group: column c = 8t + 2i + h sits at
// byte 8t + 4h + i of each digit's 32 bytes (lane t's B registers: h = 0 first, then h = 1).
__host__ __device__ constexpr int digit_pos(int c) { return 8 * (c >> 3) + 4 * (c & 1) + ((c & 7) >> 1); }

// Units a row: groups rounded up to 8, so each row's bf16 units start 16-byte aligned.
__host__ __device__ constexpr int64_t unit_pitch(int64_t groups) { return (groups + 7) / 8 * 8; }

// One warp per (row, group), lane = column. q [rows][groups][4][32] s8, unit [rows][unit_pitch] bf16
// (2^(e − 34): a power of two, exact in bf16).
__global__ void digits_kernel(const float* __restrict__ x, int64_t ldx, int64_t rows, int64_t groups,
                              int8_t* __restrict__ q, uint16_t* __restrict__ unit) {
  pdl_wait();
  pdl_trigger();
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (w >= rows * groups) return;  // whole warps: w is the same for the 32 lanes
  const int lane = int(threadIdx.x) & 31;
  const int64_t r = w / groups, G = w % groups;
  const float v = x[r * ldx + G * 32 + lane];
  const bool bad = __any_sync(0xffffffffu, !isfinite(v));
  const float m = warp_max(fabsf(v));
  int e = kMinExp;
  if (!bad && m > 0.0f) {
    frexpf(m, &e);  // m = f · 2^e, f ∈ [0.5, 1): m < 2^e
    e = max(e, kMinExp);
  }
  // 2^(30 − e) and 2^(e − 34) are normal for e ∈ [−60, 128]; v · 2^(30 − e) is exact and < 2^30. The
  // kernel multiplies the unit by a weight scale in bf16 (exact, a power of two) — normal for scales
  // ≥ 2^-32.
  const float scale = __int_as_float((127 + 30 - e) << 23);
  const int32_t xi = bad ? 0 : __float2int_rn(__fmul_rn(v, scale));
  // Balanced digits: d0 = the low byte read as s8, then the rest shifted down (exact: divisible).
  const int32_t d0 = int32_t(int8_t(xi & 0xff)), r1 = (xi - d0) >> 8;
  const int32_t d1 = int32_t(int8_t(r1 & 0xff)), r2 = (r1 - d1) >> 8;
  const int32_t d2 = int32_t(int8_t(r2 & 0xff)), d3 = (r2 - d2) >> 8;  // |d3| ≤ 65
  int8_t* out = q + w * kGroupBytes + digit_pos(lane);
  out[0] = int8_t(d0);
  out[32] = int8_t(d1);
  out[64] = int8_t(d2);
  out[96] = int8_t(d3);
  if (lane == 0) unit[r * unit_pitch(groups) + G] = bad ? uint16_t(0x7fc0) : uint16_t(((127 + e - 34) << 23) >> 16);
}

// Block of WR × WT warps: warp (wr, wt) owns RT tiles of 16 weight rows (row warp wr) and MP token
// pairs (token warp wt) of each pass, so a block covers WR·16·RT weight rows × T = 2·MP·WT tokens. A
// step is SG groups of columns (SG·32: 1024 for the decode tiles, 256 for the prefill tiles, whose
// token stage would not fit at 1024); ST shared-memory stages of one step each: weights [rows][SG ×
// 16 B] swizzled, scales [rows][s_pitch] (SG bf16; the 80-byte pitch of 32 groups puts the 8 rows a
// lane group reads on different banks, 16 bytes do it for 8), the pass's digits [T tokens][SG
// groups][128 B] and units [T][SG] bf16. Each unpacked weight fragment serves MP MMAs; each staged
// digit row serves WR warps — the two reuses a wide batch (prefill, large trees) needs, where a pass
// of few tokens re-streamed the expert's weights from L2 for every 4 tokens (docs/perf.md).
template <int WR, int WT, int RT, int ST, int MP, int SG>
struct Imma {
  static_assert(SG == 8 || SG == 32, "steps of 8 or 32 groups (the weight swizzle permutes runs of 8 units)");
  static_assert(ST >= 2, "double buffering at least");
  static constexpr int wr = WR, wt = WT, rt = RT, st = ST, mp = MP, sg = SG;
  static constexpr int W = WR * WT, threads = W * 32;
  static constexpr int rows = WR * 16 * RT, T = WT * 2 * MP;
  static constexpr int w_pitch = SG * 16, w_bytes = rows * w_pitch;
  static constexpr int s_pitch = SG == 32 ? 80 : 2 * SG, s_bytes = rows * s_pitch;
  static constexpr int x_pitch = SG * kGroupBytes, x_bytes = T * x_pitch, u_bytes = T * SG * 2;
  static constexpr int stage = w_bytes + s_bytes + x_bytes + u_bytes, smem = ST * stage;
  // Copies a thread issues a step (16 bytes each): unit tid % SG of rows tid / SG + k · threads / SG
  // (k < wk); scale units i = tid + k · threads (k < sk); digit pieces i = tid + k · threads of the
  // pass's T × xp pieces (k < xk: token i / xp, piece i % xp); unit pieces: thread tid < T · SG / 8.
  static constexpr int wk = rows * SG / threads, su = SG / 8, sk = (rows * su + threads - 1) / threads;
  static constexpr int xp = SG * 8, xk = T * xp / threads, up = T * su;
  static_assert(threads % SG == 0 && rows * SG % threads == 0, "whole weight rows a copy round");
  static_assert(T * xp % threads == 0 && up <= threads, "whole digit pieces a thread");
};

__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// The 8 nibbles of word w as two s8x4 vectors of 16·(n − 8): even nibbles (columns 8t, +2, +4, +6)
// and odd ones; the nibble moved to the byte's high half with its top bit flipped.
// (a & m) ^ f in one LOP3: m and f go in registers (one instruction takes one immediate only).
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t m, uint32_t f) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(r) : "r"(a), "r"(m), "r"(f));
  return r;
}
__device__ __forceinline__ uint32_t s8_even(uint32_t w, uint32_t m, uint32_t f) { return and_xor(w << 4, m, f); }
__device__ __forceinline__ uint32_t s8_odd(uint32_t w, uint32_t m, uint32_t f) { return and_xor(w, m, f); }
// Two bf16 products a · b (b a power of two: exact unless subnormal), as bf16x2.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
}

// The grid: (row tiles, active experts); a block loops over its expert's passes.
template <class C>
dim3 imma_grid(const ExpertBatch& b) {
  return dim3(unsigned((b.w.rows + C::rows - 1) / C::rows), unsigned(b.max_active));
}

// grid imma_grid; block W warps; dynamic shared memory Imma::smem.
template <int WR, int WT, int RT, int ST, int MP, int SG>
__global__ void __launch_bounds__(WR * WT * 32) expert_imma_kernel(ExpertBatch b, float* y, int64_t ldy, int ep) {
  using C = Imma<WR, WT, RT, ST, MP, SG>;
  constexpr int T = C::T;
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_wait();  // the active experts come from dispatch (common.cuh)
  pdl_trigger();
  const int64_t nrows = b.w.rows, groups = b.w.cols / 32;
  const int64_t tile = blockIdx.x;
  const int a = int(blockIdx.y);
  if (a >= *b.n_active) return;
  const int off = b.act_off[a], cnt = b.act_cnt[a];
  const int64_t e = b.act_expert[a];
  const int64_t tile0 = tile * C::rows;
  const uint8_t* wb = static_cast<const uint8_t*>(b.w.w) + e * b.w_stride_bytes;
  const uint16_t* sb = b.w.scales + e * b.scale_stride_elems;
  const int S = int((groups + SG - 1) / SG), nsteps = (cnt + T - 1) / T * S;
  // 16-byte scale copies need whole 8-group units and aligned rows; small models take plain loads.
  const bool scales16 = groups % 8 == 0 && (reinterpret_cast<uintptr_t>(sb) & 15) == 0;
  const int tid = int(threadIdx.x);

  const int lane = tid & 31, warp = tid >> 5;
  // Issue side (copy assignment: Imma). Addresses are set up once here, so a step costs a few
  // instructions a copy and no global load (the pass's digit rows are looked up once a pass).
  const int64_t rb = groups * 16;  // weight bytes a row
  const bool full_tile = tile0 + C::rows <= nrows;
  const int wu = tid % SG, wr0 = tid / SG;  // weight unit and first row of this thread's copies
  const uint8_t* wsrc = wb + min(tile0 + wr0, nrows - 1) * rb + wu * 16;  // row wr0, step 0
  const uint16_t* ssrc[C::sk];
#pragma unroll
  for (int k = 0; k < C::sk; ++k) {
    const int i = min(tid + k * C::threads, C::rows * C::su - 1);
    ssrc[k] = sb + min(tile0 + i / C::su, nrows - 1) * groups + (i % C::su) * 8;
  }
  int ip = 0, is = 0, imc = 0;  // issue side: pass, column step, tokens in the pass
  const int8_t* xsrc[C::xk];    // this thread's digit pieces of the pass (group 0; null: no token)
  const uint16_t* usrc = nullptr;
  auto pass_rows = [&] {
    imc = min(T, cnt - T * ip);
#pragma unroll
    for (int k = 0; k < C::xk; ++k) {
      const int i = tid + k * C::threads, m = i / C::xp;
      xsrc[k] = m < imc ? b.xq + int64_t(b.in_row[off + T * ip + m]) * groups * kGroupBytes + (i % C::xp) * 16 : nullptr;
    }
    const int um = tid / C::su;
    usrc = tid < C::up && um < imc ? b.xunit + int64_t(b.in_row[off + T * ip + um]) * unit_pitch(groups) + (tid % C::su) * 8 : nullptr;
  };
  if (nsteps > 0) pass_rows();
  // Step j (pass ip, column step is) into stage j % ST; then advance (ip, is).
  auto issue = [&](int j) {
    if (j < nsteps) {
      uint8_t* st = smem + (j % ST) * C::stage;
      const int s = is, ng = int(min(int64_t(SG), groups - SG * int64_t(s)));
      if (full_tile && ng == SG) {
        const uint8_t* src = wsrc + int64_t(s) * C::w_pitch;
#pragma unroll
        for (int k = 0; k < C::wk; ++k) {
          const int r = wr0 + k * (C::threads / SG);
          cp16(st + r * C::w_pitch + ((wu ^ (r & 7)) << 4), src + int64_t(k) * (C::threads / SG) * rb);
        }
      } else {
#pragma unroll
        for (int k = 0; k < C::wk; ++k) {
          const int r = wr0 + k * (C::threads / SG);  // a partial last tile re-reads the last row
          if (wu < ng)
            cp16(st + r * C::w_pitch + ((wu ^ (r & 7)) << 4), wb + min(tile0 + r, nrows - 1) * rb + (int64_t(s) * SG + wu) * 16);
        }
      }
      uint8_t* ss = st + C::w_bytes;
      if (scales16) {
#pragma unroll
        for (int k = 0; k < C::sk; ++k) {
          const int i = tid + k * C::threads;
          if (i < C::rows * C::su && (i % C::su) * 8 < ng) cp16(ss + (i / C::su) * C::s_pitch + (i % C::su) * 16, ssrc[k] + s * SG);
        }
      } else {  // small models: plain loads (cp.async needs 4-byte pieces)
        for (int i = tid; i < C::rows * ng; i += C::threads) {
          const int r = i / ng, gi = i % ng;
          reinterpret_cast<uint16_t*>(ss + r * C::s_pitch)[gi] = sb[min(tile0 + r, nrows - 1) * groups + s * SG + gi];
        }
      }
      uint8_t* xs = ss + C::s_bytes;
      uint8_t* us = xs + C::x_bytes;
#pragma unroll
      for (int k = 0; k < C::xk; ++k) {
        const int i = tid + k * C::threads;
        if (xsrc[k] != nullptr && (i % C::xp) / 8 < ng) cp16(xs + (i / C::xp) * C::x_pitch + (i % C::xp) * 16, xsrc[k] + int64_t(s) * C::x_pitch);
      }
      if (usrc != nullptr && (tid % C::su) * 8 < ng) cp16(us + tid * 16, usrc + int64_t(s) * SG);  // padded rows
      if (++is == S) {
        is = 0;
        ++ip;
        if (T * ip < cnt) pass_rows();
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");  // empty groups too: wait_group counts steps
  };
#pragma unroll
  for (int j = 0; j < ST - 1; ++j) issue(j);

  const int g = lane >> 2, t = lane & 3;
  const int wr = warp % WR, tb = (warp / WR) * 2 * MP;  // this warp's row tiles and first token of a pass
  float acc[RT][MP][2];
  int p = 0, s = 0;  // pass and column step of step j
#pragma unroll 1
  for (int j = 0; j < nsteps; ++j) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2) : "memory");
    __syncthreads();  // step j visible to all; everyone is done with step j − 1's stage
    issue(j + ST - 1);
    const uint8_t* st = smem + (j % ST) * C::stage;
    const int ng = int(min(int64_t(SG), groups - SG * int64_t(s))), mc = min(T, cnt - T * p);
    if (s == 0)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int q = 0; q < MP; ++q) acc[rt][q][0] = acc[rt][q][1] = 0.0f;
    // Pair q's B column g = token tb + 2q + g / 4, digit g % 4 (a missing token repeats the last one);
    // its C columns 2t, 2t + 1 = token tb + 2q + t / 2, digits 2(t % 2) and 2(t % 2) + 1.
    const uint8_t* xb[MP];
    const uint16_t* ub[MP];
#pragma unroll
    for (int q = 0; q < MP; ++q) {
      xb[q] = st + C::w_bytes + C::s_bytes + min(tb + 2 * q + (g >> 2), mc - 1) * C::x_pitch + (g & 3) * 32 + t * 8;
      ub[q] = reinterpret_cast<const uint16_t*>(st + C::w_bytes + C::s_bytes + C::x_bytes) + min(tb + 2 * q + (t >> 1), mc - 1) * SG;
    }
    const int pairs = max(0, min(MP, (mc - tb + 1) / 2));  // this warp's token pairs in the pass (warp-uniform)
    const uint32_t m4 = 0xf0f0f0f0u, f8 = 0x80808080u;
    // Groups gi and gi + 1 (the latter only if `second`): one ldmatrix and `pairs` MMAs a group per
    // 16-row tile; full: all MP pairs present (no branch in the unrolled loop: branches kept the
    // pairs of groups from interleaving, +19 % at MP = 1).
    auto pair = [&](int gi, bool second, auto full) {
      constexpr bool kFull = decltype(full)::value;
      uint2 b0[MP], b1[MP];
      uint32_t u[MP];  // units of groups gi, gi + 1 (bf16x2)
#pragma unroll
      for (int q = 0; q < MP; ++q) {
        b0[q] = *reinterpret_cast<const uint2*>(xb[q] + gi * kGroupBytes);
        b1[q] = *reinterpret_cast<const uint2*>(xb[q] + (gi + 1) * kGroupBytes);
        u[q] = *reinterpret_cast<const uint32_t*>(ub[q] + gi);
      }
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const int r0 = (wr * RT + rt) * 16;  // the tile's first row in the block
        // ldmatrix x4: lanes 8i … 8i + 7 address matrix i's rows: (rows 0–7 | 8–15) × (group gi | gi + 1).
        const int lr = r0 + (lane & 7) + ((lane >> 3) & 1) * 8, lu = gi + (lane >> 4);
        const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(st + lr * C::w_pitch + ((lu ^ (lr & 7)) << 4)));
        uint32_t w[4];  // word t of: row g group gi, row g + 8 group gi, row g group gi + 1, row g + 8 group gi + 1
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "r"(addr));
        const uint8_t* srow = st + C::w_bytes + (r0 + g) * C::s_pitch + gi * 2;
        const uint32_t s0 = *reinterpret_cast<const uint32_t*>(srow);                  // row g: groups gi, gi + 1
        const uint32_t s8 = *reinterpret_cast<const uint32_t*>(srow + 8 * C::s_pitch);  // row g + 8
        // One group: A from word t of rows g (wg) and g + 8 (wg8), B of pair q from bq[q]; `high`: the
        // group's scale · unit is the high bf16 half (group gi + 1).
        auto group = [&](uint32_t wg, uint32_t wg8, const uint2 (&bq)[MP], bool high) {
          const uint32_t fa[4] = {s8_even(wg, m4, f8), s8_even(wg8, m4, f8), s8_odd(wg, m4, f8), s8_odd(wg8, m4, f8)};
#pragma unroll
          for (int q = 0; q < MP; ++q) {
            if (!kFull && q >= pairs) break;
            const uint32_t sc0 = bf16x2_mul(s0, u[q]), sc8 = bf16x2_mul(s8, u[q]);  // rows g, g + 8
            int c[4];
            mma_s8(c, fa, bq[q].x, bq[q].y);
            acc[rt][q][0] = fmaf(high ? bf16_hi(sc0) : bf16_lo(sc0), __int2float_rn(c[0] + 256 * c[1]), acc[rt][q][0]);
            acc[rt][q][1] = fmaf(high ? bf16_hi(sc8) : bf16_lo(sc8), __int2float_rn(c[2] + 256 * c[3]), acc[rt][q][1]);
          }
        };
        group(w[0], w[1], b0, false);
        if (second) group(w[2], w[3], b1, true);
      }
    };
    if (pairs > 0) {
      if ((ng & 1) == 0 && pairs == MP) {  // every group count of K2, a full pass
#pragma unroll 4
        for (int gi = 0; gi < ng; gi += 2) pair(gi, true, std::true_type{});
      } else {
        for (int gi = 0; gi < ng; gi += 2) pair(gi, gi + 1 < ng, std::false_type{});
      }
    }
    if (s == S - 1) {
      // Lane t even holds token tb + 2q + t / 2's low part, lane t + 1 its high part: y = high · 2^16 + low.
#pragma unroll
      for (int q = 0; q < MP; ++q) {
        if (q >= pairs) break;
        const int m = tb + 2 * q + (t >> 1);
        const bool mine = (t & 1) == 0 && m < mc;
        float* yr = y + int64_t(b.out_row[off + T * p + min(m, mc - 1)]) * ldy;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float hi = __shfl_xor_sync(0xffffffffu, acc[rt][q][h], 1);
            const float v = fmaf(hi, 65536.0f, acc[rt][q][h]);  // meaningful in the even lanes
            const int64_t row = tile0 + (wr * RT + rt) * 16 + g + 8 * h;
            if (ep == int(Epilogue::swiglu)) {
              const float up = __shfl_xor_sync(0xffffffffu, v, 4);  // row ^ 1 sits 4 lanes away
              if (mine && (g & 1) == 0 && row + 1 < nrows) yr[row / 2] = v / (1.0f + expf(-v)) * up;
            } else if (mine && row < nrows) {
              yr[row] = ep == int(Epilogue::add) ? __fadd_rn(yr[row], v) : v;
            }
          }
      }
      s = 0;
      ++p;
    } else {
      ++s;
    }
  }
}

// One kImmaTiles entry as a type: its kernel and its shared-memory plan.
template <int WR, int WT, int RT, int ST, int MP, int SG>
struct Tile {
  using C = Imma<WR, WT, RT, ST, MP, SG>;
  static constexpr auto kernel = expert_imma_kernel<WR, WT, RT, ST, MP, SG>;
};

// Calls f(Tile<…>{}) for kImmaTiles[tile] (kernel_config.h).
template <class F>
void with_imma(int tile, F&& f) {
#define KD_IMMA(i)                                                                                                   \
  case i:                                                                                                            \
    f(Tile<kImmaTiles[i].WR, kImmaTiles[i].WT, kImmaTiles[i].RT, kImmaTiles[i].ST, kImmaTiles[i].MP, kImmaTiles[i].SG>{});                     \
    return;
  switch (tile) {
    KD_IMMA(0) KD_IMMA(1) KD_IMMA(2)
    default:
      fail("CUDA expert IMMA tile ", tile, " does not exist (0 … ", kImmaTileCount - 1, ")");
  }
#undef KD_IMMA
}
static_assert(kImmaTileCount == 3, "with_imma lists every kImmaTiles entry");

}  // namespace

int64_t expert_digit_bytes(int64_t rows, int64_t cols) { return rows * (cols / 32) * kGroupBytes; }
int64_t expert_digit_units(int64_t rows, int64_t cols) { return rows * unit_pitch(cols / 32); }

void expert_linear_imma(const ExpertBatch& b, const float* x, int64_t ldx, float* y, int64_t ldy, Epilogue ep, cudaStream_t s) {
  const int64_t groups = b.w.cols / 32;
  if (b.xq == nullptr || b.xunit == nullptr)
    fail("CUDA expert_linear (IMMA): the batch has no digit scratch (ExpertBatch::xq / xunit, ", "expert_digit_bytes)");
  if (reinterpret_cast<uintptr_t>(b.xq) % 16 != 0 || reinterpret_cast<uintptr_t>(b.xunit) % 16 != 0)
    fail("CUDA expert_linear (IMMA): the digit scratch is not 16-byte aligned");
  if (b.x_rows <= 0) fail("CUDA expert_linear (IMMA): ExpertBatch::x_rows (rows of x the entries read) is not set");
  if (b.w_stride_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(b.w.w) % 16 != 0)
    fail("CUDA expert_linear (IMMA): expert weights are not 16-byte aligned (stride ", b.w_stride_bytes, " bytes)");
  const int64_t warps = b.x_rows * groups;
  launch("expert digits", digits_kernel, dim3(unsigned((warps * 32 + 255) / 256)), dim3(256), 0, s, x, ldx, b.x_rows, groups, b.xq,
         b.xunit);
  with_imma(b.imma_tile >= 0 ? b.imma_tile : imma_tile_for(b.w.rows, b.w.cols, b.max_rows_per_expert), [&](auto tile) {
    using Tl = decltype(tile);
    using C = typename Tl::C;
    static std::atomic<uint64_t> opted{0};  // above 48 KB of dynamic shared memory needs the opt-in, a device each
    opt_in_smem(Tl::kernel, C::smem, opted, "expert_imma shared memory");
    launch("expert_linear (IMMA)", Tl::kernel, imma_grid<C>(b), dim3(C::threads), C::smem, s, b, y, ldy, int(ep));
  });
}

std::string expert_imma_describe(int tile) {
  std::string out;
  with_imma(tile, [&](auto tl) {
    using Tl = decltype(tl);
    using C = typename Tl::C;
    cudaFuncAttributes fa{};
    check(cudaFuncGetAttributes(&fa, Tl::kernel), "cudaFuncGetAttributes");
    check(cudaFuncSetAttribute(Tl::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem), "expert_imma shared memory");
    int blocks = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Tl::kernel, C::threads, C::smem), "occupancy");
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "IMMA %dx%d warps RT%d ST%d MP%d SG%d (%d rows x %d tokens): %d regs, %d spill B, smem %.0f KB, %d blk/SM, "
                  "%.0f KB w in flight/SM",
                  C::wr, C::wt, C::rt, C::st, C::mp, C::sg, C::rows, C::T, fa.numRegs, int(fa.localSizeBytes), C::smem / 1024.0,
                  blocks, double(blocks) * (C::st - 1) * (C::w_bytes + C::s_bytes) / 1024.0);
    out = buf;
  });
  return out;
}

}  // namespace kd::cuda
