// Absorbed MLA attention over the bf16 latent cache, for decode, tree verify and prefill alike
// (SPEC-MODEL.md §2, the decode form of vLLM/FlashMLA). Three kernels, so a single decode row
// still spreads the W_UK / W_UV reads (16.8 MB a layer for K2) over the whole GPU:
//   q_lat = W_UKᵀ q_nope                                  [Lr]    qlat_kernel (kv_b rows of the head)
//   s_t   = (q_lat · c_kv[t] + q_pe · k_pe[t]) · scale     over the row's key list
//   p     = softmax(s);  o_lat = Σ_t p_t c_kv[t]           [Lr]    mla_core_kernel, per (row, head, chunk)
//                                                                 (+ mla_combine_kernel over chunks)
//   out   = W_UV o_lat                                    [dv]    wuv_kernel, a warp per value
// Long key lists are cut into up to kMaxChunks chunks of whole 512-key tiles (flash-decoding): each
// chunk's block keeps its own max m, sum l and o = Σ e^(s − m) c; the combine kernel rescales them.
// The cut depends only on the list's length (chunk_keys), so it is the same for an AR step and the
// tree node with the same prefix.
// The key list of row i (kernels.h KeyLists) is its sequence's committed rows 0 … start−1 (through
// the block table of a paged cache) followed by the new rows it may see (its tree ancestors and
// itself, ascending): exactly the list of the AR step for the same prefix, and every reduction is
// ordered by position in that list — so a verified node reproduces its AR step bit for bit whatever
// the tree, the batch or the paging around it (no public Hopper MLA kernel takes a tree mask).
#include <algorithm>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kd::cuda {

