#include "grammar/regex.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "grammar/gbnf.h"

namespace kd::grammar {

namespace {

constexpr int kMaxNesting = 100;

class RegexParser {
 public:
  RegexParser(std::string_view p, bool json, const std::string& what) : p_(p), json_(json), what_(what) {}

  std::string run() {
    bool start_anchor = false, end_anchor = false;
    if (!p_.empty() && p_[0] == '^') start_anchor = true, ++pos_;
    std::string body = alternatives(0, &end_anchor);
    if (pos_ < p_.size()) error(pos_, "unbalanced ')'");
    if (!json_) return cat("(", body, ")");
    const std::string any = "json-char*";
    return cat("(", start_anchor ? "" : any + " ", "(", body, ")", end_anchor ? "" : " " + any, ")");
  }

 private:
  std::string_view p_;
  size_t pos_ = 0;
  bool json_;
  const std::string& what_;

  [[noreturn]] void error(size_t at, const std::string& m) const { fail(what_, ": regex offset ", at, ": ", m); }
  bool at_end() const { return pos_ >= p_.size(); }

  std::string alternatives(int depth, bool* end_anchor) {
    std::string out = sequence(depth, end_anchor);
    while (!at_end() && p_[pos_] == '|') {
      ++pos_;
      out += " | " + sequence(depth, end_anchor);
    }
    return out;
  }

  std::string sequence(int depth, bool* end_anchor) {
    std::string out;
    while (!at_end() && p_[pos_] != '|' && p_[pos_] != ')') {
      if (p_[pos_] == '$') {
        // Only at the very end of the pattern (the top level's last alternative).
        if (depth != 0 || pos_ + 1 != p_.size()) error(pos_, "'$' is supported only at the end of the pattern");
        *end_anchor = true;
        ++pos_;
        break;
      }
      if (p_[pos_] == '^') error(pos_, "'^' is supported only at the start of the pattern");
      std::string atom = parse_atom(depth);
      atom = quantified(atom);
      out += (out.empty() ? "" : " ") + atom;
    }
    return out.empty() ? "\"\"" : out;
  }

  std::string quantified(std::string atom) {
    for (;;) {
      if (at_end()) return atom;
      const size_t at = pos_;
      const char c = p_[pos_];
      std::string q;
      if (c == '*' || c == '+' || c == '?') {
        q = std::string(1, c);
        ++pos_;
      } else if (c == '{') {
        size_t e = p_.find('}', pos_);
        if (e == std::string_view::npos) error(at, "unclosed '{'");
        const std::string_view inner = p_.substr(pos_ + 1, e - pos_ - 1);
        const bool ok = !inner.empty() && std::all_of(inner.begin(), inner.end(), [](char x) { return (x >= '0' && x <= '9') || x == ','; }) &&
                        std::count(inner.begin(), inner.end(), ',') <= 1 && inner[0] != ',';
        if (!ok) error(at, "bad repetition '{…}'");
        q = cat("{", inner, "}");
        pos_ = e + 1;
      } else {
        return atom;
      }
      if (!at_end() && p_[pos_] == '?') ++pos_;  // lazy: the same language
      else if (!at_end() && p_[pos_] == '+') error(pos_, "possessive quantifiers are not supported");
      atom = cat("(", atom, ")", q);
    }
  }

  uint32_t hex(size_t n, size_t at) {
    if (pos_ + n > p_.size()) error(at, "unfinished escape");
    uint32_t v = 0;
    for (size_t i = 0; i < n; ++i) {
      const char c = p_[pos_++];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) error(at, "bad hex digit");
      v = v * 16 + uint32_t(d);
    }
    return v;
  }

