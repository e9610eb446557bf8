// `kdtree tokenize`: text → ids (or ids → text with --decode) with a checkpoint's own tokenizer, for
// people checking prompts and for the tests that compare against tiktoken. Needs only the tokenizer
// files. --bench times encode in-process (one thread) so it can stand next to tiktoken's Rust core.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/untrusted.h"
#include "tokenizer/tokenizer.h"

namespace kd::cli {

void add_tokenize(CLI::App& app, TokenizeOptions& o) {
  auto* c = app.add_subcommand("tokenize", "Text to token ids (or ids to text with --decode) with a checkpoint's tokenizer");
  c->add_option("-m,--model", o.model, "Directory with tiktoken.model + tokenizer_config.json, or tokenizer.json")->required();
  auto* text = c->add_option("--text", o.text, "The text (with --decode: comma-separated ids)");
  auto* file = c->add_option("--file", o.file, "Read the text (or ids) from this file, byte for byte");
  text->excludes(file);
  c->add_flag("--json", o.json, "Print one JSON object: {\"ids\": [...], \"n_tokens\": n} or {\"text\": ...}");
  c->add_flag("--decode", o.decode, "Input is comma-separated ids; print the text (invalid UTF-8 → U+FFFD)");
  c->add_flag("--parse-special", o.parse_special, "Recognise special-token names in the text (tiktoken's allowed_special=\"all\")");
  c->add_flag("--jsonl", o.jsonl, "--file holds one JSON string (with --decode: one JSON id array) per line; "
              "print one JSON object per line");
  c->add_flag("--bench", o.bench, "Time encode of --file in-process, single thread: median of 5, MB/s");
}

namespace {

// --file: a regular file (a FIFO or device would be read without end), up to 1 GiB.
std::string read_all(const std::string& path) { return read_text_file(path, size_t(1) << 30); }

std::vector<int32_t> parse_ids(std::string_view s, const Tokenizer& tok) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ',' || s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
    if (i >= s.size()) break;
    size_t j = i;
    int64_t v = 0;
    bool neg = false;
    if (s[j] == '-') neg = true, ++j;
    const size_t digits = j;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9' && j - digits < 12) v = v * 10 + (s[j++] - '0');
    if (j == digits || (j < s.size() && s[j] != ',' && s[j] != ' ' && s[j] != '\n' && s[j] != '\r' && s[j] != '\t'))
      fail("--decode: '", s.substr(i, std::min<size_t>(20, s.size() - i)), "' at byte ", i, " is not a token id");
    if (neg) v = -v;
    if (v < 0 || v >= tok.vocab_size()) fail("--decode: token id ", v, " is out of range [0, ", tok.vocab_size(), ")");
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}

nlohmann::json ids_object(const std::vector<int32_t>& ids) {
  nlohmann::ordered_json j;
  j["ids"] = ids;
  j["n_tokens"] = ids.size();
  return j;
}

int bench(const Tokenizer& tok, const TokenizeOptions& o, const std::string& text) {
  std::vector<double> t_ms;
  size_t n_tokens = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok.encode(text, o.parse_special);
    const auto t1 = std::chrono::steady_clock::now();
    t_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    n_tokens = ids.size();
  }
  std::sort(t_ms.begin(), t_ms.end());
  const double med = t_ms[2];
  const double mb_s = static_cast<double>(text.size()) / 1e6 / (med / 1e3);
  if (o.json) {
    nlohmann::ordered_json j;
    j["bytes"] = text.size();
    j["n_tokens"] = n_tokens;
    j["t_ms"] = med;
    j["mb_per_s"] = mb_s;
    j["tokens_per_s"] = static_cast<double>(n_tokens) / (med / 1e3);
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("encode (%s, 1 thread): %zu bytes → %zu tokens in %.2f ms (median of 5) = %.2f MB/s, %.2f M tokens/s\n",
                tok.kind().c_str(), text.size(), n_tokens, med, mb_s, static_cast<double>(n_tokens) / (med / 1e3) / 1e6);
  }
  return 0;
}

}  // namespace

int cmd_tokenize(const TokenizeOptions& o) {
  if (!o.text && o.file.empty()) fail("tokenize: give the input with --text or --file");
  if (o.bench && o.file.empty()) fail("tokenize --bench: give the text with --file");
  if (o.jsonl && o.file.empty()) fail("tokenize --jsonl: give the lines with --file");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(o.model);
  const std::string input = o.file.empty() ? *o.text : read_all(o.file);
  if (o.bench) return bench(*tok, o, input);

  if (o.jsonl) {
    std::istringstream lines(input);
    std::string line;
    int64_t line_no = 0;
    while (std::getline(lines, line)) {
      ++line_no;
      if (line.empty()) continue;
      const nlohmann::json in = parse_json(line, cat(o.file, ":", line_no));
      nlohmann::ordered_json out;
      if (o.decode) {
        if (!in.is_array()) fail(o.file, ":", line_no, ": expected a JSON array of ids");
        std::vector<int32_t> ids;
        for (const auto& v : in) {
          if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok->vocab_size())
            fail(o.file, ":", line_no, ": ", json_excerpt(v), " is not a token id in [0, ", tok->vocab_size(), ")");
          ids.push_back(v.get<int32_t>());
        }
        out["text"] = tok->decode(ids);
      } else {
        if (!in.is_string()) fail(o.file, ":", line_no, ": expected a JSON string");
        const std::vector<int32_t> ids = tok->encode(in.get<std::string>(), o.parse_special);
        out["ids"] = ids;
        out["n_tokens"] = ids.size();
      }
      std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict).c_str());
    }
    return 0;
  }

  if (o.decode) {
    const std::string text = tok->decode(parse_ids(input, *tok));
    if (o.json) {
      nlohmann::ordered_json j;
      j["text"] = text;
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fputc('\n', stdout);
    }
    return 0;
  }
  const std::vector<int32_t> ids = tok->encode(input, o.parse_special);
  if (o.json) {
    std::printf("%s\n", ids_object(ids).dump().c_str());
    return 0;
  }
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) line += (i ? "," : "") + std::to_string(ids[i]);
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace kd::cli
