// tokenizer.json loading: what we cannot tokenize exactly is refused with the JSON path that says why,
// and the fixture's both merge spellings give the same ids.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "tokenizer/hf_tokenizer.h"

namespace {

const std::string kFixture = std::string(KDTREE_FIXTURES) + "/tokenizer-deepseek-small/tokenizer.json";

nlohmann::json read_fixture() {
  std::ifstream f(kFixture);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("kdtree_hf_" + name + ".json");
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

// Loads `text` and returns the error message ("" when it loaded).
std::string load_error(const std::string& name, const std::string& text) {
  const std::string path = write_temp(name, text);
  try {
    kd::load_hf_tokenizer(path);
  } catch (const kd::Error& e) {
    std::filesystem::remove(path);
    return e.what();
  }
  std::filesystem::remove(path);
  return "";
}

std::string join_bytes(const kd::Tokenizer& t, const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += t.token_bytes(id);
  return s;
}

TEST(HfTokenizer, FixtureRoundTripsAndMarksSpecials) {
  auto tok = kd::load_hf_tokenizer(kFixture);
  EXPECT_EQ(tok->kind(), "tokenizer.json");
  const std::string text = "Hello, 世界! 12345 🙂 <｜User｜>";
  EXPECT_EQ(join_bytes(*tok, tok->encode(text)), text);
  const auto user = tok->special_id("<｜User｜>");
  ASSERT_TRUE(user.has_value());
  EXPECT_TRUE(tok->is_special(*user));
  const auto with = tok->encode(text, true), without = tok->encode(text, false);
  EXPECT_EQ(with.back(), *user);
  EXPECT_NE(without.back(), *user);  // special text is ordinary text unless parse_special
  const auto think = tok->special_id("<think>");
  ASSERT_TRUE(think.has_value());
  EXPECT_FALSE(tok->is_special(*think));
  EXPECT_EQ(tok->encode("<think>", false), std::vector<int32_t>{*think});  // non-special: always matched
  EXPECT_THROW(tok->encode(std::string("a\xff", 2)), kd::Error);
  EXPECT_THROW(tok->token_bytes(tok->vocab_size()), kd::Error);
}

TEST(HfTokenizer, StringMergesEqualPairMerges) {
  nlohmann::json j = read_fixture();
  auto pairs = kd::load_hf_tokenizer(kFixture);
  for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  const std::string path = write_temp("string_merges", j.dump());
  auto strings = kd::load_hf_tokenizer(path);
  std::filesystem::remove(path);
  const std::string text = "The quick brown fox — 数字と漢字 — jumps over 1234567 lazy dogs.\r\n\tdef f(x): return x**2";
  EXPECT_EQ(pairs->encode(text), strings->encode(text));
}

// Each bad input must fail, and the message must name the JSON path of what is wrong.
TEST(HfTokenizer, RefusesWhatItCannotTokenizeExactly) {
  EXPECT_NE(load_error("not_json", "{\"model\": ").find("not valid JSON"), std::string::npos);
  EXPECT_NE(load_error("missing", "").find("not valid JSON"), std::string::npos);
  try {
    kd::load_hf_tokenizer("/nonexistent/tokenizer.json");
    ADD_FAILURE() << "loaded a missing file";
  } catch (const kd::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer.json"), std::string::npos);
  }
  struct Case {
    const char* name;
    void (*edit)(nlohmann::json&);
    const char* expect;
  };
  const Case cases[] = {
      {"wordpiece", [](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, "model.type: 'WordPiece'"},
      {"unknown_pre", [](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][1]["type"] = "Metaspace"; },
       "pre_tokenizer.pretokenizers[1].type: 'Metaspace'"},
      {"behavior", [](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "pre_tokenizer.pretokenizers[0].behavior: 'Removed'"},
      {"bad_regex", [](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][2]["pattern"]["Regex"] = "(unclosed"; },
       "pre_tokenizer.pretokenizers[2].pattern"},
      {"prefix_space", [](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][3]["add_prefix_space"] = true; },
       "pre_tokenizer.pretokenizers[3].add_prefix_space"},
      {"no_byte_level", [](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"].erase(3); }, "no ByteLevel step"},
      {"normalizer", [](nlohmann::json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer: type 'NFKC'"},
      {"decoder", [](nlohmann::json& j) { j["decoder"] = {{"type", "Metaspace"}}; }, "decoder: type 'Metaspace'"},
      {"byte_fallback", [](nlohmann::json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback"},
      {"merge_unknown", [](nlohmann::json& j) { j["model"]["merges"][5] = {"Ġ", "no-such-token"}; },
       "model.merges[5]: token 'no-such-token' is not in model.vocab"},
      {"merge_string", [](nlohmann::json& j) { j["model"]["merges"][7] = "threeparts a b"; }, "model.merges[7]"},
      {"merge_result", [](nlohmann::json& j) { j["model"]["merges"][3] = {"Ġ", "zzqx"}; }, "model.merges[3]"},
      {"added_lstrip", [](nlohmann::json& j) { j["added_tokens"][4]["lstrip"] = true; }, "added_tokens[4].lstrip"},
      {"vocab_id", [](nlohmann::json& j) { j["model"]["vocab"]["a"] = "x"; }, "model.vocab[\"a\"]"},
      {"truncation", [](nlohmann::json& j) { j["truncation"] = {{"max_length", 8}}; }, "truncation"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = read_fixture();
    c.edit(j);
    const std::string err = load_error(c.name, j.dump());
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.name << ": got '" << err << "'";
  }
}

}  // namespace
