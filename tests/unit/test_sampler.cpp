// Sampling pipeline (src/sample/sampler.h): distribution, determinism, edge cases, validation.
// Distributions are checked by chi-square goodness of fit of tokens drawn with position_uniform at
// fixed seeds against a target computed here independently (long double softmax, full stable sort,
// the stages applied literally). Every run is deterministic; the 1e-6 p-value threshold only says
// how unlucky a correct sampler would have to be to fail at a given seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "sample/rng.h"
#include "sample/sampler.h"

namespace {

using kd::SamplingParams;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

SamplingParams params(float temperature, int32_t top_k = 0, float top_p = 1.0f, float min_p = 0.0f,
                      uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  return p;
}

int32_t draw(const std::vector<float>& logits, const SamplingParams& p, float u) {
  return kd::sample(logits.data(), int32_t(logits.size()), p, u);
}

// Upper tail of the chi-square distribution, Q(df/2, x/2) (regularised upper incomplete gamma):
// power series for P when x/2 < a + 1, modified Lentz continued fraction for Q otherwise.
double chi2_sf(double x, int df) {
  const double a = 0.5 * df, y = 0.5 * x;
  if (y <= 0.0) return 1.0;
  const double prefactor = std::exp(a * std::log(y) - y - std::lgamma(a));
  if (y < a + 1.0) {
    double term = 1.0 / a, sum = term;
    for (int k = 1; k < 10000 && term > sum * 1e-17; ++k) sum += term *= y / (a + k);
    return 1.0 - prefactor * sum;
  }
  const double tiny = 1e-300;
  double b = y + 1.0 - a, c = 1.0 / tiny, d = 1.0 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    c = b + an / c;
    d = 1.0 / (std::abs(d) < tiny ? tiny : d);
    c = std::abs(c) < tiny ? tiny : c;
    h *= d * c;
    if (std::abs(d * c - 1.0) < 1e-16) break;
  }
  return prefactor * h;
}

// Reference values: scipy.stats.chi2.sf (scipy 1.17.1).
TEST(SamplerStats, ChiSquareTailMatchesScipy) {
  EXPECT_NEAR(chi2_sf(10, 10), 0.44049328506521257, 1e-12);
  EXPECT_NEAR(chi2_sf(3, 1), 0.08326451666355042, 1e-12);
  EXPECT_NEAR(chi2_sf(0.5, 2), 0.7788007830714049, 1e-12);
  EXPECT_NEAR(chi2_sf(30, 10) / 0.000856641210775301, 1.0, 1e-9);
  EXPECT_NEAR(chi2_sf(60, 20) / 7.121750862815593e-06, 1.0, 1e-9);
  EXPECT_NEAR(chi2_sf(1000, 800) / 1.6472192644087128e-06, 1.0, 1e-9);
}

// The pipeline of sampler.h, applied literally: ranked ids, their weights, how many are kept.
struct Target {
  std::vector<size_t> order;     // token ids, weight descending, ties by lower id
  std::vector<long double> q;    // [n] unnormalised weights by token id
  size_t keep = 0;               // candidates kept: order[0, keep)
  std::vector<long double> cdf;  // [keep] running sums of kept weights in ranked order
};

