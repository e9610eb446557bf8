#include "model/tp_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>

#include "core/error.h"

namespace kd {

const char* tp_split_name(TpSplit s) {
  switch (s) {
    case TpSplit::replicated: return "replicated";
    case TpSplit::rows: return "rows split";
    case TpSplit::cols: return "columns split";
    case TpSplit::vocab: return "vocab split";
  }
  return "?";
}

namespace {

// The module's own name: "model.layers.3.self_attn.q_b_proj.weight" → "q_b_proj".
std::string leaf(const std::string& name) {
  std::string n = name;
  const std::string w = ".weight";
  if (n.size() > w.size() && n.compare(n.size() - w.size(), w.size(), w) == 0) n.resize(n.size() - w.size());
  const size_t dot = n.rfind('.');
  return dot == std::string::npos ? n : n.substr(dot + 1);
}

TpSplit split_of(const PlannedTensor& t) {
  const std::string m = leaf(t.name);
  switch (t.role) {
    case TensorRole::embed:
    case TensorRole::norm:
    case TensorRole::router:
    case TensorRole::router_bias: return TpSplit::replicated;
    case TensorRole::lm_head: return TpSplit::vocab;
    case TensorRole::attention:
      if (m == "q_b_proj" || m == "kv_b_proj") return TpSplit::rows;  // by head
      if (m == "o_proj") return TpSplit::cols;                        // its input is the heads' output
      return TpSplit::replicated;                                     // q_a_proj, kv_a_proj_with_mqa: the latents
    case TensorRole::dense_mlp:
    case TensorRole::shared_expert:
    case TensorRole::routed_expert: return m == "down_proj" ? TpSplit::cols : TpSplit::rows;
  }
  fail("tensor plan: no TP split for ", t.name);
}

std::string list(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t r : v) s += cat(s.empty() ? "" : ", ", r);
  return s;
}

// The INT4 tensors split along their input dim, one per distinct width (name, cols): the ones whose
// slice must hold whole groups. Found once per config (K2 lists ≈ 70 000 tensors).
std::vector<std::pair<std::string, int64_t>> int4_column_splits(const ModelConfig& c) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& t : plan_tensors(c)) {
    if (!t.int4 || split_of(t) != TpSplit::cols) continue;
    bool seen = false;
    for (const auto& [name, cols] : out) seen = seen || cols == t.shape[1];
    if (!seen) out.emplace_back(t.name, t.shape[1]);
  }
  return out;
}

// Checks R against every dimension the layout splits; returns the first reason it is refused ("" if none).
std::string refusal(const ModelConfig& c, const std::vector<std::pair<std::string, int64_t>>& int4_cols, int32_t R) {
  if (R < 1) return cat("--tp must be at least 1 (got ", R, ")");
  auto divides = [&](int64_t n, const char* what) -> std::string {
    if (n % R == 0) return "";
    return cat(what, " = ", n, " is not divisible by R = ", R);
  };
  std::string why = divides(c.num_attention_heads, "num_attention_heads");
  if (why.empty()) {
    const int64_t v_last = c.vocab_size - (R - 1) * ((c.vocab_size + R - 1) / R);
    if (v_last < 1)
      why = cat("vocab_size = ", c.vocab_size, " leaves the last of ", R, " ranks no lm_head rows (ranks hold ceil(",
                c.vocab_size, "/", R, ") = ", (c.vocab_size + R - 1) / R, " rows each)");
  }
  bool any_moe = false, any_dense = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  if (why.empty() && any_dense) why = divides(c.intermediate_size, "intermediate_size (dense MLP)");
  if (why.empty() && any_moe) why = divides(c.moe_intermediate_size, "moe_intermediate_size (routed experts)");
  if (why.empty() && any_moe && c.n_shared_experts > 0)
    why = divides(c.moe_intermediate_size * c.n_shared_experts, "moe_intermediate_size × n_shared_experts (shared expert)");
  if (!why.empty()) return why;
  // A column-split INT4 tensor keeps whole groups only if its slice is a multiple of the group size.
  const int32_t g = c.quant.group_size;
  for (const auto& [name, cols] : int4_cols) {
    const int64_t slice = cols / R;
    if (slice % g != 0)
      return cat(name, ": its input dim ", cols, " / R = ", R, " gives a slice of ", slice,
                 " columns, not a multiple of the INT4 group size ", g, " (groups of ", g, " must stay whole on one rank)");
  }
  return "";
}

}  // namespace

int64_t TpPlan::vocab_begin(int32_t rank) const { return int64_t(rank) * vocab_rows_per_rank; }
int64_t TpPlan::vocab_rows(int32_t rank) const {
  return rank + 1 < ranks ? vocab_rows_per_rank : vocab_size - vocab_begin(rank);
}

uint64_t TpPlan::max_weight_bytes_per_rank() const {
  return weight_bytes_by_rank.empty() ? 0 : *std::max_element(weight_bytes_by_rank.begin(), weight_bytes_by_rank.end());
}

