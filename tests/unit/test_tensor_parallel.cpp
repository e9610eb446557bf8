// Tensor parallelism on the CPU (model/deepseek_v3_tp.h, issue 14): R in-process ranks with the host
// communicator run the same sharded math, reductions and argmax exchange as a multi-GPU target. For
// every R the config allows (2, 4 on the HF fixtures; 8 on a made model with 8 heads):
// - DDTree == AR token for token and logit for logit (T = 0 and seeded T > 0, tree and chain, a synthetic
//   and a DFlash drafter);
// - the engine's batched outputs == each request alone, and greedy argmax outputs == host logits;
// - TP R vs TP 1 (and vs HuggingFace's goldens): logits within the parity tolerance, tokens equal
//   except at near-ties — the partial sums of o_proj and each down_proj add in another order.
// Tolerance: max |Δ| / max |ref| ≤ 1e-4 over each logits tensor (tests/parity/test_parity_hf.cpp says
// why: fp32 on both sides from the same weights, only the summation order differs; a real formula or
// slicing error is ≥ 1e-2). Near-tie rule: where tokens differ, the reference's top-2 margin must be
// below 1e-3 × max |logit|, and the test stops comparing that sequence there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <limits>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "decode/dflash_drafter.h"
#include "decode/synthetic_drafter.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "engine_sink.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/deepseek_v3.h"
#include "model/deepseek_v3_tp.h"
#include "model/make_drafter.h"
#include "model/make_model.h"
#include "reference_ar.h"
#include "tp_test_model.h"
#include "model/tp_plan.h"
#include "sample/sampler.h"
#include "test_util.h"

namespace kd {
namespace {

namespace fs = std::filesystem;

std::string fixture_dir(const std::string& name) { return std::string(KDTREE_FIXTURES) + "/" + name; }

struct Loaded {
  std::unique_ptr<Checkpoint> ck;
  std::unique_ptr<DeepseekV3> whole;
  std::map<int32_t, std::unique_ptr<DeepseekV3Tp>> tp;
};
Loaded& loaded(const std::string& dir) {
  static std::map<std::string, Loaded> all;
  Loaded& l = all[dir];
  if (!l.ck) {
    l.ck = std::make_unique<Checkpoint>(dir);
    l.whole = std::make_unique<DeepseekV3>(*l.ck);
  }
  return l;
}
const Target& target_of(const std::string& dir, int32_t R) {
  Loaded& l = loaded(dir);
  if (R == 1) return *l.whole;
  auto& t = l.tp[R];
  if (!t) t = std::make_unique<DeepseekV3Tp>(*l.ck, R);
  return *t;
}

double rel_err(const float* got, const float* ref, size_t n) {
  double d = 0, m = 0;
  for (size_t i = 0; i < n; ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

std::vector<int32_t> prompt_for(const ModelConfig& c, int64_t n, int salt) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 131 + 7 + salt * 37) % c.vocab_size));
  return p;
}

