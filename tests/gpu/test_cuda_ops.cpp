// Op parity, CUDA vs fp64 references and the plain fp32 CPU implementation, at K2's shapes (7168 ×
// 2048 INT4 experts, 64 heads over the 576-wide latent): the flash-attention rule — the GPU's
// error against fp64 is at most 2× that of a plain same-precision implementation (DESIGN.md §2).
// Plus bitwise row invariance of the linear kernels and exact routing vs the CPU router.
// Every test skips with a message when no GPU is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/cuda_ops.h"
#include "model/deepseek_v3_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "gpu_test_util.h"


namespace kd {
namespace {

struct Host {  // a Weight with its own storage
  std::vector<uint16_t> bf16;
  std::vector<uint32_t> packed;
  std::vector<uint16_t> scales;
  Weight w;
};

Host random_weight(int64_t rows, int64_t cols, bool int4, std::mt19937& rng) {
  Host h;
  h.w.name = int4 ? "random.int4" : "random.bf16";
  h.w.rows = rows;
  h.w.cols = cols;
  h.w.int4 = int4;
  std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(cols)));
  if (int4) {
    h.packed.resize(size_t(rows * cols / 8));
    for (auto& v : h.packed) v = uint32_t(rng());
    h.scales.resize(size_t(rows * cols / 32));
    for (auto& s : h.scales) s = f32_to_bf16(nd(rng) / 4.0f);
    h.w.data = h.packed.data();
    h.w.scales = h.scales.data();
  } else {
    h.bf16.resize(size_t(rows * cols));
    for (auto& v : h.bf16) v = f32_to_bf16(nd(rng));
    h.w.dtype = DType::BF16;
    h.w.data = h.bf16.data();
  }
  return h;
}

// ‖a − b‖ / ‖b‖ in double.
double rel_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

std::vector<double> linear_fp64(const Weight& w, const std::vector<float>& x, int64_t m) {
  std::vector<double> y(size_t(m * w.rows));
  std::vector<float> row(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    cpu::dequant_row(w, r, row.data());  // exact: bf16 and (n − 8)·bf16 scale are fp32-representable
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0;
      for (int64_t k = 0; k < w.cols; ++k) acc += double(row[size_t(k)]) * double(x[size_t(i * w.cols + k)]);
      y[size_t(i * w.rows + r)] = acc;
    }
  }
  return y;
}

// The plain same-precision implementation: dequantise, one fp32 running sum per output.
std::vector<float> linear_plain_fp32(const Weight& w, const std::vector<float>& x, int64_t m) {
  std::vector<float> y(size_t(m * w.rows));
  std::vector<float> row(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    cpu::dequant_row(w, r, row.data());
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0;
      for (int64_t k = 0; k < w.cols; ++k) acc += row[size_t(k)] * x[size_t(i * w.cols + k)];
      y[size_t(i * w.rows + r)] = acc;
    }
  }
  return y;
}

void check_linear(int64_t rows, int64_t cols, bool int4, int64_t m, uint32_t seed) {
  std::mt19937 rng(seed);
  Host h = random_weight(rows, cols, int4, rng);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(m * cols));
  for (auto& v : x) v = nd(rng);
  std::vector<float> y(size_t(m * rows), std::nanf(""));  // poisoned: every output must be written
  cuda_ops::linear(h.w, x.data(), m, y.data());
  const std::vector<double> ref = linear_fp64(h.w, x, m);
  const std::vector<float> plain = linear_plain_fp32(h.w, x, m);
  for (float v : y) ASSERT_TRUE(std::isfinite(v));
  const double e_gpu = rel_err(y, ref), e_plain = rel_err(plain, ref);
  std::printf("linear %s %lldx%lld m=%lld: GPU err %.3g, plain fp32 err %.3g\n", int4 ? "INT4" : "BF16", (long long)rows,
              (long long)cols, (long long)m, e_gpu, e_plain);
  EXPECT_LE(e_gpu, 2 * e_plain + 1e-7);

  // Row invariance: each row alone (the decode variant) gives the batch's bits.
  for (int64_t i : {int64_t(0), m / 2, m - 1}) {
    std::vector<float> one(static_cast<size_t>(rows));
    std::vector<float> xi(x.begin() + i * cols, x.begin() + (i + 1) * cols);
    cuda_ops::linear(h.w, xi.data(), 1, one.data());
    EXPECT_EQ(0, std::memcmp(one.data(), y.data() + i * rows, size_t(rows) * 4)) << "row " << i << " differs from its batch";
  }
}

