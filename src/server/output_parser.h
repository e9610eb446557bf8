// Kimi output parsing for the server (issue 6): reasoning and tool calls from the generated text.
// SPEC-MODEL.md §4 lists the markers:
//   <think> … </think>                                   reasoning (thinking models start inside it:
//                                                        the chat template prefills <think>)
//   <|tool_calls_section_begin|>
//     <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> …
//   <|tool_calls_section_end|>
// The parser always works on the whole committed text (special tokens rendered by name), never on a
// single delta: a DDTree round commits many tokens at once, so two markers can arrive together, and
// a marker that is not a single special token (the singular <|tool_call_section_begin|> variant) can
// arrive split across commits. Streaming diffs successive parses.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kd {

struct ParsedToolCall {
  std::string id;         // the model's own "functions.NAME:IDX"
  std::string name;       // NAME
  std::string arguments;  // the argument text as generated (JSON), never truncated
  bool complete = false;  // <|tool_call_end|> seen
  std::string error;      // non-empty when complete and the arguments are not valid JSON
};

struct ParsedOutput {
  std::string reasoning;  // text inside <think> … </think> (markers removed)
  std::string content;    // everything else that is not a tool-call marker or call
  std::vector<ParsedToolCall> tool_calls;
};

struct OutputParserOptions {
  bool starts_in_reasoning = false;  // the prompt ended inside <think> (template prefill)
  bool reasoning = true;             // split out <think> … </think>; false: it stays in content
  bool tool_calls = true;            // false (tool_choice none / no tools): markers stay in content
};

// Parses the whole text. `final`: generation has ended, so nothing is held back; otherwise a tail
// that may be the start of a marker is withheld from content/reasoning until it resolves.
ParsedOutput parse_kimi_output(std::string_view text, const OutputParserOptions& opts, bool final);

// What is new since the previous update, for SSE deltas. Tool calls are streamed OpenAI-style: the
// first delta of call i carries index, id and name; later deltas carry argument fragments only.
struct ToolCallDelta {
  int index = 0;
  std::string id, name;  // set in the call's first delta only
  std::string arguments;
};
struct OutputDelta {
  std::string reasoning, content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class StreamingOutputParser {
 public:
  explicit StreamingOutputParser(OutputParserOptions opts) : opts_(opts) {}
  // full_text: everything committed so far. Returns only the new part. Deltas concatenated equal
  // the final parse_kimi_output(full_text, opts, true).
  OutputDelta update(std::string_view full_text, bool final);
  const ParsedOutput& state() const { return last_; }

 private:
  OutputParserOptions opts_;
  ParsedOutput last_;
  std::vector<bool> announced_;  // per tool call: id and name already sent
};

}  // namespace kd
