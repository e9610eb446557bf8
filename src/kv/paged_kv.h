// The serving engine's latent KV (DESIGN.md §3): one pool of fixed-size blocks of `block_tokens`
// rows (every layer's rows of those tokens), lent to sequences through per-sequence block tables,
// plus the prefix cache: full prompt blocks keyed by a chain hash of their token ids, shared
// read-only (refcounted) by every sequence whose prompt starts the same way, and evicted
// least-recently-used when a block is needed and none is free.
//
// A cached entry is matched on its hash AND verified: its own token ids must equal the block's and
// its parent must be the block the lookup matched just before (same id and same reuse generation),
// so by induction the whole prefix is verified, never just a hash.
// Not thread-safe: only the engine thread touches it.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

#include "kv/kv_view.h"

namespace kd {

class KvPool {
 public:
  // Storage of a block ([n_layers, block_tokens, dim] fp32) is allocated the first time it is lent.
  // host_storage = false: the pool only does the bookkeeping (block ids, refcounts, prefix cache)
  // for a target that keeps the blocks itself (the CUDA target's device cache); views then carry
  // block ids only and row() must not be called.
  KvPool(int64_t n_layers, int64_t dim, int64_t block_tokens, int64_t n_blocks, bool host_storage = true);

  int64_t block_tokens() const { return block_tokens_; }
  int64_t n_blocks() const { return int64_t(meta_.size()); }
  int64_t n_available() const { return int64_t(free_.size() + lru_.size()); }  // free or evictable
  int64_t n_used() const { return n_blocks() - n_available(); }                // held by a sequence
  int64_t n_cached() const { return int64_t(index_.size()); }                  // prefix-cache entries
  uint64_t n_evictions() const { return evictions_; }                          // cached blocks reused

  // A private block with refcount 1, evicting the least recently used unreferenced cached block
  // when none is free; -1 when every block is held.
  int32_t allocate();
  void release(int32_t b);  // refcount − 1; at 0 the block becomes free (or evictable if cached)

  // Prefix cache. hash = chain_hash(parent's hash or 0, ids of this block).
  static uint64_t chain_hash(uint64_t parent_hash, const int32_t* ids, int64_t n);
  // The cached block for `ids` (block_tokens of them) following `parent` (−1 for the first block),
  // with a reference taken; −1 on a miss.
  int32_t lookup(uint64_t hash, int32_t parent, const int32_t* ids);
  // Offers a full block (held by the caller) to the cache; a no-op when the key is already cached.
  void publish(int32_t b, uint64_t hash, int32_t parent, const int32_t* ids);

  // The view of a block table for the forward.
  KvView view(const std::vector<int32_t>& table) const;
  float* row(int32_t b, int64_t layer, int64_t offset) const {
    return storage_[size_t(b)].get() + (layer * block_tokens_ + offset) * dim_;
  }

 private:
  struct Meta {
    int32_t refs = 0;
    uint64_t gen = 0;  // bumped each time the block is lent anew: stale parent links stop matching
    bool cached = false;
    uint64_t hash = 0;
    int32_t parent = -1;
    uint64_t parent_gen = 0;
    std::vector<int32_t> ids;          // the block's tokens while cached
    std::list<int32_t>::iterator lru;  // valid while cached with refs == 0
  };
  void uncache(int32_t b);

  int64_t n_layers_, dim_, block_tokens_;
  bool host_storage_ = true;
  std::vector<Meta> meta_;
  std::vector<std::unique_ptr<float[]>> storage_;
  std::vector<int32_t> free_;   // never-cached or evicted blocks, reused LIFO
  std::list<int32_t> lru_;      // cached, unreferenced: front is the least recently used
  std::unordered_map<uint64_t, int32_t> index_;  // chain hash → cached block
  uint64_t evictions_ = 0;
};

}  // namespace kd