// The launch overlap (backend/cuda/common.cuh): 256 dependent kernels in one graph, each checking
// that every block of the kernel before it has written its slot. A kernel that ran before its
// predecessor finished (a missing or misplaced wait) finds stale slots. The forward's own ordering
// under the overlap is what the bitwise tests (verify == AR, DDTree == AR, batch == alone) check.
TEST(CudaOps, LaunchOverlapKeepsKernelOrder) {
  REQUIRE_GPU();
  int major = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), "cudaDeviceGetAttribute");
  for (const int blocks : {1, 132, 1000}) {
    const cuda::ChainTiming t = cuda::measure_kernel_chain(256, blocks, 5);
    EXPECT_EQ(t.stale, 0) << blocks << " blocks a kernel";
    EXPECT_EQ(t.overlap_available, major >= 9);
    std::printf("kernel chain, %d blocks: %.2f µs a kernel serial, %.2f with the overlap (%s)\n", blocks, t.us_per_kernel_serial,
                t.us_per_kernel_overlap, t.overlap_available ? "on" : "off");
  }
}

TEST(CudaOps, LinearInt4K2ExpertShapes) {
  REQUIRE_GPU();
  check_linear(2048, 7168, true, 3, 1);   // gate / up: 2048 × 7168
  check_linear(7168, 2048, true, 11, 2);  // down: 7168 × 2048
}

TEST(CudaOps, LinearBf16K2Shapes) {
  REQUIRE_GPU();
  check_linear(1536, 7168, false, 9, 3);  // q_a
  check_linear(576, 7168, false, 1, 4);   // kv_a
  check_linear(7168, 8192, false, 17, 5); // o_proj (64 heads × 128)
}

TEST(CudaOps, LinearOddRowCounts) {
  REQUIRE_GPU();
  check_linear(37, 96, true, 5, 6);
  check_linear(13, 40, false, 70, 7);
}

// fp64 / plain-fp32 absorbed attention, mirroring the kernel's definition.
template <class T>
std::vector<T> mla_ref(const cuda_ops::MlaShape& s, const std::vector<float>& q, const std::vector<uint16_t>& cache,
                       const std::vector<uint16_t>& kv_b, const std::vector<int32_t>& vr, const std::vector<int32_t>& vc) {
  const int64_t D = s.Lr + s.dr, qk = s.dn + s.dr;
  std::vector<T> out(size_t(s.n * s.H * s.dv));
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t h = 0; h < s.H; ++h) {
      const float* qi = &q[size_t((i * s.H + h) * qk)];
      const uint16_t* wh = &kv_b[size_t(h * (s.dn + s.dv) * s.Lr)];
      std::vector<T> qlat(size_t(s.Lr), T(0)), olat(size_t(s.Lr), T(0));
      for (int64_t l = 0; l < s.Lr; ++l)
        for (int64_t d = 0; d < s.dn; ++d) qlat[size_t(l)] += T(qi[d]) * T(bf16_to_f32(wh[d * s.Lr + l]));
      std::vector<int64_t> keys;
      for (int64_t t = 0; t < s.start; ++t) keys.push_back(t);
      for (int64_t k = 0; k < vc[size_t(i)]; ++k) keys.push_back(s.start + vr[size_t(i * s.n + k)]);
      std::vector<T> p(keys.size());
      T mx = -INFINITY, sum = 0;
      for (size_t t = 0; t < keys.size(); ++t) {
        const uint16_t* kr = &cache[size_t(keys[t] * D)];
        T a = 0, b = 0;
        for (int64_t l = 0; l < s.Lr; ++l) a += qlat[size_t(l)] * T(bf16_to_f32(kr[l]));
        for (int64_t d = 0; d < s.dr; ++d) b += T(qi[s.dn + d]) * T(bf16_to_f32(kr[s.Lr + d]));
        p[t] = (a + b) * T(s.softmax_scale);
        mx = std::max(mx, p[t]);
      }
      for (auto& v : p) sum += (v = std::exp(v - mx));
      for (size_t t = 0; t < keys.size(); ++t)
        for (int64_t l = 0; l < s.Lr; ++l) olat[size_t(l)] += p[t] / sum * T(bf16_to_f32(cache[size_t(keys[t] * D + l)]));
      for (int64_t d = 0; d < s.dv; ++d) {
        T acc = 0;
        for (int64_t l = 0; l < s.Lr; ++l) acc += T(bf16_to_f32(wh[(s.dn + d) * s.Lr + l])) * olat[size_t(l)];
        out[size_t((i * s.H + h) * s.dv + d)] = acc;
      }
    }
  return out;
}

