// tiktoken-format BPE. The split is PCRE2 (JIT) running a translation of Kimi's pat_str; the merge
// loop is tiktoken's byte_pair_merge (lowest rank first, leftmost on ties), with a heap for long
// pieces so a megabyte of spaces stays O(n log n). Ids must equal tiktoken's for every valid string.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/tiktoken.h"
#include "tokenizer/utf8.h"

#include <pcre2.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/untrusted.h"

namespace kd {

const char* const kKimiPatStr =
    R"([\p{Han}]+|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|)"
    R"(\s*[\r\n]+|)"
    R"(\s+(?!\S)|)"
    R"(\s+)";

namespace {

// kKimiPatStr in PCRE2 syntax, alternative for alternative. Three translations keep it exact:
//  - `[X&&[^\p{Han}]]`: general categories partition the code points, so "Lu|Lt|Lm|Lo|M and not Han"
//    is the negated class of every other category plus Han — one class, no lookahead, and JIT runs
//    its repeats without backtracking frames.
//  - `\p{Han}` in Rust's regex is the Script property; PCRE2 10.40+ reads a bare script name as
//    Script_Extensions (which puts 、。「」 in Han), hence `sc:Han`.
//  - `\s` in Rust's regex is Unicode White_Space; PCRE2's UCP `\s` also takes U+180E, so the
//    White_Space list is spelled out.
#define KD_WS R"(\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"
#define KD_UPPERISH R"([^\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{sc:Han}])"
#define KD_LOWERISH R"([^\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{sc:Han}])"
#define KD_CONTRACTION R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
const char* const kKimiPatPcre2 =
    R"(\p{sc:Han}+|)"
    R"([^\r\n\p{L}\p{N}]?)" KD_UPPERISH "*" KD_LOWERISH "+" KD_CONTRACTION "|"
    R"([^\r\n\p{L}\p{N}]?)" KD_UPPERISH "+" KD_LOWERISH "*" KD_CONTRACTION "|"
    R"(\p{N}{1,3}|)"
    R"( ?[^)" KD_WS R"(\p{L}\p{N}]+[\r\n]*|)"
    "[" KD_WS R"(]*[\r\n]+|)"
    "[" KD_WS "]+(?![^" KD_WS "])|"
    "[" KD_WS "]+";
#undef KD_WS
#undef KD_UPPERISH
#undef KD_LOWERISH
#undef KD_CONTRACTION

constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();

uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
  }
  return h ^ (h >> 32);
}

int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with padding (what load_tiktoken_bpe's base64.b64decode reads); nullopt if malformed.
std::optional<std::string> b64_decode(std::string_view s) {
  if (s.empty() || s.size() % 4 != 0) return std::nullopt;
  size_t pad = 0;
  if (s.back() == '=') pad = (s[s.size() - 2] == '=') ? 2 : 1;
  std::string out;
  out.reserve(s.size() / 4 * 3);
  for (size_t i = 0; i < s.size(); i += 4) {
    int v[4];
    for (int k = 0; k < 4; ++k) {
      const bool is_pad = i + static_cast<size_t>(k) >= s.size() - pad;
      v[k] = is_pad ? 0 : b64_value(static_cast<unsigned char>(s[i + static_cast<size_t>(k)]));
      if (v[k] < 0) return std::nullopt;
    }
    const uint32_t x = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
    out.push_back(static_cast<char>(x >> 16));
    out.push_back(static_cast<char>((x >> 8) & 0xFF));
    out.push_back(static_cast<char>(x & 0xFF));
  }
  out.resize(out.size() - pad);
  return out;
}

std::string read_file(const std::string& path) { return read_text_file(path, kMaxTokenizerBytes); }

}  // namespace

