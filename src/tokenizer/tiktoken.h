// Kimi's tiktoken-format byte-level BPE (SPEC-MODEL.md §4): `tiktoken.model` holds one
// `base64(bytes) rank` line per token; special tokens follow the base ranks (named from
// tokenizer_config.json's added_tokens_decoder, the rest `<|reserved_token_ID|>`); text is split by
// Kimi's pat_str and each piece is merged pair by pair, lowest rank first, as tiktoken does.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kd {

// Kimi's pat_str, joined with '|' exactly as tokenization_kimi.py writes it (Rust-regex syntax, with
// `&&` class intersections). Kept for reference and for the tests' tiktoken.Encoding.
extern const char* const kKimiPatStr;

// Number of special slots after the base ranks (tokenization_kimi.py: num_reserved_special_tokens).
constexpr int32_t kKimiNumReservedSpecial = 256;

class TiktokenTokenizer final : public Tokenizer {
 public:
  // `model_path`: tiktoken.model. `config_path`: tokenizer_config.json, or "" for none (every special
  // slot is then `<|reserved_token_ID|>`). Errors name the file and line or field.
  TiktokenTokenizer(const std::string& model_path, const std::string& config_path);
  ~TiktokenTokenizer() override;

  std::vector<int32_t> encode(std::string_view text, bool parse_special = false) const override;
  const std::string& token_bytes(int32_t id) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  std::optional<int32_t> special_id(std::string_view name) const override;
  bool is_special(int32_t id) const override { return id >= n_base_ && id < vocab_size(); }
  std::string kind() const override { return "tiktoken"; }

  int32_t n_base() const { return n_base_; }  // base (mergeable) ranks: ids [0, n_base)
  // Pre-tokenizer pieces of valid UTF-8 `text` as (offset, length); for tests.
  std::vector<std::pair<size_t, size_t>> split(std::string_view text) const;

 private:
  struct RankTable;
  struct Splitter;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<std::string> tokens_;  // id → bytes (specials: their name)
  int32_t n_base_ = 0;
  std::unique_ptr<RankTable> ranks_;    // bytes → rank, base ranks only
  std::unique_ptr<Splitter> splitter_;  // compiled pat_str
  std::vector<std::pair<std::string, int32_t>> specials_;  // name → id, sorted by name
  std::vector<uint8_t> special_lengths_;                   // distinct name lengths, longest first
  bool special_first_[256] = {};                           // bytes a special name starts with
};

}  // namespace kd
