// libFuzzer target: the Kimi output parser (src/server/output_parser.h) on arbitrary model outputs.
// Input: byte 0 = options (bits 0–2) and whether the rest is raw text (bit 3) or a program (else);
// byte 1 seeds the commit sizes; the rest is the text. In a program, bytes 0x01–0x09 insert a whole
// marker, 0x0A–0x0D a partial marker followed by a space, and a literal '<' becomes "< ": every '<'
// that does not start an inserted marker is then followed by a space, so any active marker found in
// content or reasoning is a leak. Raw text exercises everything else (markers formed across text).
// Checked: no crash and no exception; streamed deltas (commits of 1…17 bytes, plus every byte for
// short inputs) concatenate to the final parse; each call's first delta carries its id and name; and
// in program mode no active marker in any content/reasoning delta or the final parse.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "server/output_parser.h"

namespace {

const char* const kMarkers[] = {"<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                "<|tool_call_section_begin|>", "<|tool_call_section_end|>", "<|tool_call_begin|>",
                                "<|tool_call_argument_begin|>", "<|tool_call_end|>"};
const char* const kPartials[] = {"<|tool_call", "<thi", "</think", "<|tool_calls_section_"};

void check(bool ok) {
  if (!ok) std::abort();
}

bool has_active_marker(const std::string& s, const kd::OutputParserOptions& o) {
  for (size_t i = 0; i < 9; ++i) {
    const bool think = i < 2;
    if ((think ? o.reasoning : o.tool_calls) && s.find(kMarkers[i]) != std::string::npos) return true;
  }
  return false;
}

void run_stream(const std::string& text, const kd::OutputParserOptions& o, const std::vector<size_t>& cuts,
                const kd::ParsedOutput& want, bool leak_check) {
  kd::StreamingOutputParser p(o);
  kd::ParsedOutput acc;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const kd::OutputDelta d = p.update(std::string_view(text).substr(0, cuts[i]), i + 1 == cuts.size());
    if (leak_check) check(!has_active_marker(d.content, o) && !has_active_marker(d.reasoning, o));
    acc.content += d.content;
    acc.reasoning += d.reasoning;
    for (const kd::ToolCallDelta& t : d.tool_calls) {
      const size_t idx = static_cast<size_t>(t.index);
      check(idx <= acc.tool_calls.size() && idx < want.tool_calls.size());
      check(t.first == (idx == acc.tool_calls.size()));
      if (t.first) {
        acc.tool_calls.emplace_back();
        acc.tool_calls.back().id = t.id;
        acc.tool_calls.back().name = t.name;
      } else {
        check(t.id.empty() && t.name.empty());
      }
      acc.tool_calls[idx].arguments += t.arguments;
    }
  }
  check(acc.content == want.content && acc.reasoning == want.reasoning);
  check(acc.tool_calls.size() == want.tool_calls.size());
  for (size_t i = 0; i < want.tool_calls.size(); ++i) {
    check(acc.tool_calls[i].id == want.tool_calls[i].id && acc.tool_calls[i].name == want.tool_calls[i].name);
    check(acc.tool_calls[i].arguments == want.tool_calls[i].arguments);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  kd::OutputParserOptions o;
  o.starts_in_reasoning = data[0] & 1;
  o.reasoning = data[0] & 2;
  o.tool_calls = data[0] & 4;
  const bool raw = data[0] & 8;
  uint32_t seed = data[1];
  std::string text;
  for (size_t i = 2; i < size; ++i) {
    const uint8_t b = data[i];
    if (raw) text += static_cast<char>(b);
    else if (b >= 0x01 && b <= 0x09) text += kMarkers[b - 1];
    else if (b >= 0x0A && b <= 0x0D) text += std::string(kPartials[b - 0x0A]) + " ";
    else if (b == '<') text += "< ";
    else text += static_cast<char>(b);
  }
  const kd::ParsedOutput want = kd::parse_kimi_output(text, o, true);
  const bool leak_check = !raw;
  if (leak_check) check(!has_active_marker(want.content, o) && !has_active_marker(want.reasoning, o));
  std::vector<size_t> cuts;
  for (size_t at = 0; at < text.size();) {
    seed = seed * 1103515245u + 12345u;
    at = std::min(text.size(), at + 1 + (seed >> 16) % 17);
    cuts.push_back(at);
  }
  if (cuts.empty()) cuts.push_back(0);
  run_stream(text, o, cuts, want, leak_check);
  if (text.size() <= 128) {  // every byte a commit, then a separate final update
    std::vector<size_t> every;
    for (size_t at = 0; at <= text.size(); ++at) every.push_back(at);
    every.push_back(text.size());
    run_stream(text, o, every, want, leak_check);
  }
  return 0;
}
