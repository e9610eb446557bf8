// Structure-aware JSON for the libFuzzer targets (issue 21, "Prove it stays fixed"): the fuzzer's
// bytes do not spell JSON, they steer a walk over a *real* input of the entry point — a fixture's
// config.json, a safetensors header, an index, a chat request from tests/fuzz/shapes/ — and say
// where to put which hostile edit. The text that comes out is a faithful copy of the template except
// at those edits, so it is usually valid and passes the parser's early checks, and the edits land
// where parsers trust shapes: nesting up to 200,000 levels in any field, numbers like 1e999, 2^64,
// -1, 0.5 or 1000 digits, 1 MiB strings, invalid UTF-8 (raw and as lone \u surrogates), duplicate
// keys, wrong types, dropped and repeated members, keys spelled with escapes, truncation.
//
// Why this and not LLVMFuzzerCustomMutator: a custom mutator would parse the input with nlohmann,
// edit the tree and dump it again — but a tree cannot hold what we most want to send (1e999,
// duplicate keys, invalid UTF-8, unterminated nesting), and dumping a 200,000-level tree recurses in
// the mutator itself, the very crash under test. Here the input stays plain bytes that libFuzzer
// mutates, crossover and minimizes as usual; a crash file replays deterministically with the binary;
// and one generic walker serves every entry point, each target only naming its templates.
//
// Input layout (after whatever prefix a target keeps for itself): byte 0 picks the template, then
// records  [skip][op][args…]  repeat until the bytes run out: `skip` nodes (values, pre-order) are
// copied unchanged, the next one gets `op`. skip is one byte (< 0x80) or two (0x80 | hi, lo: up to
// 32767, to reach deep into a tokenizer.json), modulo the template's node count. Out of bytes, the
// rest is copied verbatim.
#pragma once
#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kdfuzz {

using ojson = nlohmann::ordered_json;

