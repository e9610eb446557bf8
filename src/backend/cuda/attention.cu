// Absorbed MLA attention over the bf16 latent cache, for decode, tree verify and prefill alike
// (SPEC-MODEL.md §2, the decode form of vLLM/FlashMLA). Three kernels, so a single decode row
// still spreads the W_UK / W_UV reads (16.8 MB a layer for K2) over the whole GPU:
//   q_lat = W_UKᵀ q_nope                                  [Lr]    qlat_kernel (kv_b rows of the head)
//   s_t   = [q_lat | q_pe] · [c_kv[t] | k_pe[t]] · scale   over the row's key list
//   p     = softmax(s);  o_lat = Σ_t p_t c_kv[t]           [Lr]    lists of ≤ kShortKeys keys:
//                                                                 mla_short_kernel, per (row, 1-4
//                                                                 heads), CUDA cores; longer lists:
//                                                                 mla_core_kernel, per (row, 16 heads,
//                                                                 chunk), on the tensor cores
//                                                                 (+ mla_combine_kernel over chunks)
//   out   = W_UV o_lat                                    [dv]    wuv_kernel, a warp per value
// Long key lists are cut into up to kMaxChunks chunks of whole 64-key units (flash-decoding): each
// chunk's block keeps its own max m, sum l and o = Σ e^(s − m) c; the combine kernel rescales them.
// Which kernel takes a row and how its list is cut depend only on the list's length (kShortKeys,
// chunk_keys), so they are the same for an AR step and the tree node with the same prefix.
// The key list of row i (kernels.h KeyLists) is its sequence's committed rows 0 … start−1 (through
// the block table of a paged cache) followed by the new rows it may see (its tree ancestors and
// itself, ascending): exactly the list of the AR step for the same prefix, and every reduction is
// ordered by position in that list — so a verified node reproduces its AR step bit for bit whatever
// the tree, the batch or the paging around it (no public Hopper MLA kernel takes a tree mask).
#include <algorithm>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/env.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kd::cuda {

namespace {

constexpr int kRowPass = 8;        // qlat / wuv: rows that share one read of a weight
constexpr int kMaxChunks = 16;     // key chunks of one (row, head) at most
constexpr size_t kMaxSmem = 227 * 1024;  // Hopper's per-block opt-in limit
// Lists of at most this many keys take mla_short_kernel (CUDA cores, a block for 1, 2 or 4 heads), longer
// ones the tensor-core kernel. A decode row of a short context has a few dozen keys: the tensor-core grid
// is then 4 head groups × 1–2 chunks and the step waits on the latency of those few blocks (plus the
// q-fragment and combine launches), while the CUDA-core kernel spreads it over 64 blocks. Measured on
// the H200 with the split at 256 keys (docs/perf.md, "Short lists on the CUDA cores", k2-slice): after a
// 64-token prompt decode −5.6 % and verify of 1–4 nodes −3 to −6 %; after a 192-token prompt a 16-node
// verify +1.6 % — its crossover lies near 130 keys, a decode row's near 220 — hence 128. The rule is
// the list's length alone, never the batch, so a tree node still takes its AR step's kernel.
constexpr int kShortKeys = 128;
__host__ __device__ constexpr bool short_list(int64_t len) { return len <= kShortKeys; }

// q_lat[i, h, :] = W_UKᵀ q_nope[i, h]: grid (H, ceil(Lr / 128), ceil(n / NR)), 256 threads = 64
// latent pairs (bf16x2 loads coalesced across the warp) × 4 quarters of d, whose partial sums are
// added in quarter order — a split fixed by the shape, so rows stay invariant. A block serves up to
// NR rows of one head: each W_UK load feeds NR rows (the head's 128 KB is read once per NR rows,
// not once per row). Per output the chain is the same whatever NR and the rows around it.
template <int NR>
__global__ void __launch_bounds__(256) qlat_kernel(MlaParams p) {
  __shared__ float qn[NR][512];
  __shared__ float2 part[4][NR][64];
  pdl_wait();  // (common.cuh)
  pdl_trigger();
  const int64_t h = blockIdx.x, Lr = p.Lr, dn = p.dn, i0 = int64_t(blockIdx.z) * NR;
  const int nr = p.n - i0 < NR ? int(p.n - i0) : NR;
  for (int r = 0; r < nr; ++r) {
    const float* qi = p.q + ((i0 + r) * p.H + h) * (dn + p.dr);
    for (int64_t d = threadIdx.x; d < dn; d += 256) qn[r][d] = qi[d];
  }
  __syncthreads();
  const int quarter = threadIdx.x >> 6, j = threadIdx.x & 63;
  const int64_t l2 = int64_t(blockIdx.y) * 64 + j;  // latent pair
  const int64_t d0 = quarter * ((dn + 3) / 4), d1 = min(dn, d0 + (dn + 3) / 4);
  float a0[NR], a1[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = 0.0f;
  if (l2 < Lr / 2) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p.kv_b + h * (dn + p.dv) * Lr) + l2;
#pragma unroll 4
    for (int64_t d = d0; d < d1; ++d) {
      const uint32_t v = __ldg(w + d * (Lr / 2));
      const float lo = bf16_lo(v), hi = bf16_hi(v);
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (r < nr) {
          a0[r] = fmaf(qn[r][d], lo, a0[r]);
          a1[r] = fmaf(qn[r][d], hi, a1[r]);
        }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) part[quarter][r][j] = make_float2(a0[r], a1[r]);
  __syncthreads();
  if (quarter != 0 || l2 >= Lr / 2) return;
  for (int r = 0; r < nr; ++r) {
    float2 t = part[0][r][j];
#pragma unroll
    for (int k = 1; k < 4; ++k) {
      t.x = __fadd_rn(t.x, part[k][r][j].x);
      t.y = __fadd_rn(t.y, part[k][r][j].y);
    }
    const int64_t ih = (i0 + r) * p.H + h;
    p.qlat[ih * Lr + 2 * l2] = t.x;
    p.qlat[ih * Lr + 2 * l2 + 1] = t.y;
  }
}

// ---- Short lists on the CUDA cores ------------------------------------------------------------
constexpr int kShortThreads = 512;  // mla_short_kernel: 16 warps

// Thread groups of mla_short_kernel's o_lat phase: a group holds a thread per latent quad (rounded up
// to whole warps) and takes every G-th key; G is a rule of Lr alone, so rows stay invariant.
__host__ __device__ constexpr int short_groups(int64_t Lr) {
  const int64_t per = (Lr / 4 + 31) / 32 * 32;
  return per >= kShortThreads ? 1 : int(kShortThreads / per);
}

// mla_short_kernel<HB>'s shared memory: q_lat [HB][Lr] | q_pe [HB][dr] | red [32·HB] | rows
// [kShortKeys] | e [HB][kShortKeys] | the o partials of groups 1 … G − 1 [HB][G − 1][Lr].
__host__ __device__ constexpr size_t short_smem(int64_t Lr, int64_t dr, int HB) {
  return size_t(HB * (Lr + dr + 32 + kShortKeys + (short_groups(Lr) - 1) * Lr) + kShortKeys) * sizeof(float);
}

// Batched block reductions of HB values (blockDim.x == kShortThreads): value h is reduced exactly as
// one value alone would be (warp butterfly, then warp 0 over the warps' results in order), so a
// head's result does not depend on how many heads share the block. sh: ≥ 32 · HB floats.
template <int HB, bool MAX>
__device__ __forceinline__ void block_reduce(float (&v)[HB], float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = kShortThreads / 32;
#pragma unroll
  for (int h = 0; h < HB; ++h) {
    const float r = MAX ? warp_max(v[h]) : warp_sum(v[h]);
    if (lane == 0) sh[h * 32 + warp] = r;
  }
  __syncthreads();
  if (warp == 0)
#pragma unroll
    for (int h = 0; h < HB; ++h) {
      float t = lane < nw ? sh[h * 32 + lane] : (MAX ? -__int_as_float(0x7f800000) : 0.0f);
      t = MAX ? warp_max(t) : warp_sum(t);
      if (lane == 0) sh[h * 32] = t;
    }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < HB; ++h) v[h] = sh[h * 32];
  __syncthreads();
}

