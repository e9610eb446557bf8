// A DDTree round kept on the device (the engine's step over the CudaTarget, draft_top_k.h): the
// device top-k of draft logits against the CPU tree builder's own draft_top_k (the reference it
// must equal bit for bit:
// ids, fp32 log-probabilities, valid counts, errors), including forced ties, ±0, −inf tails, NaN
// / +inf rows and a 163840-token vocabulary; then whole generations — the device round paths ==
// the host paths == AR on the GPU, tokens, logits and acceptance, with the GPU DFlash drafter,
// the CPU DFlash drafter and the synthetic drafter, greedy and sampled, budgets 1 / 4 / 16 and
// the DFlash chain.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/dflash_cuda.h"
#include "engine/generate.h"
#include "model/deepseek_v3_cuda.h"
#include "backend/cuda/draft_top_k.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/make_drafter.h"
#include "decode/dflash_drafter.h"
#include "decode/synthetic_drafter.h"
#include "decode/tree.h"
#include "gpu_test_util.h"


namespace kd {
namespace {

using gpu_test::fixture;

namespace fs = std::filesystem;

constexpr float kInf = std::numeric_limits<float>::infinity();


// The device result for host logits [rows, vocab] (uploaded), or the error text.
struct Outcome {
  DraftTopK top;
  std::string error;
};
Outcome device_top_k(DeviceDraftTopK& d, const std::vector<float>& logits, int64_t rows, int64_t vocab, int64_t k) {
  float* dev = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), logits.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dev, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  Outcome o;
  try {
    o.top = d.run(dev, rows, vocab, k, nullptr);
  } catch (const Error& e) {
    o.error = e.what();
  }
  cudaFree(dev);
  return o;
}
Outcome host_top_k(const std::vector<float>& logits, int64_t rows, int64_t vocab, int64_t k) {
  Outcome o;
  try {
    o.top = draft_top_k(logits.data(), rows, vocab, k);
  } catch (const Error& e) {
    o.error = e.what();
  }
  return o;
}

void expect_same(const Outcome& got, const Outcome& ref, const std::string& what) {
  EXPECT_EQ(got.error, ref.error) << what;
  if (!ref.error.empty()) return;
  EXPECT_EQ(got.top.positions, ref.top.positions) << what;
  EXPECT_EQ(got.top.k, ref.top.k) << what;
  EXPECT_EQ(got.top.ids, ref.top.ids) << what;
  EXPECT_EQ(got.top.valid, ref.top.valid) << what;
  ASSERT_EQ(got.top.logp.size(), ref.top.logp.size()) << what;
  for (size_t i = 0; i < ref.top.logp.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(got.top.logp[i]), std::bit_cast<uint32_t>(ref.top.logp[i]))
        << what << " entry " << i << ": " << got.top.logp[i] << " vs " << ref.top.logp[i];
}

// Rows built to stress the order and the normaliser; vocab 1000.
std::vector<float> stress_rows(int64_t V, int64_t* rows) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> x;
  auto row = [&](auto&& f) {
    for (int64_t v = 0; v < V; ++v) x.push_back(f(v));
  };
  row([&](int64_t) { return nd(rng); });                                        // plain
  row([&](int64_t v) { return float(int((v * 7919) % 5)) - 2.0f; });            // 5 levels: ties everywhere
  row([&](int64_t v) { return v % 3 == 0 ? 0.0f : (v % 3 == 1 ? -0.0f : -1.0f); });  // ±0 tie at the top
  row([&](int64_t v) { return v < 5 ? float(v) : -kInf; });                     // 5 finite, −inf tail (valid < k)
  row([&](int64_t v) { return v == 777 ? 40.0f : nd(rng); });                   // one dominant token
  row([&](int64_t v) { return v == 10 || v == 500 ? 3.0f : nd(rng) - 10.0f; });  // top tie, lower id first
  row([&](int64_t) { return 1.0f; });                                           // flat
  *rows = int64_t(x.size()) / V;
  return x;
}

