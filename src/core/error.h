// Errors: one exception type carrying a message that names what is wrong (file, tensor, field,
// expected vs found). User input is never checked with assert: it is checked and reported.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kd {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... A>
std::string cat(const A&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  throw Error(cat(parts...));
}

}  // namespace kd
