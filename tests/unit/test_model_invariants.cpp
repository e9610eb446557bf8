// Properties of the forward that DDTree and the CUDA backend will rely on:
// the absorbed MLA form equals the expanded one; a token's logits do not depend on how many rows
// were computed with it or on the thread count (row invariance, bitwise).
#include <gtest/gtest.h>

#include <cmath>

#include "core/thread_pool.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"

namespace kd {
namespace {

std::vector<int32_t> token_stream(int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = int32_t((i * 131 + 7) % vocab);
  return ids;
}

// Logits [n, V] from feeding ids one token at a time with the given form.
std::vector<float> stepwise(const DeepseekV3& m, const std::vector<int32_t>& ids, AttnForm form) {
  const int64_t V = m.config().vocab_size;
  LatentCache cache = m.new_cache(int64_t(ids.size()));
  std::vector<float> out(ids.size() * size_t(V));
  for (size_t i = 0; i < ids.size(); ++i) m.forward(cache, &ids[i], 1, form, false, &out[i * size_t(V)]);
  return out;
}

TEST(ModelInvariants, AbsorbedDecodeEqualsExpandedOver80Positions) {
  for (const char* fx : {"k2-int4", "dsv3-group"}) {
    Checkpoint ck(std::string(KDTREE_FIXTURES) + "/" + fx);
    DeepseekV3 m(ck);
    const int64_t V = m.config().vocab_size;
    const auto ids = token_stream(80, V);
    const auto a = stepwise(m, ids, AttnForm::absorbed), e = stepwise(m, ids, AttnForm::expanded);
    double worst = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      double d = 0, mx = 0;
      for (int64_t v = 0; v < V; ++v) {
        d = std::max(d, double(std::fabs(a[i * size_t(V) + size_t(v)] - e[i * size_t(V) + size_t(v)])));
        mx = std::max(mx, double(std::fabs(e[i * size_t(V) + size_t(v)])));
      }
      worst = std::max(worst, d / mx);
    }
    std::printf("  %s: absorbed vs expanded, worst max|d|/max|ref| over 80 positions = %.2e\n", fx, worst);
    EXPECT_LE(worst, 1e-5) << fx;
  }
}

TEST(ModelInvariants, PrefillRowsAreBitwiseTheStepwiseRows) {
  // Row invariance: the same token at the same position gets bit-identical logits whether it is
  // one row of a 40-row forward or a forward of its own (same attention form).
  Checkpoint ck(std::string(KDTREE_FIXTURES) + "/k2-int4");
  DeepseekV3 m(ck);
  const int64_t V = m.config().vocab_size;
  const auto ids = token_stream(40, V);
  LatentCache cache = m.new_cache(40);
  std::vector<float> batch(ids.size() * size_t(V));
  m.forward(cache, ids.data(), 40, AttnForm::expanded, true, batch.data());
  const auto single = stepwise(m, ids, AttnForm::expanded);
  for (size_t i = 0; i < batch.size(); ++i) ASSERT_EQ(batch[i], single[i]) << "row " << i / size_t(V);
  // And in two chunks (a prefill split like chunked prefill would do).
  LatentCache c2 = m.new_cache(40);
  std::vector<float> split(batch.size());
  m.forward(c2, ids.data(), 17, AttnForm::expanded, true, split.data());
  m.forward(c2, ids.data() + 17, 23, AttnForm::expanded, true, split.data() + 17 * size_t(V));
  for (size_t i = 0; i < batch.size(); ++i) ASSERT_EQ(batch[i], split[i]) << "row " << i / size_t(V);
}

TEST(ModelInvariants, ThreadCountDoesNotChangeBits) {
  Checkpoint ck(std::string(KDTREE_FIXTURES) + "/dsv3-group");
  DeepseekV3 m(ck);
  const auto ids = token_stream(24, m.config().vocab_size);
  std::vector<std::vector<float>> runs;
  for (int threads : {1, 2, 3}) {
    ThreadPool::set_global_threads(threads);
    runs.push_back(stepwise(m, ids, AttnForm::absorbed));
  }
  ThreadPool::set_global_threads(2);
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0], runs[2]);
}

TEST(ModelInvariants, RejectsOutOfVocabularyAndOverflowingContext) {
  Checkpoint ck(std::string(KDTREE_FIXTURES) + "/k2-bf16");
  DeepseekV3 m(ck);
  LatentCache cache = m.new_cache(4);
  std::vector<float> logits(static_cast<size_t>(m.config().vocab_size));
  int32_t bad = int32_t(m.config().vocab_size);
  EXPECT_THROW(m.forward(cache, &bad, 1, AttnForm::absorbed, false, logits.data()), Error);
  bad = -1;
  EXPECT_THROW(m.forward(cache, &bad, 1, AttnForm::absorbed, false, logits.data()), Error);
  std::vector<int32_t> five = {1, 2, 3, 4, 5};
  EXPECT_THROW(m.forward(cache, five.data(), 5, AttnForm::expanded, false, logits.data()), Error);
  EXPECT_EQ(cache.size(), 0);
}

}  // namespace
}  // namespace kd
