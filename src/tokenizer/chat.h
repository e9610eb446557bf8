// Chat templates rendered natively (no Jinja engine): each kind reproduces, byte for byte, the Jinja
// chat_template its model publishes in tokenizer_config.json (copies and their sources:
// tests/fixtures/chat-templates/). SPEC-MODEL.md §4 describes Kimi's format; issue 6 the tool calls.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kd {

enum class ChatTemplateKind {
  kimi,         // Kimi K2-Thinking / K2.5: <|im_user|>…<|im_middle|>…<|im_end|>, <think> prefill
  deepseek_v3,  // DeepSeek-V3: <｜begin▁of▁sentence｜>{system}<｜User｜>…<｜Assistant｜>…
};

struct ToolCall {
  std::string id, name, arguments_json;  // arguments as the JSON text the model produced
};

// One OpenAI-style message. An empty string stands for an absent or null field (the templates
// render both the same way).
struct ChatMessage {
  std::string role, content, name, reasoning_content;
  std::vector<ToolCall> tool_calls;
  std::string tool_call_id;
};

struct ChatOptions {
  std::string tools_json;  // OpenAI tools array as JSON text, may be empty
  bool add_generation_prompt = true;
  std::optional<bool> thinking;  // chat_template_kwargs.thinking; unset = the template's default
};

// The prompt text. Special-token names appear literally; encode it with parse_special.
// Throws kd::Error on tools_json that is not a JSON array.
std::string render_chat(ChatTemplateKind kind, const std::vector<ChatMessage>& messages, const ChatOptions& opts);

// Names of the tokens that end an assistant turn (look them up with Tokenizer::special_id).
std::vector<std::string> chat_stop_tokens(ChatTemplateKind kind);

// OpenAI `messages` JSON (string or [{type:"text",text}] content, tool_calls[].function.{name,
// arguments}) → messages. Errors name the field, e.g. "messages[2].role".
std::vector<ChatMessage> chat_messages_from_json(std::string_view json_text);

ChatTemplateKind chat_template_kind_from_name(std::string_view name);  // "kimi", "deepseek-v3"
const char* chat_template_kind_name(ChatTemplateKind kind);

}  // namespace kd