// Scores, softmax and o_lat of one row with a short list (≤ kShortKeys keys) for HB heads: grid
// (rows, H / HB), every row of the batch (a row with a longer list returns at once; the tensor-core
// kernel takes it). HB only decides which block computes a head, never how: every per-head reduction
// is the one HB = 1 does, so the launch picks HB by the batch and rows stay bit-identical. Every
// reduction is ordered by list position: a key's score (lanes over latent quads, then the warp's
// butterfly), the list's max and sum (fixed by the block size), and o (group g sums keys g, g + G, …
// in order; the G partials are added in group order).
template <int HB>
__global__ void __launch_bounds__(kShortThreads) mla_short_kernel(MlaParams p) {
  extern __shared__ __align__(16) float sm[];
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x, h0 = int64_t(blockIdx.y) * HB, Lr = p.Lr, dr = p.dr, dn = p.dn, D = Lr + dr;
  const KeyLists& k = p.keys;
  const int start = k.start[i], len = start + k.cnt[i], bt = int(k.bt);
  if (!short_list(len)) return;
  const int G = short_groups(Lr);
  float* qlat = sm;               // [HB][Lr]
  float* qpe = qlat + HB * Lr;    // [HB][dr]
  float* red = qpe + HB * dr;     // [32 · HB]
  int32_t* rows = reinterpret_cast<int32_t*>(red + 32 * HB);      // [kShortKeys]
  float* prob = reinterpret_cast<float*>(rows + kShortKeys);     // [HB][kShortKeys]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = kShortThreads / 32;
  for (int h = 0; h < HB; ++h) {
    const int64_t ih = i * p.H + h0 + h;
    for (int64_t l = tid; l < Lr; l += kShortThreads) qlat[h * Lr + l] = p.qlat[ih * Lr + l];
    const float* qr = p.q + ih * (dn + dr) + dn;
    if (p.rope_inv_freq == nullptr) {
      for (int64_t d = tid; d < dr; d += kShortThreads) qpe[h * dr + d] = qr[d];
    } else {
      for (int64_t j = tid; j < dr / 2; j += kShortThreads) {
        float a = qr[2 * j], b = qr[2 * j + 1];
        rope_pair(a, b, p.rope_inv_freq[j], p.rope_positions[i], p.rope_scaling);
        qpe[h * dr + 2 * j] = a;
        qpe[h * dr + 2 * j + 1] = b;
      }
    }
  }
  {
    const int32_t* table = k.tables + k.tab[i];
    const int32_t* vis = k.voff[i] < 0 ? nullptr : k.vis + k.voff[i];  // null: causal (KeyLists)
    const int32_t* wrow = k.wrow + k.base[i];
    for (int t = tid; t < len; t += kShortThreads)
      rows[t] = t < start ? table[t / bt] * bt + t % bt : wrow[vis ? vis[t - start] : t - start];
  }
  __syncthreads();

  // Scores: one warp per key, lanes over latent quads (8-byte loads), each load used by HB heads.
  const int nq = int(Lr / 4), nqr = int(dr / 4);
  for (int t = warp; t < len; t += nw) {
    const uint2* k4 = reinterpret_cast<const uint2*>(p.cache + int64_t(rows[t]) * D);
    float a[HB], b[HB];
#pragma unroll
    for (int h = 0; h < HB; ++h) a[h] = b[h] = 0.0f;
#pragma unroll 4
    for (int q = lane; q < nq; q += 32) {
      const uint2 v = k4[q];
      const float c0 = bf16_lo(v.x), c1 = bf16_hi(v.x), c2 = bf16_lo(v.y), c3 = bf16_hi(v.y);
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        const float4 ql = reinterpret_cast<const float4*>(qlat + h * Lr)[q];
        a[h] = fmaf(ql.w, c3, fmaf(ql.z, c2, fmaf(ql.y, c1, fmaf(ql.x, c0, a[h]))));
      }
    }
    for (int q = lane; q < nqr; q += 32) {
      const uint2 v = k4[nq + q];
      const float c0 = bf16_lo(v.x), c1 = bf16_hi(v.x), c2 = bf16_lo(v.y), c3 = bf16_hi(v.y);
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        const float4 qp = reinterpret_cast<const float4*>(qpe + h * dr)[q];
        b[h] = fmaf(qp.w, c3, fmaf(qp.z, c2, fmaf(qp.y, c1, fmaf(qp.x, c0, b[h]))));
      }
    }
