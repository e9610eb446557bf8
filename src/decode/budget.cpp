#include "decode/budget.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"

namespace kd {

namespace {

constexpr double kCostStep = 0.2;   // weight of a new verify measurement in its row count's entry
constexpr double kDraftStep = 0.2;  // … of a new draft measurement

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

VerifyCost::VerifyCost(const std::vector<std::pair<int64_t, double>>& points, int64_t max_rows) {
  if (max_rows < 1) fail("verify cost: the table needs at least one row (got ", max_rows, ")");
  if (points.empty()) fail("verify cost: no measured points");
  for (size_t i = 0; i < points.size(); ++i) {
    const auto [rows, ms] = points[i];
    if (rows < 1 || rows > max_rows || !(std::isfinite(ms) && ms > 0))
      fail("verify cost: point ", i, " (", rows, " rows, ", ms, " ms) needs rows in [1, ", max_rows, "] and a time > 0");
    if (i > 0 && rows <= points[i - 1].first) fail("verify cost: rows must ascend (", points[i - 1].first, " then ", rows, ")");
  }
  // Below the first point its time (a forward costs no less for fewer rows than we saw); past the
  // last, the last segment's slope, never below the last time.
  if (points.front().first > 1) knots_.push_back({1, points.front().second});
  knots_.insert(knots_.end(), points.begin(), points.end());
  if (points.back().first < max_rows) {
    double v = points.back().second;
    if (points.size() > 1) {
      const auto [r0, m0] = points[points.size() - 2];
      const auto [r1, m1] = points.back();
      v = std::max(m1, m1 + (m1 - m0) * double(max_rows - r1) / double(r1 - r0));
    }
    knots_.push_back({max_rows, v});
  }
}

size_t VerifyCost::segment(int64_t rows, double* w) const {
  if (rows < 1 || rows > max_rows()) fail("verify cost: ", rows, " rows outside the table's 1 … ", max_rows());
  if (knots_.size() == 1) {
    *w = 0;
    return 0;
  }
  size_t j = 1;
  while (knots_[j].first < rows) ++j;  // knots_.back().first == max_rows ≥ rows
  *w = double(rows - knots_[j - 1].first) / double(knots_[j].first - knots_[j - 1].first);
  return j - 1;
}

double VerifyCost::ms(int64_t rows) const {
  double w = 0;
  const size_t j = segment(rows, &w);
  return w == 0 ? knots_[j].second : (1 - w) * knots_[j].second + w * knots_[j + 1].second;
}

void VerifyCost::observe(int64_t rows, double ms) {
  if (rows < 1 || rows > max_rows() || !(std::isfinite(ms) && ms > 0)) return;
  double w = 0;
  const size_t j = segment(rows, &w);
  const double pred = this->ms(rows);
  const double err = std::clamp(ms, 0.5 * pred, 2.0 * pred) - pred;
  // The step on (1 − w, w) that removes kCostStep of the error: Δ = kCostStep · err / ((1 − w)² + w²).
  const double step = kCostStep * err / ((1 - w) * (1 - w) + w * w);
  knots_[j].second = std::max(1e-6, knots_[j].second + step * (1 - w));
  if (w > 0) knots_[j + 1].second = std::max(1e-6, knots_[j + 1].second + step * w);
}

std::vector<double> VerifyCost::table() const {
  std::vector<double> t;
  for (int64_t r = 1; r <= max_rows(); ++r) t.push_back(ms(r));
  return t;
}

void RoundCosts::observe_verify(int64_t rows, double ms) {
  if (!frozen) verify.observe(rows, ms);
}

void RoundCosts::observe_draft(double ms) {
  if (frozen || !(std::isfinite(ms) && ms >= 0)) return;
  draft_ms = draft_seen ? draft_ms + kDraftStep * (ms - draft_ms) : ms;
  draft_seen = true;
}

int AcceptanceModel::bin(double sigma) {
  if (!(sigma < 0)) return 0;  // σ = 0 (or a rounding above it)
  const double b = std::floor(-sigma / kBinWidth);
  return b >= kBins - 1 ? kBins - 1 : int(b);
}

double AcceptanceModel::f(double sigma) const {
  const int b = bin(sigma);
  const double prior = std::exp(std::min(sigma, 0.0));
  return (accepted_[size_t(b)] + kPriorWeight * prior) / (verified_[size_t(b)] + kPriorWeight);
}

void AcceptanceModel::observe(const DraftTree& tree, const std::vector<int32_t>& path) {
  for (int b = 0; b < kBins; ++b) {
    accepted_[size_t(b)] *= kDecay;
    verified_[size_t(b)] *= kDecay;
  }
  size_t k = 1;  // path[0] is the root; the rest ascend
  for (int64_t i = 1; i < tree.size(); ++i) {
    const int b = bin(tree.scores[size_t(i)]);
    verified_[size_t(b)] += 1;
    if (k < path.size() && path[k] == i) {
      accepted_[size_t(b)] += 1;
      ++k;
    }
  }
}

namespace {

void check_plan_input(const std::vector<double>& f, const VerifyCost& cost, const PlanLimits& lim) {
  if (f.empty()) fail("budget plan: no nodes to choose from");
  if (int64_t(f.size()) + 1 > cost.max_rows())
    fail("budget plan: ", f.size(), " nodes need cost(", f.size() + 1, "), the table ends at ", cost.max_rows(), " rows");
  if (!lim.depths.empty() && lim.depths.size() != f.size())
    fail("budget plan: ", lim.depths.size(), " node depths for ", f.size(), " nodes");
}

// The candidate rounds N = 1 … f.size() that the limits allow (N = 1 when none is), each with its
// expected tokens — 1 + Σ_{i ≤ N} f_i, capped at 1 + the deepest of those nodes' depth — and time.
template <class Visit>
void for_each_choice(const std::vector<double>& f, const VerifyCost& cost, double draft_ms, const PlanLimits& lim,
                     Visit visit) {
  double sum = 1;
  int32_t deepest = 0;
  size_t next_shape = 0;
  bool any = false;
  for (size_t i = 0; i < f.size(); ++i) {
    sum += f[i];
    if (!lim.depths.empty()) deepest = std::max(deepest, lim.depths[i]);
    const int64_t rows = int64_t(i) + 2;
    if (!lim.shapes.empty()) {
      while (next_shape < lim.shapes.size() && lim.shapes[next_shape] < rows) ++next_shape;
      if (next_shape == lim.shapes.size() || lim.shapes[next_shape] != rows) continue;
    }
    const double tokens = lim.depths.empty() ? sum : std::min(sum, 1.0 + double(deepest));
    visit(BudgetChoice{int64_t(i + 1), tokens, draft_ms + cost.ms(rows)});
    any = true;
  }
  if (!any) {
    const double tokens = lim.depths.empty() ? 1 + f[0] : std::min(1 + f[0], 1.0 + double(lim.depths[0]));
    visit(BudgetChoice{1, tokens, draft_ms + cost.ms(2)});
  }
}

}  // namespace

BudgetPlan plan_budget(const std::vector<double>& f, const VerifyCost& cost, double draft_ms, const PlanLimits& limits) {
  check_plan_input(f, cost, limits);
  BudgetPlan p;
  p.ar = {0, 1.0, cost.ms(1)};
  bool first = true;
  for_each_choice(f, cost, draft_ms, limits, [&](const BudgetChoice& c) {
    if (first || c.tokens_per_ms() > p.best.tokens_per_ms()) p.best = c;
    first = false;
  });
  return p;
}

BudgetChoice best_at_rate(const std::vector<double>& f, const VerifyCost& cost, double draft_ms, double rate,
                          const PlanLimits& limits) {
  check_plan_input(f, cost, limits);
  BudgetChoice best;
  double best_gain = 0;
  bool first = true;
  for_each_choice(f, cost, draft_ms, limits, [&](const BudgetChoice& c) {
    const double gain = c.tokens - rate * (c.ms - draft_ms);
    if (first || gain > best_gain) best = c, best_gain = gain;
    first = false;
  });
  return best;
}

double perfect_drafter_ratio(const VerifyCost& cost, double draft_ms, int64_t max_nodes, int64_t depth,
                             const std::vector<int64_t>& shapes) {
  if (cost.max_rows() < 2) fail("perfect_drafter_ratio: the verify curve covers no tree (max rows ", cost.max_rows(), ")");
  if (max_nodes < 1 || depth < 1) fail("perfect_drafter_ratio: need at least one node and one draft position");
  if (!(std::isfinite(draft_ms) && draft_ms >= 0)) fail("perfect_drafter_ratio: draft time ", draft_ms, " ms");
  double best = 0;
  const int64_t n_max = std::min(max_nodes, cost.max_rows() - 1);
  for (int64_t n = 1; n <= n_max; ++n) {
    if (!shapes.empty() && !std::binary_search(shapes.begin(), shapes.end(), n + 1)) continue;
    best = std::max(best, double(1 + std::min(n, depth)) / (draft_ms + cost.ms(n + 1)));
  }
  if (best == 0) best = double(1 + std::min<int64_t>(1, depth)) / (draft_ms + cost.ms(2));  // as for_each_choice: N = 1
  return best * cost.ms(1);
}

BudgetController::BudgetController(int64_t max_nodes) : max_nodes_(max_nodes) {
  if (max_nodes < 1) fail("--budget auto: the largest tree must have at least one node (got ", max_nodes, ")");
}

BudgetChoice BudgetController::ar_step(const RoundCosts& costs) {
  if (ar_left_ > 0) --ar_left_;
  return {0, 1.0, costs.verify.ms(1)};
}

PlanLimits BudgetController::limits(const RoundCosts& costs) const { return {depths_, costs.shapes}; }

double BudgetController::calibration() const {
  return std::clamp((calib_accepted_ + kCalibPrior) / (calib_predicted_ + kCalibPrior), kCalibMin, 1.0);
}

std::vector<double> BudgetController::node_f() const {
  std::vector<double> f(scores_.size());
  const double c = calibration();
  for (size_t i = 0; i < scores_.size(); ++i) f[i] = c * acc_.f(scores_[i]);
  return f;
}

bool BudgetController::judge(const BudgetPlan& plan, bool recheck) {
  const double ratio = plan.best.tokens_per_ms() / plan.ar.tokens_per_ms();
  // A new round joins the smoothed ratio (a probe is judged on its own); a re-check replaces its
  // round's share.
  if (!recheck) {
    ratio_before_ = ratio_;
    smoothed_before_ = speculating_;
  }
  ratio_ = smoothed_before_ ? ratio_before_ + kSmoothing * (ratio - ratio_before_) : ratio;
  if (ratio_ >= 1.0) {
    speculating_ = true;
    fails_ = 0;
    return true;
  }
  speculating_ = false;
  ++fails_;
  return false;
}

BudgetChoice BudgetController::back_off(const std::vector<double>& f, const RoundCosts& costs, const BudgetPlan& plan) {
  const BudgetChoice probe = best_at_rate(f, costs.verify, costs.draft_ms, plan.ar.tokens_per_ms(), limits(costs));
  // What such a round costs beyond the AR steps that would have committed its expected tokens; the
  // wait makes the k-th consecutive probe at most share_k of the time spent waiting.
  const double loss_ms = std::max(0.0, probe.ms - probe.tokens * plan.ar.ms);
  const double share = std::max(kProbeShare, kFirstProbeShare / std::ldexp(1.0, int(std::min<int64_t>(fails_, 60)) - 1));
  const double floor_steps = std::ceil(loss_ms / (share * plan.ar.ms));
  const int64_t doubling = fails_ > 7 ? kMaxBackoff : std::min<int64_t>(int64_t(1) << (fails_ - 1), kMaxBackoff);
  ar_left_ = std::max<int64_t>(doubling, int64_t(std::min<double>(floor_steps, double(kMaxWait))));
  return probe;
}

BudgetChoice BudgetController::choose(const DraftTree& tree, const RoundCosts& costs) {
  const int64_t n = std::min({tree.size() - 1, max_nodes_, costs.verify.max_rows() - 1});
  scores_.assign(tree.scores.begin() + 1, tree.scores.begin() + 1 + std::max<int64_t>(n, 0));
  depths_.assign(tree.depths.begin() + 1, tree.depths.begin() + 1 + std::max<int64_t>(n, 0));
  if (n < 1) {  // nothing drafted: the root alone
    last_predicted_ = 0;
    return {0, 1.0, costs.verify.ms(1)};
  }
  const std::vector<double> f = node_f();
  const BudgetPlan plan = plan_budget(f, costs.verify, costs.draft_ms, limits(costs));
  const BudgetChoice c = judge(plan, false) ? plan.best : back_off(f, costs, plan);
  last_predicted_ = c.tokens - 1;
  return c;
}

void BudgetController::observe(const DraftTree& verified, const std::vector<int32_t>& path, const RoundCosts& costs) {
  acc_.observe(verified, path);
  calib_accepted_ = kCalibDecay * calib_accepted_ + double(path.size()) - 1;
  calib_predicted_ = kCalibDecay * calib_predicted_ + last_predicted_;
  // The round's own check, with what it just taught: would its tree still look worth drafting? A
  // drafter that only looked good (the prior trusts its confidence) is caught after one round
  // instead of as many rounds as its pseudo-counts take to wear off.
  if (!speculating_ || scores_.empty()) return;
  const std::vector<double> f = node_f();
  const BudgetPlan plan = plan_budget(f, costs.verify, costs.draft_ms, limits(costs));
  if (!judge(plan, true)) back_off(f, costs, plan);
}

std::vector<int64_t> profile_rows(int64_t max_rows) {
  if (max_rows < 1) fail("verify cost profile: need at least one row (got ", max_rows, ")");
  // 1, 2, 3, 5, 9, 17, 33, 65 … (2^k + 1: a tree of 2^k nodes and its root) with the midpoints
  // 4, 7, 13, 25, 49, 97 … (3·2^(k−2) + 1) between them.
  std::vector<int64_t> rows;
  for (int64_t r = 1; r <= max_rows; r = r == 1 ? 2 : 2 * r - 1) {
    if (r >= 5) {
      const int64_t mid = 3 * ((r - 1) / 4) + 1;
      if (mid > rows.back()) rows.push_back(mid);
    }
    rows.push_back(r);
  }
  if (rows.back() != max_rows) {
    const int64_t last = rows.back();
    const int64_t mid = 3 * ((2 * last - 2) / 4) + 1;  // the midpoint on the way to the next 2^k + 1
    if (last >= 3 && mid > last && mid < max_rows) rows.push_back(mid);
    rows.push_back(max_rows);
  }
  return rows;
}

VerifyCost profile_verify_cost(const std::function<double(int64_t rows)>& time_forward, int64_t max_rows, double budget_s) {
  const std::vector<int64_t> rows = profile_rows(max_rows);
  constexpr size_t kMinRuns = 3, kMaxRuns = 9;
  constexpr double kCheapMs = 25;
  constexpr int kArStretch = 4;
  const double t0 = now_s();
  for (int64_t r : rows) time_forward(r);  // untimed: caches, buffers, graph capture
  std::vector<std::vector<double>> runs(rows.size());
  std::vector<double> spent(rows.size(), 0.0);
  for (size_t pass = 0; pass < kMaxRuns; ++pass) {
    if (pass > 0 && now_s() - t0 > budget_s) break;
    bool any = false;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (runs[i].size() >= kMinRuns && spent[i] >= kCheapMs) continue;
      // One row is an AR step, and AR steps come in stretches: timed as the last of kArStretch in a
      // row, not straight after the largest verify (whose activations push the weights out of the
      // caches: on the CPU with the trained pair that read cost(1) 0.67 ms where a stretch of AR
      // steps takes 0.45 — and AR looked 50 % dearer to every decision than it is).
      if (rows[i] == 1)
        for (int k = 1; k < kArStretch; ++k) time_forward(1);
      runs[i].push_back(time_forward(rows[i]));
      spent[i] += runs[i].back();
      any = true;
    }
    if (!any) break;
  }
  std::vector<std::pair<int64_t, double>> points;
  for (size_t i = 0; i < rows.size(); ++i) points.push_back({rows[i], std::max(median(runs[i]), 1e-6)});
  return VerifyCost(points, max_rows);
}

}  // namespace kd
