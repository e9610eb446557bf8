// The device tree build (backend/cuda/tree_build.h) against the host builder it must equal
// (decode/tree.h build_draft_tree, then make_round for positions and mask), node for node and bit
// for bit: random top-k of every shape the round takes (budget 1…1024, positions 1…15 and 63,
// K < budget), tie-heavy ones (dyadic log-probs whose sums are exact, so σ ties everywhere and the
// rank-tuple rule decides; ±0; −inf tails and a row with nothing finite; unsorted rows, where the
// frontier is not monotone), the host's own draft_top_k over quantised logits, and the GPU DFlash
// drafter's device top-k on the fixtures. The timing table is printed, never asserted.
// KDTREE_TREE_QUICK=1 / 2 (compute-sanitizer's memcheck / racecheck) keep subsets of the random shapes.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/draft_top_k.h"
#include "backend/cuda/tree_build.h"
#include "core/error.h"
#include "decode/round.h"
#include "decode/tree.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/deepseek_v3_cuda.h"
#include "model/dflash_cuda.h"
#include "model/make_drafter.h"
#include "gpu_test_util.h"

namespace kd {
namespace {

using gpu_test::fixture;
namespace fs = std::filesystem;
constexpr float kInf = std::numeric_limits<float>::infinity();

// 0: every shape; 1: a subset (memcheck); 2: a smaller one (racecheck instruments every shared access).
int quick_level() {
  const char* e = std::getenv("KDTREE_TREE_QUICK");
  return e && *e ? std::atoi(e) : 0;
}
bool quick() { return quick_level() > 0; }

// "" when the device tree equals the host round; else the first difference.
std::string diff(const DeviceTreeHost& got, const DraftRound& want) {
  const DraftTree& t = want.tree;
  const size_t n = size_t(t.size());
  if (got.tokens.size() != n) return cat("size ", got.tokens.size(), " != host ", n);
  for (size_t i = 0; i < n; ++i) {
    if (got.tokens[i] != t.tokens[i]) return cat("node ", i, ": token ", got.tokens[i], " != ", t.tokens[i]);
    if (got.depths[i] != t.depths[i]) return cat("node ", i, ": depth ", got.depths[i], " != ", t.depths[i]);
    if (got.parents[i] != t.parents[i]) return cat("node ", i, ": parent ", got.parents[i], " != ", t.parents[i]);
    if (got.ranks[i] != t.ranks[i]) return cat("node ", i, ": rank ", got.ranks[i], " != ", t.ranks[i]);
    if (std::bit_cast<uint64_t>(got.scores[i]) != std::bit_cast<uint64_t>(t.scores[i]))
      return cat("node ", i, ": score ", got.scores[i], " != ", t.scores[i], " (bits)");
    if (got.rope_pos[i] != want.positions[i]) return cat("node ", i, ": position ", got.rope_pos[i], " != ", want.positions[i]);
  }
  for (size_t e = 0; e < n * n; ++e)
    if (got.visibility[e] != want.visibility[e]) return cat("mask (", e / n, ", ", e % n, "): ", int(got.visibility[e]), " != ", int(want.visibility[e]));
  return "";
}

enum class Mode { normal, ties, peaky, unsorted, from_logits };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::normal: return "normal";
    case Mode::ties: return "ties";
    case Mode::peaky: return "peaky";
    case Mode::unsorted: return "unsorted";
    case Mode::from_logits: return "from-logits";
  }
  return "?";
}

