// The integer tensor-core path of cuda::expert_linear for INT4 g32 routed experts (expert_imma.cu,
// the default): parity against fp64 and a plain fp32 loop over dequantised weights at K2's expert
// shapes (flash-attention rule), also with outlier activations; bitwise invariance (a token's outputs
// in a batch == the token alone, whatever else its experts serve and wherever it sits in an expert's
// token passes), the epilogues, odd shapes, non-finite inputs, a missing scratch, and a timing
// printout against the CUDA-core kernel (not asserted). Every test skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "backend/cuda/kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "expert_routing.h"
#include "gpu_test_util.h"

namespace kd {
namespace {

using gpu_test::DevBuf;
using gpu_test::DevRouting;
using gpu_test::normal_x;
using gpu_test::Routing;

using cuda::Epilogue;

// Which kernel family expert_linear runs for INT4 experts (ExpertBatch::path, per call).
using Path = cuda::ExpertPath;
const char* path_name(Path p) { return p == Path::cores ? "CUDA-core" : "IMMA"; }

// E INT4 g32 experts [rows, cols] back to back (words: 8 LSB-first nibbles; bf16 scale per 32).
struct Experts {
  int64_t E, rows, cols;
  std::vector<uint32_t> words;
  std::vector<uint16_t> scales;
  DevBuf dw, ds;
  Experts(int64_t e, int64_t r, int64_t c, std::mt19937& rng)
      : E(e), rows(r), cols(c), words(static_cast<size_t>(e * r * c / 8)), scales(static_cast<size_t>(e * r * c / 32)),
        dw(words.size() * 4), ds(scales.size() * 2) {
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(c)));
    for (auto& v : words) v = uint32_t(rng());
    for (auto& s : scales) s = f32_to_bf16(nd(rng) / 4.0f);
    dw.up(words.data(), words.size() * 4);
    ds.up(scales.data(), scales.size() * 2);
  }
  float weight(int64_t e, int64_t r, int64_t k) const { return gpu_test::int4_weight(words, scales, cols, e * rows + r, k); }
};

// y [n·K, ldy] via cuda::expert_linear on `path`; NaN-poisoned, or y0 (add).
std::vector<float> run(const Experts& ex, const Routing& rt, const float* x, Epilogue ep, Path path, const float* y0 = nullptr) {
  const int64_t ldy = ep == Epilogue::swiglu ? ex.rows / 2 : ex.rows;
  const DevRouting r(rt, ex.E);
  std::vector<float> y(static_cast<size_t>(rt.n * rt.K * ldy), std::nanf(""));
  if (y0 != nullptr) std::copy(y0, y0 + y.size(), y.begin());
  DevBuf dx(size_t(rt.n * ex.cols) * 4), dy(y.size() * 4);
  dx.up(x, size_t(rt.n * ex.cols) * 4);
  dy.up(y.data(), y.size() * 4);
  cuda::ExpertBatch b = r.batch(ex.dw.p, ex.ds.as<uint16_t>(), ex.E, ex.rows, ex.cols);
  b.path = path;
  cuda::expert_linear(b, dx.as<float>(), ex.cols, dy.as<float>(), ldy, ep, nullptr);
  cuda::check(cudaDeviceSynchronize(), "expert_linear");
  cuda::check(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost), "download");
  return y;
}

// Token i: expert 0 always (so it serves every token: several 8-token tiles), plus K − 1 others.
Routing make_routing(int64_t n, int64_t K, int64_t E, std::mt19937& rng) {
  Routing r{n, K, {}};
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> ids;
    for (int32_t e = 1; e < int32_t(E); ++e) ids.push_back(e);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> c = {0};
    for (int64_t k = 1; k < K; ++k) c.push_back(ids[size_t(k - 1)]);
    r.choice.push_back(c);
  }
  return r;
}

