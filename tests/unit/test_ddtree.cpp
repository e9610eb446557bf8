// DDTree's exactness invariant (DESIGN.md §2): for every fixture target, budget, chain mode,
// greedy and sampled decoding, the speculative output equals plain AR token for token — whatever
// the drafter proposes. The synthetic drafter lets the test choose how often drafts are right:
// the oracle is always right (τ = block size every round, long compactions), a weak profile is
// mostly wrong (short acceptances, many bonus tokens).
#include <gtest/gtest.h>

#include <numeric>

#include "decode/synthetic_drafter.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "engine/generate.h"
#include "test_util.h"

namespace kd {
namespace {

const char* kTargets[] = {"k2-bf16", "dsv3-group", "k2-int4", "k25-sharded"};

std::vector<int32_t> prompt_for(const ModelConfig& c) {
  std::vector<int32_t> p;
  for (int i = 0; i < 7; ++i) p.push_back(int32_t((i * 97 + 5) % c.vocab_size));
  return p;
}

struct ArRun {
  std::vector<int32_t> truth;  // prompt + AR output, indexed by position
  GenerateResult ar;
};

ArRun run_ar(const DeepseekV3& m, const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  ArRun r;
  r.ar = generate_ar(m, prompt, opt);
  r.truth = prompt;
  r.truth.insert(r.truth.end(), r.ar.output_ids.begin(), r.ar.output_ids.end());
  return r;
}

void expect_same(const SpecResult& s, const GenerateResult& ar, const std::string& what) {
  ASSERT_EQ(s.gen.output_ids.size(), ar.output_ids.size()) << what;
  for (size_t i = 0; i < ar.output_ids.size(); ++i) ASSERT_EQ(s.gen.output_ids[i], ar.output_ids[i]) << what << " token " << i;
  EXPECT_EQ(s.gen.finish_reason, ar.finish_reason) << what;
  // Row invariance, directly: each token's logits in the verify pass are AR's, bit for bit.
  if (!ar.logits.empty()) {
    ASSERT_EQ(s.gen.logits.size(), ar.logits.size()) << what;
    for (size_t i = 0; i < ar.logits.size(); ++i) ASSERT_EQ(s.gen.logits[i], ar.logits[i]) << what << " logit " << i;
  }
  // Counting: target forwards = prefill + rounds; every emitted token is an accepted draft or a bonus.
  EXPECT_EQ(s.stats.target_forwards, 1 + s.stats.rounds) << what;
  const int64_t hist = std::accumulate(s.stats.tau_histogram.begin(), s.stats.tau_histogram.end(), int64_t(0));
  EXPECT_EQ(hist, s.stats.rounds) << what;
  EXPECT_LE(s.stats.accepted + s.stats.rounds + 1, int64_t(ar.output_ids.size()) + s.stats.rounds) << what;
  EXPECT_GE(s.stats.accepted + s.stats.rounds + 1, int64_t(ar.output_ids.size())) << what;
}

class DDTreeExact : public ::testing::TestWithParam<const char*> {};

TEST_P(DDTreeExact, EqualsARForBudgetsModesAndSeeds) {
  Checkpoint ck(std::string(KDTREE_FIXTURES) + "/" + GetParam());
  DeepseekV3 m(ck);
  const auto prompt = prompt_for(m.config());
  struct Sampling { float temp; uint64_t seed; };
  // Under ASan (test::kSanitized) a quarter of the sweep: every code path (greedy and sampled, one
  // node, mid and large trees, the chain, a second profile) in 64 tokens instead of 130 — the release
  // build runs it all; the sanitized one spent 22 CPU-minutes here, most of CI's ASan step.
  std::vector<Sampling> samplings = {{0.0f, 0}, {0.8f, 1}};
  if (!test::kSanitized) samplings.push_back({0.8f, 2});
  for (Sampling smp : samplings) {
    GenerateOptions opt;
    opt.max_new_tokens = test::kSanitized ? 64 : 130;
    opt.ignore_eos = true;
    opt.sampling.temperature = smp.temp;
    opt.sampling.seed = smp.seed;
    opt.keep_logits = true;
    const ArRun ar = run_ar(m, prompt, opt);
    struct Case { const char* profile; bool chain; int64_t budget; };
    const Case cases[] = {{"0.6,0.25", false, 1}, {"0.6,0.25", false, 2}, {"0.6,0.25", false, 4}, {"0.6,0.25", false, 16},
                          {"0.6,0.25", false, 64}, {"0.6,0.25", true, 0}, {"0.3,0.3,0.2", false, 16}};
    for (const Case& cs : cases) {
      if (test::kSanitized && (cs.budget == 2 || cs.budget == 4)) continue;
      SyntheticDrafter d(ar.truth, SyntheticDrafter::parse_profile(cs.profile), 8, m.config().vocab_size, 7);
      SpecOptions so;
      so.chain = cs.chain;
      so.budget = cs.budget;
      const SpecResult s = generate_ddtree(m, d, prompt, opt, so);
      expect_same(s, ar.ar, cat(GetParam(), " T=", smp.temp, " seed=", smp.seed, " profile=", cs.profile,
                                cs.chain ? " chain" : " budget=", cs.chain ? 0 : cs.budget));
    }
  }
}

TEST_P(DDTreeExact, OracleAcceptsTheWholeBlockEveryRound) {
  Checkpoint ck(std::string(KDTREE_FIXTURES) + "/" + GetParam());
  DeepseekV3 m(ck);
  const auto prompt = prompt_for(m.config());
  GenerateOptions opt;
  opt.max_new_tokens = 1 + 8 * 16;  // the first token, then 16 full rounds of τ = 8
  opt.ignore_eos = true;
  const ArRun ar = run_ar(m, prompt, opt);
  for (bool chain : {false, true}) {
    SyntheticDrafter d(ar.truth, {1.0}, 8, m.config().vocab_size, 3);
    SpecOptions so;
    so.chain = chain;
    so.budget = 16;
    const SpecResult s = generate_ddtree(m, d, prompt, opt, so);
    expect_same(s, ar.ar, cat(GetParam(), chain ? " oracle chain" : " oracle tree"));
    EXPECT_EQ(s.stats.rounds, 16);
    EXPECT_EQ(s.stats.tau_histogram[8], 16) << "every round accepts all 7 drafts";
    EXPECT_DOUBLE_EQ(s.stats.mean_tau(), double(s.stats.accepted + s.stats.rounds) / double(s.stats.rounds));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DDTreeExact, ::testing::ValuesIn(kTargets),
                         [](const auto& p) { std::string s = p.param; std::replace(s.begin(), s.end(), '-', '_'); return s; });

TEST(DDTree, StopsAtEosLikeAR) {
  Checkpoint ck(std::string(KDTREE_FIXTURES) + "/k2-int4");
  DeepseekV3 m(ck);
  const auto prompt = prompt_for(m.config());
  GenerateOptions opt;
  opt.max_new_tokens = 60;
  opt.ignore_eos = true;
  const ArRun full = run_ar(m, prompt, opt);
  opt.ignore_eos = false;
  opt.stop_ids = {full.ar.output_ids[20]};  // a token that the continuation reaches
  const ArRun ar = run_ar(m, prompt, opt);
  ASSERT_EQ(ar.ar.finish_reason, "stop");
  SyntheticDrafter d(full.truth, {1.0}, 8, m.config().vocab_size, 3);
  const SpecResult s = generate_ddtree(m, d, prompt, opt, SpecOptions{});
  expect_same(s, ar.ar, "eos");
}

}  // namespace
}  // namespace kd

#include <filesystem>

#include "model/make_drafter.h"
#include "decode/dflash_drafter.h"

namespace kd {
namespace {

// With a real (random-weight) DFlash drafter the drafts are mostly wrong, which exercises the
// other end: short acceptances, the drafter's context cache fed round after round, taps of the
// verify pass. The output must still be AR's.
TEST(DDTree, RandomDFlashDrafterStillEqualsAR) {
  for (const char* fx : {"k2-bf16", "k25-sharded"}) {
    const std::string target_dir = std::string(KDTREE_FIXTURES) + "/" + fx;
    const std::string draft_dir =
        (std::filesystem::temp_directory_path() / cat("kdtree_test_drafter_", fx, "_", ::getpid())).string();
    make_drafter(target_dir, draft_dir, 5, 2, 4, true);
    Checkpoint ck(target_dir);
    DeepseekV3 m(ck);
    const auto prompt = prompt_for(m.config());
    for (float temp : {0.0f, 0.8f}) {
      GenerateOptions opt;
      opt.max_new_tokens = 40;
      opt.ignore_eos = true;
      opt.sampling.temperature = temp;
      opt.sampling.seed = 9;
      const GenerateResult ar = generate_ar(m, prompt, opt);
      for (bool chain : {false, true}) {
        DFlashAdapter d(draft_dir, m, 64);
        SpecOptions so;
        so.chain = chain;
        so.budget = 6;
        const SpecResult s = generate_ddtree(m, d, prompt, opt, so);
        expect_same(s, ar, cat(fx, " dflash T=", temp, chain ? " chain" : " tree"));
        // The drafter saw the prompt and every round's accepted tokens except the last round's.
        EXPECT_GE(d.context_len(), int64_t(prompt.size()));
        EXPECT_LT(d.context_len(), int64_t(prompt.size() + ar.output_ids.size()));
      }
    }
    std::filesystem::remove_all(draft_dir);
  }
}

}  // namespace
}  // namespace kd
