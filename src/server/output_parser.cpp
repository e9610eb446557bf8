// Kimi output parser: one left-to-right pass over the whole committed text with a five-state machine
// (content, reasoning, tool section, call header, call arguments). The rules it implements are listed
// in output_parser.h. Streaming is a diff of successive parses, which is only sound because every
// parse of a longer prefix extends the parse of a shorter one; the hold-back rules below exist to keep
// that true (tests/unit/test_output_parser.cpp and tests/fuzz/fuzz_output_parser.cpp check it).
#include "server/output_parser.h"

#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kd {
namespace {

enum class Kind { think_open, think_close, section_begin, section_end, call_begin, arg_begin, call_end };

struct Marker {
  std::string_view text;
  Kind kind;
  bool tool;  // a tool-call marker (active with opts.tool_calls) rather than a think marker
};

// Every marker holds exactly one '<', its first byte: two markers can never overlap, and a proper
// prefix of a marker at the end of the text can only start at the text's last '<'.
constexpr Marker kMarkers[] = {
    {"<think>", Kind::think_open, false},
    {"</think>", Kind::think_close, false},
    {"<|tool_calls_section_begin|>", Kind::section_begin, true},
    {"<|tool_call_section_begin|>", Kind::section_begin, true},  // singular variant seen in the wild
    {"<|tool_calls_section_end|>", Kind::section_end, true},
    {"<|tool_call_section_end|>", Kind::section_end, true},
    {"<|tool_call_begin|>", Kind::call_begin, true},
    {"<|tool_call_argument_begin|>", Kind::arg_begin, true},
    {"<|tool_call_end|>", Kind::call_end, true},
};

enum class Mode { content, reasoning, section, header, args };

constexpr std::string_view kWhitespace = " \t\r\n\f\v";

bool all_whitespace(std::string_view s) { return s.find_first_not_of(kWhitespace) == std::string_view::npos; }

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(kWhitespace);
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(kWhitespace);
  return s.substr(b, e - b + 1);
}

// "functions.NAME:IDX" → NAME. Also accepts a missing "functions." and a missing ":IDX", and an
// IDX that is not a number (a model imitating another model's ids from the history, e.g.
// "functions.get_weather:call_7f3a"): OpenAI function names cannot hold ':', so the last ':' always
// starts the index.
std::string name_from_id(std::string_view id) {
  constexpr std::string_view kPrefix = "functions.";
  if (id.starts_with(kPrefix)) id.remove_prefix(kPrefix.size());
  if (const size_t colon = id.rfind(':'); colon != std::string_view::npos) id = id.substr(0, colon);
  return std::string(id);
}

// A SAX consumer that builds nothing: validates without a DOM (1 MB arguments stay cheap) and keeps
// nlohmann's message for the first error (byte position and what was expected).
struct ValidatingSax : nlohmann::json_sax<nlohmann::json> {
  std::string error;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = e.what();
    return false;
  }
};

// "" when `args` is a JSON object, else what is wrong with it.
std::string check_arguments(const std::string& args) {
  if (args.empty()) return "tool call arguments are empty (expected a JSON object)";
  ValidatingSax sax;
  if (!nlohmann::json::sax_parse(args, &sax) || !sax.error.empty())
    return cat("tool call arguments are not valid JSON: ", sax.error.empty() ? "syntax error" : sax.error);
  if (args.front() != '{') return "tool call arguments are valid JSON but not an object";
  return "";
}

class Parser {
 public:
  Parser(std::string_view text, const OutputParserOptions& opts, bool final, const ParsedOutput* prev)
      : text_(text), opts_(opts), final_(final), prev_(prev) {}

  ParsedOutput run() {
    mode_ = opts_.reasoning && opts_.starts_in_reasoning ? Mode::reasoning : Mode::content;
    size_t pos = 0;
    for (;;) {
      const std::optional<Hit> hit = find_marker(pos);
      if (!hit) break;
      closed_segment(text_.substr(pos, hit->pos - pos));
      on_marker(hit->kind);
      pos = hit->pos + hit->len;
    }
    open_tail(text_.substr(pos));
    return std::move(out_);
  }

 private:
  struct Hit {
    size_t pos, len;
    Kind kind;
  };

