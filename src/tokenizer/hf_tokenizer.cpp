// tokenizer.json byte-level BPE. The pipeline is tokenizers' own, step for step:
//   added tokens split the text (leftmost-longest; non-normalized tokens first, then normalized ones)
//   → each remaining segment goes through the pre_tokenizer Splits (Isolated: matches and the gaps
//   between them both become pieces) → ByteLevel maps bytes to symbols → BPE merges each piece,
//   lowest merge index first, leftmost on ties (tokenizers' Word::merge_all heap order).
// BPE works on byte strings here: the vocab's ByteLevel-mapped strings are turned back into bytes at
// load time, so encode never builds the mapped text.
#include "tokenizer/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/error.h"
#include "core/regex.h"
#include "core/untrusted.h"

namespace kd {
namespace {

using json = nlohmann::json;

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order, so every byte is one visible code point.
std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> m{};
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    m[b] = keep ? b : 256 + n++;
  }
  return m;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
}

// Length of the valid UTF-8 sequence at s[i], or 0 when invalid (overlongs, surrogates, > U+10FFFF).
size_t utf8_len(std::string_view s, size_t i, uint32_t* cp_out = nullptr) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n;
  uint32_t cp;
  if (c < 0x80) {
    if (cp_out) *cp_out = c;
    return 1;
  } else if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const auto d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (d & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
  if (cp_out) *cp_out = cp;
  return n;
}

// The pattern tokenizers' ByteLevel pre-tokenizer splits with when use_regex is true (GPT-2's).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string quote_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}-").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, normalized;
};

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& path);

  std::vector<int32_t> encode(std::string_view text, bool parse_special) const override;
  const std::string& token_bytes(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) fail("token id ", id, " is out of range [0, ", vocab_size(), ")");
    return tokens_[size_t(id)];
  }
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  std::optional<int32_t> special_id(std::string_view name) const override {
    for (const auto& a : added_)
      if (a.content == name) return a.id;
    return std::nullopt;
  }
  bool is_special(int32_t id) const override { return id >= 0 && id < vocab_size() && special_[size_t(id)]; }
  std::string kind() const override { return "tokenizer.json"; }

 private:
  void load_model(const json& m);
  void load_pre_tokenizer(const json& p, const std::string& where);
  void encode_segment(std::string_view seg, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  // Leftmost-longest matches of the added tokens in `which` (a pass of tokenizers' AddedVocabulary).
  void split_added(std::string_view text, const std::vector<const AddedToken*>& which, size_t pass,
                   const std::vector<std::vector<const AddedToken*>>& passes, std::vector<int32_t>& out) const;

  std::string path_;
  std::vector<std::string> tokens_;  // id → bytes (added tokens: their content as UTF-8)
  std::vector<uint8_t> special_;     // id → 1 when a special added token
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, int32_t> vocab_;  // model.vocab, mapped (ByteLevel) strings → id
  std::array<int32_t, 256> byte_id_{};              // byte → id of its one-symbol token, -1 when absent
  struct Merge {
    int32_t rank, id;
  };
  std::unordered_map<uint64_t, Merge> merges_;          // (left id, right id) → rank, merged id
  std::unordered_map<std::string, int32_t> piece_vocab_;  // bytes → id, for ignore_merges
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
  std::vector<Regex> splits_;  // Split(Isolated) steps in order

  static constexpr size_t kCacheMaxEntries = 1 << 16, kCacheMaxPiece = 256;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

const json& need(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) fail(where, ": missing \"", key, "\"");
  return *it;
}

bool is_null_or_missing(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null();
}

