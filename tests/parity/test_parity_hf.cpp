// Parity with HuggingFace transformers: every fixture under tests/fixtures was made by
// python/make_fixtures.py with transformers 5.17 in fp32 (eager attention and experts); the engine
// must reproduce its teacher-forced logits and its greedy continuation token for token.
//
// Tolerance: max |Δ| / max |ref| ≤ 1e-4 over each logits tensor. Both sides compute in fp32 from the
// same bf16 / INT4 weights, so they differ only by summation order (~1e-6 relative per op through a
// few layers); an fp64 rerun of HF moves the goldens by ≤ 2e-5 absolute. 1e-4 leaves room for that
// and still catches any real formula error (a wrong eps, scale or RoPE layout is ≥ 1e-2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "test_util.h"
#include "model/deepseek_v3.h"
#include "engine/generate.h"

namespace kd {
namespace {

const char* kFixtures[] = {"k2-bf16", "dsv3-group", "k2-int4", "k25-sharded"};

std::string fixture_dir(const std::string& name) { return std::string(KDTREE_FIXTURES) + "/" + name; }

using test::read_tensor;

double rel_err(const float* got, const float* ref, size_t n) {
  double d = 0, m = 0;
  for (size_t i = 0; i < n; ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

class ParityHF : public ::testing::TestWithParam<const char*> {};

TEST_P(ParityHF, TeacherForcedLogits) {
  const std::string dir = fixture_dir(GetParam());
  SafetensorsFile golden(dir + "/golden.safetensors");
  Checkpoint ck(dir);
  DeepseekV3 model(ck);
  const int64_t V = model.config().vocab_size;
  for (const char* which : {"logits", "full_logits"}) {
    std::vector<int32_t> ids = read_tensor<int32_t>(golden, "prompt_ids");
    if (std::string(which) == "full_logits") {
      auto g = read_tensor<int32_t>(golden, "greedy_ids");
      ids.insert(ids.end(), g.begin(), g.end());
    }
    const auto ref = read_tensor<float>(golden, which);
    ASSERT_EQ(ref.size(), ids.size() * size_t(V));
    LatentCache cache = model.new_cache(int64_t(ids.size()));
    std::vector<float> got(ref.size());
    model.forward(cache, ids.data(), int64_t(ids.size()), AttnForm::expanded, true, got.data());
    const double e = rel_err(got.data(), ref.data(), ref.size());
    std::printf("  %s %s: max|d|/max|ref| = %.2e over %zu tokens\n", GetParam(), which, e, ids.size());
    EXPECT_LE(e, 1e-4) << GetParam() << " " << which;
  }
}

TEST_P(ParityHF, GreedyContinuationIsIdentical) {
  const std::string dir = fixture_dir(GetParam());
  SafetensorsFile golden(dir + "/golden.safetensors");
  Checkpoint ck(dir);
  DeepseekV3 model(ck);
  const int64_t V = model.config().vocab_size;
  const auto prompt = read_tensor<int32_t>(golden, "prompt_ids");
  const auto want = read_tensor<int32_t>(golden, "greedy_ids");
  const auto want_logits = read_tensor<float>(golden, "greedy_logits");
  const auto margin = read_tensor<float>(golden, "greedy_margin");
  for (AttnForm form : {AttnForm::absorbed, AttnForm::expanded}) {
    GenerateOptions opt;
    opt.max_new_tokens = int64_t(want.size());
    opt.ignore_eos = true;
    opt.keep_logits = true;
    opt.decode_form = form;
    GenerateResult r = generate_ar(model, prompt, opt);
    ASSERT_EQ(r.output_ids.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(r.output_ids[i], want[i]) << GetParam() << ": step " << i << " differs (HF margin there " << margin[i] << ")";
    EXPECT_LE(rel_err(r.logits.data(), want_logits.data(), want_logits.size()), 1e-4) << GetParam();
    EXPECT_EQ(r.logits.size(), want.size() * size_t(V));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ParityHF, ::testing::ValuesIn(kFixtures),
                         [](const auto& p) { std::string s = p.param; std::replace(s.begin(), s.end(), '-', '_'); return s; });

}  // namespace
}  // namespace kd
