// The engine's paged KV pool (src/kv/paged_kv.h): allocation, refcounts, the prefix cache's
// verification (ids and parent, not just the hash) and its least-recently-used eviction.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.h"
#include "kv/paged_kv.h"

namespace kd {
namespace {

std::vector<int32_t> ids_of(int32_t base) { return {base, base + 1, base + 2, base + 3}; }

TEST(KvPool, AllocatesEveryBlockOnceThenRunsOut) {
  KvPool pool(2, 3, 4, 3);
  std::vector<int32_t> got;
  for (int i = 0; i < 3; ++i) got.push_back(pool.allocate());
  EXPECT_EQ(pool.allocate(), -1);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool.n_used(), 3);
  // Rows of different blocks and layers never overlap.
  for (int32_t b : got)
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t r = 0; r < 4; ++r) pool.row(b, l, r)[0] = float(b * 100 + l * 10 + r);
  for (int32_t b : got)
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(pool.row(b, l, r)[0], float(b * 100 + l * 10 + r));
  const KvView v = pool.view({got[2], got[0]});
  EXPECT_EQ(v.capacity(), 8);
  EXPECT_EQ(v.row(1, 5)[0], float(got[0] * 100 + 10 + 1));
  for (int32_t b : got) pool.release(b);
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_THROW(pool.release(got[0]), Error);
}

TEST(KvPool, PrefixCacheVerifiesIdsAndParent) {
  KvPool pool(1, 2, 4, 8);
  const auto a = ids_of(10), b = ids_of(20);
  const uint64_t ha = KvPool::chain_hash(0, a.data(), 4), hab = KvPool::chain_hash(ha, b.data(), 4);
  EXPECT_NE(ha, KvPool::chain_hash(0, b.data(), 4));
  const int32_t ba = pool.allocate(), bb = pool.allocate();
  pool.publish(ba, ha, -1, a.data());
  pool.publish(bb, hab, ba, b.data());
  pool.release(ba);
  pool.release(bb);
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_EQ(pool.n_cached(), 2);
  // The right hash with other ids, or another parent, is a miss.
  EXPECT_EQ(pool.lookup(ha, -1, b.data()), -1);
  EXPECT_EQ(pool.lookup(hab, -1, b.data()), -1);
  // The chain hits and takes references.
  EXPECT_EQ(pool.lookup(ha, -1, a.data()), ba);
  EXPECT_EQ(pool.lookup(hab, ba, b.data()), bb);
  EXPECT_EQ(pool.n_used(), 2);
  pool.release(bb);
  pool.release(ba);
}

TEST(KvPool, EvictsLeastRecentlyUsedAndStaleChildrenMiss) {
  KvPool pool(1, 2, 4, 3);
  const auto a = ids_of(1), b = ids_of(2), c = ids_of(3);
  const uint64_t ha = KvPool::chain_hash(0, a.data(), 4), hb = KvPool::chain_hash(ha, b.data(), 4);
  const uint64_t hc = KvPool::chain_hash(0, c.data(), 4);
  const int32_t ba = pool.allocate(), bb = pool.allocate(), bc = pool.allocate();
  pool.publish(ba, ha, -1, a.data());
  pool.publish(bb, hb, ba, b.data());
  pool.publish(bc, hc, -1, c.data());
  pool.release(bc);  // least recently used
  pool.release(ba);
  pool.release(bb);
  EXPECT_EQ(pool.n_available(), 3);
  // Touch c again: now a is the oldest.
  EXPECT_EQ(pool.lookup(hc, -1, c.data()), bc);
  pool.release(bc);
  const int32_t x = pool.allocate();
  EXPECT_EQ(x, ba);
  EXPECT_EQ(pool.n_evictions(), 1u);
  EXPECT_EQ(pool.lookup(ha, -1, a.data()), -1);
  // a's old block now holds other data: b (whose parent it was) must not match under it.
  EXPECT_EQ(pool.lookup(hb, x, b.data()), -1);
  EXPECT_EQ(pool.lookup(hc, -1, c.data()), bc);
  pool.release(bc);
  pool.release(x);
}

// A device target's pool (host_storage = false): the same bookkeeping, views carry the block
// table only, and the CPU forward refuses such a view by name instead of dereferencing nothing.
TEST(KvPool, WithoutHostStorageViewsCarryBlockIdsOnly) {
  KvPool pool(3, 8, 4, 5, /*host_storage=*/false);
  const int32_t a = pool.allocate(), b = pool.allocate();
  const KvView v = pool.view({b, a});
  EXPECT_TRUE(v.ptrs.empty());
  EXPECT_EQ(v.blocks, (std::vector<int32_t>{b, a}));
  EXPECT_EQ(v.capacity(), 8);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.n_available(), 5);
}

}  // namespace
}  // namespace kd
