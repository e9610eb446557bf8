// CudaDFlash: the DFlash drafter's forward on the device, in the order of DFlashDrafter's
// append_context / draft (src/model/dflash.cpp), with the backend's bf16 linear and rmsnorm
// kernels and dflash_kernels.cu for the per-head norm + RoPE and the block attention.
#include "model/dflash_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/deepseek_v3_cuda_impl.h"
#include "backend/cuda/draft_top_k.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/dflash.h"

namespace kd {

using cuda::check;
using cuda::DevMatrix;

namespace {

struct DraftLayer {
  float *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;  // fp32
  DevMatrix q, k, v, o, gu, down;  // bf16; gu: gate/up rows interleaved (the swiglu epilogue)
  float *kc = nullptr, *vc = nullptr;  // context K/V fp32 [cap + B, kv_dim]; rows ≥ len: the block's
};

// Device memory freed with its owner.
struct DeviceAllocs {
  std::vector<void*> ptrs;
  DeviceAllocs() = default;
  DeviceAllocs(const DeviceAllocs&) = delete;
  DeviceAllocs& operator=(const DeviceAllocs&) = delete;
  ~DeviceAllocs() {
    for (void* p : ptrs) cudaFree(p);
  }
  void* alloc(size_t bytes, const char* what) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    if (e != cudaSuccess) fail("CUDA drafter: cannot allocate ", double(bytes) / 1e6, " MB for ", what, ": ", cudaGetErrorString(e));
    ptrs.push_back(p);
    return p;
  }
  float* fbuf(int64_t n, const char* what) { return static_cast<float*>(alloc(size_t(n) * 4, what)); }
};

}  // namespace

// The shared device weights (layers[].kc / vc unused: the context is each sequence's own).
struct CudaDFlashWeights::Impl {
  std::shared_ptr<const DFlashDrafter> host;  // config and the validated tensors (in the mmap)
  int device = 0;
  uint64_t bytes = 0;
  DeviceAllocs mem;
  DevMatrix fc;
  float *hidden_norm = nullptr, *final_norm = nullptr, *inv_freq = nullptr;
  std::vector<DraftLayer> layers;

  void* upload(const void* src, size_t n, const std::string& what) {
    void* p = mem.alloc(n, what.c_str());
    check(cudaMemcpy(p, src, n, cudaMemcpyHostToDevice), "upload drafter weights");
    bytes += n;
    return p;
  }
  // The tensors DFlashDrafter validated (name, dtype, shape), read in place from its shards.
  float* vec(const std::string& name) {
    const TensorRef& t = host->shards().get(name);
    const TensorInfo& ti = *t.info;
    const int64_t n = ti.shape.empty() ? 1 : ti.shape.back();
    std::vector<uint8_t> raw(ti.nbytes());
    std::memcpy(raw.data(), t.data(), raw.size());  // the file may leave it misaligned
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (ti.dtype == DType::F32) {
        std::memcpy(&v[size_t(i)], &raw[size_t(i) * 4], 4);
      } else {
        uint16_t b;
        std::memcpy(&b, &raw[size_t(i) * 2], 2);
        v[size_t(i)] = ti.dtype == DType::BF16 ? bf16_to_f32(b) : f16_to_f32(b);
      }
    }
    return static_cast<float*>(upload(v.data(), v.size() * 4, name));
  }
  // One bf16 matrix, or gate and up with their rows interleaved (row 2j = gate j, 2j+1 = up j).
  DevMatrix matrix(const std::vector<std::string>& names) {
    DevMatrix d;
    std::vector<const uint8_t*> src;
    for (const std::string& n : names) {
      const TensorRef& t = host->shards().get(n);
      const TensorInfo& ti = *t.info;
      if (ti.dtype != DType::BF16)
        fail(t.file->path(), ": tensor '", n, "' is ", dtype_name(ti.dtype), "; the GPU drafter takes BF16 matrices (use --device cpu)");
      d.rows = ti.shape[0];
      d.cols = ti.shape[1];
      if (d.cols % 8) fail(t.file->path(), ": tensor '", n, "' has ", d.cols, " inputs, not a multiple of 8 (16-byte bf16 rows)");
      src.push_back(t.data());
    }
    const size_t rb = size_t(d.cols) * 2, np = src.size();
    std::vector<uint8_t> w(size_t(d.rows) * np * rb);
    for (int64_t r = 0; r < d.rows; ++r)
      for (size_t k = 0; k < np; ++k) std::memcpy(&w[(size_t(r) * np + k) * rb], src[k] + size_t(r) * rb, rb);
    d.rows *= int64_t(np);
    d.w = upload(w.data(), w.size(), names[0]);
    return d;
  }
};