// A top-k in DraftTopK's contract (ranks < valid finite, the rest −inf; no NaN), or for
// from_logits the host's draft_top_k itself over quantised logits with −inf entries.
DraftTopK make_top_k(Mode mode, int64_t P, int64_t K, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (mode == Mode::from_logits) {
    const int64_t V = std::max<int64_t>(K, 300);
    std::vector<float> x(size_t(P * V));
    for (auto& v : x) v = u(rng) < 0.1 ? -kInf : float(int(u(rng) * 6)) * 0.5f;  // six levels: ties
    for (int64_t p = 0; p < P; ++p) x[size_t(p * V + int64_t(u(rng) * double(V)))] = 2.0f;  // a finite logit a row
    return draft_top_k(x.data(), P, V, K);
  }
  DraftTopK t;
  t.positions = P, t.k = K;
  t.ids.resize(size_t(P * K));
  t.logp.resize(size_t(P * K));
  t.valid.resize(size_t(P));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  static const float levels[] = {0.0f, -0.0f, -0.25f, -0.5f, -0.5f, -1.0f, -1.0f, -2.0f, -4.0f};
  for (int64_t p = 0; p < P; ++p) {
    float* row = &t.logp[size_t(p * K)];
    for (int64_t r = 0; r < K; ++r) {
      t.ids[size_t(p * K + r)] = int32_t(u(rng) * 163840);
      switch (mode) {
        case Mode::ties: row[r] = levels[size_t(u(rng) * 9)]; break;
        case Mode::peaky: row[r] = r == 0 ? -float(u(rng) * 1e-3) : -6.0f - std::fabs(nd(rng)) * 3.0f; break;
        default: row[r] = -std::fabs(nd(rng)) * 2.0f - float(u(rng)); break;
      }
    }
    if (mode != Mode::unsorted)
      std::sort(row, row + K, [](float a, float b) { return a > b; });
    int64_t valid = K;
    if (u(rng) < 0.3) valid = int64_t(u(rng) * double(K + 1));      // a −inf tail, sometimes all of it
    if (mode == Mode::peaky || (p == 0 && valid == 0)) valid = std::max<int64_t>(valid, 1);
    for (int64_t r = valid; r < K; ++r) row[r] = -kInf;
    t.valid[size_t(p)] = valid;
  }
  return t;
}

std::vector<int64_t> budgets() {
  if (quick_level() >= 2) return {1, 17, 257, 1024};
  if (quick()) return {1, 3, 17, 64, 129, 257, 1024};
  return {1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 1023, 1024};
}

// Every shape and input family: the device tree == the host builder's, bit for bit.
TEST(GpuDraftTree, RandomAndTieHeavyTopKEqualTheHostBuilder) {
  REQUIRE_GPU();
  std::mt19937 rng(20261107);
  DeviceDraftTree dev;
  cudaStream_t s = nullptr;
  int cases = 0;
  std::vector<int64_t> positions;
  for (int64_t p = 1; p <= 15; ++p) positions.push_back(p);
  positions.push_back(63);
  if (quick()) positions = quick_level() >= 2 ? std::vector<int64_t>{3, 15, 63} : std::vector<int64_t>{1, 2, 7, 15, 63};
  for (int64_t B : budgets())
    for (int64_t P : positions)
      for (Mode mode : {Mode::normal, Mode::ties, Mode::peaky, Mode::unsorted, Mode::from_logits}) {
        if (quick() && (mode == Mode::normal || mode == Mode::peaky) && P != 15) continue;
        // K: the round's (= budget), one, and a random K < budget.
        const int64_t pick = int64_t(rng() % 3);
        const int64_t K = pick == 0 ? B : pick == 1 ? 1 : 1 + int64_t(rng() % uint32_t(B));
        const DraftTopK top = make_top_k(mode, P, K, rng);
        const int32_t bonus = int32_t(rng() % 163840);
        const int64_t start = int64_t(rng() % 4096);
        const DraftRound want = make_round(build_draft_tree(top, B), bonus, start);
        dev.build(top, B, bonus, start, s);
        const std::string d = diff(dev.download(s), want);
        ASSERT_EQ(d, "") << "budget " << B << ", positions " << P << ", k " << K << ", " << mode_name(mode);
        ++cases;
      }
  std::printf("device tree == host tree on %d random top-k\n", cases);
}

