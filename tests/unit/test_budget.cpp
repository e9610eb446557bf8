// --budget auto (decode/budget.h): the claim it rests on (the first N nodes of a tree drafted at a
// larger budget are exactly the budget-N tree), the chooser (the argmax of expected tokens per
// second; AR when no tree beats 1 / cost(1)), the acceptance model and the fallback's backoff —
// and, in the engine, that its output is AR's token for token (T = 0 and seeded T > 0, alone and in
// a batch), that an always-right drafter gets large trees and a random one ends up in AR steps.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include "decode/budget.h"
#include "decode/dflash_drafter.h"
#include "decode/synthetic_drafter.h"
#include "decode/tree.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "engine_sink.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/make_drafter.h"
#include "test_util.h"
#include <nlohmann/json.hpp>

namespace kd {
namespace {

void expect_same_tree(const DraftTree& a, const DraftTree& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(a.positions, b.positions) << what;
  EXPECT_EQ(a.tokens, b.tokens) << what;
  EXPECT_EQ(a.depths, b.depths) << what;
  EXPECT_EQ(a.parents, b.parents) << what;
  EXPECT_EQ(a.ranks, b.ranks) << what;
  EXPECT_EQ(a.children, b.children) << what;
  for (int64_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.scores[size_t(i)], b.scores[size_t(i)]) << what << " score " << i;
}

// Random draft logits: some rows peaked, some flat, some quantised (ties everywhere: the tie rule
// must agree), some with −inf tokens (fewer valid ranks than the budget).
std::vector<float> random_logits(std::mt19937_64& rng, int64_t L, int64_t V, int kind) {
  std::normal_distribution<float> g(0.0f, kind == 0 ? 4.0f : 1.0f);
  std::vector<float> x(static_cast<size_t>(L * V));
  for (float& v : x) v = g(rng);
  if (kind == 2)
    for (float& v : x) v = std::round(v * 2.0f) / 2.0f;
  if (kind == 3)
    for (size_t i = 0; i < x.size(); ++i)
      if (rng() % 3 == 0) x[i] = -INFINITY;
  for (int64_t p = 0; p < L; ++p) x[size_t(p * V + int64_t(rng() % uint64_t(V)))] = 1.0f;  // a finite logit a row
  return x;
}

TEST(AutoBudget, TruncatedTreeIsTheSmallerBudgetsTree) {
  std::mt19937_64 rng(16);
  int checked = 0;
  for (int trial = 0; trial < 160; ++trial) {
    const int64_t L = 1 + int64_t(rng() % 15), V = int64_t(std::vector<int>{3, 8, 40, 300}[trial % 4]);
    const int kind = int(trial / 4 % 4);
    const std::vector<float> logits = random_logits(rng, L, V, kind);
    const int64_t big = trial % 5 == 0 ? 100 : 64;
    const DraftTree full = build_draft_tree(logits.data(), L, V, big);
    for (int64_t n = 1; n <= big; ++n) {
      const DraftTree small = build_draft_tree(logits.data(), L, V, n);
      expect_same_tree(truncate_tree(full, n), small, cat("trial ", trial, " L=", L, " V=", V, " kind=", kind, " N=", n));
      if (HasFatalFailure()) return;
      ++checked;
    }
    // A chain truncates to the shorter chain; the root alone is every tree's N = 0.
    const DraftTree chain = build_draft_chain(logits.data(), L, V);
    for (int64_t n = 0; n <= L; ++n) {
      const DraftTree t = truncate_tree(chain, n);
      ASSERT_EQ(t.size(), n + 1);
      for (int64_t i = 1; i <= n; ++i) EXPECT_EQ(t.parents[size_t(i)], i - 1);
    }
    expect_same_tree(truncate_tree(full, 0), root_tree(L), "root");
  }
  EXPECT_EQ(checked, 128 * 64 + 32 * 100);
}

TEST(AutoBudget, VerifyCostInterpolatesExtrapolatesAndRefines) {
  VerifyCost c({{1, 2.0}, {3, 4.0}, {5, 10.0}}, 8);
  EXPECT_DOUBLE_EQ(c.ms(1), 2.0);
  EXPECT_DOUBLE_EQ(c.ms(2), 3.0);
  EXPECT_DOUBLE_EQ(c.ms(4), 7.0);
  EXPECT_DOUBLE_EQ(c.ms(5), 10.0);
  EXPECT_DOUBLE_EQ(c.ms(7), 16.0);  // the last segment's slope, 3 ms a row
  EXPECT_THROW(c.ms(9), Error);
  // A measurement between knots 3 and 5 (weights ½, ½) moves both: a fifth of the 5 ms error at 4.
  c.observe(4, 12.0);
  EXPECT_DOUBLE_EQ(c.ms(4), 8.0);
  EXPECT_DOUBLE_EQ(c.ms(3), 5.0);
  EXPECT_DOUBLE_EQ(c.ms(5), 11.0);
  EXPECT_DOUBLE_EQ(c.ms(1), 2.0);  // far knots stay
  // A stall (a graph captured, a preempted thread) counts as twice the prediction, no more: 16 ms,
  // a fifth of the 8 ms error at 4.
  c.observe(4, 1000.0);
  EXPECT_DOUBLE_EQ(c.ms(4), 9.6);
  EXPECT_DOUBLE_EQ(c.ms(3), 6.6);
  c.observe(4, 1e-3);  // … and a sample far below, as half of it: −4.8 ms of error
  EXPECT_DOUBLE_EQ(c.ms(4), 9.6 - 0.96);
  c.observe(4, 9.6);  // within the clip: a fifth of the 0.96 ms error
  EXPECT_NEAR(c.ms(4), 8.832, 1e-12);
  // At a knot only that knot moves; repeated measurements converge on them (each step at most a
  // halving: 200 steps are plenty).
  const double at3 = c.ms(3);
  for (int i = 0; i < 200; ++i) c.observe(1, 1.0);
  EXPECT_NEAR(c.ms(1), 1.0, 1e-9);
  EXPECT_DOUBLE_EQ(c.ms(3), at3);
  for (int i = 0; i < 200; ++i) c.observe(7, 30.0);
  EXPECT_NEAR(c.ms(7), 30.0, 1e-9);
  VerifyCost below({{4, 5.0}, {8, 9.0}}, 12);
  EXPECT_DOUBLE_EQ(below.ms(1), 5.0);
  EXPECT_DOUBLE_EQ(below.ms(12), 13.0);
  VerifyCost falling({{1, 5.0}, {2, 4.0}}, 4);  // noise: never extrapolated below the last point
  EXPECT_DOUBLE_EQ(falling.ms(4), 4.0);
  EXPECT_THROW(VerifyCost({{2, 1.0}, {2, 3.0}}, 4), Error);
  EXPECT_THROW(VerifyCost({{1, 0.0}}, 4), Error);
  EXPECT_THROW(VerifyCost({}, 4), Error);
}

TEST(AutoBudget, PlanPicksTheArgmaxOfExpectedTokensPerSecond) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t n = 1 + int64_t(rng() % 64);
    std::vector<std::pair<int64_t, double>> pts;
    double ms = 0.5 + 5 * u(rng);
    for (int64_t r = 1; r <= n + 1; r += 1 + int64_t(rng() % 6)) {
      pts.push_back({r, ms});
      ms += u(rng) * 3;
    }
    const VerifyCost cost(pts, n + 1);
    std::vector<double> f(static_cast<size_t>(n));
    double q = 1;
    for (double& x : f) x = (q *= 0.5 + 0.5 * u(rng));
    if (trial % 7 == 0) f.assign(size_t(n), 0.25);  // equal values: ties in the rate are possible
    const double draft = trial % 3 == 0 ? 0.0 : 2 * u(rng);
    const BudgetPlan p = plan_budget(f, cost, draft);
    // The argmax written out: E[τ(N)] = 1 + Σ_{i ≤ N} f_i over t_draft + cost(N + 1); smallest N on ties.
    int64_t want = 0;
    double want_rate = -1;
    for (int64_t N = 1; N <= n; ++N) {
      const double tokens = 1 + std::accumulate(f.begin(), f.begin() + N, 0.0);
      const double rate = tokens / (draft + cost.ms(N + 1));
      if (rate > want_rate) want = N, want_rate = rate;
    }
    ASSERT_EQ(p.best.nodes, want) << "trial " << trial;
    EXPECT_NEAR(p.best.tokens_per_ms(), want_rate, 1e-12);
    EXPECT_DOUBLE_EQ(p.ar.tokens_per_ms(), 1.0 / cost.ms(1));
    EXPECT_EQ(p.speculate(), want_rate > 1.0 / cost.ms(1));
    // With the plan's own rate, the draft paid, the marginal rule picks the plan (budget.h).
    EXPECT_EQ(best_at_rate(f, cost, draft, p.best.tokens_per_ms()).nodes, p.best.nodes) << "trial " << trial;