Target make_target(const std::vector<float>& logits, const SamplingParams& p) {
  Target t;
  const size_t n = logits.size();
  const long double mx = *std::max_element(logits.begin(), logits.end());
  t.q.resize(n);
  for (size_t i = 0; i < n; ++i)
    t.q[i] = logits[i] == -kInf ? 0.0L : std::exp((static_cast<long double>(logits[i]) - mx) / p.temperature);
  t.order.resize(n);
  std::iota(t.order.begin(), t.order.end(), size_t(0));
  std::stable_sort(t.order.begin(), t.order.end(), [&](size_t a, size_t b) { return t.q[a] > t.q[b]; });
  t.keep = size_t(std::count_if(t.q.begin(), t.q.end(), [](long double w) { return w > 0; }));
  if (p.top_k > 0) t.keep = std::min(t.keep, size_t(p.top_k));
  if (p.top_p < 1.0f) {
    long double s = 0, cum = 0;
    for (size_t j = 0; j < t.keep; ++j) s += t.q[t.order[j]];
    for (size_t j = 0; j < t.keep; ++j) {
      cum += t.q[t.order[j]];
      if (cum >= p.top_p * s) {
        // A fixture sitting on the boundary would make the reference itself ambiguous.
        EXPECT_GT(std::abs(cum - p.top_p * s), 1e-9L * s) << "top_p boundary at rank " << j;
        t.keep = j + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    const long double thr = p.min_p * t.q[t.order[0]];
    size_t m = 0;
    while (m < t.keep && t.q[t.order[m]] >= thr) ++m;
    if (m < t.keep) {
      EXPECT_GT(std::abs(t.q[t.order[m]] - thr), 1e-9L * thr) << "min_p boundary";
    }
    t.keep = m;
  }
  long double cum = 0;
  for (size_t j = 0; j < t.keep; ++j) t.cdf.push_back(cum += t.q[t.order[j]]);
  return t;
}

std::vector<double> target_probs(const Target& t) {
  std::vector<double> prob(t.q.size(), 0.0);
  for (size_t j = 0; j < t.keep; ++j) prob[t.order[j]] = double(t.q[t.order[j]] / t.cdf.back());
  return prob;
}

// Inverse CDF of the reference: the first kept candidate whose running sum exceeds u x total.
size_t reference_draw(const Target& t, float u) {
  const long double x = u * t.cdf.back();
  const size_t j = size_t(std::upper_bound(t.cdf.begin(), t.cdf.end(), x) - t.cdf.begin());
  return t.order[std::min(j, t.keep - 1)];
}

// Chi-square p-value of `n_draws` tokens sampled at positions 0.. of (p.seed, seq 0) against
// `prob`. Bins expected below 5 are pooled; a token of probability 0 that appears fails outright.
double fit_p_value(const std::vector<float>& logits, const SamplingParams& p, const std::vector<double>& prob,
                   int n_draws) {
  std::vector<int64_t> count(logits.size(), 0);
  for (int pos = 0; pos < n_draws; ++pos) ++count[size_t(draw(logits, p, kd::position_uniform(p.seed, 0, uint64_t(pos))))];
  double stat = 0, pooled_e = 0, pooled_o = 0;
  int bins = 0;
  for (size_t i = 0; i < prob.size(); ++i) {
    const double e = prob[i] * n_draws, o = double(count[i]);
    if (prob[i] == 0.0) {
      EXPECT_EQ(count[i], 0) << "token " << i << " has probability 0 but was sampled";
    } else if (e < 5.0) {
      pooled_e += e, pooled_o += o;
    } else {
      stat += (o - e) * (o - e) / e, ++bins;
    }
  }
  if (pooled_e > 0) stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e, ++bins;
  return bins >= 2 ? chi2_sf(stat, bins - 1) : 1.0;
}

// 40 tokens: a spread of logits, an exact tie (ids 11 and 12), two masked tokens (ids 7 and 23).
std::vector<float> fixture_logits() {
  std::vector<float> l(40);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(2.5 * std::sin(1.7 * double(i)) + 0.03 * double(i));
  l[12] = l[11];
  l[7] = l[23] = -kInf;
  return l;
}

struct FitCase {
  const char* name;
  SamplingParams p;
};

class SamplerFit : public ::testing::TestWithParam<FitCase> {};

TEST_P(SamplerFit, MatchesTargetDistribution) {
  const std::vector<float> logits = fixture_logits();
  const SamplingParams& p = GetParam().p;
  const double pv = fit_p_value(logits, p, target_probs(make_target(logits, p)), 200000);
  EXPECT_GT(pv, 1e-6) << GetParam().name;
}

// On fixture_logits (38 live tokens): top_k_6 keeps 6, top_p_0_75 keeps 9, min_p_0_08 keeps 17;
// in "combined" every stage binds: top-k 38 → 15, top-p (renormalised after top-k) → 10, min-p → 9
// (top-p over the un-renormalised distribution would keep 12 instead).
INSTANTIATE_TEST_SUITE_P(
    Sampler, SamplerFit,
    ::testing::Values(FitCase{"temperature_0_7", params(0.7f)}, FitCase{"temperature_1_3", params(1.3f, 0, 1, 0, 2)},
                      FitCase{"top_k_6", params(1.0f, 6, 1, 0, 3)}, FitCase{"top_p_0_75", params(1.0f, 0, 0.75f, 0, 4)},
                      FitCase{"min_p_0_08", params(1.0f, 0, 1, 0.08f, 5)},
                      FitCase{"combined", params(0.8f, 15, 0.9f, 0.2f, 6)},
                      FitCase{"temperature_1e4", params(1e4f, 0, 1, 0, 7)}),
    [](const ::testing::TestParamInfo<FitCase>& param_info) { return std::string(param_info.param.name); });

// The fit test has power: samples at T = 0.7 are rejected against the T = 0.77 target, and top-p
// sampling against the plain-temperature target.
TEST(SamplerFit, RejectsAWrongDistribution) {
  const std::vector<float> logits = fixture_logits();
  EXPECT_LT(fit_p_value(logits, params(0.7f), target_probs(make_target(logits, params(0.77f))), 200000), 1e-6);
  EXPECT_LT(fit_p_value(logits, params(1.0f, 0, 0.95f), target_probs(make_target(logits, params(1.0f))), 200000),
            1e-6);
}

// Full vocabulary: token for token against the reference inverse CDF, including a flat case whose
// nucleus spans thousands of candidates (the lazily extended ranking has to grow several times).
TEST(Sampler, MatchesReferenceOnFullVocabulary) {
  const int32_t n = 163840;
  std::mt19937_64 gen(20240601);  // the engine's output sequence is fixed by the standard
  std::vector<float> logits(size_t(n), 0.0f);
  for (float& l : logits) {
    double g = 0;
    for (int k = 0; k < 4; ++k) g += double(gen() >> 11) * 0x1p-53;
    l = float(-4.0 + 2.5 * (g - 2.0));
  }
  for (int i = 0; i < 30; ++i) logits[gen() % uint64_t(n)] = float(6.0 + 0.2 * i);  // a peaked head
  for (int i = 0; i < 2000; ++i) logits[gen() % uint64_t(n)] = -kInf;
  const SamplingParams cases[] = {params(1.0f),          params(0.6f, 0, 0.9f),         params(1.0f, 40),
                                  params(4.0f, 0, 0.95f), params(1.0f, 0, 1, 0.05f),     params(1.5f, 2000, 0.98f, 0.001f),
                                  params(20.0f)};
  for (const SamplingParams& p : cases) {
    const Target t = make_target(logits, p);
    for (uint64_t pos = 0; pos < 60; ++pos) {
      const float u = kd::position_uniform(99, 0, pos);
      ASSERT_EQ(size_t(draw(logits, p, u)), reference_draw(t, u))
          << "T " << p.temperature << " k " << p.top_k << " p " << p.top_p << " min_p " << p.min_p << " u " << u;
    }
  }
}

// ---- determinism -------------------------------------------------------------------------------

std::vector<int32_t> generate(const std::vector<float>& logits, uint64_t seed, uint64_t seq_id, int n) {
  std::vector<int32_t> out;
  for (int pos = 0; pos < n; ++pos)
    out.push_back(draw(logits, params(1.0f, 0, 0.99f), kd::position_uniform(seed, seq_id, uint64_t(pos))));
  return out;
}

std::vector<float> flat_logits(int n) {
  std::vector<float> l(size_t(n), 0.0f);
  for (int i = 0; i < n; ++i) l[size_t(i)] = float(std::fmod(i * 0.618034, 1.0) * 2.0);
  return l;
}

TEST(SamplerDeterminism, SameSeedSameTokensDifferentSeedsDiffer) {
  const std::vector<float> logits = flat_logits(1000);
  const std::vector<int32_t> a = generate(logits, 7, 0, 500);
  EXPECT_EQ(a, generate(logits, 7, 0, 500));
  auto n_same = [&](const std::vector<int32_t>& b) {
    int s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] == b[i];
    return s;
  };
  EXPECT_LT(n_same(generate(logits, 8, 0, 500)), 20);  // ~0.5 expected by chance
  EXPECT_LT(n_same(generate(logits, 7, 1, 500)), 20);
}

// Scratch is thread_local: a call after a bigger vocabulary, or on another thread, is unaffected.
TEST(SamplerDeterminism, ScratchStateDoesNotLeakBetweenCalls) {
  const std::vector<float> small = flat_logits(300), big = flat_logits(163840);
  const std::vector<int32_t> first = generate(small, 3, 0, 200);
  (void)generate(big, 4, 0, 3);
  EXPECT_EQ(generate(small, 3, 0, 200), first);
  std::vector<int32_t> other;
  std::thread th([&] { other = generate(small, 3, 0, 200); });
  th.join();
  EXPECT_EQ(other, first);
}

// ---- exact mapping and edge cases ----------------------------------------------------------------

// Inverse CDF runs in ranked order, not id order: probabilities 0.3, 0.2, 0.5 for ids 0, 1, 2 rank
// as 2, 0, 1 with cumulative 0.5, 0.8, 1.0.
TEST(SamplerEdge, InverseCdfWalksRankedOrder) {
  const std::vector<float> l = {std::log(0.3f), std::log(0.2f), std::log(0.5f)};
  const SamplingParams p = params(1.0f);
  EXPECT_EQ(draw(l, p, 0.0f), 2);
  EXPECT_EQ(draw(l, p, 0.49f), 2);
  EXPECT_EQ(draw(l, p, 0.51f), 0);
  EXPECT_EQ(draw(l, p, 0.79f), 0);
  EXPECT_EQ(draw(l, p, 0.81f), 1);
  EXPECT_EQ(draw(l, p, 0x1.fffffep-1f), 1);  // largest float below 1
}

// p = (0.9526, 0.0474): top_p = 1 keeps the tail token, 0.95 drops it, 0.96 keeps it again.
TEST(SamplerEdge, TopPOneKeepsEverythingAndCutsAtTheSmallestPrefix) {
  const std::vector<float> l = {0.0f, -3.0f};
  EXPECT_EQ(draw(l, params(1.0f, 0, 1.0f), 0.99f), 1);
  EXPECT_EQ(draw(l, params(1.0f, 0, 0.95f), 0.99f), 0);
  EXPECT_EQ(draw(l, params(1.0f, 0, 0.96f), 0.99f), 1);
}

TEST(SamplerEdge, TinyTopPKeepsExactlyTheTopToken) {
  const std::vector<float> l = flat_logits(1000);
  const int32_t best = kd::argmax(l.data(), int32_t(l.size()));
  for (uint64_t pos = 0; pos < 200; ++pos) EXPECT_EQ(draw(l, params(2.0f, 0, 1e-6f), kd::position_uniform(1, 0, pos)), best);
  const std::vector<float> tied = {1.0f, 5.0f, 0.0f, 5.0f};  // the lower id of a tied top
  for (float u : {0.0f, 0.5f, 0.999f}) EXPECT_EQ(draw(tied, params(1.0f, 0, 1e-6f), u), 1);
}

// Four equal weights: token j owns u in [j/4, (j+1)/4) — the running sum must EXCEED u x total,
// so the exact boundaries (representable here) belong to the next token.
TEST(SamplerEdge, EqualLogitsRankByLowerIdOnHalfOpenIntervals) {
  const std::vector<float> l(4, 0.5f);
  const float u_to_token[][2] = {{0.0f, 0}, {0.1f, 0}, {0.25f, 1}, {0.3f, 1}, {0.5f, 2}, {0.6f, 2}, {0.75f, 3}, {0.9f, 3}};
  for (const auto& [u, tok] : u_to_token) EXPECT_EQ(draw(l, params(1.0f), u), int32_t(tok)) << "u " << u;
}

// top_p = 0.5 of four equal weights is reached exactly by two of them: the smallest prefix whose
// cumulative is >= top_p keeps {0, 1}, so u = 0.75 lands on token 1, not 2.
TEST(SamplerEdge, TopPKeepsThePrefixThatReachesItExactly) {
  const std::vector<float> l(4, 0.5f);
  EXPECT_EQ(draw(l, params(1.0f, 0, 0.5f), 0.75f), 1);
  EXPECT_EQ(draw(l, params(1.0f, 0, 0.5f), 0.4f), 0);
  EXPECT_EQ(draw(l, params(1.0f, 0, 0.75f), 0.9f), 2);
}

// 100000 tokens far below the top (w = e^-17 ~ 2^-24.5 each) carry ~0.4 % of the mass together:
// selecting among them needs the ranking to reach deep weight buckets, and top-k cuts their tie.
TEST(SamplerEdge, DeepTailOfManySmallWeights) {
  std::vector<float> l(100001, -17.0f);
  l[0] = 0.0f;
  for (const SamplingParams& p : {params(1.0f), params(1.0f, 50001), params(1.0f, 0, 0.9999f)}) {
    const Target t = make_target(l, p);
    int tail = 0;
    for (uint64_t pos = 0; pos < 200; ++pos) {
      // u in [0.994, 1): the tail starts near 0.9959 (untruncated) or 0.9979 (k = 50001).
      const float u = std::min(0.994f + 0.006f * kd::position_uniform(13, 0, pos), 0x1.fffffep-1f);
      const int32_t tok = draw(l, p, u);
      ASSERT_EQ(size_t(tok), reference_draw(t, u)) << "k " << p.top_k << " p " << p.top_p << " u " << u;
      tail += tok != 0;
    }
    EXPECT_GT(tail, 30) << "k " << p.top_k << " p " << p.top_p;  // ~68 (k) or ~136 expected
  }
}

TEST(SamplerEdge, TopKCuttingInsideATieKeepsLowerIds) {
  const std::vector<float> l = {1.0f, 2.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  EXPECT_EQ(draw(l, params(1.0f, 2), 0.2f), 1);
  EXPECT_EQ(draw(l, params(1.0f, 2), 0.7f), 2);
  for (uint64_t pos = 0; pos < 2000; ++pos) {
    const int32_t t = draw(l, params(1.0f, 2), kd::position_uniform(5, 0, pos));
    ASSERT_TRUE(t == 1 || t == 2) << t;
  }
}

TEST(SamplerEdge, SingleCandidate) {
  const std::vector<float> l = {-3.5f};
  for (const SamplingParams& p : {params(0.0f), params(1.0f), params(0.3f, 1, 0.1f, 1.0f), params(1e30f, 5)})
    for (float u : {0.0f, 0.5f, 0.9999f}) EXPECT_EQ(draw(l, p, u), 0);
}

TEST(SamplerEdge, TopKAtLeastNIsOff) {
  const std::vector<float> l = fixture_logits();
  for (uint64_t pos = 0; pos < 500; ++pos) {
    const float u = kd::position_uniform(11, 0, pos);
    const int32_t off = draw(l, params(1.1f), u);
    EXPECT_EQ(draw(l, params(1.1f, 40), u), off);
    EXPECT_EQ(draw(l, params(1.1f, 1000), u), off);
  }
}

TEST(SamplerEdge, MinPOneKeepsOnlyTheMaxAndItsTies) {
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
  EXPECT_EQ(draw(l, params(1.0f, 0, 1, 1.0f), 0.0f), 1);
  EXPECT_EQ(draw(l, params(1.0f, 0, 1, 1.0f), 0.34f), 2);
  EXPECT_EQ(draw(l, params(1.0f, 0, 1, 1.0f), 0.67f), 4);
  const std::vector<float> single_max = {1.0f, 3.0f, 2.999f};
  for (uint64_t pos = 0; pos < 500; ++pos)
    EXPECT_EQ(draw(single_max, params(5.0f, 0, 1, 1.0f), kd::position_uniform(2, 0, pos)), 1);
}

// Huge T: every finite logit gets weight exactly 1 (uniform, ranked by id); -inf still never.
// Tiny T (down to the smallest subnormal): the argmax, or an even split of a tied max.
TEST(SamplerEdge, ExtremeTemperatures) {
  const std::vector<float> l = {5.0f, -kInf, -5.0f, 0.0f};
  EXPECT_EQ(draw(l, params(1e30f), 0.10f), 0);
  EXPECT_EQ(draw(l, params(1e30f), 0.40f), 2);
  EXPECT_EQ(draw(l, params(1e30f), 0.90f), 3);
  const std::vector<float> tied = {0.0f, 2.0f, 1.0f, 2.0f};
  for (float t : {1e-6f, 1e-30f, std::numeric_limits<float>::denorm_min()}) {
    for (float u : {0.0f, 0.3f, 0.999f}) EXPECT_EQ(draw(l, params(t), u), 0) << t;
    EXPECT_EQ(draw(tied, params(t), 0.25f), 1) << t;
    EXPECT_EQ(draw(tied, params(t), 0.75f), 3) << t;
  }
}

TEST(SamplerEdge, NegInfLogitsAreNeverSampled) {
  std::vector<float> l = flat_logits(200);
  for (size_t i = 0; i < l.size(); i += 3) l[i] = -kInf;
  for (const SamplingParams& p : {params(2.0f), params(1e30f), params(1.0f, 500), params(50.0f, 0, 1, 0.0f)})
    for (uint64_t pos = 0; pos < 3000; ++pos)
      ASSERT_NE(draw(l, p, kd::position_uniform(8, 0, pos)) % 3, 0) << "T " << p.temperature;
}

TEST(SamplerEdge, AllNegInfButOne) {
  std::vector<float> l(1000, -kInf);
  l[517] = -20.0f;
  EXPECT_EQ(kd::argmax(l.data(), 1000), 517);
  for (const SamplingParams& p : {params(0.0f), params(1.0f), params(1e30f, 3, 0.5f, 0.5f), params(1e-30f)})
    for (float u : {0.0f, 0.5f, 0.9999f}) EXPECT_EQ(draw(l, p, u), 517);
}

TEST(SamplerEdge, PositiveInfinitySharesTheMassEqually) {
  const std::vector<float> l = {0.0f, kInf, 1e30f, kInf};
  EXPECT_EQ(kd::argmax(l.data(), 4), 1);
  EXPECT_EQ(draw(l, params(1.0f), 0.49f), 1);
  EXPECT_EQ(draw(l, params(1.0f), 0.51f), 3);
}

TEST(SamplerEdge, ArgmaxTakesTheLowestIndexOfATie) {
  const std::vector<float> l = {-kInf, -7.0f, -1.0f, -3.0f, -1.0f};
  EXPECT_EQ(kd::argmax(l.data(), 5), 2);
  EXPECT_EQ(draw(l, params(0.0f, 1, 0.5f, 0.5f), 0.9f), 2);  // greedy ignores u and the filters
}

// ---- errors ----------------------------------------------------------------------------------------

// Runs f, expecting kd::Error whose message contains `needle`.
template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no kd::Error (expected one mentioning '" << needle << "')";
  } catch (const kd::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(SamplerErrors, NaNLogitThrows) {
  std::vector<float> l = flat_logits(64);
  l[63] = kNaN;
  expect_error([&] { kd::argmax(l.data(), 64); }, "NaN");
  expect_error([&] { draw(l, params(0.0f), 0.5f); }, "NaN");
  expect_error([&] { draw(l, params(1.0f, 5), 0.5f); }, "NaN");
}

TEST(SamplerErrors, NothingSelectableThrows) {
  const std::vector<float> l(8, -kInf);
  expect_error([&] { kd::argmax(l.data(), 8); }, "-inf");
  expect_error([&] { draw(l, params(1.0f), 0.5f); }, "-inf");
  expect_error([&] { kd::argmax(l.data(), 0); }, "size");
  expect_error([&] { kd::sample(l.data(), -1, params(1.0f), 0.5f); }, "size");
}

TEST(SamplerErrors, UniformOutsideUnitIntervalThrows) {
  const std::vector<float> l = {0.0f, 1.0f};
  for (float u : {1.0f, -0.0001f, kNaN, kInf}) expect_error([&] { draw(l, params(1.0f), u); }, "u must be");
}

TEST(SamplerErrors, InvalidParamsNameTheField) {
  const std::vector<float> l = {0.0f, 1.0f};
  const std::pair<SamplingParams, const char*> bad[] = {
      {params(-0.1f), "temperature"}, {params(kNaN), "temperature"}, {params(kInf), "temperature"},
      {params(1.0f, -1), "top_k"},    {params(1.0f, 0, 0.0f), "top_p"}, {params(1.0f, 0, -0.5f), "top_p"},
      {params(1.0f, 0, 1.01f), "top_p"}, {params(1.0f, 0, kNaN), "top_p"}, {params(1.0f, 0, 1, -0.01f), "min_p"},
      {params(1.0f, 0, 1, 1.5f), "min_p"}, {params(1.0f, 0, 1, kNaN), "min_p"},
      {params(0.0f, -3), "top_k"},  // greedy does not excuse an invalid filter
  };
  for (const auto& [p, field] : bad) {
    expect_error([&p = p] { kd::validate(p); }, std::string("SamplingParams.") + field);
    expect_error([&, &p = p] { draw(l, p, 0.5f); }, std::string("SamplingParams.") + field);
  }
  for (const SamplingParams& ok : {params(0.0f), params(1.0f, 0, 1.0f, 1.0f), params(0.5f, 7, 1e-6f, 0.0f)})
    EXPECT_NO_THROW(kd::validate(ok));
}

}  // namespace
