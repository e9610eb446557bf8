// The DFlash drafter (SPEC-DDTREE.md §1, §5): logits match python/dflash_reference.py's goldens
// and those of z-lab's `dflash` package itself (python/dflash_package_golden.py: DFlashDraftModel
// loaded from the fixture, with config variants for the YaRN amplitude rule and the dflash_config
// knobs) over two rounds of the context cache, the cache is row-invariant, and a drafter that does
// not fit its target, or uses a variant kdtree does not implement, is refused naming the field.
//
// Tolerance: max |Δ| / max |ref| ≤ 1e-4 per logits tensor. Both sides run fp32 on the same bf16
// weights and differ only in summation order: the reference moves by ≤ 5e-7 when rerun in fp64
// (golden.json "fp64_rerun_rel_diff"). The mistakes this test exists to catch move the logits by
// 3e-2 (a causal block) to 0.5 (interleaved RoPE), and 0.32 for the legacy YaRN amplitude
// 1 + 0.1 ln 64 instead of the reference's 1.0 (golden.json "sensitivity_rel_diff"): 1e-4 sits
// between the two.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "test_util.h"
#include "model/deepseek_v3.h"
#include "model/dflash.h"
#include "model/make_drafter.h"
#include "model/make_model.h"

namespace kd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string fixture(const std::string& name) { return std::string(KDTREE_FIXTURES) + "/" + name; }

using test::read_tensor;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

// The target the fixtures were made for; its embedding and lm_head feed every drafter.
const DeepseekV3& target() {
  static Checkpoint ck(fixture("k2-bf16"));
  static DeepseekV3 model(ck);
  return model;
}

std::vector<float> draft(const DFlashDrafter& d, const DFlashDrafter::Context& ctx, const std::vector<int32_t>& block) {
  std::vector<float> out(static_cast<size_t>((d.config().block_size - 1) * d.config().vocab_size));
  d.draft(ctx, block.data(), target().embedding(), target().lm_head(), out.data());
  return out;
}

class DFlashParity : public ::testing::TestWithParam<const char*> {};

TEST_P(DFlashParity, LogitsMatchReferenceAcrossTwoRounds) {
  const std::string dir = fixture(GetParam());
  SafetensorsFile golden(dir + "/golden.safetensors");
  DFlashDrafter d(dir, target().config());
  const int64_t F = d.config().n_taps() * d.config().hidden_size;
  DFlashDrafter::Context ctx = d.new_context(4096);
  for (const char* round : {"1", "2"}) {
    const auto taps = read_tensor<float>(golden, cat("taps", round));
    const auto block = read_tensor<int32_t>(golden, cat("block", round));
    const auto ref = read_tensor<float>(golden, cat("logits", round));
    ASSERT_EQ(int64_t(block.size()), d.config().block_size);
    d.append_context(ctx, taps.data(), int64_t(taps.size()) / F);
    const auto got = draft(d, ctx, block);
    ASSERT_EQ(got.size(), ref.size());
    const double e = rel_err(got, ref);
    std::printf("  %s round %s (context %lld): max|d|/max|ref| = %.2e\n", GetParam(), round, (long long)ctx.len, e);
    EXPECT_LE(e, 1e-4) << GetParam() << " round " << round;
  }
}

TEST_P(DFlashParity, ContextIsRowInvariantAndDraftLeavesItUnchanged) {
  // Appending the context all at once or token by token gives bit-identical K/V and logits, and a
  // draft neither changes the context nor depends on an earlier draft.
  const std::string dir = fixture(GetParam());
  SafetensorsFile golden(dir + "/golden.safetensors");
  DFlashDrafter d(dir, target().config());
  const int64_t F = d.config().n_taps() * d.config().hidden_size;
  const auto taps = read_tensor<float>(golden, "taps1");
  const auto block = read_tensor<int32_t>(golden, "block1");
  const int64_t n = int64_t(taps.size()) / F;
  DFlashDrafter::Context whole = d.new_context(n), steps = d.new_context(n);
  d.append_context(whole, taps.data(), n);
  for (int64_t i = 0; i < n; ++i) d.append_context(steps, taps.data() + i * F, 1);
  ASSERT_EQ(whole.len, steps.len);
  for (size_t l = 0; l < whole.k.size(); ++l) {
    EXPECT_EQ(whole.k[l], steps.k[l]) << "layer " << l;
    EXPECT_EQ(whole.v[l], steps.v[l]) << "layer " << l;
  }
  const auto first = draft(d, whole, block);
  EXPECT_EQ(first, draft(d, steps, block));
  EXPECT_EQ(first, draft(d, whole, block));
  EXPECT_EQ(whole.len, n);
  EXPECT_THROW(d.append_context(whole, taps.data(), 1), Error);  // max_tokens = n
}

