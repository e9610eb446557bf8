// A compiled PCRE2 pattern (Python `re` syntax is PCRE-compatible for what checkpoints use).
// std::regex backtracks without limit: a nested quantifier in a config's ignore list (".**x")
// hung the config fuzzer. PCRE2 runs with match and depth limits and reports when it gives up.
#pragma once
#include <memory>
#include <string>
#include <string_view>

namespace kd {

class Regex {
 public:
  explicit Regex(const std::string& pattern);  // throws kd::Error with PCRE2's message and offset
  // True when the pattern matches at the start of `s` (Python's re.match).
  // Throws kd::Error if the match exceeds the work limit.
  bool match_prefix(std::string_view s) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::string pattern_;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kd
