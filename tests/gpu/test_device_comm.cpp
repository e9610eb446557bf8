// The device communicators (backend/cuda/device_comm.h) keep comm.h's contract on the GPU: every
// element is the ranks' partials added in rank order, the same bits on every rank, whether a row
// travels alone or among 64 — checked against the host communicator (backend/cpu/host_comm.h, which
// computes the same fp32 chain on the CPU: IEEE adds, no contraction, so the bits must be equal). R = 2,
// 4, 8 ranks share the one GPU (the single-GPU emulation); NCCL runs its one-rank production path.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "backend/cpu/host_comm.h"
#include "backend/cuda/device_comm.h"
#include "core/error.h"
#include "gpu_test_util.h"

namespace kd {
namespace {

using gpu_test::DevBuf;

// Rank r's partials of n values: distinct per rank, with magnitudes that make the add order visible.
std::vector<float> partials(int32_t r, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed * 131 + uint32_t(r));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng) * (r % 2 ? 1e4f : 1e-3f);
  return v;
}

// The host communicator's rank-order sum of the same partials: the reference bits.
std::vector<float> host_sum(int32_t R, int64_t n, uint32_t seed) {
  std::vector<float> out;
  std::mutex mu;
  run_host_ranks(R, [&](Comm& c) {
    std::vector<float> v = partials(c.rank(), n, seed);
    c.all_reduce_sum(v.data(), 1, n);
    std::lock_guard<std::mutex> lk(mu);
    if (c.rank() == 0) out = v;
  });
  return out;
}

TEST(DeviceComm, SharedDeviceSumEqualsHostCommBitsAtEveryR) {
  REQUIRE_GPU();
  const int64_t hid = 7168;  // K2's hidden size: one reduction row
  for (int32_t R : {1, 2, 4, 8}) {
    for (int64_t rows : {int64_t(1), int64_t(17), int64_t(64)}) {
      const int64_t n = rows * hid;
      const std::vector<float> want = host_sum(R, n, 7);
      std::vector<std::vector<float>> got(static_cast<size_t>(R));
      run_device_ranks(R, [&](DeviceComm& c, void* stream) {
        std::vector<float> v = partials(c.rank(), n, 7);
        DevBuf d(size_t(n) * 4);
        d.up(v.data(), size_t(n) * 4);
        c.all_reduce_sum(d.as<float>(), rows, hid, stream);
        cuda::check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "sync");
        cuda::check(cudaMemcpy(v.data(), d.p, size_t(n) * 4, cudaMemcpyDeviceToHost), "download");
        got[size_t(c.rank())] = v;
      });
      for (int32_t r = 0; r < R; ++r)
        ASSERT_EQ(std::memcmp(got[size_t(r)].data(), want.data(), size_t(n) * 4), 0) << "R=" << R << " rows=" << rows << " rank " << r;
    }
  }
}

// A row's reduced bits do not depend on the rows travelling with it (a verify of 17 rows vs an AR
// step of 1): row k of a 64-row reduction == the same row reduced alone.
TEST(DeviceComm, RowInvariance) {
  REQUIRE_GPU();
  const int64_t hid = 7168, rows = 64;
  const int32_t R = 4;
  std::vector<std::vector<float>> batch(R), alone(R);
  run_device_ranks(R, [&](DeviceComm& c, void* stream) {
    const std::vector<float> v = partials(c.rank(), rows * hid, 3);
    DevBuf all(size_t(rows * hid) * 4), one(size_t(hid) * 4);
    all.up(v.data(), v.size() * 4);
    one.up(v.data() + 37 * hid, size_t(hid) * 4);  // row 37 alone
    c.all_reduce_sum(all.as<float>(), rows, hid, stream);
    c.all_reduce_sum(one.as<float>(), 1, hid, stream);
    cuda::check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "sync");
    batch[size_t(c.rank())].resize(size_t(hid));
    alone[size_t(c.rank())].resize(size_t(hid));
    cuda::check(cudaMemcpy(batch[size_t(c.rank())].data(), all.as<float>() + 37 * hid, size_t(hid) * 4, cudaMemcpyDeviceToHost), "dl");
    cuda::check(cudaMemcpy(alone[size_t(c.rank())].data(), one.p, size_t(hid) * 4, cudaMemcpyDeviceToHost), "dl");
  });
  for (int32_t r = 0; r < R; ++r) EXPECT_EQ(std::memcmp(batch[size_t(r)].data(), alone[size_t(r)].data(), size_t(hid) * 4), 0) << r;
}

