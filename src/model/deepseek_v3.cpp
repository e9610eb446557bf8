#include "model/deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "backend/comm.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/tp_plan.h"

namespace kd {

namespace {

constexpr std::initializer_list<DType> kFloatTypes = {DType::BF16, DType::F32, DType::F16};

std::vector<float> load_vector(const Checkpoint& ck, const std::string& name, int64_t n) {
  const TensorRef& t = ck.get(name, {n}, kFloatTypes);
  std::vector<float> out(static_cast<size_t>(n));
  const uint8_t* p = t.data();
  for (int64_t i = 0; i < n; ++i) {
    switch (t.info->dtype) {
      case DType::F32: { float f; std::memcpy(&f, p + 4 * i, 4); out[size_t(i)] = f; break; }
      case DType::BF16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[size_t(i)] = bf16_to_f32(h); break; }
      default: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[size_t(i)] = f16_to_f32(h); break; }
    }
  }
  return out;
}

struct WeightLoader {
  const Checkpoint& ck;
  std::vector<std::vector<uint8_t>>& owned;  // aligned copies of tensors the file left misaligned

  const void* aligned(const TensorRef& t, size_t align) {
    const uint8_t* p = t.data();
    if (reinterpret_cast<uintptr_t>(p) % align == 0) return p;
    // safetensors packs tensors back to back, so an odd-sized tensor can misalign the next one.
    std::vector<uint8_t> copy(p, p + t.info->nbytes() + align);
    size_t shift = (align - reinterpret_cast<uintptr_t>(copy.data()) % align) % align;
    std::memmove(copy.data() + shift, copy.data(), t.info->nbytes());
    owned.push_back(std::move(copy));
    return owned.back().data() + shift;
  }

  Weight dense(const std::string& name, int64_t rows, int64_t cols) {
    const TensorRef& t = ck.get(name, {rows, cols}, kFloatTypes);
    Weight w;
    w.name = name;
    w.rows = rows;
    w.cols = cols;
    w.dtype = t.info->dtype;
    w.data = aligned(t, dtype_size(w.dtype));
    return w;
  }

  // A Linear module: INT4 when the checkpoint holds `.weight_packed` (compressed-tensors
  // pack-quantized, SPEC-MODEL.md §3), else dense `.weight`. Presence decides rather than the ignore
  // list, whose names need not match wrapped checkpoints (K2.5's "lm_head" vs
  // "language_model.lm_head"); the quantization_config supplies the group size.
  Weight linear(const std::string& module, int64_t rows, int64_t cols) {
    const QuantConfig& q = ck.config().quant;
    if (!ck.find(module + ".weight_packed")) return dense(module + ".weight", rows, cols);
    if (!q.enabled)
      fail(where_str(ck.get(module + ".weight_packed")), " is INT4, but config.json has no compressed-tensors quantization_config");
    if (cols % q.group_size)
      fail(ck.dir(), ": '", module, "' has ", cols, " inputs, not a multiple of the INT4 group size ", q.group_size);
    Weight w;
    w.name = module;
    w.rows = rows;
    w.cols = cols;
    w.int4 = true;
    w.group = q.group_size;
    const TensorRef& packed = ck.get(module + ".weight_packed", {rows, w.words_per_row()}, {DType::I32});
    const TensorRef& scale = ck.get(module + ".weight_scale", {rows, cols / q.group_size}, {DType::BF16});
    if (const TensorRef* shape = ck.find(module + ".weight_shape")) {
      if (shape->info->dtype != DType::I32 && shape->info->dtype != DType::I64)
        fail(where_str(*shape), " has dtype ", dtype_name(shape->info->dtype), ", expected I32");
      if (shape->info->shape != std::vector<int64_t>{2}) fail(where_str(*shape), " has shape ", shape->info->shape_str(), ", expected [2]");
      int64_t v[2];
      for (int i = 0; i < 2; ++i) {
        if (shape->info->dtype == DType::I32) {
          int32_t x;
          std::memcpy(&x, shape->data() + 4 * i, 4);
          v[i] = x;
        } else {
          std::memcpy(&v[i], shape->data() + 8 * i, 8);
        }
      }
      if (v[0] != rows || v[1] != cols)
        fail(where_str(*shape), " says [", v[0], ", ", v[1], "], expected [", rows, ", ", cols, "]");
    }
    w.data = aligned(packed, 4);
    w.scales = static_cast<const uint16_t*>(aligned(scale, 2));
    return w;
  }

  MlpWeights mlp(const std::string& prefix, int64_t hidden, int64_t inter) {
    return {linear(prefix + ".gate_proj", inter, hidden), linear(prefix + ".up_proj", inter, hidden),
            linear(prefix + ".down_proj", hidden, inter)};
  }

