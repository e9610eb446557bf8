// Kimi output parser (issue 6): a table of model outputs → the exact parse, written by hand from the
// format (SPEC-MODEL.md §4 and the rules in src/server/output_parser.h), checked whole and streamed.
// Streams split the text at real token boundaries (tokenizer-kimi-small: special tokens are single
// tokens, the singular section markers are several) in commits of 1…16 tokens, and at byte offsets;
// the deltas must concatenate to the final parse, never carry marker text, and every call's first
// delta must carry its id and name. A seeded property test builds random interleavings.
#include <gtest/gtest.h>

#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/output_parser.h"
#include "tokenizer/tokenizer.h"

namespace {

using kd::OutputParserOptions;
using kd::ParsedOutput;

const std::string TO = "<think>", TC = "</think>";
const std::string SB = "<|tool_calls_section_begin|>", SE = "<|tool_calls_section_end|>";
const std::string SB1 = "<|tool_call_section_begin|>", SE1 = "<|tool_call_section_end|>";  // singular
const std::string CB = "<|tool_call_begin|>", AB = "<|tool_call_argument_begin|>", CE = "<|tool_call_end|>";
const std::vector<std::string> kToolMarkers = {SB, SE, SB1, SE1, CB, AB, CE};
const std::vector<std::string> kThinkMarkers = {TO, TC};

const kd::Tokenizer& kimi_small() {
  static const std::unique_ptr<kd::Tokenizer> tok =
      kd::load_tokenizer(std::string(KDTREE_FIXTURES) + "/tokenizer-kimi-small");
  return *tok;
}

struct Call {
  std::string id, name, arguments;
  bool complete = true;
  std::string error_has;  // "" → no error expected; else a substring of the error
};

struct Case {
  std::string name, text;
  OutputParserOptions opts;
  std::string reasoning, content;
  std::vector<Call> calls;
};

OutputParserOptions opt(bool starts_in_reasoning, bool reasoning = true, bool tool_calls = true) {
  OutputParserOptions o;
  o.starts_in_reasoning = starts_in_reasoning;
  o.reasoning = reasoning;
  o.tool_calls = tool_calls;
  return o;
}

const std::string W = R"({"city": "Paris"})";
const std::string W2 = R"({"city":"Tokyo","unit":"c"})";

// Written by hand from the format; every tolerated variant of output_parser.h has a row.
std::vector<Case> cases() {
  const OutputParserOptions plain = opt(false), think = opt(true);
  return {
      {"empty", "", plain, "", "", {}},
      {"plain_content", "Hello, world!", plain, "", "Hello, world!", {}},
      {"unicode_content", "héllo 中文 😀 a<b c", plain, "", "héllo 中文 😀 a<b c", {}},
      {"thinking_then_answer", "Let me think.</think>The answer is 4.", think, "Let me think.", "The answer is 4.", {}},
      {"explicit_think", TO + "hmm" + TC + "Answer", plain, "hmm", "Answer", {}},
      {"explicit_think_after_content", "A" + TO + "r1" + TC + "B" + TO + "r2" + TC + "C", plain, "r1r2", "ABC", {}},
      {"reasoning_off_keeps_markers", TO + "hmm" + TC + "Answer", opt(false, false), "", TO + "hmm" + TC + "Answer", {}},
      {"reasoning_off_prefilled", "hmm" + TC + "Answer", opt(true, false), "", "hmm" + TC + "Answer", {}},
      {"reasoning_never_closed", "still thinking", think, "still thinking", "", {}},
      {"stray_close_in_content", "a" + TC + "b", plain, "", "ab", {}},
      {"nested_open_in_reasoning", "x" + TO + "y" + TC + "z", think, "xy", "z", {}},
      {"reasoning_ends_at_section",
       "I need the weather." + SB + CB + "functions.get_weather:0" + AB + W + CE + SE, think,
       "I need the weather.", "", {{"functions.get_weather:0", "get_weather", W}}},
      {"full_turn",
       "Plan." + TC + "Checking both." + SB + CB + "functions.get_weather:0" + AB + W + CE + CB +
           "functions.get_weather:1" + AB + W2 + CE + SE + " Done.",
       think, "Plan.", "Checking both. Done.",
       {{"functions.get_weather:0", "get_weather", W}, {"functions.get_weather:1", "get_weather", W2}}},
      {"singular_section_markers", "x" + SB1 + CB + "functions.f:0" + AB + "{}" + CE + SE1 + "y", plain, "", "xy",
       {{"functions.f:0", "f", "{}"}}},
      {"hyphen_dot_name", SB + CB + "functions.my-tool.v2:3" + AB + "{\"a\":1}" + CE + SE, plain, "", "",
       {{"functions.my-tool.v2:3", "my-tool.v2", "{\"a\":1}"}}},
      {"id_without_functions_prefix", SB + CB + "get_weather:0" + AB + W + CE + SE, plain, "", "",
       {{"get_weather:0", "get_weather", W}}},
      {"id_from_other_model", SB + CB + "call_abc123" + AB + W + CE + SE, plain, "", "",
       {{"call_abc123", "call_abc123", W}}},
      {"foreign_index_after_colon", SB + CB + "functions.get_weather:call_7f3a" + AB + "{}" + CE + SE, plain, "", "",
       {{"functions.get_weather:call_7f3a", "get_weather", "{}"}}},
      {"colons_in_name_last_one_is_the_index", SB + CB + "functions.mcp:fs:read:2" + AB + "{}" + CE + SE, plain, "", "",
       {{"functions.mcp:fs:read:2", "mcp:fs:read", "{}"}}},
      // The layout public Kimi-K2 function-calling docs show: a newline after each marker.
      {"newline_inside_header_trimmed", SB + CB + "\nfunctions.get_weather:0\n" + AB + "\n" + W + "\n" + CE + "\n" + SE,
       plain, "", "", {{"functions.get_weather:0", "get_weather", W}}},
      {"whitespace_between_markers",
       "ok\n" + SB + "\n " + CB + " functions.get_weather:0 \n" + AB + "\n  " + W + " \n" + CE + "\n" + SE + "\nbye",
       plain, "", "ok\n\nbye", {{"functions.get_weather:0", "get_weather", W}}},
      {"missing_section_end", "a" + SB + CB + "functions.f:0" + AB + W + CE, plain, "", "a",
       {{"functions.f:0", "f", W}}},
      {"cut_in_arguments", SB + CB + "functions.f:0" + AB + "{\"city\": \"Par", plain, "", "",
       {{"functions.f:0", "f", "{\"city\": \"Par", false}}},
      {"cut_in_header", "r" + TC + SB + CB + "functions.get_we", think, "r", "", {{"functions.get_we", "get_we", "", false}}},
      {"cut_right_after_call_begin", SB + CB, plain, "", "", {{"", "", "", false}}},
      {"cut_inside_marker", "a" + SB + CB + "functions.f:0" + AB + "{}<|tool_call_e", plain, "", "a",
       {{"functions.f:0", "f", "{}", false}}},
      {"cut_inside_singular_section_begin", "text <|tool_call_sec", plain, "", "text ", {}},
      {"short_angle_tail_is_text", "x <", plain, "", "x <", {}},
      {"think_prefix_tail_is_text", "a </th", plain, "", "a </th", {}},
      {"missing_call_end_before_next_call",
       SB + CB + "functions.a:0" + AB + "{}" + CB + "functions.b:1" + AB + "{\"x\":2}" + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "{}"}, {"functions.b:1", "b", "{\"x\":2}"}}},
      {"missing_call_end_before_section_end", SB + CB + "functions.a:0" + AB + W + SE + "after", plain, "", "after",
       {{"functions.a:0", "a", W}}},
      {"invalid_json", SB + CB + "functions.a:0" + AB + "{\"x\": }" + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "{\"x\": }", true, "not valid JSON"}}},
      {"json_not_object", SB + CB + "functions.a:0" + AB + "[1, 2]" + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "[1, 2]", true, "not an object"}}},
      {"empty_arguments", SB + CB + "functions.a:0" + AB + "  " + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "", true, "empty"}}},
      {"no_argument_begin", SB + CB + "functions.a:0" + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "", true, "no <|tool_call_argument_begin|>"}}},
      {"empty_header", SB + CB + AB + "{}" + CE + SE, plain, "", "", {{"", "", "{}", true, "names no function"}}},
      {"tool_calls_off_keeps_markers", "x" + SB + CB + "functions.f:0" + AB + "{}" + CE + SE, opt(false, true, false),
       "", "x" + SB + CB + "functions.f:0" + AB + "{}" + CE + SE, {}},
      {"tool_calls_off_reasoning_kept_going", "r" + SB + "more" + TC + "c", opt(true, true, false), "r" + SB + "more", "c", {}},
      {"stray_tool_markers_dropped", "a" + CE + "b" + AB + "c" + SE + "d", plain, "", "abcd", {}},
      {"stray_tool_markers_in_reasoning_dropped", "a" + CE + "b" + TC + "c", think, "ab", "c", {}},
      {"call_without_section_begin", "Sure." + CB + "functions.f:0" + AB + "{}" + CE + "Done.", think, "Sure.", "Done.",
       {{"functions.f:0", "f", "{}"}}},
      {"text_between_calls_is_content",
       SB + CB + "functions.a:0" + AB + "{}" + CE + " note " + CB + "functions.b:1" + AB + "{}" + CE + SE, plain, "",
       " note ", {{"functions.a:0", "a", "{}"}, {"functions.b:1", "b", "{}"}}},
      {"call_without_call_begin", "a" + SB + "functions.f:0" + AB + W + SE + "b", plain, "", "ab",
       {{"functions.f:0", "f", W}}},
      {"second_call_without_call_begin",
       SB + CB + "functions.a:0" + AB + "{}" + CE + "\nfunctions.b:1" + AB + "{}" + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "{}"}, {"functions.b:1", "b", "{}"}}},
      {"blank_before_argument_begin_in_section", SB + " " + AB + "{}" + SE, plain, "", "{}", {}},
      {"think_markers_in_section_dropped", SB + TO + CB + "functions.a:0" + AB + "{}" + CE + TC + SE, plain, "", "",
       {{"functions.a:0", "a", "{}"}}},
      {"think_markers_inside_arguments_are_text",
       SB + CB + "functions.write:0" + AB + "{\"html\": \"" + TO + "x" + TC + "\"}" + CE + SE, plain, "", "",
       {{"functions.write:0", "write", "{\"html\": \"" + TO + "x" + TC + "\"}"}}},
      {"second_argument_begin_dropped", SB + CB + "functions.a:0" + AB + "{\"a\"" + AB + ":1}" + CE + SE, plain, "", "",
       {{"functions.a:0", "a", "{\"a\":1}"}}},
      {"two_sections",
       SB + CB + "functions.a:0" + AB + "{}" + CE + SE + "mid" + SB1 + CB + "functions.b:1" + AB + "{}" + CE + SE1, plain,
       "", "mid", {{"functions.a:0", "a", "{}"}, {"functions.b:1", "b", "{}"}}},
      {"angle_brackets_in_arguments", SB + CB + "functions.cmp:0" + AB + "{\"e\": \"a < b <| c\"}" + CE + SE, plain, "",
       "", {{"functions.cmp:0", "cmp", "{\"e\": \"a < b <| c\"}"}}},
      // tool_choice named: the server prefills "</think>" + section + call header + argument begin.
      {"server_prefill_named_call", TC + SB + CB + "functions.get_weather:0" + AB + W + CE + SE, think, "", "",
       {{"functions.get_weather:0", "get_weather", W}}},
      {"unicode_arguments", SB + CB + "functions.say:0" + AB + "{\"t\": \"中文 😀\"}" + CE + SE, plain, "", "",
       {{"functions.say:0", "say", "{\"t\": \"中文 😀\"}"}}},
  };
}

