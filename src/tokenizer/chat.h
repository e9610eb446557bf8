// Chat templates rendered natively (no Jinja engine): each kind reproduces, byte for byte, the Jinja
// chat_template its model publishes in tokenizer_config.json (copies and their sources:
// tests/fixtures/chat-templates/). SPEC-MODEL.md §4 describes Kimi's format; issue 6 the tool calls.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kd {

// Each kind names the template file it reproduces (tests/fixtures/chat-templates/; its README says
// which are exact copies of a published template and which are reconstructions).
enum class ChatTemplateKind {
  kimi,              // kimi-k2.jinja: K2-Thinking's template + the `thinking` switch, <think> prefill, JSON tools
  deepseek_v3,       // deepseek-v3.jinja: <｜begin▁of▁sentence｜>{system}<｜User｜>…<｜Assistant｜>…
  kimi_k2_thinking,  // moonshotai-Kimi-K2-Thinking.jinja: exact published copy; no prefill, no switches
  kimi_k25,          // kimi-k25.jinja: TypeScript tool declarations (`tools_ts_str`), compact JSON fallback
  kimi_k26,          // kimi-k26.jinja: kimi_k25 + `preserve_thinking`
};

struct ToolCall {
  std::string id, name, arguments_json;  // arguments as the JSON text the model produced
  // As the request gave them (chat_messages_from_json): DeepSeek-V3's template concatenates
  // tool['type'] and the arguments, so a missing type ("") or object arguments fail there.
  std::string type = "function";
  bool arguments_object = false;
};

// One OpenAI-style message. An empty string stands for an absent or null field (the templates
// render both the same way).
struct ChatMessage {
  std::string role, content, name, reasoning_content;
  std::vector<ToolCall> tool_calls;
  std::string tool_call_id;
  // Where a template tells a null from an empty string (chat_messages_from_json sets these): Kimi's
  // prints a JSON-null reasoning_content as "None"; DeepSeek-V3's cannot concatenate a null or
  // missing content, so kdtree refuses what jinja2 would fail on.
  bool content_null = false, reasoning_null = false;
};

struct ChatOptions {
  std::string tools_json;  // OpenAI tools array as JSON text, may be empty
  bool add_generation_prompt = true;
  std::optional<bool> thinking;  // chat_template_kwargs.thinking; unset = the template's default
  std::optional<bool> preserve_thinking;  // chat_template_kwargs.preserve_thinking (kimi_k26 only)
};

// The prompt text. Special-token names appear literally; encode it with parse_special.
// Throws kd::Error on tools_json that is not a JSON array, and on options the template has no
// variable for (preserve_thinking outside kimi_k26, thinking on kimi_k2_thinking) rather than
// ignoring them.
std::string render_chat(ChatTemplateKind kind, const std::vector<ChatMessage>& messages, const ChatOptions& opts);

// Names of the tokens that end an assistant turn (look them up with Tokenizer::special_id).
std::vector<std::string> chat_stop_tokens(ChatTemplateKind kind);

// OpenAI `messages` JSON (string or [{type:"text",text}] content, tool_calls[].function.{name,
// arguments}) → messages. Errors name the field, e.g. "messages[2].role".
std::vector<ChatMessage> chat_messages_from_json(std::string_view json_text);

// Names as the CLI spells them: kimi, kimi-k2-thinking, kimi-k25, kimi-k26, deepseek-v3 ('_' for
// '-' accepted too).
ChatTemplateKind chat_template_kind_from_name(std::string_view name);
const char* chat_template_kind_name(ChatTemplateKind kind);
extern const char* const kChatTemplateNames;  // "kimi|kimi-k2-thinking|…" for help texts and errors

// Which kind renders a checkpoint's chat template (the text of chat_template.jinja or of
// tokenizer_config.json's "chat_template"). A template kdtree knows byte for byte (whitespace
// aside) gives its kind and no warning; one that only shares a known template's distinctive
// variables gives that kind and a warning; one that matches nothing is an error (pick with
// --template). A checkpoint with no template text falls back to its tokenizer's family (Kimi
// for tiktoken.model, DeepSeek-V3 for tokenizer.json), with a warning.
struct ChatTemplateChoice {
  ChatTemplateKind kind;
  std::string warning;  // empty when the template is recognised exactly
};
ChatTemplateChoice chat_template_for_text(std::string_view template_text, std::string_view where);
ChatTemplateChoice chat_template_for_checkpoint(const std::string& dir);

}  // namespace kd
