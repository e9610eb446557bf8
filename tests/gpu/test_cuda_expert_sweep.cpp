// Sweep of the INT4 expert kernels at Kimi K2's routed-expert shapes — gate/up 4096 × 7168 (swiglu)
// and down 7168 × 2048 (store), 384 experts, top-8 random routing, n = 1 … 4096 tokens: µs and GB/s a
// launch (CUDA events, median of 21 after 3 warm-ups; GB = distinct experts × their weight + scale
// bytes), for the CUDA-core register kernel (ExpertBatch::path = cores, linear.cu) and every tile of
// the integer tensor-core path (kImmaTiles, ExpertBatch::imma_tile, expert_imma.cu). The choice
// travels in each call's ExpertBatch. Asserted per mode: (a) parity of the store output against fp64
// on sampled rows ≤ 2× a plain fp32 loop's error, (b) each token's rows of a 17-token batch == the
// token alone (bitwise), (c) every IMMA tile writes the first tile's bits. The retired CUDA-core
// staged/lean configs' last figures: docs/perf.md, "Retired kernels (issue 13)". Skips without a GPU.
// Run: kdtree_gpu_tests --gtest_filter=CudaExperts.ConfigSweep
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "expert_routing.h"
#include "gpu_test_util.h"

namespace kd {
namespace {

using gpu_test::DevBuf;
using gpu_test::DevRouting;
using gpu_test::normal_x;
using gpu_test::random_routing;
using gpu_test::Routing;

using cuda::Epilogue;

// Modes: 0 the CUDA-core register kernel, 1 + t the integer tensor-core path's tile t.
constexpr int kModes = 1 + cuda::kImmaTileCount;
bool is_imma(int mode) { return mode > 0; }
std::string mode_label(int mode) { return is_imma(mode) ? cuda::kImmaTiles[mode - 1].name : "core"; }

// E INT4 g32 experts [rows, cols] back to back on the device (random words, bf16 scales).
struct Mat {
  const char* name;
  int64_t E, rows, cols;
  Epilogue ep;
  int64_t wbytes() const { return rows * cols / 2; }
  int64_t sbytes() const { return rows * (cols / 32) * 2; }
  int64_t ldy() const { return ep == Epilogue::swiglu ? rows / 2 : rows; }
};

cuda::ExpertBatch batch(const Mat& m, const DevBuf& dw, const DevBuf& ds, const DevRouting& r, int mode) {
  cuda::ExpertBatch b = r.batch(dw.p, ds.as<uint16_t>(), m.E, m.rows, m.cols);
  b.path = is_imma(mode) ? cuda::ExpertPath::imma : cuda::ExpertPath::cores;
  b.imma_tile = is_imma(mode) ? mode - 1 : -1;
  return b;
}

// y [n·K, ldy] for token rows x (host) through `mode`; NaN-poisoned first.
// With y0 (the add epilogue) y starts as y0 instead.
std::vector<float> run(const Mat& m, const DevBuf& dw, const DevBuf& ds, const Routing& rt, const float* x, Epilogue ep,
                       int mode, const float* y0 = nullptr) {
  const DevRouting r(rt, m.E);
  const int64_t ldy = ep == Epilogue::swiglu ? m.rows / 2 : m.rows;
  std::vector<float> y(static_cast<size_t>(rt.n * rt.K * ldy), std::nanf(""));
  if (y0 != nullptr) std::copy(y0, y0 + y.size(), y.begin());
  DevBuf dx(size_t(rt.n * m.cols) * 4), dy(y.size() * 4);
  dx.up(x, size_t(rt.n * m.cols) * 4);
  dy.up(y.data(), y.size() * 4);
  const cuda::ExpertBatch b = batch(m, dw, ds, r, mode);
  cuda::expert_linear(b, dx.as<float>(), m.cols, dy.as<float>(), ldy, ep, nullptr);
  cuda::check(cudaDeviceSynchronize(), "expert_linear");
  cuda::check(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost), "download");
  return y;
}

void sweep(const Mat& m, uint32_t seed) {
  std::mt19937 rng(seed);
  DevBuf dw(size_t(m.E * m.wbytes())), ds(size_t(m.E * m.sbytes()));
  cuda::fill_words(dw.as<uint32_t>(), m.E * m.wbytes() / 4, seed, nullptr);
  cuda::fill_bf16(ds.as<uint16_t>(), m.E * m.sbytes() / 2, 0.01f, seed + 1, nullptr);

  // (a) parity inputs: 17 tokens top-8 among experts 0 … 15 (each serves ~8 tokens: several token
  // tiles, odd counts); fp64 and plain fp32 references on every 16th row, from the downloaded weights.
  const int64_t EP = 16, n = 17, K = 8, step = 16;
  const Routing prt = random_routing(n, K, EP, rng);
  const std::vector<float> px = normal_x(n * m.cols, rng);
  std::vector<uint32_t> words(static_cast<size_t>(EP * m.wbytes() / 4));
  std::vector<uint16_t> scales(static_cast<size_t>(EP * m.sbytes() / 2));
  cuda::check(cudaMemcpy(words.data(), dw.p, words.size() * 4, cudaMemcpyDeviceToHost), "download");
  cuda::check(cudaMemcpy(scales.data(), ds.p, scales.size() * 2, cudaMemcpyDeviceToHost), "download");
  std::vector<double> ref;
  std::vector<float> plain;
  std::vector<size_t> where;  // output index of each sampled value
  std::vector<float> wrow(static_cast<size_t>(m.cols));
  for (int64_t e = 0; e < EP; ++e)
    for (int64_t r = step / 2; r < m.rows; r += step) {
      for (int64_t c = 0; c < m.cols; ++c) wrow[size_t(c)] = gpu_test::int4_weight(words, scales, m.cols, e * m.rows + r, c);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < K; ++k) {
          if (prt.choice[size_t(i)][size_t(k)] != e) continue;
          double d = 0;
          float f = 0;
          for (int64_t c = 0; c < m.cols; ++c) {
            d += double(wrow[size_t(c)]) * double(px[size_t(i * m.cols + c)]);
            f += wrow[size_t(c)] * px[size_t(i * m.cols + c)];
          }
          ref.push_back(d);
          plain.push_back(f);
          where.push_back(size_t((i * K + k) * m.rows + r));
        }
    }
  double den = 0, nump = 0;
  for (size_t j = 0; j < ref.size(); ++j) {
    den += ref[j] * ref[j];
    nump += (double(plain[j]) - ref[j]) * (double(plain[j]) - ref[j]);
  }
  const double e_plain = std::sqrt(nump / den);

