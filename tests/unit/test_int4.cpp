// INT4 pack-quantized: our packer and unpacker against bytes made by compressed-tensors 0.20.1's
// own pack_to_int32 (tests/fixtures/int4_vectors.safetensors, python/make_fixtures.py), for group
// sizes 32 and 16, and the quantise → pack → unpack round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backend/cpu/ops.h"
#include "core/int4.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace kd {
namespace {

using test::read_tensor;

class Int4Vectors : public ::testing::TestWithParam<std::pair<const char*, int>> {};

TEST_P(Int4Vectors, PackAndUnpackMatchCompressedTensors) {
  const auto [suffix, group] = GetParam();
  SafetensorsFile f(std::string(KDTREE_FIXTURES) + "/int4_vectors.safetensors");
  const std::string s = suffix;
  const auto q = read_tensor<int8_t>(f, "q" + s);
  const auto scale = read_tensor<uint16_t>(f, (s.empty() ? "scale" : "scale" + s));
  const auto packed = read_tensor<uint32_t>(f, s.empty() ? "packed_ct" : "packed" + s);
  const auto dequant = read_tensor<float>(f, "dequant" + s);
  const int64_t N = 48, K = 96;
  ASSERT_EQ(q.size(), size_t(N * K));
  ASSERT_EQ(packed.size(), size_t(N * K / 8));
  std::vector<uint32_t> words(static_cast<size_t>(K / 8));
  for (int64_t r = 0; r < N; ++r) {
    pack_int4_row(&q[size_t(r * K)], K, words.data());
    for (int64_t j = 0; j < K / 8; ++j) ASSERT_EQ(words[size_t(j)], packed[size_t(r * K / 8 + j)]) << "row " << r << " word " << j;
  }
  Weight w;
  w.rows = N;
  w.cols = K;
  w.int4 = true;
  w.group = group;
  w.data = packed.data();
  w.scales = scale.data();
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t r = 0; r < N; ++r) {
    cpu::dequant_row(w, r, row.data());
    for (int64_t c = 0; c < K; ++c) ASSERT_EQ(row[size_t(c)], dequant[size_t(r * K + c)]) << r << "," << c;
  }
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, Int4Vectors,
                         ::testing::Values(std::make_pair("", 32), std::make_pair("_g16", 16)),
                         [](const auto& p) { return "group" + std::to_string(p.param.second); });

TEST(Int4, QuantiserMatchesCompressedTensorsOnTheSameWeights) {
  SafetensorsFile f(std::string(KDTREE_FIXTURES) + "/int4_vectors.safetensors");
  const auto w = read_tensor<float>(f, "weight");
  const auto q_ref = read_tensor<int8_t>(f, "q");
  const auto scale_ref = read_tensor<uint16_t>(f, "scale");
  std::vector<int8_t> q(96);
  std::vector<uint16_t> sc(3);
  for (int64_t r = 0; r < 48; ++r) {
    quantize_int4_row(&w[size_t(r * 96)], 96, 32, q.data(), sc.data());
    for (int g = 0; g < 3; ++g) ASSERT_EQ(sc[size_t(g)], scale_ref[size_t(r * 3 + g)]) << r;
    for (int c = 0; c < 96; ++c) ASSERT_EQ(q[size_t(c)], q_ref[size_t(r * 96 + c)]) << r << "," << c;
  }
}