TEST_P(DFlashParity, RopeMatchesTransformers) {
  // At the fixtures' positions (< 210) YaRN's interpolated low frequencies barely move the logits,
  // so the ramp is checked directly against transformers' Qwen3RotaryEmbedding.
  const std::string dir = fixture(GetParam());
  SafetensorsFile golden(dir + "/golden.safetensors");
  DFlashDrafter d(dir, target().config());
  const auto want = read_tensor<float>(golden, "rope_inv_freq");
  const auto got = d.config().rope_inv_freq();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-7 * want[i]) << i;
  EXPECT_NEAR(d.config().rope_attention_factor, read_tensor<double>(golden, "rope_attention_factor")[0], 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DFlashParity, ::testing::Values("dflash-rope", "dflash-yarn"));

TEST(DFlash, ConfigFactsFromTheSpec) {
  const auto yarn = parse_dflash_config(read_text(fixture("dflash-yarn/config.json")), "dflash-yarn");
  EXPECT_TRUE(yarn.rope.yarn);
  // SPEC §5 (corrected): transformers' rule, get_mscale(64, 1) / get_mscale(64, 1).
  EXPECT_EQ(yarn.rope_attention_factor_rule, YarnFactorRule::mscale_ratio);
  EXPECT_EQ(yarn.rope_attention_factor, 1.0);
  EXPECT_EQ(yarn.mask_token_id, 510);
  EXPECT_EQ(yarn.target_layer_ids, (std::vector<int64_t>{0, 1, 2}));
  // transformers 5's rope_parameters spelling, with an explicit attention_factor, reads the same.
  json j = json::parse(read_text(fixture("dflash-yarn/config.json")));
  json rp = j["rope_scaling"];
  rp["rope_theta"] = j["rope_theta"];
  rp["attention_factor"] = 1.25;
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = rp;
  const auto v5 = parse_dflash_config(j.dump(), "v5");
  EXPECT_TRUE(v5.rope.yarn && v5.rope_attention_factor_rule == YarnFactorRule::attention_factor);
  EXPECT_EQ(v5.rope_attention_factor, 1.25);
  EXPECT_EQ(v5.rope_theta, 50000.0);
  EXPECT_EQ(v5.rope_inv_freq(), yarn.rope_inv_freq());
  // [ZL] build_target_layer_ids: Qwen3-8B (36 layers, 5 taps) and Kimi-K2.5-DFlash (61, 6).
  EXPECT_EQ(default_target_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_target_layer_ids(61, 6), (std::vector<int64_t>{1, 12, 24, 35, 47, 58}));
  EXPECT_EQ(default_target_layer_ids(36, 1), (std::vector<int64_t>{18}));
  EXPECT_EQ(default_target_layer_ids(3, 2), (std::vector<int64_t>{0, 2}));  // too shallow for the formula
  EXPECT_EQ(default_target_layer_ids(3, 3), (std::vector<int64_t>{0, 1, 2}));
}

// A copy of a fixture drafter in a temp dir with its config.json edited.
struct TempDrafter {
  std::string dir;
  TempDrafter(const std::string& name, const std::function<void(json&)>& edit, const std::string& from = "dflash-yarn") {
    dir = (fs::temp_directory_path() / cat("kdtree_test_", ::getpid(), "_", name)).string();
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(fixture(from + "/model.safetensors"), dir + "/model.safetensors");
    std::ifstream in(fixture(from + "/config.json"));
    json j = json::parse(in);
    edit(j);
    std::ofstream(dir + "/config.json") << j.dump(2);
  }
  ~TempDrafter() { fs::remove_all(dir); }
};