// bytes → rank for the base ranks: open addressing, a 32-bit hash tag per slot so most probes never
// touch the token bytes.
struct TiktokenTokenizer::RankTable {
  struct Slot {
    uint32_t tag = 0;
    int32_t id = -1;
  };
  const std::vector<std::string>& tokens;
  std::vector<Slot> slots;
  uint64_t mask = 0;
  uint32_t byte_rank[256];

  explicit RankTable(const std::vector<std::string>& t, int32_t n) : tokens(t) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(n) * 2) cap *= 2;
    slots.resize(cap);
    mask = cap - 1;
    std::fill(std::begin(byte_rank), std::end(byte_rank), kNoRank);
    for (int32_t id = 0; id < n; ++id) {
      const std::string& s = tokens[static_cast<size_t>(id)];
      const uint64_t h = hash_bytes(s.data(), s.size());
      for (uint64_t i = h & mask;; i = (i + 1) & mask) {
        if (slots[i].id < 0) {
          slots[i] = {static_cast<uint32_t>(h >> 32), id};
          break;
        }
      }
      if (s.size() == 1 && byte_rank[static_cast<unsigned char>(s[0])] == kNoRank)
        byte_rank[static_cast<unsigned char>(s[0])] = static_cast<uint32_t>(id);
    }
  }

  uint32_t find(const char* p, size_t n) const {
    if (n == 1) return byte_rank[static_cast<unsigned char>(*p)];
    const uint64_t h = hash_bytes(p, n);
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& sl = slots[i];
      if (sl.id < 0) return kNoRank;
      if (sl.tag == tag) {
        const std::string& s = tokens[static_cast<size_t>(sl.id)];
        if (s.size() == n && std::memcmp(s.data(), p, n) == 0) return static_cast<uint32_t>(sl.id);
      }
    }
  }
};

struct TiktokenTokenizer::Splitter {
  pcre2_code* code = nullptr;
  bool jit = false;
  Splitter() {
    int err = 0;
    PCRE2_SIZE off = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kKimiPatPcre2), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                         &err, &off, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("tiktoken pre-tokenizer regex: ", reinterpret_cast<const char*>(msg), " at offset ", off);
    }
    jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Splitter() { pcre2_code_free(code); }

  // Calls fn(offset, length) for each piece of valid UTF-8 `text`, as Rust's find_iter yields them.
  template <class F>
  void each(std::string_view text, F&& fn) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t start = 0;
    while (start < text.size()) {
      // The caller validated the UTF-8 once; PCRE2 would otherwise re-check the whole subject per call.
      const int rc = jit ? pcre2_jit_match(code, subject, text.size(), start, 0, md, nullptr)
                         : pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        fail("tiktoken pre-tokenizer at byte ", start, ": ", reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // the pattern cannot match empty; guard against looping anyway
        start = b + 1;
        continue;
      }
      fn(b, e - b);
      start = e;
    }
    pcre2_match_data_free(md);
  }
};

