// JSON Schema's numeric keywords as grammars over digit strings (json_schema.cpp's integer and
// number types): a bounded range of integers is a regular language — a finite set of digit
// patterns, one per length and leading digit — and so is "decimal ≥ 1.25" or "a multiple of 7".
//
// The language of numbers is JSON's, minus what the grammar never writes: no "-0", no exponent
// (a range over exponents would be exact too, but a model gains nothing by writing 1e2). Bounds
// are compared so that what a validator computes agrees:
//   - integer literals (no '.') are compared with the bound's exact value (Python's jsonschema
//     compares ints exactly, also against floats): ceil(minimum) ≤ n ≤ floor(maximum);
//   - literals with a fraction are compared, as decimals, with the bound's shortest round-trip
//     spelling S (1.1, not 1.100000000000000088…). A validator reads them as doubles; rounding is
//     monotone and S rounds to the bound, so x ≥ S (decimal) implies double(x) ≥ bound.
// Exclusive bounds on non-integers are not offered (a decimal just above the bound can round onto
// it); json_schema.cpp refuses them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kd::grammar {

// 128-bit integers (GCC and Clang): ranges up to 10^19 in magnitude, with room for ±1.
__extension__ typedef __int128 i128;
__extension__ typedef unsigned __int128 u128;

// Inclusive integer bounds; nullopt is unbounded. The magnitudes must stay below 10^19.
struct IntRange {
  std::optional<i128> lo, hi;
};

// A GBNF expression matching the decimal integers in [lo, hi] (JSON's spelling); empty range:
// the empty string (the caller refuses it first).
std::string integer_range_gbnf(const IntRange& r);

// A GBNF expression matching JSON numbers without exponent whose value lies in [lo, hi] (either
// may be absent). `what` prefixes errors (a bound too large to spell).
std::string number_range_gbnf(std::optional<double> lo, std::optional<double> hi, const std::string& what);

// GBNF rules (name, body) whose first rule matches the decimal integers (JSON spelling) that are
// multiples of k, 2 ≤ k ≤ kMaxModulus: an automaton with k states (the remainder so far) over the
// digits. Rule names start with `prefix`.
constexpr int64_t kMaxModulus = 1000;
std::vector<std::pair<std::string, std::string>> multiple_of_rules(int64_t k, const std::string& prefix);

// The decimal spelling of a 128-bit integer.
std::string int128_string(i128 v);

}  // namespace kd::grammar