#pragma unroll
    for (int h = 0; h < HB; ++h) {
      const float sa = warp_sum(a[h]), sb = warp_sum(b[h]);
      if (lane == 0) prob[h * kShortKeys + t] = __fmul_rn(__fadd_rn(sa, sb), p.softmax_scale);
    }
  }
  __syncthreads();
  float mx[HB], sum[HB];
#pragma unroll
  for (int h = 0; h < HB; ++h) {
    mx[h] = -__int_as_float(0x7f800000);
    for (int t = tid; t < len; t += kShortThreads) mx[h] = fmaxf(mx[h], prob[h * kShortKeys + t]);
  }
  block_reduce<HB, true>(mx, red);
#pragma unroll
  for (int h = 0; h < HB; ++h) {
    sum[h] = 0.0f;
    for (int t = tid; t < len; t += kShortThreads) {
      const float e = expf(prob[h * kShortKeys + t] - mx[h]);
      prob[h * kShortKeys + t] = e;
      sum[h] += e;
    }
  }
  block_reduce<HB, false>(sum, red);  // (its barriers also publish e)

  // o: group g = tid / per, thread = one latent quad (8-byte loads), keys g, g + G, …; each load
  // feeds HB heads.
  const int per = kShortThreads / G, g = tid / per, q = tid % per;
  const bool active = g < G && q < nq;
  float acc[HB][4];
#pragma unroll
  for (int h = 0; h < HB; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
  if (active) {
#pragma unroll 4
    for (int t = g; t < len; t += G) {
      const uint2 v = reinterpret_cast<const uint2*>(p.cache + int64_t(rows[t]) * D)[q];
      const float c0 = bf16_lo(v.x), c1 = bf16_hi(v.x), c2 = bf16_lo(v.y), c3 = bf16_hi(v.y);
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        const float pr = prob[h * kShortKeys + t];
        acc[h][0] = fmaf(pr, c0, acc[h][0]);
        acc[h][1] = fmaf(pr, c1, acc[h][1]);
        acc[h][2] = fmaf(pr, c2, acc[h][2]);
        acc[h][3] = fmaf(pr, c3, acc[h][3]);
      }
    }
  }
  float* partial = prob + HB * kShortKeys;  // [HB][G − 1][Lr]
  if (active && g >= 1)
#pragma unroll
    for (int h = 0; h < HB; ++h)
      reinterpret_cast<float4*>(partial + (h * (G - 1) + g - 1) * Lr)[q] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
  __syncthreads();
  if (!active || g != 0) return;
#pragma unroll
  for (int h = 0; h < HB; ++h) {
    float4 o = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    for (int gg = 1; gg < G; ++gg) {
      const float4 u = reinterpret_cast<const float4*>(partial + (h * (G - 1) + gg - 1) * Lr)[q];
      o = make_float4(__fadd_rn(o.x, u.x), __fadd_rn(o.y, u.y), __fadd_rn(o.z, u.z), __fadd_rn(o.w, u.w));
    }
    reinterpret_cast<float4*>(p.olat + (i * p.H + h0 + h) * Lr)[q] =
        make_float4(__fdiv_rn(o.x, sum[h]), __fdiv_rn(o.y, sum[h]), __fdiv_rn(o.z, sum[h]), __fdiv_rn(o.w, sum[h]));
  }
}

// ---- The core on the tensor cores ---------------------------------------------------------------
// A block serves one row, kHeads heads and one key chunk: every head of a row attends to the same
// latent keys, so the heads are the MMA's 16-row side (mma.sync m16n8k16, bf16 inputs, fp32
// accumulators). The chunk's keys are taken kTile at a time, folded in order into a running
// (max M, sum L, o) per head (the online softmax; the rescale factor is e^(M_old − M_new)):
//   scores  Sᵀ[keys × heads] = K[keys × D] · Qᵀ        A = cache rows (bf16, as stored), B = q
//   o       O[heads × Lr]   += P[heads × keys] · V      A = p,  B = the same rows' first Lr columns
// q (fp32: q_lat | rope'd q_pe) and p (fp32) are split exactly as hi + mid + lo, three bf16 (mma.cu's
// split3), so every product is the fp32 product, exact in the tensor core; each k32 step's six MMAs
// (3 parts × 2 k16 halves) start from zero and are added to the fp32 accumulator with one IEEE add,
// so the tensor core's own rounding only ever spans one step's partial sum. A score is two such
// chains, the k32 steps of each half of the row (warps 0–3 and 4–7), added in that order.
// Exactness: an MMA output element depends only on its own row of A, column of B and accumulator, and
// every sum here runs in an order fixed by the row's key list alone (tiles, chunks and k32 steps cut
// by its length; keys a warp takes fixed by their place in the tile); which block, which launch and
// which other rows or heads share it never enter. So a tree node equals its AR step bit for bit.
// q's fragments are built once a (row, 16 heads) by mla_qfrag_kernel, not once a chunk.
constexpr int kHeads = 16;          // heads a block (the MMA's M); a row's heads past H are zeros
constexpr int kCoreThreads = 256;   // 8 warps
constexpr int kCoreWarps = kCoreThreads / 32;
constexpr int kTile = 256;          // keys a fold step: 16 A tiles of 16 keys, 4 a warp of each k half
constexpr int kProbStride = kTile + 4;  // (the score stores of a warp hit 32 distinct banks)
constexpr int kLrMax = 64 * kCoreWarps; // o: one 64-column group a warp
static_assert(kLrMax / 4 <= kShortThreads, "mla_short_kernel's o phase takes a thread per latent quad, no loop");

