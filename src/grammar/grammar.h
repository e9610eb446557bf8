// A byte-level context-free grammar: the one form every constraint (GBNF, JSON Schema, json_object,
// regular expressions) is compiled to before the matcher runs it (grammar/matcher.h).
//
// Every terminal is a set of bytes, so a Unicode character class becomes alternatives of 1–4 byte
// sets (its UTF-8 encodings) and a token may end or begin in the middle of a character: the
// tokenizers are byte-level BPE (SPEC-MODEL.md §4), and a token boundary inside a character is normal.
// A rule is a list of alternatives; an alternative is a sequence of elements (byte sets and rule
// references). Repetition is rewritten into right-recursive rules, which the matcher runs with tail
// calls, so `x*` costs constant stack depth.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kd::grammar {

// 256 bits, one per byte value.
struct ByteSet {
  std::array<uint64_t, 4> bits{};
  bool has(uint8_t b) const { return (bits[b >> 6] >> (b & 63)) & 1; }
  void add(uint8_t b) { bits[b >> 6] |= uint64_t(1) << (b & 63); }
  void add_range(uint8_t lo, uint8_t hi) {
    for (int b = lo; b <= hi; ++b) add(uint8_t(b));
  }
  bool operator==(const ByteSet&) const = default;
};

struct Element {
  enum Kind : uint8_t { bytes, rule, token };
  Kind kind = bytes;
  int32_t index = 0;  // bytes: index into Grammar::sets; rule: a rule id; token: a special token's id
};

using Sequence = std::vector<Element>;

struct Grammar {
  std::vector<std::string> names;               // [rules] for messages ("root", "value", "root-star-3")
  std::vector<std::vector<Sequence>> rules;     // [rules][alternatives] → elements; an empty sequence matches ""
  std::vector<ByteSet> sets;                    // the distinct terminals
  int32_t root = -1;
};

// Inclusive Unicode scalar value ranges (a character class), e.g. {{'a','z'},{0x4E00,0x9FFF}}.
using CodepointRanges = std::vector<std::pair<uint32_t, uint32_t>>;

// Builds a Grammar; the front ends (gbnf.cpp, json_schema.cpp) call it.
class GrammarBuilder {
 public:
  // The rule called `name`, created (without alternatives) when it does not exist yet.
  int32_t rule(std::string_view name);
  // A new rule named `base-N` (N unique), for repetitions, groups and classes.
  int32_t fresh(std::string_view base);
  void add_alternative(int32_t rule, Sequence seq);
  bool defined(int32_t rule) const { return defined_[size_t(rule)]; }
  const std::string& name(int32_t rule) const { return g_.names[size_t(rule)]; }

  Element byte_set(const ByteSet& s);
  // Appends the bytes of `text` as single-byte elements.
  void literal(Sequence& seq, std::string_view bytes);
  // A rule matching one character of the class (its UTF-8 encodings; surrogates are never matched).
  // negated: every scalar value outside the ranges. Empty (nothing matches) is a kd::Error.
  int32_t char_class(const CodepointRanges& ranges, bool negated, std::string_view what);
  // Rules for repetitions of the sequence `body` (min ≤ count ≤ max; max < 0: unbounded).
  // Counts above kMaxRepeat are a kd::Error (the expansion is written out).
  static constexpr int64_t kMaxRepeat = 4096;
  // Elements in the whole grammar past which building is a kd::Error (nested counted repetitions
  // multiply: a{4096}{4096} would be 16 M elements).
  static constexpr int64_t kMaxElements = 1 << 20;
  int32_t repeat(const Sequence& body, int64_t min, int64_t max, std::string_view base);

  // Checks (every referenced rule defined, no left recursion, the root exists) and returns the
  // grammar; errors name the rule.
  Grammar finish(std::string_view root_name = "root");

 private:
  Grammar g_;
  std::vector<bool> defined_;
  // name → rule and set → index: lookups in constant time, so a grammar of 10^5 rules or sets builds in
  // linear time (a scan of the names per fresh rule was quadratic: minutes for 1 KB of "a"{0,4096}…).
  std::unordered_map<std::string, int32_t> rule_index_;
  std::unordered_map<std::string, int32_t> set_index_;  // the 32 bytes of ByteSet::bits
  int64_t n_fresh_ = 0;
  int64_t n_elements_ = 0;
};

// UTF-8 byte-set sequences covering exactly the scalar values in [lo, hi] (surrogates excluded).
std::vector<std::vector<std::pair<uint8_t, uint8_t>>> utf8_ranges(uint32_t lo, uint32_t hi);

}  // namespace kd::grammar