TEST(DeviceDraftTopK, EqualsCpuBuilderBitwiseWithTies) {
  REQUIRE_GPU();
  DeviceDraftTopK d;
  // 1030: a second, short chunk (6 tokens) that runs out before k; 129 and V: the unchunked path.
  for (int64_t V : {int64_t(1000), int64_t(1030)}) {
    int64_t rows = 0;
    const std::vector<float> x = stress_rows(V, &rows);
    for (int64_t k : {int64_t(1), int64_t(4), int64_t(16), int64_t(64), int64_t(128), int64_t(129), V})
      expect_same(device_top_k(d, x, rows, V, k), host_top_k(x, rows, V, k), cat("V = ", V, ", k = ", k));
  }
  std::printf("  %lld rows, %lld resolved from a full row\n", (long long)d.rows_done(), (long long)d.fallback_rows());
}

// K2's vocabulary, logits like a drafter's (a peaked head over a wide tail): every row resolves
// from the bounds (no full-row download), bit-identical to the CPU.
TEST(DeviceDraftTopK, LargeVocabularyResolvesOnDevice) {
  REQUIRE_GPU();
  const int64_t V = 163840, rows = 15;
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(-4.0f, 2.5f);
  std::vector<float> x(static_cast<size_t>(rows * V));
  for (float& v : x) v = nd(rng);
  for (int64_t p = 0; p < rows; ++p) {
    x[size_t(p * V + (p * 104729) % V)] = 9.0f + float(p) * 0.25f;  // a likely top token
    x[size_t(p * V + (p * 7) % V)] = 7.5f;
  }
  DeviceDraftTopK d;
  for (int64_t k : {int64_t(1), int64_t(16), int64_t(200)})  // 200: the unchunked path
    expect_same(device_top_k(d, x, rows, V, k), host_top_k(x, rows, V, k), cat("k = ", k));
  EXPECT_EQ(d.fallback_rows(), 0) << "the bounds should pin every float of these rows";

  // Cost per round at K2's shape (informational): the device pass + 2.3 KB download vs today's
  // 9.8 MB download + host build.
  float* dev = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), x.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<float> host(x.size());
  auto ms = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int64_t k : {int64_t(1), int64_t(16), int64_t(64), int64_t(200)}) {
    d.run(dev, rows, V, k, nullptr);  // warm
    const double dev_ms = ms([&] { d.run(dev, rows, V, k, nullptr); });
    const double host_ms = ms([&] {
      ASSERT_EQ(cudaMemcpy(host.data(), dev, x.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      (void)draft_top_k(host.data(), rows, V, k);
    });
    std::printf("  15 × 163840, k = %lld: device top-k %.3f ms; download + host top-k %.3f ms\n", (long long)k, dev_ms, host_ms);
  }
  cudaFree(dev);
}

// Confident rows (top probability 1 − 1e-2 … 1 − 1e-7): still bit-identical; how many need the
// full-row fallback is printed (the bounds' width, ~1e-13, meets the float spacing of a logp
// near 0 only for the most confident rows).
TEST(DeviceDraftTopK, ConfidentRowsStayExact) {
  REQUIRE_GPU();
  const int64_t V = 163840, rows = 12;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * V));
  for (int64_t p = 0; p < rows; ++p) {
    // margin m over a tail of V tokens near 0: p_top ≈ 1 / (1 + V e^-m).
    const float margin = 16.0f + 1.2f * float(p);
    for (int64_t v = 0; v < V; ++v) x[size_t(p * V + v)] = nd(rng) * 0.5f;
    x[size_t(p * V + 31 * p + 3)] = margin;
  }
  DeviceDraftTopK d;
  expect_same(device_top_k(d, x, rows, V, 8), host_top_k(x, rows, V, 8), "confident rows");
  std::printf("  %lld confident rows, %lld resolved from a full row\n", (long long)rows, (long long)d.fallback_rows());
}

