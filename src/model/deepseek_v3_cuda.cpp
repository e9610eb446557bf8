// CudaTarget: device weights, the bf16 latent cache and the forward that strings the kernels of
// kernels.h together in the CPU forward's order (src/model/deepseek_v3.cpp). Weight upload and
// the random benchmark weights are in deepseek_v3_cuda_weights.cpp.
#include "model/deepseek_v3_cuda_impl.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "backend/cuda/device_comm.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kd {

using cuda::check;

int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

bool cuda_device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string cuda_device_name() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cat("no CUDA device (", cudaGetErrorString(e), ")");
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "CUDA device 0 (properties unavailable)";
  return cat(p.name, " (sm_", p.major, p.minor, ", ", p.multiProcessorCount, " SMs, ", double(p.totalGlobalMem) / double(1ull << 30),
             " GiB, L2 ", p.l2CacheSize >> 20, " MiB)");
}

CudaTarget::Impl::~Impl() {
  for (void* p : allocs) cudaFree(p);
  if (h_in) cudaFreeHost(h_in);
  if (h_logits) cudaFreeHost(h_logits);
  if (am_host) cudaFreeHost(am_host);
  drop_graphs();
  if (ev0) cudaEventDestroy(ev0);
  if (ev1) cudaEventDestroy(ev1);
  if (fork) cudaEventDestroy(fork);
  if (join) cudaEventDestroy(join);
  if (side) cudaStreamDestroy(side);
  if (stream) cudaStreamDestroy(stream);
}

void* CudaTarget::Impl::alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
  if (e != cudaSuccess) fail("CUDA: cannot allocate ", double(bytes) / 1e6, " MB for ", what, ": ", cudaGetErrorString(e));
  allocs.push_back(p);
  return p;
}

void CudaTarget::Impl::release(void* p) {
  if (!p) return;
  auto it = std::find(allocs.begin(), allocs.end(), p);
  if (it == allocs.end()) return;
  cudaFree(p);
  allocs.erase(it);
}

void CudaTarget::Impl::init_common(int64_t max_tokens) {
  const ModelConfig& c = cfg;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreate(&ev0), "cudaEventCreate");
  check(cudaEventCreate(&ev1), "cudaEventCreate");
  check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "cudaEventCreate");
  cap = std::min(max_tokens, c.max_position_embeddings);
  if (cap < 1) fail("CUDA target: the cache must hold at least one token");
  D = c.latent_dim();
  bt = cap;
  cache = static_cast<uint16_t*>(alloc(size_t(c.num_hidden_layers * cap * D) * 2, "the latent KV cache"));
  const std::vector<float> f = c.rope_inv_freq();
  inv_freq = static_cast<float*>(alloc(f.size() * 4, "RoPE frequencies"));
  check(cudaMemcpy(inv_freq, f.data(), f.size() * 4, cudaMemcpyHostToDevice), "upload inv_freq");
  rope_scaling = float(c.rope_attention_scaling());
  softmax_scale = float(c.softmax_scale());
  active_log = static_cast<int32_t*>(alloc(size_t(c.num_hidden_layers) * 4, "expert counts"));
}

void CudaTarget::Impl::ensure_rows(int64_t n) {
  if (n <= rows_cap) return;
  const ModelConfig& c = cfg;
  check(cudaStreamSynchronize(stream), "ensure_rows");  // nothing may still read the old buffers
  for (void* p : {static_cast<void*>(x), static_cast<void*>(xn), static_cast<void*>(cq), static_cast<void*>(q),
                  static_cast<void*>(kv), static_cast<void*>(attn), static_cast<void*>(qlat), static_cast<void*>(olat), static_cast<void*>(part),
                  static_cast<void*>(qfrag),
                  static_cast<void*>(h), static_cast<void*>(h2), static_cast<void*>(ys), static_cast<void*>(sh),
                  static_cast<void*>(rl), static_cast<void*>(wts), static_cast<void*>(xg), static_cast<void*>(xq),
                  static_cast<void*>(xunit), static_cast<void*>(chosen),
                  static_cast<void*>(entry_token), static_cast<void*>(entry_slot), static_cast<void*>(n_active),
                  static_cast<void*>(act_expert), static_cast<void*>(act_off), static_cast<void*>(act_cnt),
                  static_cast<void*>(yp)})
    release(p);
  const int64_t H = c.num_attention_heads, hid = c.hidden_size, K = std::max<int64_t>(c.num_experts_per_tok, 1);
  const int64_t mi = c.moe_intermediate_size, ns = std::max<int64_t>(c.n_shared_experts, 1);
  const int64_t hmax = std::max({c.intermediate_size, K * mi, mi * ns});
  auto fbuf = [&](int64_t per_row, const char* what) { return static_cast<float*>(alloc(size_t(n * per_row) * 4, what)); };
  auto ibuf = [&](int64_t count, const char* what) { return static_cast<int32_t*>(alloc(size_t(count) * 4, what)); };
  x = fbuf(hid, "x");
  xn = fbuf(hid, "xn");
  cq = fbuf(c.q_lora_rank, "cq");
  q = fbuf(H * c.qk_head_dim(), "q");
  kv = fbuf(D, "kv");
  attn = fbuf(H * c.v_head_dim, "attn");
  qlat = fbuf(H * c.kv_lora_rank, "q_lat");
  olat = fbuf(H * c.kv_lora_rank, "o_lat");
  part = static_cast<float*>(alloc(size_t(cuda::mla_part_floats(n, H, c.kv_lora_rank)) * 4, "attention chunk partials"));
  qfrag = static_cast<uint32_t*>(alloc(size_t(cuda::mla_qfrag_bytes(n, H, c.kv_lora_rank, c.qk_rope_head_dim)), "attention q fragments"));
  h = fbuf(hmax, "h");
  h2 = fbuf(mi * ns, "h2");
  ys = fbuf(K * hid, "ys");
  sh = fbuf(hid, "sh");
  yp = fbuf(hid, "partial sums");
  rl = fbuf(std::max<int64_t>(c.n_routed_experts, 1), "router logits");
  wts = fbuf(K, "router weights");
  xg = fbuf(hid, "logit rows");
  // Digit scratch of the routed experts: gate/up read n token rows of hidden, down n·K slot rows of mi.
  const int64_t dig_units = std::max(cuda::expert_digit_units(n, hid), cuda::expert_digit_units(n * K, mi));
  xq = static_cast<int8_t*>(alloc(size_t(std::max(cuda::expert_digit_bytes(n, hid), cuda::expert_digit_bytes(n * K, mi))),
                                  "expert digits"));
  xunit = static_cast<uint16_t*>(alloc(size_t(std::max<int64_t>(dig_units, 1)) * 2, "expert digit units"));
  chosen = ibuf(n * K, "chosen");
  entry_token = ibuf(n * K, "entries");
  entry_slot = ibuf(n * K, "entries");
  const int64_t E = std::max<int64_t>(c.n_routed_experts, 1);
  n_active = ibuf(1, "n_active");
  act_expert = ibuf(E, "act");
  act_off = ibuf(E, "act");
  act_cnt = ibuf(E, "act");
  rows_cap = n;
  ++buf_gen;
}

