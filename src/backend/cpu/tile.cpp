#include "backend/cpu/tile.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

#include "backend/cpu/lanes.h"  // <immintrin.h> and the GCC 12 intrinsic-warning pragmas (see there)

namespace kd::cpu {

#if defined(__AVX512F__)

namespace {

bool pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

constexpr int64_t kChunk = 64;  // elements a chunk: the 64 accumulator lanes

// Natural-order lanes from the permuted accumulators, then dot.h's halving tree.
inline float unpermute_reduce(const __m512 a[4]) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  return lanes::reduce64(_mm512_permutex2var_ps(a[0], lo, a[1]), _mm512_permutex2var_ps(a[0], hi, a[1]),
                         _mm512_permutex2var_ps(a[2], lo, a[3]), _mm512_permutex2var_ps(a[2], hi, a[3]));
}

// Lanes [0, n) of a 16-lane mask (n clamped to [0, 16]).
inline __mmask16 lanes_below(int64_t n) { return n <= 0 ? __mmask16(0) : n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// Which lanes of v0..v3 (tile.h's layout) hold elements [0, r) of a ragged last chunk.
inline void tail_masks(int64_t r, __mmask16 mk[4]) {
  mk[0] = lanes_below((r + 1) / 2);      // elements 2j < r
  mk[1] = lanes_below(r / 2);            // 2j + 1 < r
  mk[2] = lanes_below((r - 32 + 1) / 2);  // 32 + 2j < r
  mk[3] = lanes_below((r - 32) / 2);     // 33 + 2j < r
}

// One weight row against T inputs (xp: the tile's chunks, input-minor as permute_inputs lays them
// out, so every x operand is one pointer plus a constant): out[t] = w · x_t. dec(c, v) decodes
// full chunk c of the row into the register layout of tile.h; dec_tail(v) the ragged last chunk of
// `tail` elements (0: none), whose elements still go to lane i mod 64 by masked FMAs — as dot.h's
// finish() adds a tail — so a k that is not a multiple of 64 keeps the same bits too.
template <int T, class Dec, class DecTail>
inline void run_tile(const Dec& dec, const DecTail& dec_tail, int64_t n_full, int64_t tail, const float* xp, float* out,
                     int64_t out_stride) {
  __m512 acc[T][4];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n_full; ++c) {
    __m512 v[4];
    dec(c, v);
    const float* xc = xp + c * T * kChunk;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[t][j] = _mm512_fmadd_ps(v[j], _mm512_loadu_ps(xc + t * kChunk + 16 * j), acc[t][j]);
  }
  if (tail) {
    __m512 v[4];
    __mmask16 mk[4];
    dec_tail(v);
    tail_masks(tail, mk);
    const float* xc = xp + n_full * T * kChunk;
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < T; ++t)
        acc[t][j] = _mm512_mask3_fmadd_ps(v[j], _mm512_loadu_ps(xc + t * kChunk + 16 * j), acc[t][j], mk[j]);
  }
  for (int t = 0; t < T; ++t) out[t * out_stride] = unpermute_reduce(acc[t]);
}

template <class Dec, class DecTail>
void run_tile_n(int64_t n, const Dec& dec, const DecTail& dec_tail, int64_t n_full, int64_t tail, const float* xp, float* out,
                int64_t out_stride) {
  switch (n) {
    case 1: return run_tile<1>(dec, dec_tail, n_full, tail, xp, out, out_stride);
    case 2: return run_tile<2>(dec, dec_tail, n_full, tail, xp, out, out_stride);
    case 3: return run_tile<3>(dec, dec_tail, n_full, tail, xp, out, out_stride);
    case 4: return run_tile<4>(dec, dec_tail, n_full, tail, xp, out, out_stride);
    case 5: return run_tile<5>(dec, dec_tail, n_full, tail, xp, out, out_stride);
    default: return run_tile<6>(dec, dec_tail, n_full, tail, xp, out, out_stride);
  }
}
static_assert(kTileRows == 6, "run_tile_n dispatches tiles of 1..6 inputs");

