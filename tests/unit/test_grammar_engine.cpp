// Constrained decoding in the engine (issue 20): a request under a grammar gets exactly the tokens of
// an AR loop written here over the model's own forward, whose mask is computed by brute force — the
// grammar's language is finite, enumerated in the test, and a token is allowed iff some sentence
// starts with the text so far plus the token's bytes (no grammar code involved). Greedy and seeded
// sampling, alone, batched and under DDTree (a synthetic drafter that knows the answer), and the
// finish reasons: "stop" where the sentence cannot grow, "length" with grammar_incomplete when
// max_new_tokens cuts it.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "decode/synthetic_drafter.h"
#include "engine/engine.h"
#include "grammar_language.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"

namespace kd {
namespace {

const DeepseekV3& model() {
  static Checkpoint ck(std::string(KDTREE_FIXTURES) + "/k2-bf16");
  static DeepseekV3 m(ck);
  return m;
}

// The reference over the CPU model's own forward (tests/grammar_language.h: the brute-force mask).
test::MaskedResult reference(const std::vector<int32_t>& prompt, const GenerateOptions& g) {
  const DeepseekV3& m = model();
  LatentCache cache = m.new_cache(int64_t(prompt.size()) + g.max_new_tokens);
  bool first = true;
  return test::masked_ar_reference(m.config().vocab_size, prompt, g, [&](const int32_t* ids, int64_t n, float* logits) {
    m.forward(cache, ids, n, first ? AttnForm::expanded : g.decode_form, false, logits);
    first = false;
  });
}

std::vector<RequestStats> run_and_check(const EngineOptions& opt, const std::string& what) {
  return test::check_constrained_engine(model(), opt, [](const test::GrammarCase& c) { return reference(c.prompt, c.gen); }, what);
}

TEST(GrammarEngine, ConstrainedOutputEqualsBruteForceMaskedAR) {
  EngineOptions alone;
  alone.n_parallel = 1;
  alone.context = 128;
  run_and_check(alone, "alone");
  EngineOptions batch = alone;
  batch.n_parallel = 6;
  run_and_check(batch, "batch of 6");
  // The six requests sharing their masks (the server's grammar cache), at once and then again: the
  // same outputs, and the second pass finds masks the first computed.
  const grammar::GrammarSpec spec = test::language_spec();
  auto shared = std::make_shared<grammar::SharedMasks>(spec.grammar, spec.vocab);
  test::check_constrained_engine(model(), batch, [](const test::GrammarCase& c) { return reference(c.prompt, c.gen); }, "shared masks", shared);
  const int64_t first_hits = shared->stats().hits, entries = shared->stats().entries;
  EXPECT_GT(entries, 0);
  test::check_constrained_engine(model(), alone, [](const test::GrammarCase& c) { return reference(c.prompt, c.gen); }, "shared masks again", shared);
  EXPECT_GT(shared->stats().hits, first_hits);
}

TEST(GrammarEngine, DDTreeUnderAGrammarEqualsMaskedAR) {
  const auto cs = test::grammar_cases();
  const test::MaskedResult r0 = reference(cs[0].prompt, cs[0].gen);
  std::vector<int32_t> truth = cs[0].prompt;
  truth.insert(truth.end(), r0.ids.begin(), r0.ids.end());
  EngineOptions opt;
  opt.n_parallel = 6;
  opt.context = 128;
  opt.spec.budget = 6;
  opt.make_drafter = [truth] {
    return std::make_unique<SyntheticDrafter>(truth, SyntheticDrafter::parse_profile("0.8,0.1"), 6, model().config().vocab_size, 3);
  };
  // The same tokens with the draft masked by the grammar (the default) and unmasked; the masked tree
  // spends no node on a token the grammar forbids.
  int64_t acc[2] = {0, 0}, rounds[2] = {0, 0}, drafted[2] = {0, 0};
  for (int masked = 0; masked < 2; ++masked) {
    opt.spec.grammar_draft = masked == 1;
    const auto st = run_and_check(opt, masked ? "ddtree, masked draft" : "ddtree, unmasked draft");
    EXPECT_GT(st[0].accepted, 0);  // the drafter's tokens were accepted under the grammar
    EXPECT_LT(st[0].rounds, st[0].n_generated);
    for (const RequestStats& s : st) acc[masked] += s.accepted, rounds[masked] += s.rounds, drafted[masked] += s.drafted;
  }
  printf("tau (accepted/round + 1) unmasked %.3f (%lld rounds, %lld drafted), masked %.3f (%lld rounds, %lld drafted)\n",
         1.0 + double(acc[0]) / double(rounds[0]), (long long)rounds[0], (long long)drafted[0], 1.0 + double(acc[1]) / double(rounds[1]),
         (long long)rounds[1], (long long)drafted[1]);
  EXPECT_LE(rounds[1], rounds[0]);  // masking never costs rounds here (same drafts, fewer wasted nodes)
}

TEST(GrammarEngine, MismatchedSpecIsRefused) {
  Engine eng(model(), EngineOptions{});
  EngineRequest r;
  r.prompt = {1, 2, 3};
  r.gen.max_new_tokens = 4;
  r.grammar.grammar = test::language_spec().grammar;  // no vocabulary
  r.on_event = [](const EngineEvent&) { return true; };
  EXPECT_THROW(eng.submit(std::move(r)), Error);
}

}  // namespace
}  // namespace kd
