// kdtree's grammar masks against xgrammar's, token by token, over the real vocabulary of
// tokenizer-kimi-small (4000 BPE ranks + Kimi's 256 special slots). The fixture
// (tests/fixtures/grammar/xgrammar_masks.json, python/make_grammar_fixtures.py; versions inside)
// holds random walks through JSON schemas (OpenAI-style tools, $ref recursion, anyOf, enum/const,
// lengths, patterns, additional properties), json_object, GBNF grammars (Unicode classes, so tokens
// that end inside a character) and regexes, with xgrammar's mask before every step. Each walk is
// replayed through our converter + matcher and every mask must be identical.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"
#include "tokenizer/tokenizer.h"

namespace {

using json = nlohmann::ordered_json;
namespace g = kd::grammar;

json load_fixture() {
  std::ifstream f(std::string(KDTREE_FIXTURES) + "/grammar/xgrammar_masks.json");
  if (!f) throw std::runtime_error("missing tests/fixtures/grammar/xgrammar_masks.json");
  return json::parse(f);
}

std::vector<bool> unrle(const json& runs, int32_t n) {
  std::vector<bool> bits;
  bool cur = false;
  for (const json& r : runs) {
    bits.insert(bits.end(), r.get<size_t>(), cur);
    cur = !cur;
  }
  if (int32_t(bits.size()) != n) throw std::runtime_error("fixture mask has the wrong length");
  return bits;
}

std::string show(const std::string& bytes) {
  std::string s;
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7F && c != '\\') s += char(c);
    else s += kd::cat("\\x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]);
  }
  return s;
}

g::Grammar grammar_of(const json& c) {
  const std::string kind = c["kind"];
  const json& o = c["options"];
  g::JsonGrammarOptions jo;
  if (o.contains("any_whitespace")) jo.any_whitespace = o["any_whitespace"];
  if (o.contains("separators")) jo.item_separator = o["separators"][0], jo.key_separator = o["separators"][1];
  if (kind == "json_schema") return g::json_schema_grammar(c["schema"], jo);
  if (kind == "json_object") {
    jo.strict = false;
    return g::parse_gbnf(g::json_object_gbnf(jo));
  }
  if (kind == "gbnf") return g::parse_gbnf(c["source"].get<std::string>());
  if (kind == "regex") return g::regex_grammar(c["source"].get<std::string>());
  throw std::runtime_error("unknown case kind " + kind);
}

TEST(GrammarXgrammar, MasksEqualXgrammarAlongRandomWalks) {
  const json fx = load_fixture();
  const auto tok = kd::load_tokenizer(std::string(KDTREE_FIXTURES) + "/" + fx["tokenizer"].get<std::string>());
  auto vocab = std::make_shared<const g::VocabTrie>(g::VocabTrie::from_tokenizer(*tok));
  const int32_t V = fx["vocab_size"];
  ASSERT_EQ(vocab->vocab_size(), V);
  const std::vector<int32_t> stop = fx["stop_ids"];
  int64_t masks = 0;
  for (const json& c : fx["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    std::shared_ptr<const g::CompiledGrammar> cg;
    ASSERT_NO_THROW(cg = std::make_shared<const g::CompiledGrammar>(grammar_of(c))) << name;
    // xgrammar 0.2.9 writes a minLength/maxLength string as [^"\\\r\n]{m,n}: raw control characters
    // (invalid JSON, RFC 8259 §7) and no escapes, where ours is JSON's string. In that case only,
    // tokens holding a control byte or a backslash may differ; nothing else may.
    const bool length_strings = name == "string_lengths" || name == "any_of";
    auto tolerated = [](const std::string& b) {
      for (unsigned char ch : b)
        if (ch < 0x20 || ch == '\\') return true;
      return false;
    };
    int w = 0;
    for (const json& walk : c["walks"]) {
      g::Matcher m(cg, vocab, stop);
      const std::vector<int32_t> tokens = walk["tokens"];
      std::string text;
      for (size_t step = 0; step < walk["masks"].size(); ++step) {
        const std::vector<bool> want = unrle(walk["masks"][step], V);
        const std::vector<uint32_t>& got = m.mask(m.state());
        std::string diff;
        int n_diff = 0;
        for (int32_t id = 0; id < V; ++id) {
          const bool ours = (got[size_t(id) >> 5] >> (id & 31)) & 1;
          if (ours == want[size_t(id)]) continue;
          if (length_strings && tolerated(tok->token_bytes(id))) continue;
          if (++n_diff <= 8) diff += kd::cat("  id ", id, " '", show(tok->token_bytes(id)), "' ", ours ? "allowed by us only" : "allowed by xgrammar only", "\n");
        }
        ++masks;
        ASSERT_EQ(n_diff, 0) << name << " walk " << w << " step " << step << " after '" << show(text) << "': " << n_diff
                             << " tokens differ\n" << diff;
        if (step < tokens.size() && length_strings && tolerated(tok->token_bytes(tokens[step])) &&
            !m.allowed(m.state(), tokens[step]))
          break;  // xgrammar's walk went where JSON does not (see above)
        if (step < tokens.size()) {
          ASSERT_TRUE(m.commit(tokens[step])) << name << ": token " << tokens[step] << " rejected";
          text += tok->token_bytes(tokens[step]);
        }
      }
      ++w;
    }
  }
  EXPECT_GT(masks, 1000);
}

}  // namespace