  // (b) invariance inputs: 17 tokens over all experts, the timed epilogue.
  const Routing irt = random_routing(n, K, m.E, rng);
  const std::vector<float> ix = normal_x(n * m.cols, rng);
  std::vector<float> y_imma0;

  // Timing buffers: up to 4096 tokens (decode, verify trees, prefill chunks, a 4K prompt at once).
  const std::vector<int64_t> ns = {1, 2, 4, 8, 17, 33, 128, 256, 512, 1024, 4096};
  const int64_t nmax = ns.back();
  DevBuf dx(size_t(nmax * m.cols) * 4), dy(size_t(nmax * K * m.ldy()) * 4);
  cuda::fill_f32(dx.as<float>(), nmax * m.cols, -1.0f, 1.0f, seed + 2, nullptr);
  std::vector<Routing> trt;
  for (int64_t t : ns) trt.push_back(random_routing(t, K, m.E, rng));

  std::printf("%s %lldx%lld INT4 g32, %lld experts top-8 (plain fp32 err %.3g); us GB/s per n:\n", m.name,
              (long long)m.rows, (long long)m.cols, (long long)m.E, e_plain);
  std::printf("cfg  |");
  for (int64_t t : ns) std::printf(" %-13s|", ("n=" + std::to_string(t) + " us GB/s").c_str());
  std::printf(" err     bits\n");
  for (int mode = 0; mode < kModes; ++mode) {
    const bool imma = is_imma(mode);
    char label[8];
    std::snprintf(label, sizeof label, "%s", mode_label(mode).c_str());
    std::string line = std::string(label) + std::string(5 - std::min<size_t>(4, std::strlen(label)), ' ') + "|";
    for (size_t t = 0; t < ns.size(); ++t) {
      const DevRouting r(trt[t], m.E);
      const cuda::ExpertBatch b = batch(m, dw, ds, r, mode);
      auto once = [&] { cuda::expert_linear(b, dx.as<float>(), m.cols, dy.as<float>(), m.ldy(), m.ep, nullptr); };
      const double us = gpu_test::median_us(once), gb = double(r.n_active) * double(m.wbytes() + m.sbytes()) / 1e9;
      char cell[40];
      std::snprintf(cell, sizeof cell, " %6.1f %5.0f |", us, gb / (us * 1e-6));
      line += cell;
    }

    // (a) parity.
    const std::vector<float> y = run(m, dw, ds, prt, px.data(), Epilogue::store, mode);
    double num = 0;
    for (size_t j = 0; j < ref.size(); ++j) {
      ASSERT_TRUE(std::isfinite(y[where[j]])) << "mode " << label << ": unwritten output";
      num += (double(y[where[j]]) - ref[j]) * (double(y[where[j]]) - ref[j]);
    }
    const double err = std::sqrt(num / den);
    EXPECT_LE(err, 2 * e_plain) << m.name << " config " << label;

    // (b) each token alone == its rows in the batch; (c) == the first IMMA tile's bits.
    const std::vector<float> yb = run(m, dw, ds, irt, ix.data(), m.ep, mode);
    bool same = true;
    for (int64_t i = 0; i < n; ++i) {
      const Routing one{1, K, {irt.choice[size_t(i)]}};
      const std::vector<float> y1 = run(m, dw, ds, one, &ix[size_t(i * m.cols)], m.ep, mode);
      same = same && std::memcmp(y1.data(), &yb[size_t(i * K * m.ldy())], size_t(K * m.ldy()) * 4) == 0;
    }
    EXPECT_TRUE(same) << m.name << " config " << label << ": a token alone differs from its rows in the batch";
    if (mode == 1) y_imma0 = yb;
    const bool as_first = !imma || std::memcmp(yb.data(), y_imma0.data(), yb.size() * 4) == 0;
    EXPECT_TRUE(as_first) << m.name << " tile " << label << " writes other bits than tile " << mode_label(1);
    char tail[48];
    std::snprintf(tail, sizeof tail, " %.2e %s%s", err, same ? "inv" : "INV!", !imma ? "" : as_first ? " =first" : " !=first");
    std::printf("%s%s\n", line.c_str(), tail);
  }
}