// The warp-wide adder of the normaliser bounds gives the bits of the one-term-at-a-time sum (the
// CPU's order) on rows that exercise it: S starting at 0 (a −inf prefix) or tiny (the max far
// down the row: many binade crossings), subnormal terms (logits spanning 800), flat and peaked rows.
TEST(DeviceDraftTopK, WarpAdderEqualsOneByOne) {
  REQUIRE_GPU();
  std::mt19937 rng(77);
  for (int64_t V : {int64_t(163840), int64_t(5000), int64_t(700)}) {
    std::vector<float> x;
    int64_t rows = 0;
    auto row = [&](auto&& f) {
      for (int64_t v = 0; v < V; ++v) x.push_back(f(v));
      ++rows;
    };
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::uniform_real_distribution<float> wide(-800.0f, 0.0f);
    row([&](int64_t) { return nd(rng); });
    row([&](int64_t v) { return v < V / 3 ? -kInf : nd(rng); });
    row([&](int64_t v) { return v == V - 1 ? 30.0f : nd(rng) - float(V - v) * (40.0f / float(V)); });
    row([&](int64_t) { return wide(rng); });
    row([&](int64_t v) { return v == V / 2 ? 60.0f : nd(rng); });
    row([&](int64_t) { return 0.25f; });
    row([&](int64_t v) { return float(v % 17) * 0.5f; });
    DeviceDraftTopK fast, seq;
    seq.set_sequential_sum(true);
    const Outcome a = device_top_k(fast, x, rows, V, 4), b = device_top_k(seq, x, rows, V, 4);
    ASSERT_EQ(fast.last_bounds().size(), size_t(rows));
    for (int64_t p = 0; p < rows; ++p)
      for (int j = 0; j < 2; ++j)
        EXPECT_EQ(std::bit_cast<uint64_t>(fast.last_bounds()[size_t(p)][size_t(j)]),
                  std::bit_cast<uint64_t>(seq.last_bounds()[size_t(p)][size_t(j)]))
            << "V " << V << " row " << p << (j ? " hi " : " lo ") << fast.last_bounds()[size_t(p)][size_t(j)] << " vs "
            << seq.last_bounds()[size_t(p)][size_t(j)];
    const Outcome ref = host_top_k(x, rows, V, 4);
    expect_same(a, ref, cat("warp adder, V ", V));
    expect_same(b, ref, cat("one by one, V ", V));
  }
}

// Bad rows: the same error (text, position, token) as the CPU builder, in position order.
TEST(DeviceDraftTopK, BadRowsGiveTheCpuError) {
  REQUIRE_GPU();
  const int64_t V = 300, rows = 4;
  std::vector<float> base(static_cast<size_t>(rows * V));
  for (size_t i = 0; i < base.size(); ++i) base[i] = float(std::sin(0.1 * double(i)));
  DeviceDraftTopK d;
  struct Bad {
    int64_t row, tok;
    float v;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::vector<Bad>& bads : {std::vector<Bad>{{2, 17, nan}}, std::vector<Bad>{{1, 250, kInf}},
                                       std::vector<Bad>{{3, 5, nan}, {3, 4, kInf}},
                                       std::vector<Bad>{{2, 9, nan}, {1, 299, nan}}}) {
    std::vector<float> x = base;
    for (const Bad& b : bads) x[size_t(b.row * V + b.tok)] = b.v;
    const Outcome ref = host_top_k(x, rows, V, 4);
    ASSERT_FALSE(ref.error.empty());
    expect_same(device_top_k(d, x, rows, V, 4), ref, ref.error);
  }
  std::vector<float> x = base;
  for (int64_t v = 0; v < V; ++v) x[size_t(2 * V + v)] = -kInf;  // no finite logit
  const Outcome ref = host_top_k(x, rows, V, 4);
  ASSERT_NE(ref.error.find("no finite logit"), std::string::npos);
  expect_same(device_top_k(d, x, rows, V, 4), ref, ref.error);
  EXPECT_THROW(d.run(nullptr, rows, V, V + 1, nullptr), Error);  // k past the vocabulary
  EXPECT_THROW(d.run(nullptr, rows, V, 0, nullptr), Error);
}

// A random drafter (make-model --drafter-for) for a target fixture, made once per process.
std::string made_drafter(const std::string& target, int32_t layers, int32_t block) {
  const fs::path dir = fs::temp_directory_path() / cat("kdtree-gpu-round-drafter-", getpid(), "-", target, "-", layers, "-", block);
  if (!fs::exists(dir / "config.json")) make_drafter(fixture(target), dir.string(), 7, layers, block, /*force=*/true);
  return dir.string();
}