    // With limits: node depths (a tree's: each node one deeper than some earlier node or the root)
    // cap E[τ(N)] at 1 + the deepest of the first N; only the allowed row counts are candidates.
    PlanLimits lim;
    for (int64_t i = 0; i < n; ++i)
      lim.depths.push_back(i == 0 ? 1 : 1 + (rng() % 2 ? lim.depths[size_t(rng() % uint64_t(i))] : 0));
    for (int64_t r = 2; r <= n + 1; ++r)
      if (rng() % 3 == 0) lim.shapes.push_back(r);
    if (trial % 5 == 0) lim.shapes.clear();  // any size
    const BudgetPlan pl = plan_budget(f, cost, draft, lim);
    int64_t want_l = 0;
    double want_l_rate = -1, want_l_tokens = 0;
    for (int64_t N = 1; N <= n; ++N) {
      if (!lim.shapes.empty() && std::find(lim.shapes.begin(), lim.shapes.end(), N + 1) == lim.shapes.end()) continue;
      const int32_t deepest = *std::max_element(lim.depths.begin(), lim.depths.begin() + N);
      const double tokens = std::min(1 + std::accumulate(f.begin(), f.begin() + N, 0.0), 1.0 + deepest);
      const double rate = tokens / (draft + cost.ms(N + 1));
      if (rate > want_l_rate) want_l = N, want_l_rate = rate, want_l_tokens = tokens;
    }
    if (want_l == 0) {  // no allowed size: one node
      want_l = 1;
      want_l_tokens = std::min(1 + f[0], 2.0);
      want_l_rate = want_l_tokens / (draft + cost.ms(2));
    }
    ASSERT_EQ(pl.best.nodes, want_l) << "trial " << trial << " (limits)";
    EXPECT_NEAR(pl.best.tokens, want_l_tokens, 1e-12);
    EXPECT_NEAR(pl.best.tokens_per_ms(), want_l_rate, 1e-12);
    EXPECT_EQ(best_at_rate(f, cost, draft, pl.best.tokens_per_ms(), lim).nodes, pl.best.nodes) << "trial " << trial;
  }
}

// The cap in a case worked by hand: an always-right chain of 3 and four siblings of it at f = 0.2,
// on a nearly flat cost. Uncapped, the siblings' 0.8 tokens look worth 0.06 ms: N = 7 (4.8 / 1.1 =
// 4.36 a ms against 4 / 1.043 = 3.84). A round commits at most 1 + depth 3 = 4 tokens, so N = 3.
TEST(AutoBudget, PlanCapsExpectedTokensAtTheDeepestNode) {
  const VerifyCost cost({{1, 1.0}, {8, 1.1}}, 8);
  const std::vector<double> f = {1, 1, 1, 0.2, 0.2, 0.2, 0.2};
  EXPECT_EQ(plan_budget(f, cost, 0.0).best.nodes, 7);
  PlanLimits lim;
  lim.depths = {1, 2, 3, 1, 2, 3, 3};
  const BudgetPlan p = plan_budget(f, cost, 0.0, lim);
  EXPECT_EQ(p.best.nodes, 3);
  EXPECT_DOUBLE_EQ(p.best.tokens, 4.0);
  // Rows 1, 2, 3, 5 only: N = 1, 2 or 4; N = 4 (the chain and a sibling, 4.2 capped at 4 tokens in
  // 1.057 ms) beats N = 2 (3 in 1.029).
  lim.shapes = {1, 2, 3, 5};
  const BudgetPlan q = plan_budget(f, cost, 0.0, lim);
  EXPECT_EQ(q.best.nodes, 4);
  EXPECT_DOUBLE_EQ(q.best.tokens, 4.0);
  lim.shapes = {1, 9};  // no size within the tree: one node
  EXPECT_EQ(plan_budget(f, cost, 0.0, lim).best.nodes, 1);
}