void expect_parse(const ParsedOutput& got, const Case& c, const std::string& how) {
  SCOPED_TRACE(c.name + " (" + how + ")");
  EXPECT_EQ(got.reasoning, c.reasoning);
  EXPECT_EQ(got.content, c.content);
  ASSERT_EQ(got.tool_calls.size(), c.calls.size());
  for (size_t i = 0; i < c.calls.size(); ++i) {
    const kd::ParsedToolCall& g = got.tool_calls[i];
    const Call& e = c.calls[i];
    EXPECT_EQ(g.id, e.id) << i;
    EXPECT_EQ(g.name, e.name) << i;
    EXPECT_EQ(g.arguments, e.arguments) << i;
    EXPECT_EQ(g.complete, e.complete) << i;
    if (e.error_has.empty()) EXPECT_EQ(g.error, "") << i;
    else EXPECT_NE(g.error.find(e.error_has), std::string::npos) << i << ": " << g.error;
  }
}

// Markers that the parser treats as markers in content/reasoning under `o`: none of them may appear
// in a content or reasoning delta.
std::vector<std::string> active_markers(const OutputParserOptions& o) {
  std::vector<std::string> m;
  if (o.tool_calls) m.insert(m.end(), kToolMarkers.begin(), kToolMarkers.end());
  if (o.reasoning) m.insert(m.end(), kThinkMarkers.begin(), kThinkMarkers.end());
  return m;
}

