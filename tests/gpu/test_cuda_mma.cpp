// The tensor-core path of cuda::linear (mma.cu; bf16 weights, fp32 x split into three bf16 parts):
// op parity against fp64 and a plain fp32 loop at K2's shapes (the flash-attention rule, DESIGN.md
// §2), bitwise row invariance (every row of a batch == the same row alone, M = 1, for every token
// tile variant and epilogue), the epilogues against the store output, a timing printout of the
// MMA path against the CUDA-core path (not asserted), and a sweep over the MMA tiles of kernel_config.h
// (parity and invariance asserted for each, timings printed). The path and the tile travel in each
// call's cuda::LinearConfig. Every test skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "backend/cuda/kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gpu_test_util.h"


namespace kd {
namespace {

using gpu_test::DevBuf;
using gpu_test::normal_x;

using cuda::Epilogue;

// Every bf16 matrix on the tensor cores (tile by shape, or `tile` forced), or none (the CUDA-core GEMV).
cuda::LinearConfig mma_path(int tile = -1) {
  cuda::LinearConfig c;
  c.mma_min_rows = 0;
  c.mma_tile = tile;
  return c;
}
cuda::LinearConfig core_path() {
  cuda::LinearConfig c;
  c.mma_min_rows = cuda::kNoMma;
  return c;
}

// A bf16 matrix [rows, cols] on the host and the device; N(0, 1/cols) entries.
struct Matrix {
  int64_t rows, cols;
  std::vector<uint16_t> w;
  DevBuf dw;
  Matrix(int64_t r, int64_t c, std::mt19937& rng) : rows(r), cols(c), w(static_cast<size_t>(r * c)), dw(size_t(r * c) * 2) {
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(c)));
    for (auto& v : w) v = f32_to_bf16(nd(rng));
    dw.up(w.data(), w.size() * 2);
  }
  cuda::DevMatrix dev() const {
    cuda::DevMatrix d;
    d.rows = rows;
    d.cols = cols;
    d.w = dw.p;
    return d;
  }
};

int64_t out_cols(const Matrix& a, Epilogue ep) { return ep == Epilogue::swiglu ? a.rows / 2 : a.rows; }

// y [M, out_cols] = epilogue(x [M, cols] · wᵀ) through cuda::linear with cfg; y starts as y0 (add)
// or NaN (every output must be written).
std::vector<float> run(const Matrix& a, const float* x, int64_t M, Epilogue ep, const cuda::LinearConfig& cfg,
                       const float* y0 = nullptr) {
  const int64_t ldy = out_cols(a, ep);
  std::vector<float> y(static_cast<size_t>(M * ldy), std::nanf(""));
  if (y0 != nullptr) std::copy(y0, y0 + M * ldy, y.begin());
  DevBuf dx(size_t(M * a.cols) * 4), dy(y.size() * 4);
  dx.up(x, size_t(M * a.cols) * 4);
  dy.up(y.data(), y.size() * 4);
  cuda::linear(a.dev(), static_cast<const float*>(dx.p), a.cols, M, static_cast<float*>(dy.p), ldy, ep, nullptr, cfg);
  cuda::check(cudaDeviceSynchronize(), "linear");
  cuda::check(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost), "download");
  return y;
}

// fp64 reference and the plain fp32 implementation (one running fp32 sum per output, k ascending).
void references(const Matrix& a, const std::vector<float>& x, int64_t M, std::vector<double>& ref, std::vector<float>& plain) {
  ref.assign(static_cast<size_t>(M * a.rows), 0.0);
  plain.assign(static_cast<size_t>(M * a.rows), 0.0f);
  std::vector<float> row(static_cast<size_t>(a.cols));
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t k = 0; k < a.cols; ++k) row[size_t(k)] = bf16_to_f32(a.w[size_t(r * a.cols + k)]);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = &x[size_t(m * a.cols)];
      double d = 0;
      float f = 0;
      for (int64_t k = 0; k < a.cols; ++k) {
        d += double(row[size_t(k)]) * double(xm[k]);
        f += row[size_t(k)] * xm[k];
      }
      ref[size_t(m * a.rows + r)] = d;
      plain[size_t(m * a.rows + r)] = f;
    }
  }
}

