// JSON Schema → GBNF (grammar/gbnf.h), for response_format json_schema, json_object and strict tools.
//
// Supported (the subset OpenAI's structured outputs and xgrammar accept, and more): type (one or a
// list; without a type, every JSON value, each type under the keywords that apply to it),
// properties / required / additionalProperties (false, true or a schema; a property whose schema is
// false must be absent), enum, const (values the sibling keywords reject are dropped), items,
// prefixItems (and draft 4–7's array items / additionalItems), minItems / maxItems, uniqueItems
// (false, or true where at most one item fits), anyOf, oneOf (only when no value can match two
// branches — different types, distinct enum/const values, or objects with a required const tag —
// where it equals anyOf; otherwise refused), allOf of one schema, $ref to "#", "#/$defs/…",
// "#/definitions/…" (any JSON pointer into the document; recursion allowed), string minLength /
// maxLength / pattern (grammar/regex.h) / format (grammar/json_format.h; not with the others),
// integer minimum / maximum / exclusiveMinimum / exclusiveMaximum (draft 4's boolean form too) and
// multipleOf (without bounds), number minimum / maximum (grammar/json_number.h), and the
// annotations (title, description, default, examples, $schema, $id, $comment, deprecated, readOnly,
// writeOnly, x-…), which do not constrain. Anything else is a kd::Error naming the JSON path and
// keyword, e.g. "$.properties.x.patternProperties: not supported" (not, if/then/else,
// patternProperties, propertyNames, contains, dependencies, min/maxProperties, remote $refs,
// exclusive bounds and multipleOf on numbers).
//
// The language: properties in the schema's order (required ones present, optional ones may be left
// out), additional properties after them; strings as JSON writes them (escapes included, no raw
// control characters); integers without leading zeros (and no "-0", as xgrammar); bounded numbers
// without exponent; whitespace either any run of [ \n\r\t] between
// tokens (any_whitespace) or exactly the separators given. With strict (OpenAI's strict: true) an
// object without additionalProperties takes none, as OpenAI and xgrammar's strict mode require.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "grammar/grammar.h"

namespace kd::grammar {

struct JsonGrammarOptions {
  bool any_whitespace = true;
  std::string item_separator = ", ";  // without any_whitespace: between items and properties
  std::string key_separator = ": ";   // … and between a key and its value
  bool strict = true;                 // additionalProperties defaults to false
};

// GBNF text whose root is the schema's language.
std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema, const JsonGrammarOptions& opt = {});
// Any JSON object (response_format json_object).
std::string json_object_gbnf(const JsonGrammarOptions& opt = {});

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonGrammarOptions& opt = {});

}  // namespace kd::grammar
