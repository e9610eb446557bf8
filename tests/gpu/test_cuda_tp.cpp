// The tensor-parallel GPU target (model/deepseek_v3_cuda_tp.h) with R ranks sharing this one GPU —
// the single-GPU emulation, running the sharded kernels and the rank-order reductions a multi-GPU host
// runs (SharedDeviceComm instead of NCCL). For R = 2, 4 on the HF fixtures and 8 on a made 8-head model:
// - DDTree == AR on the TP target, token for token and logit for logit (tree and chain, T = 0 and
//   seeded T > 0);
// - the engine's batch == each request alone, and argmax outputs == host logits (bitwise);
// - the prompt's logits agree with the CPU's tensor-parallel target (model/deepseek_v3_tp.h) at the same R
//   (HF fixtures: the GPU-vs-CPU tolerance of test_cuda_model.cpp, 1e-2 of the largest logit — bf16 KV,
//   other kernels) and with the unsharded GPU target (1e-4: only the partial sums' order differs), and
//   the first token is the same;
// - a GPU DFlash drafter beside rank 0 (draft_rank: the whole lm_head uploaded there) keeps DDTree == AR
//   with no tap row leaving the GPU, and drafts what the CPU drafter drafts from the same taps.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "decode/synthetic_drafter.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "engine_sink.h"
#include "gpu_test_util.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/deepseek_v3_cuda.h"
#include "model/deepseek_v3_cuda_tp.h"
#include "model/deepseek_v3_tp.h"
#include "model/dflash.h"
#include "model/dflash_cuda.h"
#include "model/make_drafter.h"
#include "model/make_model.h"
#include "tp_test_model.h"

namespace kd {
namespace {

namespace fs = std::filesystem;

struct TpCase {
  const char* model;  // a fixture, or "tp8"
  int32_t R;
};
void PrintTo(const TpCase& c, std::ostream* os) { *os << c.model << " R=" << c.R; }
std::string dir_of(const TpCase& c) { return std::string(c.model) == "tp8" ? test::tp8_model_dir() : gpu_test::fixture(c.model); }

struct Loaded {
  std::unique_ptr<Checkpoint> ck;
  std::map<int32_t, std::unique_ptr<CudaTpTarget>> gpu;
};
const CudaTpTarget& gpu_tp(const std::string& dir, int32_t R) {
  static std::map<std::string, Loaded> all;
  Loaded& l = all[dir];
  if (!l.ck) l.ck = std::make_unique<Checkpoint>(dir);
  auto& t = l.gpu[R];
  if (!t) t = std::make_unique<CudaTpTarget>(*l.ck, std::vector<int32_t>(size_t(R), 0));
  return *t;
}

std::vector<int32_t> prompt_for(const ModelConfig& c, int64_t n, int salt) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 131 + 7 + salt * 37) % c.vocab_size));
  return p;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

// n tokens, EOS ignored, every logit kept (the bitwise comparisons), at this temperature and seed.
GenerateOptions exact_options(int64_t n, float temp, uint64_t seed) {
  GenerateOptions opt;
  opt.max_new_tokens = n;
  opt.ignore_eos = true;
  opt.keep_logits = true;
  opt.sampling.temperature = temp;
  opt.sampling.seed = seed;
  return opt;
}

class CudaTp : public ::testing::TestWithParam<TpCase> {};

TEST_P(CudaTp, DDTreeEqualsARBitwise) {
  REQUIRE_GPU();
  const CudaTpTarget& tp = gpu_tp(dir_of(GetParam()), GetParam().R);
  const ModelConfig& c = tp.config();
  const auto prompt = prompt_for(c, 9, 1);
  for (auto [temp, seed] : {std::pair{0.0f, uint64_t(0)}, std::pair{0.8f, uint64_t(3)}}) {
    const GenerateOptions opt = exact_options(32, temp, seed);
    const GenerateResult ar = generate_ar(tp, prompt, opt);
    std::vector<int32_t> truth = prompt;
    truth.insert(truth.end(), ar.output_ids.begin(), ar.output_ids.end());
    for (auto [chain, budget] : {std::pair{false, int64_t(12)}, std::pair{true, int64_t(0)}}) {
      SyntheticDrafter d(truth, SyntheticDrafter::parse_profile("0.6,0.25"), 8, c.vocab_size, 5);
      SpecOptions so;
      so.chain = chain;
      so.budget = budget;
      const SpecResult s = generate_ddtree(tp, d, prompt, opt, so);
      const std::string what = cat(GetParam().model, " R=", GetParam().R, " T=", temp, chain ? " chain" : " tree");
      ASSERT_EQ(s.gen.output_ids, ar.output_ids) << what;
      ASSERT_EQ(s.gen.logits, ar.logits) << what;
      EXPECT_GT(s.stats.accepted, 0) << what;
    }
  }
}

