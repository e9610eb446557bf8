// GBNF (llama.cpp's grammar format, grammars/README.md there) → a byte-level Grammar.
//
//   root  ::= "{" ws pair ("," ws pair)* "}"      # a comment
//   pair  ::= [a-z]+ ws ":" ws ("true" | "false")
//   ws    ::= [ \t\n]{0,8}
//
// Supported: rules `name ::= …` (names of letters, digits, '-' and '_'), alternatives `|`, groups
// `( … )`, string literals with escapes (\n \r \t \\ \" \' \[ \] \- \^ \xHH \uHHHH \UHHHHHHHH, each a
// code point written as UTF-8), character classes `[a-z]` / `[^"\\]` over code points, `.` (any
// character), and the postfixes * + ? {m} {m,} {m,n} {,n}. A rule continues over newlines until the
// next `name ::=`, so alternatives may start a line. Special tokens, which are not text: `<[1234]>`
// (an id) or `<|tool_call_begin|>` / `<think>` (a name the resolver knows) match exactly that token;
// without a resolver, or for a name it does not know, they are a kd::Error, as is `!<…>`. Errors
// give the line and column.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "grammar/grammar.h"

namespace kd::grammar {

// A special token's id by its name (e.g. Tokenizer::special_id); nullopt when there is none.
using SpecialTokens = std::function<std::optional<int32_t>(std::string_view name)>;

Grammar parse_gbnf(std::string_view text, std::string_view root = "root", const SpecialTokens& specials = {});

// The same GBNF text with every rule it defines renamed `prefix + name` (definitions and
// references; literals, classes, token references and comments untouched), so that several
// generated grammars can be joined into one without their rule names colliding.
std::string prefix_rules(std::string_view text, std::string_view prefix);

}  // namespace kd::grammar