std::vector<int64_t> TpPlan::slice_shape(const TpTensor& t, int32_t rank) const {
  std::vector<int64_t> s = t.tensor.shape;
  switch (t.split) {
    case TpSplit::replicated: break;
    case TpSplit::rows: s[0] /= ranks; break;
    case TpSplit::cols: s[1] /= ranks; break;
    case TpSplit::vocab: s[0] = vocab_rows(rank); break;
  }
  return s;
}

uint64_t TpPlan::slice_bytes(const TpTensor& t, int32_t rank) const {
  PlannedTensor p = t.tensor;
  p.shape = slice_shape(t, rank);
  return p.bytes(group);
}

std::vector<int32_t> valid_tp_ranks(const ModelConfig& c) {
  const auto int4_cols = int4_column_splits(c);
  std::vector<int32_t> v;
  for (int64_t r = 1; r <= std::max<int64_t>(1, c.num_attention_heads); ++r)
    if (refusal(c, int4_cols, int32_t(r)).empty()) v.push_back(int32_t(r));
  return v;
}

TpPlan plan_tp(const ModelConfig& c, int32_t R) {
  if (const std::string why = refusal(c, int4_column_splits(c), R); !why.empty())
    fail("tensor parallel --tp ", R, " is refused: ", why, ". Valid R for this model: ", list(valid_tp_ranks(c)));
  TpPlan p;
  p.ranks = R;
  p.group = c.quant.group_size;
  p.vocab_size = c.vocab_size;
  p.heads_per_rank = c.num_attention_heads / R;
  p.vocab_rows_per_rank = (c.vocab_size + R - 1) / R;
  bool any_moe = false, any_dense = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  if (any_moe) p.moe_intermediate_per_rank = c.moe_intermediate_size / R;
  if (any_moe) p.shared_intermediate_per_rank = c.moe_intermediate_size * c.n_shared_experts / R;
  if (any_dense) p.dense_intermediate_per_rank = c.intermediate_size / R;

  p.weight_bytes_by_rank.assign(size_t(R), 0);
  for (auto& t : plan_tensors(c)) {
    TpTensor tt{std::move(t), TpSplit::replicated};
    tt.split = split_of(tt.tensor);
    if (tt.split == TpSplit::replicated) p.replicated_bytes += tt.tensor.bytes(p.group);
    else if (tt.tensor.int4) p.replicated_bytes += 8;  // weight_shape [2] I32 on every rank
    for (int32_t r = 0; r < R; ++r) p.weight_bytes_by_rank[size_t(r)] += p.slice_bytes(tt, r);
    p.tensors.push_back(std::move(tt));
  }
  p.kv_bytes_per_token_per_rank_bf16 = uint64_t(c.num_hidden_layers * c.latent_dim() * 2);
  p.kv_bytes_per_token_per_rank_f32 = uint64_t(c.num_hidden_layers * c.latent_dim() * 4);
  p.reductions_per_step = 2 * c.num_hidden_layers;
  p.reduction_values_per_row = c.hidden_size;
  p.reduction_bytes_per_row = uint64_t(c.hidden_size) * 4;
  return p;
}

// fp32 values one row keeps live on one rank during a forward, as an upper estimate:
//   4 × hidden (residual, normed input, partial sum, reduced sum) + R × hidden (the partials gathered
//   for the rank-order reduction) + q_lora + latent (the replicated latents) + heads/R × (qk_head_dim +
//   kv_lora_rank + v_head_dim) (queries, absorbed queries, attention output) + 2 × the widest MLP slice
//   (gate and up: dense inter/R, or shared/R + top-k × moe inter/R) + ceil(vocab/R) (logits).
uint64_t tp_activation_bytes_per_row(const ModelConfig& c, const TpPlan& p) {
  const int64_t mlp = std::max(p.dense_intermediate_per_rank,
                               p.shared_intermediate_per_rank + c.num_experts_per_tok * p.moe_intermediate_per_rank);
  const int64_t values = (4 + p.ranks) * c.hidden_size + c.q_lora_rank + c.latent_dim() +
                         p.heads_per_rank * (c.qk_head_dim() + c.kv_lora_rank + c.v_head_dim) + 2 * mlp +
                         p.vocab_rows_per_rank;
  return uint64_t(values) * 4;
}

RankArgmax rank_argmax(const float* row, int64_t n, int64_t first_id) {
  RankArgmax best{-std::numeric_limits<float>::infinity(), int32_t(first_id)};
  for (int64_t v = 0; v < n; ++v) {
    if (std::isnan(row[v])) return {row[v], -1};
    if (row[v] > best.val) best = {row[v], int32_t(first_id + v)};
  }
  return best;
}

RankArgmax combine_rank_argmax(const RankArgmax* per_rank, int32_t ranks, size_t stride) {
  RankArgmax best = per_rank[0];
  for (int32_t q = 1; q < ranks && best.idx >= 0; ++q) {
    const RankArgmax& o = per_rank[size_t(q) * stride];
    if (o.idx < 0 || o.val > best.val) best = o;
  }
  return best;
}

