// Text ↔ token ids for the models kdtree serves (SPEC-MODEL.md §4): Kimi's tiktoken-format BPE
// (tiktoken.model + tokenizer_config.json) and DeepSeek's HF tokenizer.json byte-level BPE.
// Both are byte-level: every id maps to a byte string; decode concatenates bytes, and the
// StreamDecoder holds back an incomplete UTF-8 tail so streamed text never shows broken characters.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kd {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Ids of `text` (UTF-8; invalid UTF-8 is a kd::Error naming the byte offset). Special-token
  // strings in the text are only recognised when parse_special (tiktoken's allowed_special="all");
  // otherwise they are encoded as ordinary text.
  virtual std::vector<int32_t> encode(std::string_view text, bool parse_special = false) const = 0;
  // The bytes of one id (special tokens: their name, e.g. "<|im_end|>"); kd::Error when out of range.
  virtual const std::string& token_bytes(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;  // ids are [0, vocab_size)
  virtual std::optional<int32_t> special_id(std::string_view name) const = 0;
  virtual bool is_special(int32_t id) const = 0;
  virtual std::string kind() const = 0;  // "tiktoken" or "tokenizer.json"

  // Concatenated bytes (may end in an incomplete UTF-8 sequence).
  std::string decode_bytes(const std::vector<int32_t>& ids) const;
  // Valid UTF-8: invalid or truncated sequences become U+FFFD.
  std::string decode(const std::vector<int32_t>& ids) const;
};

// Loads the tokenizer of a checkpoint directory: tiktoken.model + tokenizer_config.json (Kimi), else
// tokenizer.json (DeepSeek-V3/R1). Errors name the file and what is wrong.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);

// Streaming detokenizer: push ids as they are committed (a DDTree round commits several at once),
// get back the text that is now complete; flush() at the end emits a held-back tail as U+FFFD.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

// Replaces invalid UTF-8 with U+FFFD (maximal subparts, as Python's errors="replace" does).
std::string utf8_sanitize(std::string_view bytes);

}  // namespace kd
