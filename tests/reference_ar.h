// The AR reference the engine tests check against, written out independently of the engine (generate_ar,
// the `kdtree run` path, runs through the engine): a host-KV target's single-sequence forward over a
// LatentCache (forward_cached) — the prompt in the target's prefill form, one decode-form forward per token —
// with the token at position p drawn as sample(logits, position_uniform(seed, seq_id, p)), stopping at a
// stop id or the length limit. Used by tests/unit/test_engine.cpp and test_tensor_parallel.cpp.
#pragma once
#include <algorithm>
#include <vector>

#include "decode/generate.h"
#include "kv/latent_cache.h"
#include "model/target.h"
#include "sample/rng.h"
#include "sample/sampler.h"

namespace kd::test {

inline GenerateResult reference_ar(const Target& t, const std::vector<int32_t>& prompt, const GenerateOptions& g) {
  const ModelConfig& c = t.config();
  const GenerationLimits lim = check_generation(c, prompt, g);
  const int64_t V = c.vocab_size;
  GenerateResult r;
  r.finish_reason = "length";
  if (lim.n_max == 0) return r;
  LatentCache cache(c.num_hidden_layers, c.latent_dim(), std::min(lim.n_prompt + lim.n_max, c.max_position_embeddings));
  std::vector<float> logits(static_cast<size_t>(V));
  forward_cached(t, cache, prompt.data(), lim.n_prompt, t.prefill_form(), false, logits.data());
  for (;;) {
    const int64_t pos = cache.size();
    const int32_t tok = sample(logits.data(), int32_t(V), g.sampling, position_uniform(g.sampling.seed, g.seq_id, uint64_t(pos)));
    r.output_ids.push_back(tok);
    if (g.keep_logits) r.logits.insert(r.logits.end(), logits.begin(), logits.end());
    if (!g.ignore_eos && std::find(g.stop_ids.begin(), g.stop_ids.end(), tok) != g.stop_ids.end()) {
      r.finish_reason = "stop";
      break;
    }
    if (int64_t(r.output_ids.size()) >= lim.n_max) break;
    forward_cached(t, cache, &tok, 1, g.decode_form, false, logits.data());
  }
  return r;
}

}  // namespace kd::test