// Feeds text[0, cuts[i]) as successive commits (the last one final, or an extra final update with
// the same text when `extra_final`) and rebuilds the parse from the deltas, checking on the way that
// each delta only extends what the final parse holds and carries no marker.
ParsedOutput stream(const std::string& text, const OutputParserOptions& o, std::vector<size_t> cuts,
                    const ParsedOutput& final_parse, bool extra_final = false) {
  if (cuts.empty() || cuts.back() != text.size()) cuts.push_back(text.size());
  kd::StreamingOutputParser p(o);
  ParsedOutput acc;
  const std::vector<std::string> markers = active_markers(o);
  for (size_t i = 0; i < cuts.size() + (extra_final ? 1 : 0); ++i) {
    const size_t cut = cuts[std::min(i, cuts.size() - 1)];
    const bool last = i + 1 == cuts.size() + (extra_final ? 1 : 0);
    const kd::OutputDelta d = p.update(std::string_view(text).substr(0, cut), last);
    for (const std::string& m : markers) {
      EXPECT_EQ(d.content.find(m), std::string::npos) << "marker " << m << " in content delta at " << cut;
      EXPECT_EQ(d.reasoning.find(m), std::string::npos) << "marker " << m << " in reasoning delta at " << cut;
    }
    acc.content += d.content;
    acc.reasoning += d.reasoning;
    EXPECT_TRUE(final_parse.content.starts_with(acc.content)) << "content not a prefix of the final at " << cut;
    EXPECT_TRUE(final_parse.reasoning.starts_with(acc.reasoning)) << "reasoning not a prefix at " << cut;
    int prev_index = -1;
    for (const kd::ToolCallDelta& t : d.tool_calls) {
      EXPECT_GT(t.index, prev_index);
      prev_index = t.index;
      const size_t idx = static_cast<size_t>(t.index);
      if (idx >= final_parse.tool_calls.size()) {
        ADD_FAILURE() << "delta for call " << t.index << " that the final parse does not have";
        continue;
      }
      EXPECT_EQ(t.first, idx == acc.tool_calls.size());
      if (idx == acc.tool_calls.size()) {  // the call's first delta: id and name come with it
        acc.tool_calls.push_back({});
        acc.tool_calls.back().id = t.id;
        acc.tool_calls.back().name = t.name;
        EXPECT_EQ(t.id, final_parse.tool_calls[idx].id);
        EXPECT_EQ(t.name, final_parse.tool_calls[idx].name);
      } else if (idx > acc.tool_calls.size()) {
        ADD_FAILURE() << "call " << t.index << " skipped an index";
        continue;
      } else {
        EXPECT_TRUE(t.id.empty() && t.name.empty()) << "id/name repeated in a later delta of call " << t.index;
      }
      acc.tool_calls[idx].arguments += t.arguments;
      EXPECT_TRUE(final_parse.tool_calls[idx].arguments.starts_with(acc.tool_calls[idx].arguments));
    }
    EXPECT_EQ(p.state().content, acc.content);
  }
  // complete/error are not streamed: take them from the parser's final state.
  for (size_t i = 0; i < acc.tool_calls.size() && i < p.state().tool_calls.size(); ++i) {
    acc.tool_calls[i].complete = p.state().tool_calls[i].complete;
    acc.tool_calls[i].error = p.state().tool_calls[i].error;
  }
  return acc;
}

