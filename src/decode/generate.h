// What a generation request asks for and what it gives back, shared by the one decode loop (the
// engine's step, src/engine/) and its callers: the options, the request checks, the results and
// DDTree's statistics. The AR reference and DDTree both run in that loop; DDTree's output equals
// AR's token for token: the token at absolute position p is sample(logits, position_uniform(seed,
// seq_id, p)) either way, never a function of call order, and the verify pass reproduces the AR
// logits bit for bit (row invariance).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "decode/tree.h"  // kMaxTreeBudget
#include "model/target.h"
#include "sample/sampler.h"

namespace kd {

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  SamplingParams sampling;
  uint64_t seq_id = 0;
  bool ignore_eos = false;
  std::vector<int32_t> stop_ids;   // the config's EOS ids unless the caller overrides
  bool keep_logits = false;        // fill GenerateResult::logits (for --dump-logits and tests)
  AttnForm decode_form = AttnForm::absorbed;
  int64_t context = 0;             // 0 → the model's max_position_embeddings
};

struct GenerateResult {
  std::vector<int32_t> output_ids;
  std::string finish_reason;       // "stop" (a stop id, included in output_ids) or "length"
  std::vector<float> logits;       // [output_ids.size(), vocab]: the logits each token was drawn from
  double prefill_ms = 0, decode_ms = 0;
  int64_t n_prompt = 0, n_target_forwards = 0;  // forwards run: the prefill plus one per decode step
  uint64_t prefill_weight_bytes = 0, decode_weight_bytes = 0;
};

// Checks a generation request (sampling parameters, a non-empty prompt of in-vocabulary ids that
// leaves room in the context) and returns its limits; shared by every decoder.
struct GenerationLimits {
  int64_t ctx = 0, n_prompt = 0, n_max = 0;  // context, prompt length, tokens that may be generated
};
GenerationLimits check_generation(const ModelConfig& c, const std::vector<int32_t>& prompt, const GenerateOptions& opt);

struct SpecOptions {
  bool chain = false;   // DFlash: verify the top-1 chain instead of a tree
  int64_t budget = 16;  // tree nodes per round, root excluded (ignored in chain mode); with auto_budget the most
  // --budget auto (decode/budget.h): each round drafts one tree at `budget` nodes (chain: the whole
  // chain) and verifies its best first N (expected tokens per second from the device's cost(N) and
  // the acceptance seen so far), or runs plain AR steps where no tree pays. The output is the same.
  bool auto_budget = false;
  // With auto_budget, tests and what-if runs: this verify cost [(rows, ms), rows ascending] and
  // drafter cost instead of the start-up profile and online measurement (never refined). Empty: measure.
  std::vector<std::pair<int64_t, double>> fixed_verify_ms;
  double fixed_draft_ms = 0;
  // A drafter on a device hands back the tree builder's top-k from there (Drafter::top_k_on_device,
  // the same tree bit for bit); false: its logits come to the host (the tests' reference).
  bool device_top_k = true;
  // A constrained request's tree holds only prefixes its grammar allows (tree.h NodeFilter); false
  // drafts unmasked (the output is the same either way; for measuring τ).
  bool grammar_draft = true;
  // Keep every round's tree and accepted path (SpecStats / RequestStats::round_trees), for comparing
  // acceptance round by round with another implementation (run --json-rounds full).
  bool record_trees = false;
};

// Checks a speculative request's options (the tree budget within [1, kMaxTreeBudget] unless chain);
// shared by the engine and the one-request path, which sizes its KV from the budget.
void check_spec(const SpecOptions& spec);

// One speculative round as the engine ran it (SpecOptions::record_trees).
struct SpecRoundTree {
  int64_t start = 0;             // position of the root: the bonus token, committed before the round
  std::vector<int32_t> tokens;   // [n + 1] the draft tree (DraftTree), root first; tokens[1..n] were drafted
  std::vector<int32_t> parents;  // [n + 1]; parents[0] = −1
  std::vector<int32_t> depths;   // [n + 1]; root 0
  std::vector<int32_t> path;     // the accepted nodes, root first: τ = path.size()
};

struct SpecStats {
  int64_t rounds = 0, target_forwards = 0;
  int64_t drafted = 0;                   // tree nodes verified, root excluded
  int64_t accepted = 0;                  // drafted tokens the target confirmed
  std::vector<int64_t> tau_histogram;    // [block + 1]: rounds whose τ (accepted + 1) was i
  // [rounds] each round's τ: the tokens it committed, its accepted drafted tokens and the target's
  // own next one (fewer only when a stop id or the length limit ended the round inside the tree:
  // the stopping token counts, though it is not a node of the path). The prefill commits the first
  // token, so Σ round_tau = tokens generated − 1 (as dflash_generate's acceptance_lengths).
  std::vector<int32_t> round_tau;
  std::vector<SpecRoundTree> round_trees;  // [rounds] with SpecOptions::record_trees, else empty
  double draft_ms = 0, verify_ms = 0, prefill_ms = 0;
  // [most nodes + 1]: rounds that verified N nodes (N = 0: an AR step of --budget auto, no draft).
  std::vector<int64_t> budget_histogram;
  int64_t ar_steps = 0;                           // --budget auto: AR steps among the rounds (τ = 1 each)
  double predicted_tokens = 0, predicted_ms = 0;  // --budget auto: Σ E[τ(N)] and Σ (t_draft + cost(N + 1)) of its choices
  // --budget auto: the rate of a drafter that is always right over AR's, on this device's start-up
  // costs (perfect_drafter_ratio); below kSpeculationGate it drafts no round.
  double auto_ceiling = 0;
  double mean_tau() const { return rounds ? double(accepted + rounds) / double(rounds) : 0.0; }
};

struct SpecResult {
  GenerateResult gen;  // output ids, finish reason, timings (decode_ms covers all rounds)
  SpecStats stats;
};

}  // namespace kd