std::string load_error(const std::string& dir, const ModelConfig& t) {
  try {
    DFlashDrafter d(dir, t);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DFlash, RefusesADrafterThatDoesNotFitItsTarget) {
  const ModelConfig& t = target().config();
  const std::string good = fixture("dflash-yarn");
  ASSERT_EQ(load_error(good, t), "(no error)");
  {
    ModelConfig wide = t;
    wide.hidden_size = 128;
    const std::string e = load_error(good, wide);
    EXPECT_PRED2(has, e, "dflash-yarn/config.json");
    EXPECT_PRED2(has, e, "hidden_size = 64 differs from the target's hidden_size = 128");
  }
  {
    ModelConfig big = t;
    big.vocab_size = 1024;
    const std::string e = load_error(good, big);
    EXPECT_PRED2(has, e, "config.json: vocab_size = 512 differs from the target's vocab_size = 1024");
  }
  {
    TempDrafter d("tap", [](json& j) {
      j.erase("num_target_layers");  // so the check against the target, not the range check, fires
      j["dflash_config"]["target_layer_ids"] = {0, 1, 3};
    });
    const std::string e = load_error(d.dir, t);
    EXPECT_PRED2(has, e, d.dir + "/config.json: dflash_config.target_layer_ids holds 3, but the target has only 3 layers");
  }
  {
    TempDrafter d("tap_range", [](json& j) { j["dflash_config"]["target_layer_ids"] = {0, 3, 1}; });
    const std::string e = load_error(d.dir, t);
    EXPECT_PRED2(has, e, "config.json: dflash_config.target_layer_ids holds 3, not a layer index in [0, 2]");
  }
  {
    TempDrafter d("block", [](json& j) { j["block_size"] = 1; });
    const std::string e = load_error(d.dir, t);
    EXPECT_PRED2(has, e, "block_size = 1 must be at least 2");
  }
  {
    TempDrafter d("mask", [](json& j) { j["dflash_config"]["mask_token_id"] = 512; });
    const std::string e = load_error(d.dir, t);
    EXPECT_PRED2(has, e, "config.json: field 'mask_token_id' = 512 is out of range [0, 511]");
  }
  {
    TempDrafter d("arch", [](json& j) { j["architectures"] = {"Qwen3ForCausalLM"}; });
    EXPECT_PRED2(has, load_error(d.dir, t), "architectures is [\"Qwen3ForCausalLM\"], expected [\"DFlashDraftModel\"]");
  }
  {
    TempDrafter d("sliding", [](json& j) { j["layer_types"] = {"full_attention", "sliding_attention"}; });
    EXPECT_PRED2(has, load_error(d.dir, t), "layer_types holds \"sliding_attention\"");
  }
  {
    TempDrafter d("heads", [](json& j) { j["num_key_value_heads"] = 1; });  // k_proj is [64, 64], not [32, 64]
    EXPECT_PRED2(has, load_error(d.dir, t), "tensor 'layers.0.self_attn.k_proj.weight' has shape [64, 64], expected [32, 64]");
  }
  {
    // A checkpoint without layers.1.mlp.up_proj.weight.
    TempDrafter d("missing", [](json&) {});
    SafetensorsFile src(fixture("dflash-yarn/model.safetensors"));
    SafetensorsWriter w;
    for (const auto& ti : src.tensors())
      if (ti.name != "layers.1.mlp.up_proj.weight") w.add_bytes(ti.name, ti.dtype, ti.shape, src.data(ti));
    w.write(d.dir + "/model.safetensors");
    const std::string e = load_error(d.dir, t);
    EXPECT_PRED2(has, e, "missing tensor 'layers.1.mlp.up_proj.weight' (looked in " + d.dir + "/model.safetensors)");
  }
}

TEST(DFlash, MisalignedTensorsLoadByCopy) {
  // One more header byte shifts every tensor to an odd address; the loader must copy them to
  // aligned memory and draft exactly as from the original file.
  TempDrafter d("misaligned", [](json&) {});
  const std::string img = read_text(fixture("dflash-yarn/model.safetensors"));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(img[size_t(i)])) << (8 * i);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(((n + 1) >> (8 * i)) & 0xff);
  out += img.substr(8, n) + " " + img.substr(8 + n);
  std::ofstream(d.dir + "/model.safetensors", std::ios::binary) << out;

  SafetensorsFile golden(fixture("dflash-yarn/golden.safetensors"));
  const auto taps = read_tensor<float>(golden, "taps1");
  const auto block = read_tensor<int32_t>(golden, "block1");
  DFlashDrafter a(fixture("dflash-yarn"), target().config()), b(d.dir, target().config());
  const int64_t T = int64_t(taps.size()) / (a.config().n_taps() * a.config().hidden_size);
  DFlashDrafter::Context ca = a.new_context(T), cb = b.new_context(T);
  a.append_context(ca, taps.data(), T);
  b.append_context(cb, taps.data(), T);
  EXPECT_EQ(draft(a, ca, block), draft(b, cb, block));
}