// Keys a chunk of a len-key list holds: whole units of kChunkUnit keys, as few as keep ≤ kMaxChunks
// chunks. The unit is smaller than a tile so that a decode row's few blocks (a row, 16 heads, a
// chunk each) become more once its list passes 64 keys: measured on the H200 (docs/perf.md), 64
// against 256 made a decode step after a 4096-token prompt 5 % faster and the 4096-token prefill 5 %
// slower (more, shorter chunks to combine).
constexpr int kChunkUnit = 64;
__host__ __device__ constexpr int64_t chunk_keys(int64_t len) {
  const int64_t units = (len + kChunkUnit - 1) / kChunkUnit;
  return kChunkUnit * ((units + kMaxChunks - 1) / kMaxChunks);
}
// q's fragments of one (row, 16 heads): [D / 32][2][3][32] uint4 (k32 step, 8-head half, part, lane).
__host__ __device__ constexpr int64_t qfrag_uint4s(int64_t D) { return (D + 31) / 32 * 2 * 3 * 32; }

// Shared memory of the core for a D-column latent row: q's fragments, the tile's scores
// [kHeads][kProbStride] (the first k half's partials), p's parts in fragment order [kTile / 16][3]
// (uint4 a lane; before the fold, the second k half's partial scores), the tile's cache rows, and
// per head M, L and the rescale factor.
__host__ __device__ constexpr size_t core_smem(int64_t D) {
  return size_t(qfrag_uint4s(D)) * 16 + size_t(kHeads) * kProbStride * 4 + size_t(kTile / 16) * 3 * 32 * 16 +
         size_t(kTile) * 4 + 3 * kHeads * 4;
}
static_assert(size_t(kTile / 16) * 3 * 32 * 16 >= size_t(kHeads) * kProbStride * 4, "p's parts hold the second half's scores");

// 8 bf16 of a row at columns [c, c + 8), zeros at and past lim (c, lim multiples of 4). FAST: the
// shape guarantees c + 8 ≤ lim and 16-byte aligned rows (only a missing row gives zeros).
template <bool FAST>
__device__ __forceinline__ uint4 load8(const uint16_t* row, int c, int lim) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (FAST) return row == nullptr ? v : *reinterpret_cast<const uint4*>(row + c);
  if (row == nullptr || c >= lim) return v;
  const uint2 lo = *reinterpret_cast<const uint2*>(row + c);
  v.x = lo.x, v.y = lo.y;
  if (c + 8 <= lim) {
    const uint2 hi = *reinterpret_cast<const uint2*>(row + c + 4);
    v.z = hi.x, v.w = hi.y;
  }
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// q's B fragments for rows i0 … (grid (rows, ceil(H / kHeads), ceil(D / 32)), row i0 + blockIdx.x,
// k32 step blockIdx.z, a slot a thread: one round trip to memory) into p.qfrag
// [rows][ceil(H / kHeads)][qfrag_uint4s(D)]; rows with a short list are left alone (the CUDA-core
// kernel takes them). Slot (kb, nh, lane g, t) holds head h0 + 8·nh + g
// at columns 32·kb + 8t … + 7 (q_lat, then q_pe rotated here when rope_inv_freq is set), split in
// three; the k16 half s uses columns 4s, 4s + 1 (logical 2t, 2t + 1) and 4s + 2, 4s + 3 (logical
// 2t + 8, 2t + 9) — the same permutation the A side (the cache row's 8 columns) uses.
constexpr int kQfragThreads = 64;  // a k32 step's slots: 2 head halves × 32 lanes
__global__ void __launch_bounds__(kQfragThreads) mla_qfrag_kernel(MlaParams p, int64_t i0) {
  pdl_wait();
  pdl_trigger();
  const int64_t li = blockIdx.x, i = i0 + li, h0 = int64_t(blockIdx.y) * kHeads;
  if (short_list(p.keys.start[i] + p.keys.cnt[i])) return;
  const int Lr = int(p.Lr), dr = int(p.dr), dn = int(p.dn), D = Lr + dr;
  uint4* out = reinterpret_cast<uint4*>(p.qfrag) + (li * gridDim.y + blockIdx.y) * qfrag_uint4s(D);
  const int slot = int(blockIdx.z) * kQfragThreads + int(threadIdx.x);
  const int kb = slot / 64, nh = (slot / 32) % 2, sg = (slot % 32) >> 2, st = slot & 3;
  const int64_t h = h0 + 8 * nh + sg, ih = i * p.H + h;
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = kb * 32 + 8 * st + e;
    v[e] = h >= p.H || c >= D ? 0.0f : c < Lr ? p.qlat[ih * Lr + c] : p.q[ih * (dn + dr) + dn + c - Lr];
  }
  if (p.rope_inv_freq != nullptr && h < p.H)
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const int c = kb * 32 + 8 * st + e;
      if (c >= Lr && c < D) rope_pair(v[e], v[e + 1], p.rope_inv_freq[(c - Lr) / 2], p.rope_positions[i], p.rope_scaling);
    }
  const Split3 s0 = split3(v[0], v[1]), s1 = split3(v[2], v[3]), s2 = split3(v[4], v[5]), s3 = split3(v[6], v[7]);
  uint4* q = out + (slot / 32) * 3 * 32 + (slot % 32);  // (kb · 2 + nh) = slot / 32
  q[0] = make_uint4(s0.hi, s1.hi, s2.hi, s3.hi);
  q[32] = make_uint4(s0.mid, s1.mid, s2.mid, s3.mid);
  q[64] = make_uint4(s0.lo, s1.lo, s2.lo, s3.lo);
}