TEST(CudaExperts, ConfigSweep) {
  REQUIRE_GPU();
  std::printf("device read bandwidth %.0f GB/s; production: IMMA %s, %s from %lld rows (gate/up) / %lld rows (down), %s from %lld rows; "
              "kernels:\n",
              cuda::measure_read_gbps(int64_t(1) << 31, 5), cuda::kImmaTiles[cuda::kImmaNarrowTile].name,
              cuda::kImmaTiles[cuda::kImmaWideTile].name, (long long)cuda::kImmaWideGateUpRows, (long long)cuda::kImmaWideDownRows,
              cuda::kImmaTiles[cuda::kImmaPrefillTile].name, (long long)cuda::kImmaPrefillRows);
  std::printf("  core %s\n", cuda::expert_cores_describe().c_str());
  for (int c = 0; c < cuda::kImmaTileCount; ++c)
    std::printf("  %s %s\n", cuda::kImmaTiles[c].name, cuda::expert_imma_describe(c).c_str());
  sweep(Mat{"gate/up", 384, 4096, 7168, Epilogue::swiglu}, 501);
  sweep(Mat{"down", 384, 7168, 2048, Epilogue::store}, 502);
}

// Shapes that leave partial blocks, token passes and column steps: 102 rows (not a multiple of any
// tile's 32, 64 or 128 rows a block); 2048 columns (whole steps), 96 (3 groups: less than one step of
// 8, scales not in 16-byte units), 2080 (65 groups: a partial last step for every tile) and 2304 (72
// groups: 16-byte scale copies — whole units of 8 — with a partial last step of the 32-group tiles); expert 0
// serving all 75 tokens (odd, so a pass of token pairs ends on a single token; 5 passes of p16's
// 16 tokens, the last of 11). Every mode, every epilogue: each token alone ==
// its rows in the batch; every IMMA tile writes the first tile's bits (the CUDA-core kernel writes
// other bits: another arithmetic).
TEST(CudaExperts, ConfigsPartialTiles) {
  REQUIRE_GPU();
  std::mt19937 rng(511);
  for (const int64_t cols : {2048, 96, 2080, 2304}) {
    const Mat m{"small", 4, 102, cols, Epilogue::store};
    DevBuf dw(size_t(m.E * m.wbytes())), ds(size_t(m.E * m.sbytes()));
    cuda::fill_words(dw.as<uint32_t>(), m.E * m.wbytes() / 4, 512, nullptr);
    cuda::fill_bf16(ds.as<uint16_t>(), m.E * m.sbytes() / 2, 0.01f, 513, nullptr);
    const int64_t n = 75, K = 2;
    Routing rt{n, K, {}};
    for (int64_t i = 0; i < n; ++i) rt.choice.push_back({0, int32_t(1 + rng() % 3)});
    const std::vector<float> x = normal_x(n * m.cols, rng), y0 = normal_x(n * K * m.rows, rng);
    for (Epilogue ep : {Epilogue::store, Epilogue::add, Epilogue::swiglu}) {
      const int64_t ldy = ep == Epilogue::swiglu ? m.rows / 2 : m.rows;
      const float* init = ep == Epilogue::add ? y0.data() : nullptr;
      const std::vector<float> want_imma = run(m, dw, ds, rt, x.data(), ep, 1, init);
      for (size_t j = 0; j < want_imma.size(); ++j) ASSERT_TRUE(std::isfinite(want_imma[j])) << "IMMA tile left output " << j;
      for (int mode = 0; mode < kModes; ++mode) {
        const std::vector<float> y = run(m, dw, ds, rt, x.data(), ep, mode, init);
        for (size_t j = 0; j < y.size(); ++j)
          ASSERT_TRUE(std::isfinite(y[j])) << mode_label(mode) << " left output " << j << " (" << cols << " columns)";
        if (is_imma(mode)) {
          ASSERT_EQ(0, std::memcmp(y.data(), want_imma.data(), y.size() * 4))
              << "tile " << mode_label(mode) << " epilogue " << int(ep) << ", " << cols << " columns";
        }
        for (int64_t i = 0; i < n; i += 6) {
          const Routing one{1, K, {rt.choice[size_t(i)]}};
          const std::vector<float> y1 =
              run(m, dw, ds, one, &x[size_t(i * m.cols)], ep, mode, init == nullptr ? nullptr : &y0[size_t(i * K * ldy)]);
          ASSERT_EQ(0, std::memcmp(y1.data(), &y[size_t(i * K * ldy)], size_t(K * ldy) * 4))
              << mode_label(mode) << " epilogue " << int(ep) << ", " << cols << " columns: token " << i << " alone differs";
        }
      }
    }
  }
}

