// Regular expressions → GBNF, for JSON Schema's string `pattern` and regex-constrained output.
//
// Supported (ECMAScript syntax, the JSON Schema dialect): literals, `.`, classes `[a-z]` / `[^…]`
// with ranges and \d \w \s \D \W \S, escapes (\n \r \t \f \v \xHH \uHHHH, \ before punctuation),
// groups `( … )` and `(?: … )`, `|`, the quantifiers * + ? {m} {m,} {m,n} (lazy forms: the same
// language), `^` at the start and `$` at the end. Back-references, lookaround, \b, named groups and
// possessive quantifiers are a kd::Error naming the offset.
#pragma once
#include <string>
#include <string_view>

#include "grammar/grammar.h"

namespace kd::grammar {

// A GBNF expression for `pattern`. json_string: the expression matches the *JSON-escaped* text of
// the strings the pattern matches, as written between a string's quotes (", \ and control
// characters appear as escapes), it uses the rule `json-char` (any escaped character, defined by
// json_schema.cpp), and the pattern is unanchored unless it starts with ^ / ends with $, as JSON
// Schema says. Otherwise the whole text must match (^ and $ are implied).
std::string regex_to_gbnf(std::string_view pattern, bool json_string, const std::string& what);

// A grammar whose language is the strings `pattern` matches in full.
Grammar regex_grammar(std::string_view pattern);

}  // namespace kd::grammar