  // Tensor parallel (model/tp_plan.h): rank r of R keeps rows [r·n/R, (r+1)·n/R) of a rows-split
  // matrix — a view, rows being contiguous in both layouts — or those columns of a columns-split one —
  // a copy, each row's slice lying apart from the next's; an INT4 column slice holds whole groups.
  static Weight rows_slice(Weight w, TpRank tp) {
    if (tp.ranks == 1) return w;
    const int64_t n = w.rows / tp.ranks, r0 = tp.rank * n;
    if (w.int4) {
      w.data = static_cast<const uint32_t*>(w.data) + r0 * w.words_per_row();
      w.scales += r0 * (w.cols / w.group);
    } else {
      w.data = static_cast<const uint8_t*>(w.data) + r0 * w.cols * int64_t(dtype_size(w.dtype));
    }
    w.rows = n;
    return w;
  }
  Weight cols_slice(Weight w, TpRank tp) {
    if (tp.ranks == 1) return w;
    const int64_t n = w.cols / tp.ranks, c0 = tp.rank * n;
    std::vector<uint8_t> buf;
    if (w.int4) {
      // plan_tp has checked that the slice holds whole groups; groups hold whole 8-nibble words.
      if (n % w.group || w.group % 8)
        fail(w.name, ": a ", n, "-column INT4 slice does not hold whole groups of ", w.group);
      const int64_t wpr = w.words_per_row(), gpr = w.cols / w.group, nw = n / 8, ng = n / w.group;
      buf.resize(size_t(w.rows * (nw * 4 + ng * 2)));
      uint8_t* words = buf.data();
      uint8_t* scales = buf.data() + w.rows * nw * 4;
      for (int64_t r = 0; r < w.rows; ++r) {
        std::memcpy(words + r * nw * 4, static_cast<const uint32_t*>(w.data) + r * wpr + c0 / 8, size_t(nw) * 4);
        std::memcpy(scales + r * ng * 2, w.scales + r * gpr + c0 / w.group, size_t(ng) * 2);
      }
      owned.push_back(std::move(buf));
      w.data = owned.back().data();
      w.scales = reinterpret_cast<const uint16_t*>(owned.back().data() + w.rows * nw * 4);
    } else {
      const size_t es = dtype_size(w.dtype);
      buf.resize(size_t(w.rows * n) * es);
      for (int64_t r = 0; r < w.rows; ++r)
        std::memcpy(buf.data() + size_t(r * n) * es, static_cast<const uint8_t*>(w.data) + size_t(r * w.cols + c0) * es, size_t(n) * es);
      owned.push_back(std::move(buf));
      w.data = owned.back().data();
    }
    w.cols = n;
    return w;
  }
  MlpWeights mlp_slice(const std::string& prefix, int64_t hidden, int64_t inter, TpRank tp) {
    MlpWeights m = mlp(prefix, hidden, inter);
    return {rows_slice(m.gate, tp), rows_slice(m.up, tp), cols_slice(m.down, tp)};
  }
};

}  // namespace

DeepseekV3::DeepseekV3(const Checkpoint& ckpt, TpRank tp) : cfg_(ckpt.config()), tp_(tp) {
  const ModelConfig& c = cfg_;
  if (tp.ranks < 1 || tp.rank < 0 || tp.rank >= tp.ranks)
    fail("tensor parallel: rank ", tp.rank, " of ", tp.ranks, " (ranks must be ≥ 1, rank in [0, ranks))");
  WeightLoader L{ckpt, owned_};
  const std::string& p = c.tensor_prefix;
  const int64_t H = c.num_attention_heads, hid = c.hidden_size;
  heads_ = H;
  embed_ = L.dense(p + "embed_tokens.weight", c.vocab_size, hid);
  lm_head_ = L.dense(c.lm_head_name, c.vocab_size, hid);
  if (tp.ranks > 1) {
    const TpPlan plan = plan_tp(c, tp.ranks);  // an Error naming what R does not divide
    heads_ = plan.heads_per_rank;
    vocab_begin_ = plan.vocab_begin(tp.rank);
    lm_head_.data = static_cast<const uint8_t*>(lm_head_.data) + vocab_begin_ * hid * int64_t(dtype_size(lm_head_.dtype));
    lm_head_.rows = plan.vocab_rows(tp.rank);
  }
  final_norm_ = load_vector(ckpt, p + "norm.weight", hid);
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& w = layers_[size_t(l)];
    const std::string lp = cat(p, "layers.", l, ".");
    w.attn_norm = load_vector(ckpt, lp + "input_layernorm.weight", hid);
    w.ffn_norm = load_vector(ckpt, lp + "post_attention_layernorm.weight", hid);
    const std::string a = lp + "self_attn.";
    w.q_a = L.linear(a + "q_a_proj", c.q_lora_rank, hid);
    w.q_a_norm = load_vector(ckpt, a + "q_a_layernorm.weight", c.q_lora_rank);
    w.q_b = L.rows_slice(L.linear(a + "q_b_proj", H * c.qk_head_dim(), c.q_lora_rank), tp);
    w.kv_a = L.linear(a + "kv_a_proj_with_mqa", c.latent_dim(), hid);
    w.kv_a_norm = load_vector(ckpt, a + "kv_a_layernorm.weight", c.kv_lora_rank);
    w.kv_b = L.rows_slice(L.linear(a + "kv_b_proj", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), tp);
    w.o = L.cols_slice(L.linear(a + "o_proj", hid, H * c.v_head_dim), tp);
    w.moe = c.is_moe_layer(l);
    const std::string m = lp + "mlp";
    if (!w.moe) {
      w.dense = L.mlp_slice(m, hid, c.intermediate_size, tp);
      continue;
    }
    w.router = L.dense(m + ".gate.weight", c.n_routed_experts, hid);
    {
      // The correction bias is fp32 in every release; selection adds it, weighting does not.
      const TensorRef& b = ckpt.get(m + ".gate.e_score_correction_bias", {c.n_routed_experts}, {DType::F32, DType::BF16});
      (void)b;
      w.router_bias = load_vector(ckpt, m + ".gate.e_score_correction_bias", c.n_routed_experts);
    }
    w.experts.reserve(static_cast<size_t>(c.n_routed_experts));
    for (int64_t e = 0; e < c.n_routed_experts; ++e)
      w.experts.push_back(L.mlp_slice(cat(m, ".experts.", e), hid, c.moe_intermediate_size, tp));
    if (c.n_shared_experts > 0)
      w.shared = L.mlp_slice(m + ".shared_experts", hid, c.moe_intermediate_size * c.n_shared_experts, tp);
  }
  inv_freq_ = c.rope_inv_freq();
  rope_scaling_ = float(c.rope_attention_scaling());
  softmax_scale_ = float(c.softmax_scale());
}

