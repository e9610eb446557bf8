// `--budget auto` (issue 16 §3): each round verifies the tree size N that maximises expected tokens
// per second, E[τ(N)] / (t_draft + cost(N + 1)), and where no tree pays, plain AR steps instead.
//
// Why it cannot change the output: every tree, the root alone included, gives AR's tokens (DESIGN.md
// §2); the choice moves only speed.
// Why one draft serves every N: a tree's nodes are in pop order and its first N nodes are exactly the
// budget-N tree (tree.h truncate_tree), so a round drafts once at the largest budget and keeps N.
// Why every verified node teaches about every smaller tree: the target's choice at a node depends only
// on that node's path (row invariance), so node i is on the accept path of the N-node truncation
// (any N ≥ i) exactly when it is on this round's path. Hence E[τ(N)] = 1 + Σ_{i ≤ N} P(node i is on
// the path), and each verified node is one sample of that probability at its surrogate score σ_i.
//
// The pieces: VerifyCost (the device's cost(rows), profiled at start-up and refined online),
// AcceptanceModel (f(σ), learned online), plan_budget (the argmax, a pure function), and
// BudgetController (one sequence's policy: which N, or AR steps with a doubling backoff and probes).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "decode/tree.h"

namespace kd {

// cost(rows): milliseconds of one target verify forward of `rows` rows (the root + N nodes) for one
// sequence on this device: piecewise linear through knots — the given points, plus rows 1 and
// max_rows at the first point's time and the last segment's slope (never below the last time).
// observe(rows, ms) refines it online: one gradient step on the squared error of that prediction,
// shared by the two knots around `rows` in proportion to their interpolation weights, a fifth of the
// error in all. So a round of any size moves the curve near it (noise averages out, a growing
// context or a busier machine is followed) while the shape between knots stays the profile's. A
// sample is first clipped to [½, 2] × the prediction: a one-off stall (a GPU capturing a graph for a
// new shape took 1.5 ms where 0.35 was usual, a preempted thread) moves the curve as a doubling
// would, not by its full size, while a lasting change still gets there in a few rounds.
class VerifyCost {
 public:
  VerifyCost() = default;
  // points: (rows, ms), rows strictly ascending in [1, max_rows], ms finite and > 0; the table covers
  // rows 1 … max_rows (≥ 1). Throws naming the bad point.
  VerifyCost(const std::vector<std::pair<int64_t, double>>& points, int64_t max_rows);
  double ms(int64_t rows) const;  // rows in [1, max_rows]
  void observe(int64_t rows, double ms);
  int64_t max_rows() const { return knots_.empty() ? 0 : knots_.back().first; }
  std::vector<double> table() const;  // [max_rows]: ms(1) … ms(max_rows)

 private:
  // The knots (rows, ms) around `rows` and the second one's weight in the interpolation.
  size_t segment(int64_t rows, double* w) const;
  std::vector<std::pair<int64_t, double>> knots_;
};

// The device's costs, shared by every sequence of one engine: the verify curve and the drafter's
// per-round cost (draft + tree build + the context it had to take in), an average of measured rounds.
struct RoundCosts {
  VerifyCost verify;
  double draft_ms = 0;
  bool draft_seen = false;
  bool frozen = false;  // given by the caller (tests, what-if): measurements change nothing
  // The row counts (N + 1) a round may verify, ascending; empty: any. On a device where a new shape's
  // first forwards cost extra (CUDA graphs: launched kernel by kernel, then captured — 0.5 and 1.5 ms
  // where a captured verify of that size takes 0.35 on the H200), the sizes the start-up profile ran
  // (and so captured): every round then replays a graph, and its cost is a measured point, not an
  // interpolation.
  std::vector<int64_t> shapes;
  // The ceiling of speculation here (perfect_drafter_ratio at start-up, from the profiled verify
  // curve and a timed draft) and whether --budget auto drafts at all: false when even a drafter
  // that is always right could not reach kSpeculationGate × AR — every round is then an AR step,
  // without taps and without a drafter call.
  double ceiling = 0;
  bool speculate = true;
  void observe_verify(int64_t rows, double ms);
  void observe_draft(double ms);
};

// f(σ) = P(a node of surrogate log-probability σ is on the accept path), in bins of σ a quarter nat
// wide from 0 down to −10 (below: the last bin). Each bin holds decayed counts of verified nodes and
// of those accepted, plus kPriorWeight pseudo-observations at the calibrated prior f = exp(σ):
//   f(σ) = (accepted + w·exp(σ)) / (verified + w).
// A drafter that is right as often as it claims keeps f ≈ exp(σ); a random one drives f to 0.
class AcceptanceModel {
 public:
  static constexpr int kBins = 40;
  static constexpr double kBinWidth = 0.25;    // nats
  static constexpr double kPriorWeight = 2.0;  // pseudo-observations a bin
  static constexpr double kDecay = 0.98;       // a round's weight a round later (half-life ≈ 34 rounds)
  double f(double sigma) const;
  // One verified round: nodes 1 … tree.size() − 1 of `tree` (as verified), `path` its accepted nodes
  // (root first, ascending, as accept_walk returns them).
  void observe(const DraftTree& tree, const std::vector<int32_t>& path);

