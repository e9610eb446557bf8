#include "grammar/gbnf.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace kd::grammar {

namespace {

constexpr int kMaxNesting = 200;  // parentheses deep: the parser recurses per level

bool word_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

class Parser {
 public:
  Parser(std::string_view t, const SpecialTokens& sp) : t_(t), specials_(sp) {}

  Grammar run(std::string_view root) {
    skip();
    if (at_end()) fail("gbnf: the grammar is empty (it needs a '", root, " ::= …' rule)");
    while (!at_end()) {
      const size_t p = pos_;
      const std::string name = word();
      if (name.empty()) error(p, "expected a rule name");
      skip();
      if (!eat("::=")) error(pos_, cat("expected '::=' after the rule name '", name, "'"));
      const int32_t r = b_.rule(name);
      if (b_.defined(r)) error(p, cat("rule '", name, "' is defined twice"));
      parse_alternatives(r, 0);
      if (!at_end()) {
        if (peek() == ')') error(pos_, "unbalanced ')'");
        if (!rule_start()) error(pos_, "expected a rule name or the end of the grammar");
      }
    }
    return b_.finish(root);
  }

 private:
  std::string_view t_;
  const SpecialTokens& specials_;
  size_t pos_ = 0;
  GrammarBuilder b_;
  // Rules made by x*, x+ or x? (body x): a second operator on one of them is folded into it — (x+)+
  // is x+, (x?)? is x?, any other pair is x*, (x*){m,n} is x* — the same language, one parse per
  // text. Stacked, they would nest one rule per operator and leave 2^n parses alive (each a matcher
  // stack); counted, n copies of a nullable repetition leave n.
  struct Simple {
    Sequence body;
    int64_t lo, hi;
  };
  std::unordered_map<int32_t, Simple> simple_;

  bool at_end() const { return pos_ >= t_.size(); }
  char peek() const { return at_end() ? '\0' : t_[pos_]; }

  [[noreturn]] void error(size_t p, const std::string& what) const {
    int line = 1, col = 1;
    for (size_t i = 0; i < p && i < t_.size(); ++i) {
      if (t_[i] == '\n') ++line, col = 1;
      else ++col;
    }
    fail("gbnf: line ", line, " column ", col, ": ", what);
  }