LatentCache DeepseekV3::new_cache(int64_t max_tokens) const {
  return LatentCache(cfg_.num_hidden_layers, cfg_.latent_dim(), std::min(max_tokens, cfg_.max_position_embeddings));
}

void DeepseekV3::route(int64_t layer, const float* logits, int32_t* experts, float* weights) const {
  const int64_t E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  const int64_t G = cfg_.n_group, per_group = E / G;
  const std::vector<float>& bias = layers_[size_t(layer)].router_bias;
  std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    score[size_t(e)] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[size_t(e)] = score[size_t(e)] + bias[size_t(e)];
  }
  // Higher value first, lower index on ties: a fixed order so every backend picks the same set.
  auto better = [](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[size_t(a)] > v[size_t(b)] || (v[size_t(a)] == v[size_t(b)] && a < b); };
  };
  if (G > 1) {
    // Group-limited routing: a group scores the sum of its top-2 biased scores; keep topk_group groups.
    std::vector<float> gscore(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      std::vector<int64_t> idx(static_cast<size_t>(per_group));
      std::iota(idx.begin(), idx.end(), g * per_group);
      std::partial_sort(idx.begin(), idx.begin() + 2, idx.end(), better(choice));
      gscore[size_t(g)] = choice[size_t(idx[0])] + choice[size_t(idx[1])];
    }
    std::vector<int64_t> gidx(static_cast<size_t>(G));
    std::iota(gidx.begin(), gidx.end(), 0);
    std::partial_sort(gidx.begin(), gidx.begin() + cfg_.topk_group, gidx.end(), better(gscore));
    std::vector<bool> keep(static_cast<size_t>(G), false);
    for (int64_t i = 0; i < cfg_.topk_group; ++i) keep[size_t(gidx[size_t(i)])] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[size_t(e / per_group)]) choice[size_t(e)] = -std::numeric_limits<float>::infinity();
  }
  std::vector<int64_t> idx(static_cast<size_t>(E));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), better(choice));
  std::sort(idx.begin(), idx.begin() + K);
  float sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    experts[k] = int32_t(idx[size_t(k)]);
    weights[k] = score[size_t(idx[size_t(k)])];  // unbiased: the bias only chooses
    sum += weights[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    if (cfg_.norm_topk_prob) weights[k] /= (sum + 1e-20f);
    weights[k] *= float(cfg_.routed_scaling_factor);
  }
}

void DeepseekV3::mlp(const MlpWeights& w, const float* x, int64_t n, float* out, ForwardStats* st) const {
  const int64_t inter = w.gate.rows;
  std::vector<float> g(static_cast<size_t>(n * inter)), u(static_cast<size_t>(n * inter));
  cpu::linear(w.gate, x, n, g.data());
  cpu::linear(w.up, x, n, u.data());
  cpu::swiglu(g.data(), u.data(), n * inter, g.data());
  cpu::linear(w.down, g.data(), n, out);
  if (st) st->weight_bytes += w.gate.bytes() + w.up.bytes() + w.down.bytes();
}

