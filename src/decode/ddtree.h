// DDTree speculative decoding (DESIGN.md §1, SPEC-DDTREE.md §2): each round the drafter proposes
// per-position distributions for the block after the bonus token, a best-first tree of `budget`
// nodes is built from them, the target verifies the whole tree in one forward (ancestor-only mask,
// RoPE position = start + depth), the walk follows the target's own choices, the accepted rows of
// the latent KV are compacted into place and their tapped features go to the drafter.
// The output equals generate_ar's token for token: the target's choice at position p is
// sample(logits, position_uniform(seed, seq, p)) either way, and the verify pass reproduces the AR
// logits bit for bit (row invariance). `chain` mode verifies the drafter's top-1 path only (DFlash).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/deepseek_v3.h"
#include "decode/ar.h"
#include "model/drafter.h"
#include "decode/tree.h"  // kMaxTreeBudget

namespace kd {

struct SpecOptions {
  bool chain = false;   // DFlash: verify the top-1 chain instead of a tree
  int64_t budget = 16;  // tree nodes per round, root excluded (ignored in chain mode)
};

struct SpecStats {
  int64_t rounds = 0, target_forwards = 0;
  int64_t drafted = 0;                   // tree nodes verified, root excluded
  int64_t accepted = 0;                  // drafted tokens the target confirmed
  std::vector<int64_t> tau_histogram;    // [block + 1]: rounds whose τ (accepted + 1) was i
  double draft_ms = 0, verify_ms = 0, prefill_ms = 0;
  double mean_tau() const { return rounds ? double(accepted + rounds) / double(rounds) : 0.0; }
};

struct SpecResult {
  GenerateResult gen;  // output ids, finish reason, timings (decode_ms covers all rounds)
  SpecStats stats;
};

SpecResult generate_ddtree(const DeepseekV3& model, Drafter& drafter, const std::vector<int32_t>& prompt,
                           const GenerateOptions& opt, const SpecOptions& spec,
                           const std::function<void(int32_t)>& on_token = {});

}  // namespace kd
