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
// next `name ::=`, so alternatives may start a line. Token references (`<[1234]>`, `<think>`,
// `!<…>`) are a kd::Error: the grammar runs on bytes. Errors give the line and column.
#pragma once
#include <string_view>

#include "grammar/grammar.h"

namespace kd::grammar {

Grammar parse_gbnf(std::string_view text, std::string_view root = "root");

}  // namespace kd::grammar
