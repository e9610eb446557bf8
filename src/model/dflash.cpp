#include "model/dflash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "backend/cpu/ops.h"
#include "core/error.h"
#include "io/json_fields.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "core/untrusted.h"

namespace kd {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {


DFlashConfig parse_impl(const std::string& text, const std::string& label) {
  const json root = parse_json(text, label);
  if (!root.is_object()) fail(label, ": top level is not a JSON object");
  JsonFields r{root, label};
  {
    const json* a = r.get("architectures");
    if (a && a->is_array() && !a->empty() && (*a)[0] == "DFlash2DraftModel")
      fail(label, ": architectures is [\"DFlash2DraftModel\"]: DFlash2 drafters (grouped dynamic convolutions, "
                  "conv_kernel_size / conv_group_size, and a candidate selector, selector_rank / selector_top_k) are not "
                  "supported; kdtree runs DFlashDraftModel checkpoints");
    if (!a || !a->is_array() || a->empty() || (*a)[0] != "DFlashDraftModel")
      fail(label, ": architectures is ", a ? json_excerpt(*a) : "missing", ", expected [\"DFlashDraftModel\"]");
  }
  DFlashConfig c;
  c.vocab_size = r.integer("vocab_size", 1, int64_t(1) << 22);
  c.hidden_size = r.integer("hidden_size", 1, 1 << 17);
  c.intermediate_size = r.integer("intermediate_size", 1, int64_t(1) << 24);
  c.num_hidden_layers = r.integer("num_hidden_layers", 1, 1024);
  c.num_attention_heads = r.integer("num_attention_heads", 1, 4096);
  c.num_key_value_heads = r.integer("num_key_value_heads", 1, c.num_attention_heads, c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads)
    fail(label, ": num_attention_heads = ", c.num_attention_heads, " is not a multiple of num_key_value_heads = ",
         c.num_key_value_heads, " (GQA)");
  if (!r.get("head_dim") && (c.hidden_size % c.num_attention_heads || c.hidden_size / c.num_attention_heads < 2))
    fail(label, ": head_dim is missing and hidden_size = ", c.hidden_size, " / num_attention_heads = ",
         c.num_attention_heads, " does not give one");
  // transformers' Qwen3 default when head_dim is absent.
  c.head_dim = r.integer("head_dim", 2, 1 << 14, c.hidden_size / c.num_attention_heads);
  if (c.head_dim % 2) fail(label, ": head_dim = ", c.head_dim, " must be even (RoPE rotates pairs)");
  c.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-6);
  c.max_position_embeddings = r.integer("max_position_embeddings", 1, int64_t(1) << 30, 32768);
  if (std::string s = r.string_or("hidden_act", "silu"); s != "silu")
    fail(label, ": hidden_act \"", s, "\" is not supported (only silu)");
  if (const json* b = r.get("attention_bias"); b && *b != false) fail(label, ": attention_bias = ", json_excerpt(*b), " is not supported");

  // rope_theta and YaRN: the target's parse (io/config.h); the amplitude by transformers' generic
  // rule, which the reference drafter runs (not the target's).
  {
    const RopeParams rope = parse_rope(root, label);
    c.rope_theta = rope.theta;
    c.rope = rope.scaling;
    c.rope_attention_factor = yarn_attention_factor(c.rope);
    c.rope_attention_factor_rule = !c.rope.yarn                   ? YarnFactorRule::none
                                   : c.rope.attention_factor      ? YarnFactorRule::attention_factor
                                   : yarn_mscale_ratio_applies(c.rope) ? YarnFactorRule::mscale_ratio
                                                                  : YarnFactorRule::legacy;
  }

  for (const char* rk : {"rope_scaling", "rope_parameters"})
    if (const json* rp = r.get(rk); rp && rp->is_object() && rp->contains("partial_rotary_factor"))
      if (JsonFields{*rp, cat(label, ": ", rk)}.number("partial_rotary_factor", 0.0, 1.0, 1.0) != 1.0)
        fail(label, ": ", rk, ".partial_rotary_factor ≠ 1 is not supported (the drafter rotates the whole head)");
  if (r.get("partial_rotary_factor") && r.number("partial_rotary_factor", 0.0, 1.0) != 1.0)
    fail(label, ": partial_rotary_factor ≠ 1 is not supported (the drafter rotates the whole head)");

