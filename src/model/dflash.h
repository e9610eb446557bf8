// The DFlash block drafter (SPEC-DDTREE.md §1, §5): a few Qwen3-style decoder layers that draft
// B−1 tokens in one non-causal forward over [bonus, MASK × (B−1)], conditioned on the target's
// hidden states through per-layer K/V only ("KV injection"). It has no embedding and no LM head:
// both are the target's. CPU reference: fp32 activations, weights viewed in the checkpoint's mmap.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/weight.h"
#include "io/checkpoint.h"
#include "io/config.h"

namespace kd {

// Largest block size B accepted from a drafter's config.json and from `run --block-size`: every
// round drafts B − 1 positions through all drafter layers (and a tree ranks that many positions),
// so a hostile 4096 turned 4 tokens into a minute. Published DFlash drafters use 16.
inline constexpr int64_t kMaxDFlashBlockSize = 64;

// Where DFlashConfig::rope_attention_factor came from.
enum class YarnFactorRule {
  none,              // no YaRN: 1.0
  attention_factor,  // rope_scaling.attention_factor, as config.json gives it
  mscale_ratio,      // get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
  legacy,            // 0.1·ln(factor) + 1: mscale or mscale_all_dim absent (or 0), transformers' fallback
  legacy_option,     // 0.1·ln(factor) + 1 by DFlashLoadOptions::yarn_legacy_mscale
};
const char* yarn_factor_rule_name(YarnFactorRule r);

// How a drafter is loaded beyond what its config.json says (the CLI's flags).
struct DFlashLoadOptions {
  // --draft-yarn-legacy-mscale: YaRN's cos/sin amplitude 0.1·ln(factor) + 1 instead of the reference
  // rule's inferred value, for a checkpoint trained by a runtime that used the legacy value (SGLang's
  // and vLLM's generic YaRN). Refused when config.json gives attention_factor or has no YaRN.
  bool yarn_legacy_mscale = false;
};

// config.json of a published DFlash drafter (architectures ["DFlashDraftModel"], model_type qwen3).
struct DFlashConfig {
  int64_t hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope;  // yarn = false: plain RoPE; the YaRN fields as in the target's config
  // YaRN's cos/sin amplitude: the reference drafter's rule, yarn_attention_factor (io/config.h:
  // attention_factor > mscale ratio > 0.1·ln(factor) + 1; SPEC-DDTREE.md §5). 1.0 for Kimi-K2.5-
  // DFlash's mscale = mscale_all_dim = 1. DFlashLoadOptions::yarn_legacy_mscale replaces an inferred
  // value with the legacy 0.1·ln(factor) + 1. 1.0 without YaRN.
  double rope_attention_factor = 1.0;
  YarnFactorRule rope_attention_factor_rule = YarnFactorRule::none;
  int64_t block_size = 16;                      // B: the bonus token plus B−1 drafted positions
  int32_t mask_token_id = 0;                    // dflash_config.mask_token_id
  std::vector<int64_t> target_layer_ids;        // dflash_config.target_layer_ids: 0-based taps
  int64_t num_target_layers = 0;                // 0 when config.json omits it
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  // z-lab's dflash_config knobs (dflash_config, else the top level, as its _draft_value reads them):
  double input_embedding_scale = 1.0;    // block embeddings × this before the first layer
  double output_multiplier = 1.0;        // logits × this
  double final_logit_softcapping = 0.0;  // > 0: logits ← c·tanh(logits / c) after the multiplier