TEST(DeviceComm, AllGatherAndDisagreementIsAnErrorOnEveryRank) {
  REQUIRE_GPU();
  const int32_t R = 4;
  std::vector<std::vector<int32_t>> got(R);
  run_device_ranks(R, [&](DeviceComm& c, void* stream) {
    const int32_t mine[2] = {c.rank() * 10, c.rank() * 10 + 1};
    DevBuf s(8), r(size_t(R) * 8);
    s.up(mine, 8);
    c.all_gather(s.p, 8, r.p, stream);
    cuda::check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "sync");
    got[size_t(c.rank())].resize(size_t(2 * R));
    cuda::check(cudaMemcpy(got[size_t(c.rank())].data(), r.p, size_t(R) * 8, cudaMemcpyDeviceToHost), "dl");
  });
  for (int32_t r = 0; r < R; ++r)
    for (int32_t q = 0; q < R; ++q) {
      EXPECT_EQ(got[size_t(r)][size_t(2 * q)], q * 10);
      EXPECT_EQ(got[size_t(r)][size_t(2 * q + 1)], q * 10 + 1);
    }
  std::atomic<int> failed{0};
  EXPECT_THROW(run_device_ranks(R, [&](DeviceComm& c, void* stream) {
                 DevBuf d(64 * 4);
                 try {
                   c.all_reduce_sum(d.as<float>(), c.rank() == 2 ? 2 : 1, 16, stream);
                 } catch (const Error&) {
                   ++failed;
                   throw;
                 }
               }),
               Error);
  EXPECT_EQ(failed.load(), R) << "every rank fails the disagreeing call";
}

// NCCL's one-rank path (ncclCommInitAll on this GPU): the all-gather + rank-order sum returns the
// partials themselves; the gather returns the bytes.
TEST(DeviceComm, NcclOneRankProductionPath) {
  REQUIRE_GPU();
  if (!NcclCommGroup::available()) GTEST_SKIP() << "NCCL: " << NcclCommGroup::version();
  std::printf("  NCCL %s\n", NcclCommGroup::version().c_str());
  NcclCommGroup g({0});
  ASSERT_EQ(g.size(), 1);
  DeviceComm& c = g.rank(0);
  cudaStream_t s = nullptr;
  cuda::check(cudaStreamCreate(&s), "stream");
  const int64_t hid = 7168, rows = 17;
  const std::vector<float> v = partials(0, rows * hid, 5);
  DevBuf d(v.size() * 4);
  d.up(v.data(), v.size() * 4);
  c.all_reduce_sum(d.as<float>(), rows, hid, s);
  DevBuf r(v.size() * 4);
  c.all_gather(d.p, v.size() * 4, r.p, s);
  cuda::check(cudaStreamSynchronize(s), "sync");
  std::vector<float> out(v.size()), gathered(v.size());
  cuda::check(cudaMemcpy(out.data(), d.p, v.size() * 4, cudaMemcpyDeviceToHost), "dl");
  cuda::check(cudaMemcpy(gathered.data(), r.p, v.size() * 4, cudaMemcpyDeviceToHost), "dl");
  EXPECT_EQ(std::memcmp(out.data(), v.data(), v.size() * 4), 0);
  EXPECT_EQ(std::memcmp(gathered.data(), v.data(), v.size() * 4), 0);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace kd
