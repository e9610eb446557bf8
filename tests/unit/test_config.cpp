// config.json parsing: the published shapes load, YaRN and scales match SPEC-MODEL.md's numbers,
// the INT4 ignore list picks exactly the routed experts, and out-of-range fields are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/config.h"
#include "model/make_model.h"

namespace kd {
namespace {

using json = nlohmann::json;

json k2() { return json::parse(preset_config_json("k2")); }

std::string error_of(const json& j) {
  try {
    parse_model_config(j.dump(), "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, K2ShapesAndScales) {
  ModelConfig c = parse_model_config(k2().dump(), "k2");
  EXPECT_EQ(c.latent_dim(), 576);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.tensor_prefix, "model.");
  // SPEC-MODEL.md §2: factor 64 → 0.144680; factor 32 → 0.130861.
  EXPECT_NEAR(c.softmax_scale(), 0.144680, 5e-7);
  json j = k2();
  j["rope_scaling"]["factor"] = 32.0;
  EXPECT_NEAR(parse_model_config(j.dump(), "k2").softmax_scale(), 0.130861, 5e-7);
  EXPECT_DOUBLE_EQ(c.rope_attention_scaling(), 1.0);  // mscale == mscale_all_dim
}

TEST(Config, YarnRampMatchesSpec) {
  // beta 32/1 with θ = 50000: low 8, high 20, a linear blend between; beta 1/1: 19/20, a hard switch.
  ModelConfig c = parse_model_config(k2().dump(), "k2");
  std::vector<float> f = c.rope_inv_freq();
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    double base = std::pow(50000.0, -2.0 * i / 64.0);
    double ramp = std::clamp((i - 8.0) / 12.0, 0.0, 1.0);
    double want = base * (1 - ramp) + base / 64 * ramp;
    EXPECT_NEAR(f[size_t(i)], want, want * 2e-6) << i;
  }
  json j = k2();
  j["rope_scaling"]["beta_fast"] = 1.0;
  f = parse_model_config(j.dump(), "k2").rope_inv_freq();
  for (int i = 0; i < 32; ++i) {
    double base = std::pow(50000.0, -2.0 * i / 64.0);
    double want = i <= 19 ? base : base / 64;
    EXPECT_NEAR(f[size_t(i)], want, want * 2e-6) << i;
  }
}

TEST(Config, Int4IgnoreListSelectsRoutedExpertsOnly) {
  ModelConfig c = parse_model_config(k2().dump(), "k2");
  ASSERT_TRUE(c.quant.enabled);
  EXPECT_EQ(c.quant.group_size, 32);
  EXPECT_TRUE(c.quant.is_quantized("model.layers.3.mlp.experts.17.down_proj"));
  EXPECT_TRUE(c.quant.is_quantized("language_model.model.layers.60.mlp.experts.383.gate_proj"));
  EXPECT_FALSE(c.quant.is_quantized("model.layers.3.self_attn.q_a_proj"));
  EXPECT_FALSE(c.quant.is_quantized("model.layers.3.mlp.shared_experts.up_proj"));
  EXPECT_FALSE(c.quant.is_quantized("model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(c.quant.is_quantized("lm_head"));
}

TEST(Config, K25WrapperUsesTextConfigAndPrefix) {
  json text = k2();
  json q = text["quantization_config"];
  json wrapper = {{"architectures", {"KimiK25ForConditionalGeneration"}}, {"model_type", "kimi_k25"},
                  {"text_config", text}, {"quantization_config", q}, {"vision_config", {{"hidden_size", 1152}}}};
  ModelConfig c = parse_model_config(wrapper.dump(), "k25");
  EXPECT_EQ(c.tensor_prefix, "language_model.model.");
  EXPECT_EQ(c.lm_head_name, "language_model.lm_head.weight");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_TRUE(c.quant.enabled);
}

TEST(Config, EosMayBeAList) {
  json j = k2();
  j["eos_token_id"] = {163585, 163586};
  EXPECT_EQ(parse_model_config(j.dump(), "k2").eos_token_ids, (std::vector<int32_t>{163585, 163586}));
}

TEST(Config, RefusesOutOfRangeAndUnsupported) {
  struct Case {
    const char* key;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {"hidden_size", 0, "hidden_size"},
      {"hidden_size", "7168", "must be an integer"},
      {"num_experts_per_tok", 999, "num_experts_per_tok"},
      {"n_group", 7, "not divisible by n_group"},
      {"qk_rope_head_dim", 63, "even"},
      {"scoring_func", "softmax", "scoring_func"},
      {"q_lora_rank", nullptr, "q_lora_rank"},
      {"rms_norm_eps", -1.0, "rms_norm_eps"},
      {"eos_token_id", 999999, "eos_token_id"},
      {"vocab_size", nullptr, "missing required field 'vocab_size'"},
      {"tie_word_embeddings", true, "tie_word_embeddings"},
  };
  for (const auto& c : cases) {
    json j = k2();
    j[c.key] = c.value;
    std::string msg = error_of(j);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.key << ": '" << msg << "'";
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  }
  json j = k2();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  EXPECT_NE(error_of(j).find("FP8"), std::string::npos);
  j = k2();
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  EXPECT_NE(error_of(j).find("num_bits"), std::string::npos);
  j = k2();
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false;
  EXPECT_NE(error_of(j).find("symmetric"), std::string::npos);
  j = k2();
  j["rope_scaling"]["type"] = "longrope";
  EXPECT_NE(error_of(j).find("longrope"), std::string::npos);
  EXPECT_NE(error_of(json::array()).find("not a JSON object"), std::string::npos);
  try {
    parse_model_config("{not json", "config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos);
  }
}

// The one YaRN parse (io/config.h parse_rope), read by the target and the DFlash drafter alike.
TEST(Config, RopeParseIsSharedAndStrict) {
  const ModelConfig base = parse_model_config(k2().dump(), "k2");
  ASSERT_TRUE(base.rope.yarn);
  // transformers 5's rope_parameters (rope_theta inside) reads as rope_scaling + rope_theta.
  json j = k2();
  json rp = j["rope_scaling"];
  rp.erase("type");
  rp["rope_type"] = "yarn";
  rp["rope_theta"] = j["rope_theta"];
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = rp;
  const ModelConfig v5 = parse_model_config(j.dump(), "k2");
  EXPECT_EQ(v5.rope_theta, base.rope_theta);
  EXPECT_EQ(v5.rope_inv_freq(), base.rope_inv_freq());
  EXPECT_EQ(v5.rope_attention_scaling(), base.rope_attention_scaling());
  // DeepSeek's own spelling of the type.
  j = k2();
  j["rope_scaling"]["type"] = "deepseek_yarn";
  EXPECT_EQ(parse_model_config(j.dump(), "k2").rope_inv_freq(), base.rope_inv_freq());
  // The written form reads back as the same parameters.
  j = k2();
  j["rope_scaling"] = json::parse(rope_scaling_json(base.rope).dump());
  const ModelConfig back = parse_model_config(j.dump(), "k2");
  EXPECT_EQ(back.rope_inv_freq(), base.rope_inv_freq());
  EXPECT_EQ(back.rope.original_max_position_embeddings, base.rope.original_max_position_embeddings);
  EXPECT_TRUE(rope_scaling_json(RopeScaling{}).is_null());
  // Refused, naming the file and the field.
  j = k2();
  j["rope_scaling"]["rope_type"] = "linear";
  EXPECT_NE(error_of(j).find("config.json: rope_scaling.rope_type \"linear\" and .type \"yarn\" disagree"), std::string::npos)
      << error_of(j);
  j = k2();
  j["rope_scaling"]["truncate"] = false;
  EXPECT_NE(error_of(j).find("config.json: rope_scaling.truncate = false is not supported"), std::string::npos);
  j = k2();
  j["rope_scaling"]["attention_factor"] = 1.5;
  EXPECT_NE(error_of(j).find("rope_scaling.attention_factor is not supported"), std::string::npos);
  j = k2();
  j["rope_scaling"] = "yarn";
  EXPECT_NE(error_of(j).find("config.json: rope_scaling must be an object or null"), std::string::npos);
  j = k2();
  j["rope_scaling"]["factor"] = 0.5;
  EXPECT_NE(error_of(j).find("config.json: rope_scaling: field 'factor' = 0.5 is out of range"), std::string::npos);
  // The drafter's parse reads the same struct (and keeps the attention factor).
  RopeParams p = parse_rope(json::parse(R"({"rope_theta": 50000, "rope_scaling": {"rope_type": "yarn", "factor": 64,
      "original_max_position_embeddings": 4096, "attention_factor": 1.25}})"), "d");
  EXPECT_TRUE(p.scaling.yarn);
  EXPECT_EQ(p.theta, 50000.0);
  EXPECT_EQ(p.scaling.attention_factor, 1.25);
  p = parse_rope(json::object(), "d");
  EXPECT_FALSE(p.scaling.yarn);
  EXPECT_EQ(p.theta, 10000.0);
}

}  // namespace
}  // namespace kd