  // Attention variants of z-lab's model code this drafter does not implement: a layer is causal when
  // is_causal says so, else when it is a sliding_attention layer (with a window when sliding_window
  // is set). Without layer_types, transformers' Qwen3Config makes layers ≥ max_window_layers
  // sliding when use_sliding_window and sliding_window are set.
  if (const json* lt = r.get("layer_types")) {
    if (!lt->is_array()) fail(label, ": layer_types must be a list");
    for (const auto& t : *lt)
      if (t != "full_attention")
        fail(label, ": layer_types holds ", json_excerpt(t), "; only \"full_attention\" (non-causal) drafter layers are "
             "supported (sliding_attention layers attend causally within a window)");
  } else if (r.boolean_or("use_sliding_window", false) && r.get("sliding_window")) {
    const int64_t from = r.integer("max_window_layers", 0, 1 << 20, 28);  // transformers' Qwen3 default
    if (from < c.num_hidden_layers)
      fail(label, ": use_sliding_window = true with sliding_window = ", json_excerpt(*r.get("sliding_window")),
           " makes layers ", from, "+ sliding_attention (max_window_layers = ", from, "); only full_attention "
           "(non-causal) drafter layers are supported");
  }
  if (const json* ic = r.get("is_causal"); ic && *ic != false) fail(label, ": is_causal = ", json_excerpt(*ic), " is not supported (DFlash blocks are non-causal)");
  const json* dc = r.get("dflash_config");
  if (dc && !dc->is_object()) fail(label, ": dflash_config is not an object");
  const json empty = json::object();
  JsonFields d{dc ? *dc : empty, label, &root};
  c.input_embedding_scale = d.number("input_embedding_scale", -1e6, 1e6, 1.0);
  c.output_multiplier = d.number("output_multiplier", -1e6, 1e6, 1.0);
  // z-lab applies it when > 0 (0, negative or null: off).
  c.final_logit_softcapping = std::max(0.0, d.number("final_logit_softcapping", -1e9, 1e9, 0.0));
  if (c.final_logit_softcapping > 0 && c.final_logit_softcapping < 1e-6)
    fail(label, ": final_logit_softcapping = ", c.final_logit_softcapping, " is too small to divide by (logits / c)");

  c.block_size = d.integer("block_size", 0, std::numeric_limits<int64_t>::max(), 16);  // z-lab's default
  if (c.block_size < 2)
    fail(label, ": block_size = ", c.block_size, " must be at least 2 (the bonus token plus at least one drafted position)");
  if (c.block_size > kMaxDFlashBlockSize)
    fail(label, ": block_size = ", c.block_size, " is more than kdtree accepts (", kMaxDFlashBlockSize,
         "; published DFlash drafters use 16)");
  c.mask_token_id = int32_t(d.integer("mask_token_id", 0, c.vocab_size - 1));
  c.num_target_layers = d.integer("num_target_layers", 1, 1024, 0);
  if (const json* ids = d.get("target_layer_ids")) {
    if (!ids->is_array() || ids->empty() || ids->size() > 1024)
      fail(label, ": dflash_config.target_layer_ids must be a non-empty list of layer indices, found ", json_excerpt(*ids));
    const int64_t hi = c.num_target_layers > 0 ? c.num_target_layers - 1 : 1023;
    for (const auto& v : *ids) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > hi)
        fail(label, ": dflash_config.target_layer_ids holds ", json_excerpt(v), ", not a layer index in [0, ", hi, "]");
      c.target_layer_ids.push_back(v.get<int64_t>());
    }
  } else {
    // z-lab's build_target_layer_ids(num_target_layers, num_hidden_layers).
    const int64_t N = c.num_target_layers, k = c.num_hidden_layers;
    if (N == 0)
      fail(label, ": missing dflash_config.target_layer_ids (the target layers whose outputs the drafter reads), and "
                  "no num_target_layers to derive them from");
    if (k > N || (k > 1 && N < k + 3))
      fail(label, ": dflash_config.target_layer_ids is missing and z-lab's default for ", k, " drafter layers over ",
           N, " target layers does not give distinct layers; give target_layer_ids");
    c.target_layer_ids = default_target_layer_ids(N, k);
  }
  if (c.n_taps() * c.hidden_size > (int64_t(1) << 24))
    fail(label, ": ", c.n_taps(), " taps × hidden_size ", c.hidden_size, " is too wide for fc");
  return c;
}

