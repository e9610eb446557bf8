// Decoding shared by every tokenizer (bytes, U+FFFD replacement, streaming) and the loader that
// picks the tokenizer format a checkpoint directory ships.
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

#include <filesystem>

#include "core/error.h"
#include "tokenizer/hf_tokenizer.h"
#include "tokenizer/tiktoken.h"

namespace kd {

namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// Decodes s[0, n) into `out`, each ill-formed subsequence replaced by one U+FFFD using the Unicode
// "maximal subpart" rule (Python's errors="replace"). With `hold_tail`, a sequence cut short only by
// the end of `s` is not replaced but left unconsumed. Returns the bytes consumed.
size_t utf8_decode(std::string_view s, std::string& out, bool hold_tail) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  out.reserve(out.size() + n);
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    size_t len;
    unsigned char lo, hi;  // allowed range of the second byte
    if (!utf8_lead(c, &len, &lo, &hi)) {
      out += kReplacement;
      ++i;
      continue;
    }
    size_t k = 1;  // bytes of the sequence that are valid so far
    while (k < len && i + k < n) {
      const unsigned char b = p[i + k];
      const bool ok = (k == 1) ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
      if (!ok) break;
      ++k;
    }
    if (k == len) {
      out.append(s.data() + i, len);
    } else if (i + k == n && hold_tail) {
      return i;  // a prefix of a valid character, cut by the end: wait for more bytes
    } else {
      out += kReplacement;
    }
    i += k;
  }
  return n;
}

}  // namespace

std::string utf8_sanitize(std::string_view bytes) {
  std::string out;
  utf8_decode(bytes, out, false);
  return out;
}

std::string Tokenizer::decode_bytes(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const { return utf8_sanitize(decode_bytes(ids)); }

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_.token_bytes(id);
  std::string out;
  const size_t used = utf8_decode(pending_, out, true);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8_sanitize(pending_);
  pending_.clear();
  return out;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec)) fail(dir, ": not a directory (expected a checkpoint or tokenizer directory)");
  // exists, not is_regular_file: a FIFO or directory in a tokenizer file's place is refused by name
  // when read (read_text_file), not skipped as if absent.
  if (fs::exists(d / "tiktoken.model", ec)) {
    const fs::path cfg = d / "tokenizer_config.json";
    return std::make_unique<TiktokenTokenizer>((d / "tiktoken.model").string(),
                                               fs::exists(cfg, ec) ? cfg.string() : std::string());
  }
  if (fs::exists(d / "tokenizer.json", ec)) return load_hf_tokenizer((d / "tokenizer.json").string());
  fail(dir, ": no tokenizer (expected tiktoken.model + tokenizer_config.json, as Kimi ships, or tokenizer.json)");
}

}  // namespace kd
