#include "model/perplexity.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "io/safetensors.h"

namespace kd {

std::vector<PplWindow> ppl_windows(int64_t n_tokens, int64_t ctx, int64_t stride, bool bos) {
  if (ctx < 4) fail("--ctx ", ctx, ": the context must be at least 4 tokens");
  if (n_tokens < 2 * ctx)
    fail("the text tokenizes to ", n_tokens, " tokens, fewer than 2 × --ctx = ", 2 * ctx,
         " (llama.cpp's perplexity needs at least two chunks); give a longer file or a smaller --ctx");
  std::vector<PplWindow> w;
  if (stride == 0) {
    const int64_t first = ctx / 2;
    for (int64_t i = 0; i < n_tokens / ctx; ++i) w.push_back({i * ctx, first, ctx - 1 - first, bos});
    return w;
  }
  if (stride < 1 || stride > ctx - 1) fail("--stride ", stride, " must be in [1, ctx − 1 = ", ctx - 1, "]");
  const int64_t n = (n_tokens - ctx + stride - 1) / stride;
  for (int64_t i = 0; i < n; ++i) w.push_back({i * stride, ctx - stride - 1, stride, false});
  return w;
}

double NllStats::ppl() const { return std::exp(mean()); }

double NllStats::ppl_stderr() const {
  if (count < 2) return 0;
  const double m = mean(), v = sum2 / double(count) - m * m;
  return v > 0 ? ppl() * std::sqrt(v / double(count - 1)) : 0;
}

namespace {

// log Σ exp(l) with the max subtracted, in double.
double log_sum_exp(const float* l, int64_t vocab, int32_t* argmax) {
  float mx = l[0];
  int32_t am = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (l[i] > mx) mx = l[i], am = int32_t(i);
  double s = 0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(double(l[i]) - double(mx));
  if (argmax) *argmax = am;
  return double(mx) + std::log(s);
}

void check_finite(const float* l, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i)
    if (!std::isfinite(l[i])) fail("the model produced a non-finite logit (", l[i], ") at vocabulary id ", i);
}

}  // namespace

RowScore score_row(const float* logits, int64_t vocab, int32_t target, int32_t k, int32_t* topk_ids, float* topk_logprobs) {
  check_finite(logits, vocab);
  RowScore r;
  const double lse = log_sum_exp(logits, vocab, &r.argmax);
  r.nll = lse - double(logits[target]);
  if (k > 0) {
    std::vector<int32_t> idx(static_cast<size_t>(vocab));
    for (int64_t i = 0; i < vocab; ++i) idx[size_t(i)] = int32_t(i);
    const int64_t kk = std::min<int64_t>(k, vocab);
    std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < kk; ++i) {
      topk_ids[i] = idx[size_t(i)];
      topk_logprobs[i] = float(double(logits[idx[size_t(i)]]) - lse);
    }
  }
  return r;
}

KlRow kl_row(const float* logits, int64_t vocab, int32_t target, double base_nll, const int32_t* base_ids,
             const float* base_logprobs, int32_t k) {
  check_finite(logits, vocab);
  int32_t am = 0;
  const double lse = log_sum_exp(logits, vocab, &am);
  KlRow r;
  double sp = 0, sq = 0, kl = 0;
  for (int32_t i = 0; i < k; ++i) {
    const double lp = base_logprobs[i], lq = double(logits[base_ids[i]]) - lse;
    const double p = std::exp(lp);
    sp += p;
    sq += std::exp(lq);
    kl += p * (lp - lq);
  }
  // A tail below 1e-5 is the stored fp32 log-probabilities' rounding (k = vocab leaves 1e-8 of
  // "tail"), not mass: its term would be noise times log(1e-300) when Σ q rounds past 1.
  const double tp = std::max(0.0, 1.0 - sp), tq = std::max(1e-300, 1.0 - sq);
  if (tp > 1e-5) kl += tp * (std::log(tp) - std::log(tq));
  r.kl = kl;
  r.tail = tp;
  r.same_top = am == base_ids[0];
  r.p_diff = std::exp(-(lse - double(logits[target]))) - std::exp(-base_nll);
  return r;
}

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double f) {
    const double x = f * double(v.size() - 1);
    const size_t i = size_t(x);
    const double t = x - double(i);
    return (1 - t) * v[i] + t * v[std::min(i + 1, v.size() - 1)];
  };
  p.min = v.front(), p.max = v.back();
  p.p01 = at(0.001), p.p1 = at(0.01), p.p5 = at(0.05), p.p10 = at(0.10), p.median = at(0.5);
  p.p90 = at(0.90), p.p95 = at(0.95), p.p99 = at(0.99), p.p999 = at(0.999);
  return p;
}