// The fuzzer's bytes as a stream of choices; exhausted, every read gives 0 and empty() is true.
class Bytes {
 public:
  Bytes(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool empty() const { return n_ == 0; }
  uint8_t u8() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  uint32_t u16() { return uint32_t(u8()) << 8 | u8(); }
  size_t below(size_t n) { return n == 0 ? 0 : (n <= 256 ? u8() % n : u16() % n); }
  std::string take(size_t k) {
    k = std::min(k, n_);
    std::string s(reinterpret_cast<const char*>(p_), k);
    p_ += k, n_ -= k;
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

// Values that break parsers: numbers past every integer and float range, boundaries, fractions
// where integers are due, and spellings that are not JSON at all.
inline const char* const kNumbers[] = {
    "1e999", "-1e999", "1e308", "1.7976931348623157e308", "4.9e-324", "1e-400", "-0", "-0.0", "0.5", "-1", "0",
    "2147483647", "2147483648", "-2147483649", "4294967296", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "18446744073709551615", "18446744073709551616",
    "123456789012345678901234567890", "1e19", "3.0", "1E+2", "1e-7", "65536", "1e10", "-1e10", "1e-5", "64.000001"};
// Spellings that are not JSON numbers at all (chosen one time in eight).
inline const char* const kNotNumbers[] = {"NaN", "Infinity", "-Infinity", "01", "1.", ".5", "+1", "0x10", "1e", "-"};
// Strings the code under test gives meaning to: special tokens, regex and path syntax, dtype names.
inline const char* const kStrings[] = {
    "", " ", "\\u0000", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<think>", "</think>",
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "functions.f:0", "re:.*", "re:(a+)+$", "re:(", "re:.**",
    "../config.json", "/etc/passwd", "model.safetensors", ".", "..", "a/b", "config.json", "yarn", "dynamic",
    "int", "float", "group", "tensor", "BF16", "F32", "F16", "I32", "I64", "U8", "F8_E4M3", "BOOL", "null", "true",
    "object", "array", "string", "integer", "number", "function", "auto", "none", "required", "{{", "{%", "%}",
    "\\\\", "\\\"", "\\n\\t\\r", "é", "😀", "\\ud83d\\ude00", "system", "user", "assistant", "tool"};
// Bytes that are not UTF-8, and escapes that decode to no character.
inline const char* const kBadUtf8[] = {"\xff", "\xfe\xff", "\xc0\xaf", "\xc0\x80", "\xed\xa0\x80", "\xed\xbf\xbf",
                                      "\xe2\x82", "\xf4\x90\x80\x80", "\xf8\x88\x80\x80\x80", "\x80", "\xc3",
                                      "\\ud800", "\\udfff\\ud800", "\\ud800x", "\\uDC00", "\\u00", "\\x41"};
inline const size_t kDepths[] = {65, 66, 100, 257, 1000, 5000, 20000, 100000, 200000};

enum Op : uint8_t {
  kDeep,       // replace the value by nesting kDepths[…] deep (arrays, objects or both; closed or not;
               // ≥ 20,000 levels a quarter as often as drawn: keep_huge())
  kNumber,     // replace by a kNumbers entry, or a variant of the template's own number
  kLongString, // replace by a string of 300 B … 1 MiB
  kBadString,  // replace by a string holding invalid UTF-8 / lone surrogates
  kWrongType,  // replace by null, a bool, 0, "", [], {} or a numeric string
  kRandom,     // replace by a small random value
  kDrop,       // leave the member / element out
  kDup,        // emit the member twice (the second copy may differ: later records apply to it too)
  kInsert,     // insert a member with a key seen in the templates (or junk) before this one
  kTweak,      // numbers ±1, ×−1, ×2^31, +0.5, as string; strings swapped for another; bools flipped; containers emptied
  kWrap,       // [v] or {"key": v}
  kCorrupt,    // raw bytes here: a stray comma, colon, bracket, NUL, a comment opener
  kRepeat,     // the element or member 2…10,000 times
  kKey,        // the member's key spelled with \u escapes, invalid UTF-8, empty, 4 KiB, or another key
  kTruncate,   // the text ends here
  kNumOps
};
// How often each op is drawn (of 256): edits that leave the text valid JSON dominate, so that most
// inputs get past the parser to the code that trusts its shape; corruption and truncation are rare.
inline constexpr uint8_t kOpWeights[kNumOps] = {24, 24, 12, 10, 30, 20, 24, 16, 20, 36, 14, 4, 10, 8, 4};
inline Op op_for(uint8_t b) {
  unsigned acc = 0;
  for (int op = 0; op < kNumOps; ++op)
    if (b < (acc += kOpWeights[op])) return Op(op);
  return kTweak;
}

class Mutator {
 public:
  // `dict_keys`/`dict_strings`: what kInsert and kTweak pick from (the templates' own keys and strings).
  // `nodes`: the template's value count; skips wrap around it so that every record lands somewhere.
  Mutator(Bytes& in, const std::vector<std::string>& dict_keys, const std::vector<std::string>& dict_strings,
          size_t nodes, size_t max_out = size_t(3) << 20)
      : in_(in), keys_(dict_keys), strings_(dict_strings), nodes_(std::max<size_t>(nodes, 1)), max_out_(max_out) {
    next_skip();
  }

  std::string render(const ojson& tmpl) {
    out_.clear();
    value(tmpl, nullptr);
    return std::move(out_);
  }

 private:
  static constexpr long kNever = std::numeric_limits<long>::max();

  void next_skip() {
    if (in_.empty()) {
      skip_ = kNever;
      return;
    }
    const uint8_t b = in_.u8();
    skip_ = long((b < 0x80 ? b : size_t(b & 0x7F) << 8 | in_.u8()) % nodes_);
  }
  // Whether the node now being visited takes an op (and which); counts the node either way.
  int visit() {
    if (done_) return -1;
    if (pending_skip_) {  // the previous record's op and arguments are read: now its successor's skip
      pending_skip_ = false;
      next_skip();
    }
    if (skip_ > 0) {
      if (skip_ != kNever) --skip_;
      return -1;
    }
    pending_skip_ = true;
    return op_for(in_.u8());
  }
  bool room(size_t n) const { return out_.size() + n <= max_out_; }

  void scalar(const ojson& v) { out_ += v.dump(-1, ' ', false, ojson::error_handler_t::replace); }

  // One value, with the op (if any) that the input gives its node; `key` is the member's key when
  // the value sits in an object (kDup/kRepeat/kKey/kDrop act on the member, which the caller emits).
  void value(const ojson& v, const std::string* key) {
    const int op = visit();
    if (op < 0) return plain(v);
    apply(op, v, key);
  }

  void plain(const ojson& v) {
    if (done_) return;
    if (v.is_object()) {
      out_ += '{';
      bool first = true;
      for (auto it = v.begin(); it != v.end() && !done_; ++it) member(it.key(), it.value(), first);
      if (!done_) out_ += '}';
    } else if (v.is_array()) {
      out_ += '[';
      bool first = true;
      for (const auto& e : v) {
        if (done_) break;
        element(e, first);
      }
      if (!done_) out_ += ']';
    } else {
      scalar(v);
    }
  }

  // Container children carry their own op decisions so that drop/dup/repeat/key act on the member.
  void member(const std::string& k, const ojson& v, bool& first) {
    const int op = visit();
    if (op < 0) return emit_member(k, v, first);
    switch (op) {
      case kDrop: return skip_children(v);
      case kDup: emit_member(k, v, first); return emit_member(k, v, first);
      case kInsert:
        emit_key(pick_key(), first);
        random_value(2);
        return emit_member(k, v, first);
      case kRepeat: {
        const size_t n = repeat_count();
        for (size_t i = 0; i < n && !done_ && room(k.size() + 8); ++i) emit_member(k, v, first);
        return;
      }
      case kKey: {
        comma(first);
        odd_key(k);
        out_ += ':';
        return plain(v);
      }
      default:
        emit_key(k, first);
        return apply(op, v, &k);
    }
  }
  void element(const ojson& v, bool& first) {
    const int op = visit();
    if (op < 0) {
      comma(first);
      return plain(v);
    }
    switch (op) {
      case kDrop: return skip_children(v);
      case kDup: case kRepeat: {
        const size_t n = op == kDup ? 2 : repeat_count();
        for (size_t i = 0; i < n && !done_ && room(16); ++i) {
          comma(first);
          plain(v);
        }
        return;
      }
      case kInsert:
        comma(first);
        random_value(2);
        comma(first);
        return plain(v);
      default:
        comma(first);
        return apply(op, v, nullptr);
    }
  }
  void emit_member(const std::string& k, const ojson& v, bool& first) {
    emit_key(k, first);
    plain(v);
  }
  void emit_key(const std::string& k, bool& first) {
    comma(first);
    scalar(ojson(k));
    out_ += ':';
  }
  void comma(bool& first) {
    if (!first) out_ += ',';
    first = false;
  }
  // A replaced value's children are not visited: later records count from the next sibling.
  void skip_children(const ojson&) {}

  void apply(int op, const ojson& v, const std::string* key) {
    switch (op) {
      case kDeep: return deep(v, key);
      case kNumber: return number(v);
      case kLongString: return long_string();
      case kBadString: return bad_string();
      case kWrongType: {
        static const char* const kTypes[] = {"null", "true", "false", "0", "\"\"", "[]", "{}", "\"64\"", "[null]", "{\"\":0}"};
        out_ += kTypes[in_.below(std::size(kTypes))];
        return;
      }
      case kRandom: return random_value(3);
      case kTweak: return tweak(v);
      case kWrap:
        if (in_.u8() & 1) {
          out_ += '[';
          plain(v);
          if (!done_) out_ += ']';
        } else {
          out_ += '{';
          scalar(ojson(key ? *key : pick_key()));
          out_ += ':';
          plain(v);
          if (!done_) out_ += '}';
        }
        return;
      case kCorrupt: {
        static const char* const kJunk[] = {",", ":", "]", "}", "[", "{", "\"", "" /* NUL */, "/*", "//",
                                            "\x01", ",,", "\xff", "\\"};
        const size_t j = in_.below(std::size(kJunk));
        if (j == 7) out_ += '\0';
        else out_ += kJunk[j];
        return plain(v);
      }
      case kTruncate: {
        // Cut inside the value's own text, not only before it.
        const uint32_t at = in_.u16();
        std::string whole;
        std::swap(whole, out_);
        plain(v);
        const std::string mine = std::move(out_);
        out_ = std::move(whole);
        out_ += mine.substr(0, mine.empty() ? 0 : at % mine.size());
        done_ = true;
        return;
      }
      default: return plain(v);  // kDrop/kDup/kInsert/kRepeat/kKey at the root: nothing to act on
    }
  }

  // Whether a huge size just drawn stays huge: one more byte, kept 1 time in 4 (and when the input
  // is exhausted, so a short seed ending here means what it meant before this gate existed). The
  // huge cases (≥ 20,000 levels, 1 MiB strings, 10,000 repeats) cost milliseconds each to build and
  // parse under ASan; drawn as often as the small ones they made most executions slow without
  // finding more (the bounded parser refuses 65 levels as it refuses 200,000).
  bool keep_huge() { return in_.empty() || in_.u8() % 4 == 0; }

  void deep(const ojson& v, const std::string* key) {
    size_t depth = kDepths[in_.below(std::size(kDepths))];
    if (depth >= 20000 && !keep_huge()) depth = 5000;
    const uint8_t shape = in_.u8();
    const int kind = shape % 3;  // 0 arrays, 1 objects, 2 alternating
    const bool unclosed = (shape >> 2) % 16 == 0;
    const int inner = (shape >> 5) % 4;  // what sits at the bottom
    const std::string k = ojson(key ? *key : std::string("a")).dump(-1, ' ', false, ojson::error_handler_t::replace);
    const size_t per_level = kind == 0 ? 2 : k.size() + 3;
    while (depth > 0 && !room(depth * per_level + 64)) depth /= 2;
    // Level i is an object when kind == 1, or kind == 2 and i is odd; else an array.
    const auto is_obj = [kind](size_t i) { return kind == 1 || (kind == 2 && i % 2); };
    const std::string open_obj = '{' + k + ':';
    if (kind == 0) {
      out_.append(depth, '[');
    } else {
      for (size_t i = 0; i < depth; ++i) {
        if (is_obj(i)) out_ += open_obj;
        else out_ += '[';
      }
    }
    switch (inner) {
      case 0: out_ += "0"; break;
      case 1: out_ += "\"x\""; break;
      case 2: out_ += "null"; break;
      default: plain(v); break;  // the template's own value at the bottom
    }
    if (unclosed || done_) return;
    if (kind == 0) out_.append(depth, ']');
    else if (kind == 1) out_.append(depth, '}');
    else
      for (size_t i = depth; i-- > 0;) out_ += is_obj(i) ? '}' : ']';
  }

  void number(const ojson& v) {
    const uint8_t b = in_.u8();
    if (v.is_number() && (b & 1)) return near_number(v);
    if ((b >> 1) % 8 == 0) out_ += kNotNumbers[in_.below(std::size(kNotNumbers))];
    else out_ += kNumbers[in_.below(std::size(kNumbers))];
  }
  void near_number(const ojson& v) {
    const double d = v.get<double>();
    const int64_t i = v.is_number_integer() ? v.get<int64_t>() : int64_t(d);
    switch (in_.u8() % 9) {
      case 0: out_ += std::to_string(i + 1); break;
      case 1: out_ += std::to_string(i - 1); break;
      case 2: out_ += std::to_string(-i); break;
      case 3: out_ += std::to_string(i) + "000000000000"; break;
      case 4: out_ += std::to_string(i) + ".5"; break;
      case 5: out_ += std::to_string(i) + ".0"; break;
      case 6: out_ += std::to_string(i) + "e400"; break;
      case 7: out_ += "\"" + std::to_string(i) + "\""; break;
      default: out_ += std::to_string(i * 2147483648.0); break;
    }
  }

  void long_string() {
    static const size_t kLens[] = {300, 4097, 65536, size_t(1) << 20};
    size_t n = kLens[in_.below(std::size(kLens))];
    if (n == kLens[std::size(kLens) - 1] && !keep_huge()) n = kLens[std::size(kLens) - 2];
    while (n > 0 && !room(n + 8)) n /= 4;
    const uint8_t fill = in_.u8();
    out_ += '"';
    if (fill % 3 == 0) {
      const char* s = kStrings[in_.below(std::size(kStrings))];
      const size_t len = std::strlen(s);
      while (len && n >= len) out_ += s, n -= len;
    } else {
      out_.append(n, fill % 3 == 1 ? 'a' : char('!' + fill % 90));
    }
    out_ += '"';
  }
  void bad_string() {
    out_ += '"';
    out_ += in_.take(in_.u8() % 4);  // raw input bytes, unescaped (may break the string: that is fine)
    const size_t n = 1 + in_.u8() % 4;
    for (size_t i = 0; i < n; ++i) out_ += kBadUtf8[in_.below(std::size(kBadUtf8))];
    out_ += '"';
  }

  void tweak(const ojson& v) {
    if (v.is_number()) return near_number(v);
    if (v.is_boolean()) return scalar(ojson(!v.get<bool>()));
    if (v.is_string()) {
      const std::string& s = v.get_ref<const std::string&>();
      switch (in_.u8() % 5) {
        case 0: return scalar(ojson(pick_string()));
        case 1: return scalar(ojson(s + pick_string()));
        case 2: return scalar(ojson(s.substr(0, s.empty() ? 0 : in_.below(s.size()))));
        case 3: out_ += '"' + std::string(kStrings[in_.below(std::size(kStrings))]) + '"'; return;
        default: return scalar(ojson(s + s));
      }
    }
    if (v.is_array()) out_ += "[]";
    else if (v.is_object()) out_ += "{}";
    else out_ += kNumbers[in_.below(std::size(kNumbers))];
  }

  void random_value(int depth) {
    const uint8_t t = in_.u8() % (depth > 0 ? 8 : 6);
    switch (t) {
      case 0: out_ += kNumbers[in_.below(std::size(kNumbers))]; return;
      case 1: scalar(ojson(pick_string())); return;
      case 2: out_ += '"' + std::string(kStrings[in_.below(std::size(kStrings))]) + '"'; return;
      case 3: out_ += (in_.u8() & 1) ? "true" : "null"; return;
      case 4: out_ += std::to_string(int(in_.u16()) - 32768); return;
      case 5: out_ += std::to_string(in_.u8()) + "." + std::to_string(in_.u8()) + "e" + std::to_string(int(in_.u8()) - 128); return;
      case 6: {
        out_ += '[';
        const size_t n = in_.u8() % 5;
        for (size_t i = 0; i < n; ++i) {
          if (i) out_ += ',';
          random_value(depth - 1);
        }
        out_ += ']';
        return;
      }
      default: {
        out_ += '{';
        const size_t n = in_.u8() % 5;
        for (size_t i = 0; i < n; ++i) {
          if (i) out_ += ',';
          scalar(ojson(pick_key()));
          out_ += ':';
          random_value(depth - 1);
        }
        out_ += '}';
        return;
      }
    }
  }

  void odd_key(const std::string& k) {
    switch (in_.u8() % 6) {
      case 0: {  // the same key, every character escaped: equal after decoding, different bytes
        out_ += '"';
        for (unsigned char c : k) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c < 0x80 ? c : 0xFFFD);
          out_ += buf;
        }
        out_ += '"';
        return;
      }
      case 1: out_ += "\"\""; return;
      case 2: out_ += '"' + k + kBadUtf8[in_.below(std::size(kBadUtf8))] + '"'; return;
      case 3: out_ += '"' + std::string(4096, 'k') + '"'; return;
      case 4: {
        std::string u = k;
        for (char& c : u) c = char(std::toupper(static_cast<unsigned char>(c)));
        return scalar(ojson(u));
      }
      default: return scalar(ojson(pick_key()));
    }
  }

  size_t repeat_count() {
    static const size_t kCounts[] = {2, 3, 17, 100, 1000, 10000};
    const size_t n = kCounts[in_.below(std::size(kCounts))];
    return n == 10000 && !keep_huge() ? 1000 : n;
  }
  std::string pick_key() { return keys_.empty() ? "a" : keys_[in_.below(keys_.size())]; }
  std::string pick_string() { return strings_.empty() ? "a" : strings_[in_.below(strings_.size())]; }

  Bytes& in_;
  const std::vector<std::string>& keys_;
  const std::vector<std::string>& strings_;
  size_t nodes_, max_out_;
  std::string out_;
  long skip_ = 0;
  bool pending_skip_ = false, done_ = false;
};

// A target's templates and the dictionaries gathered from them.
struct Templates {
  std::vector<ojson> list;
  std::vector<size_t> nodes;  // values in each template
  std::vector<std::string> keys, strings;

