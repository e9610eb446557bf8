// config.json → ModelConfig: the DeepSeek-V3 text backbone shared by DeepSeek-V3/R1 and Kimi K2,
// K2-Thinking, K2.5 and K2.6 (SPEC-MODEL.md §1). Every field is range-checked; anything the engine
// does not implement (softmax routing, FP8 weights, q_lora_rank null, …) is refused by name.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/regex.h"

namespace kd {

struct RopeScaling {
  bool yarn = false;  // false: plain RoPE
  double factor = 1.0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;
  // Whether config.json gave mscale / mscale_all_dim (the defaults above stand in otherwise):
  // transformers' generic YaRN rule tells "absent" from any value (yarn_attention_factor).
  bool mscale_given = false, mscale_all_dim_given = false;
  int64_t original_max_position_embeddings = 4096;
  std::optional<double> attention_factor;  // rope_scaling.attention_factor, when config.json gives one
};

// YaRN's cos/sin amplitude by transformers' generic rule (modeling_rope_utils
// _compute_yarn_parameters, which z-lab's DFlashDraftModel runs through Qwen3RotaryEmbedding;
// SPEC-DDTREE.md §5): attention_factor when given; else, when mscale and mscale_all_dim are both
// given and non-zero, get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); else
// get_mscale(factor) — with get_mscale(f, m) = 0.1·m·ln f + 1, and 1 for f ≤ 1. 1.0 without YaRN.
// (The target's own rule is ModelConfig::rope_attention_scaling, which refuses attention_factor.)
double yarn_attention_factor(const RopeScaling& r);
// Whether that rule takes the mscale ratio: no attention_factor, mscale and mscale_all_dim given, non-zero.
bool yarn_mscale_ratio_applies(const RopeScaling& r);
// The legacy amplitude get_mscale(factor) = 0.1·ln(factor) + 1 that ignores mscale/mscale_all_dim
// (SGLang's and vLLM's generic YaRN rotary); 1.0 without YaRN.
double yarn_legacy_attention_factor(const RopeScaling& r);

// A config's RoPE: rope_theta and YaRN. The one parse of rope_scaling, for the target (config.json,
// or its text_config) and the DFlash drafter alike. Reads rope_scaling (transformers 4), else
// rope_parameters (transformers 5, which moves rope_theta inside); rope_theta is the top-level field,
// else rope_parameters.rope_theta, else 10000. The type is rope_type, else type (transformers'
// order; both given and different is an error); "yarn" and "deepseek_yarn" are YaRN, "default" or
// none plain RoPE, anything else is refused by name, as is truncate = false. What a caller does not
// implement (the target: attention_factor) it refuses itself. `label` names the file (and
// text_config) in errors.
struct RopeParams {
  double theta = 10000.0;
  RopeScaling scaling;
};
RopeParams parse_rope(const nlohmann::json& config, const std::string& label);
// The rope_scaling object that parse_rope reads back as `r` (null for plain RoPE).
nlohmann::ordered_json rope_scaling_json(const RopeScaling& r);

// compressed-tensors pack-quantized INT4 (SPEC-MODEL.md §3): which Linear modules are INT4.
struct QuantConfig {
  bool enabled = false;
  int32_t num_bits = 4;
  int32_t group_size = 32;
  std::vector<std::string> ignore;    // exact module names from the ignore list
  std::vector<Regex> ignore_re;      // its "re:" entries, matched at the start of the name like re.match
  // module = full module name without ".weight", e.g. "model.layers.3.mlp.experts.7.down_proj".
  bool is_quantized(const std::string& module) const;
};

struct ModelConfig {
  std::string model_type;      // "kimi_k2", "deepseek_v3", or the wrapper's "kimi_k25"
  std::string architecture;    // architectures[0]
  std::string tensor_prefix;   // "model." or "language_model.model." (K2.5/K2.6 wrapper)
  std::string lm_head_name;    // "lm_head.weight" or "language_model.lm_head.weight"

  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, moe_intermediate_size = 0;
  int64_t num_hidden_layers = 0, num_attention_heads = 0;
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int64_t n_routed_experts = 0, num_experts_per_tok = 0, n_shared_experts = 0;
  int64_t first_k_dense_replace = 0, n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = true;
  double rms_norm_eps = 1e-6;
  // HF's DeepseekV3 builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (1e-6),
  // whatever rms_norm_eps says; we follow transformers for parity (SPEC-MODEL.md §2).
  double latent_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  RopeScaling rope;
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
  QuantConfig quant;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t latent_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // cache values per token per layer
  bool is_moe_layer(int64_t layer) const { return layer >= first_k_dense_replace; }
  double softmax_scale() const;     // qk_head_dim^-0.5 × mscale² (YaRN)
  double rope_attention_scaling() const;  // YaRN's cos/sin factor (1.0 for Kimi)
  std::vector<float> rope_inv_freq() const;  // [qk_rope_head_dim / 2], fp32 as HF computes it
};

// Parses config.json text; `label` names the file in errors.
ModelConfig parse_model_config(const std::string& json_text, const std::string& label);
ModelConfig load_model_config(const std::string& dir);

}  // namespace kd
