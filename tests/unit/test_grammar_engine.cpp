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
#include "engine_sink.h"
#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "sample/rng.h"
#include "sample/sampler.h"

namespace kd {
namespace {

const DeepseekV3& model() {
  static Checkpoint ck(std::string(KDTREE_FIXTURES) + "/k2-bf16");
  static DeepseekV3 m(ck);
  return m;
}

constexpr int32_t kStop = 511;  // the vocabulary's one special token, the stop id

// 512 tokens: every single byte, then strings over the grammar's alphabet (so several tokens may
// cover one sentence in different ways, and some span the separator).
std::vector<std::string> vocab_bytes() {
  std::vector<std::string> v;
  for (int b = 0; b < 256; ++b) v.push_back(std::string(1, char(b)));
  const char* alphabet = "yesno, 0123456789!";
  std::mt19937 rng(7);
  while (v.size() < 511) {
    std::string s;
    const int len = 1 + int(rng() % 4);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % 18];
    v.push_back(s);
  }
  v.push_back("<|stop|>");
  return v;
}

const char* kGrammar = "root ::= (\"yes\" | \"no\") \", \" [0-9]{1,3} \"!\"\n";

// The grammar's language, written out: (yes|no), then 1–3 digits, then "!".
const std::vector<std::string>& language() {
  static std::vector<std::string> l = [] {
    std::vector<std::string> out;
    for (const char* w : {"yes", "no"})
      for (int n = 1; n <= 3; ++n)
        for (int x = 0; x < int(std::pow(10, n)); ++x) {
          std::string d = std::to_string(x);
          d = std::string(size_t(n) - d.size(), '0') + d;
          out.push_back(std::string(w) + ", " + d + "!");
        }
    return out;
  }();
  return l;
}

bool viable(const std::string& prefix) {
  for (const auto& s : language())
    if (s.compare(0, prefix.size(), prefix) == 0) return true;
  return false;
}
bool complete(const std::string& t) { return std::find(language().begin(), language().end(), t) != language().end(); }
bool extensible(const std::string& t) {
  for (const auto& s : language())
    if (s.size() > t.size() && s.compare(0, t.size(), t) == 0) return true;
  return false;
}

struct Result {
  std::vector<int32_t> ids;
  std::string finish;
};

// The reference: the model's forward, the brute-force mask, sample(), position-keyed uniforms.
Result reference(const std::vector<int32_t>& prompt, const GenerateOptions& g) {
  const DeepseekV3& m = model();
  const auto vb = vocab_bytes();
  const int64_t V = m.config().vocab_size;
  LatentCache cache = m.new_cache(int64_t(prompt.size()) + g.max_new_tokens);
  std::vector<float> logits(static_cast<size_t>(V));
  m.forward(cache, prompt.data(), int64_t(prompt.size()), AttnForm::expanded, false, logits.data());
  Result r;
  std::string text;
  for (;;) {
    for (int32_t t = 0; t < int32_t(V); ++t) {
      const bool ok = t == kStop ? complete(text) : viable(text + vb[size_t(t)]);
      if (!ok) logits[size_t(t)] = -INFINITY;
    }
    const int64_t pos = cache.size();
    const int32_t tok = sample(logits.data(), int32_t(V), g.sampling, position_uniform(g.sampling.seed, g.seq_id, uint64_t(pos)));
    r.ids.push_back(tok);
    if (tok == kStop) return r.finish = "stop", r;
    text += vb[size_t(tok)];
    if (complete(text) && !extensible(text)) return r.finish = "stop", r;
    if (int64_t(r.ids.size()) >= g.max_new_tokens) return r.finish = "length", r;
    m.forward(cache, &tok, 1, g.decode_form, false, logits.data());
  }
}

grammar::GrammarSpec spec() {
  static grammar::GrammarSpec s = [] {
    const auto vb = vocab_bytes();
    std::vector<bool> special(vb.size(), false);
    special[kStop] = true;
    grammar::GrammarSpec g;
    g.grammar = std::make_shared<const grammar::CompiledGrammar>(grammar::parse_gbnf(kGrammar));
    g.vocab = std::make_shared<const grammar::VocabTrie>(vb, special);
    return g;
  }();
  return s;
}

struct Case {
  std::vector<int32_t> prompt;
  GenerateOptions gen;
};

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (int k = 0; k < 6; ++k) {
    Case c;
    for (int i = 0; i < 3 + k; ++i) c.prompt.push_back(int32_t((17 * i + 31 * k + 5) % 500));
    c.gen.max_new_tokens = k == 5 ? 2 : 24;  // the last one is cut before the sentence can end
    c.gen.stop_ids = {kStop};
    c.gen.sampling.temperature = k % 3 == 0 ? 0.0f : 0.9f;
    c.gen.sampling.seed = uint64_t(100 + k);
    cs.push_back(c);
  }
  return cs;
}

// Returns every request's stats.
std::vector<RequestStats> run_and_check(EngineOptions opt, const std::string& what) {
  const auto cs = cases();
  test::Sink sink;
  std::vector<bool> incomplete(cs.size(), false);
  {
    Engine eng(model(), opt);
    for (size_t k = 0; k < cs.size(); ++k) {
      EngineRequest r;
      r.prompt = cs[k].prompt;
      r.gen = cs[k].gen;
      r.grammar = spec();
      auto cb = sink.callback(k);
      r.on_event = [cb, k, &incomplete](const EngineEvent& ev) {
        if (ev.done) incomplete[k] = ev.grammar_incomplete;
        return cb(ev);
      };
      eng.submit(std::move(r));
    }
    sink.wait_done(cs.size());
  }
  const auto vb = vocab_bytes();
  int n_stop = 0;
  for (size_t k = 0; k < cs.size(); ++k) {
    const Result ref = reference(cs[k].prompt, cs[k].gen);
    const test::Collected got = sink.get(k);
    n_stop += ref.finish == "stop";
    EXPECT_EQ(got.ids, ref.ids) << what << " request " << k;
    EXPECT_EQ(got.finish_reason, ref.finish) << what << " request " << k;
    std::string text;
    for (int32_t t : got.ids)
      if (t != kStop) text += vb[size_t(t)];
    EXPECT_EQ(incomplete[k], !complete(text)) << what << " request " << k << ": '" << text << "'";
    if (ref.finish == "stop") {
      EXPECT_TRUE(complete(text)) << text;
    }
  }
  EXPECT_GE(n_stop, 4) << what;          // most sentences end within 24 tokens…
  EXPECT_EQ(sink.get(5).finish_reason, "length");  // … but not in 2
  EXPECT_TRUE(incomplete[5]);
  std::vector<RequestStats> st;
  for (size_t k = 0; k < cs.size(); ++k) st.push_back(sink.get(k).stats);
  return st;
}

TEST(GrammarEngine, ConstrainedOutputEqualsBruteForceMaskedAR) {
  EngineOptions alone;
  alone.n_parallel = 1;
  alone.context = 128;
  run_and_check(alone, "alone");
  EngineOptions batch = alone;
  batch.n_parallel = 6;
  run_and_check(batch, "batch of 6");
}

TEST(GrammarEngine, DDTreeUnderAGrammarEqualsMaskedAR) {
  const auto cs = cases();
  const Result r0 = reference(cs[0].prompt, cs[0].gen);
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
  r.grammar.grammar = spec().grammar;  // no vocabulary
  r.on_event = [](const EngineEvent&) { return true; };
  EXPECT_THROW(eng.submit(std::move(r)), Error);
}

}  // namespace
}  // namespace kd