void CudaTarget::Impl::ensure_logits(int64_t rows) {
  if (rows <= logits_cap) return;
  check(cudaStreamSynchronize(stream), "ensure_logits");
  release(logits);
  logits = static_cast<float*>(alloc(size_t(rows * cfg.vocab_size) * 4, "logits"));
  logits_cap = rows;
  ++buf_gen;
}

void CudaTarget::Impl::ensure_in(int64_t ints) {
  if (ints <= in_cap) return;
  check(cudaStreamSynchronize(stream), "ensure_in");
  release(in);
  if (h_in) cudaFreeHost(h_in);
  h_in = nullptr;
  const int64_t cap_ints = std::max<int64_t>(ints, 2 * in_cap);
  in = static_cast<int32_t*>(alloc(size_t(cap_ints) * 4, "forward inputs"));
  check(cudaMallocHost(reinterpret_cast<void**>(&h_in), size_t(cap_ints) * 4), "cudaMallocHost");
  in_cap = cap_ints;
  ++buf_gen;
}

void CudaTarget::Impl::run(int64_t n, int64_t vcap, int64_t max_keys, int64_t n_logits,
                           const std::vector<int32_t>* tap_layers, float* taps_dev) {
  const ModelConfig& c = cfg;
  const int64_t H = c.num_attention_heads, hid = c.hidden_size, qr = c.q_lora_rank, qk = c.qk_head_dim();
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim, Lr = c.kv_lora_rank;
  const int64_t E = c.n_routed_experts, K = c.num_experts_per_tok, mi = c.moe_intermediate_size;
  const int32_t* ids = in;
  const int32_t* pos = in + n;
  const cuda::KeyLists keys{in + 2 * n, in + 3 * n, in + 4 * n, in + 5 * n, in + 6 * n, in + 7 * n, in + 9 * n, in + 9 * n + vcap, bt};
  const int32_t* lrows = in + 8 * n;
  cudaStream_t s = stream;
  using cuda::Epilogue;
  cuda::embed(embed, hid, ids, n, x, s);
  const int64_t n_taps = tap_layers ? int64_t(tap_layers->size()) : 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const DevLayer& L = layers[size_t(l)];
    uint16_t* cache_l = cache + l * cap * D;
    cuda::rmsnorm(x, hid, L.attn_norm, n, hid, c.rms_norm_eps, xn, hid, s);
    // The latent path (kv_a, cache write) and the query path only meet in attention: two streams,
    // so the small, latency-bound kernels of one overlap the other (captured graphs keep the fork).
    check(cudaEventRecord(fork, s), "fork");
    check(cudaStreamWaitEvent(side, fork), "fork");
    cuda::linear(L.kv_a, xn, hid, n, kv, D, Epilogue::store, side);
    cuda::latent_write(kv, n, Lr, dr, L.kv_a_norm, c.latent_norm_eps, inv_freq, pos, rope_scaling, cache_l, keys.wrow, side);
    check(cudaEventRecord(join, side), "join");
    cuda::linear(L.q_a, xn, hid, n, cq, qr, Epilogue::store, s);
    cuda::rmsnorm(cq, qr, L.q_a_norm, n, qr, c.latent_norm_eps, cq, qr, s);
    cuda::linear(L.q_b, cq, qr, n, q, H * qk, Epilogue::store, s);
    check(cudaStreamWaitEvent(s, join), "join");
    cuda::MlaParams mp;
    mp.q = q;
    mp.kv_b = static_cast<const uint16_t*>(L.kv_b.w);
    mp.cache = cache_l;
    mp.keys = keys;
    mp.out = attn;
    mp.qlat = qlat;
    mp.olat = olat;
    mp.part = part;
    mp.qfrag = qfrag;
    mp.n = n;
    mp.max_keys = max_keys;
    mp.H = H;
    mp.dn = dn;
    mp.dr = dr;
    mp.dv = dv;
    mp.Lr = Lr;
    mp.softmax_scale = softmax_scale;
    mp.rope_inv_freq = inv_freq;  // q_pe rotated inside the core (rope_q's arithmetic, one launch less)
    mp.rope_positions = pos;
    mp.rope_scaling = rope_scaling;
    cuda::mla_attention(mp, s);
    // Under TP each rank's heads give a partial sum of o_proj: reduced in rank order, then added.
    auto reduce_into_x = [&] {
      comm->all_reduce_sum(yp, n, hid, s);
      cuda::add_rows(x, yp, n * hid, s);
    };
    if (comm) {
      cuda::linear(L.o, attn, H * dv, n, yp, hid, Epilogue::store, s);
      reduce_into_x();
    } else {
      cuda::linear(L.o, attn, H * dv, n, x, hid, Epilogue::add, s);
    }
    cuda::rmsnorm(x, hid, L.ffn_norm, n, hid, c.rms_norm_eps, xn, hid, s);
    if (!L.moe) {
      cuda::linear(L.dense_gu, xn, hid, n, h, c.intermediate_size, Epilogue::swiglu, s);
      cuda::linear(L.dense_down, h, c.intermediate_size, n, comm ? yp : x, hid, comm ? Epilogue::store : Epilogue::add, s);
      if (comm) reduce_into_x();
    } else {
      // Shared experts on the side stream, overlapping the router → dispatch → routed-expert chain.
      const int64_t si = mi * c.n_shared_experts;
      if (L.has_shared) {
        check(cudaEventRecord(fork, s), "fork");
        check(cudaStreamWaitEvent(side, fork), "fork");
        cuda::linear(L.sh_gu, xn, hid, n, h2, si, Epilogue::swiglu, side);
        cuda::linear(L.sh_down, h2, si, n, sh, hid, Epilogue::store, side);
        check(cudaEventRecord(join, side), "join");
      }
      cuda::linear(L.router, xn, hid, n, rl, E, Epilogue::store, s);
      cuda::RouteParams rp;
      rp.E = E;
      rp.K = K;
      rp.G = c.n_group;
      rp.topk_group = c.topk_group;
      rp.norm_topk_prob = c.norm_topk_prob;
      rp.routed_scaling = float(c.routed_scaling_factor);
      cuda::route(rl, L.router_bias, n, rp, chosen, wts, s);
      cuda::Dispatch d{n_active, act_expert, act_off, act_cnt, entry_token, entry_slot};
      cuda::dispatch(chosen, n, K, E, d, active_log + l, s);
      cuda::ExpertBatch gu;
      gu.w = L.exp_gu;
      gu.w_stride_bytes = L.gu_stride_bytes;
      gu.scale_stride_elems = L.gu_scale_stride;
      gu.n_active = n_active;
      gu.act_expert = act_expert;
      gu.act_off = act_off;
      gu.act_cnt = act_cnt;
      gu.in_row = entry_token;   // gate/up read the token's normalised hidden state
      gu.out_row = entry_slot;   // … and write its slot i·K + k
      gu.max_active = std::min(E, n * K);
      gu.max_rows_per_expert = n;
      gu.x_rows = n;
      gu.xq = xq;
      gu.xunit = xunit;
      cuda::expert_linear(gu, xn, hid, h, mi, Epilogue::swiglu, s);
      cuda::ExpertBatch dw = gu;
      dw.w = L.exp_down;
      dw.w_stride_bytes = L.down_stride_bytes;
      dw.scale_stride_elems = L.down_scale_stride;
      dw.in_row = entry_slot;
      dw.x_rows = n * K;
      cuda::expert_linear(dw, h, mi, ys, hid, Epilogue::store, s);
      if (L.has_shared) check(cudaStreamWaitEvent(s, join), "join");
      if (comm) {
        // The rank's routed + shared partials (0 + Σ … is Σ … exactly), reduced, then added.
        check(cudaMemsetAsync(yp, 0, size_t(n * hid) * 4, s), "partials");
        cuda::moe_combine(yp, ys, wts, L.has_shared ? sh : nullptr, n, K, hid, s);
        reduce_into_x();
      } else {
        cuda::moe_combine(x, ys, wts, L.has_shared ? sh : nullptr, n, K, hid, s);
      }
    }
    // HF's hidden_states[l + 1], which DFlash taps: the residual stream after layer l.
    for (int64_t t = 0; t < n_taps; ++t)
      if ((*tap_layers)[size_t(t)] == l)
        check(cudaMemcpy2DAsync(taps_dev + t * hid, size_t(n_taps * hid) * 4, x, size_t(hid) * 4, size_t(hid) * 4, size_t(n),
                                cudaMemcpyDeviceToDevice, s),
              "tap copy");
  }
  if (n_logits == 0) return;
  cuda::gather_rows(x, hid, lrows, n_logits, xg, s);
  cuda::rmsnorm(xg, hid, final_norm, n_logits, hid, c.rms_norm_eps, xn, hid, s);
  cuda::linear(lm_head, xn, hid, n_logits, logits, lm_rows, Epilogue::store, s);
}

