// Tokenizer pieces that tiktoken cannot check: U+FFFD replacement, streaming hold-back of partial
// UTF-8, special/reserved naming, and the errors for bad tokenizer files and bad input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/tokenizer.h"

namespace {

const std::string kSmall = std::string(KDTREE_FIXTURES) + "/tokenizer-kimi-small";

const kd::Tokenizer& small() {
  static const std::unique_ptr<kd::Tokenizer> tok = kd::load_tokenizer(kSmall);
  return *tok;
}

std::string tmp_dir(const std::string& name) {
  const auto d = std::filesystem::temp_directory_path() / ("kdtree_tok_" + name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const kd::Error& e) {
    return e.what();
  }
  return "(no error)";
}

const std::string R = "\xEF\xBF\xBD";  // U+FFFD

TEST(TokenizerUtf8, SanitizeKeepsValidText) {
  EXPECT_EQ(kd::utf8_sanitize("héllo 中文 😀"), "héllo 中文 😀");
  EXPECT_EQ(kd::utf8_sanitize(""), "");
}

// Expected values are Python's bytes.decode("utf-8", errors="replace").
TEST(TokenizerUtf8, SanitizeReplacesMaximalSubparts) {
  EXPECT_EQ(kd::utf8_sanitize("a\xFF" "b"), "a" + R + "b");
  EXPECT_EQ(kd::utf8_sanitize("\xF0\x9F\x98"), R);                 // truncated 4-byte: one U+FFFD
  EXPECT_EQ(kd::utf8_sanitize("\xF0\x9F\x98" "a"), R + "a");
  EXPECT_EQ(kd::utf8_sanitize("\xE2\x82"), R);
  EXPECT_EQ(kd::utf8_sanitize("\xC0\xAF"), R + R);                 // overlong: each byte
  EXPECT_EQ(kd::utf8_sanitize("\xED\xA0\x80"), R + R + R);         // surrogate: 3 replacements
  EXPECT_EQ(kd::utf8_sanitize("\xF4\x90\x80\x80"), R + R + R + R); // > U+10FFFF
  EXPECT_EQ(kd::utf8_sanitize("\xE0\x80\x80"), R + R + R);
  EXPECT_EQ(kd::utf8_sanitize("\x80\x80"), R + R);
  EXPECT_EQ(kd::utf8_sanitize("\xF1\x80\x80\xE1\x80\xC2"), R + R + R);
  EXPECT_EQ(kd::utf8_sanitize("\xF8\x88\x80\x80\x80"), R + R + R + R + R);
}

TEST(TokenizerStream, HoldsBackAnEmojiSplitAcrossIds) {
  const kd::Tokenizer& tok = small();
  // Single-byte ids split 😀 (F0 9F 98 80) into four tokens.
  std::vector<int32_t> bytes_ids;
  for (unsigned char c : std::string("😀")) {
    for (int32_t id = 0; id < tok.vocab_size(); ++id)
      if (tok.token_bytes(id) == std::string(1, char(c))) {
        bytes_ids.push_back(id);
        break;
      }
  }
  ASSERT_EQ(bytes_ids.size(), 4u);
  kd::StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(tok.encode("a")[0]), "a");
  EXPECT_EQ(sd.push(bytes_ids[0]), "");
  EXPECT_EQ(sd.push(bytes_ids[1]), "");
  EXPECT_EQ(sd.push(bytes_ids[2]), "");
  EXPECT_EQ(sd.push(bytes_ids[3]), "😀");
  EXPECT_EQ(sd.push(tok.encode("b")[0]), "b");
  EXPECT_EQ(sd.flush(), "");
}

TEST(TokenizerStream, FlushReplacesATruncatedTailAndInvalidBytesPassAsReplacement) {
  const kd::Tokenizer& tok = small();
  auto id_of_byte = [&](unsigned char c) {
    for (int32_t id = 0; id < tok.vocab_size(); ++id)
      if (tok.token_bytes(id) == std::string(1, char(c))) return id;
    return -1;
  };
  kd::StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(id_of_byte(0xE4)), "");
  EXPECT_EQ(sd.push(id_of_byte(0xB8)), "");
  EXPECT_EQ(sd.flush(), R);
  EXPECT_EQ(sd.push(id_of_byte(0xFF)), R);  // can never become valid: replaced at once
  EXPECT_EQ(sd.push(id_of_byte(0xE4)), "");
  EXPECT_EQ(sd.push(id_of_byte('x')), R + "x");
}

TEST(TokenizerStream, ConcatenationEqualsDecode) {
  const kd::Tokenizer& tok = small();
  const std::string text = "Streaming 中文、日本語 😀👍🏽 e\u0301 <|im_end|> done\r\n";
  const std::vector<int32_t> ids = tok.encode(text, true);
  kd::StreamDecoder sd(tok);
  std::string out;
  for (int32_t id : ids) out += sd.push(id);
  out += sd.flush();
  EXPECT_EQ(out, text);
  EXPECT_EQ(tok.decode(ids), text);
}