// ‖a − ref‖ / ‖ref‖ over the first n values.
template <class T>
double rel_err(const std::vector<T>& a, const std::vector<double>& ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// (a) Parity: the MMA path's error against fp64 is at most 2× the plain fp32 loop's, for every M.
// cfg: the MMA path as production takes it (the default), or forced for every height.
void check_parity(int64_t rows, int64_t cols, uint32_t seed, const cuda::LinearConfig& cfg = {}) {
  std::mt19937 rng(seed);
  const Matrix a(rows, cols, rng);
  ASSERT_TRUE(cuda::mma_eligible(a.dev(), cfg)) << rows << "x" << cols << " should take the MMA path (KDTREE_CUDA_MMA_MIN_ROWS?)";
  const int64_t Mmax = 33;
  const std::vector<float> x = normal_x(Mmax * cols, rng);
  std::vector<double> ref;
  std::vector<float> plain;
  references(a, x, Mmax, ref, plain);
  for (int64_t M : {1, 2, 5, 9, 17, 33}) {
    const std::vector<float> y = run(a, x.data(), M, Epilogue::store, cfg);
    for (float v : y) ASSERT_TRUE(std::isfinite(v)) << "unwritten or non-finite output at M = " << M;
    const size_t n = size_t(M * rows);
    const double e_mma = rel_err(y, ref, n), e_plain = rel_err(plain, ref, n);
    std::printf("mma linear %lldx%lld M=%lld: MMA err %.3g, plain fp32 err %.3g\n", (long long)rows, (long long)cols,
                (long long)M, e_mma, e_plain);
    EXPECT_LE(e_mma, 2 * e_plain) << rows << "x" << cols << " M = " << M;
  }
  // The path really ran: its bits differ from the CUDA-core kernel's somewhere (other reduction order).
  const std::vector<float> y_mma = run(a, x.data(), Mmax, Epilogue::store, cfg);
  const std::vector<float> y_core = run(a, x.data(), Mmax, Epilogue::store, core_path());
  EXPECT_NE(0, std::memcmp(y_mma.data(), y_core.data(), y_mma.size() * 4)) << "MMA path had no effect";
}

TEST(CudaMma, ParityK2Shapes) {
  REQUIRE_GPU();
  check_parity(7168, 2048, 101);  // shared expert down (4 warps split K)
  check_parity(2048, 7168, 102);  // 2048 rows × hidden (8 warps split K)
  check_parity(7168, 1536, 103);  // q_b-like: K = q_lora
}

TEST(CudaMma, ParityRaggedShape) {
  REQUIRE_GPU();
  check_parity(1030, 1000, 104);  // a partial 16-row tile; K not a multiple of 32
}

// (b) + (c): every row of a batch == the row alone, bit for bit, for each epilogue and token tile
// variant (8 / 16 / 24 / 32 rows, several tiles); add == y0 + store; swiglu == silu(g) · u of store.
void check_invariance(int64_t rows, int64_t cols, uint32_t seed, const cuda::LinearConfig& cfg = {}) {
  std::mt19937 rng(seed);
  const Matrix a(rows, cols, rng);
  ASSERT_TRUE(cuda::mma_eligible(a.dev(), cfg)) << rows << "x" << cols << " should take the MMA path";
  const int64_t Mmax = 70;
  const std::vector<float> x = normal_x(Mmax * cols, rng);
  const std::vector<float> y0 = normal_x(Mmax * rows, rng);  // residual for the add epilogue
  for (Epilogue ep : {Epilogue::store, Epilogue::add, Epilogue::swiglu}) {
    const int64_t ldy = out_cols(a, ep);
    std::vector<float> alone(static_cast<size_t>(Mmax * ldy));
    for (int64_t m = 0; m < Mmax; ++m) {
      const std::vector<float> y1 = run(a, &x[size_t(m * cols)], 1, ep, cfg, ep == Epilogue::add ? &y0[size_t(m * ldy)] : nullptr);
      std::copy(y1.begin(), y1.end(), alone.begin() + m * ldy);
    }
    for (float v : alone) ASSERT_TRUE(std::isfinite(v));
    for (int64_t M : {2, 8, 9, 16, 17, 24, 33, 70}) {
      const std::vector<float> y = run(a, x.data(), M, ep, cfg, ep == Epilogue::add ? y0.data() : nullptr);
      for (int64_t m = 0; m < M; ++m)
        ASSERT_EQ(0, std::memcmp(&y[size_t(m * ldy)], &alone[size_t(m * ldy)], size_t(ldy) * 4))
            << rows << "x" << cols << " epilogue " << int(ep) << ": row " << m << " of M = " << M << " differs from M = 1";
    }
  }
  // The epilogues against the store output of the same rows.
  const int64_t M = 17;
  const std::vector<float> st = run(a, x.data(), M, Epilogue::store, cfg);
  const std::vector<float> ad = run(a, x.data(), M, Epilogue::add, cfg, y0.data());
  for (size_t i = 0; i < st.size(); ++i) {
    const float want = y0[i] + st[i];  // one IEEE fp32 add, as the kernel's __fadd_rn
    ASSERT_EQ(0, std::memcmp(&ad[i], &want, 4)) << "add epilogue at " << i;
  }
  const std::vector<float> sw = run(a, x.data(), M, Epilogue::swiglu, cfg);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < rows / 2; ++j) {
      const float g = st[size_t(m * rows + 2 * j)], u = st[size_t(m * rows + 2 * j + 1)];
      const float want = g / (1.0f + std::exp(-g)) * u;
      ASSERT_NEAR(sw[size_t(m * (rows / 2) + j)], want, 4e-6f * std::fabs(want) + 1e-30f) << "swiglu row " << m << " j " << j;
    }
}

