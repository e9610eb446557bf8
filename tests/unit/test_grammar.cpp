// The grammar engine's parts (src/grammar/): UTF-8 range encoding checked against every code point,
// GBNF / JSON Schema / regex front ends (their languages on hand-picked sentences, their errors by
// line or JSON path), and the matcher (characters split across tokens, stop ids, the memo reset).
// The masks themselves are compared with xgrammar's in test_grammar_xgrammar.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/regex.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"

namespace {

namespace g = kd::grammar;
using ojson = nlohmann::ordered_json;

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18)), s += char(0x80 | ((cp >> 12) & 0x3F)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// A matcher over a vocabulary of the 256 single bytes plus `extra` tokens, stop id = last.
struct Fixture {
  std::shared_ptr<const g::VocabTrie> vocab;
  int32_t stop = 0;
  explicit Fixture(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> v;
    for (int b = 0; b < 256; ++b) v.push_back(std::string(1, char(b)));
    v.insert(v.end(), extra.begin(), extra.end());
    v.push_back("<eos>");
    std::vector<bool> special(v.size(), false);
    special.back() = true;
    stop = int32_t(v.size() - 1);
    vocab = std::make_shared<const g::VocabTrie>(v, special);
  }
  g::Matcher matcher(const g::Grammar& gr) const {
    return g::Matcher(std::make_shared<const g::CompiledGrammar>(gr), vocab, {stop});
  }
};

// Whether the grammar's language contains `text` (fed byte by byte).
bool accepts(const g::Grammar& gr, const std::string& text) {
  static const Fixture fx;
  g::Matcher m = fx.matcher(gr);
  const auto s = m.advance_bytes(m.state(), text);
  return s != g::Matcher::kDead && m.accepting(s);
}

TEST(Grammar, Utf8RangesCoverExactlyTheScalarValues) {
  // Each range's byte sequences must match exactly the encodings of its code points.
  for (auto [lo, hi] : std::vector<std::pair<uint32_t, uint32_t>>{{0, 0x10FFFF}, {0x7F, 0x800}, {0xD000, 0xE100}, {0x1234, 0x1F600}, {'a', 'a'}}) {
    const auto seqs = g::utf8_ranges(lo, hi);
    auto matched = [&](const std::string& b) {
      int n = 0;
      for (const auto& s : seqs) {
        if (s.size() != b.size()) continue;
        bool ok = true;
        for (size_t i = 0; i < s.size(); ++i) ok = ok && uint8_t(b[i]) >= s[i].first && uint8_t(b[i]) <= s[i].second;
        n += ok;
      }
      return n;
    };
    uint64_t covered = 0;  // byte strings the sequences describe, counted as products of ranges
    for (const auto& s : seqs) {
      uint64_t p = 1;
      for (auto [a, b] : s) p *= uint64_t(b - a + 1);
      covered += p;
    }
    uint64_t scalars = 0;
    for (uint32_t cp = lo; cp <= hi; ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      ++scalars;
      ASSERT_EQ(matched(utf8(cp)), 1) << std::hex << cp;
    }
    EXPECT_EQ(covered, scalars) << std::hex << lo << "-" << hi;  // nothing else (no surrogates, no overlongs)
  }
}

TEST(Grammar, GbnfLanguage) {
  const g::Grammar gr = g::parse_gbnf(R"(
    # a comment
    root ::= item ("," item)*
    item ::= [a-c]+ | "\x41" | num{2,3} | [^\x00-\x7F]
    num  ::= [0-9]
  )");
  for (const char* ok : {"a", "abc,b", "A", "12,345", "é", "中,a"}) EXPECT_TRUE(accepts(gr, ok)) << ok;
  for (const char* bad : {"", "d", "1", "1234", "a,", "ab c", "\xC3"}) EXPECT_FALSE(accepts(gr, bad)) << bad;
  EXPECT_TRUE(accepts(g::parse_gbnf("root ::= .{2}"), "€x"));
  EXPECT_FALSE(accepts(g::parse_gbnf("root ::= .{2}"), "€"));
  EXPECT_TRUE(accepts(g::parse_gbnf("root ::= \"\" | \"x\"?"), ""));
}

TEST(Grammar, GbnfErrorsNameTheProblem) {
  auto msg = [](const char* src) {
    try {
      g::parse_gbnf(src);
    } catch (const kd::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg("root ::= x").find("'x' is used but never defined"), std::string::npos);
  EXPECT_NE(msg("a ::= \"a\"").find("no 'root' rule"), std::string::npos);
  EXPECT_NE(msg("root ::= root \"a\" | \"b\"").find("left-recursive"), std::string::npos);
  EXPECT_NE(msg("root ::= (\"a\"? \"c\"?)* \"b\"").find("left-recursive"), std::string::npos);
  EXPECT_NE(msg("root ::= \"a\"\n  \"b").find("line 2"), std::string::npos);
  EXPECT_NE(msg("root ::= <think>").find("need the model's special tokens"), std::string::npos);
  EXPECT_NE(msg("root ::= !<think>").find("negated"), std::string::npos);
  EXPECT_NE(msg("root ::= [z-a]").find("backwards"), std::string::npos);
  EXPECT_NE(msg("root ::= \"a\"{5,2}").find("n < m"), std::string::npos);
  EXPECT_NE(msg("root ::= \"a\"{99999}").find("above"), std::string::npos);
  EXPECT_NE(msg("root ::= \"a\"\nroot ::= \"b\"").find("defined twice"), std::string::npos);
  EXPECT_NE(msg(("root ::= " + std::string(300, '(')).c_str()).find("nested deeper"), std::string::npos);
  EXPECT_NE(msg("root ::= \"\\q\"").find("unknown escape"), std::string::npos);
}

TEST(Grammar, JsonSchemaLanguage) {
  const ojson schema = ojson::parse(R"({
    "type": "object",
    "properties": {"b": {"type": "integer"}, "a": {"type": "array", "items": {"enum": ["x", null]}, "maxItems": 2},
                   "s": {"type": "string", "pattern": "^q\"[0-9]+$"}},
    "required": ["b"], "additionalProperties": false})");
  g::JsonGrammarOptions compact;
  compact.any_whitespace = false;
  compact.item_separator = ",";
  compact.key_separator = ":";
  const g::Grammar gr = g::json_schema_grammar(schema, compact);
  for (const char* ok : {R"({"b":0})", R"({"b":-12,"a":[]})", R"({"b":3,"a":["x",null]})", R"({"b":1,"s":"q\"42"})"})
    EXPECT_TRUE(accepts(gr, ok)) << ok;
  for (const char* bad : {R"({})", R"({"a":[],"b":1})", R"({"b":01})", R"({"b":-0})", R"({"b":1,"a":["x","x","x"]})",
                          R"({"b":1,"c":2})", R"({"b":1,"s":"q\"4a"})", R"({"b":1, "a":[]})"})
    EXPECT_FALSE(accepts(gr, bad)) << bad;
  // Whitespace anywhere between tokens when asked; a recursive $ref.
  const ojson tree = ojson::parse(R"({"$defs": {"n": {"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                                                 "required": ["k"], "additionalProperties": false}}, "$ref": "#/$defs/n"})");
  const g::Grammar t = g::json_schema_grammar(tree);
  EXPECT_TRUE(accepts(t, "{ \"k\" :\n[ {\"k\": []} ,{\"k\":[{\"k\":[]}]}] }"));
  EXPECT_FALSE(accepts(t, "{\"k\": [{}]}"));
  // Not strict: undeclared properties are allowed (JSON Schema's default), but never a declared name again.
  g::JsonGrammarOptions loose;
  loose.strict = false;
  const g::Grammar l = g::json_schema_grammar(ojson::parse(R"({"type": "object", "properties": {"id": {"type": "integer"}}})"), loose);
  EXPECT_TRUE(accepts(l, R"({"id": 1, "x": [true, {"y": null}], "i": "é"})"));
  EXPECT_TRUE(accepts(l, R"({"idx": 1})"));
  EXPECT_FALSE(accepts(l, R"({"id": 1, "id": 2})"));
}