TEST(DFlash, MakeDrafterWritesALoadableDeterministicDrafter) {
  const std::string a = (fs::temp_directory_path() / cat("kdtree_test_", ::getpid(), "_mkd_a")).string();
  const std::string b = (fs::temp_directory_path() / cat("kdtree_test_", ::getpid(), "_mkd_b")).string();
  fs::remove_all(a);
  fs::remove_all(b);
  make_drafter(fixture("k2-bf16"), a, 7, 2, 8, false);
  make_drafter(fixture("k2-bf16"), b, 7, 2, 8, false);
  EXPECT_EQ(read_text(a + "/model.safetensors"), read_text(b + "/model.safetensors"));
  EXPECT_EQ(read_text(a + "/config.json"), read_text(b + "/config.json"));
  EXPECT_THROW(make_drafter(fixture("k2-bf16"), a, 7, 2, 8, false), Error);  // not empty, no force

  DFlashDrafter d(a, target().config());
  const DFlashConfig& c = d.config();
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{0, 2}));  // 3-layer target: evenly spread
  EXPECT_EQ(c.mask_token_id, 510);
  EXPECT_EQ(c.block_size, 8);
  EXPECT_EQ(c.num_key_value_heads * 2, c.num_attention_heads);
  EXPECT_EQ(c.hidden_size % c.head_dim, 0);
  EXPECT_TRUE(c.rope.yarn);  // the target's YaRN, mscale and mscale_all_dim 1 written out: amplitude 1
  EXPECT_EQ(c.rope_attention_factor_rule, YarnFactorRule::mscale_ratio);
  EXPECT_EQ(c.rope_attention_factor, 1.0);
  std::vector<float> taps(static_cast<size_t>(5 * c.n_taps() * c.hidden_size));
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(std::sin(double(i)));
  DFlashDrafter::Context ctx = d.new_context(64);
  d.append_context(ctx, taps.data(), 5);
  std::vector<int32_t> block(8, c.mask_token_id);
  block[0] = 42;
  for (float x : draft(d, ctx, block)) ASSERT_TRUE(std::isfinite(x));
  fs::remove_all(a);
  fs::remove_all(b);
}

// The dotted-key patch of python/dflash_package_golden.py: {"set": {"a.b": v}, "unset": ["a.c"]}.
void apply_patch(json& j, const json& patch) {
  auto walk = [&](const std::string& key, bool create) -> std::pair<json*, std::string> {
    json* node = &j;
    size_t i = 0;
    for (size_t dot; (dot = key.find('.', i)) != std::string::npos; i = dot + 1) {
      const std::string part = key.substr(i, dot - i);
      if (!node->contains(part) && create) (*node)[part] = json::object();
      node = &(*node)[part];
    }
    return {node, key.substr(i)};
  };
  const json set = patch.value("set", json::object()), unset = patch.value("unset", json::array());
  for (const auto& [key, value] : set.items()) {
    auto [node, last] = walk(key, true);
    (*node)[last] = value;
  }
  for (const auto& key : unset) {
    auto [node, last] = walk(key.get<std::string>(), false);
    node->erase(last);
  }
}

