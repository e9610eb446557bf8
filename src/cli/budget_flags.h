// `--budget N|auto` and `--budget-max N`, as run and serve take them, and what --budget auto reports
// (run's timing summary and --json; bench/ddtree-cpu.sh prints it from the JSON).
#pragma once
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "decode/generate.h"

namespace CLI { class App; }

namespace kd::cli {

// The largest tree --budget auto drafts unless --budget-max says otherwise.
inline constexpr int64_t kDefaultBudgetMax = 64;

struct BudgetFlags {
  std::string budget;      // "" (not given), "auto" or a whole number (checked by the parser)
  std::string budget_max;  // "" (not given) or a whole number (checked by the parser)
};

// Declares both flags on subcommand c. range_is_usage_error: a number outside [1, kMaxTreeBudget] is a
// usage error (exit 2, serve's contract) rather than check_budget_flags' error naming the cap (run's).
void add_budget_flags(CLI::App* c, BudgetFlags& b, bool range_is_usage_error = false);
// Checks the flags for decoder `mode` ("ddtree", "dflash", or "" / "ar": none) before anything
// loads; throws kd::Error naming the flag. ddtree's default is auto (at most kDefaultBudgetMax
// nodes), dflash's the fixed whole chain (--budget auto: the chain's best prefix or AR steps).
void check_budget_flags(const BudgetFlags& b, const std::string& mode);
// Sets so.budget / so.auto_budget for mode (after check_budget_flags).
void apply_budget_flags(const BudgetFlags& b, const std::string& mode, SpecOptions& so);

// run --json's spec.budget: the fixed budget, "auto", or null (chain).
nlohmann::ordered_json budget_field(const std::string& mode, const SpecOptions& so);
// The --budget auto fields of run --json (an empty object otherwise): budget_max, the histogram of
// chosen budgets {"N": rounds} (0: AR steps), ar_steps, predicted and measured tokens/s of rounds.
nlohmann::ordered_json budget_report_json(const SpecOptions& so, const SpecStats& st);
// The same as lines of run's timing summary (nothing for a fixed budget).
void print_budget_report(std::FILE* out, const SpecOptions& so, const SpecStats& st);

}  // namespace kd::cli
