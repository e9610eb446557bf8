// OpenAI request bodies → validated ApiRequest (issue 6; docs/architecture.md "Server" lists the
// fields). Policy, the same for every route:
//   - unknown top-level fields are ignored, as vLLM and llama-server do (clients send `user`,
//     `metadata`, `store`, … freely);
//   - a known field with the wrong JSON type, or out of range, is a 400 naming the field;
//   - a known OpenAI parameter kdtree does not implement (n > 1, best_of > 1, echo, suffix,
//     logit_bias, presence/frequency penalties, response_format other than text, legacy functions)
//     is a 400 when set to anything but its neutral value — never silently ignored.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "tokenizer/chat.h"

namespace kd {

// An error answered as {"error": {"code": status, "message", "type", "param"}} (llama-server's shape;
// `param` names the offending field when there is one).
struct ApiError : Error {
  int status;
  std::string type, param;
  ApiError(int status_, std::string type_, const std::string& message, std::string param_ = "")
      : Error(message), status(status_), type(std::move(type_)), param(std::move(param_)) {}
};
[[noreturn]] void bad_request(const std::string& param, const std::string& message);
std::string error_json(int status, const std::string& type, const std::string& message, const std::string& param = "");

enum class Endpoint { chat, completion };

enum class ToolChoice { none, auto_, required, named };

struct ApiRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string model;  // as sent; empty when absent
  // /v1/completions: a string, or token ids.
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  bool prompt_is_ids = false;
  // /v1/chat/completions
  std::vector<ChatMessage> messages;
  std::string tools_json;  // the tools array as JSON text, empty when none
  std::vector<std::string> tool_names;
  bool strict_tools = false;       // some tool has function.strict: true
  std::string tools_json_ordered;  // strict_tools or tool_choice required / named: the tools array in document order (schemas' property order)
  ToolChoice tool_choice = ToolChoice::auto_;
  std::string tool_choice_name;  // ToolChoice::named
  std::optional<bool> thinking;  // chat_template_kwargs.thinking
  // Generation. Unset optionals take the model's generation_config.json, then kdtree's defaults.
  std::optional<int64_t> max_tokens;
  std::optional<float> temperature, top_p, min_p;
  std::optional<int32_t> top_k;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false, ignore_eos = false;
  int32_t top_logprobs = -1;  // -1: no logprobs; else 0…20 alternatives per token
  // Constrained output: response_format {type: json_object} / {type: json_schema, json_schema:
  // {schema, strict}} (either route), or llama.cpp's `grammar` (GBNF text). Compiled in prepare.
  enum class Constraint { none, json_object, json_schema, gbnf } constraint = Constraint::none;
  std::string constraint_source;  // the schema as JSON text (key order kept) or the GBNF text
  bool constraint_strict = false;  // json_schema.strict
};

constexpr size_t kMaxStopStrings = 16;
constexpr int32_t kMaxTopLogprobs = 20;

// Parses and validates a request body; throws ApiError (400) naming the field.
ApiRequest parse_api_request(Endpoint endpoint, std::string_view body);

}  // namespace kd