// Grid (rows, ceil(H / kHeads), chunks); row i = i0 + blockIdx.x, unless its list is short (then
// mla_short_kernel's). Chunk z of the row's list is the keys [z·C, min(len, (z + 1)·C)), C = chunk_keys(len). One chunk: o / L into olat; more: (o, M, L)
// into part [rows][H][kMaxChunks][Lr + 4] for mla_combine_kernel. FAST: D % 32 == 0 and Lr % 64 == 0
// (K2, DeepSeek-V3): no column guards.
template <bool FAST>
__global__ void __launch_bounds__(kCoreThreads, 2) mla_core_kernel(MlaParams p, int64_t i0) {
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_wait();
  pdl_trigger();
  const int64_t li = blockIdx.x, i = i0 + li, h0 = int64_t(blockIdx.y) * kHeads;
  const int Lr = int(p.Lr), D = Lr + int(p.dr), KB = (D + 31) / 32;
  const KeyLists& k = p.keys;
  const int start = k.start[i], len = start + k.cnt[i], bt = int(k.bt);
  if (short_list(len)) return;  // (first: chunk_keys of a list this short is not needed, nor defined at 0)
  const int C = int(chunk_keys(len)), S = (len + C - 1) / C, z = int(blockIdx.z);
  if (z >= S) return;
  const int k0 = z * C, k1 = min(len, k0 + C);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int nq = int(qfrag_uint4s(D));
  uint4* qs = reinterpret_cast<uint4*>(smem);                                // [KB][2][3][32]
  float* prob = reinterpret_cast<float*>(qs + nq);                          // [kHeads][kProbStride]
  uint4* ps = reinterpret_cast<uint4*>(prob + kHeads * kProbStride);         // [kTile / 16][3][32]
  float* prob2 = reinterpret_cast<float*>(ps);                               // (the second half's scores)
  int32_t* rows = reinterpret_cast<int32_t*>(ps + (kTile / 16) * 3 * 32);   // [kTile]
  float* stM = reinterpret_cast<float*>(rows + kTile);                      // [kHeads] running max
  float* stL = stM + kHeads;                                                 // [kHeads] running sum
  float* stA = stL + kHeads;                                                 // [kHeads] this tile's rescale

  {
    const uint4* src = reinterpret_cast<const uint4*>(p.qfrag) + (li * gridDim.y + blockIdx.y) * nq;
#pragma unroll 4
    for (int x = tid; x < nq; x += kCoreThreads) qs[x] = src[x];
  }
  if (tid < kHeads) stM[tid] = -__int_as_float(0x7f800000), stL[tid] = 0.0f;

  const int32_t* table = k.tables + k.tab[i];
  const int32_t* vis = k.voff[i] < 0 ? nullptr : k.vis + k.voff[i];  // null: causal (KeyLists)
  const int32_t* wrow = k.wrow + k.base[i];
  const int groups = (Lr + 63) / 64;  // o column groups of 64 (warp w takes group w)
  // Scores: k half kh = warp / 4 takes the k32 steps [kh·KH, min(KB, (kh + 1)·KH)); within it warp
  // wq = warp % 4 takes the 16-key A tiles wq, wq + 4, wq + 8, wq + 12 of the tile, two at a time.
  const int KH = (KB + 1) / 2, kh = warp >> 2, wq = warp & 3, kb0 = kh * KH, kb1 = min(KB, kb0 + KH);
  float* sdst = kh == 0 ? prob : prob2;
  float acc[8][4];                    // o of heads g, g + 8 at 16 columns of the warp's group
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e][0] = acc[e][1] = acc[e][2] = acc[e][3] = 0.0f;

  for (int t0 = k0; t0 < k1; t0 += kTile) {
    const int nk = min(kTile, k1 - t0), mt = (nk + 15) / 16;
    __syncthreads();  // the previous tile's rows and p are no longer read (and q's fragments are in)
    for (int j = tid; j < nk; j += kCoreThreads) {
      const int tt = t0 + j;
      rows[j] = tt < start ? table[tt / bt] * bt + tt % bt : wrow[vis ? vis[tt - start] : tt - start];
    }
    __syncthreads();
    // The tile's rows into L2 at once (fire and forget): the score loop below then waits on L2, not
    // on HBM, once a k32 step.
    {
      const int lines = (D * 2 + 127) / 128;
      for (int x = tid; x < nk * lines; x += kCoreThreads) {
        const char* a = reinterpret_cast<const char*>(p.cache + int64_t(rows[x / lines]) * D) + (x % lines) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
      }
    }

    for (int m0 = wq; m0 < mt; m0 += 8) {  // A tiles m0 and m0 + 4
      const bool second = m0 + 4 < mt;      // (warp-uniform)
      const uint16_t* kr[2][2];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key = 16 * (m0 + 4 * m) + 8 * r + g;
          kr[m][r] = key < nk ? p.cache + int64_t(rows[key]) * D : nullptr;
        }
      float sacc[2][2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int nh = 0; nh < 2; ++nh) sacc[m][nh][0] = sacc[m][nh][1] = sacc[m][nh][2] = sacc[m][nh][3] = 0.0f;
#pragma unroll 1
      for (int kb = kb0; kb < kb1; ++kb) {
        uint4 kv[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int r = 0; r < 2; ++r) kv[m][r] = m == 1 && !second ? make_uint4(0u, 0u, 0u, 0u) : load8<FAST>(kr[m][r], kb * 32 + 8 * t, D);
#pragma unroll
        for (int nh = 0; nh < 2; ++nh) {
          uint4 qf[3];  // (one 8-head half at a time: the o accumulators stay live through this loop)
#pragma unroll
          for (int pp = 0; pp < 3; ++pp) qf[pp] = qs[((kb * 2 + nh) * 3 + pp) * 32 + lane];
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            if (m == 1 && !second) continue;
            float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int hs = 0; hs < 2; ++hs) {
              const uint32_t a[4] = {word(kv[m][0], 2 * hs), word(kv[m][1], 2 * hs), word(kv[m][0], 2 * hs + 1),
                                     word(kv[m][1], 2 * hs + 1)};
#pragma unroll
              for (int pp = 2; pp >= 0; --pp) mma_bf16(f, a, word(qf[pp], 2 * hs), word(qf[pp], 2 * hs + 1));
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) sacc[m][nh][c] = __fadd_rn(sacc[m][nh][c], f[c]);
          }
        }
      }
      // Sᵀ fragment: c0 = (key g, head 2t), c1 = (key g, head 2t + 1), c2, c3 = the same for key g + 8.
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int nh = 0; nh < 2; ++nh)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int key = 16 * (m0 + 4 * m) + g + 8 * (c >> 1), head = 8 * nh + 2 * t + (c & 1);
            if (m == 0 || second) sdst[head * kProbStride + key] = sacc[m][nh][c];
          }
    }
    __syncthreads();

    // The fold: 16 threads a head, thread j of a head takes keys j, j + 16, … (a fixed split; the
    // 16 partial maxima and sums then meet in a fixed butterfly). A score = (first half + second
    // half) · scale.
    {
      const int head = tid >> 4, j = tid & 15;
      float* pr = prob + head * kProbStride;
      const float* pr2 = prob2 + head * kProbStride;
      float mx = -__int_as_float(0x7f800000);
      for (int key = j; key < nk; key += 16) {
        const float sc = __fmul_rn(__fadd_rn(pr[key], pr2[key]), p.softmax_scale);
        pr[key] = sc;
        mx = fmaxf(mx, sc);
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float M = fmaxf(stM[head], mx);
      float sum = 0.0f;
      for (int key = j; key < kTile; key += 16) {
        const float e = key < nk ? expf(pr[key] - M) : 0.0f;
        pr[key] = e;
        sum += e;
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (j == 0) {
        const float alpha = expf(stM[head] - M);  // 0 at the first tile (e^−inf)
        stA[head] = alpha;
        stL[head] = __fadd_rn(__fmul_rn(stL[head], alpha), sum);
        stM[head] = M;
      }
    }
    __syncthreads();  // (prob2 is read no more: p's parts may overwrite it)
    // p's A fragments: slot (k16 step ks, lane g, t) holds heads g, g + 8 at the step's keys 2t, 2t + 1
    // and 2t + 8, 2t + 9, split in three.
    for (int slot = tid; slot < mt * 32; slot += kCoreThreads) {
      const int ks = slot / 32, sg = (slot % 32) >> 2, st = slot & 3, kk = 16 * ks + 2 * st;
      const float* r0 = prob + sg * kProbStride + kk;
      const float* r1 = prob + (sg + 8) * kProbStride + kk;
      const Split3 a0 = split3(r0[0], r0[1]), a1 = split3(r1[0], r1[1]), a2 = split3(r0[8], r0[9]), a3 = split3(r1[8], r1[9]);
      uint4* q = ps + ks * 3 * 32 + (slot % 32);
      q[0] = make_uint4(a0.hi, a1.hi, a2.hi, a3.hi);
      q[32] = make_uint4(a0.mid, a1.mid, a2.mid, a3.mid);
      q[64] = make_uint4(a0.lo, a1.lo, a2.lo, a3.lo);
    }
    __syncthreads();

    // o: warp w owns columns 64w … 64w + 63; lane (g, t) loads 8 of them (64w + 8g …) from each of the
    // step's keys 2t, 2t + 1, 2t + 8, 2t + 9; column 8g + e is the B column g of 8-column tile e, so
    // tile e's output column n is 64w + 8n + e and a lane ends with 16 consecutive columns a head.
    if (warp < groups) {
      const float al0 = stA[g], al1 = stA[g + 8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        acc[e][0] = __fmul_rn(acc[e][0], al0), acc[e][1] = __fmul_rn(acc[e][1], al0);
        acc[e][2] = __fmul_rn(acc[e][2], al1), acc[e][3] = __fmul_rn(acc[e][3], al1);
      }
      const int col = 64 * warp + 8 * g;
      for (int ks0 = 0; ks0 < mt; ks0 += 2) {
        float f[8][4];
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e][0] = f[e][1] = f[e][2] = f[e][3] = 0.0f;
#pragma unroll
        for (int hs = 0; hs < 2; ++hs) {
          const int ks = ks0 + hs, kk = 16 * ks + 2 * t;
          if (ks >= mt) break;  // (warp-uniform) an odd last step
          uint4 v[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int key = kk + (r & 1) + 8 * (r >> 1);
            v[r] = load8<FAST>(key < nk ? p.cache + int64_t(rows[key]) * D : nullptr, col, Lr);
          }
          const uint4* pa = ps + ks * 3 * 32 + lane;
          const uint4 ph = pa[0], pm = pa[32], pl = pa[64];
          const uint32_t ah[4] = {ph.x, ph.y, ph.z, ph.w}, am[4] = {pm.x, pm.y, pm.z, pm.w}, alo[4] = {pl.x, pl.y, pl.z, pl.w};
#pragma unroll
          for (int w2 = 0; w2 < 4; ++w2) {
            // bf16x2 of (key 2t, key 2t + 1) and (key 2t + 8, key 2t + 9) at column 8g + 2·w2 (+ 1).
            const uint32_t b0e = __byte_perm(word(v[0], w2), word(v[1], w2), 0x5410);
            const uint32_t b0o = __byte_perm(word(v[0], w2), word(v[1], w2), 0x7632);
            const uint32_t b1e = __byte_perm(word(v[2], w2), word(v[3], w2), 0x5410);
            const uint32_t b1o = __byte_perm(word(v[2], w2), word(v[3], w2), 0x7632);
            mma_bf16(f[2 * w2], alo, b0e, b1e);
            mma_bf16(f[2 * w2], am, b0e, b1e);
            mma_bf16(f[2 * w2], ah, b0e, b1e);
            mma_bf16(f[2 * w2 + 1], alo, b0o, b1o);
            mma_bf16(f[2 * w2 + 1], am, b0o, b1o);
            mma_bf16(f[2 * w2 + 1], ah, b0o, b1o);
          }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[e][c] = __fadd_rn(acc[e][c], f[e][c]);
      }
    }
  }

  // Lane (g, t) of warp w holds, for head g (c = 0, 1) and head g + 8 (c = 2, 3), the columns
  // 64w + 16t + 8·(c & 1) + e, e = 0 … 7.
  if (warp >= groups) return;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int head = g + 8 * hh;
    if (h0 + head >= p.H) continue;
    const int64_t ih = i * p.H + h0 + head;
    const float L = stL[head];
    float* dst = S == 1 ? p.olat + ih * Lr : p.part + ((li * p.H + h0 + head) * kMaxChunks + z) * (Lr + 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c0 = 64 * warp + 16 * t + 8 * half;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (FAST || c0 + e < Lr) {
          const float o = acc[e][2 * hh + half];
          dst[c0 + e] = S == 1 ? __fdiv_rn(o, L) : o;
        }
    }
    if (S > 1 && warp == 0 && t == 0) dst[Lr] = stM[head], dst[Lr + 1] = L;
  }
}