// Host side of a forward: checks as the CPU forward does, then the key lists of each row.
void CudaTarget::Impl::stage_seq(Staged& st, const int32_t* ids_h, int64_t n, const int32_t* positions,
                                 const uint8_t* visibility, int64_t start, const int32_t* table, int64_t n_table,
                                 bool all_logits, bool want_logits) const {
  const ModelConfig& c = cfg;
  if (n <= 0) fail("forward: no tokens");
  for (int64_t i = 0; i < n; ++i)
    if (ids_h[i] < 0 || ids_h[i] >= c.vocab_size)
      fail("token id ", ids_h[i], " at index ", i, " is outside the vocabulary [0, ", c.vocab_size, ")");
  if (start + n > n_table * bt)
    fail("context full: ", start, " + ", n, " tokens exceed the ", n_table * bt, " cache rows given to the sequence");
  for (int64_t b = 0; b < n_table; ++b)
    if (table[b] < 0 || table[b] >= n_blocks) fail("KV block ", table[b], " is outside the cache's ", n_blocks, " blocks");
  const int32_t base = int32_t(st.n), tab = int32_t(st.tables.size());
  st.tables.insert(st.tables.end(), table, table + n_table);
  auto phys = [&](int64_t t) { return int32_t(int64_t(table[t / bt]) * bt + t % bt); };
  for (int64_t i = 0; i < n; ++i) {
    const int32_t ps = positions ? positions[i] : int32_t(start + i);
    if (ps < 0 || ps >= c.max_position_embeddings)
      fail("position ", ps, " is outside the model's context [0, ", c.max_position_embeddings, ")");
    st.ids.push_back(ids_h[i]);
    st.pos.push_back(ps);
    // A causal row stores no list (cuda::KeyLists: voff < 0, keys 0 … i); a tree row its ancestors.
    int32_t k = 0;
    if (visibility) {
      if (st.vis.size() > size_t(INT32_MAX) - size_t(n)) fail("forward: ", n, " tree rows exceed the visible lists' int32 offsets");
      st.voff.push_back(int32_t(st.vis.size()));
      for (int64_t j = 0; j < n; ++j)
        if (visibility[i * n + j] != 0) st.vis.push_back(int32_t(j)), ++k;
    } else {
      st.voff.push_back(-1);
      k = int32_t(i + 1);
    }
    st.cnt.push_back(k);
    st.start.push_back(int32_t(start));
    st.tab.push_back(tab);
    st.wrow.push_back(phys(start + i));
    st.base.push_back(base);
    st.max_keys = std::max(st.max_keys, start + k);
  }
  if (want_logits)
    for (int64_t i = all_logits ? 0 : n - 1; i < n; ++i) st.lrows.push_back(base + int32_t(i));
  st.n += n;
}