// Any field of the wrong type that a `.value(key, default)` or `get<T>()` below meets throws
// nlohmann's type_error: the function-try-block turns every one into a kd::Error naming the file.
HfTokenizer::HfTokenizer(const std::string& path) try : path_(path) {
  const json j = read_json_file(path, kMaxTokenizerBytes);
  if (!j.is_object()) fail(path, ": top level is not a JSON object");
  try {
    if (!is_null_or_missing(j, "normalizer")) {
      const json& n = j["normalizer"];
      fail(path, ": normalizer: type '", n.value("type", std::string("?")),
           "' is not supported (only null, as DeepSeek-V3 ships)");
    }
    if (!is_null_or_missing(j, "truncation")) fail(path, ": truncation: only null is supported");
    load_model(need(j, "model", path));
    if (is_null_or_missing(j, "pre_tokenizer")) fail(path, ": pre_tokenizer: null is not supported (a byte-level BPE needs ByteLevel)");
    bool has_byte_level = false;
    const json& p = j["pre_tokenizer"];
    const std::string ptype = p.value("type", std::string());
    if (ptype == "Sequence") {
      const json& list = need(p, "pretokenizers", path + ": pre_tokenizer");
      if (!list.is_array()) fail(path, ": pre_tokenizer.pretokenizers is not an array");
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string where = cat("pre_tokenizer.pretokenizers[", i, "]");
        if (has_byte_level) fail(path, ": ", where, ": steps after ByteLevel are not supported");
        load_pre_tokenizer(list[i], where);
        has_byte_level = list[i].value("type", std::string()) == "ByteLevel";
      }
    } else {
      load_pre_tokenizer(p, "pre_tokenizer");
      has_byte_level = ptype == "ByteLevel";
    }
    if (!has_byte_level) fail(path, ": pre_tokenizer: no ByteLevel step (only byte-level BPE is supported)");
    if (!is_null_or_missing(j, "decoder")) {
      const std::string dtype = j["decoder"].value("type", std::string("?"));
      if (dtype != "ByteLevel") fail(path, ": decoder: type '", dtype, "' is not supported (only ByteLevel)");
    }
    // post_processor only adds BOS/EOS when add_special_tokens; kdtree's chat templates add them.
  } catch (const json::exception& e) {
    fail(path, ": ", e.what());
  }

  // added_tokens: may reuse vocab ids or extend past them.
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const json& list = j["added_tokens"];
    if (!list.is_array()) fail(path, ": added_tokens is not an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string where = cat(path, ": added_tokens[", i, "]");
      const json& a = list[i];
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") || !a["content"].is_string())
        fail(where, ": needs integer \"id\" and string \"content\"");
      for (const char* opt : {"single_word", "lstrip", "rstrip"})
        if (a.value(opt, false)) fail(where, ".", opt, ": true is not supported");
      AddedToken t{a["content"].get<std::string>(), a["id"].get<int32_t>(), a.value("special", false), a.value("normalized", true)};
      if (t.id < 0 || t.id > (1 << 24)) fail(where, ".id: ", t.id, " is out of range");
      if (t.content.empty()) fail(where, ".content: empty");
      if (size_t(t.id) >= tokens_.size()) {
        tokens_.resize(size_t(t.id) + 1);
        special_.resize(size_t(t.id) + 1);
      }
      tokens_[size_t(t.id)] = t.content;
      special_[size_t(t.id)] = t.special;
      added_.push_back(std::move(t));
    }
  }
} catch (const json::exception& e) {
  fail(path, ": ", escaped_excerpt(e.what(), 200));
}

