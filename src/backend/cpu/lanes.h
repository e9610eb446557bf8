// The 64-lane accumulation structure every CPU dot product shares (dot.h): the fixed halving tree
// over 64 fp32 lanes held in four AVX-512 registers (natural order: a0 = lanes 0–15, …, a3 = 48–63).
// One definition, so the fused dots (dot.cpp) and the tiled multi-row kernels (tile.cpp) sum in the
// same order bit for bit. Internal to the CPU backend; AVX-512 builds only.
// Including it also silences, for the rest of the including file, GCC 12's -Wmaybe-uninitialized /
// -Wuninitialized on the _mm512_undefined_* temporaries inside its own intrinsic headers (GCC bug
// 105593, fixed in 13; the intrinsics used here never read them): every includer uses intrinsics.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kd::cpu::lanes {

// Lanes j += j+32, then j += j+16, then within the register 8, 4, 2, 1: elementwise adds in the
// order of dot.cpp's scalar finish(), so bit-identical to it.
inline float reduce64(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  __m512 v = _mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

}  // namespace kd::cpu::lanes
#endif