void CudaTarget::Impl::upload(const Staged& st, int64_t vcap) {
  const int64_t n = st.n, nt = int64_t(st.tables.size()), nv = int64_t(st.vis.size());
  if (nv > vcap) fail("internal: ", nv, " visible-list entries exceed their ", vcap, " slots");
  ensure_rows(n);
  ensure_logits(std::max<int64_t>(1, int64_t(st.lrows.size())));
  ensure_in(9 * n + vcap + nt);
  int32_t* p = h_in;
  for (const std::vector<int32_t>* v : {&st.ids, &st.pos, &st.cnt, &st.start, &st.tab, &st.wrow, &st.base, &st.voff}) {
    std::memcpy(p, v->data(), size_t(n) * 4);
    p += n;
  }
  std::memcpy(p, st.lrows.data(), st.lrows.size() * 4);  // (n slots; the rest unused)
  p += n;
  std::memcpy(p, st.vis.data(), size_t(nv) * 4);
  std::memcpy(p + vcap, st.tables.data(), size_t(nt) * 4);
  check(cudaMemcpyAsync(in, h_in, size_t(9 * n + vcap + nt) * 4, cudaMemcpyHostToDevice, stream), "upload inputs");
}

int64_t CudaTarget::Impl::upload_own(const int32_t* ids_h, int64_t n, const int32_t* positions, const uint8_t* visibility,
                                     bool all_logits, bool want_logits, bool graphed) {
  const SeqForward f = own_sequence({});
  Staged st;
  stage_seq(st, ids_h, n, positions, visibility, size, f.kv.blocks.data(), 1, all_logits, want_logits);
  staged_vis = graphed ? n * n : int64_t(st.vis.size());
  upload(st, staged_vis);
  return size;
}

