#include "backend/cpu/dot.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"

#include "backend/cpu/lanes.h"  // <immintrin.h> and the GCC 12 intrinsic-warning pragmas (see there)

namespace kd::cpu {

namespace {

constexpr int kLanes = 64;

// Elements [from, n) into their lanes one by one, then the fixed halving tree: the reference
// order (the portable build's; finish4 below is its register form).
[[maybe_unused]] inline float finish(float* acc, const float* w_tail, const float* x, int64_t from, int64_t n) {
  for (int64_t i = from; i < n; ++i) acc[i % kLanes] = std::fma(w_tail[i - from], x[i], acc[i % kLanes]);
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int j = 0; j < s; ++j) acc[j] += acc[j + s];
  return acc[0];
}

}  // namespace

bool dot_int4_supported(int64_t n, int32_t group) { return n % kLanes == 0 && group % 16 == 0; }

#if defined(__AVX512F__)

namespace {
using lanes::reduce64;  // the same halving tree as finish(), on registers

// finish()'s tail on registers: element i (< 64 of them) into lane i mod 64 by a masked FMA (the
// same correctly rounded fma per lane; masked-off lanes keep their sums). Short dots (a 16-wide
// attention head) were dominated by finish()'s 63 scalar adds.
inline void tail4(__m512& a0, __m512& a1, __m512& a2, __m512& a3, const float* w_tail, const float* x, int64_t i, int64_t n) {
  const int64_t r = n - i;
  __m512* a[4] = {&a0, &a1, &a2, &a3};
  for (int j = 0; j < 4 && 16 * j < r; ++j) {
    const int64_t left = r - 16 * j;
    const __mmask16 mk = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    *a[j] = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(mk, w_tail + 16 * j), _mm512_maskz_loadu_ps(mk, x + i + 16 * j), *a[j], mk);
  }
}

// finish() on registers: the tail, then the same tree.
inline float finish4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, const float* w_tail, const float* x, int64_t i, int64_t n) {
  tail4(a0, a1, a2, a3, w_tail, x, i, n);
  return reduce64(a0, a1, a2, a3);
}

// dot_f32's 64 lanes of w · x: element i into lane i mod 64 in order of i (whole chunks, then the tail).
inline void lanes64(const float* w, const float* x, int64_t n, __m512& a0, __m512& a1, __m512& a2, __m512& a3) {
  a0 = a1 = a2 = a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  tail4(a0, a1, a2, a3, w + i, x, i, n);
}
}  // namespace

float dot_f32(const float* w, const float* x, int64_t n) {
  __m512 a0, a1, a2, a3;
  lanes64(w, x, n, a0, a1, a2, a3);
  return reduce64(a0, a1, a2, a3);
}

namespace {

// One row's 64 lanes as dot_f32 forms them, folded by reduce64's first step to 16: (a0 + a2) + (a1 + a3).
inline __m512 lanes16(const float* w, const float* x, int64_t n) {
  __m512 a0, a1, a2, a3;
  lanes64(w, x, n, a0, a1, a2, a3);
  return _mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3));
}

// The rest of reduce64 for 16 rows at once: lane k of the result is reduce64's sum of v[k]. Its
// steps — lanes j + j+8, then j + j+4, j + j+2, j + j+1 — as vertical adds of registers whose
// lanes were shuffled into place, pairing the same operands: the same sums bit for bit.
inline __m512 tree16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int m = 0; m < 8; ++m)  // j + j+8: halves of two rows side by side
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int p = 0; p < 4; ++p)  // j + j+4: 128-bit quarter k of x[p] is row 4p + k
    x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int r = 0; r < 2; ++r)  // j + j+2 within each quarter
    y[r] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * r], x[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * r], x[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // j + j+1: lane 4k + i holds row 4i + k; put row k in lane k.
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

}  // namespace

void dot_f32_rows(const float* x, const float* const* rows, int64_t count, int64_t n, float* out) {
  for (int64_t j0 = 0; j0 < count; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, count - j0);
    __m512 v[16];
    for (int64_t k = 0; k < 16; ++k) v[k] = k < m ? lanes16(x, rows[j0 + k], n) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out + j0, m >= 16 ? __mmask16(0xffff) : __mmask16((1u << m) - 1), tree16(v));
  }
}

namespace {

// accumulate_rows over elements [d0, d0 + 16 R) (the last register ragged by its mask): R sums in
// registers across all the rows.
template <int R>
void accumulate_block(const float* w, const float* const* rows, int64_t count, int64_t n, int64_t d0, float* out) {
  __m512 acc[R];
  __mmask16 mk[R];
  for (int j = 0; j < R; ++j) {
    const int64_t left = n - d0 - 16 * j;
    mk[j] = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    acc[j] = _mm512_maskz_loadu_ps(mk[j], out + d0 + 16 * j);
  }
  for (int64_t t = 0; t < count; ++t) {
    const __m512 wt = _mm512_set1_ps(w[t]);
    const float* r = rows[t] + d0;
    for (int j = 0; j < R; ++j) acc[j] = _mm512_mask3_fmadd_ps(wt, _mm512_maskz_loadu_ps(mk[j], r + 16 * j), acc[j], mk[j]);
  }
  for (int j = 0; j < R; ++j) _mm512_mask_storeu_ps(out + d0 + 16 * j, mk[j], acc[j]);
}

}  // namespace