// The ceiling worked by hand. cost(rows) = 1 + (rows − 1) / 4, draft 2, depth 7 (a block of 8):
// N = 7 commits 8 tokens in 2 + 2.75 ms — 1.684 a ms, × cost(1) = 1.684; N = 3 commits 4 in
// 3.75 ms (1.067); past the depth, more nodes add time and no token (N = 20: 8 in 8 ms).
TEST(AutoBudget, PerfectDrafterRatioIsTheBestChainOverAR) {
  const VerifyCost cost({{1, 1.0}, {65, 17.0}}, 65);
  EXPECT_NEAR(perfect_drafter_ratio(cost, 2.0, 64, 7), 8.0 / 4.75, 1e-12);
  EXPECT_NEAR(perfect_drafter_ratio(cost, 2.0, 3, 7), 4.0 / 3.75, 1e-12);   // at most 3 nodes
  EXPECT_NEAR(perfect_drafter_ratio(cost, 0.0, 64, 64), 65.0 / 17.0, 1e-12);  // free draft, deep block: the whole curve
  // Shapes: only rows 1, 3, 5 → N = 2 or 4: 5 tokens in 2 + 2 ms.
  EXPECT_NEAR(perfect_drafter_ratio(cost, 2.0, 64, 7, {1, 3, 5}), 5.0 / 4.0, 1e-12);
  // None within the tree: N = 1, as the plan does (2 tokens in 2 + 1.25 ms).
  EXPECT_NEAR(perfect_drafter_ratio(cost, 2.0, 64, 7, {1, 99}), 2.0 / 3.25, 1e-12);
  // The gate: a device as the CPU with the trained pair (verify rows about an AR step each, a draft of
  // 4 AR steps) stays shut; one as the H200 (rows nearly free, a draft of 2 AR steps) opens wide.
  EXPECT_LT(perfect_drafter_ratio(VerifyCost({{1, 0.37}, {17, 3.17}}, 17), 1.54, 16, 15), kSpeculationGate);
  EXPECT_GT(perfect_drafter_ratio(VerifyCost({{1, 0.186}, {17, 0.34}}, 17), 0.39, 16, 15), 2 * kSpeculationGate);
  EXPECT_THROW(perfect_drafter_ratio(cost, 2.0, 0, 7), Error);
  EXPECT_THROW(perfect_drafter_ratio(cost, std::nan(""), 4, 7), Error);
  EXPECT_THROW(perfect_drafter_ratio(VerifyCost({{1, 1.0}}, 1), 2.0, 4, 7), Error);
}

