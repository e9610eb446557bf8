#include "io/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/untrusted.h"
#include "io/json_fields.h"

namespace kd {

using json = nlohmann::json;

namespace {

QuantConfig parse_quant(const json& q, const std::string& label) {
  QuantConfig out;
  JsonFields r{q, label + ": quantization_config"};
  std::string method = r.string_or("quant_method", "");
  if (method == "fp8")
    fail(label, ": FP8 checkpoints (quant_method \"fp8\", e.g. Kimi-K2-Instruct) are not supported; use an INT4 "
                "release (K2-Thinking, K2.5, K2.6) or a bf16 checkpoint");
  if (method != "compressed-tensors")
    fail(label, ": quantization_config.quant_method \"", method, "\" is not supported (only \"compressed-tensors\")");
  std::string format = r.string_or("format", "");
  if (format != "pack-quantized")
    fail(label, ": compressed-tensors format \"", format, "\" is not supported (only \"pack-quantized\")");
  const json* groups = r.get("config_groups");
  if (!groups || !groups->is_object() || groups->size() != 1)
    fail(label, ": quantization_config.config_groups must hold exactly one group");
  const json& g = groups->begin().value();
  const std::string gl = cat(label, ": quantization_config.config_groups.", groups->begin().key());
  if (!g.is_object()) fail(gl, " is not an object");
  auto t = g.find("targets");
  if (t == g.end() || !t->is_array() || t->size() != 1 || *t != json::array({"Linear"}))
    fail(gl, ".targets must be [\"Linear\"]");
  auto ia = g.find("input_activations");
  if (ia != g.end() && !ia->is_null()) fail(gl, ".input_activations must be null (only weight-only W4A16 is supported)");
  auto w = g.find("weights");
  if (w == g.end() || !w->is_object()) fail(gl, ".weights is missing");
  JsonFields wr{*w, gl + ".weights"};
  out.num_bits = int32_t(wr.integer("num_bits", 1, 64));
  if (out.num_bits != 4) fail(gl, ".weights.num_bits = ", out.num_bits, " is not supported (only 4)");
  if (wr.string_or("type", "") != "int") fail(gl, ".weights.type must be \"int\"");
  if (!wr.boolean_or("symmetric", false)) fail(gl, ".weights.symmetric must be true (asymmetric INT4 is not supported)");
  if (wr.string_or("strategy", "") != "group") fail(gl, ".weights.strategy must be \"group\"");
  if (wr.boolean_or("dynamic", false)) fail(gl, ".weights.dynamic must be false");
  out.group_size = int32_t(wr.integer("group_size", 1, 1 << 20));
  if (const json* ig = r.get("ignore")) {
    if (!ig->is_array()) fail(label, ": quantization_config.ignore must be a list");
    for (const auto& s : *ig) {
      if (!s.is_string()) fail(label, ": quantization_config.ignore holds a non-string ", json_excerpt(s));
      std::string p = s.get<std::string>();
      if (p.rfind("re:", 0) == 0) {
        try {
          out.ignore_re.emplace_back(p.substr(3));
        } catch (const Error& e) {
          fail(label, ": quantization_config.ignore pattern '", escaped_excerpt(p, 200), "' is not a valid regex: ", e.what());
        }
      } else {
        out.ignore.push_back(std::move(p));  // an exact module name
      }
    }
  }
  out.enabled = true;
  return out;
}

}  // namespace

bool QuantConfig::is_quantized(const std::string& module) const {
  if (!enabled) return false;
  for (const auto& p : ignore)
    if (p == module) return false;
  for (const auto& re : ignore_re)
    if (re.match_prefix(module)) return false;
  return true;
}

namespace {
// yarn_get_mscale of DeepSeek-V3's and transformers' YaRN.
double get_mscale(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }
}  // namespace

double ModelConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(double(qk_head_dim()));
  if (rope.yarn && rope.mscale_all_dim != 0 && rope.factor > 1) {
    double m = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    s *= m * m;
  }
  return s;
}