void DeepseekV3::ffn(int64_t layer, const float* x, int64_t n, float* out, ForwardStats* st) const {
  const LayerWeights& w = layers_[size_t(layer)];
  const int64_t hid = cfg_.hidden_size;
  if (!w.moe) {
    mlp(w.dense, x, n, out, st);
    return;
  }
  const int64_t E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  std::vector<float> logits(static_cast<size_t>(n * E));
  cpu::linear(w.router, x, n, logits.data());
  if (st) st->weight_bytes += w.router.bytes();
  std::vector<int32_t> chosen(static_cast<size_t>(n * K));
  std::vector<float> weight(static_cast<size_t>(n * K));
  for (int64_t i = 0; i < n; ++i) route(layer, logits.data() + i * E, chosen.data() + i * K, weight.data() + i * K);

  // Group rows by expert so each expert's weights are streamed once for the whole batch; sum in
  // ascending expert id per row (the order HF's eager loop adds them in).
  std::fill(out, out + n * hid, 0.0f);
  std::vector<std::vector<std::pair<int64_t, float>>> rows_of(static_cast<size_t>(E));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < K; ++k) rows_of[size_t(chosen[size_t(i * K + k)])].push_back({i, weight[size_t(i * K + k)]});
  // With enough active experts (a batch of decode rows), experts run in parallel, each on its own
  // rows with its linears inline on one thread: one hand-off per layer instead of one per expert
  // matrix. With few, each expert's linears split their rows across threads instead. Results do
  // not depend on the split; the sum below stays in ascending expert id per row.
  std::vector<int64_t> active;
  int64_t work = 0;
  for (int64_t e = 0; e < E; ++e)
    if (!rows_of[size_t(e)].empty()) {
      active.push_back(e);
      work += int64_t(rows_of[size_t(e)].size()) * 3 * w.experts[size_t(e)].gate.rows * hid;  // this rank's width
    }
  std::vector<std::vector<float>> ye(active.size());
  std::vector<ForwardStats> est(active.size());
  const int64_t n_active = int64_t(active.size());
  ThreadPool& pool = ThreadPool::global();
  const bool by_expert = n_active >= 2 * pool.size() && work >= (int64_t(1) << 15);
  auto run_experts = [&](int64_t a0, int64_t a1) {
    std::vector<float> xe;
    for (int64_t ai = a0; ai < a1; ++ai) {
      const auto& rows = rows_of[size_t(active[size_t(ai)])];
      const int64_t m = int64_t(rows.size());
      xe.resize(static_cast<size_t>(m * hid));
      ye[size_t(ai)].resize(static_cast<size_t>(m * hid));
      for (int64_t j = 0; j < m; ++j) std::memcpy(&xe[size_t(j * hid)], x + rows[size_t(j)].first * hid, size_t(hid) * sizeof(float));
      mlp(w.experts[size_t(active[size_t(ai)])], xe.data(), m, ye[size_t(ai)].data(), st ? &est[size_t(ai)] : nullptr);
    }
  };
  if (by_expert)
    pool.parallel_for(n_active, 1, run_experts);
  else
    run_experts(0, n_active);
  for (int64_t ai = 0; ai < n_active; ++ai) {
    const auto& rows = rows_of[size_t(active[size_t(ai)])];
    if (st) st->weight_bytes += est[size_t(ai)].weight_bytes;
    for (int64_t j = 0; j < int64_t(rows.size()); ++j) {
      float* o = out + rows[size_t(j)].first * hid;
      const float wt = rows[size_t(j)].second;
      const float* y = &ye[size_t(ai)][size_t(j * hid)];
      for (int64_t d = 0; d < hid; ++d) o[d] += y[d] * wt;
    }
  }
  if (cfg_.n_shared_experts > 0) {
    std::vector<float> sh(static_cast<size_t>(n * hid));
    mlp(w.shared, x, n, sh.data(), st);
    for (int64_t i = 0; i < n * hid; ++i) out[i] += sh[size_t(i)];
  }
}

// Per-forward bookkeeping shared by every layer: where each sequence's rows sit in the batch and
// which keys each row attends to.
struct DeepseekV3::BatchPlan {
  int64_t n = 0;                        // rows in the batch
  std::vector<int64_t> row0;            // [seqs]: first batch row of each sequence
  std::vector<int32_t> positions;       // [n] RoPE positions
  // [seqs][rows]: keys of each row, in cache order: every committed row, then the new rows it may
  // see (causal, or its tree ancestors and itself). The order is the AR order of the same prefix,
  // so a verified node reproduces its AR step bit for bit. The same for every layer.
  std::vector<std::vector<std::vector<int32_t>>> keys;
};

