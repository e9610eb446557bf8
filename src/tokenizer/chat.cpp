// Each render_* function walks the messages the way its Jinja template does (the template text is in
// tests/fixtures/chat-templates/, and tests/cli/test_chat_template.py checks the two agree).
#include "tokenizer/chat.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/untrusted.h"
#include "tokenizer/tool_declaration_ts.h"

namespace kd {
namespace {

using json = nlohmann::json;

// transformers renders `tools | tojson` as json.dumps(tools, ensure_ascii=False): ", " and ": "
// separators unless the template passes others, non-ASCII kept. Kimi's apply_chat_template
// deep-sorts dict keys first, which nlohmann::json's std::map objects already are (UTF-8 byte
// order = code point order).
void dump_python(const json& j, std::string& out) { dump_python_json(j, out); }
void dump_python(const nlohmann::ordered_json& j, std::string& out) { dump_python_json(j, out); }

// What distinguishes the Kimi templates (see ChatTemplateKind).
struct KimiVariant {
  bool thinking_switch;    // reads `thinking`: false drops current reasoning and prefills <think></think>
  bool think_prefill;      // the generation prompt opens <think>
  bool typescript_tools;   // tools_ts_str (compact JSON when the encoder gives none), else spaced JSON
  bool preserve_thinking;  // reads `preserve_thinking`: true keeps every turn's reasoning
};

KimiVariant kimi_variant(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::kimi_k2_thinking: return {false, false, false, false};
    case ChatTemplateKind::kimi_k25: return {true, true, true, false};
    case ChatTemplateKind::kimi_k26: return {true, true, true, true};
    default: return {true, true, false, false};
  }
}

// Kimi's chat templates: K2-Thinking's (moonshotai-Kimi-K2-Thinking.jinja) and the variants that add
// switches to it (kimi-k2.jinja, kimi-k25.jinja, kimi-k26.jinja).
std::string render_kimi(const KimiVariant& v, const std::vector<ChatMessage>& msgs, const ChatOptions& opts, const json& tools) {
  std::string out;
  // Messages up to the last assistant turn without tool calls are history: their reasoning is
  // dropped (<think></think>); later ones (the current agent loop) keep reasoning_content.
  int64_t last_plain_assistant = -1;
  for (int64_t i = int64_t(msgs.size()) - 1; i >= 0; --i)
    if (msgs[size_t(i)].role == "assistant" && msgs[size_t(i)].tool_calls.empty()) {
      last_plain_assistant = i;
      break;
    }
  if (opts.preserve_thinking.value_or(false)) last_plain_assistant = -1;  // every turn is "current"
  if (!tools.empty()) {
    out += "<|im_system|>tool_declare<|im_middle|>";
    std::optional<std::string> ts;
    if (v.typescript_tools) ts = encode_tools_typescript(tools);
    if (ts && !ts->empty())
      out += *ts;
    else if (v.typescript_tools)
      dump_python_json(tools, out, ",", ":");  // the encoder raised or found no function: JSON instead
    else
      dump_python(tools, out);
    out += "<|im_end|>";
  }
  if (msgs.empty() || msgs[0].role != "system")
    out += "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>";
  const bool thinking_off = v.thinking_switch && opts.thinking.has_value() && !*opts.thinking;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const std::string& role_name = m.name.empty() ? m.role : m.name;
    out += m.role == "user" ? "<|im_user|>" : m.role == "assistant" ? "<|im_assistant|>" : "<|im_system|>";
    out += role_name;
    out += "<|im_middle|>";
    if (m.role == "assistant") {
      const bool history = int64_t(i) <= last_plain_assistant;
      out += "<think>";
      if (!history && !thinking_off) out += m.reasoning_null && m.reasoning_content.empty() ? "None" : m.reasoning_content;
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
  if (opts.add_generation_prompt) {
    out += "<|im_assistant|>assistant<|im_middle|>";
    if (thinking_off)
      out += "<think></think>";
    else if (v.think_prefill)
      out += "<think>";
  }
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
  for (size_t i = 0; i < msgs.size(); ++i)  // '<｜User｜>' + None raises in jinja2: refuse, do not guess
    if (msgs[i].content_null && !(msgs[i].role == "assistant" && !msgs[i].tool_calls.empty()))
      fail("messages[", i, "].content: null or missing, which DeepSeek-V3's chat template cannot render (only an "
           "assistant message with tool_calls may have no content)");
  for (size_t i = 0; i < msgs.size(); ++i)
    for (size_t k = 0; k < msgs[i].tool_calls.size(); ++k) {
      const ToolCall& tc = msgs[i].tool_calls[k];
      if (tc.type.empty() || tc.arguments_object)
        fail("messages[", i, "].tool_calls[", k, "]: ", tc.type.empty() ? "no type" : "arguments as an object",
             ", which DeepSeek-V3's chat template cannot concatenate (give type \"function\" and arguments as a JSON string)");
    }
  bool is_first = false, is_tool = false, is_output_first = true;
  auto call = [](const ToolCall& tc) {
    return cat("<｜tool▁call▁begin｜>", tc.type, "<｜tool▁sep｜>", tc.name, "\n```json\n", tc.arguments_json, "\n```<｜tool▁call▁end｜>");
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
    // Reached from HTTP requests too: bounded nesting, errors as kd::Error (core/untrusted.h).
    tools = parse_json(opts.tools_json, "tools");
    check_json_integers(opts.tools_json, "tools");
    if (!tools.is_array()) fail("tools: expected a JSON array of tool definitions");
  }
  const char* name = chat_template_kind_name(kind);
  if (opts.preserve_thinking.has_value() && kind != ChatTemplateKind::kimi_k26)
    fail("preserve_thinking: the ", name, " chat template has no such option (kimi-k26 has)");
  if (opts.thinking.has_value() && kind == ChatTemplateKind::kimi_k2_thinking)
    fail("thinking: the ", name, " chat template has no thinking switch (kimi, kimi-k25 and kimi-k26 have)");
  if (kind == ChatTemplateKind::deepseek_v3) return render_deepseek_v3(messages, opts);
  return render_kimi(kimi_variant(kind), messages, opts, tools);
}

std::vector<std::string> chat_stop_tokens(ChatTemplateKind kind) {
  if (kind == ChatTemplateKind::deepseek_v3) return {"<｜end▁of▁sentence｜>"};
  return {"<|im_end|>", "[EOS]", "[EOT]"};  // every Kimi kind; SPEC-MODEL.md §4: 163586, 163585, 163593
}

namespace {

struct KindName {
  ChatTemplateKind kind;
  const char* name;
};
constexpr KindName kKindNames[] = {{ChatTemplateKind::kimi, "kimi"},
                                   {ChatTemplateKind::kimi_k2_thinking, "kimi-k2-thinking"},
                                   {ChatTemplateKind::kimi_k25, "kimi-k25"},
                                   {ChatTemplateKind::kimi_k26, "kimi-k26"},
                                   {ChatTemplateKind::deepseek_v3, "deepseek-v3"}};

}  // namespace

const char* const kChatTemplateNames = "kimi|kimi-k2-thinking|kimi-k25|kimi-k26|deepseek-v3";

ChatTemplateKind chat_template_kind_from_name(std::string_view name) {
  std::string n(name);
  for (char& c : n)
    if (c == '_') c = '-';
  for (const KindName& k : kKindNames)
    if (n == k.name) return k.kind;
  fail("unknown chat template '", name, "' (known: ", kChatTemplateNames, ")");
}

const char* chat_template_kind_name(ChatTemplateKind kind) {
  for (const KindName& k : kKindNames)
    if (k.kind == kind) return k.name;
  return "?";
}

std::vector<ChatMessage> chat_messages_from_json(std::string_view json_text) {
  // Key order kept: an `arguments` object is printed with `| tojson`, which keeps the client's order.
  using ojson = nlohmann::ordered_json;
  // Reached from HTTP requests too: bounded nesting, errors as kd::Error (core/untrusted.h).
  ojson j = parse_ordered_json(json_text, "messages");
  check_json_integers(json_text, "messages");
  if (j.is_object() && j.contains("messages")) j = j["messages"];
  if (!j.is_array()) fail("messages: expected a JSON array of messages");
  auto text_of = [](const ojson& v, const std::string& where) -> std::string {
    if (v.is_null()) return "";
    if (v.is_string()) return v.get<std::string>();
    if (v.is_array()) {  // content parts: the templates concatenate the text parts
      std::string s;
      for (size_t k = 0; k < v.size(); ++k) {
        const ojson& part = v[k];
        if (!part.is_object() || part.value("type", ojson()) != "text" || !part.contains("text") || !part["text"].is_string())
          fail(where, "[", k, "]: only {\"type\": \"text\", \"text\": ...} parts are supported");
        s += part["text"].get<std::string>();
      }
      return s;
    }
    fail(where, ": expected a string, null or an array of text parts");
  };
  auto str_of = [](const ojson& m, const char* key, const std::string& where) -> std::string {
    auto it = m.find(key);
    if (it == m.end() || it->is_null()) return "";
    if (!it->is_string()) fail(where, ".", key, ": expected a string");
    return it->get<std::string>();
  };
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = cat("messages[", i, "]");
    const ojson& m = j[i];
    if (!m.is_object()) fail(where, ": expected an object");
    ChatMessage msg;
    msg.role = str_of(m, "role", where);
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
      fail(where, ".role: '", msg.role, "' (expected system, user, assistant or tool)");
    if (m.contains("content")) msg.content = text_of(m["content"], where + ".content");
    msg.name = str_of(m, "name", where);
    msg.content_null = !m.contains("content") || m["content"].is_null();
    msg.reasoning_null = m.contains("reasoning_content") && m["reasoning_content"].is_null();
    msg.reasoning_content = str_of(m, "reasoning_content", where);
    if (msg.reasoning_content.empty()) msg.reasoning_content = str_of(m, "reasoning", where);
    msg.tool_call_id = str_of(m, "tool_call_id", where);
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      const ojson& calls = m["tool_calls"];
      if (!calls.is_array()) fail(where, ".tool_calls: expected an array");
      for (size_t k = 0; k < calls.size(); ++k) {
        const std::string w = cat(where, ".tool_calls[", k, "]");
        const ojson& c = calls[k];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object()) fail(w, ".function: expected an object");
        const ojson& f = c["function"];
        ToolCall tc{str_of(c, "id", w), str_of(f, "name", w + ".function"), ""};
        tc.type = str_of(c, "type", w);
        if (f.contains("arguments") && !f["arguments"].is_string() && !f["arguments"].is_null()) {
          dump_python(f["arguments"], tc.arguments_json);  // an object, as some clients send: `| tojson`
          tc.arguments_object = true;
        } else
          tc.arguments_json = str_of(f, "arguments", w + ".function");
        msg.tool_calls.push_back(std::move(tc));
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace kd

namespace kd {
namespace {

// FNV-1a of the template text with CRLF read as LF and trailing whitespace dropped: how a template
// is stored (chat_template.jinja, a JSON string) may differ only there. Anything else in a Jinja
// template can change what it renders, so nothing else is normalised.
uint64_t template_hash(std::string_view text) {
  std::string t;
  t.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i)
    if (!(text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n')) t += text[i];
  while (!t.empty() && std::string_view(" \t\n\r\f\v").find(t.back()) != std::string_view::npos) t.pop_back();
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : t) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// The templates in tests/fixtures/chat-templates/ (test_chat_template.py checks these hashes
// against the files, so a changed fixture cannot silently stop being recognised).
struct KnownTemplate {
  uint64_t hash;
  ChatTemplateKind kind;
  const char* file;
};
constexpr KnownTemplate kKnown[] = {
    {0xaafa7d2fab38eaceull, ChatTemplateKind::kimi_k2_thinking, "moonshotai-Kimi-K2-Thinking.jinja"},
    {0x650ff34356db4c38ull, ChatTemplateKind::kimi, "kimi-k2.jinja"},
    {0x19cc6b8854420586ull, ChatTemplateKind::kimi_k25, "kimi-k25.jinja"},
    {0x50b3217c4063f405ull, ChatTemplateKind::kimi_k26, "kimi-k26.jinja"},
    {0xb9eb54d150716a7dull, ChatTemplateKind::deepseek_v3, "deepseek-v3.jinja"},
};

bool has(std::string_view text, std::string_view what) { return text.find(what) != std::string_view::npos; }

std::string read_file_text(const std::filesystem::path& p) { return read_text_file(p.string(), kMaxTokenizerBytes); }

}  // namespace

ChatTemplateChoice chat_template_for_text(std::string_view text, std::string_view where) {
  const uint64_t h = template_hash(text);
  for (const KnownTemplate& k : kKnown)
    if (k.hash == h) return {k.kind, ""};
  auto near = [&](ChatTemplateKind kind, const char* why) {
    return ChatTemplateChoice{kind, cat(where, ": the chat template is not one kdtree knows byte for byte; rendering it as ",
                                        chat_template_kind_name(kind), " (", why,
                                        "). Compare with `kdtree chat-template`, or choose with --template")};
  };
  if (has(text, "<|im_middle|>")) {  // Kimi
    if (has(text, "preserve_thinking")) return near(ChatTemplateKind::kimi_k26, "it reads preserve_thinking");
    if (has(text, "tools_ts_str")) return near(ChatTemplateKind::kimi_k25, "it reads tools_ts_str");
    if (has(text, "last_non_tool_call_assistant_msg")) {
      if (has(text, "thinking is defined")) return near(ChatTemplateKind::kimi, "K2-Thinking's history split with a thinking switch");
      return near(ChatTemplateKind::kimi_k2_thinking, "K2-Thinking's history split");
    }
    fail(where, ": an unrecognised Kimi chat template (K2-Instruct's has no native renderer in kdtree yet); "
         "choose one with --template ", kChatTemplateNames);
  }
  if (has(text, "<｜Assistant｜>")) {  // DeepSeek
    if (has(text, "<think>") || has(text, "thinking"))
      fail(where, ": a DeepSeek chat template with thinking (R1 / V3.1 style) that kdtree does not render natively; "
           "choose one with --template ", kChatTemplateNames);
    // DeepSeek-V3's repository has carried several revisions; only the one deepseek-v3.jinja copies
    // (multiple system prompts joined, </think> stripped) renders the way deepseek_v3 does. The first
    // revision (no is_first_sp: a newline between tool outputs, tool calls only when content is
    // null) and V3-0324's (is_last_user: <｜Assistant｜> after every user turn) differ in output.
    if (!has(text, "is_first_sp") || !has(text, "split('</think>')") || has(text, "is_last_user"))
      fail(where, ": a DeepSeek-V3 chat template revision kdtree does not render natively (it renders the one with "
           "is_first_sp and </think> stripping, without is_last_user); choose one with --template ", kChatTemplateNames);
    return near(ChatTemplateKind::deepseek_v3, "DeepSeek-V3's revision with is_first_sp, no thinking");
  }
  fail(where, ": unrecognised chat template; choose one with --template ", kChatTemplateNames);
}

ChatTemplateChoice chat_template_for_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path jinja = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja)) return chat_template_for_text(read_file_text(jinja), jinja.string());
  const fs::path cfg_path = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(cfg_path)) {
    const json cfg = read_json_file(cfg_path.string(), kMaxTokenizerBytes);
    if (cfg.is_object() && cfg.contains("chat_template") && !cfg["chat_template"].is_null()) {
      const json& t = cfg["chat_template"];
      const std::string where = cfg_path.string() + " chat_template";
      if (t.is_string()) return chat_template_for_text(t.get<std::string>(), where);
      if (t.is_array()) {  // [{"name": "default", "template": "..."}, ...]
        for (const json& e : t)
          if (e.is_object() && e.value("name", json()) == "default" && e.contains("template") && e["template"].is_string())
            return chat_template_for_text(e["template"].get<std::string>(), where + "[default]");
        fail(where, ": a list of templates without one named \"default\" (choose with --template)");
      }
      fail(where, ": expected a string or a list of {name, template}");
    }
  }
  const bool tiktoken = fs::exists(fs::path(dir) / "tiktoken.model");
  if (!tiktoken && !fs::exists(fs::path(dir) / "tokenizer.json"))
    fail(dir, ": no chat template and no tokenizer to tell the model family from (choose with --template)");
  const ChatTemplateKind kind = tiktoken ? ChatTemplateKind::kimi : ChatTemplateKind::deepseek_v3;
  return {kind, cat(dir, ": no chat template (chat_template.jinja or tokenizer_config.json \"chat_template\"); using ",
                    chat_template_kind_name(kind), " for its ", tiktoken ? "tiktoken.model" : "tokenizer.json")};
}

}  // namespace kd
