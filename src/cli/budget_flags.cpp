#include "cli/budget_flags.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>

#include "core/error.h"
#include "decode/budget.h"

namespace kd::cli {

namespace {

// "auto" (where allowed) or a whole number of int64, else a usage error naming the value; the range
// is checked later with the messages every budget flag shares.
CLI::Validator nodes_flag(bool allow_auto, bool range) {
  return CLI::Validator(
      [allow_auto, range](std::string& s) -> std::string {
        if (allow_auto && s == "auto") return {};
        int64_t v = 0;
        const char* end = s.data() + s.size();
        const auto [p, ec] = std::from_chars(s.data(), end, v);
        const std::string want = allow_auto ? "auto or a whole number of tree nodes" : "a whole number of tree nodes";
        if (ec == std::errc::result_out_of_range) return "'" + s + "' is out of range: expected " + want;
        if (ec != std::errc() || p != end || s.empty()) return "'" + s + "' is not " + want;
        if (range && (v < 1 || v > kMaxTreeBudget))
          return "'" + s + "' is outside [1, " + std::to_string(kMaxTreeBudget) + "] tree nodes (memory and time grow with budget²)";
        s = std::to_string(v);
        return {};
      },
      "", "nodes");
}

int64_t nodes_of(const std::string& s) { return std::stoll(s); }  // validated by the parser

void check_nodes(const char* flag, int64_t n) {
  if (n < 1) fail(flag, " must be at least 1 (got ", n, ")");
  if (n > kMaxTreeBudget)
    fail(flag, " ", n, " is more than ", kMaxTreeBudget, " tree nodes: verify memory and time grow with budget² "
         "(the tree's ancestor mask and attention rows), and acceptance stops improving long before; try 16–256");
}

}  // namespace

void add_budget_flags(CLI::App* c, BudgetFlags& b, bool range_is_usage_error) {
  c->add_option("--budget", b.budget,
                cat("DDTree tree nodes per round, root excluded, or auto (the default for --spec ddtree): each round "
                    "drafts one tree of --budget-max nodes and verifies its first N, the N that maximises expected "
                    "tokens/s from this device's verify cost (profiled at start-up, refined as it runs) and the "
                    "acceptance seen so far — or runs plain AR steps while no tree pays (a poor drafter, prose, "
                    "T > 0). Where even a drafter that is always right could not reach ", kSpeculationGate,
                    "× AR on this device (the start-up profile and a timed draft say; printed as 'budget gate'), it "
                    "drafts nothing: every step is AR. The output is the same either way. With --spec dflash, auto "
                    "picks how much of the chain to verify, or AR steps (default there: the whole chain). At most ",
                    kMaxTreeBudget))
      ->transform(nodes_flag(true, range_is_usage_error));
  c->add_option("--budget-max", b.budget_max,
                cat("With --budget auto (ddtree): the largest tree it drafts and may verify (default ", kDefaultBudgetMax,
                    ", at most ", kMaxTreeBudget, ")"))
      ->transform(nodes_flag(false, range_is_usage_error));
}

void check_budget_flags(const BudgetFlags& b, const std::string& mode) {
  const bool given = !b.budget.empty(), is_auto = b.budget == "auto";
  if (given && mode != "ddtree" && !(mode == "dflash" && is_auto)) {
    if (mode == "dflash") fail("--budget only applies to --spec ddtree (with --spec dflash: --budget auto, or none for the whole chain)");
    fail("--budget only applies to --spec ddtree");
  }
  if (given && !is_auto) check_nodes("--budget", nodes_of(b.budget));
  if (!b.budget_max.empty()) {
    if (mode != "ddtree") fail("--budget-max only applies to --spec ddtree (with --budget auto)");
    if (given && !is_auto) fail("--budget-max applies to --budget auto, not to a fixed --budget ", b.budget);
    check_nodes("--budget-max", nodes_of(b.budget_max));
  }
}

void apply_budget_flags(const BudgetFlags& b, const std::string& mode, SpecOptions& so) {
  so.chain = mode == "dflash";
  so.auto_budget = b.budget == "auto" || (b.budget.empty() && mode == "ddtree");
  if (so.chain) return;  // the chain's length is the drafter's block − 1
  if (so.auto_budget)
    so.budget = b.budget_max.empty() ? kDefaultBudgetMax : nodes_of(b.budget_max);
  else if (!b.budget.empty())
    so.budget = nodes_of(b.budget);
}

nlohmann::ordered_json budget_field(const std::string& mode, const SpecOptions& so) {
  if (so.auto_budget) return "auto";
  if (mode == "ddtree") return so.budget;
  return nullptr;
}

nlohmann::ordered_json budget_report_json(const SpecOptions& so, const SpecStats& st) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!so.auto_budget) return j;
  nlohmann::ordered_json hist = nlohmann::ordered_json::object();
  for (size_t n = 0; n < st.budget_histogram.size(); ++n)
    if (st.budget_histogram[n]) hist[std::to_string(n)] = st.budget_histogram[n];
  const double measured_ms = st.draft_ms + st.verify_ms;
  j["budget_max"] = so.chain ? std::max<int64_t>(0, int64_t(st.budget_histogram.size()) - 1) : so.budget;
  j["budget_histogram"] = hist;
  j["ar_steps"] = st.ar_steps;
  j["predicted_tokens_per_s"] = st.predicted_ms > 0 ? st.predicted_tokens / st.predicted_ms * 1e3 : 0.0;
  j["measured_tokens_per_s"] = measured_ms > 0 ? double(st.accepted + st.rounds) / measured_ms * 1e3 : 0.0;
  j["ceiling_x_ar"] = st.auto_ceiling;  // a drafter always right, × AR here (perfect_drafter_ratio)
  j["drafts"] = st.auto_ceiling >= kSpeculationGate;
  return j;
}

void print_budget_report(std::FILE* out, const SpecOptions& so, const SpecStats& st) {
  if (!so.auto_budget) return;
  const nlohmann::ordered_json j = budget_report_json(so, st);
  std::string hist;
  for (const auto& [n, rounds] : j["budget_histogram"].items()) hist += cat(hist.empty() ? "" : " ", "N", n, ":", rounds.get<int64_t>());
  std::fprintf(out, "budget auto  = at most %lld nodes; chosen N (rounds) %s; %lld AR steps\n",
               (long long)j["budget_max"].get<int64_t>(), hist.c_str(), (long long)st.ar_steps);
  std::fprintf(out, "budget model = predicted %.2f tokens/s, measured %.2f tokens/s (draft + verify time of the rounds)\n",
               j["predicted_tokens_per_s"].get<double>(), j["measured_tokens_per_s"].get<double>());
  if (st.auto_ceiling > 0)
    std::fprintf(out, "budget gate  = a drafter always right would reach %.3fx AR on this device: %s\n", st.auto_ceiling,
                 st.auto_ceiling >= kSpeculationGate ? "rounds are drafted"
                                                     : cat("below ", kSpeculationGate, "x, every step was AR").c_str());
}

}  // namespace kd::cli