// Byte offsets after every token of `text` (special tokens parsed as single tokens).
std::vector<size_t> token_ends(const std::string& text) {
  const kd::Tokenizer& tok = kimi_small();
  const std::vector<int32_t> ids = tok.encode(text, /*parse_special=*/true);
  std::vector<size_t> ends;
  size_t at = 0;
  for (int32_t id : ids) ends.push_back(at += tok.token_bytes(id).size());
  EXPECT_EQ(at, text.size());
  return ends;
}

std::vector<size_t> every_kth(const std::vector<size_t>& ends, size_t k) {
  std::vector<size_t> cuts;
  for (size_t i = k - 1; i < ends.size(); i += k) cuts.push_back(ends[i]);
  return cuts;
}

TEST(OutputParser, FixtureTokenizesMarkersAsSingleTokens) {
  const kd::Tokenizer& tok = kimi_small();
  for (const std::string& m : {TO, TC, SB, SE, CB, AB, CE}) EXPECT_EQ(tok.encode(m, true).size(), 1u) << m;
  EXPECT_GT(tok.encode(SB1, true).size(), 1u);  // the singular variant is not a special token
}

TEST(OutputParser, TableWhole) {
  for (const Case& c : cases()) expect_parse(kd::parse_kimi_output(c.text, c.opts, true), c, "whole");
}