// Under tensor parallelism `out` is this rank's partial sum over its heads (o_proj's columns of them).
void DeepseekV3::attention(int64_t layer, const std::vector<SeqForward>& seqs, const BatchPlan& plan, const float* x,
                           float* out, ForwardStats* st, Comm* comm) const {
  const int64_t n = plan.n;
  const LayerWeights& w = layers_[size_t(layer)];
  const ModelConfig& c = cfg_;
  const int64_t H = heads_, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t qk = dn + dr, Lr = c.kv_lora_rank, D = c.latent_dim();
  const int32_t* positions = plan.positions.data();

  // Queries of all rows: q_b(RMSNorm(q_a x)), RoPE on each head's last dr values.
  std::vector<float> cq(static_cast<size_t>(n * c.q_lora_rank)), q(static_cast<size_t>(n * H * qk));
  cpu::linear(w.q_a, x, n, cq.data());
  cpu::rmsnorm(cq.data(), w.q_a_norm.data(), n, c.q_lora_rank, c.latent_norm_eps, cq.data());
  cpu::linear(w.q_b, cq.data(), n, q.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) cpu::rope_gptj(&q[size_t((i * H + h) * qk + dn)], dr / 2, inv_freq_.data(), positions[i], rope_scaling_);

  // Latent KV of the new rows: [RMSNorm(c_kv) | RoPE(k_pe)] into each sequence's cache. Tensor-parallel
  // ranks share the host rows: rank 0 writes them, and every rank reads them after the barrier.
  const bool writes_kv = !comm || comm->rank() == 0;
  std::vector<float> kv(writes_kv ? static_cast<size_t>(n * D) : 0);
  if (writes_kv) cpu::linear(w.kv_a, x, n, kv.data());
  for (size_t sq = 0; writes_kv && sq < seqs.size(); ++sq) {
    const SeqForward& f = seqs[sq];
    for (int64_t i = 0; i < f.args.n; ++i) {
      const int64_t b = plan.row0[sq] + i;
      float* row = f.kv.row(layer, f.start + i);
      cpu::rmsnorm(&kv[size_t(b * D)], w.kv_a_norm.data(), 1, Lr, c.latent_norm_eps, row);
      std::memcpy(row + Lr, &kv[size_t(b * D + Lr)], size_t(dr) * sizeof(float));
      cpu::rope_gptj(row + Lr, dr / 2, inv_freq_.data(), positions[b], rope_scaling_);
    }
  }
  if (comm) comm->barrier();
  if (st) st->weight_bytes += w.q_a.bytes() + w.q_b.bytes() + (writes_kv ? w.kv_a.bytes() : 0) + w.kv_b.bytes() + w.o.bytes();

  // Expanded sequences (HF's form): k_nope and v of every cached token re-projected through kv_b.
  std::vector<std::vector<float>> kvb(seqs.size());
  bool any_absorbed = false;
  int64_t head_work = 0;
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const SeqForward& f = seqs[sq];
    const int64_t S = f.start + f.args.n;  // cache rows any new row may see
    head_work += f.args.n * S * (Lr + dr);
    if (f.args.form != AttnForm::expanded) {
      any_absorbed = true;
      continue;
    }
    std::vector<float> ckv(static_cast<size_t>(S * Lr));
    for (int64_t s = 0; s < S; ++s) std::memcpy(&ckv[size_t(s * Lr)], f.kv.row(layer, s), size_t(Lr) * sizeof(float));
    kvb[sq].resize(static_cast<size_t>(S * H * (dn + dv)));
    cpu::linear(w.kv_b, ckv.data(), S, kvb[sq].data());
  }
  std::vector<float> attn(static_cast<size_t>(n * H * dv));
  // Heads are split across threads only when their work (the head's kv_b rows, then rows × keys
  // over the latent) outweighs a hand-off. Each (row, head) is computed by one thread in a fixed
  // order, so the split never changes bits.
  head_work = H * ((dn + dv) * Lr + head_work);
  const int64_t head_grain = head_work >= (int64_t(1) << 16) ? 1 : H;
  ThreadPool::global().parallel_for(H, head_grain, [&](int64_t h0, int64_t h1) {
    std::vector<float> wkv, qlat(static_cast<size_t>(Lr)), olat(static_cast<size_t>(Lr)), p, d1, d2;
    std::vector<const float*> k1, k2;  // each key's two score operands (dot_f32_rows: 16 keys' trees at once)
    for (int64_t h = h0; h < h1; ++h) {
      if (any_absorbed) {
        wkv.resize(static_cast<size_t>((dn + dv) * Lr));
        for (int64_t r = 0; r < dn + dv; ++r) cpu::dequant_row(w.kv_b, h * (dn + dv) + r, &wkv[size_t(r * Lr)]);
      }
      for (size_t sq = 0; sq < seqs.size(); ++sq) {
        const SeqForward& f = seqs[sq];
        const KvView& cache = f.kv;
        p.resize(static_cast<size_t>(f.start + f.args.n));
        for (int64_t i = 0; i < f.args.n; ++i) {
          const int64_t b = plan.row0[sq] + i;
          const float* qi = &q[size_t((b * H + h) * qk)];
          const auto& ki = plan.keys[sq][size_t(i)];
          const int64_t len = int64_t(ki.size());
          float* o = &attn[size_t((b * H + h) * dv)];
          float mx = -std::numeric_limits<float>::infinity();
          // A key's score: (q_nope · k_nope + q_pe · k_pe) · scale, each dot in dot_f32's order.
          auto scores = [&](const float* q1, int64_t n1) {
            d1.resize(size_t(len));
            d2.resize(size_t(len));
            cpu::dot_f32_rows(q1, k1.data(), len, n1, d1.data());
            cpu::dot_f32_rows(qi + dn, k2.data(), len, dr, d2.data());
            for (int64_t t = 0; t < len; ++t) {
              p[size_t(t)] = (d1[size_t(t)] + d2[size_t(t)]) * softmax_scale_;
              mx = std::max(mx, p[size_t(t)]);
            }
          };
          k1.resize(size_t(len));
          k2.resize(size_t(len));
          if (f.args.form == AttnForm::expanded) {
            const std::vector<float>& kb = kvb[sq];
            for (int64_t t = 0; t < len; ++t) {
              const int64_t s = ki[size_t(t)];
              k1[size_t(t)] = &kb[size_t((s * H + h) * (dn + dv))];
              k2[size_t(t)] = cache.row(layer, s) + Lr;
            }
            scores(qi, dn);
            float sum = 0;
            for (int64_t t = 0; t < len; ++t) sum += (p[size_t(t)] = std::exp(p[size_t(t)] - mx));
            std::fill(o, o + dv, 0.0f);
            for (int64_t t = 0; t < len; ++t) {
              p[size_t(t)] /= sum;
              k1[size_t(t)] += dn;  // the key's value row
            }
            cpu::accumulate_rows(p.data(), k1.data(), len, dv, o);
            continue;
          }
          // Absorbed: q_lat = W_UKᵀ q_nope attends over the latent directly; W_UV applies after the sum.
          std::fill(qlat.begin(), qlat.end(), 0.0f);
          for (int64_t d = 0; d < dn; ++d)
            for (int64_t l = 0; l < Lr; ++l) qlat[size_t(l)] += qi[d] * wkv[size_t(d * Lr + l)];
          for (int64_t t = 0; t < len; ++t) {
            k1[size_t(t)] = cache.row(layer, ki[size_t(t)]);
            k2[size_t(t)] = k1[size_t(t)] + Lr;
          }
          scores(qlat.data(), Lr);
          float sum = 0;
          for (int64_t t = 0; t < len; ++t) sum += (p[size_t(t)] = std::exp(p[size_t(t)] - mx));
          std::fill(olat.begin(), olat.end(), 0.0f);
          for (int64_t t = 0; t < len; ++t) p[size_t(t)] /= sum;
          cpu::accumulate_rows(p.data(), k1.data(), len, Lr, olat.data());  // k1: the keys' latent rows
          for (int64_t d = 0; d < dv; ++d) o[d] = cpu::dot_f32(&wkv[size_t((dn + d) * Lr)], olat.data(), Lr);
        }
      }
    }
  });
  cpu::linear(w.o, attn.data(), n, out);
}

