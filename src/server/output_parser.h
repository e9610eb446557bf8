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
//
// Rules (each one tested in tests/unit/test_output_parser.cpp):
// - Reasoning ends at </think> or at a tool-call section (a call begin without a section counts as
//   one). A <think> in content opens reasoning again; a stray </think> in content or a nested <think>
//   in reasoning is dropped. With opts.reasoning false the think markers are ordinary text.
// - Tolerated: the singular <|tool_call_section_begin|>/<|tool_call_section_end|>; whitespace and
//   newlines between markers; a call begin without a section begin; a call closed by the next call
//   begin or the section end instead of <|tool_call_end|> (the call counts as complete and its JSON is
//   checked); a missing section end (text after a section end is content again); a call without
//   <|tool_call_begin|> (section text followed by <|tool_call_argument_begin|> is its header). Other
//   text between calls is dropped when it is only whitespace, else it is content; while streaming it
//   is held until the next marker decides. Think markers inside a call's arguments are argument text;
//   stray markers anywhere else are dropped.
// - Call header (between <|tool_call_begin|> and <|tool_call_argument_begin|>), trimmed: the id is the
//   header as generated; the name is the header without a leading "functions." and without the last
//   ':' and what follows ("functions.get-weather.v2:0" → "get-weather.v2", "get_weather:0" →
//   "get_weather", "functions.f:call_7f3a" → "f", "call_abc" → "call_abc": a header with neither part
//   is taken whole as the name, the server may check it against the declared tools). Arguments are
//   trimmed of surrounding whitespace, otherwise verbatim.
// - Never a marker in content/reasoning: while not final, a tail that is a proper prefix of a marker
//   is held back; when final, a dangling tail that starts like a tool marker ("<|…", i.e. a marker cut
//   by max_tokens) is dropped, a shorter one ("<", "</th") is kept as text.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace kd {

struct ParsedToolCall {
  std::string id;         // the model's own "functions.NAME:IDX" (the trimmed call header)
  std::string name;       // NAME
  std::string arguments;  // the argument text as generated (JSON), never truncated
  // The arguments were closed by a marker (<|tool_call_end|>, or tolerated: the next call begin or
  // the section end). false: generation ended inside the call (max_tokens), arguments are cut.
  bool complete = false;
  // Non-empty when complete and something is wrong: the arguments are not a JSON object, the call
  // had no <|tool_call_argument_begin|>, or the header names no function.
  std::string error;
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
// that may be the start of a marker is withheld from content/reasoning until it resolves, and a call
// appears only once its header is complete (so its first delta carries id and name).
ParsedOutput parse_kimi_output(std::string_view text, const OutputParserOptions& opts, bool final);

// What is new since the previous update, for SSE deltas. Tool calls are streamed OpenAI-style: the
// first delta of call i carries index, id and name; later deltas carry argument fragments only.
struct ToolCallDelta {
  int index = 0;
  bool first = false;    // the call's first delta: send id, type and name (the id itself may be "")
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
  // full_text: everything committed so far (each call extends the previous text). Returns only the
  // new part. Deltas concatenated equal the final parse_kimi_output(full_text, opts, true). Cost:
  // one linear pass over full_text per call. kd::Error if full_text does not extend the previous one
  // or update is called after a final update.
  OutputDelta update(std::string_view full_text, bool final);
  const ParsedOutput& state() const { return last_; }

 private:
  OutputParserOptions opts_;
  ParsedOutput last_;
  size_t last_text_size_ = 0;
  bool finished_ = false;
};

// What is wrong with a call for the client, "" when nothing: the error, or for an incomplete call
// "tool call cut by the end of generation: arguments are incomplete".
std::string tool_call_problem(const ParsedToolCall& call);

// The OpenAI `tool_calls[i]` object: {"id", "type": "function", "function": {"name", "arguments"}}.
// `arguments` is always the text as generated, also when cut (max_tokens) or invalid: the stream has
// already sent those fragments, and the non-streamed response must say the same. When
// tool_call_problem() is non-empty the object carries it as a non-standard "error" string (OpenAI
// clients keep unknown fields: ChatCompletionMessageToolCall.model_extra); the server should also
// report finish_reason "length" for a cut call.
nlohmann::json tool_call_to_openai(const ParsedToolCall& call);

}  // namespace kd