TEST(OutputParser, TableStreamedAtTokenBoundaries) {
  for (const Case& c : cases()) {
    const std::vector<size_t> ends = token_ends(c.text);
    for (size_t k = 1; k <= 16; ++k) {
      const ParsedOutput want = kd::parse_kimi_output(c.text, c.opts, true);
      for (bool extra_final : {false, true})
        expect_parse(stream(c.text, c.opts, every_kth(ends, k), want, extra_final), c,
                     "tokens k=" + std::to_string(k) + (extra_final ? " +final" : ""));
    }
  }
}

TEST(OutputParser, TableStreamedAtByteOffsets) {
  for (const Case& c : cases()) {
    const ParsedOutput want = kd::parse_kimi_output(c.text, c.opts, true);
    for (size_t k = 1; k <= 16; ++k) {
      std::vector<size_t> cuts;
      for (size_t b = k; b < c.text.size(); b += k) cuts.push_back(b);
      expect_parse(stream(c.text, c.opts, cuts, want), c, "bytes k=" + std::to_string(k));
    }
  }
}

// A DDTree round commits several tokens: two markers (and the text between) arrive in one commit.
TEST(OutputParser, MergedMarkersInOneCommit) {
  const std::string text = "why" + TC + SB + CB + "functions.f:0" + AB + W + CE + SE + "ok";
  const OutputParserOptions o = opt(true);
  const ParsedOutput want = kd::parse_kimi_output(text, o, true);
  const size_t a = text.find(TC), b = text.find(AB) + AB.size(), c = text.find(CE);
  const ParsedOutput got = stream(text, o, {a, b, c, text.size()}, want);
  EXPECT_EQ(got.reasoning, "why");
  EXPECT_EQ(got.content, "ok");
  ASSERT_EQ(got.tool_calls.size(), 1u);
  EXPECT_EQ(got.tool_calls[0].arguments, W);
  // The whole call section in one commit.
  EXPECT_EQ(stream(text, o, {3, text.size()}, want).tool_calls.size(), 1u);
}