TEST(CudaMma, RowInvarianceAndEpilogues) {
  REQUIRE_GPU();
  check_invariance(4096, 7168, 201);  // 4 warps split K, 32-row blocks for wide token tiles
  check_invariance(1536, 7168, 202);  // q_a: 8 warps split K
  check_invariance(1030, 1000, 203);  // ragged rows and K
}

// Narrow matrices stay on CUDA cores in production (kMmaMinRows); forced through the MMA path
// (LinearConfig::mma_min_rows = 0, as KDTREE_CUDA_MMA_MIN_ROWS=0 does for whole forwards) they keep
// its parity and invariance.
TEST(CudaMma, NarrowShapesWhenEnabled) {
  REQUIRE_GPU();
  check_parity(13, 40, 105, mma_path());
  check_parity(576, 7168, 106, mma_path());  // kv_a
  check_invariance(13, 40, 204, mma_path());
  check_invariance(384, 7168, 205, mma_path());  // router
}

// Operands of a timed call on the device: a bf16 matrix [rows, cols] (fill_bf16, scale 1/√cols), x of
// m_max rows (uniform in [−1, 1]) and y of m_max rows; median_us times one cuda::linear of M rows.
struct TimedShape {
  cuda::DevMatrix d;
  DevBuf w, x, y;
  TimedShape(int64_t rows, int64_t cols, int64_t m_max)
      : w(size_t(rows * cols) * 2), x(size_t(m_max * cols) * 4), y(size_t(m_max * rows) * 4) {
    cuda::fill_bf16(w.as<uint16_t>(), rows * cols, 1.0f / std::sqrt(float(cols)), 7, nullptr);
    cuda::fill_f32(x.as<float>(), m_max * cols, -1.0f, 1.0f, 8, nullptr);
    d.rows = rows;
    d.cols = cols;
    d.w = w.p;
  }
  double median_us(int64_t M, const cuda::LinearConfig& cfg, int warm = 3, int reps = 21) {
    auto once = [&] { cuda::linear(d, x.as<float>(), d.cols, M, y.as<float>(), d.rows, Epilogue::store, nullptr, cfg); };
    return gpu_test::median_us(once, warm, reps);
  }
};

