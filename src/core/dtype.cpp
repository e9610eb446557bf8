#include "core/dtype.h"

#include <array>
#include <utility>

namespace kd {

namespace {
constexpr std::array<std::pair<std::string_view, DType>, 12> kNames = {{
    {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16},
    {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},
    {"U8", DType::U8}, {"BOOL", DType::BOOL}, {"F8_E4M3", DType::F8_E4M3}, {"F8_E5M2", DType::F8_E5M2},
}};
}  // namespace

std::string_view dtype_name(DType t) {
  for (auto& [n, d] : kNames)
    if (d == t) return n;
  return "?";
}

bool parse_dtype(std::string_view s, DType* out) {
  for (auto& [n, d] : kNames)
    if (n == s) { *out = d; return true; }
  return false;
}

}  // namespace kd