TEST(OutputParser, HoldsBackPartialMarkersUntilResolved) {
  const OutputParserOptions o = opt(false);
  EXPECT_EQ(kd::parse_kimi_output("abc <|tool_call_sec", o, false).content, "abc ");
  EXPECT_EQ(kd::parse_kimi_output("abc <|tool_calls", o, false).content, "abc ");
  EXPECT_EQ(kd::parse_kimi_output("abc <thi", o, false).content, "abc ");
  EXPECT_EQ(kd::parse_kimi_output("abc <", o, false).content, "abc ");
  EXPECT_EQ(kd::parse_kimi_output("abc <thing>", o, false).content, "abc <thing>");  // resolved: not a marker
  EXPECT_EQ(kd::parse_kimi_output("abc <|tool_callx", o, false).content, "abc <|tool_callx");
  // Not held when the marker is not active.
  EXPECT_EQ(kd::parse_kimi_output("abc <|tool_call", opt(false, true, false), false).content, "abc <|tool_call");
  EXPECT_EQ(kd::parse_kimi_output("abc <thi", opt(false, false, true), false).content, "abc <thi");
  EXPECT_EQ(kd::parse_kimi_output("abc <", opt(false, false, true), false).content, "abc ");  // "<" could be "<|…"
  EXPECT_EQ(kd::parse_kimi_output("abc <thi", opt(false, false, false), false).content, "abc <thi");
  // A call is not announced before its header is complete.
  EXPECT_TRUE(kd::parse_kimi_output(SB + CB + "functions.get_weather:0", o, false).tool_calls.empty());
  const ParsedOutput p = kd::parse_kimi_output(SB + CB + "functions.f:0" + AB + "{\"a\": 1  ", o, false);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, "{\"a\": 1");  // trailing whitespace held too
  EXPECT_FALSE(p.tool_calls[0].complete);
  // Whitespace between calls is held: it may be dropped.
  EXPECT_EQ(kd::parse_kimi_output(SB + "\n  ", o, false).content, "");
  // Text in a section is held: it may be the header of a call without <|tool_call_begin|>.
  EXPECT_EQ(kd::parse_kimi_output(SB + "functions.f:0", o, false).content, "");
  EXPECT_EQ(kd::parse_kimi_output(SB + "functions.f:0", o, true).content, "functions.f:0");
}

TEST(OutputParser, LargeArgumentsAreNeverTruncated) {
  std::string big = "{\"data\": \"";
  std::mt19937 rng(7);
  while (big.size() < (1u << 20)) big += static_cast<char>('a' + rng() % 26);
  big += "<|tool\"}";  // a marker-like tail inside a JSON string is argument text
  const std::string text = "r" + TC + SB + CB + "functions.write_file:0" + AB + big + CE + SE + "done";
  const OutputParserOptions o = opt(true);
  const ParsedOutput whole = kd::parse_kimi_output(text, o, true);
  ASSERT_EQ(whole.tool_calls.size(), 1u);
  EXPECT_EQ(whole.tool_calls[0].arguments, big);
  EXPECT_EQ(whole.tool_calls[0].error, "");
  EXPECT_EQ(whole.content, "done");
  std::vector<size_t> cuts;
  for (size_t b = 1; b < text.size(); b += 4093) cuts.push_back(b);  // ~260 commits
  const ParsedOutput s = stream(text, o, cuts, whole);
  ASSERT_EQ(s.tool_calls.size(), 1u);
  EXPECT_EQ(s.tool_calls[0].arguments, big);
  // Cut by max_tokens in the middle: reported whole as generated, marked incomplete.
  const std::string cut_text = text.substr(0, text.size() / 2);
  const ParsedOutput cut = kd::parse_kimi_output(cut_text, o, true);
  ASSERT_EQ(cut.tool_calls.size(), 1u);
  EXPECT_FALSE(cut.tool_calls[0].complete);
  EXPECT_EQ(cut.tool_calls[0].arguments, cut_text.substr(cut_text.find(AB) + AB.size()));
}

