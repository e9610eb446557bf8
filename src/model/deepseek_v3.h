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

class Comm;

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

// Which slice of the model an instance holds (model/tp_plan.h): rank `rank` of `ranks` keeps its
// heads' rows of q_b_proj and kv_b_proj and their columns of o_proj, its slice of every MLP's
// intermediate dimension (gate/up rows, down columns), and its vocabulary rows of lm_head; the rest
// is replicated. {0, 1} is the whole model.
struct TpRank {
  int32_t rank = 0, ranks = 1;
};

// The CPU target (model/target.h); with a TpRank of R > 1, one rank of the tensor-parallel CPU
// target (model/deepseek_v3_tp.h), which drives it through forward_rank.
class DeepseekV3 final : public Target {
 public:
  // Validates every tensor's name, dtype and shape; a TpRank the config cannot be split into is an
  // Error naming the dimension and the R that are valid (plan_tp).
  explicit DeepseekV3(const Checkpoint& ckpt, TpRank tp = {});

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

  // One rank's share of a tensor-parallel forward (this instance holds rank comm.rank() of
  // comm.size(); every rank calls it with the same sequences). The ranks share the sequences' host KV
  // rows: rank 0 writes the new latents (every rank would compute the same bits) and all read them
  // after a barrier. Partial sums cross `comm` twice a layer (after o_proj, after the MLP) in its
  // rank order, so each row's bits are the same alone or in any batch. Outputs: logits on the host —
  // each rank writes its vocabulary columns; argmax outputs — each rank's (value, index) over its rows
  // of lm_head exchanged and combined with sample()'s greedy rule, written by rank 0; taps — rank 0.
  // Every rank keeps its slice of the logit rows until its next forward (kept_logits).
  void forward_rank(const std::vector<SeqForward>& seqs, Comm& comm, ForwardStats* stats = nullptr) const;
  // This rank's slice [vocab_rows()] of logit row `row` of sequence `seq` of the last forward_rank.
  const float* kept_logits(int64_t seq, int64_t row) const;
  TpRank tp() const { return tp_; }
  int64_t vocab_begin() const { return vocab_begin_; }  // this rank's lm_head rows [vocab_begin, + vocab_rows)
  int64_t vocab_rows() const { return lm_head_.rows; }

  // MoE router of one row of `layer` (SPEC-MODEL.md §2 MoE): from fp32 router logits [n_routed_experts]
  // to the chosen experts [num_experts_per_tok] (ascending id) and their weights.
  void route(int64_t layer, const float* router_logits, int32_t* experts, float* weights) const;

 private:
  struct BatchPlan;
  void run(const std::vector<SeqForward>& seqs, ForwardStats* stats, Comm* comm) const;
  void attention(int64_t layer, const std::vector<SeqForward>& seqs, const BatchPlan& plan, const float* x, float* out,
                 ForwardStats* st, Comm* comm) const;
  void logit_outputs(const std::vector<SeqForward>& seqs, const BatchPlan& plan, const std::vector<float>& x,
                     ForwardStats* st, Comm* comm) const;
  void ffn(int64_t layer, const float* x, int64_t n, float* out, ForwardStats* st) const;
  void mlp(const MlpWeights& w, const float* x, int64_t n, float* out, ForwardStats* st) const;

  ModelConfig cfg_;
  TpRank tp_;
  int64_t heads_ = 0;        // attention heads this instance holds (num_attention_heads / R)
  int64_t vocab_begin_ = 0;  // its first lm_head row
  std::vector<std::vector<uint8_t>> owned_;  // aligned copies of misaligned tensors; column slices
  Weight embed_;    // [vocab, hidden]
  Weight lm_head_;  // [vocab_rows, hidden]: rows [vocab_begin, vocab_begin + vocab_rows) of the checkpoint's
  // forward_rank's slices of its logit rows [rows, vocab_rows] and each sequence's first row there.
  mutable std::vector<float> kept_;
  mutable std::vector<int64_t> kept_row0_, kept_n_;
  std::vector<float> final_norm_;
  std::vector<LayerWeights> layers_;
  std::vector<float> inv_freq_;  // [qk_rope_head_dim / 2]
  float rope_scaling_ = 1.0f, softmax_scale_ = 1.0f;
};

}  // namespace kd
