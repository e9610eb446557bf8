#include "decode/generate.h"

#include <algorithm>

#include "core/error.h"

namespace kd {

GenerationLimits check_generation(const ModelConfig& c, const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  validate(opt.sampling);
  if (prompt.empty()) fail("the prompt is empty: give at least one token");
  if (opt.max_new_tokens < 0) fail("the number of tokens to generate (", opt.max_new_tokens, ") is negative");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= c.vocab_size)
      fail("prompt token ", prompt[i], " at index ", i, " is outside the vocabulary [0, ", c.vocab_size, ")");
  GenerationLimits lim;
  lim.ctx = opt.context > 0 ? std::min(opt.context, c.max_position_embeddings) : c.max_position_embeddings;
  lim.n_prompt = int64_t(prompt.size());
  if (lim.n_prompt >= lim.ctx)
    fail("the prompt has ", lim.n_prompt, " tokens, but the context holds ", lim.ctx, " (leave room for at least one new token)");
  lim.n_max = std::min(opt.max_new_tokens, lim.ctx - lim.n_prompt);
  return lim;
}

void check_spec(const SpecOptions& spec) {
  if (spec.chain) return;
  if (spec.budget < 1) fail("--budget must be at least 1 (got ", spec.budget, ")");
  if (spec.budget > kMaxTreeBudget)
    fail("--budget ", spec.budget, " is more than ", kMaxTreeBudget, " tree nodes (memory and time grow with budget²)");
}

}  // namespace kd