void DeepseekV3::forward(LatentCache& cache, const int32_t* ids, int64_t n, AttnForm form, bool all_logits,
                         float* logits, ForwardStats* st) const {
  forward_cached(*this, cache, ids, n, form, all_logits, logits, st);
}

void forward_cached(const Target& target, LatentCache& cache, const int32_t* ids, int64_t n, AttnForm form, bool all_logits,
                    float* logits, ForwardStats* st) {
  ForwardArgs a;
  a.ids = ids;
  a.n = n;
  a.form = form;
  a.all_logits = all_logits;
  a.logits = logits;
  a.stats = st;
  forward_cached(target, cache, a);
}

void DeepseekV3::forward(LatentCache& cache, const ForwardArgs& a) const { forward_cached(*this, cache, a); }

void forward_cached(const Target& target, LatentCache& cache, const ForwardArgs& a) {
  if (!target.host_kv()) fail("forward over a host cache: the ", target.device(), " target keeps its KV on the device");
  const int64_t start = cache.size();
  if (a.n <= 0) fail("forward: no tokens");
  if (start + a.n > cache.max_tokens())
    fail("context full: ", start, " + ", a.n, " tokens exceed the limit of ", cache.max_tokens());
  cache.reserve(start + a.n);
  std::vector<SeqForward> one(1);
  one[0].kv = cache.view();
  one[0].start = start;
  one[0].args = a;
  target.forward_batch(one, a.stats);
  if (a.commit) cache.commit(start + a.n);
}