TpMemory tp_memory(const ModelConfig& c, const TpPlan& p, uint64_t gpu_bytes, int64_t rows) {
  TpMemory m;
  m.gpu_bytes = gpu_bytes;
  m.weight_bytes = p.max_weight_bytes_per_rank();
  m.workspace_bytes = kTpWorkspaceFixedBytes + uint64_t(rows) * tp_activation_bytes_per_row(c, p);
  m.kv_bytes_per_token = p.kv_bytes_per_token_per_rank_bf16;
  const uint64_t used = m.weight_bytes + m.workspace_bytes;
  if (gpu_bytes > used && m.kv_bytes_per_token > 0) m.kv_tokens_fit = int64_t((gpu_bytes - used) / m.kv_bytes_per_token);
  return m;
}

int32_t tp_ranks_that_fit(const ModelConfig& c, int32_t above, uint64_t gpu_bytes, int64_t kv_tokens, TpMemory* mem) {
  for (int32_t r : valid_tp_ranks(c)) {
    if (r <= above) continue;
    const TpMemory m = tp_memory(c, plan_tp(c, r), gpu_bytes);
    if (m.kv_tokens_fit >= std::max<int64_t>(kv_tokens, 1)) {
      if (mem) *mem = m;
      return r;
    }
  }
  return 0;
}

namespace {
std::string gb3(uint64_t b) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3f GB", double(b) / 1e9);
  return buf;
}
std::string gib2(uint64_t b) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1ull << 30));
  return buf;
}
}  // namespace

std::string tp_gpu_refusal(const ModelConfig& c, const std::vector<int32_t>& devices,
                           const std::function<uint64_t(int32_t)>& free_bytes, uint64_t limit_bytes, int64_t kv_tokens,
                           const std::string& what) {
  const int32_t R = int32_t(devices.size());
  const TpPlan plan = plan_tp(c, R);
  const uint64_t workspace = tp_memory(c, plan, 0).workspace_bytes;
  const uint64_t kv_rank = plan.kv_bytes_per_token_per_rank_bf16 * uint64_t(std::max<int64_t>(kv_tokens, 0));
  std::vector<int32_t> seen;
  for (int32_t d : devices) {
    if (std::find(seen.begin(), seen.end(), d) != seen.end()) continue;
    seen.push_back(d);
    uint64_t weights = 0;
    int32_t here = 0;
    for (int32_t r = 0; r < R; ++r)
      if (devices[size_t(r)] == d) weights += plan.weight_bytes_by_rank[size_t(r)], ++here;
    const uint64_t need = weights + uint64_t(here) * (workspace + kv_rank);
    const uint64_t free_b = free_bytes(d);
    const bool limited = limit_bytes > 0 && limit_bytes < free_b;
    const uint64_t avail = limited ? limit_bytes : free_b;
    if (need <= avail) continue;
    std::string msg = cat(what, ": the memory plan does not fit GPU ", d, ": ", here, " rank", here == 1 ? "" : "s", " of ", R,
                          " there need weights ", gb3(weights), " + workspace ", gb3(uint64_t(here) * workspace),
                          " (estimate: ", gib2(kTpWorkspaceFixedBytes), " fixed + ", kTpWorkspaceRows, " rows of activations",
                          here == 1 ? "" : ", a rank", ") + KV ", gb3(uint64_t(here) * kv_rank), " (", kv_tokens, " tokens × ",
                          plan.kv_bytes_per_token_per_rank_bf16, " B", here == 1 ? "" : ", on every rank", ") = ", gb3(need),
                          ", but ");
    if (limited) msg += cat("--gpu-memory-limit allows ", gb3(limit_bytes), " (", gib2(limit_bytes), ") of its ", gb3(free_b), " free");
    else msg += cat("it has ", gb3(free_b), " free", limit_bytes > 0 ? cat(" (--gpu-memory-limit ", gib2(limit_bytes), ")") : "");
    std::vector<std::string> fixes;
    if (limited && need <= free_b)
      fixes.push_back(cat("raise --gpu-memory-limit to at least ", std::ceil(double(need) / double(1ull << 30) * 100) / 100, " GiB"));
    if (here > 1) fixes.push_back("give each rank its own GPU with --devices");
    TpMemory m;
    if (const int32_t r = tp_ranks_that_fit(c, R, avail, kv_tokens, &m))
      fixes.push_back(cat("use more ranks: --tp ", r, " with a GPU each fits (", gb3(m.weight_bytes), " of weights a GPU)"));
    if (kv_tokens > 0 && weights + uint64_t(here) * workspace < avail) {
      const int64_t fit = int64_t((avail - weights - uint64_t(here) * workspace) / (uint64_t(here) * plan.kv_bytes_per_token_per_rank_bf16));
      fixes.push_back(cat("use less context (", fit, " tokens fit)"));
    }
    if (fixes.empty()) fixes.push_back(limited ? "raise --gpu-memory-limit or free memory on the GPU" : "free memory on the GPU or use GPUs with more");
    msg += ". To run: ";
    for (size_t i = 0; i < fixes.size(); ++i) msg += cat(i ? "; or " : "", fixes[i]);
    return msg + cat(" (kdtree inspect --tp ", R, " --gpu-memory-limit GIB prints the plan)");
  }
  return "";
}

}  // namespace kd