// Timing printout (not asserted): one call, CUDA events, median of 21 after 3 warm-ups, MMA path vs
// the CUDA-core path. Weights ≥ 4× L2 for the tall matrix (each call streams them from HBM).
TEST(CudaMma, TimingPrintout) {
  REQUIRE_GPU();
  struct Shape {
    int64_t rows, cols;
  };
  for (const Shape sh : {Shape{16384, 7168}, Shape{7168, 8192}, Shape{1536, 7168}}) {
    TimedShape ts(sh.rows, sh.cols, 64);
    const double gb = double(sh.rows * sh.cols) * 2 / 1e9;
    std::printf("mma timing %lldx%lld bf16 (%.0f MB), median of 21:\n", (long long)sh.rows, (long long)sh.cols, gb * 1e3);
    std::printf("   M | CUDA-core us  GB/s | MMA us  GB/s | MMA/core\n");
    for (int64_t M : {1, 2, 4, 8, 17, 33}) {
      double t[2];
      for (int p = 0; p < 2; ++p) t[p] = ts.median_us(M, p == 1 ? mma_path() : core_path());  // µs
      std::printf("%4lld | %12.1f %5.0f | %6.1f %5.0f | %.2f\n", (long long)M, t[0], gb / (t[0] * 1e-6), t[1],
                  gb / (t[1] * 1e-6), t[1] / t[0]);
    }
  }
}

// Median time (µs) of one cuda::linear call over 21 after 3 warm-ups, CUDA events; call i reads
// weight copy i % copies.size() (copies > 3× L2 together, so every call streams from HBM).
double median_linear_us(const std::vector<cuda::DevMatrix>& copies, const float* x, int64_t M, float* y,
                        const cuda::LinearConfig& cfg) {
  size_t i = 0;
  auto once = [&] {
    const cuda::DevMatrix& d = copies[i++ % copies.size()];
    cuda::linear(d, x, d.cols, M, y, d.rows, Epilogue::store, nullptr, cfg);
  };
  return gpu_test::median_us(once);
}

