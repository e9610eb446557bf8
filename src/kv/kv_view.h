// One sequence's latent KV rows as the forward addresses them, wherever they live: a contiguous
// LatentCache (one block as long as the cache) or blocks of the engine's paged pool. Row `pos` of
// layer `l` is in block pos / block_tokens at offset pos % block_tokens.
#pragma once
#include <cstdint>
#include <vector>

namespace kd {

struct KvView {
  int64_t dim = 0;           // values per row (kv_lora_rank + qk_rope_head_dim)
  int64_t n_layers = 0;
  int64_t block_tokens = 0;  // rows per block
  std::vector<float*> ptrs;  // [n_blocks × n_layers]: where block b's rows of layer l begin (host storage)
  std::vector<int32_t> blocks;  // the block table (pool block ids), when the view comes from a KvPool

  int64_t capacity() const {
    if (!ptrs.empty() || blocks.empty()) return n_layers ? int64_t(ptrs.size()) / n_layers * block_tokens : 0;
    return int64_t(blocks.size()) * block_tokens;
  }
  float* row(int64_t layer, int64_t pos) const {
    return ptrs[size_t((pos / block_tokens) * n_layers + layer)] + (pos % block_tokens) * dim;
  }
};

}  // namespace kd