// ------------------------------------------------------------------------------------------------
// The stored reference

void save_ppl_logits(const std::string& path, const PplLogits& l) {
  const int64_t m = int64_t(l.target.size());
  SafetensorsWriter w;
  w.add_bytes("tokens", DType::I32, {int64_t(l.tokens.size())}, l.tokens.data());
  w.add_bytes("target", DType::I32, {m}, l.target.data());
  w.add_bytes("nll", DType::F64, {m}, l.nll.data());
  w.add_bytes("topk_ids", DType::I32, {m, l.k}, l.topk_ids.data());
  w.add_bytes("topk_logprobs", DType::F32, {m, l.k}, l.topk_logprobs.data());
  w.set_metadata("format", "kdtree-ppl-logits/1");
  w.set_metadata("ctx", std::to_string(l.ctx));
  w.set_metadata("stride", std::to_string(l.stride));
  w.set_metadata("vocab", std::to_string(l.vocab));
  w.set_metadata("k", std::to_string(l.k));
  w.set_metadata("bos", l.bos ? "1" : "0");
  w.set_metadata("bos_id", std::to_string(l.bos_id));
  w.set_metadata("model", l.model);
  w.write(path);
}

PplLogits load_ppl_logits(const std::string& path) {
  SafetensorsFile f(path);
  auto meta = [&](const char* key) -> const std::string& {
    auto it = f.metadata().find(key);
    if (it == f.metadata().end()) fail(path, ": not a `kdtree ppl --save-logits` file (no metadata '", key, "')");
    return it->second;
  };
  if (meta("format") != "kdtree-ppl-logits/1")
    fail(path, ": format '", meta("format"), "' is not kdtree-ppl-logits/1 (written by kdtree ppl --save-logits)");
  auto integer = [&](const char* key, int64_t lo, int64_t hi) {
    const std::string& s = meta(key);
    int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) fail(path, ": metadata ", key, " = '", s, "' is out of range");
    return v;
  };
  PplLogits l;
  l.ctx = integer("ctx", 4, int64_t(1) << 24);
  l.stride = integer("stride", 0, int64_t(1) << 24);
  l.vocab = integer("vocab", 1, int64_t(1) << 26);
  l.k = int32_t(integer("k", 1, 1 << 20));
  l.bos = integer("bos", 0, 1) == 1;
  l.bos_id = int32_t(integer("bos_id", -1, int64_t(1) << 26));
  l.model = meta("model");
  auto tensor = [&](const char* name, DType dt, size_t rank) -> const TensorInfo& {
    const TensorInfo* t = f.find(name);
    if (!t) fail(path, ": missing tensor '", name, "'");
    if (t->dtype != dt || t->shape.size() != rank)
      fail(path, ": tensor '", name, "' is ", dtype_name(t->dtype), " ", t->shape_str(), ", expected ", dtype_name(dt), " of rank ", rank);
    return *t;
  };
  auto copy = [&](const TensorInfo& t, auto& v) {
    v.resize(size_t(t.nbytes() / sizeof(v[0])));
    std::memcpy(v.data(), f.data(t), t.nbytes());
  };
  copy(tensor("tokens", DType::I32, 1), l.tokens);
  const TensorInfo& tt = tensor("target", DType::I32, 1);
  const int64_t m = tt.shape[0];
  copy(tt, l.target);
  const TensorInfo& tn = tensor("nll", DType::F64, 1);
  const TensorInfo& ti = tensor("topk_ids", DType::I32, 2);
  const TensorInfo& tl = tensor("topk_logprobs", DType::F32, 2);
  if (tn.shape[0] != m || ti.shape != std::vector<int64_t>{m, l.k} || tl.shape != ti.shape)
    fail(path, ": tensor shapes disagree (target ", tt.shape_str(), ", nll ", tn.shape_str(), ", topk_ids ", ti.shape_str(),
         ", topk_logprobs ", tl.shape_str(), ", k = ", l.k, ")");
  copy(tn, l.nll);
  copy(ti, l.topk_ids);
  copy(tl, l.topk_logprobs);
  for (int32_t id : l.tokens)
    if (id < 0 || id >= l.vocab) fail(path, ": token id ", id, " outside the vocabulary of ", l.vocab);
  for (size_t i = 0; i < l.target.size(); ++i)
    if (l.target[i] < 0 || l.target[i] >= l.vocab || !std::isfinite(l.nll[i]) || l.nll[i] < -1e-6)
      fail(path, ": scored position ", i, " holds target ", l.target[i], " / nll ", l.nll[i], " (out of range)");
  for (size_t i = 0; i < l.topk_ids.size(); ++i)
    if (l.topk_ids[i] < 0 || l.topk_ids[i] >= l.vocab || !std::isfinite(l.topk_logprobs[i]) || l.topk_logprobs[i] > 1e-4f)
      fail(path, ": top-k entry ", i, " holds id ", l.topk_ids[i], " / log-probability ", l.topk_logprobs[i], " (out of range)");
  return l;
}