// Rows [r_begin, r_end) in sub-blocks small enough to stay in L1 while every input tile passes over
// them: each weight byte comes from memory once per call, whatever m. row(r) gives {dec, dec_tail}.
template <class RowFor>
void rows_loop(const RowFor& row, int64_t row_bytes, int64_t k, const float* xp, int64_t m, int64_t r_begin, int64_t r_end,
               float* y, int64_t y_stride) {
  const int64_t n_full = k / kChunk, tail = k % kChunk, kp = padded_cols(k);
  const int64_t sub = std::max<int64_t>(1, (int64_t(8) << 10) / std::max<int64_t>(1, row_bytes));
  for (int64_t rs = r_begin; rs < r_end; rs += sub) {
    const int64_t re = std::min(r_end, rs + sub);
    for (int64_t t0 = 0; t0 < m; t0 += kTileRows)
      for (int64_t r = rs; r < re; ++r) {
        const auto [dec, dec_tail] = row(r);
        run_tile_n(std::min(kTileRows, m - t0), dec, dec_tail, n_full, tail, xp + t0 * kp, y + t0 * y_stride + r, y_stride);
      }
  }
}

}  // namespace

bool tiled_supported(const Weight& w) {
  if (w.cols < 1) return false;
  // INT4: whole groups of a power-of-two size ≥ 32 (so a row is whole 16-byte halves of chunks).
  if (w.int4) return w.group % 32 == 0 && pow2(w.group) && w.cols % w.group == 0;
  return w.dtype == DType::BF16;
}

void permute_inputs(const float* x, int64_t m, int64_t k, float* xp) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const int64_t kp = padded_cols(k);
  for (int64_t t0 = 0; t0 < m; t0 += kTileRows) {
    const int64_t tn = std::min(kTileRows, m - t0);
    for (int64_t t = 0; t < tn; ++t)
      for (int64_t c = 0; c < kp / kChunk; ++c) {
        const float* s = x + (t0 + t) * k + c * kChunk;
        const int64_t left = k - c * kChunk;  // < 64 only in a ragged last chunk: zeros past k
        float* d = xp + t0 * kp + (c * tn + t) * kChunk;
        const __m512 a = _mm512_maskz_loadu_ps(lanes_below(left), s), b = _mm512_maskz_loadu_ps(lanes_below(left - 16), s + 16);
        const __m512 e = _mm512_maskz_loadu_ps(lanes_below(left - 32), s + 32);
        const __m512 f = _mm512_maskz_loadu_ps(lanes_below(left - 48), s + 48);
        _mm512_storeu_ps(d, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(d + 16, _mm512_permutex2var_ps(a, odd, b));
        _mm512_storeu_ps(d + 32, _mm512_permutex2var_ps(e, even, f));
        _mm512_storeu_ps(d + 48, _mm512_permutex2var_ps(e, odd, f));
      }
  }
}

