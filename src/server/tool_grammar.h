// Tool calls under a grammar (issue 20): the grammar of a Kimi answer whose tool-call section is
// constrained to the declared tools, for requests where some tool has `strict: true` or where
// tool_choice is required / named (then even with no strict tool: the call, a declared name and
// JSON-object arguments are enforced).
//
// SPEC-MODEL.md §4's section, markers as the special tokens they are:
//   <|tool_calls_section_begin|> ( <|tool_call_begin|> functions.NAME:IDX <|tool_call_argument_begin|>
//     ARGS <|tool_call_end|> )+ <|tool_calls_section_end|>
// NAME is one of the declared functions; IDX any decimal number (Kimi counts calls across the
// conversation); ARGS the tool's `parameters` schema for a strict tool, any JSON object for the others
// (written with ", " and ": "). By tool_choice, the prefill (prepare.cpp) already holds:
//   auto      nothing: free text (after reasoning and </think> on a thinking prompt), then at most one
//             section; the stop ids end it anywhere the text may end;
//   required  <|tool_calls_section_begin|>: one or more calls and the section end;
//   named     up to <|tool_call_argument_begin|> of that function: its ARGS, the call end, the section end.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "server/api_request.h"

namespace kd {

// GBNF (token references by name) for `tools` (the request's array, in document order). Schema
// errors are a kd::Error naming the tool and the JSON path.
std::string kimi_tool_call_gbnf(const nlohmann::ordered_json& tools, ToolChoice choice, const std::string& named_function,
                                bool in_reasoning);

}  // namespace kd