// One MLA case on random data: row i of a tree sees the cached prefix and anc[i] (offsets past start).
// Checks the kernel's output against fp64 within twice the plain-fp32 error, and each row alone (the
// same key list, a batch of one, the core's heads a block by the rule) against its row in the batch,
// bit for bit.
void check_mla_case(const cuda_ops::MlaShape& s, const std::vector<std::vector<int32_t>>& anc, uint32_t seed, const char* what) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t D = s.Lr + s.dr, qk = s.dn + s.dr;
  std::vector<float> q(size_t(s.n * s.H * qk));
  for (auto& v : q) v = nd(rng);
  std::vector<uint16_t> cache(size_t((s.start + s.n) * D)), kv_b(size_t(s.H * (s.dn + s.dv) * s.Lr));
  for (auto& v : cache) v = f32_to_bf16(nd(rng));
  for (auto& v : kv_b) v = f32_to_bf16(nd(rng) / std::sqrt(float(s.Lr)));
  std::vector<int32_t> vr(size_t(s.n * s.n), 0), vc(size_t(s.n));
  for (int64_t i = 0; i < s.n; ++i) {
    vc[size_t(i)] = int32_t(anc[size_t(i)].size());
    for (size_t k = 0; k < anc[size_t(i)].size(); ++k) vr[size_t(i * s.n) + k] = anc[size_t(i)][k];
  }
  std::vector<float> out(size_t(s.n * s.H * s.dv), std::nanf(""));
  cuda_ops::mla_attention(s, q.data(), cache, kv_b, vr, vc, out.data());
  for (float v : out) EXPECT_TRUE(std::isfinite(v)) << what;
  const std::vector<double> ref = mla_ref<double>(s, q, cache, kv_b, vr, vc);
  const double e_gpu = rel_err(out, ref), e_plain = rel_err(mla_ref<float>(s, q, cache, kv_b, vr, vc), ref);
  std::printf("MLA %s: GPU err %.3g, plain fp32 err %.3g\n", what, e_gpu, e_plain);
  EXPECT_LE(e_gpu, 2 * e_plain + 1e-7) << what;
  for (int64_t i = 0; i < s.n; ++i) {
    cuda_ops::MlaShape s1 = s;
    s1.n = 1;
    std::vector<float> qi(q.begin() + i * s.H * qk, q.begin() + (i + 1) * s.H * qk);
    std::vector<int32_t> vr1 = anc[size_t(i)], vc1 = {vc[size_t(i)]};
    std::vector<float> o1(size_t(s.H * s.dv), std::nanf(""));
    cuda_ops::mla_attention(s1, qi.data(), cache, kv_b, vr1, vc1, o1.data());
    EXPECT_EQ(0, std::memcmp(o1.data(), out.data() + i * s.H * s.dv, o1.size() * 4)) << what << ": row " << i << " alone";
  }
}

// An attention shape of n rows after `start` cached keys; softmax scale 1 / sqrt(dn + dr).
cuda_ops::MlaShape mla_shape(int64_t n, int64_t start, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t Lr) {
  cuda_ops::MlaShape s;
  s.n = n;
  s.start = start;
  s.H = H;
  s.dn = dn;
  s.dr = dr;
  s.dv = dv;
  s.Lr = Lr;
  s.softmax_scale = 1.0f / std::sqrt(float(dn + dr));
  return s;
}

// Kimi K2's attention shapes (dn 128, dr 64, dv 128, Lr 512).
cuda_ops::MlaShape k2_mla_shape(int64_t n, int64_t start, int64_t H) { return mla_shape(n, start, H, 128, 64, 128, 512); }

