// Each render_* function walks the messages the way its Jinja template does (the template text is in
// tests/fixtures/chat-templates/, and tests/cli/test_chat_template.py checks the two agree).
#include "tokenizer/chat.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kd {
namespace {

using json = nlohmann::json;

// transformers renders `tools | tojson` as json.dumps(tools, ensure_ascii=False): ", " and ": "
// separators, non-ASCII kept. Kimi's apply_chat_template deep-sorts dict keys first, which
// nlohmann::json's std::map objects already are (UTF-8 byte order = code point order).
void dump_python(const json& j, std::string& out) {
  if (j.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += json(it.key()).dump(-1, ' ', false);
      out += ": ";
      dump_python(it.value(), out);
    }
    out += '}';
  } else if (j.is_array()) {
    out += '[';
    for (size_t i = 0; i < j.size(); ++i) {
      if (i) out += ", ";
      dump_python(j[i], out);
    }
    out += ']';
  } else {
    out += j.dump(-1, ' ', false);
  }
}

// Kimi K2-Thinking's chat_template with K2.5's `thinking` switch (tests/fixtures/chat-templates/kimi-k2.jinja).
std::string render_kimi(const std::vector<ChatMessage>& msgs, const ChatOptions& opts, const json& tools) {
  std::string out;
  // Messages up to the last assistant turn without tool calls are history: their reasoning is
  // dropped (<think></think>); later ones (the current agent loop) keep reasoning_content.
  int64_t last_plain_assistant = -1;
  for (int64_t i = int64_t(msgs.size()) - 1; i >= 0; --i)
    if (msgs[size_t(i)].role == "assistant" && msgs[size_t(i)].tool_calls.empty()) {
      last_plain_assistant = i;
      break;
    }
  if (!tools.empty()) {
    out += "<|im_system|>tool_declare<|im_middle|>";
    dump_python(tools, out);
    out += "<|im_end|>";
  }
  if (msgs.empty() || msgs[0].role != "system")
    out += "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>";
  const bool thinking_off = opts.thinking.has_value() && !*opts.thinking;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const std::string& role_name = m.name.empty() ? m.role : m.name;
    out += m.role == "user" ? "<|im_user|>" : m.role == "assistant" ? "<|im_assistant|>" : "<|im_system|>";
    out += role_name;
    out += "<|im_middle|>";
    if (m.role == "assistant") {
      const bool history = int64_t(i) <= last_plain_assistant;
      out += "<think>";
      if (!history && !thinking_off) out += m.reasoning_content;
      out += "</think>";
      out += m.content;
      if (!m.tool_calls.empty()) {
        out += "<|tool_calls_section_begin|>";
        for (const ToolCall& tc : m.tool_calls)
          out += cat("<|tool_call_begin|>", tc.id, "<|tool_call_argument_begin|>", tc.arguments_json, "<|tool_call_end|>");
        out += "<|tool_calls_section_end|>";
      }
    } else if (m.role == "tool") {
      out += cat("## Return of ", m.tool_call_id, "\n", m.content);
    } else {
      out += m.content;
    }
    out += "<|im_end|>";
  }
  if (opts.add_generation_prompt) out += thinking_off ? "<|im_assistant|>assistant<|im_middle|><think></think>" : "<|im_assistant|>assistant<|im_middle|><think>";
  return out;
}

// DeepSeek-V3's chat_template (tests/fixtures/chat-templates/deepseek-v3.jinja), quirks included:
// `is_first` is never reset, so only the first assistant tool-call turn of a conversation opens with
// <｜Assistant｜><｜tool▁calls▁begin｜>; tools are not declared in the prompt.
std::string render_deepseek_v3(const std::vector<ChatMessage>& msgs, const ChatOptions& opts) {
  std::string out = "<｜begin▁of▁sentence｜>";
  bool first_system = true;
  for (const ChatMessage& m : msgs)
    if (m.role == "system") {
      if (!first_system) out += "\n\n";
      out += m.content;
      first_system = false;
    }
  bool is_first = false, is_tool = false, is_output_first = true;
  auto call = [](const ToolCall& tc) {
    return cat("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", tc.name, "\n```json\n", tc.arguments_json, "\n```<｜tool▁call▁end｜>");
  };
  for (const ChatMessage& m : msgs) {
    if (m.role == "user") {
      is_tool = false;
      out += "<｜User｜>";
      out += m.content;
    } else if (m.role == "assistant" && !m.tool_calls.empty()) {
      is_tool = false;
      for (const ToolCall& tc : m.tool_calls) {
        if (!is_first) {
          out += cat("<｜Assistant｜>", m.content, "<｜tool▁calls▁begin｜>", call(tc));
          is_first = true;
        } else {
          out += '\n';
          out += call(tc);
        }
      }
      out += "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>";
    } else if (m.role == "assistant") {
      if (is_tool) {
        out += cat("<｜tool▁outputs▁end｜>", m.content, "<｜end▁of▁sentence｜>");
        is_tool = false;
      } else {
        const size_t end_think = m.content.rfind("</think>");
        const std::string content = end_think == std::string::npos ? m.content : m.content.substr(end_think + 8);
        out += cat("<｜Assistant｜>", content, "<｜end▁of▁sentence｜>");
      }
    } else if (m.role == "tool") {
      is_tool = true;
      out += is_output_first ? "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" : "<｜tool▁output▁begin｜>";
      out += m.content;
      out += "<｜tool▁output▁end｜>";
      is_output_first = false;
    }
  }
  if (is_tool) out += "<｜tool▁outputs▁end｜>";
  if (opts.add_generation_prompt && !is_tool) out += "<｜Assistant｜>";
  return out;
}

}  // namespace

