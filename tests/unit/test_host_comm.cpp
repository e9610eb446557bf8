// The host communicator (backend/cpu/host_comm.h) keeps comm.h's exactness contract: a row's reduced
// value is its partials summed in rank order in fp32 — bit for bit the serial sum below, on every rank,
// whether the row travels alone or among 17 or 64 — for R = 1/2/4/8; calls repeat without deadlock; ranks
// that disagree, or a rank that stops early, produce an Error on every rank instead of a hang.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/host_comm.h"
#include "core/error.h"

namespace kd {
namespace {

constexpr int64_t kRowLen = 96;

// Partials whose sum depends on the order of addition: magnitudes from 1e-4 to 1e4, both signs.
std::vector<float> partials(int32_t rank, int64_t n_rows, uint32_t seed) {
  std::mt19937 rng(seed * 7919u + uint32_t(rank));
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-4, 4);
  std::vector<float> v(size_t(n_rows * kRowLen));
  for (float& x : v) x = mant(rng) * std::pow(10.0f, float(expo(rng)));
  return v;
}

// The reference: ((p0 + p1) + p2) + … serially, element by element.
std::vector<float> serial_rank_order_sum(const std::vector<std::vector<float>>& p) {
  std::vector<float> s = p[0];
  for (size_t r = 1; r < p.size(); ++r)
    for (size_t i = 0; i < s.size(); ++i) s[i] += p[r][i];
  return s;
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

class HostCommRanks : public ::testing::TestWithParam<int32_t> {};

TEST_P(HostCommRanks, AllReduceEqualsSerialRankOrderSumBitwiseOnEveryRank) {
  const int32_t R = GetParam();
  const int64_t n_rows = 64;
  std::vector<std::vector<float>> p;
  for (int32_t r = 0; r < R; ++r) p.push_back(partials(r, n_rows, 1));
  const std::vector<float> want = serial_rank_order_sum(p);
  if (R >= 4) {  // the data can tell orders apart: summing in reverse changes some bits
    std::vector<float> rev = p[size_t(R - 1)];
    for (int32_t r = R - 2; r >= 0; --r)
      for (size_t i = 0; i < rev.size(); ++i) rev[i] += p[size_t(r)][i];
    ASSERT_FALSE(same_bits(rev.data(), want.data(), want.size()));
  }
  std::vector<std::vector<float>> got(static_cast<size_t>(R));
  run_host_ranks(R, [&](Comm& c) {
    ASSERT_EQ(c.size(), R);
    std::vector<float> buf = p[size_t(c.rank())];
    c.all_reduce_sum(buf.data(), n_rows, kRowLen);
    got[size_t(c.rank())] = std::move(buf);
  });
  for (int32_t r = 0; r < R; ++r) EXPECT_TRUE(same_bits(got[size_t(r)].data(), want.data(), want.size())) << "rank " << r;
}

TEST_P(HostCommRanks, ARowReducesToTheSameBitsAloneOrInABatchOf1_17_64) {
  const int32_t R = GetParam();
  const int64_t n_max = 64;
  std::vector<std::vector<float>> p;
  for (int32_t r = 0; r < R; ++r) p.push_back(partials(r, n_max, 2));
  // Row `k` of the 64 travels alone, at the end of a batch of 17 (rows k−16 … k) and among all 64.
  for (int64_t k : {int64_t(0), int64_t(16), int64_t(40), int64_t(63)}) {
    std::vector<std::vector<float>> alone(static_cast<size_t>(R)), in17(static_cast<size_t>(R)), in64(static_cast<size_t>(R));
    const int64_t b17 = std::max<int64_t>(0, k - 16), n17 = std::min<int64_t>(17, n_max - b17);
    run_host_ranks(R, [&](Comm& c) {
      const auto& mine = p[size_t(c.rank())];
      std::vector<float> a(mine.begin() + k * kRowLen, mine.begin() + (k + 1) * kRowLen);
      c.all_reduce_sum(a.data(), 1, kRowLen);
      std::vector<float> b(mine.begin() + b17 * kRowLen, mine.begin() + (b17 + n17) * kRowLen);
      c.all_reduce_sum(b.data(), n17, kRowLen);
      std::vector<float> d = mine;
      c.all_reduce_sum(d.data(), n_max, kRowLen);
      alone[size_t(c.rank())] = std::move(a);
      in17[size_t(c.rank())] = std::move(b);
      in64[size_t(c.rank())] = std::move(d);
    });
    for (int32_t r = 0; r < R; ++r) {
      const float* row_alone = alone[size_t(r)].data();
      EXPECT_TRUE(same_bits(row_alone, in17[size_t(r)].data() + (k - b17) * kRowLen, kRowLen)) << "row " << k << " rank " << r;
      EXPECT_TRUE(same_bits(row_alone, in64[size_t(r)].data() + k * kRowLen, kRowLen)) << "row " << k << " rank " << r;
      EXPECT_TRUE(same_bits(row_alone, alone[0].data(), kRowLen)) << "row " << k << ": rank " << r << " differs from rank 0";
    }
  }
}

TEST_P(HostCommRanks, AllGatherPlacesRankRsBytesAtR) {
  const int32_t R = GetParam();
  std::vector<std::vector<int64_t>> got(static_cast<size_t>(R));
  run_host_ranks(R, [&](Comm& c) {
    const int64_t mine[3] = {c.rank(), 100 + c.rank(), -c.rank()};
    std::vector<int64_t> all(size_t(3 * R));
    c.all_gather(mine, sizeof mine, all.data());
    got[size_t(c.rank())] = all;
  });
  for (int32_t r = 0; r < R; ++r)
    for (int32_t q = 0; q < R; ++q) {
      EXPECT_EQ(got[size_t(r)][size_t(3 * q)], q);
      EXPECT_EQ(got[size_t(r)][size_t(3 * q + 1)], 100 + q);
      EXPECT_EQ(got[size_t(r)][size_t(3 * q + 2)], -q);
    }
}

TEST_P(HostCommRanks, ThousandRoundsOfMixedCallsNeitherDeadlockNorDrift) {
  const int32_t R = GetParam();
  std::atomic<int64_t> bad{0};
  run_host_ranks(R, [&](Comm& c) {
    for (int round = 0; round < 1000; ++round) {
      // Small integers: every order gives the exact sum, so each rank can check the result itself.
      const int64_t n_rows = 1 + round % 5, len = 1 + round % 7;
      std::vector<float> v(size_t(n_rows * len));
      for (size_t i = 0; i < v.size(); ++i) v[i] = float(c.rank() + 1) * float(i + size_t(round));
      c.all_reduce_sum(v.data(), n_rows, len);
      const float ranks_sum = float(R * (R + 1) / 2);
      for (size_t i = 0; i < v.size(); ++i)
        if (v[i] != ranks_sum * float(i + size_t(round))) ++bad;
      const int32_t mine = round * 31 + c.rank();
      std::vector<int32_t> all(static_cast<size_t>(R));
      c.all_gather(&mine, sizeof mine, all.data());
      for (int32_t q = 0; q < R; ++q)
        if (all[size_t(q)] != round * 31 + q) ++bad;
      if (round % 10 == 0) c.barrier();
    }
  });
  EXPECT_EQ(bad.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(R, HostCommRanks, ::testing::Values(1, 2, 4, 8));

TEST(HostComm, MismatchedSizesAreAnErrorOnEveryRankNamingEachRanksSizes) {
  std::vector<std::string> errors(2);
  run_host_ranks(2, [&](Comm& c) {
    std::vector<float> v(32, 1.0f);
    try {
      c.all_reduce_sum(v.data(), c.rank() == 0 ? 2 : 3, 8);
    } catch (const Error& e) {
      errors[size_t(c.rank())] = e.what();
    }
    // Both ranks failed the same call, so they are still in step.
    c.all_reduce_sum(v.data(), 4, 8);
    EXPECT_EQ(v[0], 2.0f);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0 all_reduce_sum of 2 rows × 8 fp32"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 1 all_reduce_sum of 3 rows × 8 fp32"), std::string::npos) << e;
  }
  EXPECT_EQ(errors[0], errors[1]);
}

TEST(HostComm, ReduceAgainstGatherIsAnErrorNotAHang) {
  try {
    run_host_ranks(4, [](Comm& c) {
      float v[4] = {};
      if (c.rank() == 2) c.all_gather(v, sizeof v, v);
      else c.all_reduce_sum(v, 1, 4);
    });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 2 all_gather of 16 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 3 all_reduce_sum of 1 rows × 4 fp32"), std::string::npos) << m;
  }
}

TEST(HostComm, ARankThatThrowsReleasesTheOthersWithItsError) {
  try {
    run_host_ranks(4, [](Comm& c) {
      if (c.rank() == 1) throw Error("rank one failed to load its slice");
      float v[8] = {};
      c.all_reduce_sum(v, 2, 4);
    });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank one failed to load its slice");  // the cause, not the others' reports
  }
}

TEST(HostComm, ARankThatMakesFewerCallsIsAnErrorForTheOthers) {
  std::atomic<int> left_errors{0};
  run_host_ranks(3, [&](Comm& c) {
    if (c.rank() == 0) return;
    try {
      c.barrier();
    } catch (const Error& e) {
      if (std::string(e.what()).find("rank 0 of 3 left the group (returned)") != std::string::npos) ++left_errors;
    }
  });
  EXPECT_EQ(left_errors.load(), 2);
}

TEST(HostComm, GroupOfZeroRanksIsRefused) { EXPECT_THROW(HostCommGroup(0), Error); }

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// The kept rank threads of a tensor-parallel target: run after run on the same threads, a run whose
// rank throws fails with that rank's error and leaves the threads usable for the next run.
TEST(HostComm, KeptRankThreadsServeRunAfterRunAndSurviveAFailure) {
  HostRankThreads threads(4);
  for (int run = 0; run < 50; ++run) {
    std::vector<float> got(4);
    threads.run([&](Comm& c) {
      float v = float(c.rank() + run);
      c.all_reduce_sum(&v, 1, 1);
      got[size_t(c.rank())] = v;
    });
    for (float v : got) ASSERT_EQ(v, float(4 * run + 6)) << "run " << run;
    if (run % 10 == 3) {
      try {
        threads.run([&](Comm& c) {
          if (c.rank() == 2) fail("rank 2 stops");
          float v = 1;
          c.all_reduce_sum(&v, 1, 1);
        });
        FAIL() << "a rank threw and run returned";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("rank 2 stops"), std::string::npos) << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace kd
