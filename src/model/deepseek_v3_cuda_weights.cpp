// CudaTarget's weights: uploaded from DeepseekV3::layers() (the checkpoint's views), or made at
// random on the GPU for benchmarks. Device layout (docs/formats.md, "Device weight layout"):
// bf16 matrices row-major as stored; INT4 matrices keep compressed-tensors' packing (8 LSB-first
// nibbles per uint32 along the input, so one 16-byte load is exactly one group of 32 with one bf16
// scale); every MLP's gate and up rows are interleaved (row 2j = gate j, 2j+1 = up j) so one warp
// sees both and writes silu(gate)·up directly; a layer's routed experts lie back to back at a
// fixed stride, indexed by expert id.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/deepseek_v3_cuda_impl.h"
#include "core/error.h"
#include "core/log.h"

namespace kd {

using cuda::check;
using cuda::DevMatrix;

namespace {

void check_weight(const Weight& w) {
  if (w.int4) {
    if (w.group != 32) fail(w.name, ": INT4 group size ", w.group, "; the CUDA kernels take groups of 32");
    if (w.cols % 32) fail(w.name, ": ", w.cols, " inputs is not a multiple of 32 (INT4 groups)");
  } else {
    if (w.dtype != DType::BF16) fail(w.name, ": dtype ", dtype_name(w.dtype), "; the CUDA backend takes BF16 dense weights");
    if (w.cols % 8) fail(w.name, ": ", w.cols, " inputs is not a multiple of 8 (16-byte bf16 rows)");
  }
}

// Bytes of one row's weights and of its scales.
size_t row_bytes(const Weight& w) { return w.int4 ? size_t(w.cols / 8) * 4 : size_t(w.cols) * 2; }
size_t row_scale_bytes(const Weight& w) { return w.int4 ? size_t(w.cols / 32) * 2 : 0; }

struct Uploader {
  CudaTarget::Impl& m;
  Progress* progress = nullptr;

  void done(size_t bytes) {
    if (progress) progress->add(bytes);
  }

  float* vec(const std::vector<float>& v, const char* what) {
    float* p = static_cast<float*>(m.alloc(v.size() * 4, what));
    check(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), what);
    m.weight_bytes += v.size() * 4;
    done(v.size() * 2);  // stored as bf16: the checkpoint bytes it stands for
    return p;
  }

  // Writes rows of `parts` (1: as is; 2: interleaved gate/up) into dst (weights) and sdst (scales).
  static void interleave(const std::vector<const Weight*>& parts, std::vector<uint8_t>& w, std::vector<uint8_t>& s) {
    const Weight& a = *parts[0];
    const size_t rb = row_bytes(a), sb = row_scale_bytes(a), np = parts.size();
    w.resize(size_t(a.rows) * np * rb);
    s.resize(size_t(a.rows) * np * sb);
    for (int64_t r = 0; r < a.rows; ++r)
      for (size_t k = 0; k < np; ++k) {
        const Weight& p = *parts[k];
        std::memcpy(&w[(size_t(r) * np + k) * rb], static_cast<const uint8_t*>(p.data) + size_t(r) * rb, rb);
        if (sb) std::memcpy(&s[(size_t(r) * np + k) * sb], reinterpret_cast<const uint8_t*>(p.scales) + size_t(r) * sb, sb);
      }
  }

  DevMatrix matrix(const std::vector<const Weight*>& parts) {
    const Weight& a = *parts[0];
    for (const Weight* p : parts) {
      check_weight(*p);
      if (p->int4 != a.int4 || p->rows != a.rows || p->cols != a.cols) fail(p->name, ": gate and up differ in shape or format");
    }
    std::vector<uint8_t> w, s;
    interleave(parts, w, s);
    DevMatrix d;
    d.rows = a.rows * int64_t(parts.size());
    d.cols = a.cols;
    d.int4 = a.int4;
    void* pw = m.alloc(w.size(), a.name.c_str());
    check(cudaMemcpy(pw, w.data(), w.size(), cudaMemcpyHostToDevice), "upload weights");
    d.w = pw;
    if (!s.empty()) {
      void* ps = m.alloc(s.size(), a.name.c_str());
      check(cudaMemcpy(ps, s.data(), s.size(), cudaMemcpyHostToDevice), "upload scales");
      d.scales = static_cast<const uint16_t*>(ps);
    }
    m.weight_bytes += w.size() + s.size();
    done(w.size() + s.size());
    return d;
  }
  DevMatrix matrix(const Weight& w) { return matrix(std::vector<const Weight*>{&w}); }
  DevMatrix gate_up(const MlpWeights& mw) { return matrix(std::vector<const Weight*>{&mw.gate, &mw.up}); }