double ModelConfig::rope_attention_scaling() const {
  if (!rope.yarn) return 1.0;
  if (rope.mscale != 0 && rope.mscale_all_dim != 0)
    return get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim);
  return get_mscale(rope.factor, 1.0);
}

bool yarn_mscale_ratio_applies(const RopeScaling& r) {
  // transformers tests `if mscale and mscale_all_dim`: absent and 0 both fall through to the legacy form.
  return r.yarn && !r.attention_factor && r.mscale_given && r.mscale_all_dim_given && r.mscale != 0 && r.mscale_all_dim != 0;
}

double yarn_attention_factor(const RopeScaling& r) {
  if (!r.yarn) return 1.0;
  if (r.attention_factor) return *r.attention_factor;
  if (yarn_mscale_ratio_applies(r))
    return get_mscale(r.factor, r.mscale) / get_mscale(r.factor, r.mscale_all_dim);
  return get_mscale(r.factor, 1.0);
}

double yarn_legacy_attention_factor(const RopeScaling& r) { return r.yarn ? get_mscale(r.factor, 1.0) : 1.0; }

std::vector<float> ModelConfig::rope_inv_freq() const {
  const int64_t dim = qk_rope_head_dim, half = dim / 2;
  std::vector<float> out(static_cast<size_t>(half));
  const double pi = 3.14159265358979323846;
  double low = 0, high = 0;
  if (rope.yarn) {
    auto corr = [&](double rot) {
      return double(dim) * std::log(double(rope.original_max_position_embeddings) / (rot * 2 * pi)) /
             (2 * std::log(rope_theta));
    };
    low = std::max(std::floor(corr(rope.beta_fast)), 0.0);
    high = std::min(std::ceil(corr(rope.beta_slow)), double(dim - 1));
    if (low == high) high += 0.001;  // HF's linear_ramp_factor avoids a zero division the same way
  }
  for (int64_t i = 0; i < half; ++i) {
    // HF computes base^(2i/dim) in fp32 and inverts it in fp32.
    float pos_freq = std::pow(float(rope_theta), float(2 * i) / float(dim));
    float extra = 1.0f / pos_freq;
    if (!rope.yarn) {
      out[size_t(i)] = extra;
      continue;
    }
    float inter = 1.0f / (float(rope.factor) * pos_freq);
    float ramp = std::clamp(float((double(i) - low) / (high - low)), 0.0f, 1.0f);
    float extrapolation_factor = 1.0f - ramp;
    out[size_t(i)] = inter * (1.0f - extrapolation_factor) + extra * extrapolation_factor;
  }
  return out;
}

RopeParams parse_rope(const json& config, const std::string& label) {
  JsonFields r{config, label};
  RopeParams out;
  // ln θ divides the YaRN ramp, so θ must exceed 1.
  constexpr double kThetaLo = 1.0 + 1e-6, kThetaHi = 1e12;
  out.theta = r.number("rope_theta", kThetaLo, kThetaHi, 10000.0);
  const char* key = r.get("rope_scaling") ? "rope_scaling" : "rope_parameters";
  const json* rs = r.get(key);
  if (!rs) return out;
  if (!rs->is_object()) fail(label, ": ", key, " must be an object or null");
  JsonFields y{*rs, cat(label, ": ", key)};
  if (!r.get("rope_theta")) out.theta = y.number("rope_theta", kThetaLo, kThetaHi, out.theta);
  const std::string rope_type = y.string_or("rope_type", ""), type = y.string_or("type", "");
  if (!rope_type.empty() && !type.empty() && rope_type != type)
    fail(label, ": ", key, ".rope_type \"", escaped_excerpt(rope_type), "\" and .type \"", escaped_excerpt(type),
         "\" disagree");
  const std::string t = rope_type.empty() ? type : rope_type;
  if (t == "yarn" || t == "deepseek_yarn") {
    RopeScaling& s = out.scaling;
    s.yarn = true;
    s.factor = y.number("factor", 1.0, 1e6);
    s.beta_fast = y.number("beta_fast", 1e-6, 1e6, 32.0);
    s.beta_slow = y.number("beta_slow", 1e-6, 1e6, 1.0);
    s.mscale = y.number("mscale", 0.0, 1e3, 1.0);
    s.mscale_all_dim = y.number("mscale_all_dim", 0.0, 1e3, 0.0);
    s.mscale_given = y.get("mscale") != nullptr;
    s.mscale_all_dim_given = y.get("mscale_all_dim") != nullptr;
    s.original_max_position_embeddings = y.integer("original_max_position_embeddings", 1, int64_t(1) << 30);
    if (const json* tr = y.get("truncate"); tr && *tr != true) fail(label, ": ", key, ".truncate = false is not supported");
    if (y.get("attention_factor")) s.attention_factor = y.number("attention_factor", 1e-6, 1e3);
  } else if (!t.empty() && t != "default") {
    fail(label, ": ", key, " type \"", escaped_excerpt(t), "\" is not supported (only \"yarn\", or none)");
  }
  return out;
}

