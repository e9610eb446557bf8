// A compiled PCRE2 pattern (Python `re` syntax is PCRE-compatible for what checkpoints use).
// std::regex backtracks without limit: a nested quantifier in a config's ignore list (".**x")
// hung the config fuzzer. PCRE2 runs with match and depth limits and reports when it gives up.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kd {

class Regex {
 public:
  struct Options {
    bool ucp = false;  // \s \d \w and POSIX classes use Unicode properties (Rust regex / Oniguruma do)
    bool jit = false;  // JIT-compile for repeated matching (tokenizer pre-splitting)
  };
  explicit Regex(const std::string& pattern);  // throws kd::Error with PCRE2's message and offset
  Regex(const std::string& pattern, Options opts);
  // True when the pattern matches at the start of `s` (Python's re.match).
  // Throws kd::Error if the match exceeds the work limit.
  bool match_prefix(std::string_view s) const;
  // Every non-overlapping match of the pattern in `s`, left to right, as (begin, end) byte offsets
  // (Rust regex find_iter: an empty match advances one character). `s` is UTF-8-checked once.
  // Throws kd::Error on invalid UTF-8 or when a match exceeds the work limit.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::string pattern_;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kd
