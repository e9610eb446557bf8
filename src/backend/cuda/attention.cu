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

constexpr int kThreads = 256;
constexpr size_t kMaxSmem = 227 * 1024;  // Hopper's per-block opt-in limit

// q_lat[i, h, :] = W_UKᵀ q_nope[i, h]: grid (n·H, ceil(Lr / 128)), 256 threads = 64 latent pairs
// (bf16x2 loads coalesced across the warp) × 4 quarters of d, whose partial sums are added in
// quarter order — a split fixed by the shape, so rows stay invariant; 4× the loads in flight.
__global__ void __launch_bounds__(256) qlat_kernel(MlaParams p) {
  __shared__ float qn[512];
  __shared__ float2 part[4][64];
  const int64_t ih = blockIdx.x, h = ih % p.H, Lr = p.Lr, dn = p.dn;
  const float* qi = p.q + ih * (dn + p.dr);
  for (int64_t d = threadIdx.x; d < dn; d += 256) qn[d] = qi[d];
  __syncthreads();
  const int quarter = threadIdx.x >> 6, j = threadIdx.x & 63;
  const int64_t l2 = int64_t(blockIdx.y) * 64 + j;  // latent pair
  const int64_t d0 = quarter * ((dn + 3) / 4), d1 = min(dn, d0 + (dn + 3) / 4);
  float a0 = 0.0f, a1 = 0.0f;
  if (l2 < Lr / 2) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p.kv_b + h * (dn + p.dv) * Lr) + l2;
#pragma unroll 16
    for (int64_t d = d0; d < d1; ++d) {
      const uint32_t v = __ldg(w + d * (Lr / 2));
      a0 = fmaf(qn[d], bf16_lo(v), a0);
      a1 = fmaf(qn[d], bf16_hi(v), a1);
    }
  }
  part[quarter][j] = make_float2(a0, a1);
  __syncthreads();
  if (quarter != 0 || l2 >= Lr / 2) return;
  float2 t = part[0][j];
#pragma unroll
  for (int k = 1; k < 4; ++k) {
    t.x = __fadd_rn(t.x, part[k][j].x);
    t.y = __fadd_rn(t.y, part[k][j].y);
  }
  p.qlat[ih * Lr + 2 * l2] = t.x;
  p.qlat[ih * Lr + 2 * l2 + 1] = t.y;
}

// Scores, softmax and o_lat for one (row, head). Shared: q_lat [Lr] | q_pe [dr] | red [32] | p [len].
__global__ void __launch_bounds__(kThreads) mla_core_kernel(MlaParams p) {
  extern __shared__ float sm[];
  const int64_t i = blockIdx.x, h = blockIdx.y, Lr = p.Lr, dr = p.dr, dn = p.dn, D = Lr + dr, ih = i * p.H + h;
  float* qlat = sm;
  float* qpe = qlat + Lr;
  float* red = qpe + dr;
  float* prob = red + 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = kThreads / 32;
  for (int64_t l = tid; l < Lr; l += kThreads) qlat[l] = p.qlat[ih * Lr + l];
  for (int64_t d = tid; d < dr; d += kThreads) qpe[d] = p.q[ih * (dn + dr) + dn + d];
  __syncthreads();

  const KeyLists& k = p.keys;
  const int64_t start = k.start[i], len = start + k.cnt[i], bt = k.bt;
  const int32_t* table = k.tables + k.tab[i];
  const int32_t* vis = k.vis + k.voff[i];
  const int32_t* wrow = k.wrow + k.base[i];
  auto key_row = [&](int64_t t) -> int64_t {
    return t < start ? int64_t(table[t / bt]) * bt + t % bt : int64_t(wrow[vis[t - start]]);
  };

  // Scores: one warp per key, lanes over bf16 pairs of the latent.
  for (int64_t t = warp; t < len; t += nw) {
    const uint32_t* k2 = reinterpret_cast<const uint32_t*>(p.cache + key_row(t) * D);
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
  __syncthreads();
  float mx = -__int_as_float(0x7f800000);
  for (int64_t t = tid; t < len; t += kThreads) mx = fmaxf(mx, prob[t]);
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (int64_t t = tid; t < len; t += kThreads) {
    const float e = expf(prob[t] - mx);
    prob[t] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  for (int64_t t = tid; t < len; t += kThreads) prob[t] = __fdiv_rn(prob[t], sum);
  __syncthreads();

  // o_lat: one thread per pair of latent values (bf16x2 loads), keys in list order.
  for (int64_t l2 = tid; l2 < Lr / 2; l2 += kThreads) {
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 8
    for (int64_t t = 0; t < len; ++t) {
      const uint32_t v = reinterpret_cast<const uint32_t*>(p.cache + key_row(t) * D)[l2];
      a0 = fmaf(prob[t], bf16_lo(v), a0);
      a1 = fmaf(prob[t], bf16_hi(v), a1);
    }
    p.olat[ih * Lr + 2 * l2] = a0;
    p.olat[ih * Lr + 2 * l2 + 1] = a1;
  }
}

// out[i, h, d] = W_UV[h][d] · o_lat[i, h]: one warp per output value, 8 warps a block.
__global__ void __launch_bounds__(256) wuv_kernel(MlaParams p) {
  const int64_t wid = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (wid >= p.n * p.H * p.dv) return;
  const int64_t d = wid % p.dv, ih = wid / p.dv, h = ih % p.H, Lr = p.Lr;
  const uint32_t* w2 = reinterpret_cast<const uint32_t*>(p.kv_b + (h * (p.dn + p.dv) + p.dn + d) * Lr);
  const float2* o2 = reinterpret_cast<const float2*>(p.olat + ih * Lr);
  float acc = 0.0f;
#pragma unroll 8
  for (int64_t q = lane; q < Lr / 2; q += 32) {
    const uint32_t v = __ldg(w2 + q);
    const float2 o = o2[q];
    acc = fmaf(bf16_lo(v), o.x, acc);
    acc = fmaf(bf16_hi(v), o.y, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) p.out[ih * p.dv + d] = acc;
}

size_t smem_bytes(int64_t Lr, int64_t dr, int64_t len) { return size_t(Lr + dr + 32 + len) * sizeof(float); }

}  // namespace

int64_t mla_max_keys(int64_t Lr, int64_t dr) { return int64_t(kMaxSmem / sizeof(float)) - (Lr + dr + 32); }

void mla_attention(const MlaParams& p, cudaStream_t s) {
  if (p.dn > 512) fail("CUDA MLA: qk_nope_head_dim ", p.dn, " exceeds 512");
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
  qlat_kernel<<<dim3(unsigned(p.n * p.H), unsigned((p.Lr / 2 + 63) / 64)), 256, 0, s>>>(p);
  check_launch("mla qlat");
  mla_core_kernel<<<dim3(unsigned(p.n), unsigned(p.H)), kThreads, smem_bytes(p.Lr, p.dr, len_max), s>>>(p);
  check_launch("mla core");
  wuv_kernel<<<unsigned((p.n * p.H * p.dv + 7) / 8), 256, 0, s>>>(p);
  check_launch("mla wuv");
}

}  // namespace kd::cuda