// Every MMA tile of kernel_config.h (LinearConfig::mma_tile): asserted — parity against fp64 (≤ 2×
// the plain fp32 loop's error) at 7168x2048 and 1536x7168, M = 17, and every row of M = 5 / 9 / 17 /
// 33 / 64 / 70 bit-equal to the row alone (M = 1) for a tall (7168x2048) and a short (1536x7168)
// matrix, i.e. both K-split rules and every token tile; the shape rule (mma_tile = −1) writes the
// bits of the tile it names for each shape; printed — µs and GB/s of weight bytes (median of 21) for
// M = 1, 2, 4, 8, 17, 33, 64 at seven shapes, with the CUDA-core path as the first row. (The retired
// tiles' last figures: docs/perf.md, "Retired kernels (issue 13)".)
TEST(CudaMma, ConfigSweep) {
  REQUIRE_GPU();
  std::mt19937 rng(301);
  const Matrix tall(7168, 2048, rng), shrt(1536, 7168, rng);
  const int64_t Mmax = 70;
  const std::vector<float> xt = normal_x(Mmax * tall.cols, rng), xs = normal_x(Mmax * shrt.cols, rng);
  std::vector<double> ref, ref_s;
  std::vector<float> plain, plain_s;
  references(tall, xt, 17, ref, plain);
  references(shrt, xs, 17, ref_s, plain_s);
  const double e_plain = rel_err(plain, ref, plain.size()), e_plain_s = rel_err(plain_s, ref_s, plain_s.size());
  const int n_cfg = cuda::kMmaTileCount;
  std::printf("mma tiles: err/plain-fp32-err vs fp64 at M=17, 7168x2048 (plain %.3g) & 1536x7168 (plain %.3g); "
              "row invariance (inv):\n", e_plain, e_plain_s);
  for (int c = 0; c < n_cfg; ++c) {
    const cuda::LinearConfig cfg = mma_path(c);
    const char* name = cuda::kMmaTiles[c].name;
    const std::vector<float> y17 = run(tall, xt.data(), 17, Epilogue::store, cfg), y17s = run(shrt, xs.data(), 17, Epilogue::store, cfg);
    bool finite = true;
    for (float v : y17) finite = finite && std::isfinite(v);
    for (float v : y17s) finite = finite && std::isfinite(v);
    const double r = rel_err(y17, ref, y17.size()) / e_plain, rs = rel_err(y17s, ref_s, y17s.size()) / e_plain_s;
    int bad = 0;  // rows of a batch differing from the row alone, over both matrices and all M
    for (const Matrix* a : {&tall, &shrt}) {
      const std::vector<float>& x = a == &tall ? xt : xs;
      std::vector<float> alone(static_cast<size_t>(Mmax * a->rows));
      for (int64_t m = 0; m < Mmax; ++m) {
        const std::vector<float> y1 = run(*a, &x[size_t(m * a->cols)], 1, Epilogue::store, cfg);
        std::copy(y1.begin(), y1.end(), alone.begin() + m * a->rows);
      }
      for (int64_t M : {5, 9, 17, 33, 64, 70}) {
        const std::vector<float> y = run(*a, x.data(), M, Epilogue::store, cfg);
        for (int64_t m = 0; m < M; ++m)
          bad += std::memcmp(&y[size_t(m * a->rows)], &alone[size_t(m * a->rows)], size_t(a->rows) * 4) != 0;
      }
    }
    // The shape rule: the tall matrix (≥ kMmaTallRows) runs kMmaTallTile, the short one kMmaShortTile;
    // a tile with the rule tile's reduction order (K split, k32 runs) must write its bits too — the
    // pipeline depth, rows a warp and occupancy only choose who computes what, and when.
    auto same_order = [](const cuda::MmaTile& a, const cuda::MmaTile& b) {
      return a.KST == b.KST && a.KSS == b.KSS && a.KC == b.KC && (!a.KC || a.U1 == b.U1);
    };
    int differ = 0;
    for (const Matrix* a : {&tall, &shrt}) {
      if (!same_order(cuda::kMmaTiles[c], cuda::kMmaTiles[a->rows >= cuda::kMmaTallRows ? cuda::kMmaTallTile : cuda::kMmaShortTile]))
        continue;
      const std::vector<float>& x = a == &tall ? xt : xs;
      const std::vector<float> y = run(*a, x.data(), Mmax, Epilogue::store, cfg);
      const std::vector<float> y_rule = run(*a, x.data(), Mmax, Epilogue::store, mma_path());
      differ += std::memcmp(y.data(), y_rule.data(), y.size() * 4) != 0;
    }
    std::printf("  %2d %-8s %.2f %.2f %-4s inv %-4s%s\n", c, name, r, rs, finite && r <= 2 && rs <= 2 ? "ok" : "FAIL",
                bad == 0 ? "ok" : "FAIL", differ ? " RULEBITS-FAIL" : "");
    EXPECT_EQ(0, differ) << "tile " << c << " (" << name << "): the shape rule writes other bits than the tile it names";
    EXPECT_TRUE(finite) << "tile " << c << ": unwritten or non-finite output";
    EXPECT_LE(r, 2.0) << "tile " << c << " (" << name << ") 7168x2048";
    EXPECT_LE(rs, 2.0) << "tile " << c << " (" << name << ") 1536x7168";
    EXPECT_EQ(0, bad) << "tile " << c << " (" << name << "): rows differ from M = 1";
  }

  int dev = 0;
  cudaDeviceProp prop{};
  cuda::check(cudaGetDevice(&dev), "device");
  cuda::check(cudaGetDeviceProperties(&prop, dev), "properties");
  struct Shape {
    int64_t rows, cols;
  };
  const int64_t Ms[] = {1, 2, 4, 8, 17, 33, 64};
  // Timed: the CUDA-core path and every configuration (the sweep's wall time stays around a
  // minute), at each K2 shape the forward runs through linear(): lm_head-like, o_proj, q_a,
  // 2048-row, shared expert gate+up (4096×7168), q_b (12288×1536), shared expert down (7168×2048).
  for (const Shape sh : {Shape{16384, 7168}, Shape{7168, 8192}, Shape{1536, 7168}, Shape{2048, 7168}, Shape{4096, 7168},
                         Shape{12288, 1536}, Shape{7168, 2048}}) {
    const size_t bytes = size_t(sh.rows * sh.cols) * 2;
    const size_t n_copies = std::max<size_t>(1, (3 * size_t(prop.l2CacheSize) + bytes - 1) / bytes);
    std::vector<std::unique_ptr<DevBuf>> bufs;
    std::vector<cuda::DevMatrix> copies;
    for (size_t i = 0; i < n_copies; ++i) {
      bufs.push_back(std::make_unique<DevBuf>(bytes));
      cuda::fill_bf16(static_cast<uint16_t*>(bufs.back()->p), sh.rows * sh.cols, 1.0f / std::sqrt(float(sh.cols)), 7 + i, nullptr);
      cuda::DevMatrix d;
      d.rows = sh.rows;
      d.cols = sh.cols;
      d.w = bufs.back()->p;
      copies.push_back(d);
    }
    DevBuf dx(size_t(64 * sh.cols) * 4), dy(size_t(64 * sh.rows) * 4);
    cuda::fill_f32(static_cast<float*>(dx.p), 64 * sh.cols, -1.0f, 1.0f, 8, nullptr);
    cuda::check(cudaDeviceSynchronize(), "fill");
    const double gb = double(bytes) / 1e9;
    std::printf("%lldx%lld bf16 %.0f MB x%zu copies | us/GBps at M = 1 2 4 8 17 33 64\n", (long long)sh.rows,
                (long long)sh.cols, gb * 1e3, n_copies);
    for (int c = -1; c < n_cfg; ++c) {
      const cuda::LinearConfig cfg = c >= 0 ? mma_path(c) : core_path();
      std::printf("  %2d %-8s", c, c >= 0 ? cuda::kMmaTiles[c].name : "core");
      for (int64_t M : Ms) {
        const double us = median_linear_us(copies, static_cast<const float*>(dx.p), M, static_cast<float*>(dy.p), cfg);
        std::printf(" %6.1f/%4.0f", us, gb / (us * 1e-6));
      }
      std::printf("\n");
    }
  }
}