void HfTokenizer::load_model(const json& m) {
  const std::string where = path_ + ": model";
  const std::string type = m.value("type", std::string());
  if (type != "BPE") fail(where, ".type: '", type, "' is not supported (only BPE)");
  if (!is_null_or_missing(m, "dropout") && m["dropout"].get<double>() != 0.0) fail(where, ".dropout: only null is supported");
  if (m.value("byte_fallback", false)) fail(where, ".byte_fallback: true is not supported");
  for (const char* opt : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!is_null_or_missing(m, opt) && !m[opt].get<std::string>().empty()) fail(where, ".", opt, ": only null is supported");
  ignore_merges_ = m.value("ignore_merges", false);

  const json& vocab = need(m, "vocab", where);
  if (!vocab.is_object()) fail(where, ".vocab is not an object");
  const auto to_cp = byte_to_codepoint();
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  for (uint32_t b = 0; b < 256; ++b) cp_to_byte[to_cp[b]] = uint8_t(b);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) fail(where, ".vocab[\"", it.key(), "\"] is not an integer id");
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id > (1 << 24)) fail(where, ".vocab[\"", it.key(), "\"]: id ", id, " is out of range");
    vocab_[it.key()] = int32_t(id);
    if (size_t(id) >= tokens_.size()) {
      tokens_.resize(size_t(id) + 1);
      special_.resize(size_t(id) + 1);
    }
    // ByteLevel decoder: each symbol back to its byte; a token with any other character decodes to
    // its own UTF-8 (tokenizers does the same).
    const std::string& s = it.key();
    std::string bytes;
    bool mapped = true;
    for (size_t i = 0; i < s.size();) {
      uint32_t cp = 0;
      const size_t n = utf8_len(s, i, &cp);
      if (n == 0) fail(where, ".vocab: token \"", s, "\" is not valid UTF-8");
      auto b = cp_to_byte.find(cp);
      if (b == cp_to_byte.end()) {
        mapped = false;
        break;
      }
      bytes += char(b->second);
      i += n;
    }
    tokens_[size_t(id)] = mapped ? bytes : s;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    std::string sym;
    append_utf8(sym, to_cp[b]);
    auto it = vocab_.find(sym);
    byte_id_[b] = it == vocab_.end() ? -1 : it->second;
  }
  if (!is_null_or_missing(m, "unk_token")) {
    const std::string unk = m["unk_token"].get<std::string>();
    auto it = vocab_.find(unk);
    if (it == vocab_.end()) fail(where, ".unk_token: '", unk, "' is not in model.vocab");
    unk_id_ = it->second;
  }
  if (ignore_merges_)
    for (const auto& [s, id] : vocab_) piece_vocab_.emplace(tokens_[size_t(id)], id);

  const json& merges = need(m, "merges", where);
  if (!merges.is_array()) fail(where, ".merges is not an array");
  merges_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& e = merges[i];
    std::string a, b;
    if (e.is_string()) {  // "a b" (tokenizers < 0.20 and most published files)
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail(where, ".merges[", i, "]: \"", s, "\" is not two tokens separated by one space");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {  // ["a", "b"]
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    } else {
      fail(where, ".merges[", i, "]: expected \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    if (ia == vocab_.end()) fail(where, ".merges[", i, "]: token '", a, "' is not in model.vocab");
    if (ib == vocab_.end()) fail(where, ".merges[", i, "]: token '", b, "' is not in model.vocab");
    if (iab == vocab_.end()) fail(where, ".merges[", i, "]: merged token '", a + b, "' is not in model.vocab");
    const uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    merges_.emplace(key, Merge{int32_t(i), iab->second});  // the first occurrence wins, as in tokenizers
  }
}

void HfTokenizer::load_pre_tokenizer(const json& p, const std::string& where) {
  const std::string w = path_ + ": " + where;
  if (!p.is_object()) fail(w, ": not an object");
  const std::string type = p.value("type", std::string());
  if (type == "Split") {
    const json& pat = need(p, "pattern", w);
    std::string re;
    if (pat.contains("Regex")) {
      re = pat["Regex"].get<std::string>();
    } else if (pat.contains("String")) {
      re = quote_literal(pat["String"].get<std::string>());
    } else {
      fail(w, ".pattern: expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string behavior = p.value("behavior", std::string());
    if (behavior != "Isolated") fail(w, ".behavior: '", behavior, "' is not supported (only Isolated)");
    if (p.value("invert", false)) fail(w, ".invert: true is not supported");
    try {
      splits_.emplace_back(re, Regex::Options{.ucp = true, .jit = true});
    } catch (const Error& e) {
      fail(w, ".pattern: ", e.what());
    }
  } else if (type == "ByteLevel") {
    if (p.value("add_prefix_space", false)) fail(w, ".add_prefix_space: true is not supported");
    if (p.value("use_regex", true)) splits_.emplace_back(kGpt2Pattern, Regex::Options{.ucp = true, .jit = true});
  } else {
    fail(w, ".type: '", type, "' is not supported (only Sequence, Split, ByteLevel)");
  }
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, bool parse_special) const {
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_len(text, i);
    if (n == 0) fail("input is not valid UTF-8 at byte offset ", i);
    i += n;
  }
  // tokenizers' AddedVocabulary: tokens with normalized=false split the raw text first, then the
  // normalized ones split what is left (identical text here: there is no normalizer).
  std::vector<std::vector<const AddedToken*>> passes(2);
  for (const auto& a : added_)
    if (!a.special || parse_special) passes[a.normalized ? 1 : 0].push_back(&a);
  for (auto& p : passes)  // longest first, so the first match found at a position is the longest
    std::stable_sort(p.begin(), p.end(), [](const AddedToken* x, const AddedToken* y) { return x->content.size() > y->content.size(); });
  std::vector<int32_t> out;
  split_added(text, passes[0], 0, passes, out);
  return out;
}

void HfTokenizer::split_added(std::string_view text, const std::vector<const AddedToken*>& which, size_t pass,
                              const std::vector<std::vector<const AddedToken*>>& passes, std::vector<int32_t>& out) const {
  auto emit_gap = [&](std::string_view gap) {
    if (gap.empty()) return;
    if (pass + 1 < passes.size()) split_added(gap, passes[pass + 1], pass + 1, passes, out);
    else encode_segment(gap, out);
  };
  size_t start = 0;
  if (!which.empty()) {
    for (size_t i = 0; i < text.size(); ++i) {
      const AddedToken* hit = nullptr;
      for (const AddedToken* a : which)
        if (text.compare(i, a->content.size(), a->content) == 0) {
          hit = a;
          break;
        }
      if (!hit) continue;
      emit_gap(text.substr(start, i - start));
      out.push_back(hit->id);
      i += hit->content.size() - 1;
      start = i + 1;
    }
  }
  emit_gap(text.substr(start));
}

void HfTokenizer::encode_segment(std::string_view seg, std::vector<int32_t>& out) const {
  std::vector<std::string_view> pieces{seg}, next;
  for (const Regex& re : splits_) {
    next.clear();
    for (std::string_view p : pieces) {
      size_t prev = 0;
      for (const auto& [b, e] : re.find_all(p)) {
        if (b > prev) next.push_back(p.substr(prev, b - prev));
        next.push_back(p.substr(b, e - b));
        prev = e;
      }
      if (prev < p.size()) next.push_back(p.substr(prev));
    }
    pieces.swap(next);
  }
  for (std::string_view p : pieces) encode_piece(p, out);
}

void HfTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() > kCacheMaxPiece) return bpe(piece, out);
  std::string key(piece);
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  bpe(piece, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (cache_.size() >= kCacheMaxEntries) cache_.clear();
  cache_.emplace(std::move(key), std::move(ids));
}

void HfTokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    auto it = piece_vocab_.find(std::string(piece));
    if (it != piece_vocab_.end()) return out.push_back(it->second);
  }
  // One symbol per byte; a byte with no token becomes unk (or is dropped when there is none), as in
  // tokenizers' Word construction.
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(piece.size());
  for (unsigned char c : piece) {
    const int32_t id = byte_id_[c] >= 0 ? byte_id_[c] : unk_id_;
    if (id < 0) continue;
    const int32_t n = int32_t(sym.size());
    sym.push_back({id, n - 1, n + 1, true});
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  struct Cand {
    int32_t rank, pos, id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto find_merge = [&](int32_t l, int32_t r) -> const Merge* {
    auto it = merges_.find((uint64_t(uint32_t(l)) << 32) | uint32_t(r));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (int32_t i = 0; i + 1 < int32_t(sym.size()); ++i)
    if (const Merge* m = find_merge(sym[size_t(i)].id, sym[size_t(i) + 1].id)) heap.push({m->rank, i, m->id});
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Symbol& s = sym[size_t(c.pos)];
    if (!s.alive || s.next < 0) continue;
    Symbol& r = sym[size_t(s.next)];
    const Merge* m = find_merge(s.id, r.id);
    if (!m || m->id != c.id) continue;  // stale: one side merged since this pair was queued
    s.id = c.id;
    r.alive = false;
    s.next = r.next;
    if (s.next >= 0) sym[size_t(s.next)].prev = c.pos;
    if (s.prev >= 0)
      if (const Merge* pm = find_merge(sym[size_t(s.prev)].id, s.id)) heap.push({pm->rank, s.prev, pm->id});
    if (s.next >= 0)
      if (const Merge* nm = find_merge(s.id, sym[size_t(s.next)].id)) heap.push({nm->rank, c.pos, nm->id});
  }
  for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) out.push_back(sym[size_t(i)].id);
}

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) { return std::make_unique<HfTokenizer>(path); }

}  // namespace kd
