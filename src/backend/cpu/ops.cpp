#include "backend/cpu/ops.h"

#include "backend/cpu/dot.h"
#include "backend/cpu/tile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace kd::cpu {

void dequant_row(const Weight& w, int64_t r, float* out) {
  const int64_t k = w.cols;
  if (w.int4) {
    const uint32_t* words = static_cast<const uint32_t*>(w.data) + r * w.words_per_row();
    const uint16_t* sc = w.scales + r * (k / w.group);
    if (w.group % 8 == 0 && k % 8 == 0) {
      const int64_t words_per_group = w.group / 8;
      for (int64_t g = 0; g < k / w.group; ++g) {
        const float s = bf16_to_f32(sc[g]);
        for (int64_t j = 0; j < words_per_group; ++j) {
          uint32_t word = words[g * words_per_group + j];
          float* o = out + (g * words_per_group + j) * 8;
          for (int i = 0; i < 8; ++i) o[i] = float(int32_t((word >> (4 * i)) & 0xfu) - 8) * s;
        }
      }
    } else {  // general group size / a ragged last word
      for (int64_t c = 0; c < k; ++c) {
        uint32_t nib = (words[c / 8] >> (4 * (c % 8))) & 0xfu;
        out[c] = float(int32_t(nib) - 8) * bf16_to_f32(sc[c / w.group]);
      }
    }
    return;
  }
  switch (w.dtype) {
    case DType::F32:
      std::memcpy(out, static_cast<const float*>(w.data) + r * k, size_t(k) * sizeof(float));
      return;
    case DType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + r * k;
      for (int64_t c = 0; c < k; ++c) out[c] = bf16_to_f32(p[c]);
      return;
    }
    case DType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + r * k;
      for (int64_t c = 0; c < k; ++c) out[c] = f16_to_f32(p[c]);
      return;
    }
    default:
      fail(w.name, ": dtype ", dtype_name(w.dtype), " cannot be used as a weight");
  }
}

void linear(const Weight& w, const float* x, int64_t m, float* y) {
  constexpr int64_t kBlock = 8, kFusedMaxRows = 2;
  const int64_t n_rows = w.rows, k = w.cols;
  const int64_t n_blocks = (n_rows + kBlock - 1) / kBlock;
  // Split only when each thread gets enough work to outweigh a hand-off: ~2^17 multiply-adds (5–10 µs
  // on one core). Waking a sleeping or descheduled worker costs that much or more on a shared 2-core
  // machine; below it (a small drafter's 64-wide matrices) one thread is faster.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, kBlock * k * m));
  if (tiled_supported(w)) {
    // BF16 and INT4 (tile.h): every weight row read once for all m inputs, decoded once per tile of
    // kTileRows, bit-identical per (row, input) to the paths below.
    // The caller's scratch (per-expert MLPs run on several threads at once). A lambda names a
    // thread_local afresh on each thread, so the workers get the pointer, not the name.
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(m * padded_cols(k)));
    float* xp = scratch.data();
    permute_inputs(x, m, k, xp);
    ThreadPool::global().parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
      tiled_rows(w, xp, m, b0 * kBlock, std::min(n_rows, b1 * kBlock), y, n_rows);
    });
    return;
  }
  // Two paths with bit-identical results (dot.h) for the other encodings (F32, F16, INT4 groups
  // tile.h does not take): small batches (decode) dot straight from the stored encoding, streaming
  // each weight row once per input from L1; larger batches dequantise a block of rows once and run
  // every input against it.
  const bool fused = m <= kFusedMaxRows &&
                     (w.int4 ? dot_int4_supported(k, w.group) : (w.dtype == DType::BF16 || w.dtype == DType::F32));
  ThreadPool::global().parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t r_begin = b0 * kBlock, r_end = std::min(n_rows, b1 * kBlock);
    if (fused) {
      for (int64_t r = r_begin; r < r_end; ++r)
        for (int64_t i = 0; i < m; ++i) {
          const float* xi = x + i * k;
          float v;
          if (w.int4)
            v = dot_int4(static_cast<const uint32_t*>(w.data) + r * w.words_per_row(), w.scales + r * (k / w.group), w.group, xi, k);
          else if (w.dtype == DType::BF16)
            v = dot_bf16(static_cast<const uint16_t*>(w.data) + r * k, xi, k);
          else
            v = dot_f32(static_cast<const float*>(w.data) + r * k, xi, k);
          y[i * n_rows + r] = v;
        }
      return;
    }
    std::vector<float> buf(static_cast<size_t>(kBlock * k));
    for (int64_t r0 = r_begin; r0 < r_end; r0 += kBlock) {
      const int64_t r1 = std::min(r_end, r0 + kBlock);
      for (int64_t r = r0; r < r1; ++r) dequant_row(w, r, buf.data() + (r - r0) * k);
      // Pairs of weight rows × pairs of inputs share their loads; leftovers take dot_f32. All paths
      // give the same bits per (row, input).
      int64_t i = 0;
      for (; i + 2 <= m; i += 2) {
        const float *x0 = x + i * k, *x1 = x0 + k;
        int64_t r = r0;
        for (; r + 2 <= r1; r += 2) {
          float o[4];
          dot_f32_2x2(buf.data() + (r - r0) * k, buf.data() + (r + 1 - r0) * k, x0, x1, k, o);
          y[i * n_rows + r] = o[0];
          y[(i + 1) * n_rows + r] = o[1];
          y[i * n_rows + r + 1] = o[2];
          y[(i + 1) * n_rows + r + 1] = o[3];
        }
        for (; r < r1; ++r) {
          y[i * n_rows + r] = dot_f32(buf.data() + (r - r0) * k, x0, k);
          y[(i + 1) * n_rows + r] = dot_f32(buf.data() + (r - r0) * k, x1, k);
        }
      }
      for (; i < m; ++i)
        for (int64_t r = r0; r < r1; ++r) y[i * n_rows + r] = dot_f32(buf.data() + (r - r0) * k, x + i * k, k);
    }
  });
}

void embed(const Weight& w, const int32_t* ids, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) dequant_row(w, ids[i], out + i * w.cols);
}

void rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += double(xr[i]) * double(xr[i]);
    const float inv = float(1.0 / std::sqrt(ss / double(dim) + eps));
    for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

void rope_gptj(float* v, int64_t half, const float* inv_freq, int64_t position, float attn_scaling) {
  for (int64_t i = 0; i < half; ++i) {
    // HF forms the angle as fp32(inv_freq) × fp32(position) in fp32.
    const float angle = inv_freq[i] * float(position);
    const float c = std::cos(angle) * attn_scaling, s = std::sin(angle) * attn_scaling;
    const float a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = a * c - b * s;
    v[2 * i + 1] = b * c + a * s;
  }
}

void swiglu(const float* g, const float* u, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

}  // namespace kd::cpu