// outliers: every 37th activation × 1000 (the block-floating-point digits of the IMMA path round x
// relative to its group's largest value).
void check_experts(Path path, int64_t rows, int64_t cols, uint32_t seed, bool outliers = false) {
  std::mt19937 rng(seed);
  const int64_t E = 4, K = 2, n = 19;  // expert 0 serves 19 tokens: tiles of 8, 8, 3 (pairs: 9 and 1)
  const Experts ex(E, rows, cols, rng);
  const Routing rt = make_routing(n, K, E, rng);
  std::vector<float> x = normal_x(n * cols, rng);
  if (outliers)
    for (size_t j = 0; j < x.size(); j += 37) x[j] *= 1000.0f;

  // (a) parity of the store output against fp64 and the plain fp32 loop.
  const std::vector<float> y = run(ex, rt, x.data(), Epilogue::store, path);
  std::vector<double> ref(y.size());
  std::vector<float> plain(y.size());
  std::vector<float> wrow(static_cast<size_t>(cols));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) wrow[size_t(c)] = ex.weight(e, r, c);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < K; ++k) {
          if (rt.choice[size_t(i)][size_t(k)] != e) continue;
          double d = 0;
          float f = 0;
          for (int64_t c = 0; c < cols; ++c) {
            d += double(wrow[size_t(c)]) * double(x[size_t(i * cols + c)]);
            f += wrow[size_t(c)] * x[size_t(i * cols + c)];
          }
          ref[size_t((i * K + k) * rows + r)] = d;
          plain[size_t((i * K + k) * rows + r)] = f;
        }
    }
  double num = 0, den = 0, nump = 0;
  for (size_t j = 0; j < y.size(); ++j) {
    ASSERT_TRUE(std::isfinite(y[j])) << "unwritten or non-finite output at " << j;
    num += (double(y[j]) - ref[j]) * (double(y[j]) - ref[j]);
    nump += (double(plain[j]) - ref[j]) * (double(plain[j]) - ref[j]);
    den += ref[j] * ref[j];
  }
  const double e_mma = std::sqrt(num / den), e_plain = std::sqrt(nump / den);
  std::printf("%s experts INT4 %lldx%lld, %lld tokens x %lld%s: err %.3g, plain fp32 err %.3g\n", path_name(path),
              (long long)rows, (long long)cols, (long long)n, (long long)K, outliers ? " (outliers)" : "", e_mma, e_plain);
  EXPECT_LE(e_mma, 2 * e_plain) << path_name(path);
  {
    const std::vector<float> y_core = run(ex, rt, x.data(), Epilogue::store, Path::cores);
    EXPECT_NE(0, std::memcmp(y.data(), y_core.data(), y.size() * 4)) << path_name(path) << " path had no effect";
  }

  // (b) + (c): each token alone (one row an expert, the decode shape) == its rows in the batch, for
  // every epilogue; add == y0 + store bit for bit; swiglu == silu(g) · u of store.
  const std::vector<float> y0 = normal_x(n * K * rows, rng);
  for (Epilogue ep : {Epilogue::store, Epilogue::add, Epilogue::swiglu}) {
    const int64_t ldy = ep == Epilogue::swiglu ? rows / 2 : rows;
    const std::vector<float> yb = run(ex, rt, x.data(), ep, path, ep == Epilogue::add ? y0.data() : nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const Routing one{1, K, {rt.choice[size_t(i)]}};
      const std::vector<float> y1 =
          run(ex, one, &x[size_t(i * cols)], ep, path, ep == Epilogue::add ? &y0[size_t(i * K * ldy)] : nullptr);
      ASSERT_EQ(0, std::memcmp(y1.data(), &yb[size_t(i * K * ldy)], size_t(K * ldy) * 4))
          << rows << "x" << cols << " epilogue " << int(ep) << ": token " << i << " alone differs from the batch";
    }
    if (ep == Epilogue::add)
      for (size_t j = 0; j < yb.size(); ++j) {
        const float want = y0[j] + y[j];
        ASSERT_EQ(0, std::memcmp(&yb[j], &want, 4)) << "add epilogue at " << j;
      }
    if (ep == Epilogue::swiglu)
      for (int64_t s = 0; s < n * K; ++s)
        for (int64_t j = 0; j < rows / 2; ++j) {
          const float g = y[size_t(s * rows + 2 * j)], u = y[size_t(s * rows + 2 * j + 1)];
          const float want = g / (1.0f + std::exp(-g)) * u;
          ASSERT_NEAR(yb[size_t(s * ldy + j)], want, 4e-6f * std::fabs(want) + 1e-30f) << "swiglu slot " << s << " j " << j;
        }
  }
}

TEST(CudaImmaExperts, ParityInvarianceEpiloguesK2Shapes) {
  REQUIRE_GPU();
  check_experts(Path::imma, 4096, 7168, 311);
  check_experts(Path::imma, 7168, 2048, 312);
  check_experts(Path::imma, 4096, 7168, 313, true);
}