  // [E] experts back to back: gate/up interleaved, and down.
  void experts(const std::vector<MlpWeights>& ex, DevLayer& L) {
    const int64_t E = int64_t(ex.size());
    std::vector<uint8_t> w, s;
    auto place = [&](const std::vector<const Weight*>& parts, DevMatrix& d, int64_t& wstride, int64_t& sstride) {
      const Weight& a = *parts[0];
      for (const Weight* p : parts) check_weight(*p);
      const size_t np = parts.size(), wb = size_t(a.rows) * np * row_bytes(a), sb = size_t(a.rows) * np * row_scale_bytes(a);
      d.rows = a.rows * int64_t(np);
      d.cols = a.cols;
      d.int4 = a.int4;
      uint8_t* pw = static_cast<uint8_t*>(m.alloc(wb * size_t(E), "routed experts"));
      uint8_t* ps = sb ? static_cast<uint8_t*>(m.alloc(sb * size_t(E), "routed expert scales")) : nullptr;
      d.w = pw;
      d.scales = reinterpret_cast<const uint16_t*>(ps);
      wstride = int64_t(wb);
      sstride = int64_t(sb / 2);
      m.weight_bytes += (wb + sb) * size_t(E);
      return std::make_pair(pw, ps);
    };
    auto [gw, gs] = place({&ex[0].gate, &ex[0].up}, L.exp_gu, L.gu_stride_bytes, L.gu_scale_stride);
    auto [dw, ds] = place({&ex[0].down}, L.exp_down, L.down_stride_bytes, L.down_scale_stride);
    for (int64_t e = 0; e < E; ++e) {
      const MlpWeights& x = ex[size_t(e)];
      for (const Weight* p : {&x.gate, &x.up, &x.down}) {
        check_weight(*p);
        if (p->int4 != ex[0].gate.int4) fail(p->name, ": routed experts mix INT4 and dense formats");
      }
      if (x.gate.rows != ex[0].gate.rows || x.gate.cols != ex[0].gate.cols || x.down.rows != ex[0].down.rows ||
          x.down.cols != ex[0].down.cols)
        fail(x.gate.name, ": routed experts differ in shape");
      interleave({&x.gate, &x.up}, w, s);
      check(cudaMemcpy(gw + e * L.gu_stride_bytes, w.data(), w.size(), cudaMemcpyHostToDevice), "upload experts");
      if (gs) check(cudaMemcpy(gs + e * L.gu_scale_stride * 2, s.data(), s.size(), cudaMemcpyHostToDevice), "upload experts");
      interleave({&x.down}, w, s);
      check(cudaMemcpy(dw + e * L.down_stride_bytes, w.data(), w.size(), cudaMemcpyHostToDevice), "upload experts");
      if (ds) check(cudaMemcpy(ds + e * L.down_scale_stride * 2, s.data(), s.size(), cudaMemcpyHostToDevice), "upload experts");
      done(size_t(L.gu_stride_bytes + L.gu_scale_stride * 2 + L.down_stride_bytes + L.down_scale_stride * 2));
    }
  }
};

// Random weights on the device: values of unit-scale outputs for unit-scale inputs (the benchmark
// needs finite, non-zero, non-degenerate data; its numbers mean nothing).
struct RandomMaker {
  CudaTarget::Impl& m;
  uint64_t seed;

  DevMatrix matrix(int64_t rows, int64_t cols, bool int4, int64_t copies = 1, int64_t* wstride = nullptr,
                   int64_t* sstride = nullptr) {
    DevMatrix d;
    d.rows = rows;
    d.cols = cols;
    d.int4 = int4;
    const float a = float(std::sqrt(3.0 / double(cols)));
    if (int4) {
      const int64_t words = rows * cols / 8, scales = rows * cols / 32;
      uint32_t* w = static_cast<uint32_t*>(m.alloc(size_t(words * copies) * 4, "random INT4 weights"));
      uint16_t* s = static_cast<uint16_t*>(m.alloc(size_t(scales * copies) * 2, "random INT4 scales"));
      cuda::fill_words(w, words * copies, seed++, nullptr);
      cuda::fill_bf16(s, scales * copies, a / 4.6f, seed++, nullptr);  // nibble − 8 has σ ≈ 4.6
      d.w = w;
      d.scales = s;
      if (wstride) *wstride = words * 4;
      if (sstride) *sstride = scales;
      m.weight_bytes += uint64_t(words * 4 + scales * 2) * uint64_t(copies);
    } else {
      uint16_t* w = static_cast<uint16_t*>(m.alloc(size_t(rows * cols * copies) * 2, "random bf16 weights"));
      cuda::fill_bf16(w, rows * cols * copies, a, seed++, nullptr);
      d.w = w;
      if (wstride) *wstride = rows * cols * 2;
      if (sstride) *sstride = 0;
      m.weight_bytes += uint64_t(rows * cols * 2) * uint64_t(copies);
    }
    return d;
  }
  float* vec(int64_t n, float lo, float hi) {
    float* p = static_cast<float*>(m.alloc(size_t(n) * 4, "random vector"));
    cuda::fill_f32(p, n, lo, hi, seed++, nullptr);
    m.weight_bytes += uint64_t(n) * 4;
    return p;
  }
};

}  // namespace