// The GPU drafter's device top-k equals the host builder's over draft()'s downloaded logits.
TEST(DeviceDraftTopK, GpuDrafterTopKEqualsHostOverItsLogits) {
  REQUIRE_GPU();
  const std::string dir = made_drafter("k2-int4", 2, 8);
  Checkpoint ck(fixture("k2-int4"));
  DeepseekV3 model(ck);
  const int64_t V = model.config().vocab_size;
  CudaTarget t(model, 64);
  CudaDFlash g(dir, t, 64);
  std::vector<float> taps(static_cast<size_t>(12 * int64_t(g.tap_layers().size()) * model.config().hidden_size));
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(std::cos(0.21 * double(i)));
  g.append_context(taps.data(), 12);
  const int64_t B = g.block_size();
  std::vector<float> logits(static_cast<size_t>((B - 1) * V));
  for (int32_t bonus : {3, 41}) {
    g.draft(bonus, 12, logits.data());  // a repeated draft computes the same bits
    for (int64_t L : {B - 1, int64_t(3)})
      for (int64_t k : {int64_t(1), int64_t(16)}) {
        Outcome got;
        got.top = g.draft_top_k(bonus, 12, L, k);
        expect_same(got, host_top_k(logits, L, V, k), cat("bonus ", bonus, " L ", L, " k ", k));
      }
  }
  EXPECT_THROW(g.draft_top_k(3, 12, B, 1), Error);  // more positions than the block drafts
}

// Whole generations: device round paths == host paths == AR, bit for bit.
struct PathRun {
  SpecResult on, off;
};
template <class MakeDrafter>
PathRun both_paths(CudaTarget& t, MakeDrafter make, const std::vector<int32_t>& prompt, const GenerateOptions& go,
                   const SpecOptions& so) {
  PathRun r;
  auto d1 = make();
  r.on = generate_ddtree(t, *d1, prompt, go, so);
  auto d2 = make();
  SpecOptions host = so;
  host.device_top_k = false;
  t.set_device_outputs(false);
  r.off = generate_ddtree(t, *d2, prompt, go, host);
  t.set_device_outputs(true);
  return r;
}

void expect_equal_runs(const PathRun& r, const GenerateResult& ar, bool logits, const std::string& what) {
  EXPECT_EQ(r.on.gen.output_ids, ar.output_ids) << what << ": device path vs AR";
  EXPECT_EQ(r.off.gen.output_ids, ar.output_ids) << what << ": host path vs AR";
  EXPECT_EQ(r.on.stats.rounds, r.off.stats.rounds) << what;
  EXPECT_EQ(r.on.stats.accepted, r.off.stats.accepted) << what;
  EXPECT_EQ(r.on.stats.drafted, r.off.stats.drafted) << what << ": trees differ";
  EXPECT_EQ(r.on.stats.tau_histogram, r.off.stats.tau_histogram) << what;
  EXPECT_EQ(r.on.gen.finish_reason, ar.finish_reason) << what;
  if (!logits) {
    EXPECT_TRUE(r.on.gen.logits.empty());
    return;
  }
  for (const SpecResult* s : {&r.on, &r.off}) {
    ASSERT_EQ(s->gen.logits.size(), ar.logits.size()) << what;
    EXPECT_EQ(0, std::memcmp(s->gen.logits.data(), ar.logits.data(), ar.logits.size() * 4))
        << what << (s == &r.on ? ": device path" : ": host path") << " logits differ from AR's";
  }
}