// A bad kernel choice is a clear error before any launch, not a silent fallback (no GPU needed).
TEST(CudaExperts, ConfigOutOfRange) {
  cuda::ExpertBatch b;
  b.w.int4 = true;
  b.w.rows = b.w.cols = 1024;
  b.max_active = 1;
  b.imma_tile = cuda::kImmaTileCount;
  EXPECT_THROW(cuda::expert_linear(b, nullptr, 1024, nullptr, 1024, Epilogue::store, nullptr), Error);
  b.imma_tile = -2;
  EXPECT_THROW(cuda::expert_linear(b, nullptr, 1024, nullptr, 1024, Epilogue::store, nullptr), Error);
  b.imma_tile = -1;
  b.path = static_cast<cuda::ExpertPath>(7);
  EXPECT_THROW(cuda::expert_linear(b, nullptr, 1024, nullptr, 1024, Epilogue::store, nullptr), Error);
  cuda::MlaParams p;  // a latent width the core's 8-byte loads cannot take
  p.Lr = 42;
  p.dr = 64;
  EXPECT_THROW(cuda::mla_attention(p, nullptr), Error);
  p.Lr = 512;  // K2's shapes, a list long enough for the tensor cores, without the q fragment buffer
  p.dn = 128;
  p.dv = 128;
  p.H = 64;
  p.n = 1;
  p.max_keys = 1000;
  // Stand-ins for the operands, never read: each call must fail before any launch, and only the
  // check under test can fire.
  float f = 0;
  uint16_t w = 0;
  p.q = p.out = p.qlat = p.olat = p.part = &f;
  p.kv_b = p.cache = &w;
  EXPECT_THROW(cuda::mla_attention(p, nullptr), Error);
  p.max_keys = 10;  // short lists need no q fragments, but the kernels still need their operands
  p.qlat = nullptr;
  EXPECT_THROW(cuda::mla_attention(p, nullptr), Error);
}

}  // namespace
}  // namespace kd
