#include "backend/cuda/cuda_generate.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "sample/rng.h"
#include "sample/sampler.h"
#include "backend/cuda/cuda_dflash.h"
#include "spec/round.h"
#include "spec/tree.h"

namespace kd {

GenerateResult generate_ar_cuda(CudaTarget& target, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                                const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = target.config();
  const GenerationLimits lim = check_generation(c, prompt, opt);
  const int64_t n_prompt = lim.n_prompt, n_max = lim.n_max, V = c.vocab_size;
  if (n_prompt + n_max > target.max_tokens())
    fail("the CUDA cache holds ", target.max_tokens(), " tokens; this request needs ", n_prompt + n_max);
  target.reset();
  GenerateResult r;
  r.n_prompt = n_prompt;
  if (n_max == 0) {
    r.finish_reason = "length";
    return r;
  }
  std::vector<float> logits(static_cast<size_t>(opt.keep_prompt_logits ? n_prompt * V : V));
  ForwardStats st;
  double t0 = now_s();
  ForwardArgs a;
  a.ids = prompt.data();
  a.n = n_prompt;
  a.all_logits = opt.keep_prompt_logits;
  a.logits = logits.data();
  a.stats = &st;
  target.forward(a);
  r.prefill_ms = (now_s() - t0) * 1e3;
  r.n_target_forwards = 1;
  r.prefill_weight_bytes = st.weight_bytes;
  if (opt.keep_prompt_logits) r.prompt_logits = logits;
  const float* last = logits.data() + (opt.keep_prompt_logits ? (n_prompt - 1) * V : 0);
  std::vector<float> step(last, last + V);
  st = {};
  t0 = now_s();
  for (int64_t i = 0;; ++i) {
    const int64_t pos = n_prompt + i;
    const int32_t tok = sample(step.data(), int32_t(V), opt.sampling, position_uniform(opt.sampling.seed, opt.seq_id, uint64_t(pos)));
    r.output_ids.push_back(tok);
    if (opt.keep_logits) r.logits.insert(r.logits.end(), step.begin(), step.end());
    if (on_token) on_token(tok);
    if (!opt.ignore_eos && std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      r.finish_reason = "stop";
      break;
    }
    if (int64_t(r.output_ids.size()) >= n_max) {
      r.finish_reason = "length";
      break;
    }
    ForwardArgs d;
    d.ids = &tok;
    d.n = 1;
    d.logits = step.data();
    d.stats = &st;
    target.forward(d);
    ++r.n_target_forwards;
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = st.weight_bytes;
  return r;
}

SpecResult generate_ddtree_cuda(CudaTarget& target, Drafter& drafter, const std::vector<int32_t>& prompt,
                                const GenerateOptions& opt, const SpecOptions& spec,
                                const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = target.config();
  if (!spec.chain && spec.budget < 1) fail("--budget must be at least 1 (got ", spec.budget, ")");
  const GenerationLimits lim = check_generation(c, prompt, opt);
  const int64_t ctx = lim.ctx, n_prompt = lim.n_prompt, n_max = lim.n_max;
  const int64_t B = drafter.block_size(), V = c.vocab_size, hid = c.hidden_size;
  if (drafter.context_len() != 0) fail("the drafter already holds context: use a fresh drafter per generation");
  const int64_t max_nodes = spec.chain ? B - 1 : spec.budget;
  if (n_prompt + n_max + max_nodes + 1 > target.max_tokens())
    fail("the CUDA cache holds ", target.max_tokens(), " tokens; this request needs ", n_prompt + n_max + max_nodes + 1);
  target.reset();
  SpecResult res;
  GenerateResult& r = res.gen;
  SpecStats& st = res.stats;
  st.tau_histogram.assign(size_t(B + 1), 0);
  r.n_prompt = n_prompt;
  if (n_max == 0) {
    r.finish_reason = "length";
    return res;
  }
  const std::vector<int32_t>& taps_of = drafter.tap_layers();
  const int64_t n_taps = int64_t(taps_of.size());
  ForwardStats fst;
  bool done = false;
  auto emit = [&](int32_t tok, const float* logits) {
    r.output_ids.push_back(tok);
    if (opt.keep_logits) r.logits.insert(r.logits.end(), logits, logits + V);
    if (on_token) on_token(tok);
    if (!opt.ignore_eos && std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      r.finish_reason = "stop";
      done = true;
    } else if (int64_t(r.output_ids.size()) >= n_max) {
      r.finish_reason = "length";
      done = true;
    }
    return !done;
  };
  auto choose = [&](const float* logits, int64_t pos) {
    return sample(logits, int32_t(V), opt.sampling, position_uniform(opt.sampling.seed, opt.seq_id, uint64_t(pos)));
  };

  // A drafter on the GPU reads the target's taps where the forward left them (no download of taps,
  // no upload of kept rows); any other drafter gets them on the host.
  CudaDFlash* gpu_drafter = dynamic_cast<CudaDFlash*>(&drafter);
  const bool host_taps = n_taps && !gpu_drafter;
  auto run_forward = [&](ForwardArgs& a, std::vector<float>& host) -> const float* {
    a.tap_layers = &taps_of;
    a.stats = &fst;
    if (gpu_drafter && n_taps) return target.forward_device_taps(a);
    host.resize(static_cast<size_t>(a.n * n_taps * hid));
    a.taps = host_taps ? host.data() : nullptr;
    target.forward(a);
    return nullptr;
  };

  std::vector<float> logits(static_cast<size_t>(V)), taps;
  double t0 = now_s();
  {
    ForwardArgs a;
    a.ids = prompt.data();
    a.n = n_prompt;
    a.logits = logits.data();
    const float* taps_dev = run_forward(a, taps);
    if (taps_dev)
      gpu_drafter->append_context_device(taps_dev, n_prompt, nullptr);
    else
      drafter.append_context(host_taps ? taps.data() : nullptr, n_prompt);
  }
  r.prefill_ms = st.prefill_ms = (now_s() - t0) * 1e3;
  r.prefill_weight_bytes = fst.weight_bytes;
  st.target_forwards = 1;
  fst = {};

  t0 = now_s();
  int32_t bonus = choose(logits.data(), n_prompt);
  emit(bonus, logits.data());
  std::vector<float> draft_logits, vlogits, vtaps, acc_taps;
  while (!done) {
    const int64_t start = target.size();
    const int64_t L = std::min({B - 1, ctx - 1 - start, n_max - int64_t(r.output_ids.size())});
    if (L < 1) fail("internal: no draft position left at ", start);
    double td = now_s();
    const DraftRound dr = draft_round(drafter, bonus, start, L, spec, V, draft_logits);
    st.draft_ms += (now_s() - td) * 1e3;

    const int64_t n = dr.tree.size();
    vlogits.resize(static_cast<size_t>(n * V));
    double tv = now_s();
    ForwardArgs a;
    a.ids = dr.tree.tokens.data();
    a.n = n;
    a.positions = dr.positions.data();
    a.visibility = dr.visibility.data();
    a.commit = false;
    a.all_logits = true;
    a.logits = vlogits.data();
    const float* vtaps_dev = run_forward(a, vtaps);
    st.verify_ms += (now_s() - tv) * 1e3;
    ++st.target_forwards;
    ++st.rounds;
    st.drafted += n - 1;

    const std::vector<int32_t> path = accept_walk(dr.tree, vlogits.data(), V, start, choose, emit, &bonus);
    const int64_t tau = int64_t(path.size());
    st.accepted += tau - 1;
    ++st.tau_histogram[size_t(std::min(tau, B))];
    if (done) break;
    target.compact(start, path);
    if (vtaps_dev) {
      gpu_drafter->append_context_device(vtaps_dev, tau, path.data());
      continue;
    }
    acc_taps.resize(static_cast<size_t>(tau * n_taps * hid));
    for (int64_t k = 0; k < tau && host_taps; ++k)
      std::copy_n(&vtaps[size_t(path[size_t(k)]) * size_t(n_taps * hid)], n_taps * hid, &acc_taps[size_t(k * n_taps * hid)]);
    drafter.append_context(host_taps ? acc_taps.data() : nullptr, tau);
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = fst.weight_bytes;
  r.n_target_forwards = st.target_forwards;
  return res;
}

}  // namespace kd