// (model directory, R): every R ≥ 2 the configs allow, as valid_tp_ranks lists them.
struct TpCase {
  std::string dir_name;  // a fixture, or "tp8" for the made model
  int32_t R;
};
void PrintTo(const TpCase& c, std::ostream* os) { *os << c.dir_name << " R=" << c.R; }
std::string dir_of(const TpCase& c) { return c.dir_name == "tp8" ? test::tp8_model_dir() : fixture_dir(c.dir_name); }
std::vector<TpCase> tp_cases() {
  return {{"k2-bf16", 2}, {"k2-bf16", 4}, {"dsv3-group", 2}, {"dsv3-group", 4}, {"k25-sharded", 2}, {"tp8", 2}, {"tp8", 8}};
}
std::string case_name(const ::testing::TestParamInfo<TpCase>& p) {
  std::string s = cat(p.param.dir_name, "_tp", p.param.R);
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

class TensorParallelR : public ::testing::TestWithParam<TpCase> {};

// TP R against TP 1: teacher-forced logits of a prompt (expanded prefill) and a greedy continuation
// (absorbed decode), within the parity tolerance; tokens equal but for near-ties.
TEST_P(TensorParallelR, MatchesOneRankWithinTolerance) {
  const std::string dir = dir_of(GetParam());
  const Target& one = target_of(dir, 1);
  const Target& tp = target_of(dir, GetParam().R);
  const ModelConfig& c = one.config();
  GenerateOptions opt;
  opt.max_new_tokens = 24;
  opt.ignore_eos = true;
  opt.keep_logits = true;
  for (int salt = 0; salt < 3; ++salt) {
    const auto prompt = prompt_for(c, 5 + 6 * salt, salt);
    const GenerateResult a = generate_ar(one, prompt, opt);
    const GenerateResult b = generate_ar(tp, prompt, opt);
    const int64_t V = c.vocab_size;
    size_t same = 0;
    while (same < a.output_ids.size() && a.output_ids[same] == b.output_ids[same]) ++same;
    if (same < a.output_ids.size()) {
      // A near-tie: the one-rank top-2 margin at the first differing step is within rounding.
      std::vector<float> row(a.logits.begin() + int64_t(same) * V, a.logits.begin() + int64_t(same + 1) * V);
      std::vector<float> sorted = row;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      const double scale = *std::max_element(row.begin(), row.end(), [](float x, float y) { return std::fabs(x) < std::fabs(y); });
      EXPECT_LT(sorted[0] - sorted[1], 1e-3 * std::fabs(scale)) << dir << " R=" << GetParam().R << " step " << same << " is no near-tie";
    }
    // Logits of every step both took on the same prefix.
    const size_t n = (same + (same < a.output_ids.size() ? 1 : 0)) * size_t(V);
    EXPECT_LE(rel_err(b.logits.data(), a.logits.data(), n), 1e-4) << dir << " R=" << GetParam().R << " salt " << salt;
    EXPECT_GE(same, a.output_ids.size() / 2) << "most of the continuation should agree exactly";
  }
}

// DDTree over the TP target == AR over the TP target, bits of tokens and logits, for trees and
// chains at T = 0 and seeded T > 0.
TEST_P(TensorParallelR, DDTreeEqualsAR) {
  const std::string dir = dir_of(GetParam());
  const Target& tp = target_of(dir, GetParam().R);
  const ModelConfig& c = tp.config();
  const auto prompt = prompt_for(c, 9, 1);
  struct Sampling { float temp; uint64_t seed; };
  for (Sampling smp : {Sampling{0.0f, 0}, Sampling{0.8f, 3}}) {
    GenerateOptions opt;
    opt.max_new_tokens = test::kSanitized ? 24 : 40;  // ASan: the same paths, fewer rounds (test_util.h)
    opt.ignore_eos = true;
    opt.keep_logits = true;
    opt.sampling.temperature = smp.temp;
    opt.sampling.seed = smp.seed;
    const GenerateResult ar = test::reference_ar(tp, prompt, opt);
    std::vector<int32_t> truth = prompt;
    truth.insert(truth.end(), ar.output_ids.begin(), ar.output_ids.end());
    for (auto [chain, budget] : {std::pair{false, int64_t(16)}, std::pair{false, int64_t(3)}, std::pair{true, int64_t(0)}}) {
      if (test::kSanitized && budget == 3) continue;
      SyntheticDrafter d(truth, SyntheticDrafter::parse_profile("0.6,0.25"), 8, c.vocab_size, 5);
      SpecOptions so;
      so.chain = chain;
      so.budget = budget;
      const SpecResult s = generate_ddtree(tp, d, prompt, opt, so);
      const std::string what = cat(dir, " R=", GetParam().R, " T=", smp.temp, chain ? " chain" : " budget ", budget);
      ASSERT_EQ(s.gen.output_ids, ar.output_ids) << what;
      ASSERT_EQ(s.gen.logits.size(), ar.logits.size()) << what;
      for (size_t i = 0; i < ar.logits.size(); ++i) ASSERT_EQ(s.gen.logits[i], ar.logits[i]) << what << " logit " << i;
      EXPECT_GT(s.stats.accepted, 0) << what;
    }
  }
}

// The engine over the TP target: each of 6 requests in one batch == that request alone in the AR loop
// written out in tests/reference_ar.h (tokens and logits, bit for bit); greedy requests without kept
// logits take the argmax outputs (the ranks' exchange) in the engine and host logits in the reference.
TEST_P(TensorParallelR, EngineBatchEqualsAloneAndArgmaxEqualsLogits) {
  const std::string dir = dir_of(GetParam());
  const Target& tp = target_of(dir, GetParam().R);
  const ModelConfig& c = tp.config();
  std::vector<test::Case> cases;
  for (int k = 0; k < 6; ++k) {
    test::Case cs;
    cs.prompt = prompt_for(c, 3 + 5 * k, k);
    cs.gen.max_new_tokens = 8 + k;
    cs.gen.ignore_eos = true;
    cs.gen.keep_logits = k % 3 != 2;  // k % 3 == 2: greedy argmax outputs
    if (k % 3 == 1) {
      cs.gen.sampling.temperature = 0.9f;
      cs.gen.sampling.seed = uint64_t(40 + k);
    }
    cases.push_back(cs);
  }
  EngineOptions eo;
  eo.n_parallel = 6;
  eo.context = 96;
  eo.prefill_chunk = 7;
  test::Sink sink;
  {
    Engine eng(tp, eo);
    for (size_t k = 0; k < cases.size(); ++k) test::submit_case(eng, sink, k, cases[k]);
    sink.wait_done(cases.size());
  }
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string what = cat(dir, " R=", GetParam().R, " request ", k);
    const GenerateResult alone = test::reference_ar(tp, cases[k].prompt, cases[k].gen);
    const test::Collected got = sink.get(k);
    ASSERT_EQ(got.ids, alone.output_ids) << what;
    ASSERT_EQ(got.logits.size(), alone.logits.size()) << what;
    for (size_t i = 0; i < alone.logits.size(); ++i) ASSERT_EQ(got.logits[i], alone.logits[i]) << what << " logit " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallelR, ::testing::ValuesIn(tp_cases()), case_name);

// HuggingFace's teacher-forced goldens (tests/parity) hold under TP too.
TEST(TensorParallel, HFParityAtEveryValidR) {
  for (const char* name : {"k2-bf16", "dsv3-group", "k25-sharded"}) {
    const std::string dir = fixture_dir(name);
    SafetensorsFile golden(dir + "/golden.safetensors");
    const auto ids = test::read_tensor<int32_t>(golden, "prompt_ids");
    const auto ref = test::read_tensor<float>(golden, "logits");
    const Target& one = target_of(dir, 1);
    for (int32_t R : valid_tp_ranks(one.config())) {
      if (R == 1) continue;
      const Target& tp = target_of(dir, R);
      KvView kv;
      const ModelConfig& c = tp.config();
      const int64_t n = int64_t(ids.size()), D = c.latent_dim();
      std::vector<float> rows(size_t(n * D * c.num_hidden_layers));
      kv.dim = D;
      kv.n_layers = c.num_hidden_layers;
      kv.block_tokens = n;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) kv.ptrs.push_back(rows.data() + l * n * D);
      std::vector<float> got(ref.size());
      std::vector<SeqForward> f(1);
      f[0].kv = kv;
      f[0].args.ids = ids.data();
      f[0].args.n = n;
      f[0].args.form = AttnForm::expanded;
      f[0].args.all_logits = true;
      f[0].args.logits = got.data();
      tp.forward_batch(f);
      const double e = rel_err(got.data(), ref.data(), ref.size());
      std::printf("  %s R=%d: max|d|/max|ref| = %.2e vs HF\n", name, R, e);
      EXPECT_LE(e, 1e-4) << name << " R=" << R;
    }
  }
}

