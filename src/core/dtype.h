// Element types as safetensors names them, and the widening conversions the CPU backend uses.
#pragma once
#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace kd {

enum class DType : uint8_t { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };

// Bytes per element for every dtype safetensors defines that we recognise.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    default: return 1;
  }
}

std::string_view dtype_name(DType t);
// Parses a safetensors dtype string; false when unknown.
bool parse_dtype(std::string_view s, DType* out);

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }

// Round-to-nearest-even, as torch's float → bfloat16 cast does (NaN kept quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE half → float, exact (subnormals included).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t out;
  if (exp == 0) {
    if (man == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      out = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    out = sign | 0x7f800000u | man << 13;
  } else {
    out = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  return std::bit_cast<float>(out);
}

}  // namespace kd
