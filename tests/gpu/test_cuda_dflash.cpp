// The DFlash drafter on the GPU (src/model/dflash_cuda.*) against the CPU DFlashDrafter
// (itself checked against python/dflash_reference.py's goldens in tests/unit/test_dflash.cpp); DDTree
// with it == AR on the GPU is tests/gpu/test_cuda_round.cpp's.
//
// Tolerance for draft logits: max |Δ| / max |ref| ≤ 1e-4, the rule of the CPU drafter's own test:
// both sides run fp32 on the same bf16 weights and differ only in summation order (≈ 1e-6 here),
// while the mistakes this catches (a causal block, interleaved RoPE, a wrong YaRN amplitude, a
// stale block K/V) move the logits by 3e-2 or more (tests/fixtures/dflash-*/golden.json).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/dflash_cuda.h"
#include "model/deepseek_v3_cuda.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/deepseek_v3.h"
#include "model/dflash.h"
#include "model/make_drafter.h"
#include "test_util.h"
#include "gpu_test_util.h"


namespace kd {
namespace {

using gpu_test::fixture;

namespace fs = std::filesystem;


double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

// A random drafter (make-model --drafter-for) for a target fixture, made once per process.
std::string made_drafter(const std::string& target, int32_t layers, int32_t block) {
  const fs::path dir = fs::temp_directory_path() / cat("kdtree-gpu-drafter-", getpid(), "-", target, "-", layers, "-", block);
  if (!fs::exists(dir / "config.json")) make_drafter(fixture(target), dir.string(), 7, layers, block, /*force=*/true);
  return dir.string();
}

std::vector<float> cpu_draft(const DFlashDrafter& d, const DFlashDrafter::Context& ctx, int32_t bonus, const DeepseekV3& t) {
  const DFlashConfig& c = d.config();
  std::vector<int32_t> block(static_cast<size_t>(c.block_size), c.mask_token_id);
  block[0] = bonus;
  std::vector<float> out(static_cast<size_t>((c.block_size - 1) * c.vocab_size));
  d.draft(ctx, block.data(), t.embedding(), t.lm_head(), out.data());
  return out;
}

class GpuDFlashGolden : public ::testing::TestWithParam<const char*> {};

// Two rounds of the fixtures' goldens: GPU logits vs the CPU drafter and vs the golden logits; a
// repeated draft is bit-identical (the block's K/V never enter the context).
TEST_P(GpuDFlashGolden, LogitsMatchCpuDrafterAcrossTwoRounds) {
  REQUIRE_GPU();
  const std::string dir = fixture(GetParam());
  Checkpoint ck(fixture("k2-bf16"));
  DeepseekV3 model(ck);
  CudaTarget t(model, 64);
  CudaDFlash g(dir, t, 4096);
  DFlashDrafter d(dir, model.config());
  DFlashDrafter::Context ctx = d.new_context(4096);
  SafetensorsFile golden(dir + "/golden.safetensors");
  const int64_t F = d.config().n_taps() * d.config().hidden_size, V = d.config().vocab_size;
  for (const char* round : {"1", "2"}) {
    const auto taps = test::read_tensor<float>(golden, cat("taps", round));
    const auto block = test::read_tensor<int32_t>(golden, cat("block", round));
    const auto ref = test::read_tensor<float>(golden, cat("logits", round));
    for (size_t i = 1; i < block.size(); ++i) ASSERT_EQ(block[i], d.config().mask_token_id);
    const int64_t n = int64_t(taps.size()) / F;
    d.append_context(ctx, taps.data(), n);
    g.append_context(taps.data(), n);
    ASSERT_EQ(g.context_len(), ctx.len);
    std::vector<float> got(static_cast<size_t>((d.config().block_size - 1) * V)), again(got.size());
    g.draft(block[0], g.context_len(), got.data());
    g.draft(block[0], g.context_len(), again.data());
    const std::vector<float> cpu = cpu_draft(d, ctx, block[0], model);
    const double e_cpu = rel_err(got, cpu), e_ref = rel_err(got, ref);
    std::printf("  %s round %s (context %lld): GPU vs CPU drafter %.2e, GPU vs golden %.2e\n", GetParam(), round,
                (long long)ctx.len, e_cpu, e_ref);
    EXPECT_LE(e_cpu, 1e-4) << GetParam() << " round " << round;
    EXPECT_LE(e_ref, 1e-4) << GetParam() << " round " << round;
    EXPECT_EQ(0, std::memcmp(got.data(), again.data(), got.size() * 4)) << "a second draft differs";
  }
  EXPECT_THROW(g.draft(1, g.context_len() + 1, nullptr), Error);  // block not at the context's end
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuDFlashGolden, ::testing::Values("dflash-rope", "dflash-yarn"));

// The dflash_config knobs (input_embedding_scale, output_multiplier, final_logit_softcapping) and an
// explicit YaRN attention_factor on the GPU: against the CPU drafter, which tests/unit/test_dflash.cpp
// checks knob by knob against z-lab's package (package_golden.safetensors).
TEST(GpuDFlashKnobs, ScalesAndSoftcapMatchTheCpuDrafter) {
  REQUIRE_GPU();
  const fs::path dir = fs::temp_directory_path() / cat("kdtree-gpu-knobs-", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fixture("dflash-yarn") + "/model.safetensors", dir / "model.safetensors");
  nlohmann::json j = nlohmann::json::parse(std::ifstream(fixture("dflash-yarn") + "/config.json"));
  j["dflash_config"]["input_embedding_scale"] = 1.7;
  j["dflash_config"]["output_multiplier"] = 0.6;
  j["dflash_config"]["final_logit_softcapping"] = 4.0;
  j["rope_scaling"]["attention_factor"] = 1.25;
  std::ofstream(dir / "config.json") << j.dump(2);
  Checkpoint ck(fixture("k2-bf16"));
  DeepseekV3 model(ck);
  CudaTarget t(model, 64);
  CudaDFlash g(dir.string(), t, 4096);
  DFlashDrafter d(dir.string(), model.config());
  ASSERT_EQ(d.config().final_logit_softcapping, 4.0);
  DFlashDrafter::Context ctx = d.new_context(4096);
  SafetensorsFile golden(fixture("dflash-yarn") + "/golden.safetensors");
  const int64_t F = d.config().n_taps() * d.config().hidden_size, V = d.config().vocab_size;
  for (const char* round : {"1", "2"}) {
    const auto taps = test::read_tensor<float>(golden, cat("taps", round));
    const auto block = test::read_tensor<int32_t>(golden, cat("block", round));
    const int64_t n = int64_t(taps.size()) / F;
    d.append_context(ctx, taps.data(), n);
    g.append_context(taps.data(), n);
    std::vector<float> got(static_cast<size_t>((d.config().block_size - 1) * V));
    g.draft(block[0], g.context_len(), got.data());
    const double e = rel_err(got, cpu_draft(d, ctx, block[0], model));
    std::printf("  knobs round %s: GPU vs CPU drafter %.2e\n", round, e);
    EXPECT_LE(e, 1e-4) << "round " << round;
    for (float x : got) ASSERT_LE(std::fabs(x), 4.0f);  // the softcap bounds every logit
  }
  fs::remove_all(dir);
}

// A deeper made drafter (3 layers, block 8, GQA): the context fed from device taps through a row
// list (a DDTree path) equals the CPU drafter fed those rows from the host.
TEST(GpuDFlash, DeviceTapRowsMatchCpuDrafter) {
  REQUIRE_GPU();
  for (const char* target : {"k2-int4", "dsv3-group"}) {
    const std::string dir = made_drafter(target, 3, 8);
    Checkpoint ck(fixture(target));
    DeepseekV3 model(ck);
    CudaTarget t(model, 64);
    CudaDFlash g(dir, t, 256);
    DFlashDrafter d(dir, model.config());
    DFlashDrafter::Context ctx = d.new_context(256);
    const DFlashConfig& c = d.config();
    const int64_t F = c.n_taps() * c.hidden_size, rows = 24;
    std::vector<float> taps(static_cast<size_t>(rows * F));
    for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(std::sin(0.37 * double(i))) * 2.0f;
    float* dev = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), taps.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev, taps.data(), taps.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    // A prompt of rows 0 … 9, then two "paths" of kept rows.
    d.append_context(ctx, taps.data(), 10);
    g.append_context_device(dev, 10, nullptr);
    for (const std::vector<int32_t>& path : {std::vector<int32_t>{10, 12, 13}, std::vector<int32_t>{15, 16, 20, 23}}) {
      std::vector<float> sel;
      for (int32_t r : path) sel.insert(sel.end(), taps.begin() + r * F, taps.begin() + (r + 1) * F);
      d.append_context(ctx, sel.data(), int64_t(path.size()));
      g.append_context_device(dev, int64_t(path.size()), path.data());
      std::vector<float> got(static_cast<size_t>((c.block_size - 1) * c.vocab_size));
      g.draft(5, g.context_len(), got.data());
      const double e = rel_err(got, cpu_draft(d, ctx, 5, model));
      std::printf("  %s made drafter, context %lld: GPU vs CPU drafter %.2e\n", target, (long long)ctx.len, e);
      EXPECT_LE(e, 1e-4) << target;
    }
    cudaFree(dev);
  }
}

// Staged rows (stage_context_device: what --budget auto's AR steps hand over) == the same rows
// appended at once, bit for bit: singles that fill the staging buffer and flush it, a stage larger
// than the buffer, staged rows before a direct append and before a host append, and a draft that
// takes a partly filled buffer in. context_len counts staged rows at once.
TEST(GpuDFlash, StagedRowsEqualDirectAppendsBitwise) {
  REQUIRE_GPU();
  const std::string dir = made_drafter("k2-int4", 2, 8);
  Checkpoint ck(fixture("k2-int4"));
  DeepseekV3 model(ck);
  CudaTarget t(model, 64);
  CudaDFlash staged(dir, t, 512), direct(dir, t, 512);
  const DFlashConfig c = load_dflash_config(dir);
  const int64_t F = c.n_taps() * c.hidden_size, rows = 260;
  ASSERT_GT(rows, 3 * CudaDFlash::kStageRows);
  std::vector<float> taps(static_cast<size_t>(rows * F));
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(std::sin(0.29 * double(i) + 1.0)) * 2.0f;
  float* dev = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), taps.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, taps.data(), taps.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<float> a(static_cast<size_t>((c.block_size - 1) * c.vocab_size)), b(a.size());
  auto same_draft = [&](const char* what) {
    ASSERT_EQ(staged.context_len(), direct.context_len()) << what;
    staged.draft(7, staged.context_len(), a.data());
    direct.draft(7, direct.context_len(), b.data());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << what;
  };
  int64_t r = 0;
  // 150 singles: two full buffers flushed by the next stage, 22 left for the draft.
  for (; r < 150; ++r) {
    staged.stage_context_device(dev + r * F, 1);
    direct.append_context_device(dev + r * F, 1, nullptr);
    EXPECT_EQ(staged.context_len(), r + 1);
  }
  same_draft("singles across two buffer fills");
  // A stage larger than the buffer goes straight in (after what is staged).
  staged.stage_context_device(dev + r * F, 3);
  staged.stage_context_device(dev + (r + 3) * F, CudaDFlash::kStageRows + 6);
  direct.append_context_device(dev + r * F, CudaDFlash::kStageRows + 9, nullptr);
  r += CudaDFlash::kStageRows + 9;
  same_draft("a stage larger than the buffer");
  // Staged rows, then a direct append of path rows, then staged rows and a host append.
  staged.stage_context_device(dev + r * F, 2);
  direct.append_context_device(dev + r * F, 2, nullptr);
  r += 2;
  const std::vector<int32_t> path{int32_t(r), int32_t(r + 2), int32_t(r + 3)};
  staged.append_context_device(dev, 3, path.data());
  direct.append_context_device(dev, 3, path.data());
  r += 4;
  staged.stage_context_device(dev + r * F, 5);
  direct.append_context_device(dev + r * F, 5, nullptr);
  staged.append_context(taps.data() + (r + 5) * F, 4);
  direct.append_context(taps.data() + (r + 5) * F, 4);
  same_draft("staged rows before a path append and a host append");
  // A full context refuses a stage, naming the limit.
  CudaDFlash small(dir, t, 4);
  small.stage_context_device(dev, 3);
  EXPECT_THROW(small.stage_context_device(dev, 2), Error);
  cudaFree(dev);
}

// DDTree / DFlash chains with this drafter == AR on the GPU (tokens and logits, bitwise; T 0 and 0.8;
// budgets 0/1/4/16; also the CPU drafter on the GPU target): CudaRound.DevicePathsEqualHostPathsAndAr.

}  // namespace
}  // namespace kd
