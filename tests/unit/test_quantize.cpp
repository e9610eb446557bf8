// `kdtree quantize`'s rules (model/quantize.h) against compressed-tensors 0.20.1's own bytes
// (tests/fixtures/quality/ct_vectors.safetensors, python/make_quality_fixtures.py): scale, the
// bf16 quotient, packing, at groups 32 and 128; the ignore-list syntax; which tensors are Linear;
// safetensors' in-file order. The whole-checkpoint byte comparison is tests/cli/test_quantize.py.
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/int4.h"
#include "io/safetensors.h"
#include "model/quantize.h"
#include "test_util.h"

namespace kd {
namespace {

using test::read_tensor;

class CtVectors : public ::testing::TestWithParam<int> {};

TEST_P(CtVectors, ScalesAndPackedWordsEqualCompressedTensors) {
  const int group = GetParam();
  SafetensorsFile f(std::string(KDTREE_FIXTURES) + "/quality/ct_vectors.safetensors");
  const auto w = read_tensor<uint16_t>(f, "weight");
  const auto scale = read_tensor<uint16_t>(f, "scale_g" + std::to_string(group));
  const auto packed = read_tensor<uint32_t>(f, "packed_g" + std::to_string(group));
  const int64_t N = 12, K = 256;
  ASSERT_EQ(w.size(), size_t(N * K));
  std::vector<int8_t> q(K);
  std::vector<uint16_t> s(size_t(K / group));
  std::vector<uint32_t> words(K / 8);
  for (int64_t r = 0; r < N; ++r) {
    ct_quantize_row_bf16(&w[size_t(r * K)], K, group, q.data(), s.data());
    for (int64_t g = 0; g < K / group; ++g) ASSERT_EQ(s[size_t(g)], scale[size_t(r * (K / group) + g)]) << "row " << r << " group " << g;
    pack_int4_row(q.data(), K, words.data());
    for (int64_t j = 0; j < K / 8; ++j) ASSERT_EQ(words[size_t(j)], packed[size_t(r * K / 8 + j)]) << "row " << r << " word " << j;
  }
}
INSTANTIATE_TEST_SUITE_P(Groups, CtVectors, ::testing::Values(32, 128));

TEST(CtQuantize, ZeroGroupGetsBf16EpsScaleAndZeros) {
  std::vector<uint16_t> w(32, 0);
  std::vector<int8_t> q(32, 5);
  uint16_t s = 0;
  ct_quantize_row_bf16(w.data(), 32, 32, q.data(), &s);
  EXPECT_EQ(s, 0x3c00);  // 2^-7, torch.finfo(torch.bfloat16).eps
  for (int8_t v : q) EXPECT_EQ(v, 0);
}

TEST(CtQuantize, ScaleIsAbsmaxOver7Point5) {
  std::vector<uint16_t> w(32, f32_to_bf16(0.0f));
  w[3] = f32_to_bf16(-7.5f);  // absmax 7.5 on the negative side → scale 1, q = -7.5 rounds half-even to -8
  w[4] = f32_to_bf16(2.5f);
  std::vector<int8_t> q(32);
  uint16_t s = 0;
  ct_quantize_row_bf16(w.data(), 32, 32, q.data(), &s);
  EXPECT_EQ(bf16_to_f32(s), 1.0f);
  EXPECT_EQ(q[3], -8);
  EXPECT_EQ(q[4], 2);  // half to even
}

TEST(IgnoreList, CompressedTensorsSyntax) {
  const IgnoreList l(kimi_ignore_list());
  EXPECT_TRUE(l.matches("lm_head"));
  EXPECT_TRUE(l.matches("model.layers.1.self_attn.q_a_proj"));
  EXPECT_TRUE(l.matches("model.layers.1.mlp.shared_experts.down_proj"));
  EXPECT_TRUE(l.matches("model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(l.matches("model.layers.1.mlp.experts.3.gate_proj"));
  EXPECT_FALSE(l.matches("language_model.lm_head"));  // exact names are exact
  const IgnoreList anchored({"re:layers"});
  EXPECT_FALSE(anchored.matches("model.layers.1.mlp.experts.3.gate_proj"));  // re.match: anchored at the start
}

TEST(IgnoreList, UnknownSyntaxIsAnErrorNamingThePattern) {
  for (const char* bad : {"*experts*", "model.layers.*.mlp", "", "re:", "re:(unclosed", "Linear|lm_head"}) {
    try {
      IgnoreList l({bad});
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--ignore"), std::string::npos) << e.what();
    }
  }
  const IgnoreList l({"lm_head", "re:.*nothing_here.*"});
  const auto none = l.unmatched({"lm_head", "model.layers.0.self_attn.o_proj"});
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0], "re:.*nothing_here.*");
}

TEST(LinearWeights, WhatCompressedTensorsTargetsAsLinear) {
  const std::vector<int64_t> m = {8, 8};
  EXPECT_TRUE(is_linear_weight("model.layers.1.mlp.experts.0.down_proj.weight", m, "model."));
  EXPECT_TRUE(is_linear_weight("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", m, "model."));
  EXPECT_TRUE(is_linear_weight("lm_head.weight", m, "model."));
  EXPECT_TRUE(is_linear_weight("language_model.lm_head.weight", m, "language_model.model."));
  EXPECT_FALSE(is_linear_weight("model.layers.1.mlp.gate.weight", m, "model."));  // the router is no nn.Linear
  EXPECT_FALSE(is_linear_weight("model.embed_tokens.weight", m, "model."));
  EXPECT_FALSE(is_linear_weight("model.layers.1.input_layernorm.weight", {8}, "model."));
  EXPECT_FALSE(is_linear_weight("vision_tower.blocks.0.attn.q_proj.weight", m, "language_model.model."));
}

TEST(SafetensorsOrder, DtypeRankDescendingThenName) {
  // safetensors.torch.save_file's order, seen on 0.8.0: I64, F32, I32, BF16, F16, I8.
  EXPECT_TRUE(safetensors_order_less(DType::I64, "z", DType::F32, "a"));
  EXPECT_TRUE(safetensors_order_less(DType::F32, "z", DType::I32, "a"));
  EXPECT_TRUE(safetensors_order_less(DType::I32, "z", DType::BF16, "a"));
  EXPECT_TRUE(safetensors_order_less(DType::BF16, "z", DType::F16, "a"));
  EXPECT_TRUE(safetensors_order_less(DType::F16, "z", DType::I8, "a"));
  EXPECT_TRUE(safetensors_order_less(DType::BF16, "a.a", DType::BF16, "b.x"));
  EXPECT_FALSE(safetensors_order_less(DType::BF16, "b", DType::BF16, "b"));
}

}  // namespace
}  // namespace kd