// ------------------------------------------------------------------------------------------------

namespace {

std::pair<double, double> mean_and_uncertainty(double sum, double sum2, int64_t count) {
  if (count < 1) return {0, 0};
  const double f = sum / double(count);
  double df = sum2 / double(count) - f * f;
  df = df > 0 && count > 10 ? std::sqrt(df / double(count - 1)) : 0.0;
  return {f, df};
}

}  // namespace

PplResult run_perplexity(const std::vector<int32_t>& tokens, int64_t vocab, const PplOptions& o, const PplForward& forward,
                         const std::function<void(int64_t, int64_t, const NllStats&)>& on_window) {
  for (int32_t id : tokens)
    if (id < 0 || id >= vocab) fail("token id ", id, " is outside the model's vocabulary of ", vocab);
  if (o.bos && (o.bos_id < 0 || o.bos_id >= vocab)) fail("BOS id ", o.bos_id, " is outside the vocabulary of ", vocab);
  if (o.top_k < 1) fail("--top-k must be at least 1");
  std::vector<PplWindow> windows = ppl_windows(int64_t(tokens.size()), o.ctx, o.stride, o.bos);
  if (o.max_windows > 0 && int64_t(windows.size()) > o.max_windows) windows.resize(size_t(o.max_windows));
  const PplLogits* b = o.base;
  if (b) {
    if (b->vocab != vocab) fail("--kl-divergence: the reference has a vocabulary of ", b->vocab, ", this model ", vocab);
    if (b->ctx != o.ctx || b->stride != o.stride || b->bos != o.bos)
      fail("--kl-divergence: the reference was made with --ctx ", b->ctx, " --stride ", b->stride, " BOS ", b->bos ? "on" : "off",
           "; this run has --ctx ", o.ctx, " --stride ", o.stride, " BOS ", o.bos ? "on" : "off", ": use the same settings");
    if (b->tokens != tokens)
      fail("--kl-divergence: the text tokenizes differently from the reference's (", b->tokens.size(), " vs ", tokens.size(),
           " tokens): use the same file and tokenizer");
  }
  PplResult r;
  r.n_windows = int64_t(windows.size());
  r.n_tokens = int64_t(tokens.size());
  const int32_t k = int32_t(std::min<int64_t>(o.top_k, vocab));
  if (o.keep_logits) {
    r.logits.ctx = o.ctx, r.logits.stride = o.stride, r.logits.vocab = vocab, r.logits.k = k;
    r.logits.bos = o.bos, r.logits.bos_id = o.bos_id, r.logits.tokens = tokens;
  }
  std::vector<float> logits(size_t(o.ctx) * size_t(vocab));
  std::vector<int32_t> ids(size_t(o.ctx));
  std::vector<int32_t> tk(static_cast<size_t>(k));
  std::vector<float> tl(static_cast<size_t>(k));
  // KL accumulators, llama.cpp's kl_divergence_result.
  NllStats base_nll;
  double sum_nll_nll_base = 0, sum_kl = 0, sum_kl2 = 0, sum_pd = 0, sum_pd2 = 0, sum_pd4 = 0, sum_tail = 0, max_tail = 0;
  int64_t same_top = 0, scored = 0;
  std::vector<double> kls;
  for (size_t wi = 0; wi < windows.size(); ++wi) {
    const PplWindow& w = windows[wi];
    std::copy(tokens.begin() + w.start, tokens.begin() + w.start + o.ctx, ids.begin());
    if (w.bos) ids[0] = o.bos_id;
    const double t0 = now_s();
    forward(ids.data(), o.ctx, logits.data());
    r.forward_ms += (now_s() - t0) * 1e3;
    for (int64_t j = w.first; j < w.first + w.n_scored; ++j) {
      const int32_t target = tokens[size_t(w.start + j + 1)];
      const float* row = logits.data() + size_t(j) * size_t(vocab);
      const RowScore s = score_row(row, vocab, target, o.keep_logits ? k : 0, tk.data(), tl.data());
      r.nll.add(s.nll);
      if (o.keep_logits) {
        r.logits.target.push_back(target);
        r.logits.nll.push_back(s.nll);
        r.logits.topk_ids.insert(r.logits.topk_ids.end(), tk.begin(), tk.end());
        r.logits.topk_logprobs.insert(r.logits.topk_logprobs.end(), tl.begin(), tl.end());
      }
      if (b) {
        if (b->target[size_t(scored)] != target) fail("--kl-divergence: the reference scores another token at position ", scored);
        const double bn = b->nll[size_t(scored)];
        const KlRow kr = kl_row(row, vocab, target, bn, &b->topk_ids[size_t(scored) * size_t(b->k)],
                                &b->topk_logprobs[size_t(scored) * size_t(b->k)], b->k);
        base_nll.add(bn);
        sum_nll_nll_base += s.nll * bn;
        sum_kl += kr.kl, sum_kl2 += kr.kl * kr.kl;
        sum_pd += kr.p_diff, sum_pd2 += kr.p_diff * kr.p_diff, sum_pd4 += kr.p_diff * kr.p_diff * kr.p_diff * kr.p_diff;
        sum_tail += kr.tail, max_tail = std::max(max_tail, kr.tail);
        same_top += kr.same_top;
        kls.push_back(kr.kl);
      }
      ++scored;
    }
    r.running_ppl.push_back(r.nll.ppl());
    r.running_err.push_back(r.nll.ppl_stderr());
    if (on_window) on_window(int64_t(wi), int64_t(windows.size()), r.nll);
  }
  if (b) {
    if (scored != int64_t(b->target.size()))
      fail("--kl-divergence: the reference holds ", b->target.size(), " scored tokens, this run ", scored);
    KlSummary& s = r.kl;
    r.has_kl = true;
    const int64_t n = scored;
    const auto lp = mean_and_uncertainty(r.nll.sum, r.nll.sum2, n);
    const auto lb = mean_and_uncertainty(base_nll.sum, base_nll.sum2, n);
    const double cov = n < 10 ? 0.0 : (sum_nll_nll_base / double(n) - lp.first * lb.first) / double(n - 1);
    const double ppl = std::exp(lp.first), ppl_err = ppl * lp.second;
    s.ppl_base = std::exp(lb.first), s.ppl_base_err = s.ppl_base * lb.second;
    s.cor = lp.second > 0 && lb.second > 0 ? cov / (lp.second * lb.second) : 0;
    s.ln_ratio = lp.first - lb.first;
    s.ln_ratio_err = std::sqrt(std::max(0.0, lp.second * lp.second + lb.second * lb.second - 2 * cov));
    s.ppl_diff = ppl - s.ppl_base;
    s.ppl_diff_err = std::sqrt(std::max(0.0, ppl_err * ppl_err + s.ppl_base_err * s.ppl_base_err - 2 * ppl * s.ppl_base * cov));
    const auto kl = mean_and_uncertainty(sum_kl, sum_kl2, n);
    s.kl_mean = kl.first, s.kl_err = kl.second;
    s.kl = percentiles(kls);
    s.same_top = double(same_top) / double(n);
    s.same_top_err = n > 1 ? std::sqrt(s.same_top * (1 - s.same_top) / double(n - 1)) : 0;
    const auto pd = mean_and_uncertainty(sum_pd, sum_pd2, n);
    s.p_diff_mean = pd.first, s.p_diff_err = pd.second;
    s.p_diff_rms = std::sqrt(sum_pd2 / double(n));
    s.tail_mean = sum_tail / double(n), s.tail_max = max_tail;
  }
  return r;
}

}  // namespace kd