TEST(AutoBudget, ProfileRowsStepByAboutRootTwo) {
  EXPECT_EQ(profile_rows(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(profile_rows(2), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(profile_rows(5), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(profile_rows(17), (std::vector<int64_t>{1, 2, 3, 4, 5, 7, 9, 13, 17}));
  EXPECT_EQ(profile_rows(16), (std::vector<int64_t>{1, 2, 3, 4, 5, 7, 9, 13, 16}));
  EXPECT_EQ(profile_rows(20), (std::vector<int64_t>{1, 2, 3, 4, 5, 7, 9, 13, 17, 20}));
  EXPECT_EQ(profile_rows(65), (std::vector<int64_t>{1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65}));
  EXPECT_EQ(profile_rows(129), (std::vector<int64_t>{1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129}));
  EXPECT_THROW(profile_rows(0), Error);
  // The profile times exactly those sizes (each at least 3 times after an untimed pass).
  std::map<int64_t, int> runs;
  const VerifyCost c = profile_verify_cost([&](int64_t r) { ++runs[r]; return 0.1 * double(r); }, 17);
  std::vector<int64_t> timed;
  for (const auto& [r, k] : runs) {
    timed.push_back(r);
    EXPECT_GE(k, 4) << r;
  }
  EXPECT_EQ(timed, profile_rows(17));
  EXPECT_DOUBLE_EQ(c.ms(13), 1.3);
}

TEST(AutoBudget, PlanTakesARWhenEveryTreeIsSlowerThanOneOverCost1) {
  // Verify cost linear in rows (the CPU today): half-right nodes never pay for themselves.
  const VerifyCost linear({{1, 1.0}, {65, 65.0}}, 65);
  const BudgetPlan p = plan_budget(std::vector<double>(64, 0.5), linear, 0.0);
  EXPECT_FALSE(p.speculate());
  EXPECT_EQ(p.ar.nodes, 0);
  // A flat cost (memory-bound verify) and a chain that is always right: the whole chain.
  const VerifyCost flat({{1, 1.0}, {65, 1.2}}, 65);
  std::vector<double> chain(7, 1.0);
  chain.resize(64, 1e-9);  // siblings that are never right
  const BudgetPlan q = plan_budget(chain, flat, 0.1);
  EXPECT_TRUE(q.speculate());
  EXPECT_EQ(q.best.nodes, 7);
  EXPECT_DOUBLE_EQ(q.best.tokens, 8.0);
  // The drafter's cost alone can make AR the better choice.
  EXPECT_FALSE(plan_budget(chain, flat, 10.0).speculate());
}

TEST(AutoBudget, AcceptanceStartsAtThePriorAndLearns) {
  AcceptanceModel a;
  for (double s : {0.0, -0.1, -1.0, -3.3, -12.0}) EXPECT_DOUBLE_EQ(a.f(s), std::exp(s));
  // A tree with one node per bin region: node 1 (σ −0.1) always on the path, node 2 (σ −0.1) never.
  DraftTree t = root_tree(4);
  t.tokens = {5, 1, 2, 3};
  t.depths = {0, 1, 1, 2};
  t.parents = {-1, 0, 0, 1};
  t.ranks = {0, 0, 1, 0};
  t.scores = {0.0, -0.05, -0.1, -4.0};
  t.children = {{1, 2}, {3}, {}, {}};
  for (int r = 0; r < 200; ++r) a.observe(t, {0, 1});
  // Bin of σ ∈ (−0.25, 0]: 2 nodes a round, 1 accepted → f ≈ ½; σ = −4: never accepted → f ≈ 0.
  EXPECT_NEAR(a.f(-0.05), 0.5, 0.02);
  EXPECT_LT(a.f(-4.0), 0.002);
  EXPECT_GT(a.f(-4.0), 0.0);
  // Old rounds fade: after 200 rounds where everything is accepted, f(−4) is near 1.
  for (int r = 0; r < 200; ++r) a.observe(t, {0, 1, 3});
  EXPECT_GT(a.f(-4.0), 0.9);
}

// A drafter that is never right on a device where one node costs a little more than it could gain:
// AR steps follow each probe, 1, 2, 4 … 64 of them, never fewer than the probe-cost floor (3 here);
// a probe that looks good resumes speculation at once.
TEST(AutoBudget, ControllerBacksOffDoublingAndProbes) {
  RoundCosts costs;
  costs.verify = VerifyCost({{1, 1.0}, {2, 1.05}, {9, 8.0}}, 9);
  costs.draft_ms = 0;
  costs.draft_seen = costs.frozen = true;
  DraftTree bad = root_tree(7);
  for (int32_t d = 1; d <= 7; ++d) {  // a chain of σ = −5 d: f ≈ e^{−5} at the first node
    bad.tokens.push_back(d);
    bad.depths.push_back(d);
    bad.parents.push_back(d - 1);
    bad.ranks.push_back(0);
    bad.scores.push_back(-5.0 * d);
    bad.children.emplace_back();
    bad.children[size_t(d - 1)].push_back(d);
  }
  BudgetController c(64);
  std::vector<int64_t> waits;
  int64_t wait = 0;
  for (int step = 0; step < 600; ++step) {
    if (!c.draft_now()) {
      const BudgetChoice ar = c.ar_step(costs);
      EXPECT_EQ(ar.nodes, 0);
      EXPECT_DOUBLE_EQ(ar.ms, 1.0);
      ++wait;
      continue;
    }
    if (step > 0) waits.push_back(wait);
    wait = 0;
    const BudgetChoice b = c.choose(bad, costs);
    EXPECT_EQ(b.nodes, 1) << "a poor round still verifies its best tree (here one node)";
    c.observe(truncate_tree(bad, b.nodes), {0}, costs);
  }
  ASSERT_GE(waits.size(), 9u);
  // A probe's expected loss is 1.05 − 1.0067 ≈ 0.043 AR steps: share_k of the doubling's wait covers
  // it every time (share ⅛ of 1, 1/16 of 2, 1/32 of 4, then 2 % of 8, 16 …), so the doubling alone
  // sets the waits.
  const std::vector<int64_t> want = {1, 2, 4, 8, 16, 32, 64, 64, 64};
  EXPECT_EQ(std::vector<int64_t>(waits.begin(), waits.begin() + 9), want);
  // The drafter turns good (an always-right chain of σ = 0): the next probe speculates, and keeps on.
  while (!c.draft_now()) c.ar_step(costs);
  DraftTree good = bad;
  for (int64_t i = 1; i < good.size(); ++i) good.scores[size_t(i)] = 0.0;
  const BudgetChoice g = c.choose(good, costs);
  EXPECT_EQ(g.nodes, 1);  // a row costs about an AR step here: one sure node is the best rate (2 / 1.05)
  EXPECT_TRUE(c.draft_now());
  // One poor round among good ones does not stop speculation (the ratio is smoothed).
  EXPECT_GE(c.choose(bad, costs).nodes, 1);
  EXPECT_TRUE(c.draft_now());
}

// A drafter that claims confidence it does not have (σ ≈ 0, never right): the prior believes it for
// one round; the round's own re-check with what it learned stops the next draft.
TEST(AutoBudget, OverconfidentDrafterCostsOneRound) {
  RoundCosts costs;
  costs.verify = VerifyCost({{1, 1.0}, {2, 1.2}, {9, 3.0}, {65, 20.0}}, 65);
  costs.draft_ms = 0.5;
  costs.draft_seen = costs.frozen = true;
  DraftTree t = root_tree(7);
  for (int32_t d = 1; d <= 7; ++d) {
    t.tokens.push_back(d);
    t.depths.push_back(d);
    t.parents.push_back(d - 1);
    t.ranks.push_back(0);
    t.scores.push_back(-0.01 * d);
    t.children.emplace_back();
    t.children[size_t(d - 1)].push_back(d);
  }
  BudgetController c(64);
  const BudgetChoice first = c.choose(t, costs);
  EXPECT_EQ(first.nodes, 7) << "the prior f = exp(σ) ≈ 1 says the whole chain";
  EXPECT_TRUE(c.draft_now());
  // Nothing accepted: f(σ ≈ 0) drops to 2·0.99 / 9 ≈ 0.22, and the best tree now runs at ~0.8× AR.
  c.observe(truncate_tree(t, first.nodes), {0}, costs);
  EXPECT_FALSE(c.draft_now()) << "the re-check after one round falls back";
}

// The drafted tokens' calibration: decayed Σ accepted / Σ predicted (E[τ] − 1) over verified rounds,
// with kCalibPrior tokens of prior at 1, clamped to [kCalibMin, 1], scales f. A round that predicted
// p extra tokens and accepted a moves it to (a + 4) / (p + 4); it never exceeds 1 (a drafter better
// than predicted is left to the acceptance model), and a drafter that keeps its predictions keeps 1.
TEST(AutoBudget, CalibrationScalesAnOverPredictingDrafter) {
  RoundCosts costs;
  costs.verify = VerifyCost({{1, 1.0}, {2, 1.02}, {9, 1.2}, {65, 3.0}}, 65);
  costs.draft_ms = 0.5;
  costs.draft_seen = costs.frozen = true;
  DraftTree t = root_tree(7);
  for (int32_t d = 1; d <= 7; ++d) {  // σ = −0.1 d: the prior believes 0.9, 0.82 …
    t.tokens.push_back(d);
    t.depths.push_back(d);
    t.parents.push_back(d - 1);
    t.ranks.push_back(0);
    t.scores.push_back(-0.1 * d);
    t.children.emplace_back();
    t.children[size_t(d - 1)].push_back(d);
  }
  BudgetController c(64);
  EXPECT_DOUBLE_EQ(c.calibration(), 1.0);
  const BudgetChoice first = c.choose(t, costs);
  ASSERT_EQ(first.nodes, 7);
  const double predicted = first.tokens - 1;
  c.observe(truncate_tree(t, first.nodes), {0, 1, 2}, costs);  // 2 accepted
  EXPECT_NEAR(c.calibration(), (2 + 4) / (predicted + 4), 1e-12);
  // The next round's prediction is the acceptance model's f scaled by it.
  const BudgetChoice second = c.choose(t, costs);
  AcceptanceModel acc;
  acc.observe(truncate_tree(t, 7), {0, 1, 2});
  double want = 1;
  for (int i = 1; i <= second.nodes; ++i) want += c.calibration() * acc.f(t.scores[size_t(i)]);
  EXPECT_NEAR(second.tokens, std::min(want, 1.0 + second.nodes), 1e-9);
  // Rounds that accept all they predicted bring it back towards 1, never past it.
  BudgetController g(64);
  for (int r = 0; r < 30; ++r) {
    const BudgetChoice b = g.choose(t, costs);
    std::vector<int32_t> all(size_t(b.nodes + 1));
    std::iota(all.begin(), all.end(), 0);
    g.observe(truncate_tree(t, b.nodes), all, costs);
    EXPECT_LE(g.calibration(), 1.0);
  }
  EXPECT_DOUBLE_EQ(g.calibration(), 1.0);
}

// The trained pair's shape on the H200 (docs/perf.md): an AR step 0.19 ms, a draft 0.4 ms (two AR
// steps), verify nearly flat. A round that predicts poorly (the first of an answer) is followed by
// a short wait — the probe's expected loss, ~2 AR steps, at most an eighth of it — not the 76 AR
// steps a fixed 2 % share gave; a drafter that stays poor waits longer and longer, and in the long
// run its probes cost about kProbeShare of the time.
TEST(AutoBudget, FirstWaitIsShortAndPoorDrafterProbesRarely) {
  RoundCosts costs;
  costs.verify = VerifyCost({{1, 0.19}, {2, 0.2}, {5, 0.26}, {9, 0.29}, {17, 0.34}, {33, 0.44}, {65, 0.69}}, 65);
  costs.draft_ms = 0.4;
  costs.draft_seen = costs.frozen = true;
  DraftTree t = root_tree(15);
  for (int32_t d = 1; d <= 15; ++d) {  // a chain of σ = −1.5 d: f ≈ 0.22 at the first node
    t.tokens.push_back(d);
    t.depths.push_back(d);
    t.parents.push_back(d - 1);
    t.ranks.push_back(0);
    t.scores.push_back(-1.5 * d);
    t.children.emplace_back();
    t.children[size_t(d - 1)].push_back(d);
  }
  BudgetController c(64);
  std::vector<int64_t> waits;
  double probe_loss_ms = 0, ar_ms = 0;
  int64_t wait = 0;
  for (int step = 0; step < 20000; ++step) {
    if (!c.draft_now()) {
      ar_ms += c.ar_step(costs).ms;
      ++wait;
      continue;
    }
    if (step > 0) waits.push_back(wait);
    wait = 0;
    const BudgetChoice b = c.choose(t, costs);
    ASSERT_GE(b.nodes, 1);
    probe_loss_ms += b.ms - 1.0 * 0.19;  // nothing accepted: the round commits one token
    c.observe(truncate_tree(t, b.nodes), {0}, costs);
  }
  ASSERT_GE(waits.size(), 6u);
  EXPECT_GE(waits[0], 8);
  EXPECT_LE(waits[0], 24) << "the first wait after a poor round";
  for (size_t i = 1; i < 5; ++i) EXPECT_GE(waits[i], waits[i - 1]) << "waits grow while probes fail";
  EXPECT_LE(probe_loss_ms / ar_ms, 2.5 * BudgetController::kProbeShare) << "probes' share of the time, long run";
}

// --- in the engine -----------------------------------------------------------------------------

const DeepseekV3& fixture_model(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Checkpoint>> cks;
  static std::map<std::string, std::unique_ptr<DeepseekV3>> models;
  auto& m = models[name];
  if (!m) {
    cks[name] = std::make_unique<Checkpoint>(std::string(KDTREE_FIXTURES) + "/" + name);
    m = std::make_unique<DeepseekV3>(*cks[name]);
  }
  return *m;
}

std::vector<int32_t> prompt_for(const ModelConfig& c, int salt = 0) {
  std::vector<int32_t> p;
  for (int i = 0; i < 7; ++i) p.push_back(int32_t((i * 97 + 5 + salt * 13) % c.vocab_size));
  return p;
}

// A device where verify rows are nearly free (memory-bound, the GPU's shape): cost(rows) = 1 + rows/20.
SpecOptions auto_spec(double draft_ms, bool chain = false) {
  SpecOptions so;
  so.auto_budget = true;
  so.chain = chain;
  so.budget = 64;
  so.fixed_verify_ms = {{1, 1.05}, {65, 4.25}};
  so.fixed_draft_ms = draft_ms;
  return so;
}

// AR's run of `prompt`, and the whole sequence it makes (what a synthetic drafter that knows the
// continuation is given).
struct ArTruth {
  GenerateResult ar;
  std::vector<int32_t> truth;
};
ArTruth ar_truth(const DeepseekV3& m, const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  ArTruth r{generate_ar(m, prompt, opt), prompt};
  r.truth.insert(r.truth.end(), r.ar.output_ids.begin(), r.ar.output_ids.end());
  return r;
}

void expect_same(const SpecResult& s, const GenerateResult& ar, const std::string& what) {
  ASSERT_EQ(s.gen.output_ids, ar.output_ids) << what;
  EXPECT_EQ(s.gen.finish_reason, ar.finish_reason) << what;
  ASSERT_EQ(s.gen.logits.size(), ar.logits.size()) << what;
  for (size_t i = 0; i < ar.logits.size(); ++i) ASSERT_EQ(s.gen.logits[i], ar.logits[i]) << what << " logit " << i;
  EXPECT_EQ(s.stats.target_forwards, 1 + s.stats.rounds) << what;
  const auto& bh = s.stats.budget_histogram;
  EXPECT_EQ(std::accumulate(bh.begin(), bh.end(), int64_t(0)), s.stats.rounds) << what;
  EXPECT_EQ(bh.empty() ? 0 : bh[0], s.stats.ar_steps) << what;
  EXPECT_GT(s.stats.predicted_ms, 0) << what;
}

TEST(AutoBudget, OutputEqualsARAndTheOraclePicksTheWholeBlock) {
  const DeepseekV3& m = fixture_model("k2-int4");
  const auto prompt = prompt_for(m.config());
  struct Sampling { float temp; uint64_t seed; };
  for (Sampling smp : {Sampling{0.0f, 0}, Sampling{0.8f, 3}}) {
    GenerateOptions opt;
    opt.max_new_tokens = 120;
    opt.ignore_eos = true;
    opt.sampling.temperature = smp.temp;
    opt.sampling.seed = smp.seed;
    opt.keep_logits = true;
    const GenerateResult ar = generate_ar(m, prompt, opt);
    std::vector<int32_t> truth = prompt;
    truth.insert(truth.end(), ar.output_ids.begin(), ar.output_ids.end());
    for (const char* profile : {"oracle", "0.6,0.25", "0.05"}) {
      for (bool chain : {false, true}) {
        SyntheticDrafter d(truth, SyntheticDrafter::parse_profile(profile), 8, m.config().vocab_size, 7);
        const SpecResult s = generate_ddtree(m, d, prompt, opt, auto_spec(0.2, chain));
        const std::string what = cat("T=", smp.temp, " ", profile, chain ? " chain" : " tree");
        expect_same(s, ar, what);
        if (std::string(profile) == "oracle") {
          // Every node of the always-right chain is worth its row; siblings (σ ≈ −27) are not.
          // Only the last rounds, short of room, verify fewer.
          EXPECT_EQ(s.stats.ar_steps, 0) << what;
          EXPECT_GE(s.stats.budget_histogram[7], s.stats.rounds - 1) << what;
          EXPECT_GE(s.stats.mean_tau(), 7.5) << what;
        }
        if (std::string(profile) == "0.05") {
          // Right one time in twenty: a node gains 0.05 tokens for 0.05 ms, a draft costs 0.2 ms —
          // below AR's rate, so mostly AR steps.
          EXPECT_GT(s.stats.ar_steps, s.stats.rounds * 3 / 4) << what;
        }
      }
    }
  }
}

// A random-weight DFlash drafter is never right: after a probe or two the sequence runs AR steps
// (the drafter still gets every token's taps, so a probe drafts with full context), and the output
// stays AR's. Its costs: a drafter round as dear as 2 AR steps, verify rows cheap.
TEST(AutoBudget, RandomDrafterEndsUpInARSteps) {
  const std::string target_dir = std::string(KDTREE_FIXTURES) + "/k2-bf16";
  const std::string draft_dir =
      (std::filesystem::temp_directory_path() / cat("kdtree_test_budget_drafter_", ::getpid())).string();
  make_drafter(target_dir, draft_dir, 5, 2, 8, true);
  const DeepseekV3& m = fixture_model("k2-bf16");
  const auto prompt = prompt_for(m.config(), 1);
  for (float temp : {0.0f, 0.8f}) {
    GenerateOptions opt;
    opt.max_new_tokens = 200;
    opt.ignore_eos = true;
    opt.sampling.temperature = temp;
    opt.sampling.seed = 21;
    opt.keep_logits = true;
    const GenerateResult ar = generate_ar(m, prompt, opt);
    for (bool chain : {false, true}) {
      DFlashAdapter d(draft_dir, m, 512);
      SpecOptions so = auto_spec(2.0, chain);
      // (Verify rows cheap enough that a perfect drafter would double AR's rate: the gate is open
      // and this tests the backoff; the gate has its own test below.)
      so.fixed_verify_ms = {{1, 1.0}, {2, 1.3}, {9, 2.0}, {65, 8.0}};
      const SpecResult s = generate_ddtree(m, d, prompt, opt, so);
      const std::string what = cat("T=", temp, chain ? " chain" : " tree");
      expect_same(s, ar, what);
      EXPECT_GE(s.stats.ar_steps, s.stats.rounds * 9 / 10) << what << ": " << s.stats.ar_steps << " AR steps of " << s.stats.rounds;
      EXPECT_LE(s.stats.rounds - s.stats.ar_steps, 8) << what << ": probes";
      // The drafter saw every committed row up to its last draft (taps are handed over before it drafts).
      EXPECT_GE(d.context_len(), int64_t(prompt.size()));
    }
  }
  std::filesystem::remove_all(draft_dir);
}

// Counts what the engine asks of a drafter.
class CountingDrafter final : public Drafter {
 public:
  explicit CountingDrafter(Drafter& d) : d_(d) {}
  std::string name() const override { return d_.name(); }
  int64_t block_size() const override { return d_.block_size(); }
  const std::vector<int32_t>& tap_layers() const override { return d_.tap_layers(); }
  void append_context(const float* taps, int64_t n) override { appended += n, d_.append_context(taps, n); }
  int64_t context_len() const override { return d_.context_len(); }
  void draft(int32_t bonus, int64_t start, float* logits) override { ++drafts, d_.draft(bonus, start, logits); }
  int64_t drafts = 0, appended = 0;

 private:
  Drafter& d_;
};

// Where even a drafter that is always right could not reach kSpeculationGate × AR (the costs of
// the CPU with the trained pair: a verify row about an AR step, a draft of 4), --budget auto
// drafts nothing — not even the first round — and hands the drafter no taps: every round is an AR
// step, the output AR's. With the costs of the GPU the same oracle speculates from the start.
TEST(AutoBudget, NoRoundIsDraftedWhereEvenAPerfectDrafterLoses) {
  const std::string target_dir = std::string(KDTREE_FIXTURES) + "/k2-bf16";
  const std::string draft_dir =
      (std::filesystem::temp_directory_path() / cat("kdtree_test_budget_gate_", ::getpid())).string();
  make_drafter(target_dir, draft_dir, 6, 2, 8, true);
  const DeepseekV3& m = fixture_model("k2-bf16");
  const auto prompt = prompt_for(m.config(), 4);
  GenerateOptions opt;
  opt.max_new_tokens = 60;
  opt.ignore_eos = true;
  opt.keep_logits = true;
  const auto [ar, truth] = ar_truth(m, prompt, opt);
  struct Device {
    const char* name;
    std::vector<std::pair<int64_t, double>> verify;
    double draft;
    bool drafts;
  };
  for (const Device& dev : {Device{"cpu-like", {{1, 0.37}, {17, 3.17}, {65, 12.3}}, 1.54, false},
                            Device{"gpu-like", {{1, 0.186}, {17, 0.34}, {65, 0.69}}, 0.39, true}}) {
    for (bool real : {false, true}) {  // an oracle (no taps) and a DFlash drafter (taps)
      const std::string what = cat(dev.name, real ? " dflash" : " oracle");
      SyntheticDrafter oracle(truth, SyntheticDrafter::parse_profile("oracle"), 8, m.config().vocab_size, 7);
      DFlashAdapter dflash(draft_dir, m, 512);
      CountingDrafter d(real ? static_cast<Drafter&>(dflash) : static_cast<Drafter&>(oracle));
      SpecOptions so;
      so.auto_budget = true;
      so.budget = 64;
      so.fixed_verify_ms = dev.verify;
      so.fixed_draft_ms = dev.draft;
      const SpecResult s = generate_ddtree(m, d, prompt, opt, so);
      expect_same(s, ar, what);
      const double want = perfect_drafter_ratio(VerifyCost(dev.verify, 65), dev.draft, 64, 7);
      EXPECT_NEAR(s.stats.auto_ceiling, want, 1e-12) << what;
      EXPECT_EQ(want >= kSpeculationGate, dev.drafts) << what;
      if (!dev.drafts) {
        EXPECT_EQ(d.drafts, 0) << what;
        EXPECT_EQ(d.appended, 0) << what << ": an AR-only sequence feeds the drafter nothing";
        EXPECT_EQ(s.stats.ar_steps, s.stats.rounds) << what;
        EXPECT_EQ(s.stats.drafted, 0) << what;
      } else if (!real) {
        EXPECT_GT(d.drafts, 0) << what;
        EXPECT_EQ(s.stats.ar_steps, 0) << what << ": the oracle speculates from its first round";
      } else {
        EXPECT_GT(d.drafts, 0) << what;
        EXPECT_GE(d.appended, int64_t(prompt.size())) << what;
      }
    }
  }
  std::filesystem::remove_all(draft_dir);
}

// The cost model measured here (the start-up profile and online refinement, nothing fixed): the
// output is AR's whatever it decides, and it reports what it predicted.
TEST(AutoBudget, ProfiledCostsKeepTheOutput) {
  const DeepseekV3& m = fixture_model("k2-bf16");
  const auto prompt = prompt_for(m.config(), 2);
  GenerateOptions opt;
  opt.max_new_tokens = 40;
  opt.ignore_eos = true;
  opt.keep_logits = true;
  const auto [ar, truth] = ar_truth(m, prompt, opt);
  SyntheticDrafter d(truth, {1.0}, 8, m.config().vocab_size, 1);
  SpecOptions so;
  so.auto_budget = true;
  so.budget = 16;
  const SpecResult s = generate_ddtree(m, d, prompt, opt, so);
  expect_same(s, ar, "profiled");
  EXPECT_EQ(s.stats.budget_histogram.size(), 17u);
}

// In a batch each sequence decides alone (its own acceptance; with fixed costs nothing it decides
// depends on the others), so each request's output, rounds and chosen budgets equal its run alone.
TEST(AutoBudget, BatchEqualsAlone) {
  const DeepseekV3& m = fixture_model("k2-bf16");
  std::vector<test::Case> cases;
  for (int k = 0; k < 5; ++k) {
    test::Case c;
    c.prompt = prompt_for(m.config(), k + 3);
    c.gen.max_new_tokens = 40;
    c.gen.ignore_eos = true;
    c.gen.keep_logits = true;
    if (k % 2) c.gen.sampling = {0.8f, 0, 1.0f, 0.0f, uint64_t(50 + k)};
    cases.push_back(c);
  }
  // The drafter knows request 0's continuation only: request 0 speculates, the others fall back.
  const GenerateResult ar0 = generate_ar(m, cases[0].prompt, cases[0].gen);
  std::vector<int32_t> truth = cases[0].prompt;
  truth.insert(truth.end(), ar0.output_ids.begin(), ar0.output_ids.end());
  const auto make = [&] { return std::make_unique<SyntheticDrafter>(truth, std::vector<double>{0.9, 0.05}, 8, m.config().vocab_size, 4); };
  EngineOptions eo;
  eo.n_parallel = 5;
  eo.context = 256;
  eo.prefill_chunk = 5;
  eo.spec = auto_spec(0.3);
  eo.make_drafter = make;
  test::Sink sink;
  {
    Engine eng(m, eo);
    for (size_t k = 0; k < cases.size(); ++k) test::submit_case(eng, sink, k, cases[k]);
    sink.wait_done(cases.size());
    EXPECT_EQ(eng.metrics().kv_blocks_used, 0);
  }
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string what = cat("request ", k);
    const GenerateResult ar = generate_ar(m, cases[k].prompt, cases[k].gen);
    const test::Collected got = sink.get(k);
    ASSERT_EQ(got.ids, ar.output_ids) << what;
    ASSERT_EQ(got.logits, ar.logits) << what;
    auto d = make();
    const SpecResult alone = generate_ddtree(m, *d, cases[k].prompt, cases[k].gen, eo.spec);
    EXPECT_EQ(got.stats.rounds, alone.stats.rounds) << what;
    EXPECT_EQ(got.stats.ar_steps, alone.stats.ar_steps) << what;
    EXPECT_EQ(got.stats.budget_histogram, alone.stats.budget_histogram) << what;
    if (k == 0) {
      EXPECT_EQ(got.stats.ar_steps, 0) << "the drafter that knows the answer speculates throughout";
    } else {
      EXPECT_GT(got.stats.ar_steps, got.stats.rounds / 2) << what << ": a drafter that is always wrong";
    }
  }
}


// --- the trained pair (assets/pair) under the H200's measured costs -----------------------------

// The policy with the real drafter's acceptance and the H200's costs (the start-up profile and draft
// time that `bench --device cuda` logged at 3b92349, docs/perf.md), frozen, so its decisions depend on
// acceptance alone and its time is the model's: Σ over rounds of t_draft + cost(N + 1), or cost(1) for
// an AR step (SpecStats::predicted_ms). Guards the policy, not the device: on the H200 the same
// prompts measured auto at 2.89 / 2.59 / 0.85 / 2.20× AR (the AR steps there cost ~20 % more than
// plain AR, which this model leaves out). Each output must still be AR's.
TEST(AutoBudget, TrainedPairUnderH200CostsBeatsAR) {
  const std::string pair = std::string(KDTREE_FIXTURES) + "/../../assets/pair";
  Checkpoint ck(pair + "/target");
  const DeepseekV3 m(ck);
  std::ifstream in(pair + "/eval_prompts.json");
  ASSERT_TRUE(in) << pair << "/eval_prompts.json";
  const nlohmann::json prompts = nlohmann::json::parse(in);
  const std::vector<std::pair<int64_t, double>> h200 = {{1, 0.1857}, {2, 0.1994}, {5, 0.2560}, {9, 0.2956},
                                                         {17, 0.3396}, {33, 0.4353}, {49, 0.5138}, {65, 0.6886}};
  const double draft_ms = 0.39;
  GenerateOptions g;
  // Under ASan (test::kSanitized) one prompt of 32 tokens, output == AR only: the same code paths
  // (the trained drafter, auto rounds, AR steps) — 4 × 256 tokens took 1,100 s of the sanitized
  // ctest's 1,128 s; the release build (7 s) checks the speed-ups.
  g.max_new_tokens = test::kSanitized ? 32 : 256;
  g.ignore_eos = true;
  double sum = 0;
  const int n_prompts = test::kSanitized ? 1 : 4;
  for (int p = 0; p < n_prompts; ++p) {
    const std::vector<int32_t> prompt = prompts[size_t(p)]["ids"].get<std::vector<int32_t>>();
    const GenerateResult ar = generate_ar(m, prompt, g);
    SpecOptions so;
    so.auto_budget = true;
    so.budget = 64;
    so.fixed_verify_ms = h200;
    so.fixed_draft_ms = draft_ms;
    DFlashAdapter d(pair + "/drafter", m, 512);
    const SpecResult s = generate_ddtree(m, d, prompt, g, so);
    ASSERT_EQ(s.gen.output_ids, ar.output_ids) << "prompt " << p;
    if (test::kSanitized) continue;
    const double tokens = double(s.gen.output_ids.size() - 1);  // the prefill commits the first
    const double speedup = tokens / s.stats.predicted_ms * h200[0].second;
    // The fixed budget 16 under the same model: every round a draft and a verify of 17 rows.
    SpecOptions fixed;
    fixed.budget = 16;
    DFlashAdapter d16(pair + "/drafter", m, 512);
    const SpecResult s16 = generate_ddtree(m, d16, prompt, g, fixed);
    const VerifyCost cost(h200, 65);
    const double speedup16 = tokens / (double(s16.stats.rounds) * (draft_ms + cost.ms(17))) * h200[0].second;
    std::printf("prompt %d: auto %.2f× AR (τ %.2f, %lld AR steps of %lld rounds), budget 16 %.2f× (τ %.2f)\n", p, speedup,
                s.stats.mean_tau(), (long long)s.stats.ar_steps, (long long)s.stats.rounds, speedup16, s16.stats.mean_tau());
    // Never far below AR, even where no budget pays (prompt 2: budget 16 at ~0.5×).
    EXPECT_GE(speedup, 0.85) << "prompt " << p;
    sum += speedup;
  }
  // The mean over the four: 2.05× here (2.84, 2.49, 0.94, 1.92; 1.84 at 3b92349, before the
  // calibration); which round a probe lands on moves single prompts by ±0.5 (a loop caught a probe
  // earlier or later), the mean much less. A fixed 2 % probe share gives 1.58 here, and the policy of
  // d31fbbc measured 1.34 on the H200.
  if (!test::kSanitized) {
    EXPECT_GE(sum / 4, 1.6);
  }
}

}  // namespace
}  // namespace kd
