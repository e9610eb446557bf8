// `kdtree plan-budget`: what --budget auto would choose on a device whose verify cost is given, for
// a drafter of a stated acceptance profile — the chooser's own code (decode/budget.h) run offline,
// for capacity planning and for reporting against published acceptance (docs/perf.md).
//
// The profile is the synthetic drafter's (decode/synthetic_drafter.h): at every draft position the
// true token is the drafter's rank-r token with probability p_r, independently, and the drafter is
// calibrated (its distribution gives rank r probability p_r, the rest spread evenly). Then a node's
// acceptance is exactly exp(σ) — its surrogate probability — which is what the chooser's f converges
// to for such a drafter.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "decode/budget.h"
#include "decode/synthetic_drafter.h"
#include "decode/tree.h"

namespace kd::cli {

void add_plan_budget(CLI::App& app, PlanBudgetOptions& o) {
  auto* c = app.add_subcommand("plan-budget",
                               "What --budget auto picks for a given verify cost curve and a stated acceptance profile");
  c->add_option("--verify-ms", o.verify_ms,
                "Verify cost of this device: ROWS:MS,… for a forward of ROWS rows (the root + N nodes; ROWS = 1 is the "
                "AR step), e.g. 1:3.50,2:4.04,5:5.68,17:12.5,65:37.3 (linear in between)")
      ->required();
  c->add_option("--profile", o.profile,
                "Acceptance profile: the true token is the drafter's rank-r token with probability p_r at every "
                "position (e.g. 0.88,0.06,0.02), as synthetic:PROFILE drafters")
      ->required();
  c->add_option("--block-size", o.block_size, "The drafter's block size (draft positions = block − 1; default 8)")
      ->transform(whole_number(o.block_size))
      ->check(CLI::Range(int64_t(2), int64_t(64)));
  c->add_option("--draft-ms", o.draft_ms, "The drafter's cost a round, ms (several: one plan each; default 0)")->delimiter(',');
  c->add_option("--budget-max", o.budget_max, cat("The largest tree (default ", kDefaultBudgetMax, ")"))
      ->transform(whole_number(o.budget_max))
      ->check(CLI::Range(int64_t(1), kMaxTreeBudget));
  c->add_option("--vocab", o.vocab, "Vocabulary size of the calibrated draft distribution (default 163840, Kimi K2)")
      ->transform(whole_number(o.vocab))
      ->check(CLI::Range(int64_t(2), int64_t(1) << 24));
  c->add_flag("--json", o.json, "Print one JSON object");
}

namespace {

std::vector<std::pair<int64_t, double>> parse_points(const std::string& s) {
  std::vector<std::pair<int64_t, double>> pts;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t colon = item.find(':');
    size_t used_r = 0, used_m = 0;
    long long rows = 0;
    double ms = 0;
    try {
      if (colon == std::string::npos) throw std::invalid_argument("no colon");
      rows = std::stoll(item.substr(0, colon), &used_r);
      ms = std::stod(item.substr(colon + 1), &used_m);
    } catch (const std::exception&) {
      used_r = 0;
    }
    if (colon == std::string::npos || used_r != colon || used_m != item.size() - colon - 1)
      fail("--verify-ms: '", item, "' is not ROWS:MS (e.g. 17:12.5)");
    pts.push_back({int64_t(rows), ms});
  }
  if (pts.empty()) fail("--verify-ms: no points");
  if (pts.front().first != 1) fail("--verify-ms: the first point must be ROWS = 1 (the AR step the plan compares with)");
  return pts;
}

}  // namespace

