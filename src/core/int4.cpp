#include "core/int4.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"

namespace kd {

void quantize_int4_row(const float* w, int64_t cols, int32_t group, int8_t* q, uint16_t* scales) {
  for (int64_t g = 0; g * group < cols; ++g) {
    const int64_t c0 = g * group, c1 = std::min<int64_t>(cols, c0 + group);
    float absmax = 0;
    for (int64_t c = c0; c < c1; ++c) absmax = std::max(absmax, std::fabs(w[c]));
    const uint16_t sb = f32_to_bf16(absmax / 8.0f);
    scales[g] = sb;
    const float s = bf16_to_f32(sb);
    for (int64_t c = c0; c < c1; ++c) {
      float v = s > 0 ? std::nearbyint(w[c] / s) : 0.0f;  // round half to even, like torch.round
      q[c] = int8_t(std::clamp(v, -8.0f, 7.0f));
    }
  }
}

void pack_int4_row(const int8_t* q, int64_t cols, uint32_t* words) {
  for (int64_t j = 0; j < (cols + 7) / 8; ++j) {
    uint32_t word = 0;
    for (int64_t i = 0; i < 8 && j * 8 + i < cols; ++i) word |= uint32_t(q[j * 8 + i] + 8) << (4 * i);
    words[j] = word;
  }
}

}  // namespace kd
