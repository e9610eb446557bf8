// Chat-template pieces with facts that need no renderer to check: Python's float repr (goldens
// printed by CPython 3.11's repr()), kind names, and the TypeScript encoder's documented edge cases.
// The renderers themselves are checked against jinja2 in tests/cli/test_chat_template.py and
// test_chat_tools_ts.py.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/chat.h"
#include "tokenizer/tool_declaration_ts.h"

namespace {

TEST(Chat, PythonFloatRepr) {
  const std::pair<double, const char*> cases[] = {
      {0.1, "0.1"},
      {1e-05, "1e-05"},
      {0.0001, "0.0001"},
      {1e+16, "1e+16"},
      {1000000000000000.0, "1000000000000000.0"},
      {1.2345678901234568e+17, "1.2345678901234568e+17"},
      {1.5, "1.5"},
      {2.0, "2.0"},
      {-0.0, "-0.0"},
      {5e-324, "5e-324"},
      {1.7976931348623157e+308, "1.7976931348623157e+308"},
      {0.30000000000000004, "0.30000000000000004"},
      {0.3333333333333333, "0.3333333333333333"},
      {100.0, "100.0"},
      {1e+22, "1e+22"},
      {-2.5e-07, "-2.5e-07"},
      {9999999999999998.0, "9999999999999998.0"},
      {12345.678, "12345.678"},
  };
  for (const auto& [v, want] : cases) EXPECT_EQ(kd::py_float_repr(v), want) << want;
}

TEST(Chat, KindNamesRoundTrip) {
  for (const char* n : {"kimi", "kimi-k2-thinking", "kimi-k25", "kimi-k26", "deepseek-v3"})
    EXPECT_STREQ(kd::chat_template_kind_name(kd::chat_template_kind_from_name(n)), n);
  EXPECT_EQ(kd::chat_template_kind_from_name("kimi_k26"), kd::ChatTemplateKind::kimi_k26);
  try {
    kd::chat_template_kind_from_name("llama3");
    FAIL() << "no error";
  } catch (const kd::Error& e) {
    EXPECT_NE(std::string(e.what()).find("kimi-k25"), std::string::npos) << e.what();  // lists the known ones
  }
}

TEST(Chat, TypescriptEncoderFallsBackWhereKimisRaises) {
  using nlohmann::json;
  std::string why;
  // A $ref to an undefined $defs entry: Python raises ValueError, the template then uses JSON.
  const json bad = json::parse(R"([{"type":"function","function":{"name":"f","parameters":
      {"type":"object","properties":{"a":{"$ref":"#/$defs/Missing"}}}}}])");
  EXPECT_FALSE(kd::encode_tools_typescript(bad, &why).has_value());
  EXPECT_NE(why.find("Missing"), std::string::npos) << why;
  // No function tools at all: an empty declaration, not a failure.
  EXPECT_EQ(kd::encode_tools_typescript(json::parse(R"([{"type":"_plugin"}])")).value(), "");
  // The smallest function: the exact text Moonshot's encoder gives (by hand from its source).
  EXPECT_EQ(kd::encode_tools_typescript(json::parse(R"([{"type":"function","function":{"name":"ping"}}])")).value(),
            "# Tools\n\n## functions\nnamespace functions {\ntype ping = (_: {}) => any;\n}\n");
}

}  // namespace
