// Integer flags read strictly (issue 21). CLI11 2.1 converts with strtoull / strtoll in base 0,
// which saturates past the type's range (--seed 18446744073709551616 became 2^64 − 1), wraps a
// negative number into an unsigned one (--seed -1 became 2^64 − 1) and reads 010 as octal 8 and
// 0x10 as hex. `->transform(whole_number(var))` runs on the text before that conversion: decimal
// digits only, a leading '-' only for a signed type, within the type's range — else a usage error
// (exit 2) naming the flag — and hands CLI11 the canonical decimal, so no base is guessed.
#pragma once
#include <CLI/CLI.hpp>
#include <charconv>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace kd::cli {

template <class T>
CLI::Validator whole_number(const T& /*the option's variable: picks T*/) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const std::string range = std::string("a whole number in [") + std::to_string(std::numeric_limits<T>::min()) +
                                  ", " + std::to_string(std::numeric_limits<T>::max()) + "]";
        T v{};
        const char* end = s.data() + s.size();
        const auto [p, ec] = std::from_chars(s.data(), end, v);  // base 10; no '+', no spaces, no 0x
        if (ec == std::errc::result_out_of_range) return "'" + s + "' is out of range: expected " + range;
        if (ec != std::errc() || p != end || s.empty()) return "'" + s + "' is not " + range;
        s = std::to_string(v);  // "010" → "10": CLI11 would read the original as octal
        return {};
      },
      "", "whole_number");
}

// A list flag (->delimiter(',')): each item on its own.
template <class T>
CLI::Validator whole_number(const std::vector<T>&) {
  return whole_number(T{});
}

}  // namespace kd::cli
