// The constrained-decoding check shared by tests/unit/test_grammar_engine.cpp (CPU) and
// tests/gpu/test_cuda_grammar.cpp (GPU): a 512-token vocabulary over a finite grammar whose language
// is enumerated here, and the reference — an AR loop over a target's own logits whose mask is computed
// by brute force (a token is allowed iff some sentence starts with the text so far plus its bytes; no
// grammar code involved), sampled with sample() and position-keyed uniforms as the engine samples.
#pragma once
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "decode/generate.h"
#include "engine/engine.h"
#include "engine_sink.h"
#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "sample/rng.h"
#include "sample/sampler.h"

namespace kd::test {

constexpr int32_t kGrammarStop = 511;  // the vocabulary's one special token, the stop id

// 512 tokens: every single byte, then strings over the grammar's alphabet (so several tokens may
// cover one sentence in different ways, and some span the separator).
inline std::vector<std::string> grammar_vocab_bytes() {
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

inline const char* kLanguageGrammar = "root ::= (\"yes\" | \"no\") \", \" [0-9]{1,3} \"!\"\n";

// The grammar's language, written out: (yes|no), then 1–3 digits, then "!".
inline const std::vector<std::string>& grammar_language() {
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

inline bool language_viable(const std::string& prefix) {
  for (const auto& s : grammar_language())
    if (s.compare(0, prefix.size(), prefix) == 0) return true;
  return false;
}
inline bool language_complete(const std::string& t) {
  return std::find(grammar_language().begin(), grammar_language().end(), t) != grammar_language().end();
}
inline bool language_extensible(const std::string& t) {
  for (const auto& s : grammar_language())
    if (s.size() > t.size() && s.compare(0, t.size(), t) == 0) return true;
  return false;
}

struct MaskedResult {
  std::vector<int32_t> ids;
  std::string finish;
};

// forward(ids, n, logits): the target's forward over n new tokens after the committed ones, the
// last row's logits [vocab] into logits. pos0: the prompt's length (the first sampled position).
inline MaskedResult masked_ar_reference(int64_t V, const std::vector<int32_t>& prompt, const GenerateOptions& g,
                                        const std::function<void(const int32_t*, int64_t, float*)>& forward) {
  const auto vb = grammar_vocab_bytes();
  std::vector<float> logits(static_cast<size_t>(V));
  forward(prompt.data(), int64_t(prompt.size()), logits.data());
  int64_t pos = int64_t(prompt.size());
  MaskedResult r;
  std::string text;
  for (;;) {
    for (int32_t t = 0; t < int32_t(V); ++t) {
      const bool ok = t == kGrammarStop ? language_complete(text) : language_viable(text + vb[size_t(t)]);
      if (!ok) logits[size_t(t)] = -INFINITY;
    }
    const int32_t tok = sample(logits.data(), int32_t(V), g.sampling, position_uniform(g.sampling.seed, g.seq_id, uint64_t(pos)));
    r.ids.push_back(tok);
    if (tok == kGrammarStop) return r.finish = "stop", r;
    text += vb[size_t(tok)];
    if (language_complete(text) && !language_extensible(text)) return r.finish = "stop", r;
    if (int64_t(r.ids.size()) >= g.max_new_tokens) return r.finish = "length", r;
    forward(&tok, 1, logits.data());
    ++pos;
  }
}

inline grammar::GrammarSpec language_spec() {
  static grammar::GrammarSpec s = [] {
    const auto vb = grammar_vocab_bytes();
    std::vector<bool> special(vb.size(), false);
    special[kGrammarStop] = true;
    grammar::GrammarSpec g;
    g.grammar = std::make_shared<const grammar::CompiledGrammar>(grammar::parse_gbnf(kLanguageGrammar));
    g.vocab = std::make_shared<const grammar::VocabTrie>(vb, special);
    return g;
  }();
  return s;
}

struct GrammarCase {
  std::vector<int32_t> prompt;
  GenerateOptions gen;
};

// Six requests: greedy and seeded T = 0.9, the last cut at 2 tokens (before any sentence can end).
inline std::vector<GrammarCase> grammar_cases() {
  std::vector<GrammarCase> cs;
  for (int k = 0; k < 6; ++k) {
    GrammarCase c;
    for (int i = 0; i < 3 + k; ++i) c.prompt.push_back(int32_t((17 * i + 31 * k + 5) % 500));
    c.gen.max_new_tokens = k == 5 ? 2 : 24;
    c.gen.stop_ids = {kGrammarStop};
    c.gen.sampling.temperature = k % 3 == 0 ? 0.0f : 0.9f;
    c.gen.sampling.seed = uint64_t(100 + k);
    cs.push_back(c);
  }
  return cs;
}

// Every case submitted at once to an engine over `target` with the grammar; each output must equal
// reference(case) token for token with its finish reason, grammar_incomplete must say whether the text
// is a sentence, most sentences end ("stop") and the 2-token case is cut ("length"). With `shared`,
// every request reads and fills those masks (as the server's requests with one schema do). Returns
// every request's stats.
inline std::vector<RequestStats> check_constrained_engine(const Target& target, const EngineOptions& opt,
                                                          const std::function<MaskedResult(const GrammarCase&)>& reference,
                                                          const std::string& what,
                                                          std::shared_ptr<grammar::SharedMasks> shared = nullptr) {
  const auto cs = grammar_cases();
  Sink sink;
  std::vector<bool> incomplete(cs.size(), false);
  {
    Engine eng(target, opt);
    for (size_t k = 0; k < cs.size(); ++k) {
      EngineRequest r;
      r.prompt = cs[k].prompt;
      r.gen = cs[k].gen;
      r.grammar = language_spec();
      r.grammar.masks = shared;
      auto cb = sink.callback(k);
      r.on_event = [cb, k, &incomplete](const EngineEvent& ev) {
        if (ev.done) incomplete[k] = ev.grammar_incomplete;
        return cb(ev);
      };
      eng.submit(std::move(r));
    }
    sink.wait_done(cs.size());
  }
  const auto vb = grammar_vocab_bytes();
  int n_stop = 0;
  for (size_t k = 0; k < cs.size(); ++k) {
    const MaskedResult ref = reference(cs[k]);
    const Collected got = sink.get(k);
    n_stop += ref.finish == "stop";
    EXPECT_EQ(got.ids, ref.ids) << what << " request " << k;
    EXPECT_EQ(got.finish_reason, ref.finish) << what << " request " << k;
    std::string text;
    for (int32_t t : got.ids)
      if (t != kGrammarStop) text += vb[size_t(t)];
    EXPECT_EQ(incomplete[k], !language_complete(text)) << what << " request " << k << ": '" << text << "'";
    if (ref.finish == "stop") {
      EXPECT_TRUE(language_complete(text)) << text;
    }
  }
  EXPECT_GE(n_stop, 4) << what;                    // most sentences end within 24 tokens…
  EXPECT_EQ(sink.get(5).finish_reason, "length");  // … but not in 2
  EXPECT_TRUE(incomplete[5]);
  std::vector<RequestStats> st;
  for (size_t k = 0; k < cs.size(); ++k) st.push_back(sink.get(k).stats);
  return st;
}

}  // namespace kd::test