void tiled_rows(const Weight& w, const float* xp, int64_t m, int64_t r_begin, int64_t r_end, float* y, int64_t y_stride) {
  const int64_t k = w.cols, n_full = k / kChunk, tail = k % kChunk;
  if (!w.int4) {
    const uint16_t* base = static_cast<const uint16_t*>(w.data);
    // A 32-bit lane holds elements 2j (low half) and 2j + 1 (high half): shift / mask to fp32.
    auto widen = [](__m512i a, __m512i b, __m512* v) {
      const __m512i hi = _mm512_set1_epi32(int32_t(0xffff0000u));
      v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
      v[1] = _mm512_castsi512_ps(_mm512_and_si512(a, hi));
      v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
      v[3] = _mm512_castsi512_ps(_mm512_and_si512(b, hi));
    };
    auto row = [&](int64_t r) {
      const uint16_t* p = base + r * k;
      auto dec = [p, widen](int64_t c, __m512* v) {
        widen(_mm512_loadu_si512(p + c * kChunk), _mm512_loadu_si512(p + c * kChunk + 32), v);
      };
      auto dec_tail = [p, widen, n_full, tail](__m512* v) {  // masked loads never touch past the row
        const uint16_t* q = p + n_full * kChunk;
        const __mmask32 m0 = tail >= 32 ? ~__mmask32(0) : (__mmask32(1) << tail) - 1;
        const __mmask32 m1 = tail <= 32 ? __mmask32(0) : (__mmask32(1) << (tail - 32)) - 1;
        widen(_mm512_maskz_loadu_epi16(m0, q), _mm512_maskz_loadu_epi16(m1, q + 32), v);
      };
      return std::pair{dec, dec_tail};
    };
    rows_loop(row, k * 2, k, xp, m, r_begin, r_end, y, y_stride);
    return;
  }
  const int64_t words = w.words_per_row(), groups = k / w.group;
  const int shift = __builtin_ctzll(uint64_t(w.group));
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  // Byte j of a chunk holds elements 2j (low nibble) and 2j + 1 (high nibble); vpermps reads only
  // an index's low 4 bits, so the zero-extended byte indexes the low nibble's table entry directly.
  auto lookup = [](__m512i b0, __m512i b1, float s0, float s1, __m512* v) {
    const __m512 q_minus_8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 t0 = _mm512_mul_ps(q_minus_8, _mm512_set1_ps(s0)), t1 = _mm512_mul_ps(q_minus_8, _mm512_set1_ps(s1));
    v[0] = _mm512_permutexvar_ps(b0, t0);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), t0);
    v[2] = _mm512_permutexvar_ps(b1, t1);
    v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), t1);
  };
  // The row's scales as fp32 (exact: bf16 widening), converted once per row and tile, so a chunk's
  // two tables cost one broadcast-multiply each instead of a scalar load, shift and broadcast.
  thread_local std::vector<float> scales_f32;  // this thread's: rows_loop runs here, row by row
  scales_f32.resize(static_cast<size_t>(groups));
  float* sf = scales_f32.data();
  auto row = [&, sf](int64_t r) {
    const uint8_t* p = base + r * words * 4;
    const uint16_t* sc = w.scales + r * groups;
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16)
      _mm512_storeu_ps(sf + g, _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g))), 16)));
    for (; g < groups; ++g) sf[g] = bf16_to_f32(sc[g]);
    // Elements 0–31 and 32–63 of a chunk lie in one group each (groups are ≥ 32, powers of two).
    auto dec = [p, sf, shift, lookup](int64_t c, __m512* v) {
      lookup(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * 32))),
             _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * 32 + 16))),
             sf[(c * kChunk) >> shift], sf[(c * kChunk + 32) >> shift], v);
    };
    // Whole groups of ≥ 32 leave a tail of 0 or 32 elements: one 16-byte half of a chunk.
    auto dec_tail = [p, sf, shift, lookup, n_full](__m512* v) {
      lookup(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + n_full * 32))), _mm512_setzero_si512(),
             sf[(n_full * kChunk) >> shift], 0.0f, v);
    };
    return std::pair{dec, dec_tail};
  };
  rows_loop(row, words * 4 + groups * 2, k, xp, m, r_begin, r_end, y, y_stride);
}

#else  // portable builds keep linear()'s fused and staged paths

bool tiled_supported(const Weight&) { return false; }
void permute_inputs(const float*, int64_t, int64_t, float*) { fail("permute_inputs: an AVX-512 build only"); }
void tiled_rows(const Weight& w, const float*, int64_t, int64_t, int64_t, float*, int64_t) {
  fail(w.name, ": tiled_rows needs an AVX-512 build");
}

#endif

}  // namespace kd::cpu