TEST_P(CudaTp, EngineBatchEqualsAloneAndArgmaxEqualsLogits) {
  REQUIRE_GPU();
  const CudaTpTarget& tp = gpu_tp(dir_of(GetParam()), GetParam().R);
  const ModelConfig& c = tp.config();
  std::vector<test::Case> cases;
  for (int k = 0; k < 5; ++k) {
    test::Case cs;
    cs.prompt = prompt_for(c, 3 + 4 * k, k);
    cs.gen.max_new_tokens = 10;
    cs.gen.ignore_eos = true;
    cs.gen.keep_logits = k % 2 == 0;  // odd k: greedy through the ranks' argmax exchange
    if (k == 2) cs.gen.sampling.temperature = 0.9f, cs.gen.sampling.seed = 77;
    cases.push_back(cs);
  }
  EngineOptions eo;
  eo.n_parallel = 5;
  eo.context = 64;
  eo.prefill_chunk = 6;
  test::Sink sink;
  {
    Engine eng(tp, eo);
    for (size_t k = 0; k < cases.size(); ++k) test::submit_case(eng, sink, k, cases[k]);
    sink.wait_done(cases.size());
  }
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string what = cat(GetParam().model, " R=", GetParam().R, " request ", k);
    const GenerateResult alone = generate_ar(tp, cases[k].prompt, cases[k].gen);
    const test::Collected got = sink.get(k);
    ASSERT_EQ(got.ids, alone.output_ids) << what;
    ASSERT_EQ(got.logits, alone.logits) << what;
    if (!cases[k].gen.keep_logits) {
      GenerateOptions g = cases[k].gen;
      g.keep_logits = true;
      EXPECT_EQ(generate_ar(tp, cases[k].prompt, g).output_ids, alone.output_ids) << what << ": argmax outputs vs host logits";
    }
  }
}

TEST_P(CudaTp, PromptLogitsMatchCpuTpAndOneGpu) {
  REQUIRE_GPU();
  const std::string dir = dir_of(GetParam());
  const int32_t R = GetParam().R;
  const CudaTpTarget& tp = gpu_tp(dir, R);
  Checkpoint ck(dir);
  DeepseekV3 whole(ck);
  const DeepseekV3Tp cpu_tp(ck, R);
  CudaTarget one(whole, 64);
  GenerateOptions g;
  g.max_new_tokens = 1;
  g.ignore_eos = true;
  g.keep_logits = true;
  for (int salt = 0; salt < 3; ++salt) {
    const auto prompt = prompt_for(tp.config(), 6 + 5 * salt, salt);
    const GenerateResult a = generate_ar(tp, prompt, g), b = generate_ar(cpu_tp, prompt, g), o = generate_ar(one, prompt, g);
    const double e_cpu = rel_err(a.logits, b.logits), e_one = rel_err(a.logits, o.logits);
    std::printf("  %s R=%d prompt %d: vs CPU TP %.2e, vs one GPU %.2e\n", GetParam().model, R, salt, e_cpu, e_one);
    // Against the unsharded GPU target only the partial sums' order differs (measured ≤ 4.4e-6).
    EXPECT_LT(e_one, 1e-4);
    EXPECT_EQ(a.output_ids, o.output_ids);
    // Against the CPU, bf16 KV and the GPU's kernels too: on the HF fixtures within test_cuda_model's
    // 1e-2; the made INT4 model's random router has near-ties that a 1e-3 difference flips (an expert
    // swap, logits > 5 % apart — test_cuda_model.cpp explains), so there the CPU is compared by the
    // chain TP GPU == one GPU (above), one GPU ≈ CPU (test_cuda_model), CPU TP ≈ CPU (tests/unit).
    if (std::string(GetParam().model) != "tp8") {
      EXPECT_LT(e_cpu, 1e-2);
      EXPECT_EQ(a.output_ids, b.output_ids);
    }
  }
}

