// UTF-8 well-formedness (Unicode Table 3-7), shared by the validators and the sanitiser.
#pragma once
#include <cstddef>

namespace kd {

// For a lead byte c ≥ 0x80: the sequence length and the allowed range [lo, hi] of its second byte
// (later bytes are 0x80–0xBF). False when c cannot start a well-formed sequence.
inline bool utf8_lead(unsigned char c, size_t* len, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) *len = 2;
  else if (c == 0xE0) *len = 3, *lo = 0xA0;
  else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) *len = 3;
  else if (c == 0xED) *len = 3, *hi = 0x9F;
  else if (c == 0xF0) *len = 4, *lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) *len = 4;
  else if (c == 0xF4) *len = 4, *hi = 0x8F;
  else return false;
  return true;
}

}  // namespace kd