  void skip() {
    while (!at_end()) {
      const char c = t_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (!at_end() && t_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  bool eat(std::string_view s) {
    if (t_.substr(pos_, s.size()) != s) return false;
    pos_ += s.size();
    return true;
  }

  std::string word() {
    const size_t p = pos_;
    while (!at_end() && word_char(t_[pos_])) ++pos_;
    return std::string(t_.substr(p, pos_ - p));
  }

  // Is the text at pos_ `name ::=` (the next rule)?
  bool rule_start() const {
    size_t p = pos_;
    while (p < t_.size() && word_char(t_[p])) ++p;
    if (p == pos_) return false;
    while (p < t_.size() && (t_[p] == ' ' || t_[p] == '\t' || t_[p] == '\n' || t_[p] == '\r')) ++p;
    return t_.substr(p, 3) == "::=";
  }

  // One UTF-8 character of the source as a code point.
  uint32_t utf8_char() {
    const size_t p = pos_;
    const unsigned char c = static_cast<unsigned char>(t_[pos_++]);
    if (c < 0x80) return c;
    int n = c >= 0xF0 && c <= 0xF4 ? 3 : c >= 0xE0 ? 2 : c >= 0xC2 && c < 0xE0 ? 1 : -1;
    if (n < 0) error(p, "invalid UTF-8");
    uint32_t cp = c & (0x3F >> n);
    for (int i = 0; i < n; ++i) {
      if (at_end() || (static_cast<unsigned char>(t_[pos_]) & 0xC0) != 0x80) error(p, "invalid UTF-8");
      cp = (cp << 6) | (static_cast<unsigned char>(t_[pos_++]) & 0x3F);
    }
    static constexpr uint32_t min_of[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < min_of[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) error(p, "invalid UTF-8");
    return cp;
  }

  uint32_t hex(int digits, size_t p) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (at_end()) error(p, "unfinished escape");
      const char c = t_[pos_++];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) error(p, "bad hex digit in escape");
      v = v * 16 + uint32_t(d);
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) error(p, "escape is not a Unicode scalar value");
    return v;
  }

  // A character inside a literal or class (after the opening quote/bracket), escapes decoded.
  uint32_t char_or_escape() {
    const size_t p = pos_;
    if (at_end()) error(p, "unterminated literal or class");
    if (t_[pos_] != '\\') return utf8_char();
    ++pos_;
    if (at_end()) error(p, "unfinished escape");
    const char c = t_[pos_++];
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/': return uint32_t(c);
      case 'x': return hex(2, p);
      case 'u': return hex(4, p);
      case 'U': return hex(8, p);
      default: error(p, cat("unknown escape '\\", c, "'"));
    }
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6)), out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
    }
  }

  // alternatives of rule r, up to ')' (depth > 0) or the next rule / the end (depth 0).
  void parse_alternatives(int32_t r, int depth) {
    for (;;) {
      b_.add_alternative(r, parse_sequence(depth));
      skip();
      if (peek() != '|') return;
      ++pos_;
    }
  }

  Sequence parse_sequence(int depth) {
    Sequence seq;
    for (;;) {
      skip();
      if (at_end() || peek() == '|' || peek() == ')') return seq;
      if (depth == 0 && rule_start()) return seq;
      Sequence item = parse_primary(depth);
      parse_postfixes(item);
      seq.insert(seq.end(), item.begin(), item.end());
    }
  }

  void parse_postfixes(Sequence& item) {
    for (;;) {
      const size_t p = pos_;
      int64_t lo = 0, hi = -1;
      if (eat("*")) {
      } else if (eat("+")) {
        lo = 1;
      } else if (eat("?")) {
        hi = 1;
      } else if (peek() == '{') {
        ++pos_;
        skip();
        auto number = [&]() -> int64_t {
          const size_t q = pos_;
          int64_t v = 0;
          while (!at_end() && t_[pos_] >= '0' && t_[pos_] <= '9') {
            v = v * 10 + (t_[pos_++] - '0');
            if (v > GrammarBuilder::kMaxRepeat) error(q, cat("repetition counts above ", GrammarBuilder::kMaxRepeat, " are not supported"));
          }
          return pos_ == q ? -1 : v;
        };
        lo = number();
        skip();
        if (eat(",")) {
          skip();
          hi = number();
        } else {
          if (lo < 0) error(p, "expected a number in '{…}'");
          hi = lo;
        }
        if (lo < 0) lo = 0;
        skip();
        if (!eat("}")) error(p, "expected '}' closing the repetition");
        if (hi >= 0 && hi < lo) error(p, "repetition {m,n} with n < m");
      } else {
        return;
      }
      if (item.empty()) error(p, "nothing to repeat");
      Sequence body = item;
      if (item.size() == 1 && item[0].kind == Element::rule) {
        if (auto it = simple_.find(item[0].index); it != simple_.end()) {
          // (x{a,b}){lo,hi} with a ≤ 1 ≤ b (x*, x+, x?) is x{a·lo, b·hi}: the counts k·[a, b] for
          // k in [lo, hi] leave no gap. (x*){624} is x*, not 624 copies each keeping a parse alive.
          const Simple& in = it->second;
          body = in.body;
          if (body.size() > 1) {  // written lo times by repeat(): one rule, not lo copies of the run
            const int32_t group = b_.fresh("group");
            b_.add_alternative(group, std::move(body));
            body = {{Element::rule, group}};
          }
          lo *= in.lo;
          hi = hi == 0 ? 0 : hi < 0 || in.hi < 0 ? -1 : hi * in.hi;  // {0}: the empty text, whatever x{a,b}
        }
      }
      const bool simple = lo <= 1 && (hi < 0 || (lo == 0 && hi == 1));
      const int32_t r = b_.repeat(body, lo, hi, "rep");
      if (simple) simple_[r] = {std::move(body), lo, hi};
      item = {{Element::rule, r}};
    }
  }

  Sequence parse_primary(int depth) {
    const size_t p = pos_;
    const char c = peek();
    Sequence out;
    if (c == '"') {
      ++pos_;
      std::string bytes;
      while (peek() != '"') {
        if (at_end()) error(p, "unterminated string literal");
        append_utf8(bytes, char_or_escape());
      }
      ++pos_;
      b_.literal(out, bytes);
      return out;
    }
    if (c == '[') {
      ++pos_;
      const bool negated = eat("^");
      CodepointRanges ranges;
      while (peek() != ']') {
        if (at_end()) error(p, "unterminated character class");
        const uint32_t a = char_or_escape();
        uint32_t z = a;
        if (peek() == '-' && pos_ + 1 < t_.size() && t_[pos_ + 1] != ']') {
          ++pos_;
          z = char_or_escape();
          if (z < a) error(p, "character range is backwards");
        }
        ranges.push_back({a, z});
      }
      ++pos_;
      bool ascii = !negated;
      for (auto [a, z] : ranges) ascii = ascii && z < 0x80;
      if (ascii && !ranges.empty()) {
        ByteSet s;
        for (auto [a, z] : ranges) s.add_range(uint8_t(a), uint8_t(z));
        out.push_back(b_.byte_set(s));
      } else {
        if (ranges.empty() && !negated) error(p, "empty character class");
        out.push_back({Element::rule, b_.char_class(ranges, negated, cat("gbnf: class at offset ", p))});
      }
      return out;
    }
    if (c == '.') {
      ++pos_;
      out.push_back({Element::rule, b_.char_class({{0, 0x10FFFF}}, false, "gbnf: '.'")});
      return out;
    }
    if (c == '(') {
      if (depth + 1 > kMaxNesting) error(p, cat("groups nested deeper than ", kMaxNesting));
      ++pos_;
      Sequence first = parse_sequence(depth + 1);
      skip();
      if (peek() == ')' && first.size() == 1) {  // (x): x itself, so (x+)+ folds as x++ does
        ++pos_;
        return first;
      }
      const int32_t r = b_.fresh("group");
      b_.add_alternative(r, std::move(first));
      if (peek() == '|') {
        ++pos_;
        parse_alternatives(r, depth + 1);
      }
      if (!eat(")")) error(p, "unclosed '('");
      out.push_back({Element::rule, r});
      return out;
    }
    if (c == '!') error(p, "negated token references (!<…>) are not supported");
    if (c == '<') {
      const size_t e = t_.find('>', pos_ + 1);
      if (e == std::string_view::npos) error(p, "unterminated token reference '<…>'");
      const std::string_view inner = t_.substr(pos_ + 1, e - pos_ - 1);
      std::optional<int32_t> id;
      if (inner.size() >= 3 && inner.front() == '[' && inner.back() == ']') {
        int64_t v = 0;
        for (char d : inner.substr(1, inner.size() - 2)) {
          if (d < '0' || d > '9' || v > (int64_t(1) << 30)) error(p, "bad token id in '<[…]>'");
          v = v * 10 + (d - '0');
        }
        id = int32_t(v);
      } else if (specials_) {
        id = specials_(t_.substr(pos_, e - pos_ + 1));
        if (!id) error(p, cat("'", std::string(t_.substr(pos_, std::min<size_t>(e - pos_ + 1, 60))), "' is not a special token of this model"));
      }
      if (!id) error(p, "token references (<…>) need the model's special tokens; the grammar runs on bytes otherwise");
      pos_ = e + 1;
      out.push_back({Element::token, *id});
      return out;
    }
    if (word_char(c)) {
      const std::string name = word();
      out.push_back({Element::rule, b_.rule(name)});
      return out;
    }
    error(p, cat("unexpected character '", std::string(1, c), "'"));
  }
};

}  // namespace

