// The tensor-parallel sharding plan (issue 14): for a ModelConfig and R ranks, how every tensor the
// checkpoint holds (model/tensor_plan.h) is split, what each rank holds and what crosses between ranks.
// Computed from config.json alone; `inspect --tp R` prints it and refuses a plan before anything loads.
//
// The layout (DESIGN.md §6, shared/PERF.md §TP) — the one published low-latency systems use on one host:
// - attention: heads split (K2: 64/R a rank). q_b_proj [H·qk, q_lora] and kv_b_proj [H·(nope+v), kv_lora]
//   keep the rows of their rank's heads; o_proj [hidden, H·v] keeps the columns of those heads and
//   produces a partial sum → reduction 1. q_a_proj, kv_a_proj_with_mqa and the latent KV (MLA has one KV
//   head) are replicated: every rank computes and caches the same latent, so KV bytes per token per rank
//   equal the unsharded figure.
// - MLP: routed experts, the shared expert and the dense MLP split along their intermediate dimension:
//   gate/up keep rows [inter/R], down keeps columns [inter/R] → a partial sum; routed + shared partials are
//   added on each rank before one reduction → reduction 2. INT4 groups (32 along the input dim) stay whole:
//   an INT4 down_proj's column slice must be a multiple of the group size. The router is replicated.
// - embedding and norms replicated; lm_head split by vocabulary (greedy: per-rank argmax + an exchange of
//   (value, index), not a reduction).
// So a step costs 2 reductions a layer, each `hidden` fp32 values a row.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/config.h"
#include "model/tensor_plan.h"

namespace kd {

enum class TpSplit {
  replicated,  // every rank holds the whole tensor
  rows,        // dim 0 split evenly: rank r holds rows [r·n/R, (r+1)·n/R)
  cols,        // dim 1 split evenly (the input dim: the rank's output is a partial sum)
  vocab,       // lm_head rows by vocabulary; uneven allowed (vocab_rows below)
};
const char* tp_split_name(TpSplit s);

struct TpTensor {
  PlannedTensor tensor;  // unsharded, as plan_tensors lists it
  TpSplit split = TpSplit::replicated;
};

struct TpPlan {
  int32_t ranks = 1;
  int32_t group = 32;  // INT4 group size (quantization_config)
  int64_t vocab_size = 0;
  // Per-rank slice sizes (the unsharded size / R).
  int64_t heads_per_rank = 0;               // num_attention_heads / R
  int64_t moe_intermediate_per_rank = 0;    // moe_intermediate_size / R (0 without MoE layers)
  int64_t shared_intermediate_per_rank = 0; // moe_intermediate_size · n_shared_experts / R
  int64_t dense_intermediate_per_rank = 0;  // intermediate_size / R (0 without dense layers)
  // lm_head's vocabulary rule: ranks 0 … R−2 hold ceil(vocab/R) rows, the last the rest (at least 1,
  // else the plan is refused). Rank r's rows start at r · ceil(vocab/R).
  int64_t vocab_rows_per_rank = 0;          // ceil(vocab/R)
  int64_t vocab_begin(int32_t rank) const;
  int64_t vocab_rows(int32_t rank) const;

  std::vector<TpTensor> tensors;              // every tensor of plan_tensors, in its order
  std::vector<uint64_t> weight_bytes_by_rank; // [R] as stored (INT4 packed + scales + weight_shape)
  // Bytes every rank holds in full: the replicated tensors, plus the 8-byte weight_shape record of each
  // split INT4 module (each rank's slice carries its own). Hence, stated and tested:
  //   Σ_r weight_bytes_by_rank[r] = stored bytes (unsharded) + (R − 1) · replicated_bytes.
  uint64_t replicated_bytes = 0;
  uint64_t max_weight_bytes_per_rank() const;

  uint64_t kv_bytes_per_token_per_rank_bf16 = 0;  // latent replicated: equal to the unsharded cache
  uint64_t kv_bytes_per_token_per_rank_f32 = 0;   // as the CPU backend holds it
  int64_t reductions_per_step = 0;                // 2 per layer (after o_proj, after the MLP/MoE)
  int64_t reduction_values_per_row = 0;           // hidden_size
  uint64_t reduction_bytes_per_row = 0;           // hidden_size × 4 (fp32 partial sums)

