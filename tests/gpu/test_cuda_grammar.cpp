// Constrained decoding on the GPU (issue 20): the engine over CudaTarget with a grammar gives exactly
// the tokens of an AR loop over the GPU target's own logits whose mask is computed by brute force
// (tests/grammar_language.h; no grammar code in the reference). The GPU path differs from the CPU's:
// greedy rows come back as argmax outputs, and where the grammar forbids the argmax the engine fetches
// the row (Target::logits_row) and masks it (the random model's argmax, over a 512-token vocabulary of
// which a handful fit the sentence, is mostly forbidden; the test does not count the branches). Alone,
// batched, and under DDTree with the draft masked and unmasked.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "decode/synthetic_drafter.h"
#include "engine/engine.h"
#include "gpu_test_util.h"
#include "grammar_language.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/deepseek_v3_cuda.h"

namespace kd {
namespace {

const DeepseekV3& host_model() {
  static Checkpoint ck(gpu_test::fixture("k2-bf16"));
  static DeepseekV3 m(ck);
  return m;
}

// The reference over the GPU target's single-sequence forward (host logits of the last row).
test::MaskedResult gpu_reference(CudaTarget& t, const test::GrammarCase& c) {
  t.reset();
  return test::masked_ar_reference(t.config().vocab_size, c.prompt, c.gen, [&](const int32_t* ids, int64_t n, float* logits) {
    ForwardArgs a;
    a.ids = ids;
    a.n = n;
    a.logits = logits;
    t.forward(a);
  });
}

TEST(CudaGrammar, ConstrainedOutputEqualsBruteForceMaskedAROnTheGpu) {
  REQUIRE_GPU();
  CudaTarget ref(host_model(), 128);
  CudaTarget gpu(host_model(), 1);
  ASSERT_TRUE(gpu.device_argmax());
  const auto reference = [&](const test::GrammarCase& c) { return gpu_reference(ref, c); };
  EngineOptions opt;
  opt.context = 128;
  for (int64_t par : {1, 6}) {
    opt.n_parallel = par;
    test::check_constrained_engine(gpu, opt, reference, cat("GPU, ", par, " in parallel"));
  }
  // DDTree under the grammar: a synthetic drafter that knows request 0's answer.
  const auto cs = test::grammar_cases();
  const test::MaskedResult r0 = gpu_reference(ref, cs[0]);
  std::vector<int32_t> truth = cs[0].prompt;
  truth.insert(truth.end(), r0.ids.begin(), r0.ids.end());
  opt.n_parallel = 6;
  opt.spec.budget = 6;
  opt.make_drafter = [truth] {
    return std::make_unique<SyntheticDrafter>(truth, SyntheticDrafter::parse_profile("0.8,0.1"), 6, host_model().config().vocab_size, 3);
  };
  for (bool masked : {true, false}) {
    opt.spec.grammar_draft = masked;
    const auto st = test::check_constrained_engine(gpu, opt, reference, masked ? "GPU DDTree, masked draft" : "GPU DDTree, unmasked draft");
    EXPECT_GT(st[0].accepted, 0);
  }
}

}  // namespace
}  // namespace kd