  int64_t n_taps() const { return int64_t(target_layer_ids.size()); }
  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  std::vector<float> rope_inv_freq() const;  // [head_dim / 2], fp32 as transformers computes it
};

// Parses config.json text; `label` names the file in errors. Every field is range-checked and
// anything this drafter does not implement (causal or sliding-window layers — layer_types, or
// use_sliding_window's derived ones —, is_causal true, DFlash2DraftModel's convolutions and
// candidate selector, partial rotary, attention bias, another hidden_act) is refused by name.
// target_layer_ids may be absent: z-lab's default for num_hidden_layers drafter layers over
// num_target_layers (default_target_layer_ids), where that formula gives distinct layers.
DFlashConfig parse_dflash_config(const std::string& json_text, const std::string& label);

// The default taps of a drafter with k context features for an N-layer target ([ZL]
// build_target_layer_ids): round(1 + i·(N−4)/(k−1)) (Python's round), [N/2] for k = 1. Targets too
// shallow for that formula to give k distinct ascending ids (N < k + 3) get round(i·(N−1)/(k−1))
// instead. Needs 1 ≤ k ≤ N.
std::vector<int64_t> default_target_layer_ids(int64_t n_target_layers, int64_t k);

// DIR/config.json parsed as parse_dflash_config does; errors name the file ("not a directory",
// "cannot open (is this a DFlash drafter directory?)", or the field). Reads no weights.
DFlashConfig load_dflash_config(const std::string& dir);
// Applies `o` to a parsed config (`label` names its file in errors).
void apply_load_options(DFlashConfig& c, const DFlashLoadOptions& o, const std::string& label);

// Refuses a drafter config that cannot serve `target` (hidden size, vocabulary, mask id, taps),
// naming `label` (the drafter's config.json) and the field. Reads no weights. `warn`: also log a
// warning when num_target_layers differs from the target's (a load does; a per-sequence recheck not).
void check_fits_target(const DFlashConfig& c, const ModelConfig& target, const std::string& label, bool warn = true);

// The drafter's weights and forward, loaded once: every method is const and a sequence's state is
// its Context, so one DFlashDrafter (shared as std::shared_ptr<const DFlashDrafter>) serves every
// sequence — the CPU Drafter (decode/dflash_drafter.h: DFlashAdapter) reads it in place and the GPU
// drafter (model/dflash_cuda.h: CudaDFlashWeights) uploads from it, neither reading a file again.
class DFlashDrafter {
 public:
  // Loads the drafter checkpoint directory `dir` (config.json + model.safetensors or an index with
  // shards, read by io/checkpoint.h's ShardDir with all its checks) and validates it against the
  // target's config: hidden size and vocab equal, every tap < target num_hidden_layers,
  // block_size ≥ 2, mask_token_id < vocab, every tensor's name, dtype (BF16/F32/F16) and shape.
  // Each failure is a kd::Error naming the file and field/tensor. The drafter owns its mmaps. (It
  // takes a directory rather than a Checkpoint because Checkpoint parses config.json as a
  // DeepSeek-V3 config, which a Qwen3-style drafter config is not.)
  DFlashDrafter(const std::string& dir, const ModelConfig& target, const DFlashLoadOptions& options = {});
  // The same, shared: what a caller that builds several per-sequence drafters loads once.
  static std::shared_ptr<const DFlashDrafter> load(const std::string& dir, const ModelConfig& target,
                                                   const DFlashLoadOptions& options = {});
  ~DFlashDrafter();
  DFlashDrafter(const DFlashDrafter&) = delete;
  DFlashDrafter& operator=(const DFlashDrafter&) = delete;

  const DFlashConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }
  // The checkpoint's tensors (validated: every one the drafter uses has its name, dtype and shape
  // checked), for a device upload.
  const ShardDir& shards() const { return *shards_; }
  // Bytes of the drafter's own matrices (fc and the layers), for GB/s reports; the shared
  // embedding and lm_head are the target's.
  uint64_t weight_bytes() const;

  // The draft KV cache of one sequence (SPEC-DDTREE.md §1 "Drafter KV cache"): only the context
  // features' K/V, never a block's. Token t sits at position t.
  struct Context {
    int64_t len = 0;         // context tokens held
    int64_t max_tokens = 0;  // capacity limit (grown on demand up to this)
    std::vector<std::vector<float>> k, v;  // [layers][len × kv_heads·head_dim]; k after k_norm and RoPE
  };
  Context new_context(int64_t max_tokens) const;  // max_tokens capped at max_position_embeddings

  // Context features of n target tokens at positions [ctx.len, ctx.len + n):
  // taps [n, n_taps·hidden] fp32 = the target's residual-stream outputs of layers target_layer_ids,
  // concatenated in that order. Ht = hidden_norm(fc(taps)); every layer appends
  // K = RoPE(k_norm(Wk·Ht)) and V = Wv·Ht. Ht never passes input_layernorm, Q, o_proj or the MLP.
  void append_context(Context& ctx, const float* taps, int64_t n) const;

  // One block forward: block_ids [B] = [bonus, mask × (B−1)] at positions [ctx.len, ctx.len + B),
  // B = block_size. embed and lm_head are the target's, [vocab, hidden]. Writes
  // logits [B−1, vocab] fp32 for block positions 1..B−1 (each predicts its own position). Attention
  // is non-causal: every block query sees all context keys and all B block keys. ctx is unchanged.
  void draft(const Context& ctx, const int32_t* block_ids, const Weight& embed, const Weight& lm_head,
             float* logits) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;  // input_layernorm, post_attention_layernorm [hidden]
    std::vector<float> q_norm, k_norm;       // [head_dim], shared by every head
    Weight q;            // [heads·head_dim, hidden]
    Weight k, v;         // [kv_heads·head_dim, hidden]
    Weight o;            // [hidden, heads·head_dim]
    Weight gate, up;     // [intermediate, hidden]
    Weight down;         // [hidden, intermediate]
  };
  // x [n, kv_dim] in place: k_norm per head, then RoPE at positions first..first+n−1.
  void norm_rope(const std::vector<float>& norm, float* x, int64_t n, int64_t heads, int64_t first) const;

  std::string dir_;
  DFlashConfig cfg_;
  std::unique_ptr<ShardDir> shards_;
  std::vector<std::vector<uint8_t>> owned_;  // aligned copies of tensors the file left misaligned
  Weight fc_;                        // [hidden, n_taps·hidden]
  std::vector<float> hidden_norm_;   // [hidden]
  std::vector<float> final_norm_;    // [hidden]
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;      // [head_dim / 2]
  float rope_scaling_ = 1.0f;        // cfg_.rope_attention_factor
  float softmax_scale_ = 1.0f;       // head_dim^-0.5
};

}  // namespace kd