nlohmann::ordered_json rope_scaling_json(const RopeScaling& r) {
  if (!r.yarn) return nullptr;
  nlohmann::ordered_json j = {{"rope_type", "yarn"},
                              {"factor", r.factor},
                              {"beta_fast", r.beta_fast},
                              {"beta_slow", r.beta_slow},
                              {"mscale", r.mscale},
                              {"mscale_all_dim", r.mscale_all_dim},
                              {"original_max_position_embeddings", r.original_max_position_embeddings}};
  if (r.attention_factor) j["attention_factor"] = *r.attention_factor;
  return j;
}

namespace {
ModelConfig parse_model_config_impl(const std::string& json_text, const std::string& label) {
  json root = parse_json(json_text, label);
  if (!root.is_object()) fail(label, ": top level is not a JSON object");
  ModelConfig c;
  c.model_type = JsonFields{root, label}.string_or("model_type", "");
  if (auto a = root.find("architectures"); a != root.end() && a->is_array() && !a->empty() && (*a)[0].is_string())
    c.architecture = (*a)[0].get<std::string>();

  // K2.5 / K2.6 wrap the text backbone in text_config and prefix its tensors with language_model.
  const json* text = &root;
  c.tensor_prefix = "model.";
  c.lm_head_name = "lm_head.weight";
  if (auto tc = root.find("text_config"); tc != root.end() && !tc->is_null()) {
    if (!tc->is_object()) fail(label, ": text_config is not an object");
    text = &*tc;
    c.tensor_prefix = "language_model.model.";
    c.lm_head_name = "language_model.lm_head.weight";
  }
  const std::string tl = text == &root ? label : label + ": text_config";
  JsonFields r{*text, tl};

  const int64_t kBig = int64_t(1) << 24;
  c.vocab_size = r.integer("vocab_size", 1, int64_t(1) << 22);
  c.hidden_size = r.integer("hidden_size", 1, 1 << 17);
  c.intermediate_size = r.integer("intermediate_size", 1, kBig);
  c.num_hidden_layers = r.integer("num_hidden_layers", 1, 1024);
  c.num_attention_heads = r.integer("num_attention_heads", 1, 4096);
  if (const json* q = r.get("q_lora_rank"); !q)
    fail(tl, ": q_lora_rank is null (DeepSeek-V2-Lite style direct q_proj) — not supported");
  c.q_lora_rank = r.integer("q_lora_rank", 1, kBig);
  c.kv_lora_rank = r.integer("kv_lora_rank", 1, kBig);
  c.qk_nope_head_dim = r.integer("qk_nope_head_dim", 1, 1 << 14);
  c.qk_rope_head_dim = r.integer("qk_rope_head_dim", 2, 1 << 14);
  if (c.qk_rope_head_dim % 2) fail(tl, ": qk_rope_head_dim = ", c.qk_rope_head_dim, " must be even (RoPE rotates pairs)");
  c.v_head_dim = r.integer("v_head_dim", 1, 1 << 14);
  c.n_routed_experts = r.integer("n_routed_experts", 1, 1 << 16);
  c.num_experts_per_tok = r.integer("num_experts_per_tok", 1, c.n_routed_experts);
  c.n_shared_experts = r.integer("n_shared_experts", 0, 64, 0);
  c.moe_intermediate_size = r.integer("moe_intermediate_size", 1, kBig);
  c.first_k_dense_replace = r.integer("first_k_dense_replace", 0, c.num_hidden_layers, 0);
  if (r.integer("moe_layer_freq", 1, 1024, 1) != 1) fail(tl, ": moe_layer_freq ≠ 1 is not supported");
  c.n_group = r.integer("n_group", 1, c.n_routed_experts, 1);
  if (c.n_routed_experts % c.n_group)
    fail(tl, ": n_routed_experts = ", c.n_routed_experts, " is not divisible by n_group = ", c.n_group);
  c.topk_group = r.integer("topk_group", 1, c.n_group, 1);
  if (c.n_group > 1 && c.n_routed_experts / c.n_group < 2)
    fail(tl, ": group-limited routing needs at least 2 experts per group (it sums each group's top 2)");
  if (c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group))
    fail(tl, ": num_experts_per_tok = ", c.num_experts_per_tok, " exceeds the experts in topk_group = ", c.topk_group, " groups");
  c.routed_scaling_factor = r.number("routed_scaling_factor", 0.0, 1e6, 1.0);
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", true);
  c.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-6);
  c.max_position_embeddings = r.integer("max_position_embeddings", 1, int64_t(1) << 30);
  if (std::string s = r.string_or("scoring_func", "sigmoid"); s != "sigmoid")
    fail(tl, ": scoring_func \"", s, "\" is not supported (only \"sigmoid\", as in DeepSeek-V3 and Kimi K2)");
  if (std::string s = r.string_or("topk_method", "noaux_tc"); s != "noaux_tc")
    fail(tl, ": topk_method \"", s, "\" is not supported (only \"noaux_tc\")");
  if (std::string s = r.string_or("hidden_act", "silu"); s != "silu") fail(tl, ": hidden_act \"", s, "\" is not supported (only silu)");
  if (r.boolean_or("attention_bias", false)) fail(tl, ": attention_bias = true is not supported");
  if (r.boolean_or("tie_word_embeddings", false)) fail(tl, ": tie_word_embeddings = true is not supported");
  if (int64_t kv = r.integer("num_key_value_heads", 1, 4096, c.num_attention_heads); kv != c.num_attention_heads)
    fail(tl, ": num_key_value_heads = ", kv, " must equal num_attention_heads = ", c.num_attention_heads, " (MLA)");

  {
    const RopeParams rope = parse_rope(*text, tl);
    c.rope_theta = rope.theta;
    c.rope = rope.scaling;
    if (c.rope.attention_factor)
      fail(tl, ": rope_scaling.attention_factor is not supported (the target's YaRN amplitude is the mscale ratio)");
  }

  c.bos_token_id = int32_t(r.integer("bos_token_id", -1, c.vocab_size - 1, -1));
  if (const json* e = r.get("eos_token_id")) {
    auto add = [&](const json& v) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.vocab_size)
        fail(tl, ": eos_token_id ", json_excerpt(v), " is not a token id in [0, ", c.vocab_size, ")");
      c.eos_token_ids.push_back(v.get<int32_t>());
    };
    if (e->is_array()) {
      for (const auto& v : *e) add(v);
    } else {
      add(*e);
    }
  }

  const json* q = r.get("quantization_config");
  if (!q) {
    auto it = root.find("quantization_config");
    if (it != root.end() && !it->is_null()) q = &*it;
  }
  if (q) {
    if (!q->is_object()) fail(label, ": quantization_config is not an object");
    c.quant = parse_quant(*q, label);
  }
  return c;
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& label) {
  try {
    return parse_model_config_impl(json_text, label);
  } catch (const nlohmann::json::exception& e) {
    // Every field is read through a type-checked accessor; this is the net under them.
    fail(label, ": unexpected JSON structure: ", e.what());
  }
}

ModelConfig load_model_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(path, ": cannot open (is ", dir, " a HuggingFace checkpoint directory?)");
  return parse_model_config(read_text_file(path, kMaxConfigBytes), path);
}

}  // namespace kd