// o_lat of a list of S > 1 chunks (grid (rows, H), row i0 + blockIdx.x): M = max m_s, w_s = e^(m_s − M),
// o_lat = Σ_s w_s o_s / Σ_s w_s l_s, chunks in order (one chunk would give o_0 / l_0, what the core
// kernel writes itself).
__global__ void mla_combine_kernel(MlaParams p, int64_t i0) {
  pdl_wait();
  pdl_trigger();
  const int64_t li = blockIdx.x, i = i0 + li, h = blockIdx.y, Lr = p.Lr;
  const int len = p.keys.start[i] + p.keys.cnt[i];
  if (short_list(len)) return;
  const int C = int(chunk_keys(len)), S = (len + C - 1) / C;
  if (S <= 1) return;
  const float* part = p.part + (li * p.H + h) * kMaxChunks * (Lr + 4);
  float M = -__int_as_float(0x7f800000);
  for (int z = 0; z < S; ++z) M = fmaxf(M, part[z * (Lr + 4) + Lr]);
  float L = 0.0f;
  for (int z = 0; z < S; ++z) L = __fadd_rn(L, __fmul_rn(expf(part[z * (Lr + 4) + Lr] - M), part[z * (Lr + 4) + Lr + 1]));
  for (int64_t q = threadIdx.x; q < Lr / 4; q += blockDim.x) {
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int z = 0; z < S; ++z) {
      const float w = expf(part[z * (Lr + 4) + Lr] - M);
      const float4 u = reinterpret_cast<const float4*>(part + z * (Lr + 4))[q];
      o = make_float4(__fadd_rn(o.x, __fmul_rn(w, u.x)), __fadd_rn(o.y, __fmul_rn(w, u.y)), __fadd_rn(o.z, __fmul_rn(w, u.z)),
                      __fadd_rn(o.w, __fmul_rn(w, u.w)));
    }
    reinterpret_cast<float4*>(p.olat + (i * p.H + h) * Lr)[q] =
        make_float4(__fdiv_rn(o.x, L), __fdiv_rn(o.y, L), __fdiv_rn(o.z, L), __fdiv_rn(o.w, L));
  }
}