CudaTarget::~CudaTarget() = default;

const ModelConfig& CudaTarget::config() const { return impl_->cfg; }
int64_t CudaTarget::size() const { return impl_->size; }
int64_t CudaTarget::max_tokens() const { return impl_->cap; }
void CudaTarget::reset() { impl_->size = 0; }
uint64_t CudaTarget::device_weight_bytes() const { return impl_->weight_bytes; }
void CudaTarget::set_graphs(bool on) { impl_->graphs = on; }
bool CudaTarget::graphs() const { return impl_->graphs; }
void CudaTarget::set_device_outputs(bool on) { impl_->device_outputs = on; }
uint64_t CudaTarget::host_tap_rows() const { return impl_->host_tap_rows; }
bool CudaTarget::device_argmax() const { return impl_->device_outputs; }
bool CudaTarget::device_taps() const { return impl_->device_outputs; }
std::string CudaTarget::device() const { return cat("cuda (", cuda_device_name(), ")"); }
int64_t CudaTarget::max_context() const { return max_keys(); }

// The pool is allocated up front on the device: the memory free now, less a tenth of it (at least
// 4 GiB) for the work buffers of a step (they grow with the rows of the largest batch).
int64_t CudaTarget::max_kv_tokens(int64_t block_tokens) const {
  const int64_t per = kv_bytes_per_token(), free_b = free_device_bytes();
  int64_t budget = free_b - std::max<int64_t>(free_b / 10, int64_t(4) << 30);
  if (impl_->kv_cap_bytes >= 0) budget = std::min(budget, impl_->kv_cap_bytes);
  return std::max<int64_t>(0, budget / per / block_tokens * block_tokens);
}

void CudaTarget::cap_kv_bytes(int64_t bytes) { impl_->kv_cap_bytes = bytes; }

void CudaTarget::Impl::drop_graphs() {
  for (Graph& g : graph_cache)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  graph_cache.clear();
}

void CudaTarget::Impl::run_graphed(int64_t n, int64_t keys, int64_t n_logits, const std::vector<int32_t>* tap_layers,
                                   float* taps_dev) {
  static const std::vector<int32_t> kNoTaps;
  const std::vector<int32_t>& tap_list = tap_layers ? *tap_layers : kNoTaps;
  const int64_t bound = std::min(cap, cuda::mla_max_keys(cfg.kv_lora_rank, cfg.qk_rope_head_dim));
  constexpr size_t kMaxGraphs = 64;  // distinct shapes kept (tree sizes ≤ the budget + 1, decode batches)
  if (graph_gen != buf_gen) {  // a work buffer (or `in`) moved since the graphs were captured
    drop_graphs();
    graph_gen = buf_gen;
    graph_keys = bound;
  }
  Graph* hit = nullptr;
  for (Graph& g : graph_cache)
    if (g.n == n && g.n_logits == n_logits && g.tap_layers == tap_list && g.taps_dev == taps_dev) hit = &g;
  if (hit) hit->last_use = ++graph_clock;
  // A shape's first forward launches kernel by kernel and only its second is captured: shapes used
  // once (a prompt, one tree size) pay no capture, and the kernels' one-time setup (attention's
  // smem opt-in, a non-stream call) has happened before any capture. A full cache gives up its least
  // recently used shape, so a serving mix of one-off batch sizes cannot keep the steady ones out.
  if (!hit || keys > bound) {  // (the launch path reports a key list beyond the kernel's limit)
    if (!hit) {
      if (graph_cache.size() >= kMaxGraphs) {
        auto lru = std::min_element(graph_cache.begin(), graph_cache.end(),
                                    [](const Graph& a, const Graph& b) { return a.last_use < b.last_use; });
        if (lru->exec) cudaGraphExecDestroy(lru->exec);  // (no launch of it is in flight: forwards end synchronised)
        graph_cache.erase(lru);
      }
      graph_cache.push_back(Graph{n, n_logits, tap_list, taps_dev, nullptr, ++graph_clock});
    }
    run(n, n * n, keys, n_logits, tap_layers, taps_dev);
    return;
  }
  if (!hit->exec) {
    cudaGraph_t g = nullptr;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      run(n, n * n, bound, n_logits, tap_layers, taps_dev);
    } catch (...) {
      cudaStreamEndCapture(stream, &g);  // leave the stream usable
      if (g) cudaGraphDestroy(g);
      throw;
    }
    check(cudaStreamEndCapture(stream, &g), "cudaStreamEndCapture");
    const cudaError_t e = cudaGraphInstantiate(&hit->exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) hit->exec = nullptr;
    check(e, "cudaGraphInstantiate");
  }
  check(cudaGraphLaunch(hit->exec, stream), "cudaGraphLaunch");
}

bool CudaTarget::Impl::graph_captured(int64_t n, int64_t n_logits) const {
  if (graph_gen != buf_gen) return false;
  for (const Graph& g : graph_cache)
    if (g.n == n && g.n_logits == n_logits && g.tap_layers.empty() && g.taps_dev == nullptr) return g.exec != nullptr;
  return false;
}

