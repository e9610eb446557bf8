// model/perplexity.h: llama.cpp's chunking and error formulas, the top-k + tail KL, percentiles.
// End-to-end numbers against HF transformers are tests/cli/test_ppl.py.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "model/perplexity.h"

namespace kd {
namespace {

TEST(PplWindows, LlamaCppChunksScoreTheSecondHalf) {
  const auto w = ppl_windows(1100, 512, 0, true);  // n_chunk = 1100 / 512 = 2
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[1].start, 512);
  EXPECT_EQ(w[0].first, 256);
  EXPECT_EQ(w[0].n_scored, 255);  // ctx − 1 − ctx/2
  EXPECT_TRUE(w[0].bos);
}

TEST(PplWindows, StrideScoresTheLastStridePredictions) {
  const auto w = ppl_windows(100, 40, 25, true);  // (100 − 40 + 24) / 25 = 3 windows
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[2].start, 50);
  EXPECT_EQ(w[2].first, 14);  // ctx − stride − 1
  EXPECT_EQ(w[2].n_scored, 25);
  EXPECT_FALSE(w[0].bos);  // llama.cpp's strided mode never shows its model a BOS
  EXPECT_LE(w[2].start + w[2].first + w[2].n_scored, 100 - 1);
}

TEST(PplWindows, ShortTextAndBadStrideAreErrors) {
  EXPECT_THROW(ppl_windows(1023, 512, 0, false), Error);
  EXPECT_THROW(ppl_windows(2000, 512, 512, false), Error);
  EXPECT_THROW(ppl_windows(2000, 2, 0, false), Error);
}

TEST(NllStats, PplAndStandardErrorAsLlamaCpp) {
  NllStats s;
  for (double v : {1.0, 2.0, 3.0, 4.0}) s.add(v);
  EXPECT_DOUBLE_EQ(s.ppl(), std::exp(2.5));
  // sqrt((mean(x²) − mean²) / (n − 1)) · ppl = sqrt((7.5 − 6.25) / 3) · e^2.5
  EXPECT_NEAR(s.ppl_stderr(), std::sqrt(1.25 / 3) * std::exp(2.5), 1e-12);
}

TEST(KlRow, ExactWhenTheTopKIsTheWholeVocabulary) {
  const float base[4] = {2.0f, 1.0f, 0.0f, -1.0f}, cur[4] = {1.5f, 1.2f, 0.1f, -0.5f};
  int32_t ids[4];
  float lps[4];
  const RowScore b = score_row(base, 4, 1, 4, ids, lps);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(b.argmax, 0);
  double lse_b = 0, lse_c = 0;
  for (int i = 0; i < 4; ++i) lse_b += std::exp(double(base[i])), lse_c += std::exp(double(cur[i]));
  lse_b = std::log(lse_b), lse_c = std::log(lse_c);
  double want = 0;
  for (int i = 0; i < 4; ++i) want += std::exp(base[i] - lse_b) * ((base[i] - lse_b) - (cur[i] - lse_c));
  const KlRow k = kl_row(cur, 4, 1, b.nll, ids, lps, 4);
  EXPECT_NEAR(k.kl, want, 1e-6);
  EXPECT_TRUE(k.same_top);
  EXPECT_LT(k.tail, 1e-6);
  // top-2 + tail: a lower bound of the exact KL
  const KlRow k2 = kl_row(cur, 4, 1, b.nll, ids, lps, 2);
  EXPECT_LE(k2.kl, want + 1e-9);
  EXPECT_GT(k2.tail, 0.05);
}

TEST(Percentiles, LinearInterpolationAsLlamaCpp) {
  const Percentiles p = percentiles({4, 1, 3, 2});
  EXPECT_DOUBLE_EQ(p.min, 1);
  EXPECT_DOUBLE_EQ(p.max, 4);
  EXPECT_DOUBLE_EQ(p.median, 2.5);
  EXPECT_DOUBLE_EQ(p.p90, 1 + 0.9 * 3);
}

}  // namespace
}  // namespace kd