// The GPU drafter under tensor parallelism: on rank 0's GPU, fed rank 0's device taps, its lm_head the
// whole matrix uploaded beside the rank's vocabulary slice. DDTree with it == AR on the TP target (tree
// and chain, T = 0 and seeded T > 0, and --budget auto's AR steps, whose taps are staged on the device),
// no tap row reaching the host; its draft logits == the CPU drafter's over the unsharded model's lm_head
// on the same taps within the drafter tests' 1e-4 (a drafter that read rank 0's slice alone would be
// off in every column past it); the upload happens once; a rank without the whole lm_head is refused.
TEST_P(CudaTp, GpuDrafterBesideRankZeroKeepsDDTreeExact) {
  REQUIRE_GPU();
  const std::string dir = dir_of(GetParam());
  const int32_t R = GetParam().R;
  const CudaTpTarget& tp = gpu_tp(dir, R);
  const ModelConfig& c = tp.config();
  const fs::path ddir = fs::temp_directory_path() / cat("kdtree-gpu-tp-drafter-", getpid(), "-", GetParam().model);
  if (!fs::exists(ddir / "config.json")) make_drafter(dir, ddir.string(), 5, 2, 8, /*force=*/true);
  Checkpoint ck(dir);
  DeepseekV3 whole(ck);
  CudaTarget& r0 = tp.draft_rank(whole.lm_head());
  const uint64_t resident = r0.device_weight_bytes();
  EXPECT_EQ(&tp.draft_rank(whole.lm_head()), &r0);
  EXPECT_EQ(r0.device_weight_bytes(), resident) << "the whole lm_head is uploaded once";
  const auto host = DFlashDrafter::load(ddir.string(), whole.config());
  const auto weights = std::make_shared<const CudaDFlashWeights>(host);
  if (R > 1) {
    try {
      CudaDFlash refused(weights, const_cast<CudaTarget&>(tp.rank(1)), 64);
      ADD_FAILURE() << "a drafter over rank 1, which holds a slice of lm_head, was built";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("add_draft_lm_head"), std::string::npos) << e.what();
    }
  }
  ASSERT_TRUE(tp.device_taps());

  const auto prompt = prompt_for(c, 9, 2);
  for (auto [temp, seed] : {std::pair{0.0f, uint64_t(0)}, std::pair{0.8f, uint64_t(3)}}) {
    const GenerateOptions opt = exact_options(40, temp, seed);
    const GenerateResult ar = generate_ar(tp, prompt, opt);
    for (int mode = 0; mode < 3; ++mode) {
      SpecOptions so;
      so.chain = mode == 1;
      so.budget = mode == 1 ? 0 : 12;
      if (mode == 2) {  // auto: AR steps (staged taps) with probes between them
        so.auto_budget = true;
        so.budget = 16;
        so.fixed_verify_ms = {{1, 1.0}, {2, 1.3}, {9, 2.0}, {65, 8.0}};
        so.fixed_draft_ms = 2.0;
      }
      CudaDFlash d(weights, r0, 256);
      const uint64_t before = r0.host_tap_rows();
      const SpecResult s = generate_ddtree(tp, d, prompt, opt, so);
      const std::string what = cat(GetParam().model, " R=", R, " T=", temp, " mode ", mode);
      ASSERT_EQ(s.gen.output_ids, ar.output_ids) << what;
      ASSERT_EQ(s.gen.logits, ar.logits) << what;
      EXPECT_EQ(r0.host_tap_rows(), before) << what << ": a tap row came to the host";
      EXPECT_GT(s.stats.rounds, 0) << what;
    }
  }

  // Draft logits from the same host taps: GPU drafter on rank 0 vs the CPU drafter over the whole model.
  CudaDFlash g(weights, r0, 64);
  DFlashDrafter::Context ctx = host->new_context(64);
  const DFlashConfig& dc = host->config();
  const int64_t F = dc.n_taps() * dc.hidden_size, rows = 11;
  std::vector<float> taps(static_cast<size_t>(rows * F));
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(std::sin(0.29 * double(i))) * 2.0f;
  host->append_context(ctx, taps.data(), rows);
  g.append_context(taps.data(), rows);
  std::vector<int32_t> block(static_cast<size_t>(dc.block_size), dc.mask_token_id);
  block[0] = 3;
  std::vector<float> cpu(static_cast<size_t>((dc.block_size - 1) * dc.vocab_size)), got(cpu.size());
  host->draft(ctx, block.data(), whole.embedding(), whole.lm_head(), cpu.data());
  g.draft(3, g.context_len(), got.data());
  const double e = rel_err(got, cpu);
  std::printf("  %s R=%d: GPU drafter on rank 0 vs CPU drafter %.2e\n", GetParam().model, R, e);
  EXPECT_LE(e, 1e-4);
  fs::remove_all(ddir);
}

INSTANTIATE_TEST_SUITE_P(Models, CudaTp,
                         ::testing::Values(TpCase{"k2-bf16", 2}, TpCase{"k2-bf16", 4}, TpCase{"dsv3-group", 2}, TpCase{"tp8", 2},
                                           TpCase{"tp8", 8}),
                         [](const auto& p) {
                           std::string s = cat(p.param.model, "_tp", p.param.R);
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

TEST(CudaTp, RefusesMixedDevicesAndBadR) {
  REQUIRE_GPU();
  Checkpoint ck(gpu_test::fixture("k2-bf16"));
  EXPECT_THROW(CudaTpTarget(ck, {0, 0, 0}), Error);  // 3 does not divide 4 heads
  EXPECT_THROW(CudaTpTarget(ck, {0}), Error);
  EXPECT_THROW(CudaTpTarget(ck, {0, 999}), Error);
}

}  // namespace
}  // namespace kd
