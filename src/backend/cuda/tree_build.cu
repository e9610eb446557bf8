// The device tree build (tree_build.h says why it equals the host builder, decode/tree.cpp).
#include <atomic>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/tree_build.h"
#include "core/error.h"

namespace kd::cuda {
namespace {

constexpr int kThreads = 512;  // warp 0 pops; the whole block stages logp and writes the outputs
constexpr unsigned kFull = 0xffffffffu;

// σ → a uint64 whose unsigned order is σ's order, −0 as +0 (so equal keys ⇔ the host's
// −a.score == −b.score). 0 would be a NaN's key: it marks an empty slot.
__device__ __forceinline__ uint64_t order_key(double s) {
  const uint64_t u = s == 0.0 ? 0 : static_cast<uint64_t>(__double_as_longlong(s));
  return (u >> 63) ? ~u : (u | (uint64_t(1) << 63));
}

// Shared state of one build, at the front of the dynamic shared memory. Frontier slot s holds an
// entry — the prefix ρ(parent) + (rank) at `depth`, score σ, key order_key(σ) (0: empty); node i
// keeps its parent and rank (the links rank tuples are compared through) and depth.
extern __shared__ __align__(16) unsigned char smem_raw[];
struct Smem {
  uint64_t* f_key;    // [budget + 1]
  double* f_score;    // [budget + 1]
  int32_t* f_parent;  // [budget + 1]
  int32_t* f_rank;    // [budget + 1]
  int32_t* f_depth;   // [budget + 1]
  int32_t* n_parent;  // [budget + 1] root −1
  int32_t* n_rank;    // [budget + 1]
  int32_t* n_depth;   // [budget + 1]
  int32_t* valid;     // [positions] clamped to [0, k]
};
__device__ __forceinline__ Smem smem_layout(int S) {
  Smem m;
  m.f_key = reinterpret_cast<uint64_t*>(smem_raw);
  m.f_score = reinterpret_cast<double*>(m.f_key + S);
  m.f_parent = reinterpret_cast<int32_t*>(m.f_score + S);
  m.f_rank = m.f_parent + S;
  m.f_depth = m.f_rank + S;
  m.n_parent = m.f_depth + S;
  m.n_rank = m.n_parent + S;
  m.n_depth = m.n_rank + S;
  m.valid = m.n_depth + S;
  return m;
}

// Whether slot a's rank tuple precedes slot b's (lexicographically, a prefix before its
// extensions: std::vector's <). a ≠ b. Reached only on equal σ.
__device__ __noinline__ bool rho_less(int S, int a, int b) {
  const Smem m = smem_layout(S);
  int pa = m.f_parent[a], ra = m.f_rank[a], da = m.f_depth[a];
  int pb = m.f_parent[b], rb = m.f_rank[b], db = m.f_depth[b];
  const bool a_shorter = da < db;
  // (p, r) at depth d names the prefix ρ(p) + (r); one step up names ρ(p) itself.
  while (da > db) ra = m.n_rank[pa], pa = m.n_parent[pa], --da;
  while (db > da) rb = m.n_rank[pb], pb = m.n_parent[pb], --db;
  if (pa == pb && ra == rb) return a_shorter;  // one is a prefix of the other
  while (pa != pb) {
    ra = m.n_rank[pa], pa = m.n_parent[pa];
    rb = m.n_rank[pb], pb = m.n_parent[pb];
  }
  return ra < rb;  // children of one node: distinct ranks
}

struct Best {
  uint64_t key;  // 0: none
  int slot;
};

// The one of x, y that pops first.
__device__ __forceinline__ Best first_of(int S, Best x, Best y) {
  if (x.key == 0) return y;
  if (y.key == 0) return x;
  if (x.key != y.key) return x.key > y.key ? x : y;
  return rho_less(S, x.slot, y.slot) ? x : y;
}

// The entry that pops first among one candidate per lane (the same answer in every lane): the
// greatest key in two 32-bit reductions, equal keys by rank tuple (a loop uniform across lanes).
__device__ __forceinline__ Best warp_first(int S, uint64_t key, int slot) {
  const unsigned hi = __reduce_max_sync(kFull, unsigned(key >> 32));
  if (hi == 0) return {0, -1};  // a live key's high half is never 0 (that would be a NaN)
  const unsigned lo = __reduce_max_sync(kFull, unsigned(key >> 32) == hi ? unsigned(key) : 0u);
  const uint64_t top = (uint64_t(hi) << 32) | lo;
  unsigned tied = __ballot_sync(kFull, key == top);
  int w = __shfl_sync(kFull, slot, __ffs(tied) - 1);
  tied &= tied - 1;
  while (tied) {
    const int s = __shfl_sync(kFull, slot, __ffs(tied) - 1);
    tied &= tied - 1;
    if (rho_less(S, s, w)) w = s;
  }
  return {top, w};
}

// The pops, by warp 0. Slots form groups of 32 (group g: slots 32g … 32g + 31, at most 33 groups);
// lane l holds the best entry of groups l and l + 32 in registers. A pop changes at most two slots
// (the popped one takes its sibling, a new one the child), so after it the warp re-reduces those
// two groups (one slot a lane) and their owners update: constant work a node, whatever the budget.
// Returns the nodes added.
__device__ int pop_nodes(const DraftTreeArgs& a, const float* lp) {
  const int lane = int(threadIdx.x) & 31;
  const int B = a.budget, P = a.positions, K = a.k, S = B + 1;
  const Smem m = smem_layout(S);
  Best g0 = {0, -1}, g1 = {0, -1};  // groups lane, lane + 32
  // The seed (ρ = (0,), σ = logp[0, 0]) in slot 0, whatever valid[0] (as the host).
  const double seed = double(lp[0]);
  if (lane == 0) {
    m.f_key[0] = order_key(seed), m.f_score[0] = seed, m.f_parent[0] = 0, m.f_rank[0] = 0, m.f_depth[0] = 1;
    m.n_parent[0] = -1, m.n_rank[0] = 0, m.n_depth[0] = 0;
    g0 = {order_key(seed), 0};
  }
  Best mine = g0;  // the lane's best of its two groups
  int count = 0, n_slots = 1;
  __syncwarp();
  while (count < B) {
    const Best top = warp_first(S, mine.key, mine.slot);  // the frontier's least (−σ, ρ)
    if (top.key == 0) break;                               // the frontier is empty
    const int w = top.slot;
    const double score = m.f_score[w];
    const int parent = m.f_parent[w], rank = m.f_rank[w], depth = m.f_depth[w];
    const int idx = ++count;
    // The host's pushes, its expressions in its order: sibling (σ − logp[d−1,r]) + logp[d−1,r+1],
    // first child σ + logp[d,0].
    const bool sib = rank + 1 < m.valid[depth - 1];
    const bool child = depth < P;
    const int c = n_slots;
    n_slots += child ? 1 : 0;
    const double sib_score =
        sib ? (score - double(lp[(depth - 1) * K + rank])) + double(lp[(depth - 1) * K + rank + 1]) : 0.0;
    const double child_score = child ? score + double(lp[depth * K]) : 0.0;
    __syncwarp();  // every lane has read slot w before it is rewritten
    if (lane == 0) {
      m.n_parent[idx] = parent, m.n_rank[idx] = rank, m.n_depth[idx] = depth;
      a.scores[idx] = score;
      m.f_key[w] = sib ? order_key(sib_score) : 0;
      if (sib) m.f_score[w] = sib_score, m.f_rank[w] = rank + 1;
      if (child) {
        m.f_key[c] = order_key(child_score), m.f_score[c] = child_score;
        m.f_parent[c] = idx, m.f_rank[c] = 0, m.f_depth[c] = depth + 1;
      }
    }
    __syncwarp();  // slots and node idx written before any lane reads or compares through them
    const int gw = w >> 5, gc = child ? c >> 5 : gw;
    const int sw = 32 * gw + lane, sc = 32 * gc + lane;
    const Best bw = warp_first(S, sw < n_slots ? m.f_key[sw] : 0, sw);
    const Best bc = gc == gw ? bw : warp_first(S, sc < n_slots ? m.f_key[sc] : 0, sc);
    bool changed = false;
    if ((gw & 31) == lane) (gw < 32 ? g0 : g1) = bw, changed = true;
    if ((gc & 31) == lane) (gc < 32 ? g0 : g1) = bc, changed = true;
    if (changed) mine = first_of(S, g0, g1);
  }
  return count;
}

// One block: stage valid (and logp when it fits), pop in warp 0, then write every output in parallel.
__global__ void __launch_bounds__(kThreads) draft_tree_kernel(const DraftTreeArgs a, const bool stage_logp) {
  __shared__ int32_t s_count;
  const int S = a.budget + 1, P = a.positions, K = a.k;
  const Smem m = smem_layout(S);
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  for (int p = tid; p < P; p += nt) {
    const int64_t v = a.valid[p];
    m.valid[p] = int32_t(v < 0 ? 0 : v > K ? K : v);
  }
  const float* lp = a.logp;
  if (stage_logp) {
    float* sl = reinterpret_cast<float*>(m.valid + P);
    const int64_t pk = int64_t(P) * K;
    for (int64_t i = tid; i < pk; i += nt) sl[i] = a.logp[i];
    lp = sl;
  }
  __syncthreads();
  if (tid < 32) {
    long long c0 = clock64(), t0 = 0, t1 = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const int n = pop_nodes(a, lp);
    const long long c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (tid == 0) {
      s_count = n;
      if (a.pop_clock) a.pop_clock[0] = c1 - c0, a.pop_clock[1] = t1 - t0;
    }
  }
  __syncthreads();
  const int size = s_count + 1;
  if (tid == 0) *a.size = size, a.scores[0] = 0.0;
  for (int i = tid; i < size; i += nt) {
    const int d = m.n_depth[i];
    a.tokens[i] = i == 0 ? a.root_token : a.ids[(d - 1) * K + m.n_rank[i]];
    a.depths[i] = d;
    a.parents[i] = m.n_parent[i];
    a.ranks[i] = m.n_rank[i];
    a.rope_pos[i] = int32_t(a.start + d);
  }
  // The mask: zeros (16 bytes a store where aligned), then each row's ancestors-or-self.
  const int64_t total = int64_t(size) * size, vec = total / 16;
  for (int64_t q = tid; q < vec; q += nt) reinterpret_cast<uint4*>(a.visibility)[q] = make_uint4(0, 0, 0, 0);
  for (int64_t b = vec * 16 + tid; b < total; b += nt) a.visibility[b] = 0;
  __syncthreads();
  for (int i = tid; i < size; i += nt)
    for (int j = i; j >= 0; j = m.n_parent[j]) a.visibility[int64_t(i) * size + j] = 1;
}

void launch(const DraftTreeArgs& a, bool stage, size_t smem, size_t optin, cudaStream_t s) {
  static std::atomic<uint64_t> opted{0};  // devices whose limit has been raised
  if (smem > 48 * 1024) opt_in_smem(draft_tree_kernel, int(optin), opted, "draft tree: shared memory attribute");
  draft_tree_kernel<<<1, kThreads, smem, s>>>(a, stage);
  check_launch("draft tree");
}

}  // namespace

void build_draft_tree(const DraftTreeArgs& a, cudaStream_t s) {
  if (a.budget < 1 || a.budget > kDeviceTreeMaxBudget)
    fail("device draft tree: budget must be in [1, ", kDeviceTreeMaxBudget, "] (got ", a.budget, ")");
  if (a.positions < 1 || a.positions > kDeviceTreeMaxPositions)
    fail("device draft tree: positions must be in [1, ", kDeviceTreeMaxPositions, "] (got ", a.positions, ")");
  if (a.k < 1) fail("device draft tree: k must be at least 1 (got ", a.k, ")");
  if (!a.ids || !a.logp || !a.valid || !a.size || !a.tokens || !a.depths || !a.parents || !a.ranks || !a.scores ||
      !a.rope_pos || !a.visibility)
    fail("device draft tree: a null buffer");
  if (reinterpret_cast<uintptr_t>(a.visibility) % 16 != 0) fail("device draft tree: the mask must be 16-byte aligned");
  int dev = 0, optin_i = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&optin_i, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "shared memory opt-in");
  const size_t optin = size_t(optin_i) - 64;  // room for the static s_count
  const size_t S = size_t(a.budget) + 1;
  const size_t base = S * (8 + 8 + 6 * 4) + size_t(a.positions) * 4;
  const size_t lp_bytes = size_t(a.positions) * size_t(a.k) * 4;
  const bool stage = base + lp_bytes <= optin;
  const size_t smem = base + (stage ? lp_bytes : 0);
  launch(a, stage, smem, optin, s);
}

}  // namespace kd::cuda
