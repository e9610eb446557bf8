// The tensor-parallel sharding plan (model/tp_plan.h) on Kimi K2's exact config (the k2 preset): heads
// 64/R, expert slice 2048/R, each tensor's split, per-rank bytes and the stated sum rule, KV and
// reductions — every golden number computed here from K2's shapes with the storage formulas written out
// (bf16: 2 B a value; INT4: rows × cols / 2 packed + rows × cols/32 bf16 scales + an 8-byte weight_shape),
// not taken from the code under test. Refusals: R = 3, slices that break INT4 groups, a vocabulary
// that leaves a rank empty.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <string>

#include "core/error.h"
#include "io/config.h"
#include "model/make_model.h"
#include "model/tensor_plan.h"
#include "model/tp_plan.h"

namespace kd {
namespace {

ModelConfig preset(const char* name) { return parse_model_config(preset_config_json(name), name); }

// Kimi K2 (SPEC-MODEL.md §1), written out independently of the preset.
constexpr uint64_t V = 163840, h = 7168, inter = 18432, moe = 2048, L = 61, H = 64, q_lora = 1536, kv_lora = 512,
                   nope = 128, rope = 64, vd = 128, E = 384, dense_layers = 1, moe_layers = 60;
uint64_t bf16(uint64_t r, uint64_t c) { return r * c * 2; }
uint64_t int4_data(uint64_t r, uint64_t c) { return r * c / 2 + r * (c / 32) * 2; }  // without weight_shape

// Every rank holds these in full.
uint64_t k2_replicated() {
  const uint64_t embed = bf16(V, h);
  const uint64_t norms = (L * (h + q_lora + kv_lora + h) + h) * 2;
  const uint64_t latents = L * (bf16(q_lora, h) + bf16(kv_lora + rope, h));  // q_a_proj, kv_a_proj_with_mqa
  const uint64_t router = moe_layers * (bf16(E, h) + E * 4);
  const uint64_t weight_shapes = moe_layers * E * 3 * 8;
  return embed + norms + latents + router + weight_shapes;
}

// One rank's share of the split tensors at R ranks (R divides everything).
uint64_t k2_split_per_rank(uint64_t R) {
  const uint64_t heads = H / R;
  const uint64_t attn = L * (bf16(heads * (nope + rope), q_lora) + bf16(heads * (nope + vd), kv_lora) + bf16(h, heads * vd));
  const uint64_t dense = dense_layers * 3 * bf16(inter / R, h);
  const uint64_t shared = moe_layers * 3 * bf16(moe / R, h);
  const uint64_t experts = moe_layers * E * (2 * int4_data(moe / R, h) + int4_data(h, moe / R));
  const uint64_t lm_head = bf16(V / R, h);
  return attn + dense + shared + experts + lm_head;
}

class TpPlanK2 : public ::testing::TestWithParam<int32_t> {};

TEST_P(TpPlanK2, SliceSizesAreTheShapesOverR) {
  const int32_t R = GetParam();
  const TpPlan p = plan_tp(preset("k2"), R);
  EXPECT_EQ(p.ranks, R);
  EXPECT_EQ(p.heads_per_rank, 64 / R);
  EXPECT_EQ(p.moe_intermediate_per_rank, 2048 / R);
  EXPECT_EQ(p.shared_intermediate_per_rank, 2048 / R);
  EXPECT_EQ(p.dense_intermediate_per_rank, 18432 / R);
  EXPECT_EQ(p.vocab_rows_per_rank, 163840 / R);
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(p.vocab_rows(r), 163840 / R);
    EXPECT_EQ(p.vocab_begin(r), r * (163840 / R));
  }
}

TEST_P(TpPlanK2, EveryTensorHasTheIssuesSplit) {
  const int32_t R = GetParam();
  const ModelConfig c = preset("k2");
  const TpPlan p = plan_tp(c, R);
  ASSERT_EQ(p.tensors.size(), plan_tensors(c).size());
  std::map<TpSplit, uint64_t> n;
  std::map<std::string, const TpTensor*> by_name;
  for (const auto& t : p.tensors) {
    ++n[t.split];
    by_name[t.tensor.name] = &t;
  }
  // replicated: embedding, 4 norms a layer + the final one, q_a and kv_a a layer, router + bias a MoE layer.
  EXPECT_EQ(n[TpSplit::replicated], 1 + (4 * L + 1) + 2 * L + 2 * moe_layers);
  // rows: q_b, kv_b a layer; gate + up of the dense MLP, shared expert and every routed expert.
  EXPECT_EQ(n[TpSplit::rows], 2 * L + 2 * (dense_layers + moe_layers * (1 + E)));
  // columns: o_proj a layer; every down_proj.
  EXPECT_EQ(n[TpSplit::cols], L + dense_layers + moe_layers * (1 + E));
  EXPECT_EQ(n[TpSplit::vocab], 1u);

  auto split = [&](const std::string& name) {
    EXPECT_TRUE(by_name.count(name)) << name;
    return by_name.count(name) ? by_name[name]->split : TpSplit::replicated;
  };
  EXPECT_EQ(split("model.embed_tokens.weight"), TpSplit::replicated);
  EXPECT_EQ(split("lm_head.weight"), TpSplit::vocab);
  EXPECT_EQ(split("model.layers.7.self_attn.q_a_proj.weight"), TpSplit::replicated);
  EXPECT_EQ(split("model.layers.7.self_attn.kv_a_proj_with_mqa.weight"), TpSplit::replicated);
  EXPECT_EQ(split("model.layers.7.self_attn.q_b_proj.weight"), TpSplit::rows);
  EXPECT_EQ(split("model.layers.7.self_attn.kv_b_proj.weight"), TpSplit::rows);
  EXPECT_EQ(split("model.layers.7.self_attn.o_proj.weight"), TpSplit::cols);
  EXPECT_EQ(split("model.layers.7.mlp.gate.weight"), TpSplit::replicated);
  EXPECT_EQ(split("model.layers.7.mlp.gate.e_score_correction_bias"), TpSplit::replicated);
  EXPECT_EQ(split("model.layers.7.mlp.experts.100.gate_proj"), TpSplit::rows);
  EXPECT_EQ(split("model.layers.7.mlp.experts.100.up_proj"), TpSplit::rows);
  EXPECT_EQ(split("model.layers.7.mlp.experts.100.down_proj"), TpSplit::cols);
  EXPECT_EQ(split("model.layers.7.mlp.shared_experts.down_proj.weight"), TpSplit::cols);
  EXPECT_EQ(split("model.layers.0.mlp.gate_proj.weight"), TpSplit::rows);
  EXPECT_EQ(split("model.layers.0.mlp.down_proj.weight"), TpSplit::cols);

  const TpTensor& down = *by_name.at("model.layers.7.mlp.experts.100.down_proj");
  EXPECT_EQ(p.slice_shape(down, R - 1), (std::vector<int64_t>{7168, 2048 / R}));
  const TpTensor& qb = *by_name.at("model.layers.7.self_attn.q_b_proj.weight");
  EXPECT_EQ(p.slice_shape(qb, 0), (std::vector<int64_t>{(64 / R) * 192, 1536}));
  const TpTensor& o = *by_name.at("model.layers.7.self_attn.o_proj.weight");
  EXPECT_EQ(p.slice_shape(o, 0), (std::vector<int64_t>{7168, (64 / R) * 128}));
  const TpTensor& lm = *by_name.at("lm_head.weight");
  EXPECT_EQ(p.slice_shape(lm, R - 1), (std::vector<int64_t>{163840 / R, 7168}));
}

TEST_P(TpPlanK2, PerRankBytesAreReplicatedPlusSliceAndSumBackToTheTotal) {
  const uint64_t R = uint64_t(GetParam());
  const ModelConfig c = preset("k2");
  const TpPlan p = plan_tp(c, int32_t(R));
  EXPECT_EQ(p.replicated_bytes, k2_replicated());
  ASSERT_EQ(p.weight_bytes_by_rank.size(), R);
  for (uint64_t r = 0; r < R; ++r) EXPECT_EQ(p.weight_bytes_by_rank[r], k2_replicated() + k2_split_per_rank(R)) << "rank " << r;
  // The stated rule: Σ ranks = unsharded total + (R − 1) × what every rank holds in full.
  const uint64_t total = model_stats(c).stored_bytes;
  EXPECT_EQ(total, k2_replicated() + k2_split_per_rank(1));
  EXPECT_EQ(std::accumulate(p.weight_bytes_by_rank.begin(), p.weight_bytes_by_rank.end(), uint64_t(0)),
            total + (R - 1) * k2_replicated());
}

TEST_P(TpPlanK2, LatentKvOnEveryRankAndTwoReductionsALayer) {
  const TpPlan p = plan_tp(preset("k2"), GetParam());
  EXPECT_EQ(p.kv_bytes_per_token_per_rank_bf16, L * (kv_lora + rope) * 2);  // 70272: MLA's one KV head, not split
  EXPECT_EQ(p.kv_bytes_per_token_per_rank_f32, L * (kv_lora + rope) * 4);
  EXPECT_EQ(p.reductions_per_step, 122);
  EXPECT_EQ(p.reduction_values_per_row, 7168);
  EXPECT_EQ(p.reduction_bytes_per_row, 7168u * 4);
}

INSTANTIATE_TEST_SUITE_P(R, TpPlanK2, ::testing::Values(1, 2, 4, 8));

TEST(TpPlan, K2ValidRanksAreTheDivisorsOfItsHeads) {
  EXPECT_EQ(valid_tp_ranks(preset("k2")), (std::vector<int32_t>{1, 2, 4, 8, 16, 32, 64}));
}

std::string refusal(const ModelConfig& c, int32_t R) {
  try {
    plan_tp(c, R);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TpPlan, K2AtR3IsRefusedNamingTheHeadsAndTheValidR) {
  const std::string e = refusal(preset("k2"), 3);
  EXPECT_NE(e.find("num_attention_heads = 64 is not divisible by R = 3"), std::string::npos) << e;
  EXPECT_NE(e.find("Valid R for this model: 1, 2, 4, 8, 16, 32, 64"), std::string::npos) << e;
  EXPECT_NE(refusal(preset("k2"), 0), "");
}

TEST(TpPlan, ASliceThatBreaksInt4GroupsIsRefusedWithItsNumbers) {
  // K2 with 65 groups of 32 in the expert intermediate: R = 2 divides 2080 but cuts a group in half.
  ModelConfig c = preset("k2");
  c.moe_intermediate_size = 2080;
  const std::string e = refusal(c, 2);
  EXPECT_NE(e.find("down_proj: its input dim 2080 / R = 2 gives a slice of 1040 columns, not a multiple of the INT4 group size 32"),
            std::string::npos) << e;
  // The tiny preset's experts are 32 wide: one group, so no R > 1 keeps it whole.
  const std::string t = refusal(preset("tiny"), 2);
  EXPECT_NE(t.find("slice of 16 columns, not a multiple of the INT4 group size 32"), std::string::npos) << t;
  EXPECT_NE(t.find("Valid R for this model: 1"), std::string::npos) << t;
  EXPECT_EQ(valid_tp_ranks(preset("tiny")), (std::vector<int32_t>{1}));
}

TEST(TpPlan, VocabularyRDoesNotDivideGivesTheLastRankTheRest) {
  ModelConfig c = preset("tiny");
  c.quant.enabled = false;  // all bf16: only the vocabulary is uneven
  c.vocab_size = 4259;
  const TpPlan p = plan_tp(c, 4);
  EXPECT_EQ(p.vocab_rows_per_rank, 1065);  // ceil(4259 / 4)
  EXPECT_EQ(p.vocab_rows(0), 1065);
  EXPECT_EQ(p.vocab_rows(2), 1065);
  EXPECT_EQ(p.vocab_begin(3), 3195);
  EXPECT_EQ(p.vocab_rows(3), 4259 - 3 * 1065);
  // Σ ranks still = total + (R − 1) × replicated.
  const uint64_t sum = std::accumulate(p.weight_bytes_by_rank.begin(), p.weight_bytes_by_rank.end(), uint64_t(0));
  EXPECT_EQ(sum, model_stats(c).stored_bytes + 3 * p.replicated_bytes);
  EXPECT_EQ(p.weight_bytes_by_rank[0] - p.weight_bytes_by_rank[3], uint64_t(1065 - 1064) * uint64_t(c.hidden_size) * 2);
  // ceil(5 / 4) = 2 rows a rank leaves the last none.
  c.vocab_size = 5;
  EXPECT_NE(refusal(c, 4).find("vocab_size = 5 leaves the last of 4 ranks no lm_head rows"), std::string::npos) << refusal(c, 4);
}

TEST(TpPlan, K2MemoryAtR8OnAnH200) {
  const ModelConfig c = preset("k2");
  const TpPlan p = plan_tp(c, 8);
  // The stated workspace estimate, recomputed: 2 GiB + 256 rows × fp32 values a row of
  // (4 + R) × hidden + q_lora + latent + heads/R × (192 + 512 + 128) + 2 × max(18432/8, 256 + 8 × 256) + vocab/8.
  const uint64_t per_row = 4 * ((4 + 8) * h + q_lora + (kv_lora + rope) + 8 * (192 + 512 + 128) + 2 * 2304 + V / 8);
  EXPECT_EQ(tp_activation_bytes_per_row(c, p), per_row);
  const uint64_t gpu = 139ull << 30;
  const TpMemory m = tp_memory(c, p, gpu);
  EXPECT_EQ(m.weight_bytes, k2_replicated() + k2_split_per_rank(8));
  EXPECT_EQ(m.workspace_bytes, (2ull << 30) + 256 * per_row);
  EXPECT_EQ(m.kv_bytes_per_token, 70272u);
  EXPECT_EQ(uint64_t(m.kv_tokens_fit), (gpu - m.weight_bytes - m.workspace_bytes) / 70272);
  EXPECT_GT(m.kv_tokens_fit, 262144);  // a full 256K context fits beside an eighth of K2
  // One GPU cannot hold K2: nothing fits.
  EXPECT_EQ(tp_memory(c, plan_tp(c, 1), gpu).kv_tokens_fit, 0);
}

}  // namespace
}  // namespace kd