TEST(Int4, RoundTripErrorIsWithinHalfAStep) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (int64_t cols : {32, 64, 200, 7168}) {  // 200: ragged last word with group 8
    const int32_t group = cols == 200 ? 8 : 32;
    std::vector<float> w(static_cast<size_t>(cols)), back(static_cast<size_t>(cols));
    for (auto& x : w) x = nd(rng);
    w[3] = 0;
    std::vector<int8_t> q(static_cast<size_t>(cols));
    std::vector<uint16_t> sc(static_cast<size_t>(cols / group));
    std::vector<uint32_t> words(static_cast<size_t>((cols + 7) / 8));
    quantize_int4_row(w.data(), cols, group, q.data(), sc.data());
    pack_int4_row(q.data(), cols, words.data());
    Weight wt;
    wt.rows = 1;
    wt.cols = cols;
    wt.int4 = true;
    wt.group = group;
    wt.data = words.data();
    wt.scales = sc.data();
    cpu::dequant_row(wt, 0, back.data());
    for (int64_t c = 0; c < cols; ++c) {
      const float step = bf16_to_f32(sc[size_t(c / group)]);
      // Symmetric absmax/8: the positive extreme clamps to 7·step, one step short of +absmax, and
      // the bf16 rounding of the scale (relative error ≤ 2^-8: 7 stored mantissa bits) can add 8·2^-8 of a step to that.
      const float tol = w[size_t(c)] > 7 * step ? step * (1.0f + 8.0f / 256) : step * 0.5001f;
      ASSERT_LE(std::fabs(back[size_t(c)] - w[size_t(c)]), tol) << "cols " << cols << " c " << c << " w " << w[size_t(c)] << " step " << step << " q " << int(q[size_t(c)]);
    }
  }
}

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// linear() takes a fused path for 1–2 rows and a staged (dequantise, then dot) path for more; both
// must give the same bits for the same row, for every weight encoding (dot.h explains why they can).
TEST(Linear, FusedAndStagedPathsAreBitIdentical) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 37, cols = 256;
  std::vector<float> wf(static_cast<size_t>(rows * cols));
  for (auto& v : wf) v = nd(rng);
  std::vector<uint16_t> wb(wf.size()), wh(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
  for (size_t i = 0; i < wf.size(); ++i) wh[i] = f32_to_bf16(wf[i]);  // reinterpreted below as F16 bits
  std::vector<int8_t> q(static_cast<size_t>(cols));
  std::vector<uint16_t> sc(static_cast<size_t>(rows * cols / 32));
  std::vector<uint32_t> packed(static_cast<size_t>(rows * cols / 8));
  for (int64_t r = 0; r < rows; ++r) {
    quantize_int4_row(&wf[size_t(r * cols)], cols, 32, q.data(), &sc[size_t(r * cols / 32)]);
    pack_int4_row(q.data(), cols, &packed[size_t(r * cols / 8)]);
  }
  std::vector<Weight> ws(4);
  for (auto& w : ws) { w.rows = rows; w.cols = cols; }
  ws[0].dtype = DType::F32; ws[0].data = wf.data();
  ws[1].dtype = DType::BF16; ws[1].data = wb.data();
  ws[2].dtype = DType::F16; ws[2].data = wh.data();
  ws[3].int4 = true; ws[3].data = packed.data(); ws[3].scales = sc.data(); ws[3].group = 32;
  const int64_t m = 9;
  std::vector<float> x(static_cast<size_t>(m * cols));
  for (auto& v : x) v = nd(rng);
  for (const Weight& w : ws) {
    std::vector<float> batch(static_cast<size_t>(m * rows)), one(static_cast<size_t>(rows));
    cpu::linear(w, x.data(), m, batch.data());
    for (int64_t i = 0; i < m; ++i) {
      cpu::linear(w, x.data() + i * cols, 1, one.data());
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(one[size_t(r)], batch[size_t(i * rows + r)]) << "dtype " << int(w.dtype) << " int4 " << w.int4 << " row " << r;
    }
    // And against a double-precision reference, to know the fast path is also right.
    std::vector<float> deq(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      cpu::dequant_row(w, r, deq.data());
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        ref += double(deq[size_t(c)]) * double(x[size_t(c)]);
        mag += std::fabs(double(deq[size_t(c)]) * double(x[size_t(c)]));
      }
      ASSERT_NEAR(batch[size_t(r)], ref, mag * 1e-6) << r;
    }
  }
}

}  // namespace
}  // namespace kd