// An aligned view of `bytes` (safetensors packs tensors back to back, so an odd-sized tensor can
// misalign the next); copies into `owned` only when needed.
const void* aligned(const uint8_t* p, uint64_t bytes, size_t align, std::vector<std::vector<uint8_t>>& owned) {
  if (reinterpret_cast<uintptr_t>(p) % align == 0) return p;
  std::vector<uint8_t> copy(static_cast<size_t>(bytes + align));
  const size_t shift = (align - reinterpret_cast<uintptr_t>(copy.data()) % align) % align;
  std::memcpy(copy.data() + shift, p, static_cast<size_t>(bytes));  // never reads past the tensor
  owned.push_back(std::move(copy));
  return owned.back().data() + shift;
}

std::string read_text(const std::string& path, const std::string& hint) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(path, ": cannot open", hint);
  return read_text_file(path, kMaxConfigBytes);
}

}  // namespace

DFlashConfig parse_dflash_config(const std::string& json_text, const std::string& label) {
  try {
    return parse_impl(json_text, label);
  } catch (const json::exception& e) {
    fail(label, ": unexpected JSON structure: ", e.what());
  }
}

std::vector<float> DFlashConfig::rope_inv_freq() const {
  // The same transformers computation as the target's YaRN, over the drafter's full head (neox
  // half-split layout; the target rotates only qk_rope_head_dim interleaved values).
  ModelConfig m;
  m.qk_rope_head_dim = head_dim;
  m.rope_theta = rope_theta;
  m.rope = rope;
  return m.rope_inv_freq();
}

std::vector<int64_t> default_target_layer_ids(int64_t n, int64_t k) {
  if (k < 1 || k > n) fail("default_target_layer_ids: need 1 ≤ taps (", k, ") ≤ target layers (", n, ")");
  if (k == 1) return {n / 2};
  std::vector<int64_t> out;
  const bool formula = n >= k + 3;  // step (N−4)/(k−1) ≥ 1: distinct, ascending, within [1, N−3]
  for (int64_t i = 0; i < k; ++i) {
    const double x = formula ? 1.0 + double(i) * double(n - 4) / double(k - 1) : double(i) * double(n - 1) / double(k - 1);
    out.push_back(int64_t(std::nearbyint(x)));  // round half to even, as Python's round()
  }
  return out;
}

void check_fits_target(const DFlashConfig& c, const ModelConfig& target, const std::string& cpath, bool warn) {
  // The drafter shares the target's embedding, lm_head and hidden states.
  if (c.hidden_size != target.hidden_size)
    fail(cpath, ": hidden_size = ", c.hidden_size, " differs from the target's hidden_size = ", target.hidden_size,
         " (the drafter reads the target's hidden states and embedding)");
  if (c.vocab_size != target.vocab_size)
    fail(cpath, ": vocab_size = ", c.vocab_size, " differs from the target's vocab_size = ", target.vocab_size,
         " (the drafter uses the target's embedding and lm_head)");
  if (c.mask_token_id >= target.vocab_size)
    fail(cpath, ": dflash_config.mask_token_id = ", c.mask_token_id, " is outside the target's vocabulary [0, ", target.vocab_size, ")");
  for (int64_t id : c.target_layer_ids)
    if (id >= target.num_hidden_layers)
      fail(cpath, ": dflash_config.target_layer_ids holds ", id, ", but the target has only ", target.num_hidden_layers,
           " layers (0-based indices < ", target.num_hidden_layers, ")");
  if (warn && c.num_target_layers && c.num_target_layers != target.num_hidden_layers)
    log_info("warning: ", cpath, ": num_target_layers = ", c.num_target_layers, " but the target has ",
             target.num_hidden_layers, " layers: is this the drafter for this target?");

}

DFlashDrafter::~DFlashDrafter() = default;

const char* yarn_factor_rule_name(YarnFactorRule r) {
  switch (r) {
    case YarnFactorRule::none: return "none";
    case YarnFactorRule::attention_factor: return "attention_factor";
    case YarnFactorRule::mscale_ratio: return "mscale_ratio";
    case YarnFactorRule::legacy: return "legacy";
    case YarnFactorRule::legacy_option: return "legacy_option";
  }
  return "?";
}