TEST(Grammar, JsonSchemaErrorsNameThePath) {
  auto msg = [](const char* schema) {
    try {
      g::json_schema_grammar(ojson::parse(schema));
    } catch (const kd::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg(R"({"type": "object", "properties": {"x": {"patternProperties": {}}}})"), "$.properties.x.patternProperties: not supported");
  EXPECT_EQ(msg(R"({"type": "object", "maxProperties": 1})"), "$.maxProperties: not supported");
  EXPECT_EQ(msg(R"({"anyOf": [{"type": "string"}, {"not": {}}]})"), "$.anyOf[1].not: not supported (a grammar cannot take the complement of a schema)");
  EXPECT_NE(msg(R"({"$ref": "#/$defs/missing"})").find("points at nothing"), std::string::npos);
  EXPECT_NE(msg(R"({"$ref": "http://example.com/s.json"})").find("inside the document"), std::string::npos);
  EXPECT_NE(msg(R"({"type": "string", "pattern": "(a)\\1"})").find("$.pattern: regex offset 3"), std::string::npos);
  EXPECT_NE(msg(R"({"type": "array", "minItems": 3, "maxItems": 1})").find("$.maxItems"), std::string::npos);
  EXPECT_NE(msg(R"({"type": "frog"})").find("unknown type"), std::string::npos);
  EXPECT_NE(msg(R"({"type": "object", "required": ["z"]})").find("$.required"), std::string::npos);
  EXPECT_EQ(msg(R"(false)"), "$: the schema 'false' matches nothing");
}

TEST(Grammar, RegexLanguage) {
  const g::Grammar r = g::regex_grammar(R"(\d{2,3}-[A-Z]+(x|yz)*\.[^a-c\n]?)");
  for (const char* ok : {"12-A.", "123-ABC.d", "99-Zxyzx.é", "10-Q."}) EXPECT_TRUE(accepts(r, ok)) << ok;
  for (const char* bad : {"1-A.", "1234-A.", "12-a.", "12-A.b", "12-Ay.", "12-A.dd"}) EXPECT_FALSE(accepts(r, bad)) << bad;
  EXPECT_THROW(g::regex_grammar("a(?=b)"), kd::Error);
  EXPECT_THROW(g::regex_grammar("\\bword"), kd::Error);
  EXPECT_THROW(g::regex_grammar("(ab"), kd::Error);
  EXPECT_THROW(g::regex_grammar("a{2"), kd::Error);
}

TEST(Grammar, MatcherSplitsCharactersAcrossTokensAndAllowsStopAtTheEnd) {
  // "é" = C3 A9 and "中" = E4 B8 AD: the vocabulary has tokens that end and start inside them.
  const Fixture fx({"a\xC3", "\xA9\xE4", "\xB8\xAD", "\xA9"});
  g::Matcher m = fx.matcher(g::parse_gbnf("root ::= \"a\" [é中]+"));
  const int32_t a_c3 = 256, a9_e4 = 257, b8ad = 258, a9 = 259;
  EXPECT_TRUE(m.allowed(m.state(), a_c3));
  EXPECT_FALSE(m.allowed(m.state(), a9));
  EXPECT_FALSE(m.allowed(m.state(), fx.stop));
  ASSERT_TRUE(m.commit(a_c3));
  EXPECT_FALSE(m.accepting());
  EXPECT_TRUE(m.allowed(m.state(), a9));
  EXPECT_TRUE(m.allowed(m.state(), a9_e4));
  EXPECT_FALSE(m.allowed(m.state(), b8ad));
  ASSERT_TRUE(m.commit(a9_e4));
  ASSERT_TRUE(m.commit(b8ad));
  EXPECT_TRUE(m.accepting());
  const auto& mask = m.mask(m.state());
  EXPECT_TRUE((mask[size_t(fx.stop) >> 5] >> (fx.stop & 31)) & 1);
  EXPECT_FALSE(m.finished());  // more characters may follow
  EXPECT_TRUE(m.commit(fx.stop));
  EXPECT_FALSE(m.commit('b'));  // rejected, state unchanged
  EXPECT_TRUE(m.accepting());
  // A mask asked twice in one state is the cached one, and equals a fresh walk.
  g::Matcher m2 = fx.matcher(g::parse_gbnf("root ::= \"a\" [é中]+"));
  m2.commit(a_c3);
  const std::vector<uint32_t> first = m2.mask(m2.state());
  EXPECT_EQ(m2.mask(m2.state()), first);
  EXPECT_EQ(m2.stats().masks_cached, 1);
}

TEST(Grammar, LongGenerationsKeepTheMemoBounded) {
  // 300 nested lists: the stacks grow with depth; the matcher still follows a deep, long document.
  const Fixture fx;
  g::Matcher m = fx.matcher(g::parse_gbnf("root ::= v\nv ::= \"[\" (v (\",\" v)*)? \"]\" | [0-9]+\n"));
  std::string doc;
  for (int i = 0; i < 300; ++i) doc += "[1,";
  doc += "2";
  for (int i = 0; i < 300; ++i) doc += "]";
  g::Matcher small = fx.matcher(g::parse_gbnf("root ::= v\nv ::= \"[\" (v (\",\" v)*)? \"]\" | [0-9]+\n"));
  small.set_memo_limits(64, 64);
  for (unsigned char c : doc) {
    ASSERT_EQ(small.mask(small.state()), m.mask(m.state())) << "at byte " << int(c);
    ASSERT_TRUE(m.commit(int32_t(c)));
    ASSERT_TRUE(small.commit(int32_t(c)));
  }
  EXPECT_TRUE(m.finished());
  EXPECT_TRUE(small.finished());
  EXPECT_GT(small.stats().resets, 10);  // the small memo was dropped many times, the masks never changed
  EXPECT_EQ(m.stats().resets, 0);
}

}  // namespace

namespace {

TEST(Grammar, SpecialTokenReferences) {
  std::vector<std::string> v;
  for (int b = 0; b < 256; ++b) v.push_back(std::string(1, char(b)));
  v.push_back("<|call|>");  // 256, special
  v.push_back("<eos>");     // 257, special, the stop id
  v.push_back("<|call|>");  // 258: the same bytes as text (not the marker)
  std::vector<bool> special(v.size(), false);
  special[256] = special[257] = true;
  auto vocab = std::make_shared<const g::VocabTrie>(v, special);
  const g::SpecialTokens names = [](std::string_view n) -> std::optional<int32_t> {
    if (n == "<|call|>") return 256;
    return std::nullopt;
  };
  const g::Grammar gr = g::parse_gbnf("root ::= \"x\" <|call|> \"y\"? <[257]>\n", "root", names);
  g::Matcher m(std::make_shared<const g::CompiledGrammar>(gr), vocab, {257});
  EXPECT_FALSE(m.allowed(m.state(), 256));
  ASSERT_TRUE(m.commit('x'));
  const auto& mask = m.mask(m.state());
  EXPECT_TRUE((mask[256 >> 5] >> (256 & 31)) & 1);
  EXPECT_FALSE((mask[258 >> 5] >> (258 & 31)) & 1);  // the marker's text is not the marker
  EXPECT_FALSE(m.allowed(m.state(), '<'));
  ASSERT_TRUE(m.commit(256));
  ASSERT_TRUE(m.commit('y'));
  EXPECT_FALSE(m.accepting());  // <[257]> must still come, and is both named and the stop id
  ASSERT_TRUE(m.commit(257));
  EXPECT_TRUE(m.finished());
  EXPECT_THROW(g::parse_gbnf("root ::= <|nope|>", "root", names), kd::Error);
  EXPECT_THROW(g::parse_gbnf("root ::= <|call|>"), kd::Error);  // no resolver: bytes only
  // A token id that is not special is refused when the matcher is made.
  EXPECT_THROW(g::Matcher(std::make_shared<const g::CompiledGrammar>(g::parse_gbnf("root ::= <[65]>")), vocab, {257}), kd::Error);
}

// The fuzzer's grammar timeouts (tests/fuzz/corpus/grammar/regress-stacked-*): stacked or nested
// repetitions keep one matcher stack per way of splitting the text, 2^n of them. Stacked operators
// fold to one repetition of the same language; what cannot fold (the ambiguity spread over rules) is
// refused with a kd::Error once too many parses are alive, and reconverging empty paths are walked
// once. Each case here ran for minutes (or never ended) before.
TEST(Grammar, AmbiguousRepetitionsFoldOrAreRefusedNeverExponential) {
  const std::string pluses(80, '+');
  const std::string many_a(200, 'a');
  // x++…+ is x+, (x?)? is x?, any other stacked pair is x*; a group of one element is that element.
  const g::Grammar plus = g::parse_gbnf(kd::cat("root ::= \"a\"", pluses, " \"b\""));
  EXPECT_TRUE(accepts(plus, kd::cat(many_a, "b")));
  EXPECT_TRUE(accepts(plus, "ab"));
  EXPECT_FALSE(accepts(plus, "b"));
  std::string nested = "\"a\"";
  for (int i = 0; i < 60; ++i) nested = kd::cat("(", nested, i % 3 == 0 ? ")*" : i % 3 == 1 ? ")+" : ")?");
  const g::Grammar star = g::parse_gbnf(kd::cat("root ::= ", nested, " \"b\""));
  EXPECT_TRUE(accepts(star, "b"));
  EXPECT_TRUE(accepts(star, kd::cat(many_a, "b")));
  const g::Grammar opt = g::parse_gbnf("root ::= \"a\"?????????????????????? \"b\"");
  EXPECT_TRUE(accepts(opt, "ab"));
  EXPECT_TRUE(accepts(opt, "b"));
  EXPECT_FALSE(accepts(opt, "aab"));
  EXPECT_TRUE(accepts(g::parse_gbnf("root ::= (\"a\"?)* \"b\""), "aab"));  // was refused as left-recursive
  EXPECT_TRUE(accepts(g::regex_grammar("((((a*)*)+)?)*b"), kd::cat(many_a, "b")));
  EXPECT_TRUE(accepts(g::regex_grammar("((((a*)*)+)?)*b"), "b"));
  // The same ambiguity through named rules does not fold: the matcher refuses it, naming why.
  std::string rules = "r0 ::= \"a\"+\n";
  for (int i = 1; i <= 40; ++i) rules += kd::cat("r", i, " ::= r", i - 1, "+\n");
  rules += "root ::= r40 \"b\"\n";
  const Fixture fx;
  g::Matcher m = fx.matcher(g::parse_gbnf(rules));
  try {
    for (int i = 0; i < 64; ++i) m.advance_bytes(m.state(), many_a.substr(0, size_t(i)));
    ADD_FAILURE() << "40 stacked repetitions over named rules were matched, not refused";
  } catch (const g::LimitError& e) {  // the request's fault: the server answers 400
    EXPECT_NE(std::string(e.what()).find("too ambiguous"), std::string::npos) << e.what();
  }
  // Nested counted repetitions: folded or not, matched or refused, in bounded time.
  std::string counted = "[0-9]";
  for (int i = 0; i < 30; ++i) counted += "{1,3}";
  try {
    g::Matcher c = fx.matcher(g::parse_gbnf(kd::cat("root ::= ", counted)));
    c.advance_bytes(c.state(), std::string(40, '7'));
  } catch (const g::LimitError& e) {
    EXPECT_NE(std::string(e.what()).find("too ambiguous"), std::string::npos) << e.what();
  }
  // 60 groups that each match "" two ways: one closure, 2^60 paths to the same stacks.
  std::string empties;
  for (int i = 0; i < 60; ++i) empties += "(\"\" | \"\") ";
  const g::Grammar e2 = g::parse_gbnf(kd::cat("root ::= ", empties, "\"a\""));
  EXPECT_TRUE(accepts(e2, "a"));
  EXPECT_FALSE(accepts(e2, "aa"));
}

// x x … x "b" with x ::= "a"* (n copies; named rules do not fold): after k a's, every copy may be
// the one reading — n stacks alive, each of whose closures walks the copies after it. One visited
// set per step makes a byte cost O(n) items, not O(n²) (fuzz_grammar's slow unit [a-z]+.H*{624},
// before counted repetitions of x* folded too).
TEST(Grammar, APileUpOfNullableRepetitionsCostsLinearWorkAByte) {
  const Fixture fx;
  auto items_for = [&](int n) {
    std::string src = "root ::= ";
    for (int i = 0; i < n; ++i) src += "x ";
    g::Matcher m = fx.matcher(g::parse_gbnf(src + "\"b\"\nx ::= \"a\"*\n"));
    const int64_t before = m.stats().closure_items;
    const auto s = m.advance_bytes(m.state(), std::string(20, 'a') + "b");
    EXPECT_TRUE(m.accepting(s)) << n;
    return m.stats().closure_items - before;
  };
  const int64_t small = items_for(100), large = items_for(800);
  // Linear: 8× the copies, ≈ 8× the items; quadratic would be 64×.
  EXPECT_LT(large, 12 * small) << small << " items for 100 copies, " << large << " for 800";
}

// A counted repetition of x*, x+ or x? is one repetition of x ((x*){624} is x*, (x?){3} is x{0,3}):
// the language is PCRE2's for the same pattern (an independent matcher), and the grammar stays small.
TEST(Grammar, CountedRepetitionsOfARepetitionFoldAndMatchAsPcre2Does) {
  for (const char* pat : {"(a*){3}b", "(a?){3}b", "(a+){2,3}b", "(a+){0,2}b", "(a*){0}b", "(a?){2,}b", "((a?){2}){3}b",
                          "((a+){2})?b", "(a?)+b", "(a+)?b", "(a*){1,4}b"}) {
    const g::Grammar gr = g::regex_grammar(pat);
    const kd::Regex ref(kd::cat("(?:", pat, ")\\z"));
    for (int k = 0; k <= 9; ++k) {
      const std::string text = std::string(size_t(k), 'a') + "b";
      EXPECT_EQ(accepts(gr, text), ref.match_prefix(text)) << pat << " on " << text;
    }
  }
  const g::Grammar pile = g::regex_grammar("(H*){624}");
  size_t elems = 0;
  for (const auto& rule : pile.rules)
    for (const g::Sequence& alt : rule) elems += alt.size();
  EXPECT_LT(elems, 50u) << "(H*){624} was written out, not folded into H*";
  // A folded body of several elements is one rule, written lo times as a call, not lo copies of the
  // run: ("<300 bytes>"+){4000} is 4000 calls (its 1.2 M bytes written out were past kMaxElements).
  const std::string lit(300, 'q');
  const g::Grammar wide = g::parse_gbnf(kd::cat("root ::= (\"", lit, "\"+){4000}"));
  size_t wide_elems = 0;
  for (const auto& rule : wide.rules)
    for (const g::Sequence& alt : rule) wide_elems += alt.size();
  EXPECT_LT(wide_elems, 20000u);
  const g::Grammar abc = g::parse_gbnf("root ::= (\"abc\"+){3}");
  EXPECT_TRUE(accepts(abc, "abcabcabc"));
  EXPECT_TRUE(accepts(abc, "abcabcabcabc"));
  EXPECT_FALSE(accepts(abc, "abcabc"));
  EXPECT_FALSE(accepts(abc, "abcab"));
}

// Matching is bounded whatever the grammar (masks run on the serving thread): every parser step is
// paid from a budget; past it, a kd::Error naming the cause; within it, the same mask as without one.
TEST(Grammar, AMaskPastTheWorkBudgetIsAClearError) {
  std::vector<std::string> extra;
  for (int i = 0; i < 400; ++i) extra.push_back(std::string(size_t(2 + i % 7), char('a' + i % 3)));
  const Fixture fx(extra);
  const g::Grammar gr = g::regex_grammar("(a|b|c)*(a|b|c)*(a|b|c)*[abc]{3,9}d");
  g::Matcher free_m = fx.matcher(gr);
  const int64_t before = free_m.stats().work;
  const std::vector<uint32_t> want = free_m.mask(free_m.state());
  const int64_t cost = free_m.stats().work - before;
  ASSERT_GT(cost, 100);
  // Closure items are paid, and so are the stacks each advance scans: strictly more than the items.
  EXPECT_GT(cost, free_m.stats().closure_items - before) << "only closure items were paid for";
  g::Matcher enough = fx.matcher(gr);
  enough.set_work_limits(cost, 0);
  EXPECT_EQ(enough.mask(enough.state()), want);
  g::Matcher tight = fx.matcher(gr);
  tight.set_work_limits(cost / 4, 0);
  try {
    tight.mask(tight.state());
    ADD_FAILURE() << "a mask of " << cost << " steps ran on a budget of " << cost / 4;
  } catch (const g::LimitError& e) {
    EXPECT_NE(std::string(e.what()).find("parser steps"), std::string::npos) << e.what();
  }
}

// The budget refills by the per-token allowance at each commit: an allowance of the dearest step
// runs a walk to its end; a smaller one fails it at the step where a token bucket fed the walk's
// measured costs runs dry — a hostile grammar costs the serving thread a bounded amount a token.
TEST(Grammar, TheWorkBudgetRefillsAtEachCommittedToken) {
  std::vector<std::string> extra;
  for (int i = 0; i < 200; ++i) extra.push_back(std::string(size_t(1 + i % 5), char('a' + i % 3)));
  const Fixture fx(extra);
  // Counting (each step a new state) through an ambiguous prefix: every mask is a fresh walk.
  const g::Grammar gr = g::regex_grammar("(a|b|c)*(a|b|c)*(a|b|c)*[abc]{40}d");
  const int steps = 30;
  std::vector<int64_t> cost;  // the work of each step's mask + commit, without a budget
  {
    g::Matcher m = fx.matcher(gr);
    for (int i = 0; i < steps; ++i) {
      const int64_t w0 = m.stats().work;
      m.mask(m.state());
      ASSERT_TRUE(m.commit(int32_t('a' + i % 3))) << "step " << i;
      cost.push_back(m.stats().work - w0);
    }
  }
  const int64_t most = *std::max_element(cost.begin(), cost.end()), least = *std::min_element(cost.begin() + 1, cost.end());
  ASSERT_GT(least, 50) << "each step must cost something for the test to mean anything";

  {  // an allowance of the dearest step: the walk runs to the end on a burst of one step
    g::Matcher m = fx.matcher(gr);
    m.set_work_limits(most, most);
    for (int i = 0; i < steps; ++i) {
      m.mask(m.state());
      ASSERT_TRUE(m.commit(int32_t('a' + i % 3))) << "step " << i;
    }
  }
  {  // a smaller allowance: fails at the step where the bucket, run on the measured costs, empties
    // The bucket on the measured costs: the step it empties at (−1: never), with and without refill.
    auto empties_at = [&](int64_t burst, int64_t per) {
      for (int64_t i = 0, left = burst; i < steps; ++i) {
        if ((left -= cost[size_t(i)]) < 0) return int(i);
        left = std::min(burst, left + per);
      }
      return -1;
    };
    const int64_t burst = most;
    const int no_refill = empties_at(burst, 0);
    // The largest allowance under which the walk still fails, at least 3 steps later than without
    // refill (so that the step it fails at shows the refill).
    int64_t per = most;
    while (per > 0 && !(empties_at(burst, per) >= no_refill + 3)) per -= std::max<int64_t>(1, most / 64);
    ASSERT_GT(per, 0) << "no allowance separates refill from none on these costs";
    const int want = empties_at(burst, per);
    g::Matcher m = fx.matcher(gr);
    m.set_work_limits(burst, per);
    int failed_at = -1;
    for (int i = 0; i < steps && failed_at < 0; ++i) {
      try {
        m.mask(m.state());
        m.commit(int32_t('a' + i % 3));
      } catch (const g::LimitError& e) {
        EXPECT_NE(std::string(e.what()).find("parser steps"), std::string::npos) << e.what();
        failed_at = i;
      }
    }
    EXPECT_EQ(failed_at, want);
  }
}

// Building a grammar takes neither a pass nor a stack frame per rule: a chain of 150,000 named
// rules (2.8 MB of GBNF, under the server's body limit) ran the nullable fixpoint once per link and
// recursed once per link in the left-recursion check — 139 s, then a stack overflow (SIGSEGV) that
// took the server down. Now it builds, and the same chain made left-recursive is refused by name.
TEST(Grammar, AChainOfManyRulesBuildsWithoutDeepRecursion) {
  const int n = 150000;
  std::string chain;
  for (int i = 0; i < n; ++i) chain += kd::cat("a", i, " ::= a", i + 1, "\n");
  const g::Grammar gr = g::parse_gbnf(kd::cat(chain, "a", n, " ::= \"\"\nroot ::= a0 \"b\"\n"));
  // Matching it walks the whole chain in one step: past Matcher::kMaxClosureItems, a clean refusal.
  try {
    accepts(gr, "b");
    ADD_FAILURE() << "a step of " << n << " nested calls ran past kMaxClosureItems";
  } catch (const g::LimitError& e) {
    EXPECT_NE(std::string(e.what()).find("too large to match"), std::string::npos) << e.what();
  }
  std::string shorter;  // 20,000 links fit in a step
  for (int i = 0; i < 20000; ++i) shorter += kd::cat("a", i, " ::= a", i + 1, "\n");
  const g::Grammar sg = g::parse_gbnf(kd::cat(shorter, "a20000 ::= \"\"\nroot ::= a0 \"b\"\n"));
  EXPECT_TRUE(accepts(sg, "b"));
  EXPECT_FALSE(accepts(sg, "bb"));
  try {
    g::parse_gbnf(kd::cat(chain, "a", n, " ::= a0 \"x\"\nroot ::= a0 \"b\"\n"));
    ADD_FAILURE() << "a left-recursive chain was accepted";
  } catch (const kd::Error& e) {
    EXPECT_NE(std::string(e.what()).find("left-recursive"), std::string::npos) << std::string(e.what()).substr(0, 200);
  }
}

// Tail calls from many sites into one many-alternative rule expand it once per return stack: M call
// sites of an N-alternative rule cost the matcher M + N steps (paid from its budget), not M · N
// unpaid ones (1000 × 1000: 10 s a walk at -O2 before).
TEST(Grammar, TailCallsIntoAWideRuleExpandItOnce) {
  const int m = 1000, n = 1000;
  std::string x = "x ::= r", r = "r ::= q";
  for (int i = 1; i < m; ++i) x += " | r";
  for (int i = 1; i < n; ++i) r += " | q";
  const Fixture fx;
  g::Matcher mt = fx.matcher(g::parse_gbnf(kd::cat("root ::= (\"a\" x){40}\n", x, "\n", r, "\nq ::= \"b\"\n")));
  const int64_t pops0 = mt.stats().closure_pops, work0 = mt.stats().work;
  ASSERT_NE(mt.advance(mt.state(), 'a'), g::Matcher::kDead);
  const int64_t pops = mt.stats().closure_pops - pops0, work = mt.stats().work - work0;
  EXPECT_LT(pops, 4 * (m + n)) << "the closure after 'a' took " << pops << " worklist entries";
  EXPECT_GE(work, pops) << "every entry is paid for";
  EXPECT_TRUE(mt.commit('a') && mt.commit('b') && mt.commit('a'));
}

// A large flat choice (an enum of 10,000 values: every value a parse until its bytes differ) is a
// real grammar, not an attack: its masks stay well inside the work budget. (Scanning a state's
// stacks for a byte costs a few ns each; charged as a full step, 256 bytes × 10,000 stacks spent
// the burst by the second mask.)
TEST(Grammar, ALargeEnumRunsWithinTheWorkBudget) {
  std::string alts;
  for (int i = 0; i < 10000; ++i) alts += kd::cat(i ? " | " : "", "\"w", 10000 + i, "\"");
  const Fixture fx;
  g::Matcher m = fx.matcher(g::parse_gbnf(kd::cat("root ::= ", alts, "\n")));
  for (const char c : std::string("w12345")) {
    const std::vector<uint32_t> mask = m.mask(m.state());
    ASSERT_TRUE((mask[uint8_t(c) >> 5] >> (uint8_t(c) & 31)) & 1) << c;
    ASSERT_TRUE(m.commit(uint8_t(c)));
  }
  EXPECT_TRUE(m.finished());
  EXPECT_LT(m.stats().work, g::Matcher::kWorkBurst / 4) << "6 masks of a 10,000-value enum";
}

TEST(Grammar, PrefixRulesRenamesDefinitionsAndReferencesOnly) {
  EXPECT_EQ(g::prefix_rules("root ::= a \"a b\\\" a\" [a\\]] <a> b # a\na ::= \"x\" ws\nws ::= [ ]*\n", "p-"),
            "p-root ::= p-a \"a b\\\" a\" [a\\]] <a> b # a\np-a ::= \"x\" p-ws\np-ws ::= [ ]*\n");
}

}  // namespace

namespace {

// Greedy longest-match ids of `doc` over the fixture's vocabulary (the 256 bytes always match).
std::vector<int32_t> greedy_ids(const g::VocabTrie& v, const std::string& doc) {
  std::vector<int32_t> ids;
  for (size_t at = 0; at < doc.size();) {
    int32_t best = -1;
    size_t len = 0;
    for (int32_t id = 0; id < v.vocab_size(); ++id) {
      const std::string& t = v.token_bytes(id);
      if (!v.is_special(id) && t.size() > len && doc.compare(at, t.size(), t) == 0) best = id, len = t.size();
    }
    ids.push_back(best);
    at += len;
  }
  return ids;
}

const char* const kToolSchema =
    R"({"type":"object","properties":{"city":{"type":"string"},"unit":{"enum":["celsius","fahrenheit"]},"days":{"type":"integer"},)"
    R"("tags":{"type":"array","items":{"type":"string"}}},"required":["city","unit","days"],"additionalProperties":false})";

TEST(Grammar, SharedMasksEqualEachMatchersOwnWalks) {
  const Fixture fx({"{\"", "\": \"", "\", \"", "\": ", ", \"", "\"]}", "city", "unit", "days", "tags", "celsius", "fahr", "enheit",
                    "Paris", " is", "12", "3}", "\"]", "[\"", "\"}", "é"});
  g::JsonGrammarOptions jo;
  jo.any_whitespace = false;
  auto cg = std::make_shared<const g::CompiledGrammar>(g::json_schema_grammar(ojson::parse(kToolSchema), jo));
  auto shared = std::make_shared<g::SharedMasks>(cg, fx.vocab);
  const std::vector<std::string> docs = {
      R"({"city": "Paris is é", "unit": "celsius", "days": 123})",
      R"({"city": "Lyon", "unit": "fahrenheit", "days": 12, "tags": ["a", "b"]})",
      R"({"city": "Paris", "unit": "celsius", "days": 3})",
  };
  // Each document through a matcher that shares (some with a memo small enough to be dropped and
  // rebuilt under other ids, some without stop ids, as ignore_eos asks) against one that walks alone.
  int64_t shared_hits = 0;
  for (size_t round = 0; round < 2; ++round)
    for (size_t d = 0; d < docs.size(); ++d) {
      const std::vector<int32_t> stops = d % 2 ? std::vector<int32_t>{} : std::vector<int32_t>{fx.stop};
      g::Matcher own(cg, fx.vocab, stops), with(cg, fx.vocab, stops, shared);
      if (d == 2) with.set_memo_limits(8, 8);
      for (int32_t id : greedy_ids(*fx.vocab, docs[d])) {
        ASSERT_EQ(with.mask(with.state()), own.mask(own.state())) << "document " << d << " round " << round << " before token " << id;
        ASSERT_TRUE(own.commit(id));
        ASSERT_TRUE(with.commit(id));
      }
      ASSERT_EQ(with.mask(with.state()), own.mask(own.state()));  // the end: the stop id only with stop ids
      EXPECT_TRUE(own.finished());
      EXPECT_EQ(own.stats().masks_shared, 0);
      if (d == 2) {
        EXPECT_GT(with.stats().resets, 0);
      }
      if (round == 1) {
        EXPECT_EQ(with.stats().masks_computed, 0) << "document " << d << ": every state was walked in round 0";
      }
      if (round == 0 && d == 1) {  // no stop ids: it still finds document 0's masks where neither may end
        EXPECT_GT(with.stats().masks_shared, 5);
      }
      shared_hits += with.stats().masks_shared;
    }
  const g::SharedMasks::Stats st = shared->stats();
  EXPECT_EQ(st.hits, shared_hits);
  EXPECT_GT(st.hits, 40);
  EXPECT_GT(st.entries, 20);

  // Masks for another grammar or vocabulary are refused; a full cache keeps nothing and changes nothing.
  auto other = std::make_shared<const g::CompiledGrammar>(g::parse_gbnf("root ::= \"x\""));
  EXPECT_THROW(g::Matcher(other, fx.vocab, {fx.stop}, shared), kd::Error);
  EXPECT_THROW(g::Matcher(cg, Fixture().vocab, {fx.stop}, shared), kd::Error);
  auto tiny = std::make_shared<g::SharedMasks>(cg, fx.vocab, 16);  // less than one mask
  g::Matcher own(cg, fx.vocab, {fx.stop}), with(cg, fx.vocab, {fx.stop}, tiny);
  for (int32_t id : greedy_ids(*fx.vocab, docs[0])) {
    ASSERT_EQ(with.mask(with.state()), own.mask(own.state()));
    ASSERT_TRUE(own.commit(id) && with.commit(id));
  }
  EXPECT_EQ(tiny->stats().entries, 0);
  EXPECT_EQ(tiny->stats().bytes, 0);
}

TEST(Grammar, SharedMasksFromManyThreadsAtOnce) {
  // Matchers on four threads fill and read one SharedMasks together; each thread's masks equal the
  // ones a lone matcher computes for the same document.
  const Fixture fx({"{\"", "\": \"", "\", \"", "\": ", "city", "unit", "days", "celsius", "fahrenheit"});
  g::JsonGrammarOptions jo;
  jo.any_whitespace = false;
  auto cg = std::make_shared<const g::CompiledGrammar>(g::json_schema_grammar(ojson::parse(kToolSchema), jo));
  const std::vector<std::string> docs = {R"({"city": "A", "unit": "celsius", "days": 1})", R"({"city": "Bb", "unit": "fahrenheit", "days": 22})",
                                         R"({"city": "A", "unit": "fahrenheit", "days": 1, "tags": []})", R"({"city": "", "unit": "celsius", "days": 0})"};
  std::vector<std::vector<std::vector<uint32_t>>> want(docs.size());
  for (size_t d = 0; d < docs.size(); ++d) {
    g::Matcher m(cg, fx.vocab, {fx.stop});
    for (int32_t id : greedy_ids(*fx.vocab, docs[d])) {
      want[d].push_back(m.mask(m.state()));
      ASSERT_TRUE(m.commit(id));
    }
  }
  auto shared = std::make_shared<g::SharedMasks>(cg, fx.vocab);
  std::vector<int> bad(docs.size() * 8, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < docs.size(); ++t)
    threads.emplace_back([&, t] {
      for (size_t rep = 0; rep < 8; ++rep) {
        const size_t d = (t + rep) % docs.size();
        g::Matcher m(cg, fx.vocab, {fx.stop}, shared);
        size_t step = 0;
        for (int32_t id : greedy_ids(*fx.vocab, docs[d])) {
          if (m.mask(m.state()) != want[d][step++]) ++bad[t * 8 + rep];
          m.commit(id);
        }
      }
    });
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < bad.size(); ++i) EXPECT_EQ(bad[i], 0) << "thread " << i / 8 << " run " << i % 8;
  EXPECT_GT(shared->stats().hits, 0);
}

}  // namespace

namespace {

TEST(Grammar, TextSubtreeSkipNeverChangesAMask) {
  // A vocabulary of the 256 bytes plus text tokens (Chinese, accented, emoji, cut inside a character,
  // starting with a continuation byte, with a quote or a backslash inside): along random walks the
  // masks with the text-subtree skip equal the full walk's, in grammars whose strings take every
  // character, all but one, or Latin-1 only (GBNF classes are of code points).
  const Fixture fx({"中文", "中", "文字", "é", "ée", "\xE4\xB8", "\xAD", "\xAD\xE6\x96\x87", "😀", "\xF0\x9F", "a中\"", "中\\n", "\" ",
                    "abc", "ab\"}", "\xC0\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\x7F", "é\"", "\"x"});
  g::JsonGrammarOptions jo;
  jo.any_whitespace = false;
  const std::vector<std::pair<std::string, g::Grammar>> grammars = {
      {"schema", g::json_schema_grammar(ojson::parse(R"({"type":"object","properties":{"a":{"type":"string"},"b":{"type":"array",)"
                                                     R"("items":{"type":"string","maxLength":3}}},"required":["a","b"]})"),
                                        jo)},
      {"all but one ideograph", g::parse_gbnf("root ::= \"\\\"\" [^\"\\\\文]* \"\\\"\"")},
      {"every character", g::parse_gbnf("root ::= \"\\\"\" [^\"\\\\]* \"\\\"\"")},
      {"Latin-1 only", g::parse_gbnf("root ::= \"\\\"\" [ -!#-\\[\\]-~\\xA0-\\xFF]* \"\\\"\"")},
      {"json_object", g::parse_gbnf(g::json_object_gbnf(jo))},
  };
  std::mt19937 rng(7);
  for (const auto& [name, gr] : grammars) {
    auto cg = std::make_shared<const g::CompiledGrammar>(gr);
    int64_t skipped_nodes = 0, full_nodes = 0;
    for (int walk = 0; walk < 40; ++walk) {
      g::Matcher skip(cg, fx.vocab, {fx.stop}), full(cg, fx.vocab, {fx.stop});
      full.set_text_skip(false);
      for (int step = 0; step < 30; ++step) {
        const std::vector<uint32_t> m = skip.mask(skip.state());
        ASSERT_EQ(m, full.mask(full.state())) << name << " walk " << walk << " step " << step;
        // And token by token against allowed(), which follows each token's own bytes (no trie walk).
        std::vector<int32_t> ok;
        for (int32_t id = 0; id < fx.vocab->vocab_size(); ++id) {
          const bool bit = (m[size_t(id) >> 5] >> (id & 31)) & 1;
          ASSERT_EQ(bit, full.allowed(full.state(), id)) << name << " walk " << walk << " step " << step << " token " << id;
          if (bit && id != fx.stop) ok.push_back(id);
        }
        if (ok.empty()) break;
        // Prefer the multi-byte tokens, so walks stay inside strings with text in them.
        std::vector<int32_t> rich;
        for (int32_t id : ok)
          if (id >= 256) rich.push_back(id);
        const std::vector<int32_t>& pick = !rich.empty() && rng() % 3 ? rich : ok;
        const int32_t id = pick[rng() % pick.size()];
        ASSERT_TRUE(skip.commit(id));
        ASSERT_TRUE(full.commit(id));
      }
      skipped_nodes += skip.stats().trie_nodes_visited, full_nodes += full.stats().trie_nodes_visited;
    }
    if (name == "schema" || name == "every character") {
      EXPECT_LT(skipped_nodes, full_nodes) << name << ": the skip never applied";
    }
  }
}

}  // namespace