int64_t DeepseekV3::max_kv_tokens(int64_t) const { return std::numeric_limits<int64_t>::max(); }

void DeepseekV3::keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const {
  for (int64_t k = 0; k < int64_t(path.size()); ++k) {
    const int64_t from = path[size_t(k)];
    if (from < k || (k > 0 && from <= path[size_t(k - 1)]))
      fail("KV compaction: kept rows must increase (row ", from, " at slot ", k, ")");
    if (start + from >= kv.capacity()) fail("KV compaction: row ", start + from, " is past the sequence's ", kv.capacity(), " rows");
    if (from == k) continue;
    for (int64_t l = 0; l < kv.n_layers; ++l) std::copy_n(kv.row(l, start + from), kv.dim, kv.row(l, start + k));
  }
}

void DeepseekV3::forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats) const {
  if (tp_.ranks > 1)
    fail("forward: this instance is rank ", tp_.rank, " of a ", tp_.ranks, "-way tensor-parallel model (forward_rank)");
  run(seqs, stats, nullptr);
}

void DeepseekV3::forward_rank(const std::vector<SeqForward>& seqs, Comm& comm, ForwardStats* stats) const {
  if (comm.size() != tp_.ranks || comm.rank() != tp_.rank)
    fail("forward_rank: this instance holds rank ", tp_.rank, " of ", tp_.ranks, ", the communicator is rank ", comm.rank(),
         " of ", comm.size());
  run(seqs, stats, &comm);
}

const float* DeepseekV3::kept_logits(int64_t seq, int64_t row) const {
  if (seq < 0 || seq >= int64_t(kept_row0_.size()) || kept_row0_[size_t(seq)] < 0)
    fail("kept logits: sequence ", seq, " of the last forward has no logit rows");
  if (row < 0 || row >= kept_n_[size_t(seq)]) fail("kept logits: sequence ", seq, " has no logit row ", row);
  return kept_.data() + (kept_row0_[size_t(seq)] + row) * lm_head_.rows;
}

void DeepseekV3::run(const std::vector<SeqForward>& seqs, ForwardStats* stats, Comm* comm) const {
  const ModelConfig& c = cfg_;
  const int64_t hid = c.hidden_size;
  if (seqs.empty()) fail("forward: no sequences");
  BatchPlan plan;
  plan.row0.resize(seqs.size());
  plan.keys.resize(seqs.size());
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const SeqForward& f = seqs[sq];
    const ForwardArgs& a = f.args;
    const int64_t n = a.n, start = f.start;
    if (n <= 0) fail("forward: no tokens (sequence ", sq, " of the batch)");
    if (a.device_taps) fail("forward: the CPU target brings taps to the host (no device taps)");
    if ((a.argmax_ids || a.argmax_vals) && !comm)
      fail("forward: the CPU target brings logits to the host (no argmax outputs)");
    if (!a.argmax_ids != !a.argmax_vals) fail("forward: argmax outputs need both argmax_ids and argmax_vals (sequence ", sq, ")");
    if (f.kv.ptrs.empty()) fail("forward: sequence ", sq, "'s KV has no host storage (a device target's pool)");
    if (start + n > f.kv.capacity())
      fail("forward: ", start, " + ", n, " rows exceed the ", f.kv.capacity(), " KV rows of sequence ", sq);
    for (int64_t i = 0; i < n; ++i)
      if (a.ids[i] < 0 || a.ids[i] >= c.vocab_size)
        fail("token id ", a.ids[i], " at index ", i, " is outside the vocabulary [0, ", c.vocab_size, ")");
    plan.row0[sq] = plan.n;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t pos = a.positions ? a.positions[i] : int32_t(start + i);
      if (pos < 0 || pos >= c.max_position_embeddings)
        fail("position ", pos, " is outside the model's context [0, ", c.max_position_embeddings, ")");
      plan.positions.push_back(pos);
    }
    plan.keys[sq].resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      auto& k = plan.keys[sq][size_t(i)];
      k.reserve(size_t(start + i + 1));
      for (int64_t s = 0; s < start; ++s) k.push_back(int32_t(s));
      for (int64_t j = 0; j < n; ++j)
        if (a.visibility ? a.visibility[i * n + j] != 0 : j <= i) k.push_back(int32_t(start + j));
    }
    plan.n += n;
  }
  const int64_t n = plan.n;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (size_t sq = 0; sq < seqs.size(); ++sq)
    std::copy_n(seqs[sq].args.ids, seqs[sq].args.n, ids.begin() + plan.row0[sq]);

  // The residual stream x is replicated: every rank adds the same reduced partial sums to it.
  const bool writes_taps = !comm || comm->rank() == 0;
  std::vector<float> x(size_t(n * hid)), xn(size_t(n * hid)), y(size_t(n * hid));
  cpu::embed(embed_, ids.data(), n, x.data());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = layers_[size_t(l)];
    cpu::rmsnorm(x.data(), w.attn_norm.data(), n, hid, c.rms_norm_eps, xn.data());
    attention(l, seqs, plan, xn.data(), y.data(), stats, comm);
    if (comm) comm->all_reduce_sum(y.data(), n, hid);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    cpu::rmsnorm(x.data(), w.ffn_norm.data(), n, hid, c.rms_norm_eps, xn.data());
    ffn(l, xn.data(), n, y.data(), stats);
    if (comm) comm->all_reduce_sum(y.data(), n, hid);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    // HF's hidden_states[l + 1]: the residual stream after layer l, which DFlash taps.
    for (size_t sq = 0; writes_taps && sq < seqs.size(); ++sq) {
      const ForwardArgs& a = seqs[sq].args;
      const int64_t n_taps = a.tap_layers && a.taps ? int64_t(a.tap_layers->size()) : 0;
      for (int64_t t = 0; t < n_taps; ++t)
        if ((*a.tap_layers)[size_t(t)] == l)
          for (int64_t i = 0; i < a.n; ++i) {
            const float* src = &x[size_t((plan.row0[sq] + i) * hid)];
            std::copy(src, src + hid, a.taps + (i * n_taps + t) * hid);
          }
    }
  }
  logit_outputs(seqs, plan, x, stats, comm);
}