// out[i, h, d] = W_UV[h][d] · o_lat[i, h]: grid (ceil(dv / 8), H, ceil(n / NR)), a warp per value d
// and pass of up to NR rows of head h (each W_UV load feeds NR rows; the block's 8 warps share the
// rows' o_lat through shared memory). Per output the lanes' chains and the butterfly are the same
// whatever NR.
template <int NR>
__global__ void __launch_bounds__(256) wuv_kernel(MlaParams p) {
  __shared__ float2 ol[NR][kLrMax / 2];  // o_lat of the pass's rows as pairs
  pdl_wait();
  pdl_trigger();
  const int64_t h = blockIdx.y, Lr = p.Lr, i0 = int64_t(blockIdx.z) * NR;
  const int64_t d = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int nr = p.n - i0 < NR ? int(p.n - i0) : NR;
  for (int r = 0; r < nr; ++r) {
    const float2* o2 = reinterpret_cast<const float2*>(p.olat + ((i0 + r) * p.H + h) * Lr);
    for (int64_t q = threadIdx.x; q < Lr / 2; q += 256) ol[r][q] = o2[q];
  }
  __syncthreads();
  if (d >= p.dv) return;
  const uint32_t* w2 = reinterpret_cast<const uint32_t*>(p.kv_b + (h * (p.dn + p.dv) + p.dn + d) * Lr);
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
#pragma unroll 4
  for (int64_t q = lane; q < Lr / 2; q += 32) {
    const uint32_t v = __ldg(w2 + q);
    const float lo = bf16_lo(v), hi = bf16_hi(v);
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (r < nr) {
        const float2 o = ol[r][q];
        acc[r] = fmaf(lo, o.x, acc[r]);
        acc[r] = fmaf(hi, o.y, acc[r]);
      }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && r < nr) p.out[((i0 + r) * p.H + h) * p.dv + d] = s;
  }
}

// The > 48 KB opt-in of mla_short_kernel<HB>, once per device — for every HB on every call, not only the
// one launched: a graph may be captured at a batch whose HB no earlier launch used (CudaTarget opts in
// during its first, uncaptured forward, and capture never meets a first-time attribute call).
template <int HB>
void opt_in_short(const MlaParams& p) {
  static std::atomic<uint64_t> opted{0};  // devices whose limit has been raised
  if (short_smem(p.Lr, p.dr, HB) > 48 * 1024)
    opt_in_smem(mla_short_kernel<HB>, int(kMaxSmem), opted, "cudaFuncSetAttribute(mla_short_kernel)");
}

// Every row of the batch; a head's bits never depend on HB (mla_short_kernel).
template <int HB>
void launch_short(const MlaParams& p, cudaStream_t s) {
  launch("mla short", mla_short_kernel<HB>, dim3(unsigned(p.n), unsigned(p.H / HB)), dim3(kShortThreads),
         short_smem(p.Lr, p.dr, HB), s, p);
}

}  // namespace

int64_t mla_core_launch_rows() {
  static const int64_t forced = env_count("KDTREE_CUDA_MLA_LAUNCH_ROWS", 0);
  return forced > 0 ? forced : kMlaCoreLaunchRows;
}

int64_t mla_max_keys(int64_t, int64_t) {
  // The core folds a chunk's keys tile by tile, so shared memory does not bound a list; a key
  // position is an int32 (KeyLists), and kMaxChunks chunks of that many tiles stay far inside it.
  return int64_t(1) << 30;
}

int64_t mla_part_floats(int64_t n, int64_t H, int64_t Lr) { return std::min<int64_t>(n, mla_core_launch_rows()) * H * kMaxChunks * (Lr + 4); }

int64_t mla_qfrag_bytes(int64_t n, int64_t H, int64_t Lr, int64_t dr) {
  return std::min<int64_t>(n, mla_core_launch_rows()) * ((H + kHeads - 1) / kHeads) * qfrag_uint4s(Lr + dr) * 16;
}