TEST(CudaRound, DevicePathsEqualHostPathsAndAr) {
  REQUIRE_GPU();
  struct Case {
    const char* target;
    std::string drafter;
  };
  for (const Case& k : {Case{"k2-bf16", fixture("dflash-rope")}, Case{"k2-int4", made_drafter("k2-int4", 2, 8)}}) {
    Checkpoint ck(fixture(k.target));
    DeepseekV3 model(ck);
    const ModelConfig& c = model.config();
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < 7; ++i) prompt.push_back(int32_t((i * 37 + 11) % c.vocab_size));
    CudaTarget t(model, 160);
    for (float temp : {0.0f, 0.8f})
      for (bool keep : {true, false}) {
        GenerateOptions go;
        go.max_new_tokens = 40;
        go.ignore_eos = true;
        go.keep_logits = keep;
        go.sampling.temperature = temp;
        go.sampling.seed = 3;
        const GenerateResult ar = generate_ar(t, prompt, go);
        std::vector<int32_t> truth = prompt;
        truth.insert(truth.end(), ar.output_ids.begin(), ar.output_ids.end());
        for (int64_t budget : {0, 1, 4, 16}) {  // 0: the DFlash chain
          SpecOptions so;
          so.chain = budget == 0;
          so.budget = budget;
          const std::string what = cat(k.target, " T=", temp, " keep_logits ", keep, " budget ", budget);
          const PathRun gpu = both_paths(t, [&] { return std::make_unique<CudaDFlash>(k.drafter, t, 128); }, prompt, go, so);
          expect_equal_runs(gpu, ar, keep, what + " GPU drafter");
          const PathRun cpu = both_paths(t, [&] { return std::make_unique<DFlashAdapter>(k.drafter, model, 128); }, prompt, go, so);
          expect_equal_runs(cpu, ar, keep, what + " CPU drafter");
          const PathRun syn = both_paths(
              t, [&] { return std::make_unique<SyntheticDrafter>(truth, std::vector<double>{0.6, 0.2}, 6, c.vocab_size, 9); },
              prompt, go, so);
          expect_equal_runs(syn, ar, keep, what + " synthetic drafter");
          EXPECT_GT(syn.on.stats.accepted, 0) << what;
          std::printf("  %s: GPU drafter rounds %lld accepted %lld; CPU drafter rounds %lld; synthetic accepted %lld\n",
                      what.c_str(), (long long)gpu.on.stats.rounds, (long long)gpu.on.stats.accepted,
                      (long long)cpu.on.stats.rounds, (long long)syn.on.stats.accepted);
        }
      }
  }
}

// AR greedy without kept logits picks each step's token on the device: the same tokens, stop and
// finish reason as the host path, graphed and launched, across the fixtures' configurations.
TEST(CudaRound, ArDevicePickEqualsHostPick) {
  REQUIRE_GPU();
  for (const char* target : {"k2-bf16", "dsv3-group", "k2-int4", "k25-sharded"}) {
    Checkpoint ck(fixture(target));
    DeepseekV3 model(ck);
    const ModelConfig& c = model.config();
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < 5; ++i) prompt.push_back(int32_t((i * 29 + 3) % c.vocab_size));
    for (bool graphs : {true, false}) {
      CudaTarget t(model, 64);
      t.set_graphs(graphs);
      GenerateOptions go;
      go.max_new_tokens = 30;
      go.ignore_eos = true;
      const GenerateResult on = generate_ar(t, prompt, go);
      t.set_device_outputs(false);
      const GenerateResult off = generate_ar(t, prompt, go);
      t.set_device_outputs(true);
      go.keep_logits = true;  // the host path whatever the option: an independent second reference
      const GenerateResult kept = generate_ar(t, prompt, go);
      EXPECT_EQ(on.output_ids, off.output_ids) << target << " graphs " << graphs;
      EXPECT_EQ(on.output_ids, kept.output_ids) << target << " graphs " << graphs;
      EXPECT_EQ(on.finish_reason, off.finish_reason);
      EXPECT_EQ(on.decode_weight_bytes, off.decode_weight_bytes) << target;
      EXPECT_TRUE(on.logits.empty());
    }
  }
}

// The greedy device walk meets a stop id mid-tree: it stops there, as the host walk does.
TEST(CudaRound, StopIdInsideAnAcceptedPath) {
  REQUIRE_GPU();
  Checkpoint ck(fixture("k2-int4"));
  DeepseekV3 model(ck);
  const ModelConfig& c = model.config();
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < 6; ++i) prompt.push_back(int32_t((i * 53 + 5) % c.vocab_size));
  CudaTarget t(model, 128);
  GenerateOptions go;
  go.max_new_tokens = 32;
  go.keep_logits = true;
  const GenerateResult full = generate_ar(t, prompt, go);
  ASSERT_GE(full.output_ids.size(), size_t(12));
  go.stop_ids = {full.output_ids[9]};
  const GenerateResult ar = generate_ar(t, prompt, go);
  ASSERT_EQ(ar.finish_reason, "stop");
  std::vector<int32_t> truth = prompt;
  truth.insert(truth.end(), full.output_ids.begin(), full.output_ids.end());
  SpecOptions so;
  so.budget = 8;
  const PathRun r = both_paths(
      t, [&] { return std::make_unique<SyntheticDrafter>(truth, std::vector<double>{1.0}, 6, c.vocab_size, 1); }, prompt, go, so);
  expect_equal_runs(r, ar, true, "stop id");
}

}  // namespace
}  // namespace kd
