// `kdtree bench --draft DIR --json-schema FILE | --gbnf FILE` (cmd_bench_grammar.cpp): DDTree under a
// grammar, through the serving engine (where constrained decoding lives) — per prompt, AR under the
// grammar, then each DDTree configuration with the draft tree masked by the grammar (the default) and
// unmasked: τ, drafted nodes a round, tokens/s, and whether each output equals AR's (it must).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/device.h"
#include "decode/generate.h"

namespace kd::cli {

// The median of v (0 for none; the mean of the middle two for an even count). Both benches' (cmd_bench_spec.cpp).
double bench_median(std::vector<double> v);
// The --json report's head both benches share: model, draft, device, spec, constraint (if any), n_gen,
// repetitions, temperature, seed.
nlohmann::ordered_json bench_json_head(const BenchOptions& o, const std::string& device);

struct SpecConfig {
  std::string label;  // "16", "auto", …
  SpecOptions so;
};

// The constrained bench's own flag checks, before anything is loaded.
void check_constrained(const BenchOptions& o);
int bench_constrained(const BenchOptions& o, const std::vector<std::vector<int32_t>>& prompts,
                      const std::vector<SpecConfig>& configs, const LoadedTarget& lt, const LoadedTarget::Drafters& drafters);

}  // namespace kd::cli
