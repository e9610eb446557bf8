#include "decode/ar.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "sample/rng.h"

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

GenerateResult generate_ar(const DeepseekV3& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                           const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = model.config();
  const GenerationLimits lim = check_generation(c, prompt, opt);
  const int64_t n_prompt = lim.n_prompt, n_max = lim.n_max;

  GenerateResult r;
  r.n_prompt = n_prompt;
  const int64_t V = c.vocab_size;
  LatentCache cache = model.new_cache(n_prompt + n_max);
  if (n_max == 0) {
    r.finish_reason = "length";
    return r;
  }
  std::vector<float> logits(size_t(opt.keep_prompt_logits ? n_prompt * V : V));
  ForwardStats st;
  double t0 = now_s();
  model.forward(cache, prompt.data(), n_prompt, AttnForm::expanded, opt.keep_prompt_logits, logits.data(), &st);
  r.prefill_ms = (now_s() - t0) * 1e3;
  r.n_target_forwards = 1;
  r.prefill_weight_bytes = st.weight_bytes;
  if (opt.keep_prompt_logits) r.prompt_logits = logits;
  const float* last = logits.data() + (opt.keep_prompt_logits ? (n_prompt - 1) * V : 0);

  std::vector<float> step(last, last + V);
  st = {};
  t0 = now_s();
  for (int64_t i = 0;; ++i) {
    const int64_t pos = n_prompt + i;  // absolute position of the token being sampled
    const float u = position_uniform(opt.sampling.seed, opt.seq_id, uint64_t(pos));
    const int32_t tok = sample(step.data(), int32_t(V), opt.sampling, u);
    r.output_ids.push_back(tok);
    if (opt.keep_logits) r.logits.insert(r.logits.end(), step.begin(), step.end());
    if (on_token) on_token(tok);
    if (!opt.ignore_eos && std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      r.finish_reason = "stop";
      break;
    }
    if (int64_t(r.output_ids.size()) >= n_max) {
      r.finish_reason = "length";
      break;
    }
    model.forward(cache, &tok, 1, opt.decode_form, false, step.data(), &st);
    ++r.n_target_forwards;
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = st.weight_bytes;
  return r;
}

}  // namespace kd