namespace {

constexpr int kCoreThreads = 512;  // mla_core_kernel: 16 warps
constexpr int kKeyTile = 512;      // key rows resolved into shared memory at a time
constexpr int kRowPass = 8;        // qlat / wuv: rows that share one read of a weight
constexpr int kMaxChunks = 16;     // key chunks of one (row, head) at most
constexpr int kChunkRows = 32;     // rows a chunked core launch covers (bounds the partials buffer)

// Keys a chunk of a len-key list holds: whole tiles, as few as keep ≤ kMaxChunks chunks.
__host__ __device__ constexpr int64_t chunk_keys(int64_t len) {
  const int64_t tiles = (len + kKeyTile - 1) / kKeyTile;
  return int64_t(kKeyTile) * ((tiles + kMaxChunks - 1) / kMaxChunks);
}
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

// Thread groups of mla_core_kernel's o_lat phase: a group holds a thread per latent quad (rounded up
// to whole warps) and takes every G-th key; G is a rule of Lr alone, so rows stay invariant.
__host__ __device__ constexpr int core_groups(int64_t Lr) {
  const int64_t per = (Lr / 4 + 31) / 32 * 32;
  return per >= kCoreThreads ? 1 : int(kCoreThreads / per);
}

// Batched block reductions of HB values (blockDim.x == kCoreThreads): value h is reduced exactly as
// block_sum / block_max reduce one (warp butterfly, then warp 0 over the warps' results in order), so
// a head's result does not depend on how many heads share the block. sh: ≥ 32 · HB floats.
template <int HB, bool MAX>
__device__ __forceinline__ void block_reduce(float (&v)[HB], float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = kCoreThreads / 32;
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

// Scores, softmax and o_lat for one row, HB heads and one key chunk (grid (rows, H / HB, chunks);
// row i = i0 + blockIdx.x). HB only decides which block computes a head, never how: every per-head
// reduction below is the one HB = 1 does, so the launch may pick HB by the batch (more heads a block
// share each key's load, the row resolution and the loop overhead) and rows stay bit-identical.
// Shared: q_lat [HB][Lr] | q_pe [HB][dr] | red [32·HB] | rows [kKeyTile] (int32) | e [HB][cap] |
// the o partials of groups 1 … G − 1 [HB][G − 1][Lr]. Key positions are resolved to cache rows a
// tile at a time (one division a key, by all threads at once); every reduction is ordered by list
// position: a key's score (lanes over latent quads, then the warp's butterfly), the chunk's max and
// sum (fixed by the block size), and o (group g sums keys g, g + G, … of the chunk in order; the G
// partials are added in group order). A list of one chunk is finished here (o / l); longer ones
// leave (o, m, l) a chunk in part [rows][H][kMaxChunks][Lr + 4] for mla_combine_kernel.
template <int HB>
__global__ void __launch_bounds__(kCoreThreads) mla_core_kernel(MlaParams p, int64_t i0, int64_t cap) {
  extern __shared__ float sm[];
  pdl_wait();
  pdl_trigger();
  const int64_t li = blockIdx.x, i = i0 + li, h0 = int64_t(blockIdx.y) * HB, Lr = p.Lr, dr = p.dr, dn = p.dn, D = Lr + dr;
  const KeyLists& k = p.keys;
  const int start = k.start[i], len = start + k.cnt[i], bt = int(k.bt);
  const int C = int(chunk_keys(len)), S = (len + C - 1) / C, z = int(blockIdx.z);
  if (z >= S) return;
  const int k0 = z * C, k1 = min(len, k0 + C);
  const int G = core_groups(Lr);
  float* qlat = sm;               // [HB][Lr]
  float* qpe = qlat + HB * Lr;    // [HB][dr]
  float* red = qpe + HB * dr;     // [32 · HB]
  int32_t* rows = reinterpret_cast<int32_t*>(red + 32 * HB);
  float* prob = reinterpret_cast<float*>(rows + kKeyTile);  // [HB][cap], index t − k0
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = kCoreThreads / 32;
  for (int h = 0; h < HB; ++h) {
    const int64_t ih = i * p.H + h0 + h;
    for (int64_t l = tid; l < Lr; l += kCoreThreads) qlat[h * Lr + l] = p.qlat[ih * Lr + l];
    const float* qr = p.q + ih * (dn + dr) + dn;
    if (p.rope_inv_freq == nullptr) {
      for (int64_t d = tid; d < dr; d += kCoreThreads) qpe[h * dr + d] = qr[d];
    } else {
      for (int64_t j = tid; j < dr / 2; j += kCoreThreads) {
        float a = qr[2 * j], b = qr[2 * j + 1];
        rope_pair(a, b, p.rope_inv_freq[j], p.rope_positions[i], p.rope_scaling);
        qpe[h * dr + 2 * j] = a;
        qpe[h * dr + 2 * j + 1] = b;
      }
    }
  }

  const int32_t* table = k.tables + k.tab[i];
  const int32_t* vis = k.vis + k.voff[i];
  const int32_t* wrow = k.wrow + k.base[i];
  // rows[j] = the cache row of list position t0 + j, for the tile [t0, t0 + kKeyTile) ∩ [t0, k1).
  auto resolve = [&](int t0) {
    __syncthreads();  // the previous tile's rows are no longer read
    for (int j = tid; j < kKeyTile && t0 + j < k1; j += kCoreThreads) {
      const int t = t0 + j;
      rows[j] = t < start ? table[t / bt] * bt + t % bt : wrow[vis[t - start]];
    }
    __syncthreads();
  };

  // Scores: one warp per key, lanes over latent quads (8-byte loads), each load used by HB heads.
  const int nq = int(Lr / 4), nqr = int(dr / 4);
  for (int t0 = k0; t0 < k1; t0 += kKeyTile) {
    resolve(t0);
    for (int t = t0 + warp; t < min(k1, t0 + kKeyTile); t += nw) {
      const uint2* k4 = reinterpret_cast<const uint2*>(p.cache + int64_t(rows[t - t0]) * D);
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
        if (lane == 0) prob[h * cap + t - k0] = __fmul_rn(__fadd_rn(sa, sb), p.softmax_scale);
      }
    }
  }
  __syncthreads();
  const int nk = k1 - k0;
  float mx[HB], sum[HB];
#pragma unroll
  for (int h = 0; h < HB; ++h) {
    mx[h] = -__int_as_float(0x7f800000);
    for (int t = tid; t < nk; t += kCoreThreads) mx[h] = fmaxf(mx[h], prob[h * cap + t]);
  }
  block_reduce<HB, true>(mx, red);
#pragma unroll
  for (int h = 0; h < HB; ++h) {
    sum[h] = 0.0f;
    for (int t = tid; t < nk; t += kCoreThreads) {
      const float e = expf(prob[h * cap + t] - mx[h]);
      prob[h * cap + t] = e;
      sum[h] += e;
    }
  }
  block_reduce<HB, false>(sum, red);

  // o: group g = tid / per, thread = one latent quad (8-byte loads), keys k0 + g, k0 + g + G, … of
  // each tile; each load feeds HB heads.
  const int per = kCoreThreads / G, g = tid / per, q = tid % per;
  const bool active = g < G && q < nq;
  float acc[HB][4];
#pragma unroll
  for (int h = 0; h < HB; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
  for (int t0 = k0; t0 < k1; t0 += kKeyTile) {
    resolve(t0);  // (its first barrier also publishes e)
    if (active) {
      const int t1 = min(k1, t0 + kKeyTile);
#pragma unroll 4
      for (int t = t0 + g; t < t1; t += G) {
        const uint2 v = reinterpret_cast<const uint2*>(p.cache + int64_t(rows[t - t0]) * D)[q];
        const float c0 = bf16_lo(v.x), c1 = bf16_hi(v.x), c2 = bf16_lo(v.y), c3 = bf16_hi(v.y);
#pragma unroll
        for (int h = 0; h < HB; ++h) {
          const float pr = prob[h * cap + t - k0];
          acc[h][0] = fmaf(pr, c0, acc[h][0]);
          acc[h][1] = fmaf(pr, c1, acc[h][1]);
          acc[h][2] = fmaf(pr, c2, acc[h][2]);
          acc[h][3] = fmaf(pr, c3, acc[h][3]);
        }
      }
    }
  }
  float* partial = prob + HB * cap;  // [HB][G − 1][Lr]
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
    const int64_t ih = i * p.H + h0 + h;
    if (S == 1) {
      reinterpret_cast<float4*>(p.olat + ih * Lr)[q] =
          make_float4(__fdiv_rn(o.x, sum[h]), __fdiv_rn(o.y, sum[h]), __fdiv_rn(o.z, sum[h]), __fdiv_rn(o.w, sum[h]));
    } else {
      float* c = p.part + ((li * p.H + h0 + h) * kMaxChunks + z) * (Lr + 4);
      reinterpret_cast<float4*>(c)[q] = o;
      if (q == 0) c[Lr] = mx[h], c[Lr + 1] = sum[h];
    }
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
  __shared__ float2 ol[NR][kCoreThreads];  // o_lat of the pass's rows as pairs (Lr / 2 ≤ kCoreThreads)
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

// mla_core_kernel<HB>'s shared memory for chunks of up to cap keys.
size_t smem_bytes(int64_t Lr, int64_t dr, int64_t cap, int HB) {
  return size_t(HB * (Lr + dr + 32 + cap + (core_groups(Lr) - 1) * Lr) + kKeyTile) * sizeof(float);
}

// Rows i0 … i0 + rows − 1; cap: the longest chunk, rounded up to whole quads (the partials after the
// scores stay 16-byte aligned); chunks: the most chunks a row of this launch has.
template <int HB>
void launch_core(const MlaParams& p, int64_t i0, int64_t rows, int64_t cap, int64_t chunks, cudaStream_t s) {
  static bool raised = false;  // the opt-in above 48 KB is a per-function attribute, set once
  if (!raised) {
    check(cudaFuncSetAttribute(mla_core_kernel<HB>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxSmem)),
          "cudaFuncSetAttribute(mla_core_kernel)");
    raised = true;
  }
  launch("mla core", mla_core_kernel<HB>, dim3(unsigned(rows), unsigned(p.H / HB), unsigned(chunks)), dim3(kCoreThreads),
         smem_bytes(p.Lr, p.dr, cap, HB), s, p, i0, cap);
}

}  // namespace

int64_t mla_max_keys(int64_t Lr, int64_t dr) {
  // kMaxChunks chunks of whole tiles, each within the shared memory of one head a block.
  const int64_t free = int64_t(kMaxSmem / sizeof(float)) - (Lr + dr + 32 + kKeyTile + (core_groups(Lr) - 1) * Lr);
  return kMaxChunks * (free / kKeyTile) * kKeyTile;
}

int64_t mla_part_floats(int64_t n, int64_t H, int64_t Lr) { return std::min<int64_t>(n, kChunkRows) * H * kMaxChunks * (Lr + 4); }

void mla_attention(const MlaParams& p, cudaStream_t s) {
  if (p.heads_per_block != 0 && p.heads_per_block != 1 && p.heads_per_block != 2 && p.heads_per_block != 4)
    fail("CUDA MLA: heads a block must be 0 (by the batch), 1, 2 or 4, not ", p.heads_per_block);
  if (p.dn > 512) fail("CUDA MLA: qk_nope_head_dim ", p.dn, " exceeds 512");
  if (p.Lr > 2 * kCoreThreads) fail("CUDA MLA: kv_lora_rank ", p.Lr, " exceeds ", 2 * kCoreThreads, " (W_UV's shared o_lat rows)");
  if (p.Lr % 4 || p.dr % 4)
    fail("CUDA MLA: kv_lora_rank (", p.Lr, ") and qk_rope_head_dim (", p.dr, ") must be multiples of 4 (8-byte latent loads)");
  if (p.max_keys > mla_max_keys(p.Lr, p.dr))
    fail("CUDA MLA: ", p.max_keys, " keys exceed this kernel's limit of ", mla_max_keys(p.Lr, p.dr), " (", kMaxChunks,
         " chunks of shared-memory scores)");
  const int64_t chunk = chunk_keys(p.max_keys), chunks = (p.max_keys + chunk - 1) / chunk;
  const int64_t cap = (std::min(p.max_keys, chunk) + 3) / 4 * 4;
  if (chunks > 1 && p.part == nullptr) fail("CUDA MLA: ", p.max_keys, " keys need the chunk partials buffer (MlaParams::part)");
  // One row (a decode step) takes the one-row instantiations: the same chains, no idle row slots.
  const unsigned passes = unsigned((p.n + kRowPass - 1) / kRowPass);
  const unsigned lat_blocks = unsigned((p.Lr / 2 + 63) / 64);
  if (p.n == 1)
    launch("mla qlat", qlat_kernel<1>, dim3(unsigned(p.H), lat_blocks, 1), dim3(256), 0, s, p);
  else
    launch("mla qlat", qlat_kernel<kRowPass>, dim3(unsigned(p.H), lat_blocks, passes), dim3(256), 0, s, p);
  // Heads a core block: as many as keep ≥ 256 blocks (two a multiprocessor) and fit shared memory —
  // each head of a block shares its key loads, so fewer re-reads of the cache from L2; a short decode
  // row keeps one a block. Speed only: HB never changes a head's bits.
  const int forced = p.heads_per_block;
  auto fits = [&](int hb) {
    const bool ok = p.H % hb == 0 && smem_bytes(p.Lr, p.dr, cap, hb) <= kMaxSmem;
    if (forced == hb && !ok) fail("CUDA MLA: ", hb, " heads a block do not fit ", p.H, " heads and ", cap, "-key chunks");
    return forced > 0 ? forced == hb : ok && p.n * p.H / hb * chunks >= 256;
  };
  const int hb = fits(4) ? 4 : fits(2) ? 2 : 1;
  // One chunk: every row in one launch, finished in the core kernel. More: kChunkRows rows a launch
  // (the partials buffer holds that many), each followed by the combine.
  const int64_t step = chunks > 1 ? kChunkRows : p.n;
  for (int64_t i0 = 0; i0 < p.n; i0 += step) {
    const int64_t rows = std::min(step, p.n - i0);
    if (hb == 4)
      launch_core<4>(p, i0, rows, cap, chunks, s);
    else if (hb == 2)
      launch_core<2>(p, i0, rows, cap, chunks, s);
    else
      launch_core<1>(p, i0, rows, cap, chunks, s);
    if (chunks > 1) launch("mla combine", mla_combine_kernel, dim3(unsigned(rows), unsigned(p.H)), dim3(128), 0, s, p, i0);
  }
  const unsigned wblocks = unsigned((p.dv + 7) / 8);
  if (p.n == 1)
    launch("mla wuv", wuv_kernel<1>, dim3(wblocks, unsigned(p.H), 1), dim3(256), 0, s, p);
  else
    launch("mla wuv", wuv_kernel<kRowPass>, dim3(wblocks, unsigned(p.H), passes), dim3(256), 0, s, p);
}

}  // namespace kd::cuda
