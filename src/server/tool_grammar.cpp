#include "server/tool_grammar.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"

namespace kd {

namespace {

std::string literal(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c < 0x20) {
      static const char* h = "0123456789ABCDEF";
      out += "\\x";
      out += h[c >> 4];
      out += h[c & 15];
      continue;
    }
    out += char(c);
  }
  return out + "\"";
}

}  // namespace

std::string kimi_tool_call_gbnf(const nlohmann::ordered_json& tools, ToolChoice choice, const std::string& named_function,
                                bool in_reasoning) {
  grammar::JsonGrammarOptions jo;
  jo.any_whitespace = false;  // ", " and ": ", as the server writes JSON elsewhere
  std::string rules, calls;
  std::string named_args;
  for (size_t i = 0; i < tools.size(); ++i) {
    const auto& f = tools[i]["function"];
    const std::string name = f["name"].get<std::string>();
    const bool strict = f.contains("strict") && f["strict"].is_boolean() && f["strict"].get<bool>();
    const std::string prefix = cat("tool", i, "-");
    std::string g;
    try {
      if (strict) {
        jo.strict = true;
        g = grammar::json_schema_to_gbnf(f.contains("parameters") ? f["parameters"] : nlohmann::ordered_json::parse(R"({"type":"object","properties":{}})"), jo);
      } else {
        jo.strict = false;
        g = grammar::json_object_gbnf(jo);
      }
    } catch (const Error& e) {
      fail("tools[", i, "].function.parameters: ", e.what());
    }
    rules += grammar::prefix_rules(g, prefix);
    calls += cat(calls.empty() ? "" : " | ", literal(name + ":"), " [0-9]+ <|tool_call_argument_begin|> ", prefix, "root");
    if (name == named_function) named_args = prefix + "root";
  }
  std::string root;
  switch (choice) {
    case ToolChoice::named:
      if (named_args.empty()) fail("tool_choice names '", named_function, "', which is not in tools");
      root = named_args + " <|tool_call_end|> <|tool_calls_section_end|>";
      break;
    case ToolChoice::required:
      root = "calls";
      break;
    case ToolChoice::auto_:
      root = cat(in_reasoning ? "text </think> " : "", "text (<|tool_calls_section_begin|> calls)?");
      break;
    case ToolChoice::none:
      fail("internal: no tool grammar for tool_choice none");
  }
  return cat("root ::= ", root, "\n",
             "calls ::= call+ <|tool_calls_section_end|>\n",
             "call ::= <|tool_call_begin|> \"functions.\" (", calls, ") <|tool_call_end|>\n",
             "text ::= .*\n", rules);
}

}  // namespace kd