namespace {

// First offset of invalid UTF-8 in `s`, or npos (RFC 3629: no overlongs, surrogates or > U+10FFFF).
size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned char lo, hi;
    if (!utf8_lead(c, &len, &lo, &hi)) return i;
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace

TiktokenTokenizer::~TiktokenTokenizer() = default;

TiktokenTokenizer::TiktokenTokenizer(const std::string& model_path, const std::string& config_path) {
  // --- base ranks: `base64 rank` per line (load_tiktoken_bpe skips empty lines) ---
  const std::string text = read_file(model_path);
  std::vector<std::pair<int64_t, std::string>> entries;  // rank, bytes
  std::vector<int64_t> line_of;                          // 1-based line of each entry
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
      fail(model_path, ":", line_no, ": expected `base64 rank`, found '", escaped_excerpt(line, 80), "'");
    std::optional<std::string> bytes = b64_decode(line.substr(0, sp));
    if (!bytes || bytes->empty())
      fail(model_path, ":", line_no, ": invalid base64 '", escaped_excerpt(line.substr(0, sp), 80), "'");
    const std::string_view rank_s = line.substr(sp + 1);
    int64_t rank = 0;
    if (rank_s.empty() || rank_s.size() > 10)
      fail(model_path, ":", line_no, ": invalid rank '", escaped_excerpt(rank_s, 20), "'");
    for (char ch : rank_s) {
      if (ch < '0' || ch > '9') fail(model_path, ":", line_no, ": invalid rank '", escaped_excerpt(rank_s, 20), "'");
      rank = rank * 10 + (ch - '0');
    }
    if (rank >= (int64_t(1) << 30)) fail(model_path, ":", line_no, ": rank ", rank, " is too large");
    entries.emplace_back(rank, std::move(*bytes));
    line_of.push_back(line_no);
  }
  if (entries.empty()) fail(model_path, ": no tokens");
  const auto n = static_cast<int64_t>(entries.size());
  // Specials are numbered from len(ranks) (tokenization_kimi.py), so the ranks must be exactly 0..n-1.
  std::vector<int64_t> line_of_rank(static_cast<size_t>(n), 0);
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t r = entries[i].first;
    if (r >= n)
      fail(model_path, ":", line_of[i], ": rank ", r, " is not below the number of tokens (", n,
           "): ranks must be 0..", n - 1, " without gaps");
    if (line_of_rank[static_cast<size_t>(r)])
      fail(model_path, ":", line_of[i], ": rank ", r, " repeats line ", line_of_rank[static_cast<size_t>(r)]);
    line_of_rank[static_cast<size_t>(r)] = line_of[i];
  }
  n_base_ = static_cast<int32_t>(n);
  tokens_.resize(static_cast<size_t>(n));
  for (auto& [r, b] : entries) tokens_[static_cast<size_t>(r)] = std::move(b);
  entries.clear();
  ranks_ = std::make_unique<RankTable>(tokens_, n_base_);
  for (int32_t id = 0; id < n_base_; ++id) {
    const std::string& s = tokens_[static_cast<size_t>(id)];
    if (ranks_->find(s.data(), s.size()) != static_cast<uint32_t>(id))
      fail(model_path, ":", line_of_rank[static_cast<size_t>(id)], ": token bytes repeat line ",
           line_of_rank[ranks_->find(s.data(), s.size())]);
  }
  for (int b = 0; b < 256; ++b)
    if (ranks_->byte_rank[b] == kNoRank)
      fail(model_path, ": no token for the single byte 0x", "0123456789abcdef"[b >> 4], "0123456789abcdef"[b & 15],
           " (byte-level BPE needs all 256)");

  // --- special tokens: named from added_tokens_decoder, the other slots reserved ---
  std::vector<std::pair<int64_t, std::string>> named;
  if (!config_path.empty()) {
    const nlohmann::json cfg = read_json_file(config_path, kMaxTokenizerBytes);
    if (!cfg.is_object()) fail(config_path, ": expected a JSON object");
    if (cfg.contains("added_tokens_decoder")) {
      const auto& atd = cfg["added_tokens_decoder"];
      if (!atd.is_object()) fail(config_path, ": added_tokens_decoder must be an object (id → token)");
      for (auto it = atd.begin(); it != atd.end(); ++it) {
        const std::string& key = it.key();
        int64_t id = 0;
        if (key.empty() || key.size() > 9 || key.find_first_not_of("0123456789") != std::string::npos)
          fail(config_path, ": added_tokens_decoder key '", escaped_excerpt(key, 40), "' is not a token id");
        id = std::stoll(key);
        const auto& v = it.value();
        if (!v.is_object() || !v.contains("content") || !v["content"].is_string() || v["content"].get<std::string>().empty())
          fail(config_path, ": added_tokens_decoder[\"", escaped_excerpt(key, 40),
               "\"] needs a non-empty string \"content\"");
        if (id < n_base_)
          fail(config_path, ": added token ", id, " ('", escaped_excerpt(v["content"].get<std::string>(), 80),
               "') collides with base rank ",
               id, " of ", model_path, " (specials start at ", n_base_, ")");
        if (id >= n_base_ + (int64_t(1) << 20)) fail(config_path, ": added token id ", id, " is too far past the base ranks");
        named.emplace_back(id, v["content"].get<std::string>());
      }
    }
  }
  int64_t n_special = kKimiNumReservedSpecial;
  for (auto& [id, name] : named) n_special = std::max(n_special, id - n_base_ + 1);
  tokens_.resize(static_cast<size_t>(n_base_ + n_special));
  std::vector<bool> is_named(static_cast<size_t>(n_special), false);
  for (auto& [id, name] : named) {
    tokens_[static_cast<size_t>(id)] = name;
    is_named[static_cast<size_t>(id - n_base_)] = true;
  }
  for (int64_t k = 0; k < n_special; ++k)
    if (!is_named[static_cast<size_t>(k)]) tokens_[static_cast<size_t>(n_base_ + k)] = cat("<|reserved_token_", n_base_ + k, "|>");
  for (int64_t k = 0; k < n_special; ++k) {
    const auto id = static_cast<int32_t>(n_base_ + k);
    specials_.emplace_back(tokens_[static_cast<size_t>(id)], id);
  }
  std::sort(specials_.begin(), specials_.end());
  for (size_t i = 1; i < specials_.size(); ++i)
    if (specials_[i].first == specials_[i - 1].first)
      fail(config_path, ": special token '", escaped_excerpt(specials_[i].first, 80), "' is named twice (ids ",
           specials_[i - 1].second, " and ", specials_[i].second, ")");
  for (auto& [name, id] : specials_)
    if (std::find(special_lengths_.begin(), special_lengths_.end(), name.size()) == special_lengths_.end()) {
      if (name.size() > 255)
        fail(config_path, ": special token '", escaped_excerpt(name.substr(0, 40), 80), "...' is longer than 255 bytes");
      special_lengths_.push_back(static_cast<uint8_t>(name.size()));
    }
  std::sort(special_lengths_.rbegin(), special_lengths_.rend());
  for (auto& [name, id] : specials_) special_first_[static_cast<unsigned char>(name[0])] = true;
  splitter_ = std::make_unique<Splitter>();
}