// The staged prefill GEMM (mma.cu, "Prefill GEMM") writes the tile kernel's bits: for the rule's tile
// and every tile forced, both block counts, every epilogue, at a tall and a short matrix (both K-split
// rules), a ragged one (partial 128-row block, K not a multiple of 32) and one whose K leaves most
// K-slices empty (K = 40: 2 k32 blocks for 4–16 slices), for M = 1, 63, 64, 130 (partial 64-token
// blocks). Every output written (y starts as NaN); the configurations do pick the kernels compared
// (mma_gemm_blocks_for); and the GEMM's error against fp64 stays within twice the plain fp32 loop's
// (check_parity, the independent reference).
TEST(CudaMma, PrefillGemmBits) {
  REQUIRE_GPU();
  {
    cuda::LinearConfig gemm = mma_path();
    gemm.mma_gemm_min_m = 0;
    check_parity(7168, 2048, 402, gemm);
    check_parity(1030, 1000, 403, gemm);
  }
  std::mt19937 rng(401);
  struct Shape {
    int64_t rows, cols;
  };
  for (const Shape sh : {Shape{7168, 2048}, Shape{4096, 1024}, Shape{1536, 7168}, Shape{1030, 1000}, Shape{200, 40}}) {
    const Matrix a(sh.rows, sh.cols, rng);
    const int64_t Mmax = 130;
    const std::vector<float> x = normal_x(Mmax * sh.cols, rng), y0 = normal_x(Mmax * sh.rows, rng);
    for (int tile = -1; tile < cuda::kMmaTileCount; ++tile) {
      cuda::LinearConfig tiles = mma_path(tile);
      tiles.mma_gemm_min_m = cuda::kNoMma;
      for (int blocks : {1, 2}) {
        cuda::LinearConfig gemm = mma_path(tile);
        gemm.mma_gemm_min_m = 0;
        gemm.mma_gemm_blocks = blocks;
        ASSERT_EQ(blocks, cuda::mma_gemm_blocks_for(1, gemm));
        ASSERT_EQ(0, cuda::mma_gemm_blocks_for(Mmax, tiles));
        for (Epilogue ep : {Epilogue::store, Epilogue::add, Epilogue::swiglu})
          for (int64_t M : {1, 63, 64, 130}) {
            const float* init = ep == Epilogue::add ? y0.data() : nullptr;
            const std::vector<float> want = run(a, x.data(), M, ep, tiles, init), got = run(a, x.data(), M, ep, gemm, init);
            for (float v : got) ASSERT_FALSE(std::isnan(v)) << "unwritten output";
            ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4))
                << sh.rows << "x" << sh.cols << " tile " << tile << " blocks " << blocks << " epilogue " << int(ep) << " M = " << M;
          }
      }
    }
  }
}