// Logits of the rows that want them (all rows, or each sequence's last), in one lm_head pass over
// this instance's vocabulary rows.
void DeepseekV3::logit_outputs(const std::vector<SeqForward>& seqs, const BatchPlan& plan, const std::vector<float>& x,
                               ForwardStats* stats, Comm* comm) const {
  const ModelConfig& c = cfg_;
  const int64_t hid = c.hidden_size, V = c.vocab_size, Vr = lm_head_.rows;
  std::vector<int64_t> rows;
  kept_row0_.assign(seqs.size(), -1);
  kept_n_.assign(seqs.size(), 0);
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const ForwardArgs& a = seqs[sq].args;
    if (!a.logits && !a.argmax_ids) continue;
    kept_row0_[sq] = int64_t(rows.size());
    kept_n_[sq] = a.all_logits ? a.n : 1;
    for (int64_t i = a.all_logits ? 0 : a.n - 1; i < a.n; ++i) rows.push_back(plan.row0[sq] + i);
  }
  kept_.clear();
  if (rows.empty()) return;  // the same on every rank: the sequences are
  const int64_t m = int64_t(rows.size());
  std::vector<float> xr(static_cast<size_t>(m * hid));
  for (int64_t r = 0; r < m; ++r) std::copy_n(&x[size_t(rows[size_t(r)] * hid)], hid, &xr[size_t(r * hid)]);
  cpu::rmsnorm(xr.data(), final_norm_.data(), m, hid, c.rms_norm_eps, xr.data());
  std::vector<float> lg(static_cast<size_t>(m * Vr));
  cpu::linear(lm_head_, xr.data(), m, lg.data());
  if (stats) stats->weight_bytes += lm_head_.bytes();

  // Host logits: each rank writes its columns [vocab_begin, + Vr) of every row (the whole row at R = 1).
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const ForwardArgs& a = seqs[sq].args;
    if (!a.logits) continue;
    const int64_t k = a.all_logits ? a.n : 1;
    for (int64_t i = 0; i < k; ++i)
      std::copy_n(&lg[size_t((kept_row0_[sq] + i) * Vr)], Vr, a.logits + i * V + vocab_begin_);
  }
  if (comm) {
    // Argmax outputs: every rank's (value, index) of every logit row, exchanged and combined
    // (combine_rank_argmax: sample()'s greedy choice over the whole row).
    bool any_argmax = false;
    for (const SeqForward& f : seqs) any_argmax = any_argmax || f.args.argmax_ids;
    if (any_argmax) {
      const int32_t R = comm->size();
      std::vector<RankArgmax> mine(static_cast<size_t>(m)), all(static_cast<size_t>(m * R));
      for (int64_t r = 0; r < m; ++r) mine[size_t(r)] = rank_argmax(&lg[size_t(r * Vr)], Vr, vocab_begin_);
      comm->all_gather(mine.data(), size_t(m) * sizeof(RankArgmax), all.data());
      for (size_t sq = 0; comm->rank() == 0 && sq < seqs.size(); ++sq) {
        const ForwardArgs& a = seqs[sq].args;
        if (!a.argmax_ids) continue;
        const int64_t k = a.all_logits ? a.n : 1;
        for (int64_t i = 0; i < k; ++i) {
          const RankArgmax best = combine_rank_argmax(&all[size_t(kept_row0_[sq] + i)], R, size_t(m));
          a.argmax_ids[i] = best.idx;
          a.argmax_vals[i] = best.val;
        }
      }
    }
    kept_ = std::move(lg);
  }
}

}  // namespace kd