std::string render_chat(ChatTemplateKind kind, const std::vector<ChatMessage>& messages, const ChatOptions& opts) {
  json tools = json::array();
  if (!opts.tools_json.empty()) {
    try {
      tools = json::parse(opts.tools_json);
    } catch (const json::parse_error& e) {
      fail("tools: not valid JSON: ", e.what());
    }
    if (!tools.is_array()) fail("tools: expected a JSON array of tool definitions");
  }
  switch (kind) {
    case ChatTemplateKind::kimi: return render_kimi(messages, opts, tools);
    case ChatTemplateKind::deepseek_v3: return render_deepseek_v3(messages, opts);
  }
  fail("unknown chat template kind");
}

std::vector<std::string> chat_stop_tokens(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::kimi: return {"<|im_end|>", "[EOS]", "[EOT]"};  // SPEC-MODEL.md §4: 163586, 163585, 163593
    case ChatTemplateKind::deepseek_v3: return {"<｜end▁of▁sentence｜>"};
  }
  return {};
}

ChatTemplateKind chat_template_kind_from_name(std::string_view name) {
  if (name == "kimi") return ChatTemplateKind::kimi;
  if (name == "deepseek-v3" || name == "deepseek_v3") return ChatTemplateKind::deepseek_v3;
  fail("unknown chat template '", name, "' (known: kimi, deepseek-v3)");
}

const char* chat_template_kind_name(ChatTemplateKind kind) {
  return kind == ChatTemplateKind::kimi ? "kimi" : "deepseek-v3";
}

std::vector<ChatMessage> chat_messages_from_json(std::string_view json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    fail("messages: not valid JSON: ", e.what());
  }
  if (j.is_object() && j.contains("messages")) j = j["messages"];
  if (!j.is_array()) fail("messages: expected a JSON array of messages");
  auto text_of = [](const json& v, const std::string& where) -> std::string {
    if (v.is_null()) return "";
    if (v.is_string()) return v.get<std::string>();
    if (v.is_array()) {  // content parts: the templates concatenate the text parts
      std::string s;
      for (size_t k = 0; k < v.size(); ++k) {
        const json& part = v[k];
        if (!part.is_object() || part.value("type", std::string()) != "text" || !part.contains("text") || !part["text"].is_string())
          fail(where, "[", k, "]: only {\"type\": \"text\", \"text\": ...} parts are supported");
        s += part["text"].get<std::string>();
      }
      return s;
    }
    fail(where, ": expected a string, null or an array of text parts");
  };
  auto str_of = [](const json& m, const char* key, const std::string& where) -> std::string {
    auto it = m.find(key);
    if (it == m.end() || it->is_null()) return "";
    if (!it->is_string()) fail(where, ".", key, ": expected a string");
    return it->get<std::string>();
  };
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = cat("messages[", i, "]");
    const json& m = j[i];
    if (!m.is_object()) fail(where, ": expected an object");
    ChatMessage msg;
    msg.role = str_of(m, "role", where);
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
      fail(where, ".role: '", msg.role, "' (expected system, user, assistant or tool)");
    if (m.contains("content")) msg.content = text_of(m["content"], where + ".content");
    msg.name = str_of(m, "name", where);
    msg.reasoning_content = str_of(m, "reasoning_content", where);
    if (msg.reasoning_content.empty()) msg.reasoning_content = str_of(m, "reasoning", where);
    msg.tool_call_id = str_of(m, "tool_call_id", where);
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      const json& calls = m["tool_calls"];
      if (!calls.is_array()) fail(where, ".tool_calls: expected an array");
      for (size_t k = 0; k < calls.size(); ++k) {
        const std::string w = cat(where, ".tool_calls[", k, "]");
        const json& c = calls[k];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object()) fail(w, ".function: expected an object");
        const json& f = c["function"];
        ToolCall tc{str_of(c, "id", w), str_of(f, "name", w + ".function"), ""};
        if (f.contains("arguments") && !f["arguments"].is_string() && !f["arguments"].is_null())
          dump_python(f["arguments"], tc.arguments_json);  // an object, as some clients send: `| tojson`
        else
          tc.arguments_json = str_of(f, "arguments", w + ".function");
        msg.tool_calls.push_back(std::move(tc));
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace kd