// Exact σ ties across whole levels (every logp 0 or −1: many rank tuples share σ) and a full
// binary-like frontier: the rank-tuple rule alone orders most pops.
TEST(GpuDraftTree, AllEqualLogpsFollowTheRankTupleOrder) {
  REQUIRE_GPU();
  DeviceDraftTree dev;
  const bool small = quick_level() >= 2;
  for (float v : {0.0f, -0.0f, -1.0f})
    for (int64_t B : small ? std::vector<int64_t>{7, 1024} : std::vector<int64_t>{1, 7, 64, 1024})
      for (int64_t P : small ? std::vector<int64_t>{4, 63} : std::vector<int64_t>{1, 4, 15, 63}) {
        const int64_t K = std::min<int64_t>(B, 40);
        DraftTopK top;
        top.positions = P, top.k = K;
        top.ids.resize(size_t(P * K));
        for (size_t i = 0; i < top.ids.size(); ++i) top.ids[i] = int32_t(i);
        top.logp.assign(size_t(P * K), v);
        top.valid.assign(size_t(P), K);
        const DraftRound want = make_round(build_draft_tree(top, B), 5, 100);
        dev.build(top, B, 5, 100, nullptr);
        ASSERT_EQ(diff(dev.download(nullptr), want), "") << "logp " << v << ", budget " << B << ", positions " << P;
      }
}

TEST(GpuDraftTree, RefusesShapesItDoesNotTake) {
  REQUIRE_GPU();
  DeviceDraftTree dev;
  std::mt19937 rng(1);
  const DraftTopK top = make_top_k(Mode::normal, 3, 4, rng);
  EXPECT_THROW(dev.build(top, 0, 1, 0, nullptr), Error);
  EXPECT_THROW(dev.build(top, 1025, 1, 0, nullptr), Error);
  EXPECT_THROW(dev.build(top, 3, 1, 0, nullptr), Error);  // k > budget
  const DraftTopK deep = make_top_k(Mode::normal, 64, 4, rng);
  EXPECT_THROW(dev.build(deep, 16, 1, 0, nullptr), Error);  // 64 positions
}

// A random drafter (make-model --drafter-for) for a target fixture, made once per process.
std::string made_drafter(const std::string& target, int32_t layers, int32_t block) {
  const fs::path dir = fs::temp_directory_path() / cat("kdtree-gpu-tree-drafter-", getpid(), "-", target, "-", layers, "-", block);
  if (!fs::exists(dir / "config.json")) make_drafter(fixture(target), dir.string(), 7, layers, block, /*force=*/true);
  return dir.string();
}

// The GPU DFlash drafter's own device top-k (the round's input): the fixture drafter (block 4) over
// k2-bf16 and a made one (block 16: 15 positions) over k2-int4, several bonus tokens and budgets.
TEST(GpuDraftTree, GpuDrafterTopKGivesTheHostTree) {
  REQUIRE_GPU();
  struct Case {
    std::string target, drafter;
  };
  const std::vector<Case> cases = {{"k2-bf16", fixture("dflash-rope")}, {"k2-int4", made_drafter("k2-int4", 1, 16)}};
  DeviceDraftTree dev;
  int trees = 0;
  for (const Case& c : cases) {
    Checkpoint ck(fixture(c.target));
    DeepseekV3 model(ck);
    CudaTarget t(model, 64);
    CudaDFlash g(c.drafter, t, 64);
    std::vector<float> taps(static_cast<size_t>(12 * int64_t(g.tap_layers().size()) * model.config().hidden_size));
    for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(std::sin(0.37 * double(i)));
    g.append_context(taps.data(), 12);
    const int64_t L = g.block_size() - 1;
    for (int32_t bonus : {3, 41, 200, 511})
      for (int64_t B : {int64_t(1), int64_t(8), int64_t(16), int64_t(64), int64_t(128), int64_t(512), int64_t(1024)}) {
        const int64_t k = std::min<int64_t>(B, kMaxDeviceTopK);
        const DraftTopK top = g.draft_top_k(bonus, 12, L, k);
        const DraftRound want = make_round(build_draft_tree(top, B), bonus, 12);
        dev.build(top, B, bonus, 12, nullptr);
        ASSERT_EQ(diff(dev.download(nullptr), want), "") << c.target << ", bonus " << bonus << ", budget " << B;
        ++trees;
      }
  }
  std::printf("device tree == host tree on %d GPU-drafter top-k\n", trees);
}