// The one forward (DESIGN.md §3, model/target.h): every sequence's rows staged into one upload,
// one pass over the layers — a captured graph of this shape replayed when the batch is small
// (≤ kGraphRows rows: decode steps, verify trees, short chunks), kernel by kernel otherwise — then
// the outputs each sequence asked for: host logits (one copy of every logit row into pinned
// memory), argmax outputs (the logits stay here; logits_row fetches one), taps on the host or
// left on the device. One host sync.
void CudaTarget::Impl::forward_seqs(const std::vector<SeqForward>& seqs, ForwardStats* stats) {
  const ModelConfig& c = cfg;
  if (seqs.empty()) fail("forward: no sequences");
  Staged& st = staged;
  st.clear();
  const std::vector<int32_t>* taps_of = nullptr;
  bool host_logits = false, argmax = false;
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const SeqForward& f = seqs[sq];
    const ForwardArgs& a = f.args;
    if (a.form == AttnForm::expanded)
      fail("the CUDA backend runs the absorbed MLA form only (it computes the same function); use --decode-attn absorbed");
    if (f.kv.block_tokens != bt || f.kv.blocks.empty())
      fail("forward: sequence ", sq, "'s KV view is not a block table of this target's ", bt, "-row blocks");
    if ((a.argmax_ids == nullptr) != (a.argmax_vals == nullptr)) fail("forward: argmax outputs need both ids and values");
    if (a.argmax_ids && a.logits) fail("forward: sequence ", sq, " asks for host logits and argmax outputs both");
    if (a.taps && a.device_taps) fail("forward: sequence ", sq, " asks for taps on the host and on the device both");
    if (a.taps || a.device_taps) {
      if (!a.tap_layers || a.tap_layers->empty()) fail("forward: taps asked without tap layers");
      if (taps_of && *taps_of != *a.tap_layers) fail("forward: sequences tap different layers");
      taps_of = a.tap_layers;
    }
    host_logits |= a.logits != nullptr;
    argmax |= a.argmax_ids != nullptr;
    stage_seq(st, a.ids, a.n, a.positions, a.visibility, f.start, f.kv.blocks.data(), int64_t(f.kv.blocks.size()), a.all_logits,
              a.logits != nullptr || a.argmax_ids != nullptr);
  }
  // Logit rows are lm_rows wide on the device (this rank's vocabulary under TP) and land at columns
  // [vocab_begin, + lm_rows) of the host's vocab-wide rows.
  const int64_t n = st.n, n_logits = int64_t(st.lrows.size()), V = c.vocab_size, W = lm_rows;
  const int64_t limit = cuda::mla_max_keys(c.kv_lora_rank, c.qk_rope_head_dim);
  if (st.max_keys > limit)
    fail("forward: a row attends to ", st.max_keys, " keys, beyond the CUDA attention's limit of ", limit);
  const bool graphed = graphs && n <= kGraphRows;
  upload(st, graphed ? n * n : int64_t(st.vis.size()));
  float* taps_dev = nullptr;
  const int64_t n_taps = taps_of ? int64_t(taps_of->size()) : 0, tap_row = n_taps * c.hidden_size;
  if (taps_of) {
    for (int32_t t : *taps_of)
      if (t < 0 || t >= c.num_hidden_layers) fail("tap layer ", t, " is outside [0, ", c.num_hidden_layers, ")");
    if (taps_cap < n * tap_row) {
      check(cudaStreamSynchronize(stream), "taps");
      release(taps);
      taps = static_cast<float*>(alloc(size_t(n * tap_row) * 4, "taps"));
      taps_cap = n * tap_row;
    }
    taps_dev = taps;
  }
  if (graphed)
    run_graphed(n, st.max_keys, n_logits, taps_of, taps_dev);
  else
    run(n, int64_t(st.vis.size()), st.max_keys, n_logits, taps_of, taps_dev);

  if (host_logits) {
    if (n_logits > h_logits_cap) {
      if (h_logits) cudaFreeHost(h_logits);
      h_logits = nullptr;
      h_logits_cap = 0;
      check(cudaMallocHost(reinterpret_cast<void**>(&h_logits), size_t(n_logits * W) * 4), "cudaMallocHost (logits)");
      h_logits_cap = n_logits;
    }
    check(cudaMemcpyAsync(h_logits, logits, size_t(n_logits * W) * 4, cudaMemcpyDeviceToHost, stream), "download logits");
  }
  if (argmax) {
    if (am_cap < n_logits) {
      check(cudaStreamSynchronize(stream), "argmax");
      release(am_dev);
      if (am_host) cudaFreeHost(am_host);
      am_host = nullptr;
      am_dev = static_cast<int32_t*>(alloc(size_t(2 * n_logits) * 4, "argmax outputs"));
      check(cudaMallocHost(reinterpret_cast<void**>(&am_host), size_t(2 * n_logits) * 4), "cudaMallocHost (argmax)");
      am_cap = n_logits;
    }
    // Lowest index on ties, −1 on a NaN (sample()'s greedy choice); the value picked, −inf when the
    // row has nothing selectable.
    float* vals_dev = reinterpret_cast<float*>(am_dev + am_cap);
    cuda::argmax_rows(logits, n_logits, W, am_dev, stream);
    cuda::gather_row_values(logits, W, am_dev, n_logits, vals_dev, stream);
    check(cudaMemcpyAsync(am_host, am_dev, size_t(n_logits) * 4, cudaMemcpyDeviceToHost, stream), "download argmax");
    check(cudaMemcpyAsync(am_host + am_cap, vals_dev, size_t(n_logits) * 4, cudaMemcpyDeviceToHost, stream), "download argmax");
  }
  int64_t row = 0;
  for (const SeqForward& f : seqs) {
    const ForwardArgs& a = f.args;
    if (a.taps) {
      check(cudaMemcpyAsync(a.taps, taps_dev + row * tap_row, size_t(a.n * tap_row) * 4, cudaMemcpyDeviceToHost, stream),
            "download taps");
      host_tap_rows += uint64_t(a.n);
    }
    if (a.device_taps) *a.device_taps = taps_dev + row * tap_row;
    row += a.n;
  }
  std::vector<int32_t> distinct(static_cast<size_t>(c.num_hidden_layers), 0);
  if (stats)
    check(cudaMemcpyAsync(distinct.data(), active_log, distinct.size() * 4, cudaMemcpyDeviceToHost, stream), "download counts");
  check(cudaStreamSynchronize(stream), "forward");
  // Each sequence's logit rows are consecutive staged logit rows.
  last_lrow0.clear();
  std::vector<std::pair<int64_t, int64_t>> copies;  // (sequence, first staged logit row)
  int64_t lrow = 0;
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const ForwardArgs& a = seqs[sq].args;
    last_lrow0.push_back(lrow);
    const int64_t k = (a.logits || a.argmax_ids) ? (a.all_logits ? a.n : 1) : 0;
    if (a.argmax_ids) {
      const int32_t* ids = am_host;
      const float* vals = reinterpret_cast<const float*>(am_host + am_cap);
      for (int64_t i = 0; i < k; ++i) a.argmax_ids[i] = ids[lrow + i] < 0 ? ids[lrow + i] : int32_t(ids[lrow + i] + vocab_begin);
      std::copy_n(vals + lrow, k, a.argmax_vals);
    }
    if (a.logits) copies.push_back({int64_t(sq), lrow});
    lrow += k;
  }
  last_lrows = lrow;
  ThreadPool::global().parallel_for(int64_t(copies.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const ForwardArgs& a = seqs[size_t(copies[size_t(k)].first)].args;
      const int64_t rows = a.all_logits ? a.n : 1;
      const float* src = h_logits + copies[size_t(k)].second * W;
      if (W == V)
        std::memcpy(a.logits, src, size_t(rows * V) * 4);
      else
        for (int64_t i = 0; i < rows; ++i) std::memcpy(a.logits + i * V + vocab_begin, src + i * W, size_t(W) * 4);
    }
  });
  if (stats) stats->weight_bytes += weight_bytes_of(n, &distinct, n_logits);
}