void apply_load_options(DFlashConfig& c, const DFlashLoadOptions& o, const std::string& label) {
  if (o.yarn_legacy_mscale) {
    if (!c.rope.yarn) fail("--draft-yarn-legacy-mscale: ", label, " has no YaRN rope_scaling (the flag would change nothing)");
    if (c.rope.attention_factor)
      fail("--draft-yarn-legacy-mscale: ", label, " gives rope_scaling.attention_factor = ", *c.rope.attention_factor,
           ", which the drafter uses as written; drop the flag");
    c.rope_attention_factor = yarn_legacy_attention_factor(c.rope);
    c.rope_attention_factor_rule = YarnFactorRule::legacy_option;
  }
}

DFlashConfig load_dflash_config(const std::string& dir) {
  if (std::error_code ec; !fs::is_directory(dir, ec)) fail(dir, ": not a directory (expected a DFlash drafter checkpoint directory)");
  const std::string cpath = dir + "/config.json";
  return parse_dflash_config(read_text(cpath, " (is this a DFlash drafter directory?)"), cpath);
}

std::shared_ptr<const DFlashDrafter> DFlashDrafter::load(const std::string& dir, const ModelConfig& target,
                                                         const DFlashLoadOptions& options) {
  return std::make_shared<const DFlashDrafter>(dir, target, options);
}

DFlashDrafter::DFlashDrafter(const std::string& dir, const ModelConfig& target, const DFlashLoadOptions& options)
    : dir_(dir) {
  cfg_ = load_dflash_config(dir);
  apply_load_options(cfg_, options, dir + "/config.json");
  const DFlashConfig& c = cfg_;
  check_fits_target(c, target, dir + "/config.json");

  // Tensors: model.safetensors, or the shards an index names (io/checkpoint.h checks both).
  shards_ = std::make_unique<ShardDir>(dir);
  auto get = [&](const std::string& name, std::vector<int64_t> shape) -> Weight {
    const TensorRef& t = shards_->get(name, shape, {DType::BF16, DType::F32, DType::F16});
    const TensorInfo* info = t.info;
    Weight w;
    w.name = name;
    w.rows = shape.size() == 2 ? shape[0] : 1;
    w.cols = shape.back();
    w.dtype = info->dtype;
    w.data = aligned(t.data(), info->nbytes(), dtype_size(w.dtype), owned_);
    return w;
  };
  auto vec = [&](const std::string& name, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    cpu::dequant_row(get(name, {n}), 0, out.data());
    return out;
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  fc_ = get("fc.weight", {H, c.n_taps() * H});
  hidden_norm_ = vec("hidden_norm.weight", H);
  final_norm_ = vec("norm.weight", H);
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& w = layers_[size_t(l)];
    const std::string p = cat("layers.", l, ".");
    w.attn_norm = vec(p + "input_layernorm.weight", H);
    w.ffn_norm = vec(p + "post_attention_layernorm.weight", H);
    w.q = get(p + "self_attn.q_proj.weight", {c.q_dim(), H});
    w.k = get(p + "self_attn.k_proj.weight", {c.kv_dim(), H});
    w.v = get(p + "self_attn.v_proj.weight", {c.kv_dim(), H});
    w.o = get(p + "self_attn.o_proj.weight", {H, c.q_dim()});
    w.q_norm = vec(p + "self_attn.q_norm.weight", hd);
    w.k_norm = vec(p + "self_attn.k_norm.weight", hd);
    w.gate = get(p + "mlp.gate_proj.weight", {I, H});
    w.up = get(p + "mlp.up_proj.weight", {I, H});
    w.down = get(p + "mlp.down_proj.weight", {H, I});
  }
  inv_freq_ = c.rope_inv_freq();
  rope_scaling_ = float(c.rope_attention_factor);
  softmax_scale_ = float(1.0 / std::sqrt(double(hd)));
}

uint64_t DFlashDrafter::weight_bytes() const {
  uint64_t n = fc_.bytes();
  for (const Layer& w : layers_)
    n += w.q.bytes() + w.k.bytes() + w.v.bytes() + w.o.bytes() + w.gate.bytes() + w.up.bytes() + w.down.bytes();
  return n;
}