// 102 rows (partial tiles and blocks), 96 columns (3 groups: an odd group count, scales not in
// 16-byte units), 64 columns × 192 rows (the k2-int4 fixture's gate/up), 2080 columns (a 1024-column
// step, then one of 32 groups, then 1 group).
TEST(CudaImmaExperts, SmallAndOddShapes) {
  REQUIRE_GPU();
  check_experts(Path::imma, 102, 96, 314);
  check_experts(Path::imma, 192, 64, 315);
  check_experts(Path::imma, 40, 2080, 316, true);
}

// Inf or NaN in a token's activations poisons (NaN) that token's outputs and nobody else's.
TEST(CudaImmaExperts, NonFiniteInputs) {
  REQUIRE_GPU();
  std::mt19937 rng(317);
  const int64_t E = 4, K = 2, n = 5, rows = 64, cols = 2048;
  const Experts ex(E, rows, cols, rng);
  const Routing rt = make_routing(n, K, E, rng);
  std::vector<float> x = normal_x(n * cols, rng);
  x[size_t(1 * cols + 700)] = std::numeric_limits<float>::infinity();
  x[size_t(3 * cols + 5)] = std::nanf("");
  const std::vector<float> y = run(ex, rt, x.data(), Epilogue::store, Path::imma);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < K * rows; ++j) {
      const float v = y[size_t(i * K * rows + j)];
      if (i == 1 || i == 3)
        ASSERT_TRUE(std::isnan(v)) << "token " << i << " output " << j << " = " << v;
      else
        ASSERT_TRUE(std::isfinite(v)) << "token " << i << " output " << j << " = " << v;
    }
}

// A batch without digit scratch is a clear error, not a crash.
TEST(CudaImmaExperts, MissingScratchIsAnError) {
  REQUIRE_GPU();
  std::mt19937 rng(318);
  const Experts ex(2, 64, 1024, rng);
  const DevRouting r(make_routing(3, 2, 2, rng), 2);
  cuda::ExpertBatch b = r.batch(ex.dw.p, ex.ds.as<uint16_t>(), 2, 64, 1024);
  b.xq = nullptr;
  b.path = Path::imma;
  DevBuf dx(3 * 1024 * 4), dy(3 * 2 * 64 * 4);
  EXPECT_THROW(cuda::expert_linear(b, dx.as<float>(), 1024, dy.as<float>(), 64, Epilogue::store, nullptr), Error);
}

// Timing printout (not asserted): one gate/up launch over K2's 384 experts (4096 × 7168 INT4 each,
// 5.6 GB), n tokens routed uniformly at random top-8, CUDA events, median of 21 after 3 warm-ups.
TEST(CudaImmaExperts, TimingPrintout) {
  REQUIRE_GPU();
  const int64_t E = 384, rows = 4096, cols = 7168, K = 8;
  const int64_t wbytes = rows * cols / 2, sbytes = rows * (cols / 32) * 2;
  DevBuf dw(size_t(E * wbytes)), ds(size_t(E * sbytes)), dx(size_t(64 * cols) * 4), dy(size_t(64 * K * rows / 2) * 4);
  cuda::fill_words(dw.as<uint32_t>(), E * wbytes / 4, 11, nullptr);
  cuda::fill_bf16(ds.as<uint16_t>(), E * sbytes / 2, 0.01f, 12, nullptr);
  cuda::fill_f32(dx.as<float>(), 64 * cols, -1.0f, 1.0f, 13, nullptr);
  std::mt19937 rng(14);
  std::printf("expert timing: gate/up 4096x7168 INT4 g32, 384 experts, top-8, median of 21:\n");
  std::printf("   n | experts | CUDA-core us  GB/s | IMMA us  GB/s | IMMA/core\n");
  for (int64_t n : {1, 2, 4, 8, 17, 33}) {
    const DevRouting r(gpu_test::random_routing(n, K, E, rng), E);
    cuda::ExpertBatch b = r.batch(dw.p, ds.as<uint16_t>(), E, rows, cols);
    const int32_t n_active = r.n_active;
    const double gb = double(n_active) * double(wbytes + sbytes) / 1e9;
    double t[2];
    for (Path p : {Path::cores, Path::imma}) {
      b.path = p;
      auto once = [&] { cuda::expert_linear(b, dx.as<float>(), cols, dy.as<float>(), rows / 2, Epilogue::swiglu, nullptr); };
      t[p == Path::cores ? 0 : 1] = gpu_test::median_us(once);  // µs
    }
    std::printf("%4lld | %7d | %12.1f %5.0f | %7.1f %5.0f | %.2f\n", (long long)n, n_active, t[0], gb / (t[0] * 1e-6), t[1],
                gb / (t[1] * 1e-6), t[1] / t[0]);
  }
}

}  // namespace
}  // namespace kd