void CudaTarget::forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats) const {
  impl_->forward_seqs(seqs, stats);
}

void CudaTarget::logits_row(int64_t seq, int64_t row, float* out) const {
  const Impl& m = *impl_;
  if (seq < 0 || seq >= int64_t(m.last_lrow0.size())) fail("logits_row: no sequence ", seq, " in the last forward");
  const int64_t r = m.last_lrow0[size_t(seq)] + row;
  const int64_t end = size_t(seq) + 1 < m.last_lrow0.size() ? m.last_lrow0[size_t(seq) + 1] : m.last_lrows;
  if (row < 0 || r >= end) fail("logits_row: sequence ", seq, " had no logit row ", row, " in the last forward");
  // [lm_rows]: this rank's vocabulary slice under TP (its caller places it), else the whole row.
  check(cudaMemcpy(out, m.logits + r * m.lm_rows, size_t(m.lm_rows) * 4, cudaMemcpyDeviceToHost), "download logits row");
}

// The single sequence of a one-block cache (CudaTarget(model, max_tokens)): a batch of one.
SeqForward CudaTarget::Impl::own_sequence(const ForwardArgs& a) const {
  if (n_blocks != 1) fail("this CUDA target's KV is a pool of ", n_blocks, " blocks lent by an engine (no single-sequence cache)");
  SeqForward f;
  f.kv.dim = D;
  f.kv.n_layers = cfg.num_hidden_layers;
  f.kv.block_tokens = bt;
  f.kv.blocks = {0};
  f.start = size;
  f.args = a;
  return f;
}

void CudaTarget::forward(const ForwardArgs& a) {
  Impl& m = *impl_;
  if (a.device_taps) fail("forward: device taps are forward_device_taps'");
  const std::vector<SeqForward> one = {m.own_sequence(a)};
  m.forward_seqs(one, a.stats);
  if (a.commit) m.size += a.n;
}

const float* CudaTarget::forward_device_taps(const ForwardArgs& a) {
  Impl& m = *impl_;
  if (a.taps) fail("forward_device_taps: the taps stay on the device (pass no host taps buffer)");
  if (!a.tap_layers || a.tap_layers->empty()) fail("forward_device_taps: no tap layers");
  const float* taps_dev = nullptr;
  ForwardArgs b = a;
  b.device_taps = &taps_dev;
  const std::vector<SeqForward> one = {m.own_sequence(b)};
  m.forward_seqs(one, a.stats);
  if (a.commit) m.size += a.n;
  return taps_dev;
}