TEST(TokenizerTiktoken, SpecialTokensFollowTheBaseRanks) {
  const kd::Tokenizer& tok = small();
  const auto& tt = dynamic_cast<const kd::TiktokenTokenizer&>(tok);
  const int32_t n = tt.n_base();
  EXPECT_EQ(tok.kind(), "tiktoken");
  EXPECT_EQ(tok.vocab_size(), n + 256);
  EXPECT_EQ(tok.special_id("[BOS]"), n);
  EXPECT_EQ(tok.special_id("<|im_end|>"), n + 2);
  EXPECT_EQ(tok.special_id("<|im_middle|>"), n + 17);
  EXPECT_EQ(tok.special_id("[PAD]"), n + 255);
  EXPECT_EQ(tok.token_bytes(n + 5), "<|reserved_token_" + std::to_string(n + 5) + "|>");
  EXPECT_EQ(tok.special_id("<|reserved_token_" + std::to_string(n + 5) + "|>"), n + 5);
  EXPECT_FALSE(tok.special_id("<|nope|>").has_value());
  EXPECT_TRUE(tok.is_special(n));
  EXPECT_FALSE(tok.is_special(n - 1));
  EXPECT_THROW(tok.token_bytes(n + 256), kd::Error);
  EXPECT_THROW(tok.token_bytes(-1), kd::Error);
}

TEST(TokenizerTiktoken, SpecialNamesAreTextUnlessParseSpecial) {
  const kd::Tokenizer& tok = small();
  const int32_t end = *tok.special_id("<|im_end|>");
  const auto plain = tok.encode("hi<|im_end|>");
  const auto parsed = tok.encode("hi<|im_end|>", true);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), end), 0);
  EXPECT_EQ(parsed.back(), end);
  EXPECT_EQ(tok.decode(plain), "hi<|im_end|>");
  EXPECT_EQ(tok.decode(parsed), "hi<|im_end|>");
}

TEST(TokenizerTiktoken, InvalidUtf8InputNamesTheOffset) {
  const std::string msg = error_of([] { small().encode("abc\xC3(def"); });
  EXPECT_NE(msg.find("byte offset 3"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { small().encode("\xED\xA0\x80"); }).find("byte offset 0"), std::string::npos);
}

TEST(TokenizerTiktoken, LongRunsEncodeAndRoundTrip) {
  const kd::Tokenizer& tok = small();
  for (const std::string& s : {std::string(200000, ' '), std::string(100000, 'a'), std::string(30000, '7')}) {
    const auto ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s);
  }
}

TEST(TokenizerTiktoken, BadFilesAreErrorsNamingFileAndLine) {
  const std::string d = tmp_dir("bad");
  std::string base;
  for (int b = 0; b < 256; ++b) {
    static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    base += std::string{k[b >> 2], k[(b & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
  }
  auto load = [&](const std::string& model, const std::string& config = "") {
    write(d + "/tiktoken.model", model);
    if (config.empty()) std::filesystem::remove(d + "/tokenizer_config.json");
    else write(d + "/tokenizer_config.json", config);
    return error_of([&] { kd::load_tokenizer(d); });
  };
  EXPECT_EQ(load(base), "(no error)");
  EXPECT_NE(load(base + "@@@@ 256\n").find("tiktoken.model:257: invalid base64"), std::string::npos);
  EXPECT_NE(load(base + "QUI= 3\n").find("rank 3 repeats line 4"), std::string::npos);
  EXPECT_NE(load(base + "QUI= 300\n").find("without gaps"), std::string::npos);
  EXPECT_NE(load(base + "QUI=\n").find("tiktoken.model:257: expected `base64 rank`"), std::string::npos);
  EXPECT_NE(load(base + "AA== 256\n").find("token bytes repeat line 1"), std::string::npos) << load(base + "AA== 256\n");
  EXPECT_NE(load(base.substr(base.find('\n') + 1)).find("without gaps"), std::string::npos);
  EXPECT_NE(load(base, "{\"added_tokens_decoder\": {\"5\": {\"content\": \"x\"}}}").find("collides with base rank 5"),
            std::string::npos);
  EXPECT_NE(load(base, "{not json").find("tokenizer_config.json: not valid JSON"), std::string::npos);
  EXPECT_NE(load(base, "{\"added_tokens_decoder\": {\"256\": {\"content\": \"[A]\"}, \"257\": {\"content\": \"[A]\"}}}")
                .find("named twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kd::load_tokenizer(d + "/missing"); }).find("not a directory"), std::string::npos);
  std::filesystem::remove(d + "/tiktoken.model");
  EXPECT_NE(error_of([&] { kd::load_tokenizer(d); }).find("no tokenizer"), std::string::npos);
}

TEST(TokenizerTiktoken, MissingByteIsAnError) {
  const std::string d = tmp_dir("nobyte");
  write(d + "/tiktoken.model", "QQ== 0\nQg== 1\n");
  EXPECT_NE(error_of([&] { kd::load_tokenizer(d); }).find("no token for the single byte 0x00"), std::string::npos);
}

}  // namespace
