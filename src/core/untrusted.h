// Reading what a user or a client hands us — files named by a checkpoint, request bodies — with
// limits, so that no input can crash, hang or balloon the process (issue 21):
//   - JSON nesting is bounded before parsing: nlohmann's dump(), copy and comparison recurse once per
//     level, so 100,000 nested brackets (200 KB) overflow the stack wherever the value is later
//     printed or copied. No real config, index or request nests beyond a dozen levels.
//   - files are read only when they are regular files below a size cap (a symlink to /dev/zero, a FIFO,
//     a directory are refused by name instead of read forever);
//   - whatever goes into an error message is a short, escaped excerpt, never the input itself.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kd {

// Deepest nesting of arrays and objects accepted anywhere (the deepest real input we know of, a
// chat request with tool schemas, nests about 12 levels).
inline constexpr int kMaxJsonDepth = 64;

// Caps for the small JSON/text files of a checkpoint directory.
inline constexpr size_t kMaxConfigBytes = size_t(16) << 20;     // config.json, generation_config.json, index
inline constexpr size_t kMaxTokenizerBytes = size_t(256) << 20;  // tokenizer.json, tiktoken.model, templates

// Throws kd::Error "LABEL: JSON nests deeper than MAX levels (at byte N)" when `text` opens more than
// `max_depth` arrays/objects at once. Brackets inside strings do not count. Linear, no allocation.
void check_json_depth(std::string_view text, const std::string& label, int max_depth = kMaxJsonDepth);

// check_json_depth, then parse; malformed JSON is a kd::Error naming `label` and nlohmann's message
// (which gives the byte position). Numbers too large for a double are an error, not infinity.
nlohmann::json parse_json(std::string_view text, const std::string& label, int max_depth = kMaxJsonDepth);
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& label, int max_depth = kMaxJsonDepth);

// At most `max_chars` characters of `v` as compact JSON, "…" appended when cut; invalid UTF-8 replaced.
// Safe on any value (it stops descending once the budget is spent).
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 60);
std::string json_excerpt(const nlohmann::ordered_json& v, size_t max_chars = 60);

// Raw bytes for an error message: printable ASCII as is, everything else as \n, \t, \xNN; cut after
// `max_chars` output characters with "…".
std::string escaped_excerpt(std::string_view bytes, size_t max_chars = 60);

// A message for a terminal or a log: valid UTF-8 kept as it is, control characters (C0, DEL, C1)
// and bytes that are not UTF-8 escaped as \n, \t, \xNN, cut after `max_bytes` with "…". The net
// under every error kdtree prints (cli/main.cpp), whatever a message copied from its input.
std::string printable_message(std::string_view text, size_t max_bytes = 4096);

// The whole of a regular file of at most `max_bytes` bytes. Errors name `path` and say what is wrong:
// missing, not a regular file (FIFO, device, directory — symlinks are followed), larger than the cap,
// unreadable. Opening never blocks (O_NONBLOCK), so a FIFO swapped in after the check cannot hang us.
std::string read_text_file(const std::string& path, size_t max_bytes);

// parse_json(read_text_file(path, max_bytes), path): a JSON file of a checkpoint directory.
nlohmann::json read_json_file(const std::string& path, size_t max_bytes = kMaxConfigBytes);

}  // namespace kd
