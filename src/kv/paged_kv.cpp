#include "kv/paged_kv.h"

#include <algorithm>

#include "core/error.h"

namespace kd {

KvPool::KvPool(int64_t n_layers, int64_t dim, int64_t block_tokens, int64_t n_blocks, bool host_storage)
    : n_layers_(n_layers), dim_(dim), block_tokens_(block_tokens), host_storage_(host_storage) {
  if (block_tokens < 1) fail("KV block size must be at least 1 token (got ", block_tokens, ")");
  if (n_blocks < 1 || n_blocks > (int64_t(1) << 30)) fail("KV pool: ", n_blocks, " blocks is out of range");
  meta_.resize(static_cast<size_t>(n_blocks));
  storage_.resize(static_cast<size_t>(n_blocks));
  free_.reserve(static_cast<size_t>(n_blocks));
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));  // block 0 lent first
}

int32_t KvPool::allocate() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    uncache(b);
    ++evictions_;
  } else {
    return -1;
  }
  Meta& m = meta_[size_t(b)];
  m.refs = 1;
  ++m.gen;
  if (host_storage_ && !storage_[size_t(b)]) storage_[size_t(b)] = std::make_unique<float[]>(size_t(n_layers_ * block_tokens_ * dim_));
  return b;
}

void KvPool::uncache(int32_t b) {
  Meta& m = meta_[size_t(b)];
  auto it = index_.find(m.hash);
  if (it != index_.end() && it->second == b) index_.erase(it);
  m.cached = false;
  m.ids.clear();
  m.ids.shrink_to_fit();
}

void KvPool::release(int32_t b) {
  if (b < 0 || b >= int32_t(meta_.size()) || meta_[size_t(b)].refs <= 0) fail("internal: KV block ", b, " released twice");
  Meta& m = meta_[size_t(b)];
  if (--m.refs > 0) return;
  if (m.cached) {
    lru_.push_back(b);
    m.lru = std::prev(lru_.end());
  } else {
    free_.push_back(b);
  }
}

uint64_t KvPool::chain_hash(uint64_t parent_hash, const int32_t* ids, int64_t n) {
  // FNV-1a over the parent's hash and the ids' bytes, then a final avalanche (splitmix64's).
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(parent_hash);
  for (int64_t i = 0; i < n; ++i) mix(uint64_t(uint32_t(ids[i])));
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

int32_t KvPool::lookup(uint64_t hash, int32_t parent, const int32_t* ids) {
  auto it = index_.find(hash);
  if (it == index_.end()) return -1;
  const int32_t b = it->second;
  Meta& m = meta_[size_t(b)];
  if (m.parent != parent || (parent >= 0 && m.parent_gen != meta_[size_t(parent)].gen)) return -1;
  if (!std::equal(m.ids.begin(), m.ids.end(), ids)) return -1;
  if (m.refs++ == 0) lru_.erase(m.lru);
  return b;
}

void KvPool::publish(int32_t b, uint64_t hash, int32_t parent, const int32_t* ids) {
  Meta& m = meta_[size_t(b)];
  if (m.cached || index_.count(hash)) return;
  m.cached = true;
  m.hash = hash;
  m.parent = parent;
  m.parent_gen = parent >= 0 ? meta_[size_t(parent)].gen : 0;
  m.ids.assign(ids, ids + block_tokens_);
  index_[hash] = b;
}

KvView KvPool::view(const std::vector<int32_t>& table) const {
  KvView v;
  v.dim = dim_;
  v.n_layers = n_layers_;
  v.block_tokens = block_tokens_;
  v.blocks = table;
  if (!host_storage_) return v;
  v.ptrs.reserve(table.size() * size_t(n_layers_));
  for (int32_t b : table)
    for (int64_t l = 0; l < n_layers_; ++l) v.ptrs.push_back(row(b, l, 0));
  return v;
}

}  // namespace kd
