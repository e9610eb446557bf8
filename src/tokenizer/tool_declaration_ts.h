// Kimi K2.5 / K2.6 declare tools to the model as TypeScript, not JSON: their tokenizer's
// apply_chat_template runs Moonshot's `encode_tools_to_typescript_style` (tool_declaration_ts.py,
// shipped with the checkpoint) and hands the text to the chat template as `tools_ts_str`. This is a
// native rendering of that encoder, byte-identical to it (tests/cli/test_chat_template.py runs the
// Python one as the reference; the copy and its source are in tests/fixtures/chat-templates/).
//
// Where the Python encoder raises (unknown $ref, enum values that contradict their type, ...), the
// tokenizer catches the exception and the template declares the tools as JSON instead: that case
// returns no text. Where Python would print something we do not reproduce exactly (the repr() of a
// list used as a constraint value, for one), kd::Error is thrown naming the JSON path.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace kd {

// `tools`: the OpenAI tools array with every object's keys sorted (nlohmann::json's std::map order,
// the same as the tokenizer's deep_sort_dict). Returns the `# Tools` text, "" when no tool is a
// function (Python returns "" too), or nullopt where Python raises; `why` gets the reason then.
std::optional<std::string> encode_tools_typescript(const nlohmann::json& tools, std::string* why = nullptr);

// Refuses (kd::Error naming `what`) JSON text with an integer literal outside 64 bits: Python keeps
// it exact, nlohmann::json would turn it into a double and print it differently.
void check_json_integers(std::string_view json_text, const char* what);

// Python's repr() of a float (shortest round-trip digits, '1e-05', '1e+16', '2.0').
std::string py_float_repr(double v);

// json.dumps(v, ensure_ascii=False) with the given separators; floats as Python writes them.
void dump_python_json(const nlohmann::json& v, std::string& out, const char* item_sep = ", ", const char* key_sep = ": ");
void dump_python_json(const nlohmann::ordered_json& v, std::string& out, const char* item_sep = ", ",
                      const char* key_sep = ": ");  // keys in the order the JSON text had them

}  // namespace kd