 private:
  static int bin(double sigma);
  std::array<double, kBins> accepted_{}, verified_{};
};

struct BudgetChoice {
  int64_t nodes = 0;  // N, the nodes to verify (0: an AR step — the root alone, no drafter call)
  double tokens = 1;  // E[τ(N)] = 1 + Σ_{i ≤ N} f_i: tokens the round is expected to commit
  double ms = 0;      // its expected time: t_draft + cost(N + 1) (an AR step: cost(1))
  double tokens_per_ms() const { return ms > 0 ? tokens / ms : 0; }
};

struct BudgetPlan {
  BudgetChoice best;  // argmax over the allowed N of E[τ(N)] / (t_draft + cost(N + 1)); the smallest N on ties
  BudgetChoice ar;    // plain AR: one token in cost(1)
  bool speculate() const { return best.tokens_per_ms() > ar.tokens_per_ms(); }
};

// What else bounds a plan besides f: the nodes' depths (a round commits at most 1 + the depth of
// the deepest node it verified, however many siblings it holds: E[τ(N)] is capped there — without
// it, siblings of an always-right chain, each a few percent likely on its own, added a token of
// expectation to a round that could not commit it, and the plan doubled its tree for nothing), and
// the row counts a round may verify (RoundCosts::shapes; empty: any).
struct PlanLimits {
  std::vector<int32_t> depths;  // [f.size()] or empty (no cap)
  std::vector<int64_t> shapes;  // allowed N + 1, ascending, or empty
};

// f[i] = P(node i + 1 is on the accept path) for the nodes of one tree in pop order (f.size() ≥ 1,
// f.size() + 1 ≤ cost.max_rows()). With shapes that allow no N ≤ f.size(), N = 1.
BudgetPlan plan_budget(const std::vector<double>& f, const VerifyCost& cost, double draft_ms, const PlanLimits& limits = {});
// Once the draft is paid and a token is worth `rate` tokens/ms elsewhere: argmax over the allowed N
// of E[τ(N)] − rate · cost(N + 1) — with rate = plan.best's own rate this is plan.best (a round at N
// gains at most rate · t_draft over its time), with AR's rate it is the best tree for a probe.
BudgetChoice best_at_rate(const std::vector<double>& f, const VerifyCost& cost, double draft_ms, double rate,
                          const PlanLimits& limits = {});

// The most speculation can give on this device: the rate of a drafter that is always right — each
// round's chain of min(N, depth) nodes all accepted, then the target's own next token — over AR's
// 1 / cost(1), at its best N ≤ max_nodes among the allowed shapes (N + 1 rows; empty: any):
//   max_N (1 + min(N, depth)) / (draft_ms + cost(N + 1)) · cost(1).
// depth: the draft positions a round has (block − 1). Real drafters commit a share of that.
double perfect_drafter_ratio(const VerifyCost& cost, double draft_ms, int64_t max_nodes, int64_t depth,
                             const std::vector<int64_t>& shapes = {});
// --budget auto drafts only where that ceiling is at least this. Why 1.5: a real drafter commits a
// share of a perfect one's tokens — the trained pair at budget 16: τ 2.0–9.8 of 17 on its held-out
// prompts (12–58 %), 6.6 median (39 %) — and at a ceiling of 1.5 it must reach two thirds of perfect
// to break even, before the probes that would find it (a draft and a verify each: ~13 AR steps on
// the CPU with the trained pair, whose ceiling is ~1.3 — there --budget auto measured 0.79–0.94× AR
// with its probes, and the best fixed budget 0.53×). Below it, every step is an AR step.
inline constexpr double kSpeculationGate = 1.5;

// One sequence's --budget auto policy. Each round either drafts (at the largest budget; choose()
// then says how many nodes to verify) or, while draft_now() is false, runs AR steps (ar_step()).
// It speculates while the predicted rate of its rounds — the latest round's ratio to AR's 1/cost(1),
// smoothed over consecutive drafted rounds — is at least AR's. Below it, the round still verifies its
// best tree (the draft is paid, and its nodes are the data f learns from), then AR steps follow:
// 1, 2, 4 … kMaxBackoff after k consecutive poor probes, and never so few that the probe's expected
// loss (its time beyond the AR steps that would commit its expected tokens) exceeds share_k of the
// AR time it waits for, share_k = max(kProbeShare, kFirstProbeShare / 2^(k − 1)): ⅛, 1/16, 1/32,
// then 2 %. So the first waits are short — a drafter that is poor at the start of an answer and
// good a few lines on (the trained pair on the H200: one poor first round, then τ = 16 every round)
// is caught after ~16 AR steps, not after 76 as with a fixed 2 % — while a drafter that stays poor
// costs about log2(T · ⅛ / loss) probes in T AR steps (~5 in 256 on the H200, 2–3 % of the time)
// and at most kProbeShare in the long run (a drafter as slow as 8 AR steps then waits ~350). The
// next drafted round is a
// probe, judged on its own prediction. f is scaled by the calibration of the drafted tokens so far —
// decayed Σ accepted / Σ predicted (E[τ] − 1) with a prior of kCalibPrior tokens at 1, never above 1
// — so a stretch where the per-σ acceptance over-predicts (the trained pair's poorest prompt: rounds
// predicted 60 tokens and committed 46) stops speculating sooner. After a round that speculated, its tree is judged again with
// the acceptance it has just learned (observe()), so a drafter that only looked good costs one
// round, not as many as the prior's pseudo-counts would.
class BudgetController {
 public:
  static constexpr int64_t kMaxBackoff = 64;
  static constexpr double kProbeShare = 0.02;
  static constexpr double kFirstProbeShare = 0.125;
  static constexpr int64_t kMaxWait = 1 << 16;
  static constexpr double kSmoothing = 0.3;  // weight of the newest round in the smoothed ratio
  static constexpr double kCalibDecay = 0.9, kCalibPrior = 4.0, kCalibMin = 0.25;
  double calibration() const;  // the factor on f: (accepted + prior) / (predicted + prior), clamped