void mla_attention(const MlaParams& p, cudaStream_t s) {
  if (p.dn > 512) fail("CUDA MLA: qk_nope_head_dim ", p.dn, " exceeds 512");
  if (p.Lr > kLrMax) fail("CUDA MLA: kv_lora_rank ", p.Lr, " exceeds ", kLrMax, " (a 64-column o group a warp of the core)");
  if (p.Lr % 4 || p.dr % 4 || p.Lr <= 0 || p.dr < 0)
    fail("CUDA MLA: kv_lora_rank (", p.Lr, ") must be a positive multiple of 4 and qk_rope_head_dim (", p.dr,
         ") a multiple of 4 (8-byte latent loads)");
  if (p.max_keys < 1) fail("CUDA MLA: the rows' key lists are bounded by ", p.max_keys, " keys; every row attends to at least itself");
  if (p.max_keys > mla_max_keys(p.Lr, p.dr)) fail("CUDA MLA: ", p.max_keys, " keys exceed the limit of ", mla_max_keys(p.Lr, p.dr));
  const size_t smem = core_smem(p.Lr + p.dr);
  if (smem > kMaxSmem || short_smem(p.Lr, p.dr, 1) > kMaxSmem)
    fail("CUDA MLA: a latent row of ", p.Lr + p.dr, " columns needs ", std::max(smem, short_smem(p.Lr, p.dr, 1)),
         " bytes of shared memory in the attention kernels (limit ", kMaxSmem, ")");
  // The most chunks any list of ≤ max_keys keys is cut into: a list of u ≤ kMaxChunks units has u
  // chunks, a longer one kMaxChunks — not the chunk count of a max_keys-long list itself, which is
  // smaller for max_keys past kMaxChunks units (1100 keys: 9 chunks of 128, while a 1000-key row of the
  // same launch has 16 of 64). Blocks past a row's own count return at once.
  const bool any_long = !short_list(p.max_keys);  // (else every row is the CUDA-core kernel's)
  const int64_t chunks = std::min<int64_t>(kMaxChunks, (p.max_keys + kChunkUnit - 1) / kChunkUnit);
  if (any_long && chunks > 1 && p.part == nullptr) fail("CUDA MLA: ", p.max_keys, " keys need the chunk partials buffer (MlaParams::part)");
  if (any_long && p.qfrag == nullptr) fail("CUDA MLA: no q fragment buffer (MlaParams::qfrag, mla_qfrag_bytes)");
  if (!p.q || !p.kv_b || !p.cache || !p.out || !p.qlat || !p.olat)
    fail("CUDA MLA: an operand is missing (MlaParams q, kv_b, cache, out, qlat and olat must all be set)");
  static std::atomic<uint64_t> opted_fast{0}, opted_guarded{0};  // devices whose limit has been raised
  const bool fast = (p.Lr + p.dr) % 32 == 0 && p.Lr % 64 == 0;
  auto* core = fast ? mla_core_kernel<true> : mla_core_kernel<false>;
  // (Every call, whether or not a row is long: a decode after a short prompt launches no core, and the
  // graph captured next — at the capacity bound — must not be the first to set the attribute.)
  opt_in_smem(core, int(kMaxSmem), fast ? opted_fast : opted_guarded, "cudaFuncSetAttribute(mla_core_kernel)");
  opt_in_short<1>(p);
  opt_in_short<2>(p);
  opt_in_short<4>(p);
  // One row (a decode step) takes the one-row instantiations: the same chains, no idle row slots.
  const unsigned passes = unsigned((p.n + kRowPass - 1) / kRowPass);
  const unsigned lat_blocks = unsigned((p.Lr / 2 + 63) / 64);
  if (p.n == 1)
    launch("mla qlat", qlat_kernel<1>, dim3(unsigned(p.H), lat_blocks, 1), dim3(256), 0, s, p);
  else
    launch("mla qlat", qlat_kernel<kRowPass>, dim3(unsigned(p.H), lat_blocks, passes), dim3(256), 0, s, p);
  // Short lists: every row in one launch (rows with a longer list return at once). Heads a block:
  // as many as keep ≥ 256 blocks (two a multiprocessor) — each head of a block shares its key loads
  // — a decode row keeps one a block. Speed only: HB never changes a head's bits.
  if (p.H % 4 == 0 && p.n * p.H / 4 >= 256)
    launch_short<4>(p, s);
  else if (p.H % 2 == 0 && p.n * p.H / 2 >= 256)
    launch_short<2>(p, s);
  else
    launch_short<1>(p, s);
  // Longer lists, mla_core_launch_rows() rows a launch (the q fragment and partials buffers hold that many): their
  // q fragments, the core, and the combine when a list may span chunks (rows with a short list return
  // at once; a captured graph, sized for its capacity, launches both kernels every step).
  const unsigned head_blocks = unsigned((p.H + kHeads - 1) / kHeads), kbs = unsigned((p.Lr + p.dr + 31) / 32);
  const int64_t launch_rows = mla_core_launch_rows();
  for (int64_t i0 = 0; any_long && i0 < p.n; i0 += launch_rows) {
    const int64_t rows = std::min<int64_t>(launch_rows, p.n - i0);
    launch("mla qfrag", mla_qfrag_kernel, dim3(unsigned(rows), head_blocks, kbs), dim3(kQfragThreads), 0, s, p, i0);
    const dim3 grid(unsigned(rows), head_blocks, unsigned(chunks));
    launch("mla core", core, grid, dim3(kCoreThreads), smem, s, p, i0);
    if (chunks > 1) launch("mla combine", mla_combine_kernel, dim3(unsigned(rows), unsigned(p.H)), dim3(128), 0, s, p, i0);
  }
  const unsigned wblocks = unsigned((p.dv + 7) / 8);
  if (p.n == 1)
    launch("mla wuv", wuv_kernel<1>, dim3(wblocks, unsigned(p.H), 1), dim3(256), 0, s, p);
  else
    launch("mla wuv", wuv_kernel<kRowPass>, dim3(wblocks, unsigned(p.H), passes), dim3(256), 0, s, p);
}

}  // namespace kd::cuda