  // Shape of rank r's slice of t (rows or cols divided; vocab rows per the rule above).
  std::vector<int64_t> slice_shape(const TpTensor& t, int32_t rank) const;
  uint64_t slice_bytes(const TpTensor& t, int32_t rank) const;
};

// The plan for R ranks, or an Error naming the dimension that R does not divide (or the INT4 slice that
// breaks a group) and the R that are valid for this config.
TpPlan plan_tp(const ModelConfig& c, int32_t ranks);
// Every R in [1, num_attention_heads] for which plan_tp succeeds, ascending.
std::vector<int32_t> valid_tp_ranks(const ModelConfig& c);

// Greedy over a row split by vocabulary (lm_head): each rank's (value, index) of its slice — the first
// index holding its maximum, index −1 when the slice holds a NaN — combined in rank order: the greatest
// value, the lower rank (hence the lower index) on ties, −1 when any slice has a NaN. That is sample()'s
// greedy choice over the whole row (first maximum, NaN refused), so argmax outputs under TP equal the
// host logits' choice bit for bit. `per_rank[q * stride]` is rank q's.
struct RankArgmax {
  float val;
  int32_t idx;
};
RankArgmax rank_argmax(const float* row, int64_t n, int64_t first_id);  // over one rank's slice [n]
RankArgmax combine_rank_argmax(const RankArgmax* per_rank, int32_t ranks, size_t stride = 1);

// The per-GPU memory plan. The workspace is an estimate, not a measurement: a fixed allowance for the
// CUDA context, cuBLAS workspaces, graphs and communicator buffers, plus the fp32 activations of
// `rows` rows in flight on one rank (tp_activation_bytes_per_row). The attention core's work buffers (chunk
// partials and q fragments for ≤ 128 rows a launch: ≈ 300 MB at K2's 64 heads a rank, 41 MB at 8) are
// inside the fixed allowance, not counted apart.
inline constexpr uint64_t kTpWorkspaceFixedBytes = 2ull << 30;  // 2 GiB
inline constexpr int64_t kTpWorkspaceRows = 256;                // rows of one forward (a verify tree)
uint64_t tp_activation_bytes_per_row(const ModelConfig& c, const TpPlan& p);

struct TpMemory {
  uint64_t gpu_bytes = 0;           // per GPU
  uint64_t weight_bytes = 0;        // the largest rank's
  uint64_t workspace_bytes = 0;     // kTpWorkspaceFixedBytes + rows × activation bytes per row
  uint64_t kv_bytes_per_token = 0;  // bf16 latent, all layers
  int64_t kv_tokens_fit = 0;        // KV tokens that fit beside weights and workspace (0 if none)
};
TpMemory tp_memory(const ModelConfig& c, const TpPlan& p, uint64_t gpu_bytes, int64_t rows = kTpWorkspaceRows);

// The smallest valid R above `above` whose plan, one rank a GPU of gpu_bytes, holds its weights, its
// workspace and kv_tokens of KV; 0 when none does. *mem (optional): that R's TpMemory.
int32_t tp_ranks_that_fit(const ModelConfig& c, int32_t above, uint64_t gpu_bytes, int64_t kv_tokens, TpMemory* mem = nullptr);

// The check `run`, `serve` and `bench --device cuda` make before a weight is read (single GPU: R = 1):
// rank r on GPU devices[r] (an id listed k times holds k ranks: the one-GPU emulation); every GPU must
// hold its ranks' weights, a workspace each (the estimate above) and each rank's copy of kv_tokens of
// latent KV, within what it may use: min(free_bytes(d), limit_bytes) (limit_bytes 0: no limit, the
// GPU's free memory). Returns "" when every GPU fits, else what does not fit, with the numbers, and
// what to do (a larger --gpu-memory-limit, more GPUs or ranks). `what` starts the message.
std::string tp_gpu_refusal(const ModelConfig& c, const std::vector<int32_t>& devices,
                           const std::function<uint64_t(int32_t)>& free_bytes, uint64_t limit_bytes, int64_t kv_tokens,
                           const std::string& what);

}  // namespace kd