// A DFlash drafter on the TP target's taps (rank 0 hands them over): DDTree == AR.
TEST(TensorParallel, DFlashDrafterEqualsAR) {
  const std::string target_dir = fixture_dir("k2-bf16");
  const std::string draft_dir = (fs::temp_directory_path() / cat("kdtree_test_tp_drafter_", ::getpid())).string();
  make_drafter(target_dir, draft_dir, 5, 2, 4, true);
  const DeepseekV3& whole = *loaded(target_dir).whole;
  for (int32_t R : {2, 4}) {
    const Target& tp = target_of(target_dir, R);
    const auto prompt = prompt_for(tp.config(), 11, 2);
    GenerateOptions opt;
    opt.max_new_tokens = 30;
    opt.ignore_eos = true;
    opt.keep_logits = true;
    const GenerateResult ar = test::reference_ar(tp, prompt, opt);
    for (bool chain : {false, true}) {
      DFlashAdapter d(draft_dir, whole, 128);
      SpecOptions so;
      so.chain = chain;
      so.budget = 6;
      const SpecResult s = generate_ddtree(tp, d, prompt, opt, so);
      ASSERT_EQ(s.gen.output_ids, ar.output_ids) << "R=" << R << (chain ? " chain" : " tree");
      ASSERT_EQ(s.gen.logits, ar.logits) << "R=" << R << (chain ? " chain" : " tree");
    }
  }
  fs::remove_all(draft_dir);
}