void CudaTarget::Impl::finish_layer_bytes() {
  const ModelConfig& c = cfg;
  for (DevLayer& L : layers) {
    L.attn_bytes = matrix_bytes(L.q_a) + matrix_bytes(L.q_b) + matrix_bytes(L.kv_a) + matrix_bytes(L.kv_b) + matrix_bytes(L.o) +
                   uint64_t(2 * c.hidden_size + c.q_lora_rank + c.kv_lora_rank) * 4;
    if (!L.moe) {
      L.dense_bytes = matrix_bytes(L.dense_gu) + matrix_bytes(L.dense_down);
    } else {
      L.dense_bytes = matrix_bytes(L.router) + uint64_t(c.n_routed_experts) * 4;
      if (L.has_shared) L.dense_bytes += matrix_bytes(L.sh_gu) + matrix_bytes(L.sh_down);
      L.expert_bytes = matrix_bytes(L.exp_gu) + matrix_bytes(L.exp_down);
    }
  }
}

CudaTarget::CudaTarget(const DeepseekV3& model, int64_t max_tokens, Progress* progress) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = model.config();
  m.lm_rows = model.vocab_rows();
  m.vocab_begin = model.vocab_begin();
  if (model.tp().ranks > 1) {
    // A tensor-parallel rank's slice: its heads and MLP widths are the shapes its kernels run.
    ModelConfig& lc = m.cfg;
    const LayerWeights& l0 = model.layers()[0];
    lc.num_attention_heads = l0.q_b.rows / lc.qk_head_dim();
    for (const LayerWeights& w : model.layers()) {
      if (w.moe && !w.experts.empty()) lc.moe_intermediate_size = w.experts[0].gate.rows;
      if (!w.moe) lc.intermediate_size = w.dense.gate.rows;
    }
    m.graphs = false;  // the emulation's reductions synchronise ranks through the host: not capturable
  }
  const ModelConfig& c = m.cfg;
  m.init_common(max_tokens);
  Uploader up{m, progress};
  check_weight(model.embedding());
  if (model.embedding().int4) fail(model.embedding().name, ": the CUDA backend needs a BF16 embedding");
  {
    const DevMatrix e = up.matrix(model.embedding());
    m.embed = static_cast<uint16_t*>(const_cast<void*>(e.w));
  }
  m.lm_head = up.matrix(model.lm_head());
  m.final_norm = up.vec(model.final_norm(), "final norm");
  m.layers.resize(size_t(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = model.layers()[size_t(l)];
    DevLayer& L = m.layers[size_t(l)];
    L.attn_norm = up.vec(w.attn_norm, "attn norm");
    L.ffn_norm = up.vec(w.ffn_norm, "ffn norm");
    L.q_a_norm = up.vec(w.q_a_norm, "q_a norm");
    L.kv_a_norm = up.vec(w.kv_a_norm, "kv_a norm");
    L.q_a = up.matrix(w.q_a);
    L.q_b = up.matrix(w.q_b);
    L.kv_a = up.matrix(w.kv_a);
    if (w.kv_b.int4) fail(w.kv_b.name, ": the CUDA attention kernel reads kv_b as BF16 (it is INT4 here)");
    L.kv_b = up.matrix(w.kv_b);
    L.o = up.matrix(w.o);
    L.moe = w.moe;
    if (!w.moe) {
      L.dense_gu = up.gate_up(w.dense);
      L.dense_down = up.matrix(w.dense.down);
      continue;
    }
    L.router = up.matrix(w.router);
    L.router_bias = up.vec(w.router_bias, "router bias");
    up.experts(w.experts, L);
    L.has_shared = c.n_shared_experts > 0;
    if (L.has_shared) {
      L.sh_gu = up.gate_up(w.shared);
      L.sh_down = up.matrix(w.shared.down);
    }
  }
  m.finish_layer_bytes();
  check(cudaDeviceSynchronize(), "weight upload");
}

