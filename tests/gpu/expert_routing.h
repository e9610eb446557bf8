// Routed-expert helpers shared by the GPU expert tests (test_cuda_expert_sweep.cpp,
// test_cuda_expert_imma.cpp): a routing of n tokens to K experts each, random top-K routing, the
// ExpertBatch tables dispatch() builds for it, on the device, and the INT4 dequantisation of the
// host references.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend/cuda/kernels.h"
#include "core/dtype.h"
#include "gpu_test_util.h"

namespace kd::gpu_test {

// Element k of row `row` of INT4 g32 matrices stored back to back, `cols` wide (words: 8 LSB-first
// nibbles, value nibble − 8; one bf16 scale per 32 columns): (n − 8) · scale, exact in fp32.
inline float int4_weight(const std::vector<uint32_t>& words, const std::vector<uint16_t>& scales, int64_t cols, int64_t row,
                         int64_t k) {
  const uint32_t q = words[size_t(row * (cols / 8) + k / 8)];
  return float(int((q >> (4 * (k % 8))) & 15u) - 8) * bf16_to_f32(scales[size_t(row * (cols / 32) + k / 32)]);
}

// Token i of n goes to experts choice[i] (distinct); entries grouped by expert ascending, tokens
// ascending inside (as dispatch() builds them); entry (i, k) reads x row i, writes y row i·K + k.
struct Routing {
  int64_t n, K;
  std::vector<std::vector<int32_t>> choice;
};

// K distinct experts of E a token, uniformly at random.
inline Routing random_routing(int64_t n, int64_t K, int64_t E, std::mt19937& rng) {
  Routing r{n, K, {}};
  std::vector<int32_t> ids(static_cast<size_t>(E));
  for (int64_t i = 0; i < n; ++i) {
    for (int32_t e = 0; e < int32_t(E); ++e) ids[size_t(e)] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    r.choice.emplace_back(ids.begin(), ids.begin() + K);
  }
  return r;
}

// The routing's ExpertBatch tables on the device.
struct DevRouting {
  struct Tables {
    std::vector<int32_t> act_expert, act_off, act_cnt, in_row, out_row;
  };
  static Tables build(const Routing& rt, int64_t E) {
    Tables t;
    for (int32_t e = 0; e < int32_t(E); ++e) {
      const int32_t off = int32_t(t.in_row.size());
      for (int64_t i = 0; i < rt.n; ++i)
        for (int64_t k = 0; k < rt.K; ++k)
          if (rt.choice[size_t(i)][size_t(k)] == e) {
            t.in_row.push_back(int32_t(i));
            t.out_row.push_back(int32_t(i * rt.K + k));
          }
      if (int32_t(t.in_row.size()) > off) {
        t.act_expert.push_back(e);
        t.act_off.push_back(off);
        t.act_cnt.push_back(int32_t(t.in_row.size()) - off);
      }
    }
    return t;
  }
  int64_t n, K;
  Tables t;
  int32_t n_active;
  DevBuf dn, dae, dao, dac, din, dout;
  DevRouting(const Routing& rt, int64_t E)
      : n(rt.n), K(rt.K), t(build(rt, E)), n_active(int32_t(t.act_expert.size())), dn(4), dae(t.act_expert.size() * 4),
        dao(t.act_off.size() * 4), dac(t.act_cnt.size() * 4), din(t.in_row.size() * 4), dout(t.out_row.size() * 4) {
    dn.up(&n_active, 4);
    dae.up(t.act_expert.data(), t.act_expert.size() * 4);
    dao.up(t.act_off.data(), t.act_off.size() * 4);
    dac.up(t.act_cnt.data(), t.act_cnt.size() * 4);
    din.up(t.in_row.data(), t.in_row.size() * 4);
    dout.up(t.out_row.data(), t.out_row.size() * 4);
  }
  // Digit scratch of the integer tensor-core path (x_rows = n token rows), grown by batch().
  mutable std::unique_ptr<DevBuf> dq, du;
  mutable int64_t dq_cols = 0;
  // The batch over E INT4 g32 experts of [rows, cols] back to back at w / scales.
  cuda::ExpertBatch batch(const void* w, const uint16_t* scales, int64_t E, int64_t rows, int64_t cols) const {
    if (cols > dq_cols) {
      dq = std::make_unique<DevBuf>(size_t(cuda::expert_digit_bytes(n, cols)));
      du = std::make_unique<DevBuf>(size_t(cuda::expert_digit_units(n, cols)) * 2);
      dq_cols = cols;
    }
    cuda::ExpertBatch b;
    b.x_rows = n;
    b.xq = dq->as<int8_t>();
    b.xunit = du->as<uint16_t>();
    b.w.rows = rows;
    b.w.cols = cols;
    b.w.int4 = true;
    b.w.w = w;
    b.w.scales = scales;
    b.w_stride_bytes = rows * cols / 2;
    b.scale_stride_elems = rows * (cols / 32);
    b.n_active = dn.as<int32_t>();
    b.act_expert = dae.as<int32_t>();
    b.act_off = dao.as<int32_t>();
    b.act_cnt = dac.as<int32_t>();
    b.in_row = din.as<int32_t>();
    b.out_row = dout.as<int32_t>();
    b.max_active = std::min(E, n * K);
    b.max_rows_per_expert = n;
    return b;
  }
};

}  // namespace kd::gpu_test