void accumulate_rows(const float* w, const float* const* rows, int64_t count, int64_t n, float* out) {
  for (int64_t d0 = 0; d0 < n; d0 += 128) {  // up to 8 registers a pass over the rows
    switch (std::min<int64_t>(8, (n - d0 + 15) / 16)) {
      case 1: accumulate_block<1>(w, rows, count, n, d0, out); break;
      case 2: accumulate_block<2>(w, rows, count, n, d0, out); break;
      case 3: accumulate_block<3>(w, rows, count, n, d0, out); break;
      case 4: accumulate_block<4>(w, rows, count, n, d0, out); break;
      case 5: accumulate_block<5>(w, rows, count, n, d0, out); break;
      case 6: accumulate_block<6>(w, rows, count, n, d0, out); break;
      case 7: accumulate_block<7>(w, rows, count, n, d0, out); break;
      default: accumulate_block<8>(w, rows, count, n, d0, out); break;
    }
  }
}

void dot_f32_2x2(const float* w0, const float* w1, const float* x0, const float* x1, int64_t n, float* out) {
  // Four independent dot products sharing their loads: each pair keeps its own four accumulators
  // and the same FMA order as dot_f32, so every result is bit-identical to dot_f32's.
  __m512 p00[4], p01[4], p10[4], p11[4];
  for (int j = 0; j < 4; ++j) p00[j] = p01[j] = p10[j] = p11[j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < 4; ++j) {
      const __m512 a = _mm512_loadu_ps(w0 + i + 16 * j), b = _mm512_loadu_ps(w1 + i + 16 * j);
      const __m512 u = _mm512_loadu_ps(x0 + i + 16 * j), v = _mm512_loadu_ps(x1 + i + 16 * j);
      p00[j] = _mm512_fmadd_ps(a, u, p00[j]);
      p01[j] = _mm512_fmadd_ps(a, v, p01[j]);
      p10[j] = _mm512_fmadd_ps(b, u, p10[j]);
      p11[j] = _mm512_fmadd_ps(b, v, p11[j]);
    }
  out[0] = finish4(p00[0], p00[1], p00[2], p00[3], w0 + i, x0, i, n);
  out[1] = finish4(p01[0], p01[1], p01[2], p01[3], w0 + i, x1, i, n);
  out[2] = finish4(p10[0], p10[1], p10[2], p10[3], w1 + i, x0, i, n);
  out[3] = finish4(p11[0], p11[1], p11[2], p11[3], w1 + i, x1, i, n);
}

namespace {
inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
}  // namespace

float dot_bf16(const uint16_t* w, const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    a0 = _mm512_fmadd_ps(widen_bf16(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(widen_bf16(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(widen_bf16(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(widen_bf16(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  float tail[kLanes];
  for (int64_t k = i; k < n; ++k) tail[k - i] = bf16_to_f32(w[k]);
  return finish4(a0, a1, a2, a3, tail, x, i, n);
}

float dot_int4(const uint32_t* words, const uint16_t* scales, int32_t group, const float* x, int64_t n) {
  // 16 nibbles (two words) per vector: lane l takes word l / 8, shifted right by 4 · (l mod 8).
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i shift = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
  const __m512i mask = _mm512_set1_epi32(0xf), eight = _mm512_set1_epi32(8);
  auto weights16 = [&](int64_t i) {
    uint64_t two;
    std::memcpy(&two, words + i / 8, 8);
    __m512i v = _mm512_permutexvar_epi32(pick, _mm512_set1_epi64(int64_t(two)));  // 32-bit lanes w0, w1, w0, …
    v = _mm512_sub_epi32(_mm512_and_si512(_mm512_srlv_epi32(v, shift), mask), eight);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(bf16_to_f32(scales[i / group])));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += kLanes) {
    a0 = _mm512_fmadd_ps(weights16(i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(weights16(i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(weights16(i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(weights16(i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  return reduce64(a0, a1, a2, a3);
}

#else  // portable: the same lanes and order, left to the compiler to vectorise

float dot_f32(const float* w, const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = std::fma(w[i + j], x[i + j], acc[j]);
  return finish(acc, w + i, x, i, n);
}

void dot_f32_rows(const float* x, const float* const* rows, int64_t count, int64_t n, float* out) {
  for (int64_t j = 0; j < count; ++j) out[j] = dot_f32(x, rows[j], n);
}

void accumulate_rows(const float* w, const float* const* rows, int64_t count, int64_t n, float* out) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t d = 0; d < n; ++d) out[d] += w[t] * rows[t][d];
}

void dot_f32_2x2(const float* w0, const float* w1, const float* x0, const float* x1, int64_t n, float* out) {
  out[0] = dot_f32(w0, x0, n);
  out[1] = dot_f32(w0, x1, n);
  out[2] = dot_f32(w1, x0, n);
  out[3] = dot_f32(w1, x1, n);
}

float dot_bf16(const uint16_t* w, const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = std::fma(bf16_to_f32(w[i + j]), x[i + j], acc[j]);
  float tail[kLanes];
  for (int64_t k = i; k < n; ++k) tail[k - i] = bf16_to_f32(w[k]);
  return finish(acc, tail, x, i, n);
}

float dot_int4(const uint32_t* words, const uint16_t* scales, int32_t group, const float* x, int64_t n) {
  float acc[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const int64_t k = i + j;
      const float w = float(int32_t((words[k / 8] >> (4 * (k % 8))) & 0xfu) - 8) * bf16_to_f32(scales[k / group]);
      acc[j] = std::fma(w, x[k], acc[j]);
    }
  return finish(acc, nullptr, x, n, n);
}

#endif

}  // namespace kd::cpu