const std::string& TiktokenTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) fail("token id ", id, " is out of range [0, ", vocab_size(), ")");
  return tokens_[static_cast<size_t>(id)];
}

std::optional<int32_t> TiktokenTokenizer::special_id(std::string_view name) const {
  auto it = std::lower_bound(specials_.begin(), specials_.end(), name,
                             [](const auto& e, std::string_view k) { return std::string_view(e.first) < k; });
  if (it != specials_.end() && it->first == name) return it->second;
  return std::nullopt;
}

std::vector<std::pair<size_t, size_t>> TiktokenTokenizer::split(std::string_view text) const {
  const size_t bad = first_invalid_utf8(text);
  if (bad != std::string_view::npos) fail("invalid UTF-8 at byte offset ", bad);
  std::vector<std::pair<size_t, size_t>> out;
  splitter_->each(text, [&](size_t b, size_t len) { out.emplace_back(b, len); });
  return out;
}

std::vector<int32_t> TiktokenTokenizer::encode(std::string_view text, bool parse_special) const {
  const size_t bad = first_invalid_utf8(text);
  if (bad != std::string_view::npos) fail("invalid UTF-8 at byte offset ", bad, " of the text to encode");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (!parse_special) {
    encode_ordinary(text, out);
    return out;
  }
  // As tiktoken's _encode_native: text between specials is split on its own (a lookahead never sees
  // the special that follows). Where two names match at one offset, the longest wins.
  size_t start = 0, p = 0;
  while (p < text.size()) {
    const char c = text[p];
    if (special_first_[static_cast<unsigned char>(c)]) {
      for (uint8_t len : special_lengths_) {
        if (p + len > text.size()) continue;
        if (auto id = special_id(text.substr(p, len))) {
          encode_ordinary(text.substr(start, p - start), out);
          out.push_back(*id);
          p += len;
          start = p;
          goto next;
        }
      }
    }
    ++p;
  next:;
  }
  encode_ordinary(text.substr(start), out);
  return out;
}

void TiktokenTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  splitter_->each(text, [&](size_t b, size_t len) { encode_piece(text.substr(b, len), out); });
}

void TiktokenTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const RankTable& rt = *ranks_;
  const char* s = piece.data();
  const size_t n = piece.size();
  // tiktoken looks the whole piece up first: a token BPE could not reach by merging is still used.
  if (uint32_t r = rt.find(s, n); r != kNoRank) {
    out.push_back(static_cast<int32_t>(r));
    return;
  }
  if (n <= 256) {
    // tiktoken's byte_pair_merge: parts[i] = (start, rank of the pair that starts there).
    struct Part {
      uint32_t start, rank;
    };
    Part parts[258];
    size_t m = n + 1;
    for (size_t i = 0; i + 1 < n; ++i) parts[i] = {static_cast<uint32_t>(i), rt.find(s + i, 2)};
    parts[n - 1] = {static_cast<uint32_t>(n - 1), kNoRank};
    parts[n] = {static_cast<uint32_t>(n), kNoRank};
    auto rank_after = [&](size_t i) {  // rank of parts[i] merged with parts[i+1..i+2] once i+1 is gone
      return i + 3 < m ? rt.find(s + parts[i].start, parts[i + 3].start - parts[i].start) : kNoRank;
    };
    for (;;) {
      uint32_t best = kNoRank;
      size_t bi = 0;
      for (size_t i = 0; i + 1 < m; ++i)
        if (parts[i].rank < best) best = parts[i].rank, bi = i;
      if (best == kNoRank) break;
      if (bi > 0) parts[bi - 1].rank = rank_after(bi - 1);
      parts[bi].rank = rank_after(bi);
      std::memmove(&parts[bi + 1], &parts[bi + 2], (m - bi - 2) * sizeof(Part));
      --m;
    }
    for (size_t i = 0; i + 1 < m; ++i)
      out.push_back(static_cast<int32_t>(rt.find(s + parts[i].start, parts[i + 1].start - parts[i].start)));
    return;
  }
  // Long pieces (whitespace runs, long words): the same merge order from a heap keyed (rank, start),
  // stale entries skipped. Start offsets grow along the list, so (rank, start) is tiktoken's
  // "lowest rank, leftmost first".
  std::vector<uint32_t> next(n + 1), prev(n + 1), rank(n + 1, kNoRank);
  for (size_t i = 0; i <= n; ++i) next[i] = static_cast<uint32_t>(i + 1), prev[i] = static_cast<uint32_t>(i ? i - 1 : 0);
  auto pair_rank = [&](uint32_t i) {
    const uint32_t j = next[i];
    if (j >= n) return kNoRank;
    return rt.find(s + i, next[j] - i);
  };
  using Entry = std::pair<uint32_t, uint32_t>;  // rank, start
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    rank[i] = pair_rank(i);
    if (rank[i] != kNoRank) heap.emplace(rank[i], i);
  }
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const auto [r, i] = heap.top();
    heap.pop();
    if (!alive[i] || rank[i] != r) continue;
    const uint32_t j = next[i];
    alive[j] = false;
    next[i] = next[j];
    if (next[j] <= n) prev[next[j]] = i;
    rank[i] = pair_rank(i);
    if (rank[i] != kNoRank) heap.emplace(rank[i], i);
    if (i > 0) {
      const uint32_t h = prev[i];
      rank[h] = pair_rank(h);
      if (rank[h] != kNoRank) heap.emplace(rank[h], h);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(static_cast<int32_t>(rt.find(s + i, next[i] - i)));
}

}  // namespace kd
