// The "xs" / "xw" kernels of the bf16 tensor-core linear (included by mma.cu, inside its anonymous
// namespace: they use its fragment helpers and finish_tile): one weight pass for up to 8 · NT tokens.
#pragma once

// 16 bytes global → shared, asynchronous; !valid fills zeros (src-size 0: nothing is read from src).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// ---- "xs" kernels: x staged, split, in shared memory; one weight pass for up to 8 · NT tokens ----
// Block: RW groups of KS warps; group r owns weight rows row0 + 16·RT·r …, and its KS warps split K
// exactly as bf16_warp does with KC (warp w: runs of U consecutive k32 blocks w·U, (w + KS)·U, …), so
// every output's reduction order — and its bits — are those of the KC configurations with the same
// KS and U, whatever NT. Stage s = the k32 blocks [s·U·KS, (s + 1)·U·KS): the block loads x of its
// 8·NT tokens for those columns once, splits it once (not once per 16·RT weight rows), stores the B
// fragments in shared memory (xs_bytes) where every group reads them, and each warp runs its U
// blocks' weights (loaded once, in registers) against all NT token tiles. Pipelined: the next stage's
// weights and raw x are in flight while this stage's MMAs run.

template <int RT, int NT, int KS, int RW, int U>
constexpr size_t xs_bytes() {
  const size_t frags = size_t(U) * KS * NT * 32 * (48 + 32);  // [u][warp][tile][lane] × 12 u32 (bf[2][3][2]), then raw x
  const size_t parts = size_t(RW) * KS * 8 * NT * (16 * RT + 4) * 4;  // finish_tile's partials, per group
  return frags > parts ? frags : parts;
}

template <int RT, int NT, int KS, int RW, int U, int LD, int MINB>
__global__ void __launch_bounds__(KS * RW * 32, MINB) mma_linear_xs_kernel(DevMatrix w, const float* __restrict__ x,
                                                                          int64_t ldx, int64_t M, float* y, int64_t ldy, int ep) {
  extern __shared__ uint4 xs_smem[];
  constexpr int NTHR = KS * RW * 32, ENT = U * KS * NT * 32, E = (ENT + NTHR - 1) / NTHR;  // E: entries a thread stages
  const int tid = int(threadIdx.x), lane = tid & 31, warp = (tid >> 5) % KS, grp = (tid >> 5) / KS;
  const int g = lane >> 2, t = lane & 3;
  const int64_t rows = w.rows, K = w.cols, nkb = (K + 31) / 32;
  const int64_t row0 = int64_t(blockIdx.y) * 16 * RT * RW + int64_t(grp) * 16 * RT, m0 = int64_t(blockIdx.x) * 8 * NT;
  const int mcount = int(M - m0 < 8 * NT ? M - m0 : int64_t(8 * NT));
  const int64_t nst = (nkb + int64_t(U) * KS - 1) / (int64_t(U) * KS);
  const uint16_t* w16 = static_cast<const uint16_t*>(w.w);
  const uint16_t* wp[RT][2];
  float acc[RT][NT][4];
  tile_start<RT, NT>(w16, rows, K, row0, g, t, wp, acc);

  // Entry e = ((u · KS + w') · NT + nt) · 32 + lane': token m0 + 8·nt + lane' / 4, columns kb · 32 + 8 · (lane' % 4) …
  // + 7 of k32 block kb = (s · KS + w') · U + u. Rows past M and columns past K stage zeros. A thread's
  // entries travel as raw fp32 by cp.async (no registers held while in flight) into its own slots of
  // `raw`, so only its own wait is needed before it splits them.
  uint4* raw = xs_smem + size_t(ENT) * 3;  // [entry][2] × 16 bytes, after the fragments
  auto x_fetch = [&](int64_t s) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int e = tid + j * NTHR;
      if (e >= ENT) break;
      const int ln = e & 31, nt = (e >> 5) % NT, wq = (e >> 5) / NT % KS, u = (e >> 5) / NT / KS;
      const int64_t tok = m0 + nt * 8 + (ln >> 2), k = ((s * KS + wq) * U + u) * 32 + 8 * (ln & 3);
      const bool in = tok < M && k < K;
      const float* src = in ? x + tok * ldx + k : x;
      cp_async16_zfill(raw + 2 * e, src, in);
      cp_async16_zfill(raw + 2 * e + 1, src + 4, in);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  auto x_stage = [&] {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int e = tid + j * NTHR;
      if (e >= ENT) break;
      const uint4 r0 = raw[2 * e], r1 = raw[2 * e + 1];
      const float4 xv[1][2] = {{make_float4(__uint_as_float(r0.x), __uint_as_float(r0.y), __uint_as_float(r0.z), __uint_as_float(r0.w)),
                                make_float4(__uint_as_float(r1.x), __uint_as_float(r1.y), __uint_as_float(r1.z), __uint_as_float(r1.w))}};
      uint32_t bf[1][2][3][2];
      x_split<false, 1>(xv, bf);
      const uint32_t* b = &bf[0][0][0][0];
      uint4* d = xs_smem + size_t(e) * 3;
      d[0] = make_uint4(b[0], b[1], b[2], b[3]);
      d[1] = make_uint4(b[4], b[5], b[6], b[7]);
      d[2] = make_uint4(b[8], b[9], b[10], b[11]);
    }
  };
  auto w_fetch = [&](int64_t s, uint4 (&wv)[U][RT][2]) {  // columns ≥ K (blocks past the end) read zeros
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = ((s * KS + warp) * U + u) * 32;
      const bool in = k + 8 * t < K;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = in ? load_w<LD>(wp[rt][h] + k) : make_uint4(0, 0, 0, 0);
    }
  };

  uint4 wv[U][RT][2];
  x_fetch(0);
  w_fetch(0, wv);
  for (int64_t s = 0; s < nst; ++s) {
    uint4 nx[U][RT][2];
    w_fetch(s + 1, nx);  // past the end: predicated off, zeros
    __syncthreads();     // the previous stage's fragments are consumed
    x_stage();
    __syncthreads();
    if (s + 1 < nst) x_fetch(s + 1);  // this thread's raw slots are free: x_stage read them
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (((s * KS + warp) * U + u) >= nkb) break;  // warp-uniform: every lane runs the MMAs
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4* src = xs_smem + size_t(((u * KS + warp) * NT + nt) * 32 + lane) * 3;
        const uint4 q0 = src[0], q1 = src[1], q2 = src[2];
        // bf[step][part][reg], flattened as x_stage stored it.
        const uint32_t bf[2][3][2] = {{{q0.x, q0.y}, {q0.z, q0.w}, {q1.x, q1.y}}, {{q1.z, q1.w}, {q2.x, q2.y}, {q2.z, q2.w}}};
#pragma unroll
        for (int st = 0; st < 2; ++st)
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            const uint4 wg = wv[u][rt][0], wg8 = wv[u][rt][1];
            const uint32_t a[4] = {st ? wg.z : wg.x, st ? wg8.z : wg8.x, st ? wg.w : wg.y, st ? wg8.w : wg8.y};
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma3(d, a, bf[st]);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][nt][i] = __fadd_rn(acc[rt][nt][i], d[i]);
          }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = nx[u][rt][h];
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // nothing may land in the partials (K = 0: stage 0's x)
  __syncthreads();  // the fragments' memory becomes the partials
  using Part = float[KS][8 * NT][16 * RT + 4];
  Part& part = reinterpret_cast<Part*>(reinterpret_cast<float*>(xs_smem))[grp];
  finish_tile<RT, NT, KS>(part, acc, row0, rows, mcount, ep, [&](int tok) { return y + (m0 + tok) * ldy; }, tid - grp * KS * 32);
}

