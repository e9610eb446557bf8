// `kdtree chat-template`: render an OpenAI messages list with the model's chat template and print the
// prompt text — for people checking what the model sees, and for the tests that compare the native
// renderer with Python jinja2 rendering of the published templates.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/chat.h"

namespace kd::cli {

namespace {

std::string read_text(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(what, " file '", path, "': cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

void add_chat_template(CLI::App& app, ChatTemplateOptions& o) {
  auto* c = app.add_subcommand("chat-template", "Render a chat (OpenAI messages JSON) with the model's chat template");
  c->add_option("-m,--model", o.model, "Checkpoint directory (tiktoken.model → kimi, tokenizer.json → deepseek-v3)");
  c->add_option("--messages", o.messages, "JSON file: an array of OpenAI chat messages")->required();
  c->add_option("--tools", o.tools, "JSON file: an OpenAI tools array");
  c->add_option("--thinking", o.thinking, "chat_template_kwargs.thinking (default: the template's)")->check(CLI::IsMember({"on", "off"}));
  c->add_option("--template", o.template_name, "Template kind instead of detecting it from -m")->check(CLI::IsMember({"kimi", "deepseek-v3"}));
  c->add_flag("--no-generation-prompt", o.no_generation_prompt, "Do not end with the assistant turn opener");
}

int cmd_chat_template(const ChatTemplateOptions& o) {
  ChatTemplateKind kind;
  if (!o.template_name.empty()) {
    kind = chat_template_kind_from_name(o.template_name);
  } else if (o.model.empty()) {
    fail("chat-template: give -m DIR or --template kimi|deepseek-v3");
  } else if (std::filesystem::exists(std::filesystem::path(o.model) / "tiktoken.model")) {
    kind = ChatTemplateKind::kimi;
  } else if (std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json")) {
    kind = ChatTemplateKind::deepseek_v3;
  } else {
    fail(o.model, ": no tiktoken.model or tokenizer.json to tell the chat template from (use --template)");
  }
  const std::vector<ChatMessage> messages = chat_messages_from_json(read_text(o.messages, "--messages"));
  ChatOptions opts;
  if (!o.tools.empty()) opts.tools_json = read_text(o.tools, "--tools");
  opts.add_generation_prompt = !o.no_generation_prompt;
  if (!o.thinking.empty()) opts.thinking = o.thinking == "on";
  const std::string text = render_chat(kind, messages, opts);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace kd::cli
