// libFuzzer target: chat messages and tool declarations as the CLI (`chat-template --messages
// --tools`) and the server hand them to the templates: chat_messages_from_json, then render_chat for
// every template kind with the tools (JSON for Kimi K2, TypeScript declarations for K2.5/K2.6 —
// encode_tools_typescript walks the parameter schemas) and thinking on, off and unset. Each renders
// or throws kd::Error — never a crash (issue 21: deep nesting in content, tool_calls arguments or
// tools[0].function.parameters recursed in dump() / the schema walker) or a library exception.
// Input: byte 0 splits the rest between the messages and the tools generators and bits of it pick
// the thinking option; each part is JSON text as is when it starts like it, else template mode
// (json_gen.h) over the messages / tools arrays of tests/fuzz/shapes/chat-*.json.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_common.h"
#include "tokenizer/chat.h"

namespace {

struct Fixture {
  kdfuzz::Templates messages, tools;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    for (const char* s : {"chat-tools", "chat-simple", "chat-named-tool", "chat-required"}) {
      const auto req = kdfuzz::ojson::parse(kdfuzz::read_file(kdfuzz::source_path(std::string("tests/fuzz/shapes/") + s + ".json")));
      x.messages.add(req["messages"]);
      if (req.contains("tools")) x.tools.add(req["tools"]);
    }
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Fixture& f = fixture();
  const size_t rest = size - 1, split = rest * data[0] / 256;
  const std::string messages = kdfuzz::json_input(f.messages, data + 1, split);
  const std::string tools = kdfuzz::json_input(f.tools, data + 1 + split, rest - split);
  std::vector<kd::ChatMessage> msgs;
  try {
    msgs = kd::chat_messages_from_json(messages);
  } catch (const kd::Error&) {
  }
  kd::ChatOptions opts;
  opts.tools_json = tools;
  if (data[0] & 1) opts.thinking = (data[0] & 2) != 0;
  for (auto kind : {kd::ChatTemplateKind::kimi, kd::ChatTemplateKind::kimi_k2_thinking, kd::ChatTemplateKind::kimi_k25,
                    kd::ChatTemplateKind::kimi_k26, kd::ChatTemplateKind::deepseek_v3}) {
    try {
      (void)kd::render_chat(kind, msgs, opts);
    } catch (const kd::Error&) {
    }
  }
  return 0;
}