void CudaTarget::compact(int64_t start, const std::vector<int32_t>& keep) {
  Impl& m = *impl_;
  const SeqForward f = m.own_sequence({});
  keep_rows(f.kv, start, keep);
  m.size = start + int64_t(keep.size());
}

void CudaTarget::Impl::copy_rows(const std::vector<int32_t>& src, const std::vector<int32_t>& dst) {
  const int64_t nk = int64_t(src.size());
  if (nk == 0) return;
  if (keep_cap < 2 * nk) {
    check(cudaStreamSynchronize(stream), "copy_rows");
    release(keep);
    keep = static_cast<int32_t*>(alloc(size_t(2 * nk) * 4, "kept rows"));
    keep_cap = 2 * nk;
  }
  std::vector<int32_t> both(src);
  both.insert(both.end(), dst.begin(), dst.end());
  // Synchronous from pageable memory; the next forward queues behind the copy on the same stream.
  check(cudaMemcpyAsync(keep, both.data(), size_t(2 * nk) * 4, cudaMemcpyHostToDevice, stream), "upload kept rows");
  cuda::compact_rows(cache, cfg.num_hidden_layers, cap * D, D, keep, keep + nk, nk, stream);
}

void CudaTarget::init_kv(int64_t n_blocks, int64_t block_tokens) const {
  Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  if (block_tokens < 1 || n_blocks < 1) fail("CUDA KV: ", n_blocks, " blocks of ", block_tokens, " rows");
  const int64_t rows = n_blocks * block_tokens;
  if (rows > (int64_t(1) << 31) - 1) fail("CUDA KV: ", rows, " rows exceed the 32-bit row index");
  check(cudaStreamSynchronize(m.stream), "init_kv");
  m.drop_graphs();
  m.release(m.cache);
  m.cache = nullptr;
  m.cache = static_cast<uint16_t*>(m.alloc(size_t(c.num_hidden_layers * rows * m.D) * 2, "the latent KV cache"));
  m.cap = rows;
  m.bt = block_tokens;
  m.n_blocks = n_blocks;
  m.size = 0;
  ++m.buf_gen;  // captured graphs read the old cache
}

void CudaTarget::keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const {
  Impl& m = *impl_;
  if (kv.block_tokens != m.bt) fail("KV compaction: the KV view's blocks are not this target's");
  std::vector<int32_t> src, dst;
  for (size_t k = 0; k < path.size(); ++k) {
    if (path[k] < int32_t(k) || (k > 0 && path[k] <= path[k - 1]))
      fail("KV compaction: kept rows must increase (row ", path[k], " at slot ", k, ")");
    const int64_t from = start + path[k], to = start + int64_t(k);
    if (from >= kv.capacity()) fail("KV compaction: row ", from, " is past the sequence's ", kv.capacity(), " rows");
    if (from == to) continue;
    auto phys = [&](int64_t t) { return int32_t(int64_t(kv.blocks[size_t(t / m.bt)]) * m.bt + t % m.bt); };
    src.push_back(phys(from));
    dst.push_back(phys(to));
  }
  m.copy_rows(src, dst);
}

int64_t CudaTarget::kv_bytes_per_token() const { return impl_->cfg.num_hidden_layers * impl_->D * 2; }

int64_t CudaTarget::free_device_bytes() {
  size_t free_b = 0, total = 0;
  check(cudaMemGetInfo(&free_b, &total), "cudaMemGetInfo");
  return int64_t(free_b);
}

int64_t CudaTarget::max_keys() const {
  return std::min(impl_->cfg.max_position_embeddings, cuda::mla_max_keys(impl_->cfg.kv_lora_rank, impl_->cfg.qk_rope_head_dim));
}

// Weight bytes a forward over n rows streams (each matrix once; experts as counted per layer).
uint64_t CudaTarget::Impl::weight_bytes_of(int64_t n, const std::vector<int32_t>* distinct, int64_t logit_rows) const {
  const ModelConfig& c = cfg;
  uint64_t b = uint64_t(n) * uint64_t(c.hidden_size) * 2;  // embedding rows
  for (size_t l = 0; l < layers.size(); ++l) {
    const DevLayer& L = layers[l];
    b += L.attn_bytes + L.dense_bytes;
    if (L.moe) {
      const int64_t e = distinct ? (*distinct)[l] : c.num_experts_per_tok;
      b += uint64_t(e) * L.expert_bytes;
    }
  }
  if (logit_rows > 0) b += matrix_bytes(lm_head) + uint64_t(c.hidden_size) * 4;
  return b;
}

uint64_t CudaTarget::floor_bytes(int64_t cached_rows, int64_t n_rows, const std::vector<int32_t>* distinct) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  // KV: every layer reads each cached and new latent row once and writes the new ones.
  const uint64_t kv = uint64_t(c.num_hidden_layers) * uint64_t(cached_rows + 2 * n_rows) * uint64_t(m.D) * 2;
  return m.weight_bytes_of(n_rows, distinct, 1) + kv;
}

}  // namespace kd