TEST(OutputParser, StreamingMisuseIsAnError) {
  kd::StreamingOutputParser p(opt(false));
  p.update("hello", false);
  EXPECT_THROW(p.update("hel", false), kd::Error);
  kd::StreamingOutputParser q(opt(false));
  q.update("hello", true);
  EXPECT_THROW(q.update("hello world", true), kd::Error);
}

TEST(OutputParser, OpenAiToolCallObject) {
  kd::ParsedToolCall c{"functions.get_weather:0", "get_weather", W, true, ""};
  const nlohmann::json want = nlohmann::json::parse(
      R"({"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})");
  EXPECT_EQ(kd::tool_call_to_openai(c), want);
  EXPECT_EQ(kd::tool_call_problem(c), "");
  // Invalid JSON: arguments as generated plus a non-standard "error" string.
  c.arguments = "{\"x\": }";
  c.error = "tool call arguments are not valid JSON: x";
  nlohmann::json j = kd::tool_call_to_openai(c);
  EXPECT_EQ(j["function"]["arguments"], "{\"x\": }");
  EXPECT_EQ(j["error"], c.error);
  // Cut by max_tokens: arguments as generated, marked incomplete.
  c = {"functions.f:0", "f", "{\"a\": \"b", false, ""};
  j = kd::tool_call_to_openai(c);
  EXPECT_EQ(j["function"]["arguments"], "{\"a\": \"b");
  EXPECT_NE(j["error"].get<std::string>().find("incomplete"), std::string::npos);
  EXPECT_EQ(j.size(), 4u);
}

// Random interleavings of markers, text, whitespace, JSON and lone '<' fragments, split at random
// byte offsets. Every '<' that is not part of an inserted marker is followed by a space, so no marker
// can appear in content/reasoning except by a leak.
TEST(OutputParser, PropertyRandomInterleavings) {
  const std::vector<std::string> markers = {TO, TC, SB, SE, SB1, SE1, CB, AB, CE};
  const std::vector<std::string> pieces = {"hello", " ", "\n", "functions.get_weather:0", "fn-1.x:2", "{}",
                                           "{\"a\": [1, 2]}", "{\"a\": ", "中文", "😀", "< ", "<| ",
                                           "<|tool_call_ ", "<thi ", "</think ", "\"}", "x:y"};
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 3000; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i)
      text += rng() % 3 == 0 ? markers[rng() % markers.size()] : pieces[rng() % pieces.size()];
    const OutputParserOptions o = opt(rng() % 2, rng() % 4 != 0, rng() % 4 != 0);
    const ParsedOutput want = kd::parse_kimi_output(text, o, true);
    for (const std::string& m : active_markers(o)) {
      ASSERT_EQ(want.content.find(m), std::string::npos) << text;
      ASSERT_EQ(want.reasoning.find(m), std::string::npos) << text;
    }
    std::vector<size_t> cuts;
    for (size_t b = 0; b < text.size(); b += 1 + rng() % 12) cuts.push_back(b);
    const ParsedOutput got = stream(text, o, cuts, want, rng() % 2 == 0);
    ASSERT_EQ(got.content, want.content) << text;
    ASSERT_EQ(got.reasoning, want.reasoning) << text;
    ASSERT_EQ(got.tool_calls.size(), want.tool_calls.size()) << text;
    for (size_t i = 0; i < want.tool_calls.size(); ++i) {
      ASSERT_EQ(got.tool_calls[i].id, want.tool_calls[i].id) << text;
      ASSERT_EQ(got.tool_calls[i].arguments, want.tool_calls[i].arguments) << text;
    }
  }
}

}  // namespace
