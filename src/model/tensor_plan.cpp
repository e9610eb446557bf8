#include "model/tensor_plan.h"

#include "core/error.h"

namespace kd {

int64_t PlannedTensor::params() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t PlannedTensor::bytes(int32_t group) const {
  if (int4) return uint64_t(shape[0]) * uint64_t((shape[1] + 7) / 8) * 4 + uint64_t(shape[0]) * uint64_t(shape[1] / group) * 2 + 8;
  return uint64_t(params()) * (fp32 ? 4 : 2);
}

const char* role_name(TensorRole r) {
  switch (r) {
    case TensorRole::embed: return "embedding";
    case TensorRole::lm_head: return "lm_head";
    case TensorRole::norm: return "norms";
    case TensorRole::attention: return "attention";
    case TensorRole::dense_mlp: return "dense MLP";
    case TensorRole::router: return "router";
    case TensorRole::router_bias: return "router bias";
    case TensorRole::shared_expert: return "shared experts";
    case TensorRole::routed_expert: return "routed experts";
  }
  return "?";
}

std::vector<PlannedTensor> plan_tensors(const ModelConfig& c) {
  std::vector<PlannedTensor> out;
  const std::string& p = c.tensor_prefix;
  const int64_t hid = c.hidden_size, H = c.num_attention_heads;
  auto linear = [&](const std::string& module, int64_t rows, int64_t cols, TensorRole role, int64_t layer) {
    bool q = c.quant.is_quantized(module);
    out.push_back({q ? module : module + ".weight", {rows, cols}, role, q, false, layer});
  };
  auto vec = [&](const std::string& name, int64_t n, TensorRole role, int64_t layer, bool fp32 = false) {
    out.push_back({name, {n}, role, false, fp32, layer});
  };
  auto mlp = [&](const std::string& prefix, int64_t inter, TensorRole role, int64_t layer) {
    linear(prefix + ".gate_proj", inter, hid, role, layer);
    linear(prefix + ".up_proj", inter, hid, role, layer);
    linear(prefix + ".down_proj", hid, inter, role, layer);
  };
  out.push_back({p + "embed_tokens.weight", {c.vocab_size, hid}, TensorRole::embed, false, false, -1});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string lp = cat(p, "layers.", l, ".");
    const std::string a = lp + "self_attn.";
    vec(lp + "input_layernorm.weight", hid, TensorRole::norm, l);
    linear(a + "q_a_proj", c.q_lora_rank, hid, TensorRole::attention, l);
    vec(a + "q_a_layernorm.weight", c.q_lora_rank, TensorRole::norm, l);
    linear(a + "q_b_proj", H * c.qk_head_dim(), c.q_lora_rank, TensorRole::attention, l);
    linear(a + "kv_a_proj_with_mqa", c.latent_dim(), hid, TensorRole::attention, l);
    vec(a + "kv_a_layernorm.weight", c.kv_lora_rank, TensorRole::norm, l);
    linear(a + "kv_b_proj", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, TensorRole::attention, l);
    linear(a + "o_proj", hid, H * c.v_head_dim, TensorRole::attention, l);
    vec(lp + "post_attention_layernorm.weight", hid, TensorRole::norm, l);
    const std::string m = lp + "mlp";
    if (!c.is_moe_layer(l)) {
      mlp(m, c.intermediate_size, TensorRole::dense_mlp, l);
      continue;
    }
    out.push_back({m + ".gate.weight", {c.n_routed_experts, hid}, TensorRole::router, false, false, l});
    vec(m + ".gate.e_score_correction_bias", c.n_routed_experts, TensorRole::router_bias, l, true);
    for (int64_t e = 0; e < c.n_routed_experts; ++e) mlp(cat(m, ".experts.", e), c.moe_intermediate_size, TensorRole::routed_expert, l);
    if (c.n_shared_experts > 0) mlp(m + ".shared_experts", c.moe_intermediate_size * c.n_shared_experts, TensorRole::shared_expert, l);
  }
  vec(p + "norm.weight", hid, TensorRole::norm, -1);
  out.push_back({c.lm_head_name, {c.vocab_size, hid}, TensorRole::lm_head, false, false, -1});
  return out;
}

ModelStats model_stats(const ModelConfig& c) {
  ModelStats s;
  const int32_t group = c.quant.group_size;
  // Each MoE layer reads num_experts_per_tok of its n_routed_experts per token.
  const double expert_frac = double(c.num_experts_per_tok) / double(c.n_routed_experts);
  for (const auto& t : plan_tensors(c)) {
    const int64_t n = t.params();
    const uint64_t b = t.bytes(group);
    s.total_params += n;
    s.stored_bytes += b;
    (t.int4 ? s.int4_modules : s.dense_tensors) += 1;
    double frac = t.role == TensorRole::routed_expert ? expert_frac : 1.0;
    uint64_t read = uint64_t(double(b) * frac + 0.5);
    if (t.role == TensorRole::embed) {
      s.active_params_with_embed += n;
      read = uint64_t(t.shape[1]) * 2;  // one row is looked up
    } else {
      s.active_params += int64_t(double(n) * frac + 0.5);
      s.active_params_with_embed += int64_t(double(n) * frac + 0.5);
    }
    s.bytes_per_token += read;
    s.bytes_per_token_by_role[int(t.role)] += read;
  }
  s.kv_bytes_per_token_bf16 = uint64_t(c.num_hidden_layers * c.latent_dim() * 2);
  s.kv_bytes_per_token_f32 = uint64_t(c.num_hidden_layers * c.latent_dim() * 4);
  return s;
}

}  // namespace kd