  // Which markers mean something in the current mode. Inside a call (header, arguments) only the
  // tool markers do: "<think>" there is argument text (a JSON string may hold it).
  bool active(const Marker& m) const {
    if (m.tool) return opts_.tool_calls;
    return opts_.reasoning && mode_ != Mode::header && mode_ != Mode::args;
  }

  std::optional<Hit> find_marker(size_t pos) const {
    for (size_t p = text_.find('<', pos); p != std::string_view::npos; p = text_.find('<', p + 1)) {
      const std::string_view rest = text_.substr(p);
      for (const Marker& m : kMarkers)
        if (active(m) && rest.starts_with(m.text)) return Hit{p, m.text.size(), m.kind};
    }
    return std::nullopt;
  }

  // Length of the longest suffix of `s` that is a proper prefix of an active marker (0 if none), and
  // whether that marker is a tool marker (a cut "<|…" at the end of generation is dropped).
  std::pair<size_t, bool> partial_marker(std::string_view s) const {
    const size_t lt = s.rfind('<');
    if (lt == std::string_view::npos) return {0, false};
    const std::string_view tail = s.substr(lt);
    size_t len = 0;
    bool tool = false;
    for (const Marker& m : kMarkers) {
      if (!active(m) || tail.size() >= m.text.size() || !m.text.starts_with(tail)) continue;
      len = tail.size();
      tool = tool || (m.tool && tail.starts_with("<|"));
    }
    return {len, tool};
  }

  void closed_segment(std::string_view s) {
    switch (mode_) {
      case Mode::content: out_.content += s; break;
      case Mode::reasoning: out_.reasoning += s; break;
      case Mode::section: section_text_ += s; break;  // the next marker decides (see on_marker)
      case Mode::header: header_ += s; break;
      case Mode::args: raw_args_ += s; break;
    }
  }

  void on_marker(Kind k) {
    switch (mode_) {
      case Mode::content:
      case Mode::reasoning:
        if (k == Kind::think_open) mode_ = Mode::reasoning;  // nested <think> in reasoning: dropped
        if (k == Kind::think_close) mode_ = Mode::content;   // stray </think> in content: dropped
        if (k == Kind::section_begin) mode_ = Mode::section;
        if (k == Kind::call_begin) begin_header();            // a call without a section begin
        return;                                               // other stray tool markers: dropped
      case Mode::section:
        // Text in the section followed by an argument begin is the header of a call that lacks
        // <|tool_call_begin|> (seen in the wild); any other text there is content unless blank.
        if (k == Kind::arg_begin && !all_whitespace(section_text_)) {
          header_ = std::move(section_text_);
          section_text_.clear();
          start_call();
          mode_ = Mode::args;
          raw_args_.clear();
          return;
        }
        flush_section_text();
        if (k == Kind::section_end) mode_ = Mode::content;
        if (k == Kind::call_begin) begin_header();
        return;
      case Mode::header:
        start_call();
        if (k == Kind::arg_begin) {
          mode_ = Mode::args;
          raw_args_.clear();
          return;
        }
        close_call(/*has_args=*/false);
        after_call(k);
        return;
      case Mode::args:
        if (k == Kind::arg_begin) return;  // a second argument begin: dropped
        close_call(/*has_args=*/true);
        after_call(k);
        return;
    }
  }

  // Where the text goes after a call closed by marker `k` (tolerated: not only <|tool_call_end|>).
  void after_call(Kind k) {
    if (k == Kind::call_begin) begin_header();
    else if (k == Kind::section_end) mode_ = Mode::content;
    else mode_ = Mode::section;
  }

  void flush_section_text() {
    if (!all_whitespace(section_text_)) out_.content += section_text_;
    section_text_.clear();
  }

  void begin_header() {
    mode_ = Mode::header;
    header_.clear();
  }

  void start_call() {
    call_ = ParsedToolCall{};
    call_.id = std::string(trim(header_));
    call_.name = name_from_id(call_.id);
  }

  void close_call(bool has_args) {
    call_.complete = true;
    call_.arguments = has_args ? std::string(trim(raw_args_)) : std::string();
    if (call_.name.empty()) call_.error = "tool call header names no function (expected functions.NAME:IDX)";
    else if (!has_args) call_.error = "tool call has no <|tool_call_argument_begin|> and no arguments";
    else call_.error = cached_check(out_.tool_calls.size());
    out_.tool_calls.push_back(std::move(call_));
  }

