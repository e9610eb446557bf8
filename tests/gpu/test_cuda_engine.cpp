// The serving engine on the GPU (Engine over the CudaTarget): paged latent KV in the device
// cache, every running sequence in one CudaTarget::forward_batch. Each request's tokens and logits
// must be bit-identical to generate_ar on a single-sequence CudaTarget (and, with a drafter,
// DDTree in the engine == AR): alone, in a batch of 16, with small prefill chunks mixed with decode
// rows, small KV blocks, after prefix-cache hits — the row invariance of the CUDA kernels (a row's
// reductions depend on its key list alone, whatever block the keys sit in) is what makes it hold.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <utility>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "model/dflash_cuda.h"
#include "engine/generate.h"
#include "model/deepseek_v3_cuda.h"
#include "core/error.h"
#include "engine/engine.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/make_drafter.h"
#include "engine_sink.h"
#include "gpu_test_util.h"


namespace kd {
namespace {

using gpu_test::fixture;

namespace fs = std::filesystem;


struct Loaded {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<DeepseekV3> model;
};
const DeepseekV3& model_of(const std::string& fx) {
  static std::map<std::string, Loaded> cache;
  Loaded& l = cache[fx];
  if (!l.model) {
    l.ckpt = std::make_unique<Checkpoint>(fixture(fx));
    l.model = std::make_unique<DeepseekV3>(*l.ckpt);
  }
  return *l.model;
}

using Got = test::Collected;
using test::Case;
using test::Sink;
using test::submit_case;

std::vector<int32_t> prompt_of(const ModelConfig& c, int64_t n, int k) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[size_t(i)] = int32_t((i * 37 + 11 + k * 101) % c.vocab_size);
  return p;
}

// 16 requests: prompts of 3 … 31 tokens, 6 … 14 new tokens, greedy and sampled (seeded) mixed.
std::vector<Case> cases_for(const ModelConfig& c, int n) {
  std::vector<Case> cs;
  for (int k = 0; k < n; ++k) {
    Case x;
    x.prompt = prompt_of(c, 3 + (k * 7) % 29, k);
    x.gen.max_new_tokens = 6 + k % 9;
    x.gen.ignore_eos = true;
    x.gen.keep_logits = true;
    if (k % 3 != 0) {
      x.gen.sampling.temperature = 0.7f + 0.1f * float(k % 4);
      x.gen.sampling.top_k = k % 2 ? 0 : 20;
      x.gen.sampling.seed = uint64_t(1000 + k);
    }
    cs.push_back(x);
  }
  return cs;
}

// generate_ar on its own single-sequence target: the reference every engine output must equal.
std::vector<GenerateResult> reference(const DeepseekV3& m, const std::vector<Case>& cases) {
  CudaTarget single(m, 256);
  std::vector<GenerateResult> out;
  for (const Case& c : cases) out.push_back(generate_ar(single, c.prompt, c.gen));
  return out;
}

void expect_equal(const Got& got, const GenerateResult& ar, const std::string& what) {
  ASSERT_EQ(got.n_done, 1) << what << " " << got.error;
  ASSERT_EQ(got.ids, ar.output_ids) << what << " " << got.error;
  EXPECT_EQ(got.finish_reason, ar.finish_reason) << what;
  ASSERT_EQ(got.logits.size(), ar.logits.size()) << what;
  for (size_t i = 0; i < ar.logits.size(); ++i) ASSERT_EQ(got.logits[i], ar.logits[i]) << what << " logit " << i;
}

// Runs the cases through one engine on a fresh paged CUDA target; returns what each request got.
std::vector<Got> run_engine(const DeepseekV3& m, const EngineOptions& opt, const std::vector<Case>& cases, int rounds = 1,
                            EngineMetrics* metrics = nullptr) {
  CudaTarget gpu(m, 1);
  const Target* t = &gpu;
  Sink sink;
  std::vector<Got> out;
  {
    Engine eng(*t, opt);
    size_t k = 0;
    for (int r = 0; r < rounds; ++r) {  // later rounds repeat the prompts: prefix-cache hits
      for (const Case& c : cases) {
        submit_case(eng, sink, k++, c);
      }
      sink.wait_done(k);
    }
    if (metrics) *metrics = eng.metrics();
  }
  for (size_t i = 0; i < cases.size() * size_t(rounds); ++i) out.push_back(sink.get(i));
  return out;
}

TEST(CudaEngine, AloneAndBatchOf16ChunkedAndPagedEqualGenerateARBitwise) {
  REQUIRE_GPU();
  for (const char* fx : {"k2-bf16", "k2-int4", "dsv3-group"}) {
    const DeepseekV3& m = model_of(fx);
    const std::vector<Case> cases = cases_for(m.config(), 16);
    const std::vector<GenerateResult> ref = reference(m, cases);
    struct Shape {
      const char* name;
      int64_t parallel, chunk, block;
    };
    for (const Shape& s : {Shape{"alone", 1, 256, 16}, Shape{"batch 16", 16, 256, 16}, Shape{"batch 16, chunks of 5, blocks of 4", 16, 5, 4},
                           Shape{"batch 5, chunks of 1, blocks of 1", 5, 1, 1}}) {
      EngineOptions opt;
      opt.n_parallel = s.parallel;
      opt.context = 256;
      opt.prefill_chunk = s.chunk;
      opt.kv_block = s.block;
      const std::vector<Got> got = run_engine(m, opt, cases);
      for (size_t k = 0; k < cases.size(); ++k) expect_equal(got[k], ref[k], cat(fx, " ", s.name, " request ", k));
    }
  }
}

TEST(CudaEngine, PrefixCacheHitsKeepOutputsBitwise) {
  REQUIRE_GPU();
  const DeepseekV3& m = model_of("k2-int4");
  std::vector<Case> cases = cases_for(m.config(), 8);
  for (size_t k = 0; k < cases.size(); ++k) cases[k].prompt = prompt_of(m.config(), 40 + int64_t(k), 3);  // shared 40-token prefix
  const std::vector<GenerateResult> ref = reference(m, cases);
  EngineOptions opt;
  opt.n_parallel = 4;
  opt.context = 256;
  opt.kv_block = 8;
  opt.kv_tokens = 4 * 128;  // small: later requests evict earlier cached blocks
  EngineMetrics mt;
  const std::vector<Got> got = run_engine(m, opt, cases, 2, &mt);
  for (size_t k = 0; k < got.size(); ++k) expect_equal(got[k], ref[k % cases.size()], cat("request ", k));
  EXPECT_GT(mt.prefix_hit_tokens, 0u) << "the repeated prompts must hit the prefix cache";
  EXPECT_EQ(mt.kv_blocks_used, 0) << "every block is released when the requests finish";
  int64_t cached = 0;
  for (const Got& g : got) cached += g.stats.n_cached;
  EXPECT_GT(cached, 0);
}

// An agent's next turn (last prompt + its answer + more): on the GPU decode rows are absorbed like
// prefill rows, bit for bit, so the answer's full blocks are published and hit too.
TEST(CudaEngine, NextTurnReusesTheAnswerBitwise) {
  REQUIRE_GPU();
  const DeepseekV3& m = model_of("k2-int4");
  Case t1;
  t1.prompt = prompt_of(m.config(), 13, 2);
  t1.gen.max_new_tokens = 16;
  t1.gen.ignore_eos = true;
  t1.gen.keep_logits = true;
  CudaTarget gpu(m, 1);
  const Target* t = &gpu;
  EngineOptions opt;
  opt.context = 256;
  opt.kv_block = 4;
  Engine eng(*t, opt);
  Sink sink;
  submit_case(eng, sink, 0, t1);
  sink.wait_done(1);
  Case t2 = t1;
  const std::vector<int32_t> answer = sink.get(0).ids;
  t2.prompt.insert(t2.prompt.end(), answer.begin(), answer.end());
  t2.prompt.push_back(3);
  t2.prompt.push_back(5);
  submit_case(eng, sink, 1, t2);
  sink.wait_done(2);
  const std::vector<GenerateResult> ref = reference(m, {t1, t2});
  expect_equal(sink.get(0), ref[0], "turn 1");
  expect_equal(sink.get(1), ref[1], "turn 2");
  EXPECT_EQ(sink.get(1).stats.n_cached, 28) << "13 + 16 − 1 rows had latents: 7 blocks of 4";
}

// A random DFlash drafter (make-model --drafter-for) drafting on the GPU for each sequence; every
// sequence's tree verified in one batched forward: output == AR bit for bit (tokens and logits). The
// drafters read the target's taps on the device (no tap row comes to the host); with the device
// outputs off (the host path: taps and logits downloaded) the outputs are the same bits.
TEST(CudaEngine, DDTreeWithGpuDrafterEqualsGenerateARBitwise) {
  REQUIRE_GPU();
  const DeepseekV3& m = model_of("k2-bf16");
  const fs::path dir = fs::temp_directory_path() / cat("kdtree-gpu-engine-drafter-", getpid());
  if (!fs::exists(dir / "config.json")) make_drafter(fixture("k2-bf16"), dir.string(), 7, 1, 6, /*force=*/true);
  std::vector<Case> cases = cases_for(m.config(), 6);
  for (Case& c : cases) c.gen.max_new_tokens = 20;
  const std::vector<GenerateResult> ref = reference(m, cases);
  for (const auto& [chain, device] : {std::pair{false, true}, std::pair{true, true}, std::pair{false, false}}) {
    CudaTarget gpu(m, 1);
    gpu.set_device_outputs(device);
    const Target* t = &gpu;
    EngineOptions opt;
    opt.n_parallel = 6;
    opt.context = 256;
    opt.prefill_chunk = 8;
    opt.kv_block = 4;
    opt.spec.chain = chain;
    opt.spec.budget = 5;
    const std::string d = dir.string();
    opt.make_drafter = [&gpu, d] { return std::make_unique<CudaDFlash>(d, gpu, 256); };
    Sink sink;
    EngineMetrics mt;
    {
      Engine eng(*t, opt);
      for (size_t k = 0; k < cases.size(); ++k) {
        submit_case(eng, sink, k, cases[k]);
      }
      sink.wait_done(cases.size());
      mt = eng.metrics();
    }
    EXPECT_GT(mt.spec_rounds, 0u);
    EXPECT_EQ(mt.kv_blocks_used, 0);
    if (device)
      EXPECT_EQ(gpu.host_tap_rows(), 0u) << "a GPU drafter's taps came to the host";
    else
      EXPECT_GT(gpu.host_tap_rows(), 0u) << "the host path downloads taps";
    for (size_t k = 0; k < cases.size(); ++k)
      expect_equal(sink.get(k), ref[k], cat(chain ? "chain" : "tree", device ? "" : " (host path)", " request ", k));
  }
}

// --budget auto on the GPU with a GPU drafter: its AR steps bring their tap row to the host and the
// drafter takes the stretch at its next draft (engine.cpp schedule), drafted rounds hand theirs over
// on the device. The drafter's context must be the same rows in the same order as when every row
// goes through the host (device outputs off): with fixed costs the policy depends only on the
// drafted trees, so the two runs must draft the same trees round for round — a row lost, repeated
// or out of order changes a random drafter's logits and so its trees. Both outputs are AR's.
TEST(CudaEngine, AutoBudgetARStepsKeepTheGpuDrafterContext) {
  REQUIRE_GPU();
  const DeepseekV3& m = model_of("k2-bf16");
  const fs::path dir = fs::temp_directory_path() / cat("kdtree-gpu-auto-drafter-", getpid());
  if (!fs::exists(dir / "config.json")) make_drafter(fixture("k2-bf16"), dir.string(), 5, 2, 8, /*force=*/true);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 9; ++i) prompt.push_back(int32_t((i * 89 + 3) % m.config().vocab_size));
  GenerateOptions g;
  g.max_new_tokens = 160;
  g.ignore_eos = true;
  SpecOptions so;
  so.auto_budget = true;
  so.budget = 16;
  // A random drafter at a draft as dear as two AR steps: AR steps with probes between them. (Verify
  // rows cheap enough that a perfect drafter would double AR's rate: the start-up gate is open.)
  so.fixed_verify_ms = {{1, 1.0}, {2, 1.3}, {9, 2.0}, {65, 8.0}};
  so.fixed_draft_ms = 2.0;
  so.record_trees = true;
  CudaTarget gpu(m, 1);
  const GenerateResult ar = generate_ar(gpu, prompt, g);
  std::vector<SpecResult> runs;
  std::vector<uint64_t> host_rows;
  for (bool device : {true, false}) {
    gpu.set_device_outputs(device);
    CudaDFlash d(dir.string(), gpu, 512);
    const uint64_t before = gpu.host_tap_rows();
    runs.push_back(generate_ddtree(gpu, d, prompt, g, so));
    host_rows.push_back(gpu.host_tap_rows() - before);
    ASSERT_EQ(runs.back().gen.output_ids, ar.output_ids) << (device ? "device outputs" : "host path");
  }
  gpu.set_device_outputs(true);
  const SpecStats& a = runs[0].stats;
  const SpecStats& b = runs[1].stats;
  EXPECT_GT(a.ar_steps, 20);
  EXPECT_GE(a.rounds - a.ar_steps, 3) << "probes after AR stretches: the deferred rows reach the drafter";
  // Device outputs: no row came to the host — the rounds' stayed, the AR steps' were staged on the
  // device (CudaDFlash::stage_context_device) and reached the drafter before its next draft.
  EXPECT_EQ(host_rows[0], uint64_t(0));
  EXPECT_GT(host_rows[1], host_rows[0]);
  ASSERT_EQ(a.round_trees.size(), b.round_trees.size());
  int64_t drafted = 0;
  for (size_t r = 0; r < a.round_trees.size(); ++r) {
    EXPECT_EQ(a.round_trees[r].start, b.round_trees[r].start) << "round " << r;
    ASSERT_EQ(a.round_trees[r].tokens, b.round_trees[r].tokens) << "round " << r << ": the drafters saw different context";
    EXPECT_EQ(a.round_trees[r].parents, b.round_trees[r].parents) << "round " << r;
    drafted += a.round_trees[r].tokens.size() > 1;
  }
  EXPECT_GE(drafted, 3);
  fs::remove_all(dir);
}

TEST(CudaEngine, RefusesWhatTheDeviceCannotDo) {
  REQUIRE_GPU();
  const DeepseekV3& m = model_of("k2-bf16");
  CudaTarget gpu(m, 1);
  const Target* t = &gpu;
  EngineOptions opt;
  opt.context = 64;
  Engine eng(*t, opt);
  EngineRequest q;
  q.prompt = prompt_of(m.config(), 5, 0);
  q.gen.decode_form = AttnForm::expanded;
  q.on_event = [](const EngineEvent&) { return true; };
  try {
    eng.submit(std::move(q));
    FAIL() << "the expanded form must be refused on the GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("absorbed"), std::string::npos) << e.what();
  }
  // Single-sequence calls on a target that serves the engine are refused, not mixed into its pool.
  ForwardArgs a;
  const int32_t id = 1;
  a.ids = &id;
  a.n = 1;
  EXPECT_THROW(gpu.forward(a), Error);
}

}  // namespace
}  // namespace kd