// Timing (printed): the device build against what it replaces — the host build (build_draft_tree +
// make_round's positions and mask) and the upload of the tree the verify reads (tokens, positions,
// mask; pinned) — at K2's 15 draft positions, k = budget as the round has it.
TEST(GpuDraftTree, TimingAgainstHostBuild) {
  REQUIRE_GPU();
  if (quick()) GTEST_SKIP() << "timing skipped under KDTREE_TREE_QUICK";
  std::mt19937 rng(7);
  const int64_t P = 15, V = 32768;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(P * V));
  for (auto& v : x) v = nd(rng) * 2.5f;  // a draft distribution with a few dominant tokens a row
  std::printf("| budget | positions | k | nodes | depth | kernel µs | pops µs | cycles / node | SM GHz | upload top-k + kernel µs | host build µs | host build + tree upload µs |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t B : {int64_t(16), int64_t(64), int64_t(256), int64_t(1024)}) {
    const DraftTopK top = draft_top_k(x.data(), P, V, B);
    DeviceDraftTree dev;
    dev.build(top, B, 1, 100, nullptr);
    const DeviceTreeHost got = dev.download(nullptr);
    const DraftRound want = make_round(build_draft_tree(top, B), 1, 100);
    ASSERT_EQ(diff(got, want), "");
    // The device top-k stays where DeviceDraftTopK would leave it: upload once, time the kernel.
    gpu_test::DevBuf in(size_t(P * B) * 8 + size_t(P) * 8);
    std::vector<char> h(size_t(P * B) * 8 + size_t(P) * 8);
    std::memcpy(h.data(), top.valid.data(), size_t(P) * 8);
    std::memcpy(h.data() + P * 8, top.ids.data(), size_t(P * B) * 4);
    std::memcpy(h.data() + P * 8 + P * B * 4, top.logp.data(), size_t(P * B) * 4);
    in.up(h.data(), h.size());
    const char* d = in.as<char>();
    const double kernel_us = gpu_test::median_us([&] {
      dev.build(reinterpret_cast<const int32_t*>(d + P * 8), reinterpret_cast<const float*>(d + P * 8 + P * B * 4),
                reinterpret_cast<const int64_t*>(d), P, B, B, 1, 100, nullptr);
    }, 5, 51);
    const auto [pop_cycles, pop_ns] = dev.last_pop_clock(nullptr);
    const double up_kernel_us = gpu_test::median_us([&] { dev.build(top, B, 1, 100, nullptr); }, 5, 51);
    // Host: the build, then its upload (pinned, synchronised: the verify waits for it).
    const int64_t n = want.tree.size();
    void* pin = nullptr;
    cuda::check(cudaMallocHost(&pin, size_t(n * 8 + n * n)), "pinned");
    gpu_test::DevBuf tree_dev(size_t(n * 8 + n * n));
    std::vector<double> host_us, host_up_us;
    for (int rep = 0; rep < 56; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const DraftRound r = make_round(build_draft_tree(top, B), 1, 100);
      const auto t1 = std::chrono::steady_clock::now();
      char* p = static_cast<char*>(pin);
      std::memcpy(p, r.tree.tokens.data(), size_t(n) * 4);
      std::memcpy(p + n * 4, r.positions.data(), size_t(n) * 4);
      std::memcpy(p + n * 8, r.visibility.data(), size_t(n * n));
      cuda::check(cudaMemcpyAsync(tree_dev.p, pin, size_t(n * 8 + n * n), cudaMemcpyHostToDevice, nullptr), "upload tree");
      cuda::check(cudaStreamSynchronize(nullptr), "sync");
      const auto t2 = std::chrono::steady_clock::now();
      if (rep < 5) continue;
      host_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      host_up_us.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
    }
    cudaFreeHost(pin);
    std::sort(host_us.begin(), host_us.end());
    std::sort(host_up_us.begin(), host_up_us.end());
    const int32_t depth = *std::max_element(want.tree.depths.begin(), want.tree.depths.end());
    std::printf("| %lld | %lld | %lld | %lld | %d | %.1f | %.1f | %.0f | %.2f | %.1f | %.1f | %.1f |\n", (long long)B,
                (long long)P, (long long)B, (long long)(n - 1), depth, kernel_us, double(pop_ns) * 1e-3,
                double(pop_cycles) / double(n - 1), double(pop_cycles) / double(pop_ns), up_kernel_us,
                host_us[host_us.size() / 2], host_up_us[host_up_us.size() / 2]);
  }
}

}  // namespace
}  // namespace kd