// The same stage loop with the weights in shared memory: each thread copies its own 16-byte weight
// chunks (those bf16_warp's lane would load) by cp.async into its own slots of a WST-deep ring and
// later reads them back itself (no barrier needed for them), so WST − 1 stages of weights are in
// flight during a stage's MMAs without holding registers; x of the next stage travels in registers
// (xq) and is split into the shared fragments as in mma_linear_xs_kernel. Same order, same bits.
template <int RT, int NT, int KS, int RW, int U, int WST>
constexpr size_t xw_bytes() {
  const size_t frags = size_t(U) * KS * NT * 32 * 48;                 // B fragments of one stage
  const size_t ring = size_t(WST) * U * RT * 2 * (KS * RW * 32) * 16;  // [stage][u][rt][h][thread] × 16 bytes
  const size_t parts = size_t(RW) * KS * 8 * NT * (16 * RT + 4) * 4;
  return frags + ring > parts ? frags + ring : parts;
}

// 16 bytes global → shared with the L2::256B prefetch hint (as load_w<2>); !valid fills zeros.
__device__ __forceinline__ void cp_async16_w(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

template <int RT, int NT, int KS, int RW, int U, int WST, int MINB>
__global__ void __launch_bounds__(KS * RW * 32, MINB) mma_linear_xw_kernel(DevMatrix w, const float* __restrict__ x,
                                                                          int64_t ldx, int64_t M, float* y, int64_t ldy, int ep) {
  static_assert(WST >= 2, "the weight ring needs at least 2 stages");
  extern __shared__ uint4 xw_smem[];
  constexpr int NTHR = KS * RW * 32, ENT = U * KS * NT * 32, E = (ENT + NTHR - 1) / NTHR;
  const int tid = int(threadIdx.x), lane = tid & 31, warp = (tid >> 5) % KS, grp = (tid >> 5) / KS;
  const int g = lane >> 2, t = lane & 3;
  const int64_t rows = w.rows, K = w.cols, nkb = (K + 31) / 32;
  const int64_t row0 = int64_t(blockIdx.y) * 16 * RT * RW + int64_t(grp) * 16 * RT, m0 = int64_t(blockIdx.x) * 8 * NT;
  const int mcount = int(M - m0 < 8 * NT ? M - m0 : int64_t(8 * NT));
  const int64_t nst = (nkb + int64_t(U) * KS - 1) / (int64_t(U) * KS);
  const uint16_t* w16 = static_cast<const uint16_t*>(w.w);
  const uint16_t* wp[RT][2];
  float acc[RT][NT][4];
  tile_start<RT, NT>(w16, rows, K, row0, g, t, wp, acc);
  uint4* ring = xw_smem + size_t(ENT) * 3;
  auto slot = [&](int64_t s, int u, int rt, int h) { return ring + ((size_t(s % WST) * U + u) * RT * 2 + rt * 2 + h) * NTHR + tid; };
  auto w_async = [&](int64_t s) {  // stage s's weights into its ring slot; always one commit group (maybe empty)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = ((s * KS + warp) * U + u) * 32;
      const bool in = s < nst && k + 8 * t < K;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) cp_async16_w(slot(s, u, rt, h), in ? wp[rt][h] + k : w16, in);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  float4 xq[E][2];  // the next stage's x, entries as in mma_linear_xs_kernel
  auto x_fetch = [&](int64_t s) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int e = tid + j * NTHR;
      const int ln = e & 31, nt = (e >> 5) % NT, wq = (e >> 5) / NT % KS, u = (e >> 5) / NT / KS;
      const int64_t tok = m0 + nt * 8 + (ln >> 2), k = ((s * KS + wq) * U + u) * 32 + 8 * (ln & 3);
      xq[j][0] = xq[j][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e < ENT && tok < M && k < K) {
        const float4* p = reinterpret_cast<const float4*>(x + tok * ldx + k);
        xq[j][0] = p[0];
        xq[j][1] = p[1];
      }
    }
  };
  auto x_stage = [&] {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int e = tid + j * NTHR;
      if (e >= ENT) break;
      const float4 xv[1][2] = {{xq[j][0], xq[j][1]}};
      uint32_t bf[1][2][3][2];
      x_split<false, 1>(xv, bf);
      const uint32_t* b = &bf[0][0][0][0];
      uint4* d = xw_smem + size_t(e) * 3;
      d[0] = make_uint4(b[0], b[1], b[2], b[3]);
      d[1] = make_uint4(b[4], b[5], b[6], b[7]);
      d[2] = make_uint4(b[8], b[9], b[10], b[11]);
    }
  };

  for (int s = 0; s < WST - 1; ++s) w_async(s);
  x_fetch(0);
  for (int64_t s = 0; s < nst; ++s) {
    w_async(s + WST - 1);  // its slot was last read (by this thread) in stage s − 1
    __syncthreads();       // the previous stage's fragments are consumed
    x_stage();
    __syncthreads();
    if (s + 1 < nst) x_fetch(s + 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(WST - 1) : "memory");  // stage s's weights have landed
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (((s * KS + warp) * U + u) >= nkb) break;  // warp-uniform
      uint4 wv[RT][2];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[rt][h] = *slot(s, u, rt, h);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4* src = xw_smem + size_t(((u * KS + warp) * NT + nt) * 32 + lane) * 3;
        const uint4 q0 = src[0], q1 = src[1], q2 = src[2];
        const uint32_t bf[2][3][2] = {{{q0.x, q0.y}, {q0.z, q0.w}, {q1.x, q1.y}}, {{q1.z, q1.w}, {q2.x, q2.y}, {q2.z, q2.w}}};
#pragma unroll
        for (int st = 0; st < 2; ++st)
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            const uint4 wg = wv[rt][0], wg8 = wv[rt][1];
            const uint32_t a[4] = {st ? wg.z : wg.x, st ? wg8.z : wg8.x, st ? wg.w : wg.y, st ? wg8.w : wg8.y};
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma3(d, a, bf[st]);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][nt][i] = __fadd_rn(acc[rt][nt][i], d[i]);
          }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // the trailing (empty or past-the-end) groups
  __syncthreads();
  using Part = float[KS][8 * NT][16 * RT + 4];
  Part& part = reinterpret_cast<Part*>(reinterpret_cast<float*>(xw_smem))[grp];
  finish_tile<RT, NT, KS>(part, acc, row0, rows, mcount, ep, [&](int tok) { return y + (m0 + tok) * ldy; }, tid - grp * KS * 32);
}