DFlashDrafter::Context DFlashDrafter::new_context(int64_t max_tokens) const {
  Context ctx;
  ctx.max_tokens = std::clamp<int64_t>(max_tokens, 0, cfg_.max_position_embeddings);
  ctx.k.resize(layers_.size());
  ctx.v.resize(layers_.size());
  return ctx;
}

void DFlashDrafter::norm_rope(const std::vector<float>& norm, float* x, int64_t n, int64_t heads, int64_t first) const {
  const int64_t hd = cfg_.head_dim, half = hd / 2;
  std::vector<float> cs(static_cast<size_t>(2 * half));  // a position's scaled cos, then sin
  for (int64_t i = 0; i < n; ++i) {
    // transformers forms the angle as fp32(inv_freq) × fp32(position), then scales cos/sin —
    // once a position, shared by its heads (the trigonometry was most of a small drafter's RoPE).
    const float pos = float(first + i);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = inv_freq_[size_t(j)] * pos;
      cs[size_t(j)] = std::cos(angle) * rope_scaling_;
      cs[size_t(half + j)] = std::sin(angle) * rope_scaling_;
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (i * heads + h) * hd;
      cpu::rmsnorm(v, norm.data(), 1, hd, cfg_.rms_norm_eps, v);
      // Neox (half-split) rotation: pairs (v[j], v[j + half]), as transformers' rotate_half.
      for (int64_t j = 0; j < half; ++j) {
        const float c = cs[size_t(j)], s = cs[size_t(half + j)];
        const float a = v[j], b = v[j + half];
        v[j] = a * c - b * s;
        v[j + half] = b * c + a * s;
      }
    }
  }
}

void DFlashDrafter::append_context(Context& ctx, const float* taps, int64_t n) const {
  const DFlashConfig& c = cfg_;
  if (n < 0) fail("DFlash append_context: negative token count ", n);
  if (n == 0) return;
  if (ctx.k.size() != layers_.size()) fail("DFlash append_context: context was not made by this drafter's new_context");
  if (ctx.len + n > ctx.max_tokens)
    fail("DFlash draft context full: ", ctx.len, " + ", n, " tokens exceed the limit of ", ctx.max_tokens);
  const int64_t H = c.hidden_size, kvd = c.kv_dim();
  std::vector<float> ht(static_cast<size_t>(n * H));
  cpu::linear(fc_, taps, n, ht.data());
  cpu::rmsnorm(ht.data(), hidden_norm_.data(), n, H, c.rms_norm_eps, ht.data());
  for (size_t l = 0; l < layers_.size(); ++l) {
    // Context K/V depend only on Ht and this layer's Wk/Wv, never on earlier layers' outputs.
    std::vector<float>& k = ctx.k[l];
    std::vector<float>& v = ctx.v[l];
    k.resize(static_cast<size_t>((ctx.len + n) * kvd));
    v.resize(static_cast<size_t>((ctx.len + n) * kvd));
    float* kn = k.data() + ctx.len * kvd;
    cpu::linear(layers_[l].k, ht.data(), n, kn);
    cpu::linear(layers_[l].v, ht.data(), n, v.data() + ctx.len * kvd);
    norm_rope(layers_[l].k_norm, kn, n, c.num_key_value_heads, ctx.len);
  }
  ctx.len += n;
}

