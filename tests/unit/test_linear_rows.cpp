// Row invariance of the CPU linear at every batch width a verify can have: random weights (fp32
// normals, then bf16-rounded or INT4-quantised with core/int4.h's quantizer), N = 1..33 input rows,
// each row's output bitwise equal to the same row computed alone (N = 1) and to the single-row dot
// products of dot.h — the property DDTree == AR rests on (DESIGN.md §2). Covers every tile width of
// tile.h (1..6, full and ragged tiles), several widths k, and the row split across threads.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/dot.h"
#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/int4.h"
#include "core/weight.h"

namespace kd {
namespace {

struct Matrix {
  std::vector<float> f32;
  std::vector<uint16_t> bf16, scales;
  std::vector<uint32_t> packed;
  Weight w;
};

Matrix make_matrix(int64_t rows, int64_t cols, bool int4, int32_t group, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Matrix m;
  m.f32.resize(size_t(rows * cols));
  for (auto& v : m.f32) v = nd(rng);
  m.w.rows = rows;
  m.w.cols = cols;
  m.w.name = int4 ? "int4" : "bf16";
  if (int4) {
    std::vector<int8_t> q(static_cast<size_t>(cols));
    m.scales.resize(size_t(rows * cols / group));
    m.packed.resize(size_t(rows * cols / 8));
    for (int64_t r = 0; r < rows; ++r) {
      quantize_int4_row(&m.f32[size_t(r * cols)], cols, group, q.data(), &m.scales[size_t(r * cols / group)]);
      pack_int4_row(q.data(), cols, &m.packed[size_t(r * cols / 8)]);
    }
    m.w.int4 = true;
    m.w.group = group;
    m.w.data = m.packed.data();
    m.w.scales = m.scales.data();
  } else {
    m.bf16.resize(m.f32.size());
    for (size_t i = 0; i < m.f32.size(); ++i) m.bf16[i] = f32_to_bf16(m.f32[i]);
    m.w.dtype = DType::BF16;
    m.w.data = m.bf16.data();
  }
  return m;
}

// dot.h's accumulation order written out in scalar code: element i into lane i mod 64 by fma, in
// order of i, then the halving tree — independent of the vector code it checks.
float lanes_reference(const float* w, const float* x, int64_t n) {
  float acc[64] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % 64] = std::fma(w[i], x[i], acc[i % 64]);
  for (int s = 32; s > 0; s /= 2)
    for (int j = 0; j < s; ++j) acc[j] += acc[j + s];
  return acc[0];
}

// The single-row reference of dot.h for (row r, input x).
float reference_dot(const Matrix& m, int64_t r, const float* x) {
  const Weight& w = m.w;
  if (!w.int4) return cpu::dot_bf16(m.bf16.data() + r * w.cols, x, w.cols);
  if (cpu::dot_int4_supported(w.cols, w.group))
    return cpu::dot_int4(m.packed.data() + r * w.words_per_row(), m.scales.data() + r * (w.cols / w.group), w.group, x, w.cols);
  std::vector<float> deq(size_t(w.cols));
  cpu::dequant_row(w, r, deq.data());
  return cpu::dot_f32(deq.data(), x, w.cols);
}

void check_every_batch_width(const Matrix& m, uint32_t seed) {
  const Weight& w = m.w;
  constexpr int64_t kMaxRows = 33;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(kMaxRows * w.cols));
  for (auto& v : x) v = nd(rng);
  // Each input alone: the N = 1 call, which must also equal dot.h's single-row products.
  std::vector<float> alone(size_t(kMaxRows * w.rows)), one(size_t(w.rows));
  for (int64_t i = 0; i < kMaxRows; ++i) {
    cpu::linear(w, x.data() + i * w.cols, 1, one.data());
    for (int64_t r = 0; r < w.rows; ++r) {
      alone[size_t(i * w.rows + r)] = one[size_t(r)];
      ASSERT_EQ(std::bit_cast<uint32_t>(one[size_t(r)]), std::bit_cast<uint32_t>(reference_dot(m, r, x.data() + i * w.cols)))
          << w.name << " k " << w.cols << " input " << i << " row " << r << ": N = 1 differs from dot.h";
      std::vector<float> deq(size_t(w.cols));
      cpu::dequant_row(w, r, deq.data());
      ASSERT_EQ(std::bit_cast<uint32_t>(one[size_t(r)]), std::bit_cast<uint32_t>(lanes_reference(deq.data(), x.data() + i * w.cols, w.cols)))
          << w.name << " k " << w.cols << " input " << i << " row " << r << ": N = 1 differs from the scalar lane order";
    }
  }
  for (int64_t n = 1; n <= kMaxRows; ++n) {
    std::vector<float> y(size_t(n * w.rows));
    cpu::linear(w, x.data(), n, y.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < w.rows; ++r)
        ASSERT_EQ(std::bit_cast<uint32_t>(y[size_t(i * w.rows + r)]), std::bit_cast<uint32_t>(alone[size_t(i * w.rows + r)]))
            << w.name << " k " << w.cols << ": input " << i << " of N = " << n << ", output " << r << " differs from the input alone";
  }
  // And close to a double-precision dot of the dequantised row (the fast path is also right).
  std::vector<float> deq(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    cpu::dequant_row(w, r, deq.data());
    double ref = 0, mag = 0;
    for (int64_t c = 0; c < w.cols; ++c) {
      ref += double(deq[size_t(c)]) * double(x[size_t(c)]);
      mag += std::fabs(double(deq[size_t(c)]) * double(x[size_t(c)]));
    }
    ASSERT_NEAR(alone[size_t(r)], ref, mag * 1e-6) << w.name << " row " << r;
  }
}

