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

// Which attention form the forward uses. Both give the same result (tests check it):
// expanded re-projects every cached latent through kv_b (HF's form, good for prefill);
// absorbed folds W_UK into the query and W_UV after the weighted sum, attending over the 576-wide
// latent directly (the decode form of vLLM/FlashMLA).
enum class AttnForm { expanded, absorbed };

struct ForwardStats {
  uint64_t weight_bytes = 0;  // weight bytes streamed (each matrix counted once per call)
};

// One target forward over n new tokens that follow the cache's committed rows. Beyond plain
// causal decoding it serves DDTree's verify pass: explicit RoPE positions (siblings share one),
// an ancestor-only visibility mask over the new rows, rows left uncommitted for compaction, and
// the residual-stream outputs of chosen layers for the drafter.
struct ForwardArgs {
  const int32_t* ids = nullptr;           // [n]
  int64_t n = 0;
  const int32_t* positions = nullptr;     // [n] RoPE positions; null → cache.size() + i
  const uint8_t* visibility = nullptr;    // [n, n]: row i sees new row j iff 1; null → causal (j ≤ i)
  bool commit = true;                     // false: the rows stay scratch at [size, size + n)
  AttnForm form = AttnForm::absorbed;
  bool all_logits = false;                // logits for every row, else only the last
  float* logits = nullptr;                // [n or 1, vocab]; may be null
  const std::vector<int32_t>* tap_layers = nullptr;  // layer ids whose outputs to copy out
  float* taps = nullptr;                  // [n, tap_layers.size(), hidden]
  ForwardStats* stats = nullptr;
};

// One sequence's share of a batched forward (the serving engine's step): its KV rows, the rows
// already committed there, and its new tokens. Every new row attends to rows [0, start) of its own
// sequence and to the new rows of its own sequence that args' causal order or visibility mask
// allows — never to another sequence. args.commit and args.stats are not read (the caller commits;
// stats are per batch).
struct SeqForward {
  KvView kv;          // capacity ≥ start + args.n; the new rows' latents are written at start + i
  int64_t start = 0;  // committed rows
  ForwardArgs args;
};

class DeepseekV3 {
 public:
  explicit DeepseekV3(const Checkpoint& ckpt);  // validates every tensor's name, dtype and shape

  const ModelConfig& config() const { return cfg_; }
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
  void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr) const;

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
