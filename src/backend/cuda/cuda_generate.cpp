#include "backend/cuda/cuda_generate.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "sample/rng.h"
#include "sample/sampler.h"
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

  std::vector<float> logits(static_cast<size_t>(V)), taps(static_cast<size_t>(n_prompt * n_taps * hid));
  double t0 = now_s();
  {
    ForwardArgs a;
    a.ids = prompt.data();
    a.n = n_prompt;
    a.logits = logits.data();
    a.tap_layers = &taps_of;
    a.taps = n_taps ? taps.data() : nullptr;
    a.stats = &fst;
    target.forward(a);
  }
  drafter.append_context(n_taps ? taps.data() : nullptr, n_prompt);
  r.prefill_ms = st.prefill_ms = (now_s() - t0) * 1e3;
  r.prefill_weight_bytes = fst.weight_bytes;
  st.target_forwards = 1;
  fst = {};

  t0 = now_s();
  int32_t bonus = choose(logits.data(), n_prompt);
  emit(bonus, logits.data());
  std::vector<float> draft_logits(static_cast<size_t>((B - 1) * V));
  while (!done) {
    const int64_t start = target.size();
    const int64_t L = std::min({B - 1, ctx - 1 - start, n_max - int64_t(r.output_ids.size())});
    if (L < 1) fail("internal: no draft position left at ", start);
    double td = now_s();
    drafter.draft(bonus, start, draft_logits.data());
    DraftTree tree = spec.chain ? build_draft_chain(draft_logits.data(), L, V)
                                : build_draft_tree(draft_logits.data(), L, V, spec.budget);
    tree.tokens[0] = bonus;
    st.draft_ms += (now_s() - td) * 1e3;

    const int64_t n = tree.size();
    std::vector<int32_t> positions(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) positions[size_t(i)] = int32_t(start + tree.depths[size_t(i)]);
    const std::vector<uint8_t> vis = tree.visibility();
    std::vector<float> vlogits(static_cast<size_t>(n * V)), vtaps(static_cast<size_t>(n * n_taps * hid));
    double tv = now_s();
    ForwardArgs a;
    a.ids = tree.tokens.data();
    a.n = n;
    a.positions = positions.data();
    a.visibility = vis.data();
    a.commit = false;
    a.all_logits = true;
    a.logits = vlogits.data();
    a.tap_layers = &taps_of;
    a.taps = n_taps ? vtaps.data() : nullptr;
    a.stats = &fst;
    target.forward(a);
    st.verify_ms += (now_s() - tv) * 1e3;
    ++st.target_forwards;
    ++st.rounds;
    st.drafted += n - 1;

    std::vector<int32_t> path = {0};
    int32_t cur = 0;
    for (;;) {
      const float* lg = &vlogits[size_t(cur) * size_t(V)];
      const int32_t tok = choose(lg, start + tree.depths[size_t(cur)] + 1);
      if (!emit(tok, lg)) break;
      const int32_t child = tree.child_with_token(cur, tok);
      if (child < 0) {
        bonus = tok;
        break;
      }
      cur = child;
      path.push_back(child);
    }
    const int64_t tau = int64_t(path.size());
    st.accepted += tau - 1;
    ++st.tau_histogram[size_t(std::min(tau, B))];
    if (done) break;
    target.compact(start, path);
    std::vector<float> acc_taps(static_cast<size_t>(tau * n_taps * hid));
    for (int64_t k = 0; k < tau && n_taps; ++k)
      std::copy_n(&vtaps[size_t(path[size_t(k)]) * size_t(n_taps * hid)], n_taps * hid, &acc_taps[size_t(k * n_taps * hid)]);
    drafter.append_context(n_taps ? acc_taps.data() : nullptr, tau);
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = fst.weight_bytes;
  r.n_target_forwards = st.target_forwards;
  return res;
}

}  // namespace kd
