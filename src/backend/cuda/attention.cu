// Absorbed MLA attention over the bf16 latent cache, for decode, tree verify and prefill alike
// (SPEC-MODEL.md §2, the decode form of vLLM/FlashMLA). Three kernels, so a single decode row
// still spreads the W_UK / W_UV reads (16.8 MB a layer for K2) over the whole GPU:
//   q_lat = W_UKᵀ q_nope                                  [Lr]    qlat_kernel (kv_b rows of the head)
//   s_t   = (q_lat · c_kv[t] + q_pe · k_pe[t]) · scale     over the row's key list
//   p     = softmax(s);  o_lat = Σ_t p_t c_kv[t]           [Lr]    mla_core_kernel, per (row, head)
//   out   = W_UV o_lat                                    [dv]    wuv_kernel, a warp per value
// The key list of row i (kernels.h KeyLists) is its sequence's committed rows 0 … start−1 (through
// the block table of a paged cache) followed by the new rows it may see (its tree ancestors and
// itself, ascending): exactly the list of the AR step for the same prefix, and every reduction is
// ordered by position in that list — so a verified node reproduces its AR step bit for bit whatever
// the tree, the batch or the paging around it (no public Hopper MLA kernel takes a tree mask).
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kd::cuda {

namespace {

constexpr int kCoreThreads = 512;  // mla_core_kernel: 16 warps
constexpr int kKeyTile = 512;      // key rows resolved into shared memory at a time
constexpr int kRowPass = 8;        // qlat / wuv: rows that share one read of a weight
constexpr size_t kMaxSmem = 227 * 1024;  // Hopper's per-block opt-in limit

// q_lat[i, h, :] = W_UKᵀ q_nope[i, h]: grid (H, ceil(Lr / 128), ceil(n / NR)), 256 threads = 64
// latent pairs (bf16x2 loads coalesced across the warp) × 4 quarters of d, whose partial sums are
// added in quarter order — a split fixed by the shape, so rows stay invariant. A block serves up to
// NR rows of one head: each W_UK load feeds NR rows (the head's 128 KB is read once per NR rows,
// not once per row). Per output the chain is the same whatever NR and the rows around it.
template <int NR>
__global__ void __launch_bounds__(256) qlat_kernel(MlaParams p) {
  __shared__ float qn[NR][512];
  __shared__ float2 part[4][NR][64];
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

// Thread groups of mla_core_kernel's o_lat phase: a group holds a thread per latent pair (rounded up
// to whole warps) and takes every G-th key; G is a rule of Lr alone, so rows stay invariant.
__host__ __device__ constexpr int core_groups(int64_t Lr) {
  const int64_t per = (Lr / 2 + 31) / 32 * 32;
  return per >= kCoreThreads ? 1 : int(kCoreThreads / per);
}

// Scores, softmax and o_lat for one (row, head). Shared: q_lat [Lr] | q_pe [dr] | red [32] |
// rows [kKeyTile] (int32) | p [len] | the o_lat partials of groups 1 … G − 1 [G − 1][Lr].
// Key list positions are resolved to cache rows a tile at a time (one division a key, by all threads
// at once); every reduction is ordered by list position: a key's score (lanes over the latent, then
// the warp's butterfly), the softmax sums (fixed by blockDim), and o_lat (group g sums keys g, g + G,
// … in order; the G partials are added in group order).
__global__ void __launch_bounds__(kCoreThreads) mla_core_kernel(MlaParams p) {
  extern __shared__ float sm[];
  const int64_t i = blockIdx.x, h = blockIdx.y, Lr = p.Lr, dr = p.dr, dn = p.dn, D = Lr + dr, ih = i * p.H + h;
  const int G = core_groups(Lr);
  float* qlat = sm;
  float* qpe = qlat + Lr;
  float* red = qpe + dr;
  int32_t* rows = reinterpret_cast<int32_t*>(red + 32);
  float* prob = reinterpret_cast<float*>(rows + kKeyTile);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = kCoreThreads / 32;
  for (int64_t l = tid; l < Lr; l += kCoreThreads) qlat[l] = p.qlat[ih * Lr + l];
  for (int64_t d = tid; d < dr; d += kCoreThreads) qpe[d] = p.q[ih * (dn + dr) + dn + d];

  const KeyLists& k = p.keys;
  const int start = k.start[i], len = start + k.cnt[i], bt = int(k.bt);
  const int32_t* table = k.tables + k.tab[i];
  const int32_t* vis = k.vis + k.voff[i];
  const int32_t* wrow = k.wrow + k.base[i];
  // rows[j] = the cache row of list position t0 + j, for the tile [t0, t0 + kKeyTile).
  auto resolve = [&](int t0) {
    __syncthreads();  // the previous tile's rows are no longer read
    for (int j = tid; j < kKeyTile && t0 + j < len; j += kCoreThreads) {
      const int t = t0 + j;
      rows[j] = t < start ? table[t / bt] * bt + t % bt : wrow[vis[t - start]];
    }
    __syncthreads();
  };

  // Scores: one warp per key, lanes over bf16 pairs of the latent.
  for (int t0 = 0; t0 < len; t0 += kKeyTile) {
    resolve(t0);
    for (int t = t0 + warp; t < min(len, t0 + kKeyTile); t += nw) {
      const uint32_t* k2 = reinterpret_cast<const uint32_t*>(p.cache + int64_t(rows[t - t0]) * D);
      float a = 0.0f, b = 0.0f;
#pragma unroll 8
      for (int64_t q = lane; q < Lr / 2; q += 32) {
        const uint32_t v = k2[q];
        a = fmaf(qlat[2 * q], bf16_lo(v), a);
        a = fmaf(qlat[2 * q + 1], bf16_hi(v), a);
      }
      for (int64_t q = lane; q < dr / 2; q += 32) {
        const uint32_t v = k2[Lr / 2 + q];
        b = fmaf(qpe[2 * q], bf16_lo(v), b);
        b = fmaf(qpe[2 * q + 1], bf16_hi(v), b);
      }
      a = warp_sum(a);
      b = warp_sum(b);
      if (lane == 0) prob[t] = __fmul_rn(__fadd_rn(a, b), p.softmax_scale);
    }
  }
  __syncthreads();
  float mx = -__int_as_float(0x7f800000);
  for (int t = tid; t < len; t += kCoreThreads) mx = fmaxf(mx, prob[t]);
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (int t = tid; t < len; t += kCoreThreads) {
    const float e = expf(prob[t] - mx);
    prob[t] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  for (int t = tid; t < len; t += kCoreThreads) prob[t] = __fdiv_rn(prob[t], sum);

  // o_lat: group g = tid / per, thread = one latent pair (bf16x2 loads), keys g, g + G, … of each tile.
  const int per = kCoreThreads / G, g = tid / per;
  const int64_t l2 = tid % per;
  float a0 = 0.0f, a1 = 0.0f;
  for (int t0 = 0; t0 < len; t0 += kKeyTile) {
    resolve(t0);  // (its first barrier also publishes prob)
    if (g < G && l2 < Lr / 2) {
      const int t1 = min(len, t0 + kKeyTile);
#pragma unroll 8
      for (int t = t0 + g; t < t1; t += G) {
        const uint32_t v = reinterpret_cast<const uint32_t*>(p.cache + int64_t(rows[t - t0]) * D)[l2];
        a0 = fmaf(prob[t], bf16_lo(v), a0);
        a1 = fmaf(prob[t], bf16_hi(v), a1);
      }
    }
  }
  float* partial = prob + len;  // [G − 1][Lr]
  if (g >= 1 && g < G && l2 < Lr / 2) {
    partial[(g - 1) * Lr + 2 * l2] = a0;
    partial[(g - 1) * Lr + 2 * l2 + 1] = a1;
  }
  __syncthreads();
  if (g != 0 || l2 >= Lr / 2) return;
  for (int gg = 1; gg < G; ++gg) {
    a0 = __fadd_rn(a0, partial[(gg - 1) * Lr + 2 * l2]);
    a1 = __fadd_rn(a1, partial[(gg - 1) * Lr + 2 * l2 + 1]);
  }
  p.olat[ih * Lr + 2 * l2] = a0;
  p.olat[ih * Lr + 2 * l2 + 1] = a1;
}

// out[i, h, d] = W_UV[h][d] · o_lat[i, h]: grid (ceil(dv / 8), H, ceil(n / NR)), a warp per value d
// and pass of up to NR rows of head h (each W_UV load feeds NR rows; the block's 8 warps share the
// rows' o_lat through shared memory). Per output the lanes' chains and the butterfly are the same
// whatever NR.
template <int NR>
__global__ void __launch_bounds__(256) wuv_kernel(MlaParams p) {
  __shared__ float2 ol[NR][kCoreThreads];  // o_lat of the pass's rows as pairs (Lr / 2 ≤ kCoreThreads)
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

size_t smem_bytes(int64_t Lr, int64_t dr, int64_t len) {
  return size_t(Lr + dr + 32 + kKeyTile + len + (core_groups(Lr) - 1) * Lr) * sizeof(float);
}

}  // namespace

int64_t mla_max_keys(int64_t Lr, int64_t dr) {
  return int64_t(kMaxSmem / sizeof(float)) - (Lr + dr + 32 + kKeyTile + (core_groups(Lr) - 1) * Lr);
}

void mla_attention(const MlaParams& p, cudaStream_t s) {
  if (p.dn > 512) fail("CUDA MLA: qk_nope_head_dim ", p.dn, " exceeds 512");
  if (p.Lr / 2 > kCoreThreads) fail("CUDA MLA: kv_lora_rank ", p.Lr, " exceeds ", 2 * kCoreThreads, " (a thread per latent pair)");
  if (p.Lr % 2 || p.dr % 2) fail("CUDA MLA: kv_lora_rank (", p.Lr, ") and qk_rope_head_dim (", p.dr, ") must be even");
  const int64_t len_max = p.max_keys;
  if (len_max > mla_max_keys(p.Lr, p.dr))
    fail("CUDA MLA: ", len_max, " keys exceed this kernel's limit of ", mla_max_keys(p.Lr, p.dr), " (shared-memory scores)");
  static bool raised = false;  // the opt-in above 48 KB is a per-function attribute, set once
  if (!raised) {
    check(cudaFuncSetAttribute(mla_core_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxSmem)),
          "cudaFuncSetAttribute(mla_core_kernel)");
    raised = true;
  }
  // One row (a decode step) takes the one-row instantiations: the same chains, no idle row slots.
  const unsigned passes = unsigned((p.n + kRowPass - 1) / kRowPass);
  if (p.n == 1)
    qlat_kernel<1><<<dim3(unsigned(p.H), unsigned((p.Lr / 2 + 63) / 64), 1), 256, 0, s>>>(p);
  else
    qlat_kernel<kRowPass><<<dim3(unsigned(p.H), unsigned((p.Lr / 2 + 63) / 64), passes), 256, 0, s>>>(p);
  check_launch("mla qlat");
  mla_core_kernel<<<dim3(unsigned(p.n), unsigned(p.H)), kCoreThreads, smem_bytes(p.Lr, p.dr, len_max), s>>>(p);
  check_launch("mla core");
  const unsigned wblocks = unsigned((p.dv + 7) / 8);
  if (p.n == 1)
    wuv_kernel<1><<<dim3(wblocks, unsigned(p.H), 1), 256, 0, s>>>(p);
  else
    wuv_kernel<kRowPass><<<dim3(wblocks, unsigned(p.H), passes), 256, 0, s>>>(p);
  check_launch("mla wuv");
}

}  // namespace kd::cuda
