// The DeepSeek-V3 / Kimi K2 target model (SPEC-MODEL.md §2): MLA attention with YaRN RoPE and a
// sigmoid-routed MoE with shared experts. One readable forward for the CPU reference backend;
// weights are views into the checkpoint's mmap (INT4 experts stay packed).
#pragma once
#include <cstdint>
#include <vector>

#include "core/weight.h"
#include "io/checkpoint.h"
#include "kv/kv_view.h"
#include "kv/latent_cache.h"
#include "model/target.h"

namespace kd {

struct MlpWeights {
  Weight gate, up;  // [inter, hidden]
  Weight down;      // [hidden, inter]
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> ffn_norm;   // [hidden]
  Weight q_a;                    // [q_lora_rank, hidden]
  std::vector<float> q_a_norm;   // [q_lora_rank]
  Weight q_b;                    // [n_heads × qk_head_dim, q_lora_rank], rows grouped by head
  Weight kv_a;                   // [kv_lora_rank + qk_rope_head_dim, hidden]
  std::vector<float> kv_a_norm;  // [kv_lora_rank]
  Weight kv_b;                   // [n_heads × (qk_nope + v), kv_lora_rank]: per head W_UK then W_UV
  Weight o;                      // [hidden, n_heads × v_head_dim]
  bool moe = false;
  MlpWeights dense;                  // !moe: intermediate_size
  Weight router;                     // moe: [n_routed_experts, hidden]
  std::vector<float> router_bias;    // moe: [n_routed_experts] e_score_correction_bias (selection only)
  std::vector<MlpWeights> experts;   // moe: n_routed_experts × moe_intermediate_size
  MlpWeights shared;                 // moe, n_shared_experts > 0: moe_intermediate × n_shared
};

// The CPU target (model/target.h).
class DeepseekV3 final : public Target {
 public:
  explicit DeepseekV3(const Checkpoint& ckpt);  // validates every tensor's name, dtype and shape

  const Weight& embedding() const { return embed_; }  // [vocab, hidden]; the DFlash drafter shares it
  const Weight& lm_head() const { return lm_head_; }  // [vocab, hidden]; the drafter shares it too
  const std::vector<float>& final_norm() const { return final_norm_; }
  // Every layer's weights as views into the checkpoint (other backends upload from these).
  const std::vector<LayerWeights>& layers() const { return layers_; }
  LatentCache new_cache(int64_t max_tokens) const;

  // Runs tokens ids[0..n) at positions cache.size() … cache.size()+n−1 (causal), appends their
  // latent KV and commits it. logits: [n, vocab] when all_logits, else [1, vocab] for the last
  // token; may be null. ids must be in [0, vocab) (checked).
  void forward(LatentCache& cache, const int32_t* ids, int64_t n, AttnForm form, bool all_logits,
               float* logits, ForwardStats* stats = nullptr) const;
  void forward(LatentCache& cache, const ForwardArgs& args) const;
  // Many sequences in one forward: every weight matrix is streamed once for all their rows. Row
  // invariance (DESIGN.md §2) makes each sequence's latents, logits and taps bit-identical to a
  // forward of that sequence alone; forward(cache, args) is this with one sequence.
  void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr) const override;

  // Target: KV rows in host memory (the KvPool's blocks), allocated as used; the prompt prefills in
  // the expanded form as HF does; logits always come to the host (no argmax outputs, no device taps).
  const ModelConfig& config() const override { return cfg_; }
  std::string device() const override { return "cpu"; }
  int64_t max_context() const override { return cfg_.max_position_embeddings; }
  int64_t max_kv_tokens(int64_t block_tokens) const override;
  bool host_kv() const override { return true; }
  void init_kv(int64_t, int64_t) const override {}
  AttnForm prefill_form() const override { return AttnForm::expanded; }
  bool supports(AttnForm) const override { return true; }
  void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const override;

  // MoE router of one row of `layer` (SPEC-MODEL.md §2 MoE): from fp32 router logits [n_routed_experts]
  // to the chosen experts [num_experts_per_tok] (ascending id) and their weights.
  void route(int64_t layer, const float* router_logits, int32_t* experts, float* weights) const;

 private:
  struct BatchPlan;
  void attention(int64_t layer, const std::vector<SeqForward>& seqs, const BatchPlan& plan, const float* x, float* out,
                 ForwardStats* st) const;
  void ffn(int64_t layer, const float* x, int64_t n, float* out, ForwardStats* st) const;
  void mlp(const MlpWeights& w, const float* x, int64_t n, float* out, ForwardStats* st) const;

  ModelConfig cfg_;
  std::vector<std::vector<uint8_t>> owned_;  // aligned copies of misaligned tensors
  Weight embed_;    // [vocab, hidden]
  Weight lm_head_;  // [vocab, hidden]
  std::vector<float> final_norm_;
  std::vector<LayerWeights> layers_;
  std::vector<float> inv_freq_;  // [qk_rope_head_dim / 2]
  float rope_scaling_ = 1.0f, softmax_scale_ = 1.0f;
};

}  // namespace kd