void CudaTarget::add_draft_lm_head(const Weight& lm_head) {
  Impl& m = *impl_;
  if (m.full_lm_head.w || m.lm_rows == m.cfg.vocab_size) return;  // done, or this target holds every row
  if (lm_head.rows != m.cfg.vocab_size || lm_head.cols != m.cfg.hidden_size)
    fail(lm_head.name, ": a GPU drafter needs the whole lm_head [", m.cfg.vocab_size, ", ", m.cfg.hidden_size, "], got [",
         lm_head.rows, ", ", lm_head.cols, "]");
  check_weight(lm_head);
  const uint64_t bytes = lm_head.bytes();  // (what the upload allocates, for the formats check_weight takes)
  const int64_t free_b = free_device_bytes();
  if (int64_t(bytes) + (int64_t(1) << 30) > free_b)
    fail("a GPU drafter beside tensor-parallel rank 0 needs the whole lm_head on that GPU (", double(bytes) / 1e9,
         " GB) and 1 GB to spare, but only ", double(free_b) / 1e9,
         " GB are free there after the weights: use more ranks (--tp) or GPUs with more memory");
  Uploader up{m, nullptr};
  m.full_lm_head = up.matrix(lm_head);
  if (m.kv_cap_bytes >= 0) m.kv_cap_bytes = std::max<int64_t>(0, m.kv_cap_bytes - int64_t(bytes));
  check(cudaDeviceSynchronize(), "drafter lm_head upload");
}

CudaTarget::CudaTarget(const ModelConfig& cfg, int64_t max_tokens, uint64_t seed, bool int4_experts)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = cfg;
  m.lm_rows = cfg.vocab_size;
  const ModelConfig& c = m.cfg;
  m.init_common(max_tokens);
  RandomMaker r{m, seed};
  const int64_t hid = c.hidden_size, H = c.num_attention_heads;
  {
    const DevMatrix e = r.matrix(c.vocab_size, hid, false);
    m.embed = static_cast<uint16_t*>(const_cast<void*>(e.w));
  }
  m.lm_head = r.matrix(c.vocab_size, hid, false);
  m.final_norm = r.vec(hid, 0.9f, 1.1f);
  m.layers.resize(size_t(c.num_hidden_layers));
  const int64_t mi = c.moe_intermediate_size;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DevLayer& L = m.layers[size_t(l)];
    L.attn_norm = r.vec(hid, 0.9f, 1.1f);
    L.ffn_norm = r.vec(hid, 0.9f, 1.1f);
    L.q_a_norm = r.vec(c.q_lora_rank, 0.9f, 1.1f);
    L.kv_a_norm = r.vec(c.kv_lora_rank, 0.9f, 1.1f);
    L.q_a = r.matrix(c.q_lora_rank, hid, false);
    L.q_b = r.matrix(H * c.qk_head_dim(), c.q_lora_rank, false);
    L.kv_a = r.matrix(c.latent_dim(), hid, false);
    L.kv_b = r.matrix(H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, false);
    L.o = r.matrix(hid, H * c.v_head_dim, false);
    L.moe = c.is_moe_layer(l);
    if (!L.moe) {
      L.dense_gu = r.matrix(2 * c.intermediate_size, hid, false);
      L.dense_down = r.matrix(hid, c.intermediate_size, false);
      continue;
    }
    L.router = r.matrix(c.n_routed_experts, hid, false);
    L.router_bias = r.vec(c.n_routed_experts, -0.01f, 0.01f);
    L.exp_gu = r.matrix(2 * mi, hid, int4_experts, c.n_routed_experts, &L.gu_stride_bytes, &L.gu_scale_stride);
    L.exp_down = r.matrix(hid, mi, int4_experts, c.n_routed_experts, &L.down_stride_bytes, &L.down_scale_stride);
    L.has_shared = c.n_shared_experts > 0;
    if (L.has_shared) {
      L.sh_gu = r.matrix(2 * mi * c.n_shared_experts, hid, false);
      L.sh_down = r.matrix(hid, mi * c.n_shared_experts, false);
    }
  }
  m.finish_layer_bytes();
  check(cudaDeviceSynchronize(), "random weights");
}

}  // namespace kd
