// DDTree's best-first tree build (SPEC-DDTREE.md §2, Algorithm 1) on the device, from a draft
// top-k already there: the same tree as the host builder, build_draft_tree(top, budget) in
// decode/tree.h (the reference), node for node and bit for bit — tokens, parents, depths, ranks,
// the double σ of every node, the pop order — plus what the verify reads: RoPE positions
// (start + depth) and the dense ancestor-or-self mask, so nothing needs the host between the draft
// and the verify. No grammar filter (NodeFilter): constrained rounds keep the host builder.
//
// Why the same tree. The host pops the heap's least (−σ, ρ, parent) until `budget` nodes are
// added. Two frontier entries never share a rank tuple ρ (each prefix is pushed at most once), so
// that order is a strict total order on the frontier and every pop is its unique minimum, whatever
// the heap's layout: any structure that takes the frontier's minimum under that order pops the
// same sequence. The device keeps the frontier in slots (a popped slot takes its next sibling, a
// new slot the first child), each group of 32 slots' best entry in a lane, and a pop is a warp-wide
// maximum of those keys — σ mapped to an order-preserving uint64 (−0 and +0 equal, as the
// host's `!=` has them) — with equal σ resolved by comparing rank tuples through the parent links
// (the lowest common ancestor's children decide; a prefix precedes its extensions). σ is double and
// updated with the host's expressions in the host's order (sibling: (σ − logp[d−1,r]) +
// logp[d−1,r+1]; child: σ + logp[d,0]); --fmad=false and no multiplies keep the bits.
//
// Input contract (draft_top_k's): no NaN logp, ranks below valid[p] finite, valid[p] ≤ k (the kernel
// clamps it there); the host builder's behaviour outside it is undefined anyway.
//
// Cost: the pops are sequential (a pop's result decides what the next may be): three warp-wide
// reductions a node (the pop itself, then the ≤ 2 groups it changed, one slot a lane) — constant
// work a node, whatever the budget; the rest of the block stages logp into shared memory first and
// writes tokens, positions and the mask in parallel last. Measured on an H200 (docs/perf.md):
// ≈ 1.2–1.3k cycles a node, slower than the host build plus its upload at every budget, so the round
// does not use it yet.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace kd::cuda {

// The most nodes (root excluded) and draft positions one build takes: decode/tree.h's
// kMaxTreeBudget, and 63 positions (a block of 64; DFlash drafts 15).
constexpr int64_t kDeviceTreeMaxBudget = 1024;
constexpr int64_t kDeviceTreeMaxPositions = 63;

// One build: the device top-k in DraftTopK's layout (sample/top_k.h) in, the tree out. Output
// arrays have room for budget + 1 entries (the mask for (budget + 1)² bytes); the kernel writes the
// first size = n + 1 and *size.
struct DraftTreeArgs {
  const int32_t* __restrict__ ids = nullptr;    // [positions, k] top-k token ids by rank
  const float* __restrict__ logp = nullptr;     // [positions, k] fp32 log-probabilities (no NaN)
  const int64_t* __restrict__ valid = nullptr;  // [positions] ranks with a finite logp
  int32_t positions = 0;                        // L, 1 … kDeviceTreeMaxPositions
  int32_t k = 0;                                // 1 … budget
  int32_t budget = 0;                           // 1 … kDeviceTreeMaxBudget
  int32_t root_token = -1;                      // tokens[0] (the bonus; −1 as the bare builder has it)
  int64_t start = 0;                            // the root's RoPE position
  int32_t* __restrict__ size = nullptr;         // [1] n + 1, root included
  int32_t* __restrict__ tokens = nullptr;       // [budget + 1]
  int32_t* __restrict__ depths = nullptr;       // [budget + 1] root 0
  int32_t* __restrict__ parents = nullptr;      // [budget + 1] root −1
  int32_t* __restrict__ ranks = nullptr;        // [budget + 1] root 0
  double* __restrict__ scores = nullptr;        // [budget + 1] σ, root 0
  int32_t* __restrict__ rope_pos = nullptr;     // [budget + 1] start + depth
  uint8_t* __restrict__ visibility = nullptr;   // [size, size] dense, row stride size: 1 where j is i or an ancestor of i
  int64_t* __restrict__ pop_clock = nullptr;    // [2] optional: the pops' SM cycles (clock64) and ns (globaltimer)
};

// Queues the build on `s` (one block); argument errors throw before any launch.
void build_draft_tree(const DraftTreeArgs& a, cudaStream_t s);

}  // namespace kd::cuda

namespace kd {

struct DraftTopK;  // sample/top_k.h

// A tree downloaded from the device (tests, timing): the first size entries of each output.
struct DeviceTreeHost {
  std::vector<int32_t> tokens, depths, parents, ranks, rope_pos;
  std::vector<double> scores;
  std::vector<uint8_t> visibility;  // [size, size]
};

// Device buffers for builds up to `max_budget` nodes over top-k of up to `max_positions` × `max_k`,
// reused build after build.
class DeviceDraftTree {
 public:
  DeviceDraftTree() = default;
  ~DeviceDraftTree();
  DeviceDraftTree(const DeviceDraftTree&) = delete;
  DeviceDraftTree& operator=(const DeviceDraftTree&) = delete;

  // From a top-k already on the device (ids/logp [positions, k], valid [positions]); no host sync.
  void build(const int32_t* ids_dev, const float* logp_dev, const int64_t* valid_dev, int64_t positions, int64_t k,
             int64_t budget, int32_t root_token, int64_t start, cudaStream_t s);
  // Uploads a host top-k (pinned staging), then as above; no host sync.
  void build(const DraftTopK& top, int64_t budget, int32_t root_token, int64_t start, cudaStream_t s);
  // Waits for `s` and downloads the last build.
  DeviceTreeHost download(cudaStream_t s);

  // The last build's outputs on the device (valid once `s` reaches them).
  const int32_t* size_dev() const { return out_i32(0); }
  const int32_t* tokens_dev() const { return out_i32(1); }
  const int32_t* rope_pos_dev() const { return out_i32(5); }
  const uint8_t* visibility_dev() const { return vis_; }
  // The last build's pop loop: SM cycles and nanoseconds (waits for `s`).
  std::pair<int64_t, int64_t> last_pop_clock(cudaStream_t s) const;

 private:
  void reserve_out(int64_t budget);
  void reserve_in(int64_t positions, int64_t k);
  const int32_t* out_i32(int which) const;
  int64_t cap_ = 0;                  // budget the outputs hold
  void* out_ = nullptr;              // [size | tokens | depths | parents | ranks | rope_pos] int32, scores double
  uint8_t* vis_ = nullptr;           // [(cap + 1)²]
  int64_t* clock_ = nullptr;         // [2] the pops' cycles and ns
  void* in_ = nullptr;               // uploaded top-k: ids | logp | valid
  void* in_host_ = nullptr;          // pinned mirror
  size_t in_bytes_ = 0;
  int64_t last_budget_ = 0;
};

}  // namespace kd
