// Plain autoregressive generation: one prefill over the prompt, then one target forward per token.
// It is the reference every speculative decoder must reproduce token for token: the token at
// absolute position p is sampled with position_uniform(seed, seq_id, p), never with call order.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/deepseek_v3.h"
#include "sample/sampler.h"

namespace kd {

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  SamplingParams sampling;
  uint64_t seq_id = 0;
  bool ignore_eos = false;
  std::vector<int32_t> stop_ids;   // the config's EOS ids unless the caller overrides
  bool keep_logits = false;        // fill GenerateResult::logits (for --dump-logits and tests)
  bool keep_prompt_logits = false; // fill GenerateResult::prompt_logits (teacher-forced)
  AttnForm decode_form = AttnForm::absorbed;
  int64_t context = 0;             // 0 → the model's max_position_embeddings
};

struct GenerateResult {
  std::vector<int32_t> output_ids;
  std::string finish_reason;       // "stop" (a stop id, included in output_ids) or "length"
  std::vector<float> logits;       // [output_ids.size(), vocab]: the logits each token was drawn from
  std::vector<float> prompt_logits;  // [prompt, vocab]
  double prefill_ms = 0, decode_ms = 0;
  int64_t n_prompt = 0, n_target_forwards = 0;  // forwards run: the prefill plus one per decode step
  uint64_t prefill_weight_bytes = 0, decode_weight_bytes = 0;
};

// Checks a generation request (sampling parameters, a non-empty prompt of in-vocabulary ids that
// leaves room in the context) and returns its limits; shared by every decoder.
struct GenerationLimits {
  int64_t ctx = 0, n_prompt = 0, n_max = 0;  // context, prompt length, tokens that may be generated
};
GenerationLimits check_generation(const ModelConfig& c, const std::vector<int32_t>& prompt, const GenerateOptions& opt);

// Validates the prompt (non-empty, ids in the vocabulary, fits the context) and generates.
// on_token(id) is called as each token is committed (for streaming); may be empty.
GenerateResult generate_ar(const DeepseekV3& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                           const std::function<void(int32_t)>& on_token = {});

}  // namespace kd