// R that does not divide the shapes is refused before anything runs, naming the dimension.
TEST(TensorParallel, RefusesRThatDoesNotDivide) {
  Checkpoint ck(fixture_dir("k2-bf16"));
  try {
    DeepseekV3Tp t(ck, 3);
    FAIL() << "R = 3 over 4 heads was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads"), std::string::npos) << e.what();
  }
  Checkpoint ck4(fixture_dir("k2-int4"));  // 96-wide INT4 experts: 48 columns a rank break the 32-groups
  EXPECT_THROW(DeepseekV3Tp(ck4, 2), Error);
  EXPECT_THROW(DeepseekV3Tp(ck, 1), Error);
}

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// The argmax exchange equals sample()'s greedy choice over the whole row (kd::argmax: the first
// maximum), on rows full of ties across slice boundaries; a NaN in any slice is −1 (sample() refuses
// such a row), a row of −inf reports −inf.
TEST(TensorParallel, ArgmaxExchangeIsTheGreedyChoiceOverTheWholeRow) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    const int32_t R = 2 + trial % 7;
    const int64_t V = R + int64_t(rng() % 40), per = (V + R - 1) / R;
    if ((R - 1) * per >= V) continue;  // the plan refuses a rank without vocabulary
    std::vector<float> row(static_cast<size_t>(V));
    for (auto& x : row) x = float(rng() % 3);  // values in {0, 1, 2}: ties everywhere
    std::vector<RankArgmax> ranks;
    for (int32_t q = 0; q < R; ++q) {
      const int64_t b = q * per, n = std::min(per, V - b);
      ranks.push_back(rank_argmax(row.data() + b, n, b));
    }
    const RankArgmax got = combine_rank_argmax(ranks.data(), R);
    ASSERT_EQ(got.idx, argmax(row.data(), int32_t(V))) << "trial " << trial;
    ASSERT_EQ(got.val, row[size_t(got.idx)]);
    if (trial % 10 == 0) {
      row[size_t(rng() % V)] = std::nanf("");
      ranks.clear();
      for (int32_t q = 0; q < R; ++q) ranks.push_back(rank_argmax(row.data() + q * per, std::min(per, V - q * per), q * per));
      EXPECT_EQ(combine_rank_argmax(ranks.data(), R).idx, -1);
    }
  }
  const std::vector<float> ninf(8, -std::numeric_limits<float>::infinity());
  const RankArgmax a[2] = {rank_argmax(ninf.data(), 4, 0), rank_argmax(ninf.data() + 4, 4, 4)};
  EXPECT_EQ(combine_rank_argmax(a, 2).val, -std::numeric_limits<float>::infinity());
}

}  // namespace
}  // namespace kd