// Two rounds (taps1/block1, then taps2/block2) of the fixture's inputs through `d`.
std::pair<std::vector<float>, std::vector<float>> two_rounds(const DFlashDrafter& d, SafetensorsFile& inputs) {
  const int64_t F = d.config().n_taps() * d.config().hidden_size;
  DFlashDrafter::Context ctx = d.new_context(4096);
  std::vector<float> out[2];
  for (int r = 0; r < 2; ++r) {
    const auto taps = read_tensor<float>(inputs, cat("taps", r + 1));
    d.append_context(ctx, taps.data(), int64_t(taps.size()) / F);
    out[r] = draft(d, ctx, read_tensor<int32_t>(inputs, cat("block", r + 1)));
  }
  return {out[0], out[1]};
}

TEST(DFlashPackage, EveryConfigVariantMatchesTheDflashPackage) {
  // The goldens of z-lab's DFlashDraftModel itself (package_golden.json names the versions): the
  // fixture as made (YaRN amplitude 1.0 by transformers' mscale ratio), an explicit
  // attention_factor, another mscale ratio, an absent mscale (transformers' legacy fallback), the
  // dflash_config knobs in dflash_config and at the top level, and derived target_layer_ids.
  int checked = 0;
  for (const char* name : {"dflash-rope", "dflash-yarn"}) {
    const json meta = json::parse(read_text(fixture(cat(name, "/package_golden.json"))));
    SafetensorsFile inputs(fixture(cat(name, "/golden.safetensors")));
    SafetensorsFile golden(fixture(cat(name, "/package_golden.safetensors")));
    for (const auto& [variant, v] : meta.at("variants").items()) {
      SCOPED_TRACE(cat(name, " / ", variant));
      TempDrafter t(cat("pkg_", variant), [&v = v](json& j) { apply_patch(j, v); }, name);
      DFlashDrafter d(t.dir, target().config());
      EXPECT_NEAR(d.config().rope_attention_factor, read_tensor<double>(golden, variant + ".attention_scaling")[0], 1e-12);
      EXPECT_EQ(d.config().target_layer_ids, v.at("target_layer_ids").get<std::vector<int64_t>>());
      const auto [l1, l2] = two_rounds(d, inputs);
      const double e1 = rel_err(l1, read_tensor<float>(golden, variant + ".logits1"));
      const double e2 = rel_err(l2, read_tensor<float>(golden, variant + ".logits2"));
      std::printf("  %s / %s: max|d|/max|ref| = %.2e, %.2e\n", name, variant.c_str(), e1, e2);
      EXPECT_LE(e1, 1e-4);
      EXPECT_LE(e2, 1e-4);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 11);  // every variant the script made
}

TEST(DFlashPackage, LegacyMscaleOptionGivesTheLegacyAmplitude) {
  // --draft-yarn-legacy-mscale: 1 + 0.1 ln 64 (golden_legacy.safetensors: dflash_reference.py with it
  // forced as attention_factor), refused where it would change nothing or override config.json.
  SafetensorsFile inputs(fixture("dflash-yarn/golden.safetensors"));
  SafetensorsFile legacy(fixture("dflash-yarn/golden_legacy.safetensors"));
  DFlashLoadOptions o;
  o.yarn_legacy_mscale = true;
  DFlashDrafter d(fixture("dflash-yarn"), target().config(), o);
  EXPECT_EQ(d.config().rope_attention_factor_rule, YarnFactorRule::legacy_option);
  EXPECT_NEAR(d.config().rope_attention_factor, read_tensor<double>(legacy, "rope_attention_factor")[0], 1e-12);
  EXPECT_NEAR(d.config().rope_attention_factor, 1.0 + 0.1 * std::log(64.0), 1e-12);
  const auto [l1, l2] = two_rounds(d, inputs);
  EXPECT_LE(rel_err(l1, read_tensor<float>(legacy, "logits1")), 1e-4);
  EXPECT_LE(rel_err(l2, read_tensor<float>(legacy, "logits2")), 1e-4);
  auto error = [&](const std::string& dir) {
    try {
      DFlashDrafter x(dir, target().config(), o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_PRED2(has, error(fixture("dflash-rope")), "dflash-rope/config.json has no YaRN rope_scaling");
  TempDrafter af("legacy_af", [](json& j) { j["rope_scaling"]["attention_factor"] = 1.25; });
  EXPECT_PRED2(has, error(af.dir), "gives rope_scaling.attention_factor = 1.25, which the drafter uses as written");
}

// Every config field z-lab's dflash/model.py (0.1.0) reads, at a non-default value: what kdtree
// supports parses to that value (its logits are checked against the package above); what it does
// not is refused naming the field and the value.
TEST(DFlashPackage, ConfigKnobsAreSupportedOrRefusedByName) {
  const json base = json::parse(read_text(fixture("dflash-yarn/config.json")));
  struct Row {
    const char* what;
    std::function<void(json&)> edit;
    const char* error;  // nullptr: accepted
    std::function<void(const DFlashConfig&)> check;
  };
  const std::vector<Row> rows = {
      {"input_embedding_scale", [](json& j) { j["dflash_config"]["input_embedding_scale"] = 1.7; }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.input_embedding_scale, 1.7); }},
      {"output_multiplier at top level", [](json& j) { j["output_multiplier"] = 0.5; }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.output_multiplier, 0.5); }},
      {"dflash_config wins over the top level",
       [](json& j) { j["output_multiplier"] = 0.5; j["dflash_config"]["output_multiplier"] = 2.0; }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.output_multiplier, 2.0); }},
      {"final_logit_softcapping", [](json& j) { j["dflash_config"]["final_logit_softcapping"] = 30.0; }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.final_logit_softcapping, 30.0); }},
      {"final_logit_softcapping null (off)", [](json& j) { j["final_logit_softcapping"] = nullptr; }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.final_logit_softcapping, 0.0); }},
      {"final_logit_softcapping ≤ 0 (off, as `softcap > 0`)", [](json& j) { j["final_logit_softcapping"] = -3.0; },
       nullptr, [](const DFlashConfig& c) { EXPECT_EQ(c.final_logit_softcapping, 0.0); }},
      {"block_size in dflash_config", [](json& j) { j.erase("block_size"); j["dflash_config"]["block_size"] = 4; },
       nullptr, [](const DFlashConfig& c) { EXPECT_EQ(c.block_size, 4); }},
      {"mask_token_id at top level",
       [](json& j) { j["dflash_config"].erase("mask_token_id"); j["mask_token_id"] = 7; }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.mask_token_id, 7); }},
      {"target_layer_ids derived", [](json& j) { j["num_hidden_layers"] = 2; j["num_target_layers"] = 61;
                                                 j["dflash_config"].erase("target_layer_ids"); }, nullptr,
       [](const DFlashConfig& c) { EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{1, 58})); }},
      {"is_causal false", [](json& j) { j["is_causal"] = false; }, nullptr, [](const DFlashConfig&) {}},
      {"use_sliding_window below max_window_layers",
       [](json& j) { j.erase("layer_types"); j["use_sliding_window"] = true; j["sliding_window"] = 64; }, nullptr,
       [](const DFlashConfig&) {}},
      {"target_layer_ids not derivable", [](json& j) { j["dflash_config"].erase("target_layer_ids"); },
       "target_layer_ids is missing and z-lab's default for 2 drafter layers over 3 target layers does not give "
       "distinct layers", nullptr},
      {"DFlash2DraftModel", [](json& j) { j["architectures"] = {"DFlash2DraftModel"}; j["conv_kernel_size"] = 4; },
       "DFlash2 drafters (grouped dynamic convolutions, conv_kernel_size / conv_group_size, and a candidate selector",
       nullptr},
      {"sliding_attention layer", [](json& j) { j["layer_types"] = {"full_attention", "sliding_attention"}; },
       "layer_types holds \"sliding_attention\"", nullptr},
      {"use_sliding_window derived layers",
       [](json& j) { j.erase("layer_types"); j["use_sliding_window"] = true; j["sliding_window"] = 64;
                     j["max_window_layers"] = 1; },
       "use_sliding_window = true with sliding_window = 64 makes layers 1+ sliding_attention", nullptr},
      {"is_causal true", [](json& j) { j["is_causal"] = true; }, "is_causal = true is not supported", nullptr},
      {"partial_rotary_factor", [](json& j) { j["rope_scaling"]["partial_rotary_factor"] = 0.5; },
       "rope_scaling.partial_rotary_factor ≠ 1 is not supported", nullptr},
      {"attention_bias", [](json& j) { j["attention_bias"] = true; }, "attention_bias = true is not supported", nullptr},
      {"hidden_act", [](json& j) { j["hidden_act"] = "gelu"; }, "hidden_act \"gelu\" is not supported", nullptr},
      {"input_embedding_scale not a number", [](json& j) { j["dflash_config"]["input_embedding_scale"] = "big"; },
       "field 'input_embedding_scale' must be a number, found \"big\"", nullptr},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.what);
    json j = base;
    r.edit(j);
    try {
      const DFlashConfig c = parse_dflash_config(j.dump(), "knob/config.json");
      if (r.error)
        ADD_FAILURE() << "accepted; expected: " << r.error;
      else
        r.check(c);
    } catch (const Error& e) {
      if (!r.error)
        ADD_FAILURE() << "refused: " << e.what();
      else {
        EXPECT_PRED2(has, std::string(e.what()), "knob/config.json: ");
        EXPECT_PRED2(has, std::string(e.what()), r.error);
      }
    }
  }
}

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// z-lab/Kimi-K2.5-DFlash's published shape (SPEC-DDTREE.md §5) against Kimi K2.5's own config:
// it must parse, carry the reference's YaRN factor (1.0), and fit the target; a wrong hidden size, vocab or
// tap is refused by name. (No weights: the real drafter is 6.5 GB.)
TEST(DFlash, KimiK25DrafterShapeFitsTheK2Target) {
  const ModelConfig k2 = parse_model_config(preset_config_json("k2"), "k2");
  json j = {{"architectures", {"DFlashDraftModel"}}, {"model_type", "qwen3"},
            {"auto_map", {{"AutoModel", "dflash.DFlashDraftModel"}}},
            {"hidden_size", 7168}, {"intermediate_size", 18432}, {"num_hidden_layers", 6},
            {"num_attention_heads", 64}, {"num_key_value_heads", 8}, {"head_dim", 128},
            {"rms_norm_eps", 1e-5}, {"rope_theta", 50000.0}, {"max_position_embeddings", 262144},
            {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 64.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                              {"mscale", 1.0}, {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096}}},
            {"vocab_size", 163840}, {"block_size", 8}, {"num_target_layers", 61},
            {"dflash_config", {{"mask_token_id", 163838}, {"target_layer_ids", {1, 12, 24, 35, 47, 58}}}},
            {"attention_bias", false}, {"hidden_act", "silu"}, {"tie_word_embeddings", false}};
  const DFlashConfig c = parse_dflash_config(j.dump(), "Kimi-K2.5-DFlash/config.json");
  EXPECT_EQ(c.num_hidden_layers, 6);
  EXPECT_EQ(c.block_size, 8);
  EXPECT_EQ(c.n_taps(), 6);
  EXPECT_EQ(c.mask_token_id, 163838);
  EXPECT_EQ(c.rope_attention_factor, 1.0);  // mscale = mscale_all_dim = 1 (the legacy 1.416 only on request)
  EXPECT_NO_THROW(check_fits_target(c, k2, "Kimi-K2.5-DFlash/config.json"));
  auto refused = [&](const std::function<void(json&)>& edit, const char* expect) {
    json e = j;
    edit(e);
    try {
      check_fits_target(parse_dflash_config(e.dump(), "cfg.json"), k2, "cfg.json");
      ADD_FAILURE() << "accepted: " << expect;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(expect), std::string::npos) << err.what();
    }
  };
  refused([](json& e) { e["hidden_size"] = 4096; }, "hidden_size");
  refused([](json& e) { e["vocab_size"] = 163968; }, "vocab_size");
  refused([](json& e) { e["dflash_config"]["target_layer_ids"] = {1, 12, 24, 35, 47, 61}; }, "61");
}

}  // namespace
}  // namespace kd