  uint32_t utf8_char() {
    const size_t at = pos_;
    const unsigned char c = static_cast<unsigned char>(p_[pos_++]);
    if (c < 0x80) return c;
    const int n = c >= 0xF0 && c <= 0xF4 ? 3 : c >= 0xE0 ? 2 : c >= 0xC2 && c < 0xE0 ? 1 : -1;
    if (n < 0) error(at, "invalid UTF-8");
    uint32_t cp = c & (0x3F >> n);
    for (int i = 0; i < n; ++i) {
      if (at_end() || (static_cast<unsigned char>(p_[pos_]) & 0xC0) != 0x80) error(at, "invalid UTF-8");
      cp = (cp << 6) | (static_cast<unsigned char>(p_[pos_++]) & 0x3F);
    }
    return cp;
  }

  // An escape after '\' : a class (\d …) into `ranges` (returns true) or one character in *cp.
  bool escape(CodepointRanges& ranges, uint32_t* cp) {
    const size_t at = pos_ - 1;
    if (at_end()) error(at, "trailing '\\'");
    const char c = p_[pos_++];
    static const CodepointRanges digit = {{'0', '9'}}, word = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}},
                                 space = {{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x2028, 0x2029}, {0xFEFF, 0xFEFF}};
    auto negate = [](const CodepointRanges& r) {
      CodepointRanges out;
      uint32_t next = 0;
      for (auto [a, b] : r) {
        if (a > next) out.push_back({next, a - 1});
        next = b + 1;
      }
      out.push_back({next, 0x10FFFF});
      return out;
    };
    switch (c) {
      case 'd': ranges.insert(ranges.end(), digit.begin(), digit.end()); return true;
      case 'w': ranges.insert(ranges.end(), word.begin(), word.end()); return true;
      case 's': ranges.insert(ranges.end(), space.begin(), space.end()); return true;
      case 'D': { auto n = negate(digit); ranges.insert(ranges.end(), n.begin(), n.end()); return true; }
      case 'W': { auto n = negate(word); ranges.insert(ranges.end(), n.begin(), n.end()); return true; }
      case 'S': { auto n = negate(space); ranges.insert(ranges.end(), n.begin(), n.end()); return true; }
      case 'n': *cp = '\n'; return false;
      case 'r': *cp = '\r'; return false;
      case 't': *cp = '\t'; return false;
      case 'f': *cp = '\f'; return false;
      case 'v': *cp = '\v'; return false;
      case '0': *cp = 0; return false;
      case 'x': *cp = hex(2, at); return false;
      case 'u': *cp = hex(4, at); return false;
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '1' && c <= '9'))
          error(at, cat("'\\", c, "' is not supported (back-references, \\b and the like cannot be compiled to a grammar)"));
        *cp = static_cast<unsigned char>(c);
        return false;
    }
  }

  static std::string hex_escape(uint32_t cp) {
    static const char* h = "0123456789ABCDEF";
    std::string s = "\\U";
    for (int i = 7; i >= 0; --i) s += h[(cp >> (4 * i)) & 15];
    return s;
  }

  // GBNF for one character of the set (merged, sorted; JSON mode escapes the specials).
  std::string emit_set(CodepointRanges r, bool negated) {
    std::sort(r.begin(), r.end());
    CodepointRanges m;
    for (auto [a, b] : r) {
      if (!m.empty() && a <= m.back().second + 1) m.back().second = std::max(m.back().second, b);
      else m.push_back({a, b});
    }
    if (negated) {
      CodepointRanges inv;
      uint32_t next = 0;
      for (auto [a, b] : m) {
        if (a > next) inv.push_back({next, a - 1});
        next = b + 1;
      }
      if (next <= 0x10FFFF) inv.push_back({next, 0x10FFFF});
      m = std::move(inv);
    }
    std::vector<std::string> alts;
    CodepointRanges plain;
    for (auto [a, b] : m) {
      if (!json_) {
        plain.push_back({a, b});
        continue;
      }
      // ", \ and U+0000–U+001F are written escaped inside a JSON string.
      for (uint32_t x = a; x <= std::min<uint32_t>(b, 0x1F); ++x) {
        std::string e;
        switch (x) {
          case '\b': e = "\"\\\\b\""; break;
          case '\f': e = "\"\\\\f\""; break;
          case '\n': e = "\"\\\\n\""; break;
          case '\r': e = "\"\\\\r\""; break;
          case '\t': e = "\"\\\\t\""; break;
          default: {
            static const char* h = "0123456789abcdef";
            e = cat("\"\\\\u00", h[x >> 4], h[x & 15], "\"");
          }
        }
        alts.push_back(e);
      }
      uint32_t lo = std::max<uint32_t>(a, 0x20);
      for (uint32_t special : {uint32_t('"'), uint32_t('\\')}) {
        if (lo <= special && special <= b) {
          alts.push_back(special == '"' ? "\"\\\\\\\"\"" : "\"\\\\\\\\\"");
          if (lo < special) plain.push_back({lo, special - 1});
          lo = special + 1;
        }
      }
      if (lo <= b) plain.push_back({lo, b});
    }
    if (!plain.empty()) {
      std::string cls = "[";
      for (auto [a, b] : plain) cls += a == b ? hex_escape(a) : hex_escape(a) + "-" + hex_escape(b);
      alts.push_back(cat(cls, "]"));
    }
    if (alts.empty()) error(pos_, "a character class matches nothing");
    if (alts.size() == 1) return alts[0];
    std::string out = "(";
    for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
    return out + ")";
  }

  std::string parse_atom(int depth) {
    const size_t at = pos_;
    const char c = p_[pos_];
    if (c == '(') {
      if (depth + 1 > kMaxNesting) error(at, "groups nested too deeply");
      ++pos_;
      if (p_.substr(pos_, 2) == "?:") pos_ += 2;
      else if (!at_end() && p_[pos_] == '?') error(at, "lookaround and named groups are not supported");
      bool dummy = false;
      std::string inner = alternatives(depth + 1, &dummy);
      if (at_end() || p_[pos_] != ')') error(at, "unclosed '('");
      ++pos_;
      return cat("(", inner, ")");
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') error(at, "nothing to repeat");
    if (c == '.') {
      ++pos_;
      return emit_set({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}, true);
    }
    if (c == '[') {
      ++pos_;
      bool negated = false;
      if (!at_end() && p_[pos_] == '^') negated = true, ++pos_;
      CodepointRanges r;
      bool first = true;
      while (at_end() || p_[pos_] != ']' || first) {
        if (at_end()) error(at, "unclosed '['");
        first = false;
        uint32_t a = 0;
        if (p_[pos_] == '\\') {
          ++pos_;
          if (escape(r, &a)) continue;
        } else {
          a = utf8_char();
        }
        uint32_t b = a;
        if (pos_ + 1 < p_.size() && p_[pos_] == '-' && p_[pos_ + 1] != ']') {
          ++pos_;
          if (p_[pos_] == '\\') {
            ++pos_;
            CodepointRanges dummy;
            if (escape(dummy, &b)) error(pos_, "a class escape cannot end a range");
          } else {
            b = utf8_char();
          }
          if (b < a) error(at, "character range is backwards");
        }
        r.push_back({a, b});
      }
      ++pos_;
      return emit_set(r, negated);
    }
    CodepointRanges r;
    uint32_t cp = 0;
    if (c == '\\') {
      ++pos_;
      if (escape(r, &cp)) return emit_set(r, false);
    } else {
      cp = utf8_char();
    }
    return emit_set({{cp, cp}}, false);
  }
};

}  // namespace

std::string regex_to_gbnf(std::string_view pattern, bool json_string, const std::string& what) {
  return RegexParser(pattern, json_string, what).run();
}

Grammar regex_grammar(std::string_view pattern) {
  return parse_gbnf("root ::= " + regex_to_gbnf(pattern, false, "regex"));
}

}  // namespace kd::grammar