  void add(const ojson& t) {
    list.push_back(t);
    nodes.push_back(count(t));
    std::set<std::string> k(keys.begin(), keys.end()), s(strings.begin(), strings.end());
    gather(t, k, s);
    keys.assign(k.begin(), k.end());
    strings.assign(s.begin(), s.end());
  }
  void add_text(std::string_view text) { add(ojson::parse(text)); }

  // Template mode: byte 0 picks the template, the rest steers the Mutator (see the file comment).
  std::string generate(const uint8_t* data, size_t size, size_t max_out = size_t(3) << 20) const {
    if (list.empty() || size == 0) return {};
    const size_t i = data[0] % list.size();
    Bytes in(data + 1, size - 1);
    Mutator m(in, keys, strings, nodes[i], max_out);
    return m.render(list[i]);
  }

 private:
  static size_t count(const ojson& v) {
    size_t n = 1;
    if (v.is_structured())
      for (const auto& e : v) n += count(e);
    return n;
  }
  static void gather(const ojson& v, std::set<std::string>& k, std::set<std::string>& s) {
    if (v.is_object()) {
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (k.size() < 512) k.insert(it.key());
        gather(it.value(), k, s);
      }
    } else if (v.is_array()) {
      for (const auto& e : v) gather(e, k, s);
    } else if (v.is_string() && s.size() < 512) {
      s.insert(v.get<std::string>());
    }
  }
};

// Raw mode for inputs that already are JSON text (the seed corpora, the fixtures, what libFuzzer's
// byte mutations make of them): they go to the parser as they are.
inline bool looks_like_json_text(const uint8_t* data, size_t size) {
  return size > 0 && std::strchr("{[\" \t\r\n", data[0]) != nullptr && data[0] != 0;
}

// Raw JSON text, or the text template mode makes of the bytes. With KDTREE_FUZZ_DUMP=FILE set, the
// text is also written to FILE (the last one wins): what a crash input means, e.g.
//   KDTREE_FUZZ_DUMP=/tmp/t.json build/fuzz/fuzz_config crash-…
inline void dump_if_asked(const std::string& text) {
  static const char* const dump = std::getenv("KDTREE_FUZZ_DUMP");
  if (dump && *dump)
    if (std::FILE* f = std::fopen(dump, "wb")) {
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
    }
}
inline std::string json_input(const Templates& t, const uint8_t* data, size_t size) {
  std::string text = looks_like_json_text(data, size) ? std::string(reinterpret_cast<const char*>(data), size)
                                                      : t.generate(data, size);
  dump_if_asked(text);
  return text;
}

}  // namespace kdfuzz