int cmd_plan_budget(const PlanBudgetOptions& o) {
  const std::vector<double> profile = SyntheticDrafter::parse_profile(o.profile);
  const std::vector<std::pair<int64_t, double>> pts = parse_points(o.verify_ms);
  const int64_t L = o.block_size - 1, V = o.vocab, budget = o.budget_max;
  if (int64_t(profile.size()) >= V) fail("--profile: more ranks than the vocabulary");
  const VerifyCost cost(pts, std::max({budget + 1, L + 1, pts.back().first}));
  // Calibrated draft logits: rank r carries p_r, the remaining mass is spread evenly.
  double rest = 1;
  for (double p : profile) rest -= p;
  std::vector<float> logits(static_cast<size_t>(L * V), float(std::log(std::max(rest, 1e-12) / double(V - int64_t(profile.size())))));
  for (int64_t pos = 0; pos < L; ++pos)
    for (size_t r = 0; r < profile.size(); ++r) logits[size_t(pos * V) + r] = float(std::log(std::max(profile[r], 1e-30)));
  const DraftTree tree = build_draft_tree(logits.data(), L, V, budget);
  const DraftTree chain = build_draft_chain(logits.data(), L, V);
  auto exp_scores = [](const DraftTree& t) {
    std::vector<double> f;
    for (int64_t i = 1; i < t.size(); ++i) f.push_back(std::exp(t.scores[size_t(i)]));
    return f;
  };
  const std::vector<double> f = exp_scores(tree), fc = exp_scores(chain);
  const std::vector<double> drafts = o.draft_ms.empty() ? std::vector<double>{0.0} : o.draft_ms;
  nlohmann::ordered_json plans = nlohmann::ordered_json::array();
  const double ar_tps = 1e3 / cost.ms(1);
  for (double d : drafts) {
    if (!(d >= 0 && std::isfinite(d))) fail("--draft-ms ", d, ": must be ≥ 0");
    const BudgetPlan p = plan_budget(f, cost, d);
    // Chain DFlash verifies the whole chain each round: block − 1 nodes.
    double chain_tokens = 1;
    for (double x : fc) chain_tokens += x;
    const double chain_ms = d + cost.ms(L + 1);
    const bool spec = p.speculate();
    const BudgetChoice& pick = spec ? p.best : p.ar;
    plans.push_back({{"draft_ms", d},
                     {"budget", pick.nodes},
                     {"expected_tau", pick.tokens},
                     {"round_ms", pick.ms},
                     {"tokens_per_s", pick.tokens_per_ms() * 1e3},
                     {"speedup_vs_ar", pick.tokens_per_ms() * 1e3 / ar_tps},
                     {"chain_expected_tau", chain_tokens},
                     {"chain_tokens_per_s", chain_tokens / chain_ms * 1e3},
                     {"speedup_vs_chain", pick.tokens_per_ms() / (chain_tokens / chain_ms)}});
  }
  // E[τ(N)] and the round's rate at a few N (the first plan's draft cost), to show the trade-off.
  nlohmann::ordered_json curve = nlohmann::ordered_json::array();
  double tokens = 1;
  for (size_t i = 0; i < f.size(); ++i) {
    tokens += f[i];
    const int64_t n = int64_t(i + 1);
    if ((n & (n - 1)) == 0 || n == L || n == int64_t(f.size())) {
      const double ms = drafts[0] + cost.ms(n + 1);
      curve.push_back({{"nodes", n}, {"expected_tau", tokens}, {"round_ms", ms}, {"tokens_per_s", tokens / ms * 1e3}});
    }
  }
  if (o.json) {
    nlohmann::ordered_json j = {{"verify_ms", cost.table()},
                                {"profile", profile},
                                {"block_size", o.block_size},
                                {"budget_max", budget},
                                {"ar_tokens_per_s", ar_tps},
                                {"plans", plans},
                                {"curve", curve}};
    j["verify_ms"].erase(j["verify_ms"].begin());  // [0] unused: rows start at 1
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("AR: %.2f ms a token (%.1f tokens/s). Acceptance profile %s at %lld positions; a calibrated drafter.\n\n",
              cost.ms(1), ar_tps, o.profile.c_str(), (long long)L);
  std::printf("| t_draft ms | budget N | E[τ] | ms/round | tokens/s | × AR | chain E[τ] | chain tokens/s | × chain |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& pl : plans)
    std::printf("| %.2f | %s | %.3f | %.2f | %.1f | %.2f | %.3f | %.1f | %.2f |\n", pl["draft_ms"].get<double>(),
                pl["budget"].get<int64_t>() == 0 ? "AR" : std::to_string(pl["budget"].get<int64_t>()).c_str(),
                pl["expected_tau"].get<double>(), pl["round_ms"].get<double>(), pl["tokens_per_s"].get<double>(),
                pl["speedup_vs_ar"].get<double>(), pl["chain_expected_tau"].get<double>(),
                pl["chain_tokens_per_s"].get<double>(), pl["speedup_vs_chain"].get<double>());
  std::printf("\nThe trade-off at t_draft = %.2f ms:\n\n| N | E[τ(N)] | ms/round | tokens/s |\n| ---: | ---: | ---: | ---: |\n", drafts[0]);
  for (const auto& c : curve)
    std::printf("| %lld | %.3f | %.2f | %.1f |\n", (long long)c["nodes"].get<int64_t>(), c["expected_tau"].get<double>(),
                c["round_ms"].get<double>(), c["tokens_per_s"].get<double>());
  return 0;
}

}  // namespace kd::cli