CudaDFlashWeights::CudaDFlashWeights(std::shared_ptr<const DFlashDrafter> host) : impl_(std::make_unique<Impl>()) {
  if (!host) fail("CUDA drafter: no drafter weights given");
  Impl& m = *impl_;
  m.host = std::move(host);
  check(cudaGetDevice(&m.device), "CUDA drafter: current device");
  const DFlashConfig& c = m.host->config();
  m.fc = m.matrix({"fc.weight"});
  m.hidden_norm = m.vec("hidden_norm.weight");
  m.final_norm = m.vec("norm.weight");
  m.layers.resize(size_t(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DraftLayer& w = m.layers[size_t(l)];
    const std::string p = cat("layers.", l, ".");
    w.attn_norm = m.vec(p + "input_layernorm.weight");
    w.ffn_norm = m.vec(p + "post_attention_layernorm.weight");
    w.q_norm = m.vec(p + "self_attn.q_norm.weight");
    w.k_norm = m.vec(p + "self_attn.k_norm.weight");
    w.q = m.matrix({p + "self_attn.q_proj.weight"});
    w.k = m.matrix({p + "self_attn.k_proj.weight"});
    w.v = m.matrix({p + "self_attn.v_proj.weight"});
    w.o = m.matrix({p + "self_attn.o_proj.weight"});
    w.gu = m.matrix({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"});
    w.down = m.matrix({p + "mlp.down_proj.weight"});
  }
  const std::vector<float> f = c.rope_inv_freq();
  m.inv_freq = static_cast<float*>(m.upload(f.data(), f.size() * 4, "drafter RoPE frequencies"));
}

CudaDFlashWeights::~CudaDFlashWeights() = default;
const DFlashDrafter& CudaDFlashWeights::host() const { return *impl_->host; }
uint64_t CudaDFlashWeights::device_bytes() const { return impl_->bytes; }

struct CudaDFlash::Impl {
  CudaTarget::Impl& t;  // embedding, lm_head (draft_lm_head: every row) and stream are the target's
  std::shared_ptr<const CudaDFlashWeights> weights;
  const DFlashDrafter& cpu;  // config (the shared host drafter; its weights stay in the mmap)
  std::vector<int32_t> taps_of;
  DeviceAllocs mem;  // this sequence's context and work buffers
  // The shared weights' device pointers (layers[].kc / vc: this sequence's context K/V).
  DevMatrix fc;
  float *hidden_norm = nullptr, *final_norm = nullptr, *inv_freq = nullptr;
  std::vector<DraftLayer> layers;
  int64_t cap = 0, len = 0, ht_rows = 0;
  // Work: x, xn, y [B, hid]; q, attn [B, q_dim]; h [B, inter]; scores [B, heads, cap + B];
  // logits [B − 1, vocab]; ids [B]; ctx_taps/ht grow with the largest append.
  float *x = nullptr, *xn = nullptr, *q = nullptr, *attn = nullptr, *h = nullptr, *scores = nullptr, *logits = nullptr;
  float *ctx_taps = nullptr, *ht = nullptr;
  float* stage = nullptr;  // [kStageRows, taps, hidden]: staged rows waiting for the next update
  int64_t staged = 0;
  int32_t* ids = nullptr;
  DeviceDraftTopK top_k;

  Impl(std::shared_ptr<const CudaDFlashWeights> w, CudaTarget::Impl& target)
      : t(target), weights(std::move(w)), cpu(weights->host()) {}
  void* alloc(size_t bytes, const char* what) { return mem.alloc(bytes, what); }
  float* fbuf(int64_t n, const char* what) { return mem.fbuf(n, what); }
  void ensure_append_rows(int64_t n);
  void append(const float* taps_dev, int64_t n, const int32_t* rows);  // the context update itself
  // The checks an append or a stage of n device rows shares; false: nothing to do (n = 0).
  bool accepts(const float* taps_dev, int64_t n, const char* what) const {
    if (n < 0) fail("DFlash ", what, ": negative token count ", n);
    if (n == 0) return false;
    if (len + staged + n > cap) fail("DFlash draft context full: ", len + staged, " + ", n, " tokens exceed the limit of ", cap);
    if (!taps_dev) fail("DFlash ", what, ": no device taps");
    return true;
  }
  void flush_staged() {
    const int64_t n = staged;
    staged = 0;
    if (n) append(stage, n, nullptr);
  }
  void block_forward(int32_t bonus, int64_t start);  // queues the draft; logits [B − 1, vocab] in `logits`
};

void CudaDFlash::Impl::ensure_append_rows(int64_t n) {
  if (n <= ht_rows) return;
  const DFlashConfig& c = cpu.config();
  ctx_taps = fbuf(n * c.n_taps() * c.hidden_size, "drafter context taps");
  ht = fbuf(n * c.hidden_size, "drafter context features");
  ht_rows = n;
}

CudaDFlash::CudaDFlash(std::shared_ptr<const CudaDFlashWeights> weights, CudaTarget& target, int64_t max_tokens) {
  if (!weights) fail("CUDA drafter: no drafter weights given");
  impl_ = std::make_unique<Impl>(std::move(weights), target.impl());
  Impl& m = *impl_;
  const DFlashConfig& c = m.cpu.config();
  check_fits_target(c, m.t.cfg, m.cpu.dir() + "/config.json", /*warn=*/false);
  if (m.t.draft_lm_head().rows != c.vocab_size)
    fail("CUDA drafter ", m.cpu.dir(), ": its target holds ", m.t.draft_lm_head().rows, " of the ", c.vocab_size,
         " rows of lm_head (a tensor-parallel rank): CudaTarget::add_draft_lm_head must upload the whole matrix first");
  const CudaDFlashWeights::Impl& W = m.weights->impl();
  // The thread that builds a sequence's drafter (the engine's, for a tensor-parallel rank 0 on GPU N) takes
  // its weights' GPU, where the drafter's buffers, kernels and the target's stream live.
  check(cudaSetDevice(W.device), "CUDA drafter: select its weights' GPU");
  for (int64_t l : c.target_layer_ids) m.taps_of.push_back(int32_t(l));
  m.fc = W.fc;
  m.hidden_norm = W.hidden_norm;
  m.final_norm = W.final_norm;
  m.inv_freq = W.inv_freq;
  m.layers = W.layers;
  const int64_t B = c.block_size, H = c.hidden_size;
  m.cap = std::clamp<int64_t>(max_tokens, 0, c.max_position_embeddings);
  for (DraftLayer& w : m.layers) {
    w.kc = m.fbuf((m.cap + B) * c.kv_dim(), "drafter context K");
    w.vc = m.fbuf((m.cap + B) * c.kv_dim(), "drafter context V");
  }
  m.x = m.fbuf(B * H, "drafter x");
  m.xn = m.fbuf(B * H, "drafter xn");
  m.q = m.fbuf(B * c.q_dim(), "drafter q");
  m.attn = m.fbuf(B * c.q_dim(), "drafter attention");
  m.h = m.fbuf(B * c.intermediate_size, "drafter MLP");
  m.scores = m.fbuf(B * c.num_attention_heads * (m.cap + B), "drafter scores");
  m.logits = m.fbuf((B - 1) * c.vocab_size, "drafter logits");
  m.ids = static_cast<int32_t*>(m.alloc(size_t(B) * 4, "drafter block ids"));
  std::vector<int32_t> block(static_cast<size_t>(B), c.mask_token_id);
  check(cudaMemcpy(m.ids, block.data(), block.size() * 4, cudaMemcpyHostToDevice), "upload block ids");
}

CudaDFlash::CudaDFlash(const std::string& dir, CudaTarget& target, int64_t max_tokens)
    : CudaDFlash(std::make_shared<const CudaDFlashWeights>(DFlashDrafter::load(dir, target.impl().cfg)), target, max_tokens) {}

CudaDFlash::~CudaDFlash() = default;

std::string CudaDFlash::name() const { return "DFlash on the GPU (" + impl_->cpu.dir() + ")"; }
int64_t CudaDFlash::block_size() const { return impl_->cpu.config().block_size; }
const std::vector<int32_t>& CudaDFlash::tap_layers() const { return impl_->taps_of; }
int64_t CudaDFlash::context_len() const { return impl_->len + impl_->staged; }
void CudaDFlash::reset() { impl_->len = 0, impl_->staged = 0; }

void CudaDFlash::append_context(const float* taps, int64_t n) {
  Impl& m = *impl_;
  if (n < 0) fail("DFlash append_context: negative token count ", n);
  if (n == 0) return;
  if (!taps) fail("DFlash append_context: no taps");
  const DFlashConfig& c = m.cpu.config();
  m.flush_staged();  // staged rows first, in order
  m.ensure_append_rows(n);
  check(cudaMemcpyAsync(m.ctx_taps, taps, size_t(n * c.n_taps() * c.hidden_size) * 4, cudaMemcpyHostToDevice, m.t.stream),
        "upload drafter taps");
  append_context_device(m.ctx_taps, n, nullptr);
}

void CudaDFlash::append_context_device(const float* taps_dev, int64_t n, const int32_t* rows) {
  Impl& m = *impl_;
  if (!m.accepts(taps_dev, n, "append_context")) return;
  m.flush_staged();
  m.append(taps_dev, n, rows);
}

void CudaDFlash::stage_context_device(const float* taps_dev, int64_t n) {
  Impl& m = *impl_;
  if (!m.accepts(taps_dev, n, "stage_context")) return;
  if (n > kStageRows) return append_context_device(taps_dev, n, nullptr);  // more than a buffer: straight in
  const DFlashConfig& c = m.cpu.config();
  const int64_t F = c.n_taps() * c.hidden_size;
  if (m.staged + n > kStageRows) m.flush_staged();
  if (!m.stage) m.stage = m.fbuf(kStageRows * F, "drafter staged taps");
  // Queued on the target's stream: the copy reads the taps before the next forward rewrites them.
  check(cudaMemcpyAsync(m.stage + m.staged * F, taps_dev, size_t(n * F) * 4, cudaMemcpyDeviceToDevice, m.t.stream),
        "stage drafter taps");
  m.staged += n;
}

void CudaDFlash::Impl::append(const float* taps_dev, int64_t n, const int32_t* rows) {
  Impl& m = *this;
  const DFlashConfig& c = m.cpu.config();
  if (m.len + n > m.cap) fail("DFlash draft context full: ", m.len, " + ", n, " tokens exceed the limit of ", m.cap);
  const int64_t H = c.hidden_size, F = c.n_taps() * H, kvd = c.kv_dim();
  cudaStream_t s = m.t.stream;
  m.ensure_append_rows(n);
  const float* src = taps_dev;
  if (rows) {
    // The kept rows of a verify forward, gathered (ascending path rows: small device copies).
    for (int64_t k = 0; k < n; ++k)
      check(cudaMemcpyAsync(m.ctx_taps + k * F, taps_dev + int64_t(rows[k]) * F, size_t(F) * 4, cudaMemcpyDeviceToDevice, s),
            "gather drafter taps");
    src = m.ctx_taps;
  }
  // Ht = hidden_norm(fc(taps)) [n, H]; every layer's K = RoPE(k_norm(Wk·Ht)), V = Wv·Ht.
  cuda::linear(m.fc, src, F, n, m.ht, H, cuda::Epilogue::store, s);
  cuda::rmsnorm(m.ht, H, m.hidden_norm, n, H, c.rms_norm_eps, m.ht, H, s);
  for (DraftLayer& w : m.layers) {
    float* kn = w.kc + m.len * kvd;
    cuda::linear(w.k, m.ht, H, n, kn, kvd, cuda::Epilogue::store, s);
    cuda::linear(w.v, m.ht, H, n, w.vc + m.len * kvd, kvd, cuda::Epilogue::store, s);
    cuda::head_norm_rope(kn, n, c.num_key_value_heads, c.head_dim, w.k_norm, c.rms_norm_eps, m.inv_freq, m.len,
                         float(c.rope_attention_factor), s);
  }
  m.len += n;
}

void CudaDFlash::draft(int32_t bonus, int64_t start, float* logits) {
  Impl& m = *impl_;
  const DFlashConfig& c = m.cpu.config();
  m.block_forward(bonus, start);
  check(cudaMemcpyAsync(logits, m.logits, size_t((c.block_size - 1) * c.vocab_size) * 4, cudaMemcpyDeviceToHost, m.t.stream),
        "download draft logits");
  check(cudaStreamSynchronize(m.t.stream), "draft");
}

DraftTopK CudaDFlash::draft_top_k(int32_t bonus, int64_t start, int64_t L, int64_t k) {
  Impl& m = *impl_;
  const DFlashConfig& c = m.cpu.config();
  if (L < 1 || L > c.block_size - 1) fail("DFlash draft: ", L, " positions asked; the block drafts 1 … ", c.block_size - 1);
  m.block_forward(bonus, start);
  return m.top_k.run(m.logits, L, c.vocab_size, k, m.t.stream);
}

int64_t CudaDFlash::top_k_fallback_rows() const { return impl_->top_k.fallback_rows(); }

bool CudaDFlash::top_k_on_device(int32_t bonus, int64_t start, int64_t L, int64_t k, DraftTopK& out) {
  if (k < 1 || k > kMaxDeviceTopK) return false;
  out = draft_top_k(bonus, start, L, k);
  return true;
}

void CudaDFlash::Impl::block_forward(int32_t bonus, int64_t start) {
  Impl& m = *this;
  const DFlashConfig& c = m.cpu.config();
  const int64_t B = c.block_size, H = c.hidden_size, V = c.vocab_size, nh = c.num_attention_heads;
  const int64_t nkv = c.num_key_value_heads, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim(), I = c.intermediate_size;
  if (start != m.len + m.staged)
    fail("DFlash drafter: block at position ", start, " but the context holds ", m.len + m.staged, " tokens");
  if (bonus < 0 || bonus >= V) fail("DFlash draft: bonus token ", bonus, " is outside the vocabulary [0, ", V, ")");
  if (start + B > c.max_position_embeddings)
    fail("DFlash draft: block positions up to ", start + B - 1, " exceed max_position_embeddings ", c.max_position_embeddings);
  m.flush_staged();
  cudaStream_t s = m.t.stream;
  using cuda::Epilogue;
  // ids = [bonus, mask × (B − 1)]: the mask rows were written once at load.
  check(cudaMemcpyAsync(m.ids, &bonus, 4, cudaMemcpyHostToDevice, s), "upload bonus");
  cuda::embed(m.t.embed, H, m.ids, B, m.x, s);
  if (c.input_embedding_scale != 1.0) cuda::scale_softcap(m.x, B * H, float(c.input_embedding_scale), 0.0f, s);
  const float scale = float(1.0 / std::sqrt(double(hd)));
  for (DraftLayer& w : m.layers) {
    cuda::rmsnorm(m.x, H, w.attn_norm, B, H, c.rms_norm_eps, m.xn, H, s);
    cuda::linear(w.q, m.xn, H, B, m.q, qd, Epilogue::store, s);
    // The block's K/V go right after the context rows, so attention reads one [S, kv_dim] run;
    // the next append overwrites them (the context never keeps a block's K/V).
    float* kb = w.kc + start * kvd;
    cuda::linear(w.k, m.xn, H, B, kb, kvd, Epilogue::store, s);
    cuda::linear(w.v, m.xn, H, B, w.vc + start * kvd, kvd, Epilogue::store, s);
    const float af = float(c.rope_attention_factor);
    cuda::head_norm_rope(m.q, B, nh, hd, w.q_norm, c.rms_norm_eps, m.inv_freq, start, af, s);
    cuda::head_norm_rope(kb, B, nkv, hd, w.k_norm, c.rms_norm_eps, m.inv_freq, start, af, s);
    cuda::block_attention(m.q, w.kc, w.vc, m.attn, m.scores, B, nh, nkv, hd, start + B, scale, s);
    cuda::linear(w.o, m.attn, qd, B, m.x, H, Epilogue::add, s);
    cuda::rmsnorm(m.x, H, w.ffn_norm, B, H, c.rms_norm_eps, m.xn, H, s);
    cuda::linear(w.gu, m.xn, H, B, m.h, I, Epilogue::swiglu, s);
    cuda::linear(w.down, m.h, I, B, m.x, H, Epilogue::add, s);
  }
  // Position 0 (the bonus token) predicts nothing new: logits for positions 1 … B − 1 only.
  cuda::rmsnorm(m.x + H, H, m.final_norm, B - 1, H, c.rms_norm_eps, m.xn, H, s);
  cuda::linear(m.t.draft_lm_head(), m.xn, H, B - 1, m.logits, V, Epilogue::store, s);
  // As DFlashDrafter::draft: × output_multiplier, then c·tanh(logits / c).
  if (c.output_multiplier != 1.0 || c.final_logit_softcapping > 0)
    cuda::scale_softcap(m.logits, (B - 1) * V, float(c.output_multiplier), float(c.final_logit_softcapping), s);
}

}  // namespace kd