// The key lists of a chain of n new rows: row i sees new rows 0 … i.
std::vector<std::vector<int32_t>> chain_lists(int64_t n) {
  std::vector<std::vector<int32_t>> c(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    for (int32_t a = 0; a <= i; ++a) c[size_t(i)].push_back(a);
  return c;
}

// K2's shapes: 64 heads, 576 latent columns, 1100 cached keys (9 chunks of 128) + a tree of 5:
// 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 2 (keys: ancestors and self).
TEST(CudaOps, MlaAttentionK2ShapesWithTreeMask) {
  REQUIRE_GPU();
  cuda_ops::MlaShape s = k2_mla_shape(5, 1100, 64);
  check_mla_case(s, {{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}}, 11, "64 heads, 576 latent, 1100 cached + tree of 5");
}

// Lists whose chunks span more than one 256-key tile: each chunk folds its tiles in order (the
// online softmax) before the combine; K2's shapes.
TEST(CudaOps, MlaAttentionLongListsFoldTiles) {
  REQUIRE_GPU();
  cuda_ops::MlaShape s = k2_mla_shape(3, 4700, 64);  // 74 units of 64 keys → 15 chunks of 320: a 256-key tile and a 64-key one each
  check_mla_case(s, {{0}, {0, 1}, {0, 2}}, 21, "K2, 4700 cached");
}

// Rows of one launch whose lists are cut into different numbers of chunks: a chain of 140 nodes after
// 960 cached keys gives lists of 961 … 1100 keys — 16 chunks of 64 for the shortest, 9 of 128 for the
// longest. The launch must run the most chunks any row has, not the longest row's count (found in
// review: a 1000-key row beside an 1100-key one lost 7 of its chunks).
TEST(CudaOps, MlaAttentionRowsOfDifferentChunkCounts) {
  REQUIRE_GPU();
  check_mla_case(k2_mla_shape(140, 960, 16), chain_lists(140), 41, "chain of 140 after 960 cached (9 to 16 chunks)");
}

// Lists on both sides of the split between the CUDA-core kernel (≤ kShortKeys = 128 keys) and the tensor
// cores in one launch: a chain of 16 after 120 cached keys gives 121 … 136 keys, 8 rows each side. K2's 64 heads
// make 16 rows take 4 heads a CUDA-core block in the batch and 1 a block alone (the row-alone check
// compares them bit for bit); Lr 36 takes the guarded tensor-core kernel beside it.
TEST(CudaOps, MlaAttentionShortAndLongListsInOneLaunch) {
  REQUIRE_GPU();
  check_mla_case(k2_mla_shape(16, 120, 64), chain_lists(16), 51, "K2, chain of 16 after 120 cached (8 short, 8 long)");
  check_mla_case(mla_shape(16, 120, 20, 24, 8, 16, 36), chain_lists(16), 52, "Lr 36, 20 heads, chain of 16 after 120 cached");
  // Short lists only, off K2's shapes, at 2 and 4 heads a block in the batch (n · 20 / HB ≥ 256) against
  // 1 alone: 30 rows of 61 … 90 keys (HB 2), 56 rows of 41 … 96 keys (HB 4).
  for (const auto& [n, start, seed] : {std::tuple{30, 60, 53}, std::tuple{56, 40, 54}}) {
    const std::string what = "Lr 36, 20 heads, " + std::to_string(n) + " short lists (" + std::to_string(n == 30 ? 2 : 4) + " heads a block)";
    check_mla_case(mla_shape(n, start, 20, 24, 8, 16, 36), chain_lists(n), uint32_t(seed), what.c_str());
  }
}

// Shapes off the K2 grid: fewer heads than a block takes (the fixtures' 4), a head count that leaves a
// partial second block (20), latent rows that are not 16-byte aligned (Lr + dr = 36) and a latent
// width that leaves a partial 64-column o group with a half-filled 8-column load (Lr = 36).
TEST(CudaOps, MlaAttentionSmallShapes) {
  REQUIRE_GPU();
  struct Case {
    int64_t H, dn, dr, dv, Lr, start;
    const char* what;
  };
  for (const Case& c : {Case{4, 32, 16, 32, 32, 40, "fixture shape (4 heads, Lr 32, dr 16)"},
                        Case{20, 16, 4, 24, 32, 300, "20 heads, rows of 36 columns, 5 chunks"},
                        Case{4, 24, 8, 16, 36, 700, "Lr 36, 11 chunks"}}) {
    check_mla_case(mla_shape(4, c.start, c.H, c.dn, c.dr, c.dv, c.Lr), {{0}, {0, 1}, {0, 1, 2}, {0, 3}}, 31, c.what);
  }
}

TEST(CudaOps, RouterMatchesCpuWithGroupLimits) {
  REQUIRE_GPU();
  for (const char* fx : {"dsv3-group", "k2-bf16"}) {
    const char* env = std::getenv("KDTREE_FIXTURES");  // scripts/gpu-check runs binaries built elsewhere
    Checkpoint ck(std::string(env ? env : KDTREE_FIXTURES) + "/" + fx);
    DeepseekV3 model(ck);
    const ModelConfig& c = model.config();
    const int64_t layer = c.first_k_dense_replace, E = c.n_routed_experts, K = c.num_experts_per_tok, n = 500;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    std::vector<float> logits(size_t(n * E));
    for (auto& v : logits) v = nd(rng);
    for (int64_t i = 0; i < 20; ++i)  // exact ties: the lower id must win on both sides
      logits[size_t(i * E + 3)] = logits[size_t(i * E + 5)];
    std::vector<int32_t> chosen(size_t(n * K)), ref_c(size_t(n * K));
    std::vector<float> w(size_t(n * K)), ref_w(size_t(n * K));
    cuda_ops::route(logits.data(), model.layers()[size_t(layer)].router_bias.data(), n, E, K, c.n_group, c.topk_group,
                    c.norm_topk_prob, float(c.routed_scaling_factor), chosen.data(), w.data());
    for (int64_t i = 0; i < n; ++i) model.route(layer, &logits[size_t(i * E)], &ref_c[size_t(i * K)], &ref_w[size_t(i * K)]);
    EXPECT_EQ(chosen, ref_c) << fx;
    for (size_t j = 0; j < w.size(); ++j) EXPECT_NEAR(w[j], ref_w[j], 1e-6f * std::abs(ref_w[j]) + 1e-7f) << fx << " slot " << j;
  }
}

}  // namespace
}  // namespace kd
