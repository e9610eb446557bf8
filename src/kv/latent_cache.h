// The MLA latent KV cache of one sequence: per layer and token, [c_kv (kv_lora_rank, after
// kv_a_layernorm) | k_pe (qk_rope_head_dim, after RoPE, GPT-J interleaved layout)] — 576 values for
// K2 (SPEC-MODEL.md §2). fp32 on the CPU. Rows past size() are scratch until commit().
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "kv/kv_view.h"

namespace kd {

class LatentCache {
 public:
  LatentCache(int64_t n_layers, int64_t dim, int64_t max_tokens)
      : dim_(dim), max_tokens_(max_tokens), layers_(static_cast<size_t>(n_layers)) {}

  int64_t dim() const { return dim_; }
  int64_t size() const { return size_; }          // committed tokens
  int64_t max_tokens() const { return max_tokens_; }

  // Makes rows [0, n) addressable (rows past size() hold uncommitted work).
  void reserve(int64_t n) {
    if (n > max_tokens_) fail("KV cache: ", n, " tokens exceed the context limit of ", max_tokens_);
    for (auto& l : layers_)
      if (int64_t(l.size()) < n * dim_) l.resize(static_cast<size_t>(std::max<int64_t>(n, int64_t(l.size() / size_t(dim_)) * 2) * dim_));
  }
  float* row(int64_t layer, int64_t pos) { return layers_[size_t(layer)].data() + pos * dim_; }
  const float* row(int64_t layer, int64_t pos) const { return layers_[size_t(layer)].data() + pos * dim_; }
  // The rows reserved so far as a view (invalidated by the next reserve()).
  KvView view() {
    KvView v;
    v.dim = dim_;
    v.n_layers = int64_t(layers_.size());
    v.block_tokens = layers_.empty() ? 0 : int64_t(layers_[0].size()) / dim_;
    if (v.block_tokens == 0) return v;
    for (auto& l : layers_) v.ptrs.push_back(l.data());
    return v;
  }
  void commit(int64_t n) { size_ = n; }  // also truncates
  // DDTree compaction: the scratch rows start + keep[k] move to start + k in every layer and the
  // cache commits start + keep.size() rows. keep must increase with keep[k] ≥ k (a tree path in pop
  // order), so moving front to back never overwrites a row still to be read. Nothing is recomputed:
  // each kept row attended only to its ancestors, at its own position.
  void compact(int64_t start, const std::vector<int32_t>& keep) {
    for (size_t k = 0; k < keep.size(); ++k) {
      if (keep[k] < int32_t(k) || (k > 0 && keep[k] <= keep[k - 1]))
        fail("KV compaction: kept rows must increase (row ", keep[k], " at slot ", k, ")");
      if (keep[k] == int32_t(k)) continue;
      for (auto& l : layers_)
        std::copy_n(l.data() + (start + keep[k]) * dim_, dim_, l.data() + (start + int64_t(k)) * dim_);
    }
    commit(start + int64_t(keep.size()));
  }
  uint64_t bytes_per_token() const { return uint64_t(layers_.size()) * uint64_t(dim_) * sizeof(float); }

 private:
  int64_t dim_, max_tokens_, size_ = 0;
  std::vector<std::vector<float>> layers_;  // [n_layers][capacity × dim]
};

}  // namespace kd