void DFlashDrafter::draft(const Context& ctx, const int32_t* block_ids, const Weight& embed, const Weight& lm_head,
                          float* logits) const {
  const DFlashConfig& c = cfg_;
  const int64_t B = c.block_size, H = c.hidden_size, V = c.vocab_size;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim(), I = c.intermediate_size, start = ctx.len, S = start + B;
  if (ctx.k.size() != layers_.size()) fail("DFlash draft: context was not made by this drafter's new_context");
  for (const Weight* w : {&embed, &lm_head})
    if (w->rows != V || w->cols != H)
      fail("DFlash draft: '", w->name, "' is [", w->rows, ", ", w->cols, "], expected the target's [vocab ", V, ", hidden ", H, "]");
  for (int64_t i = 0; i < B; ++i)
    if (block_ids[i] < 0 || block_ids[i] >= V)
      fail("DFlash draft: block token id ", block_ids[i], " at index ", i, " is outside the vocabulary [0, ", V, ")");

  std::vector<float> x(static_cast<size_t>(B * H)), xn(static_cast<size_t>(B * H)), y(static_cast<size_t>(B * H));
  std::vector<float> q(static_cast<size_t>(B * qd)), kb(static_cast<size_t>(B * kvd)), vb(static_cast<size_t>(B * kvd));
  std::vector<float> attn(static_cast<size_t>(B * qd)), g(static_cast<size_t>(B * I)), u(static_cast<size_t>(B * I));
  cpu::embed(embed, block_ids, B, x.data());  // the mask rows are the target's (frozen) embedding rows
  if (c.input_embedding_scale != 1.0)
    for (float& e : x) e *= float(c.input_embedding_scale);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& w = layers_[l];
    cpu::rmsnorm(x.data(), w.attn_norm.data(), B, H, c.rms_norm_eps, xn.data());
    cpu::linear(w.q, xn.data(), B, q.data());
    cpu::linear(w.k, xn.data(), B, kb.data());
    cpu::linear(w.v, xn.data(), B, vb.data());
    norm_rope(w.q_norm, q.data(), B, nh, start);
    norm_rope(w.k_norm, kb.data(), B, nkv, start);
    // Keys/values = [context ; block]; no mask: every block query sees all S keys.
    const float* kc = ctx.k[l].data();
    const float* vc = ctx.v[l].data();
    // Heads split across threads only when their work outweighs a hand-off: a small drafter's
    // heads are a few µs in all, and each hand-off on a loaded 2-core machine can cost a time slice.
    const int64_t head_grain = nh * B * S * hd * 2 >= (int64_t(1) << 18) ? 1 : nh;
    ThreadPool::global().parallel_for(nh, head_grain, [&](int64_t h0, int64_t h1) {
      std::vector<float> p(static_cast<size_t>(S));
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t g_kv = h / (nh / nkv);  // GQA: consecutive query heads share a KV head
        for (int64_t i = 0; i < B; ++i) {
          const float* qi = &q[size_t((i * nh + h) * hd)];
          auto key = [&](int64_t s) { return s < start ? kc + s * kvd + g_kv * hd : &kb[size_t((s - start) * kvd + g_kv * hd)]; };
          auto val = [&](int64_t s) { return s < start ? vc + s * kvd + g_kv * hd : &vb[size_t((s - start) * kvd + g_kv * hd)]; };
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t s = 0; s < S; ++s) mx = std::max(mx, p[size_t(s)] = cpu::dot_f32(qi, key(s), hd) * softmax_scale_);
          float sum = 0;
          for (int64_t s = 0; s < S; ++s) sum += (p[size_t(s)] = std::exp(p[size_t(s)] - mx));
          float* o = &attn[size_t((i * nh + h) * hd)];
          std::fill(o, o + hd, 0.0f);
          for (int64_t s = 0; s < S; ++s) {
            const float ps = p[size_t(s)] / sum;
            const float* vs = val(s);
            for (int64_t d = 0; d < hd; ++d) o[d] += ps * vs[d];
          }
        }
      }
    });
    cpu::linear(w.o, attn.data(), B, y.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    cpu::rmsnorm(x.data(), w.ffn_norm.data(), B, H, c.rms_norm_eps, xn.data());
    cpu::linear(w.gate, xn.data(), B, g.data());
    cpu::linear(w.up, xn.data(), B, u.data());
    cpu::swiglu(g.data(), u.data(), B * I, g.data());
    cpu::linear(w.down, g.data(), B, y.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }
  // Position 0 (the bonus token) predicts nothing new: logits for positions 1..B−1 only.
  cpu::rmsnorm(x.data() + H, final_norm_.data(), B - 1, H, c.rms_norm_eps, xn.data());
  cpu::linear(lm_head, xn.data(), B - 1, logits);
  // z-lab's compute_logits, in its fp32 order: × output_multiplier, then c·tanh(logits / c).
  const int64_t n = (B - 1) * V;
  const float mul = float(c.output_multiplier), cap = float(c.final_logit_softcapping);
  if (mul != 1.0f)
    for (int64_t i = 0; i < n; ++i) logits[i] *= mul;
  if (cap > 0)
    for (int64_t i = 0; i < n; ++i) logits[i] = std::tanh(logits[i] / cap) * cap;
}

}  // namespace kd
