// Philox4x32-10 and position-keyed uniforms (src/sample/rng.h).
//
// Known answers: the three `philox4x32 10` lines of Random123's tests/kat_vectors. They were
// cross-checked independently: a width-generic Python Philox reproduced numpy 2.4.6's
// numpy.random.Philox (which is Philox4x64-10 and pre-increments its counter) on 200 random
// (counter, key) pairs, and the same code at 32-bit width printed these three vectors. The pinned
// position_uniform values below come from that Python reference too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "sample/rng.h"

namespace {

using kd::Philox4x32;
using kd::position_uniform;
using Ctr = std::array<uint32_t, 4>;
using Key = std::array<uint32_t, 2>;

struct Kat {
  Ctr ctr;
  Key key;
  Ctr want;
};

constexpr Kat kKats[] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

// block() is constexpr so a CUDA port can be checked against it at compile time as well.
static_assert(Philox4x32::block(kKats[0].ctr, kKats[0].key) == kKats[0].want);
static_assert(Philox4x32::block(kKats[2].ctr, kKats[2].key) == kKats[2].want);
// The largest 24-bit value maps strictly below 1.
static_assert(float(0xffffffu) * 0x1p-24f < 1.0f);

TEST(Philox4x32, MatchesRandom123KnownAnswerVectors) {
  for (const Kat& k : kKats) {
    const Ctr got = Philox4x32::block(k.ctr, k.key);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(got[i], k.want[i]) << "word " << i << " of ctr " << std::hex << k.ctr[0] << "...";
  }
}

TEST(Philox4x32, EveryInputWordChangesTheOutput) {
  const Ctr base = Philox4x32::block({1, 2, 3, 4}, {5, 6});
  for (int i = 0; i < 4; ++i) {
    Ctr c = {1, 2, 3, 4};
    c[i] ^= 1u;
    EXPECT_NE(Philox4x32::block(c, {5, 6}), base) << "counter word " << i;
  }
  EXPECT_NE(Philox4x32::block({1, 2, 3, 4}, {4, 6}), base);
  EXPECT_NE(Philox4x32::block({1, 2, 3, 4}, {5, 7}), base);
}

// Pins the documented mapping: key = {lo, hi}(seed), counter = {lo, hi}(position), {lo, hi}(seq_id),
// first output word, top 24 bits. The last case has every high half non-zero.
TEST(PositionUniform, MatchesReferenceMapping) {
  struct Case {
    uint64_t seed, seq_id, position;
    uint32_t top24;
  };
  const Case cases[] = {
      {0, 0, 0, 6694888},  // = 0x6627e8d5 >> 8, the first KAT word
      {42, 0, 7, 6012291},
      {0x0123456789abcdefull, 3, 1000, 14189084},
      {0xffffffffffffffffull, 0xfedcba9876543210ull, 0x100000005ull, 16540813},
  };
  for (const Case& c : cases) {
    const float u = position_uniform(c.seed, c.seq_id, c.position);
    EXPECT_EQ(u, float(c.top24) * 0x1p-24f) << "seed " << c.seed << " seq " << c.seq_id << " pos " << c.position;
    const Ctr w = Philox4x32::block({uint32_t(c.position), uint32_t(c.position >> 32),
                                     uint32_t(c.seq_id), uint32_t(c.seq_id >> 32)},
                                    {uint32_t(c.seed), uint32_t(c.seed >> 32)});
    EXPECT_EQ(w[0] >> 8, c.top24);
  }
}

TEST(PositionUniform, IsAPureFunctionOfItsArguments) {
  const int n = 4096;
  std::vector<float> forward(n);
  for (int p = 0; p < n; ++p) forward[p] = position_uniform(123, 9, uint64_t(p));
  // Interleave other sequences and seeds, then read the positions back in a scrambled order.
  for (int p = n - 1; p >= 0; --p) {
    (void)position_uniform(999, 1, uint64_t(p));
    const int q = int((uint64_t(p) * 2654435761u) % n);  // a permutation of 0..n-1 (odd multiplier, n = 2^12)
    EXPECT_EQ(position_uniform(123, 9, uint64_t(q)), forward[q]) << "position " << q;
  }
}

TEST(PositionUniform, LiesInUnitIntervalOnA24BitGrid) {
  for (uint64_t p = 0; p < 100000; ++p) {
    const float u = position_uniform(7, 0, p);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    const float scaled = u * 16777216.0f;  // exact: u = k * 2^-24
    ASSERT_EQ(scaled, std::floor(scaled)) << "position " << p;
  }
}

// Counts how many of `n` positions give equal uniforms under two (seed, seq_id) pairs. Independent
// 24-bit values collide with probability 2^-24 each, so more than a couple means a dependence.
int count_equal(uint64_t seed_a, uint64_t seq_a, uint64_t seed_b, uint64_t seq_b, uint64_t pos_b0, int n) {
  int eq = 0;
  for (int p = 0; p < n; ++p)
    eq += position_uniform(seed_a, seq_a, uint64_t(p)) == position_uniform(seed_b, seq_b, pos_b0 + uint64_t(p));
  return eq;
}

TEST(PositionUniform, DiffersAcrossSeedsSequencesAndPositions) {
  const int n = 10000;
  EXPECT_LE(count_equal(1, 0, 2, 0, 0, n), 2) << "seed";
  EXPECT_LE(count_equal(1, 0, 1, 1, 0, n), 2) << "seq_id";
  EXPECT_LE(count_equal(1, 0, 1, 0, 1, n), 2) << "position shift by 1";
  // High halves must reach the generator (a truncation to 32 bits would alias these).
  EXPECT_LE(count_equal(1, 0, 1ull | (1ull << 32), 0, 0, n), 2) << "seed high half";
  EXPECT_LE(count_equal(1, 0, 1, 1ull << 32, 0, n), 2) << "seq_id high half";
  EXPECT_LE(count_equal(1, 0, 1, 0, 1ull << 32, n), 2) << "position high half";
  // Swapping the roles of seq_id and position must not give the same stream.
  int eq = 0;
  for (int p = 0; p < n; ++p) eq += position_uniform(5, uint64_t(p), 3) == position_uniform(5, 3, uint64_t(p));
  EXPECT_LE(eq, 3);
}

// Kolmogorov–Smirnov against U[0,1). Threshold from the Dvoretzky–Kiefer–Wolfowitz inequality with
// Massart's constant, P(D_n > eps) <= 2 exp(-2 n eps^2), at a false-positive bound of 1e-9.
TEST(PositionUniform, IsUniformByKolmogorovSmirnov) {
  const int n = 100000;
  const double eps = std::sqrt(std::log(2.0 / 1e-9) / (2.0 * n));
  for (uint64_t seq : {0ull, 77ull}) {
    std::vector<double> u(n);
    for (int p = 0; p < n; ++p) u[p] = position_uniform(0xC0FFEE, seq, uint64_t(p));
    std::sort(u.begin(), u.end());
    double d = 0.0;
    for (int i = 0; i < n; ++i) d = std::max({d, (i + 1.0) / n - u[i], u[i] - double(i) / n});
    EXPECT_LT(d, eps) << "seq " << seq;
  }
}

// Every one of the 24 bits is set half the time, and consecutive positions are not ordered more
// often than chance. Hoeffding: P(|mean - 1/2| > eps) <= 2 exp(-2 n eps^2); eps at a 1e-9 bound.
TEST(PositionUniform, BitsAndNeighboursAreBalanced) {
  const int n = 100000;
  const double eps = std::sqrt(std::log(2.0 / 1e-9) / (2.0 * n));
  int ones[24] = {};
  for (int p = 0; p < n; ++p) {
    const uint32_t k = uint32_t(position_uniform(31337, 2, uint64_t(p)) * 16777216.0f);
    for (int b = 0; b < 24; ++b) ones[b] += (k >> b) & 1u;
  }
  for (int b = 0; b < 24; ++b) EXPECT_LT(std::abs(double(ones[b]) / n - 0.5), eps) << "bit " << b;
  int rising = 0;  // disjoint pairs, so the n trials are independent
  for (int i = 0; i < n; ++i)
    rising += position_uniform(31337, 2, 2 * uint64_t(i)) < position_uniform(31337, 2, 2 * uint64_t(i) + 1);
  EXPECT_LT(std::abs(double(rising) / n - 0.5), eps);
}

}  // namespace