TEST(LinearRows, Bf16RowsBitIdenticalAloneOrAmong33) {
  // Ragged widths (a last chunk of 1..63 elements, or only a tail) as well as whole chunks.
  for (int64_t k : {64, 256, 1088, 1, 16, 33, 100, 192 + 47})
    check_every_batch_width(make_matrix(37, k, false, 32, uint32_t(100 + k)), 7);
}

TEST(LinearRows, Int4Group32RowsBitIdenticalAloneOrAmong33) {
  for (int64_t k : {64, 256, 1088, 32, 96, 160}) check_every_batch_width(make_matrix(37, k, true, 32, uint32_t(200 + k)), 8);
}

TEST(LinearRows, ShortF32DotsFollowTheLaneOrder) {
  // dot_f32's tail (masked FMAs into the lanes) against the scalar order, for every length < 200.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(200), x(200);
  for (auto& v : w) v = nd(rng);
  for (auto& v : x) v = nd(rng);
  for (int64_t n = 1; n < 200; ++n)
    ASSERT_EQ(std::bit_cast<uint32_t>(cpu::dot_f32(w.data(), x.data(), n)), std::bit_cast<uint32_t>(lanes_reference(w.data(), x.data(), n)))
        << "n " << n;
}

TEST(LinearRows, ManyShortDotsAtOnceEqualDotF32BitForBit) {
  // dot_f32_rows (attention scores: 16 rows' halving trees at once) against dot_f32 and the scalar
  // lane order, for the head sizes and around them, counts that leave a ragged last group, rows
  // anywhere in memory (pointers, not a stride), and values whose sums depend on the order: ±0
  // (a −0 product plus +0 is +0), huge and tiny magnitudes, infinities.
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 15);
  const float special[] = {0.0f, -0.0f, 1e30f, -1e30f, 1e-30f, 3e38f, -3e38f, INFINITY};
  for (int64_t n : {1, 16, 31, 32, 33, 63, 64, 65, 96, 128, 130}) {
    for (int64_t count : {1, 5, 15, 16, 17, 40}) {
      std::vector<float> x(static_cast<size_t>(n)), data(static_cast<size_t>(count * (n + 3)));
      for (auto& v : x) v = pick(rng) == 0 ? special[pick(rng) % 8] : nd(rng);
      for (auto& v : data) v = pick(rng) == 0 ? special[pick(rng) % 8] : nd(rng) * (pick(rng) == 1 ? 1e6f : 1.0f);
      std::vector<const float*> rows;
      for (int64_t j = 0; j < count; ++j) rows.push_back(&data[size_t(((j * 7) % count) * (n + 3) + (j % 3))]);
      std::vector<float> out(size_t(count), -1.0f);
      cpu::dot_f32_rows(x.data(), rows.data(), count, n, out.data());
      for (int64_t j = 0; j < count; ++j) {
        const float want = cpu::dot_f32(x.data(), rows[size_t(j)], n);
        ASSERT_EQ(std::bit_cast<uint32_t>(out[size_t(j)]), std::bit_cast<uint32_t>(want)) << "n " << n << " count " << count << " row " << j;
        const float ref = lanes_reference(x.data(), rows[size_t(j)], n);
        if (!std::isnan(ref)) {
          ASSERT_EQ(std::bit_cast<uint32_t>(out[size_t(j)]), std::bit_cast<uint32_t>(ref)) << "n " << n;
        }
      }
    }
  }
}

TEST(LinearRows, Int4OtherGroupsBitIdenticalAloneOrAmong33) {
  // 64 and 128 take the tiled path too; 16 and 96 (not a power of two) the fused/staged ones.
  for (int32_t g : {16, 64, 96, 128}) check_every_batch_width(make_matrix(19, 384, true, g, uint32_t(300 + g)), 9);
}

TEST(LinearRows, ManyOutputRowsSplitAcrossThreads) {
  // Enough rows and width that linear() splits the rows over the pool and sub-blocks them.
  check_every_batch_width(make_matrix(300, 512, true, 32, 41), 10);
  check_every_batch_width(make_matrix(300, 512, false, 32, 42), 11);
}

}  // namespace
}  // namespace kd
