// `kdtree chat-template`: render an OpenAI messages list with the model's chat template and print the
// prompt text — for people checking what the model sees, and for the tests that compare the native
// renderer with Python jinja2 rendering of the published templates.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "core/untrusted.h"
#include "tokenizer/chat.h"

namespace kd::cli {

namespace {

std::string read_text(const std::string& path, const char* what) {
  try {
    return read_text_file(path, kMaxConfigBytes);
  } catch (const Error& e) {
    fail(what, " file: ", e.what());
  }
}

}  // namespace

void add_chat_template(CLI::App& app, ChatTemplateOptions& o) {
  auto* c = app.add_subcommand("chat-template", "Render a chat (OpenAI messages JSON) with the model's chat template");
  c->add_option("-m,--model", o.model,
                "Checkpoint directory: its chat_template.jinja / tokenizer_config.json chat_template picks the template");
  c->add_option("--messages", o.messages, "JSON file: an array of OpenAI chat messages")->required();
  c->add_option("--tools", o.tools, "JSON file: an OpenAI tools array");
  c->add_option("--thinking", o.thinking, "chat_template_kwargs.thinking (default: the template's)")->check(CLI::IsMember({"on", "off"}));
  c->add_option("--preserve-thinking", o.preserve_thinking, "chat_template_kwargs.preserve_thinking (kimi-k26 only)")
      ->check(CLI::IsMember({"on", "off"}));
  c->add_option("--template", o.template_name,
                "Template instead of the one -m's checkpoint names: kimi (K2-Thinking + thinking switch), kimi-k2-thinking "
                "(K2-Thinking as published), kimi-k25 (TypeScript tool declarations), kimi-k26 (+ preserve_thinking), "
                "deepseek-v3")
      ->check(CLI::IsMember({"kimi", "kimi-k2-thinking", "kimi-k25", "kimi-k26", "deepseek-v3"}));
  c->add_flag("--no-generation-prompt", o.no_generation_prompt, "Do not end with the assistant turn opener");
}

int cmd_chat_template(const ChatTemplateOptions& o) {
  ChatTemplateKind kind;
  if (!o.template_name.empty()) {
    kind = chat_template_kind_from_name(o.template_name);
  } else if (o.model.empty()) {
    fail("chat-template: give -m DIR or --template ", kChatTemplateNames);
  } else {
    const ChatTemplateChoice choice = chat_template_for_checkpoint(o.model);
    if (!choice.warning.empty()) std::fprintf(stderr, "kdtree: warning: %s\n", choice.warning.c_str());
    kind = choice.kind;
  }
  const std::vector<ChatMessage> messages = chat_messages_from_json(read_text(o.messages, "--messages"));
  ChatOptions opts;
  if (!o.tools.empty()) opts.tools_json = read_text(o.tools, "--tools");
  opts.add_generation_prompt = !o.no_generation_prompt;
  if (!o.thinking.empty()) opts.thinking = o.thinking == "on";
  if (!o.preserve_thinking.empty()) opts.preserve_thinking = o.preserve_thinking == "on";
  const std::string text = render_chat(kind, messages, opts);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace kd::cli