  // The previous streaming parse already checked call i when its text is the same: a 1 MB argument
  // is then not re-validated on every later update.
  std::string cached_check(size_t i) const {
    if (prev_ && i < prev_->tool_calls.size()) {
      const ParsedToolCall& p = prev_->tool_calls[i];
      if (p.complete && p.id == call_.id && p.arguments == call_.arguments) return p.error;
    }
    return check_arguments(call_.arguments);
  }

  // The text after the last marker: nothing closes it yet.
  void open_tail(std::string_view s) {
    const auto [partial, tool] = partial_marker(s);
    if (!final_ || tool) s.remove_suffix(partial);  // held back, or a marker cut by max_tokens
    switch (mode_) {
      case Mode::content:
      case Mode::reasoning: closed_segment(s); return;
      case Mode::section:
        // Held while streaming: an argument begin may still turn it into a call header.
        if (final_) {
          section_text_ += s;
          flush_section_text();
        }
        return;
      case Mode::header:
        // Announced only with a complete header (the first delta must carry id and name), or at
        // the end of generation as a cut call.
        if (!final_) return;
        header_ += s;
        start_call();
        break;
      case Mode::args:
        raw_args_ += s;
        call_.arguments = std::string(trim(raw_args_));
        break;
    }
    call_.complete = false;
    out_.tool_calls.push_back(std::move(call_));
  }

  std::string_view text_;
  const OutputParserOptions& opts_;
  bool final_;
  const ParsedOutput* prev_;
  Mode mode_ = Mode::content;
  ParsedOutput out_;
  std::string section_text_;  // text in the section since the last marker
  std::string header_;    // the current call's header so far
  std::string raw_args_;  // the current call's argument text so far, untrimmed
  ParsedToolCall call_;   // the current call once its header is complete
};

// `now` minus its prefix `before`; kd::Error when `before` is not a prefix (a parser bug).
std::string suffix_after(const std::string& now, const std::string& before, std::string_view what) {
  if (now.size() < before.size() || now.compare(0, before.size(), before) != 0)
    fail("streaming output parser: the ", what, " of a later parse does not extend the earlier one");
  return now.substr(before.size());
}

}  // namespace

ParsedOutput parse_kimi_output(std::string_view text, const OutputParserOptions& opts, bool final) {
  return Parser(text, opts, final, nullptr).run();
}

OutputDelta StreamingOutputParser::update(std::string_view full_text, bool final) {
  if (finished_) fail("streaming output parser: update after the final update");
  if (full_text.size() < last_text_size_) fail("streaming output parser: the committed text got shorter");
  ParsedOutput now = Parser(full_text, opts_, final, &last_).run();
  OutputDelta d;
  d.reasoning = suffix_after(now.reasoning, last_.reasoning, "reasoning");
  d.content = suffix_after(now.content, last_.content, "content");
  if (now.tool_calls.size() < last_.tool_calls.size())
    fail("streaming output parser: a later parse has fewer tool calls");
  for (size_t i = 0; i < now.tool_calls.size(); ++i) {
    const ParsedToolCall& c = now.tool_calls[i];
    ToolCallDelta td;
    td.index = static_cast<int>(i);
    if (i >= last_.tool_calls.size()) {
      td.first = true;
      td.id = c.id;
      td.name = c.name;
      td.arguments = c.arguments;
    } else {
      const ParsedToolCall& p = last_.tool_calls[i];
      if (p.id != c.id || p.name != c.name) fail("streaming output parser: tool call ", i, " changed its id or name");
      td.arguments = suffix_after(c.arguments, p.arguments, "tool call arguments");
      if (td.arguments.empty()) continue;
    }
    d.tool_calls.push_back(std::move(td));
  }
  last_ = std::move(now);
  last_text_size_ = full_text.size();
  finished_ = final;
  return d;
}

std::string tool_call_problem(const ParsedToolCall& call) {
  if (!call.complete) return "tool call cut by the end of generation: arguments are incomplete";
  return call.error;
}

nlohmann::json tool_call_to_openai(const ParsedToolCall& call) {
  nlohmann::json j = {{"id", call.id},
                      {"type", "function"},
                      {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
  if (std::string problem = tool_call_problem(call); !problem.empty()) j["error"] = std::move(problem);
  return j;
}

}  // namespace kd