std::string prefix_rules(std::string_view t, std::string_view prefix) {
  // Pass 1: the defined names (a word followed by ::=). Pass 2: rewrite words that are one of them.
  std::vector<std::string> defined;
  auto scan = [&](auto&& on_word) {
    std::string out;
    for (size_t i = 0; i < t.size();) {
      const char c = t[i];
      if (c == '"' || c == '[') {
        const char close = c == '"' ? '"' : ']';
        size_t j = i + 1;
        while (j < t.size() && t[j] != close) j += t[j] == '\\' ? 2 : 1;
        j = std::min(j + 1, t.size());
        out.append(t.substr(i, j - i));
        i = j;
      } else if (c == '<' || c == '#') {
        size_t j = t.find(c == '<' ? '>' : '\n', i);
        j = j == std::string_view::npos ? t.size() : j + 1;
        out.append(t.substr(i, j - i));
        i = j;
      } else if (word_char(c)) {
        size_t j = i;
        while (j < t.size() && word_char(t[j])) ++j;
        out += on_word(std::string(t.substr(i, j - i)), j);
        i = j;
      } else {
        out += c;
        ++i;
      }
    }
    return out;
  };
  scan([&](const std::string& w, size_t end) {
    size_t k = end;
    while (k < t.size() && (t[k] == ' ' || t[k] == '\t' || t[k] == '\n' || t[k] == '\r')) ++k;
    if (t.substr(k, 3) == "::=") defined.push_back(w);
    return w;
  });
  return scan([&](const std::string& w, size_t) {
    return std::find(defined.begin(), defined.end(), w) != defined.end() ? std::string(prefix) + w : w;
  });
}

Grammar parse_gbnf(std::string_view text, std::string_view root, const SpecialTokens& specials) {
  return Parser(text, specials).run(root);
}

}  // namespace kd::grammar