  explicit BudgetController(int64_t max_nodes);
  bool draft_now() const { return ar_left_ == 0; }
  BudgetChoice ar_step(const RoundCosts& costs);  // an AR step instead of a round
  // After drafting `tree` (at the largest budget; its draft already measured into costs): the nodes
  // to verify (≥ 1 when the tree has any).
  BudgetChoice choose(const DraftTree& tree, const RoundCosts& costs);
  // The verified round (tree as verified, path accepted); only rounds whose walk left the tree.
  void observe(const DraftTree& verified, const std::vector<int32_t>& path, const RoundCosts& costs);
  const AcceptanceModel& acceptance() const { return acc_; }
  int64_t ar_left() const { return ar_left_; }
  double ratio() const { return ratio_; }  // the smoothed predicted rate of drafted rounds over AR's

 private:
  std::vector<double> node_f() const;          // f of the last drafted tree's nodes
  PlanLimits limits(const RoundCosts& costs) const;  // the last drafted tree's depths, the allowed shapes
  bool judge(const BudgetPlan& plan, bool recheck);  // updates the smoothed ratio; true: speculate
  BudgetChoice back_off(const std::vector<double>& f, const RoundCosts& costs, const BudgetPlan& plan);

  AcceptanceModel acc_;
  std::vector<double> scores_;  // σ of the last drafted tree's nodes (up to the largest budget)
  std::vector<int32_t> depths_;  // … and their depths
  int64_t max_nodes_ = 0, ar_left_ = 0, fails_ = 0;
  double ratio_ = 0, ratio_before_ = 0;  // the smoothed ratio, and before the last drafted round
  // Calibration of the drafted tokens: decayed Σ accepted / Σ predicted (E[τ] − 1) over verified rounds,
  // each with kCalibPrior tokens of prior at 1; f is scaled by it (within [kCalibMin, 1]).
  double calib_accepted_ = 0, calib_predicted_ = 0, last_predicted_ = 0;
  bool speculating_ = false, smoothed_before_ = false;
};

// The row counts the start-up profile times within max_rows (≥ 1): 1, 2, 3, 4, 5, 7, 9, 13, 17, 25,
// 33, 49, 65, 97, 129 … (steps of about √2: a round restricted to them — RoundCosts::shapes — is
// within ~20 % of any tree size), and max_rows itself.
std::vector<int64_t> profile_rows(int64_t max_rows);
// The start-up micro-profile: time_forward(rows) runs one verify forward of `rows` rows for one
// sequence and returns its milliseconds, for each of profile_rows(max_rows): one untimed pass (caches; a GPU's graphs are captured on a shape's second use),
// then timed passes while the whole stays under budget_s — each row count at least 3 times and, while
// it has cost under 25 ms so far, up to 9 (cheap shapes get more samples: a noisy cost(1), the AR
// baseline, would mislead every decision) — and the median of each.
VerifyCost profile_verify_cost(const std::function<double(int64_t rows)>& time_forward, int64_t max_rows,
                               double budget_s = 2.0);

}  // namespace kd