// Timing printout (not asserted): the tile kernel against the prefill GEMM (2 and 1 blocks an SM) at
// K2's MMA shapes for prompt-sized M; µs (median of 5 after 1 warm-up), TFLOP/s counting the three
// MMAs a k16 step runs (2 · rows · cols · M · 3) and % of the mma.sync rate measured in the same run.
TEST(CudaMma, PrefillGemmTiming) {
  REQUIRE_GPU();
  const double peak = cuda::measure_mma_tflops(5);
  std::printf("prefill GEMM timing; mma.sync bf16 ceiling %.0f TFLOP/s (same run)\n", peak);
  struct Shape {
    const char* name;
    int64_t rows, cols;
  };
  const int64_t Ms[] = {64, 128, 256, 1024, 4096};
  for (const Shape sh : {Shape{"q_a", 1536, 7168}, Shape{"q_b", 12288, 1536}, Shape{"o_proj", 7168, 8192},
                         Shape{"shared gate/up", 4096, 7168}, Shape{"shared down", 7168, 2048}, Shape{"dense gate/up", 36864, 7168},
                         Shape{"dense down", 7168, 18432}}) {
    TimedShape ts(sh.rows, sh.cols, 4096);
    std::printf("%s %lldx%lld | us TFLOP/s %%peak at M = 64 128 256 1024 4096\n", sh.name, (long long)sh.rows, (long long)sh.cols);
    for (int path = 0; path < 3; ++path) {
      cuda::LinearConfig cfg;
      cfg.mma_gemm_min_m = path == 0 ? cuda::kNoMma : 0;
      cfg.mma_gemm_blocks = path == 0 ? 0 : path;  // 1: 1 block an SM, 2: 2
      std::printf("  %-9s", path == 0 ? "tiles" : path == 1 ? "gemm/1" : "gemm/2");
      for (int64_t M : Ms) {
        const double us = ts.median_us(M, cfg, 1, 5), tf = 6.0 * double(sh.rows * sh.cols) * double(M) / (us * 1e-6) / 1e12;
        std::printf(" %8.1f %4.0f %3.0f%%", us, tf, 100 * tf / peak);
      }
      std::printf("\n");
    }
  }
}

// A bad choice is a clear error before any launch (no GPU needed).
TEST(CudaMma, BadConfigIsAnError) {
  cuda::DevMatrix d;
  d.rows = 16;
  d.cols = 16;
  cuda::LinearConfig bad = mma_path(cuda::kMmaTileCount);
  EXPECT_THROW(cuda::linear(d, nullptr, 16, 1, nullptr, 16, Epilogue::store, nullptr, bad), Error);
  bad.mma_tile = -2;
  EXPECT_THROW(cuda::linear(d, nullptr, 16, 1, nullptr, 16, Epilogue::store, nullptr, bad), Error);
  bad = mma_path();
  bad.mma_min_rows = -1;
  EXPECT_THROW(cuda::linear(d, nullptr, 16, 1, nullptr, 16, Epilogue::store, nullptr, bad), Error);
  bad = mma_path();
  bad.mma_gemm_min_m = -1;
  EXPECT_THROW(cuda::linear(d, nullptr, 16, 1, nullptr, 16, Epilogue::store, nullptr, bad), Error);
  bad = mma_path();
  bad.mma_gemm_blocks = 3;
  EXPECT_THROW(cuda::linear(d, nullptr, 16, 1, nullptr, 16, Epilogue::store, nullptr, bad), Error);
}

}  // namespace
}  // namespace kd
