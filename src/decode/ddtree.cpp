#include "decode/ddtree.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "sample/rng.h"
#include "decode/round.h"

namespace kd {

SpecResult generate_ddtree(const DeepseekV3& model, Drafter& drafter, const std::vector<int32_t>& prompt,
                           const GenerateOptions& opt, const SpecOptions& spec,
                           const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = model.config();
  if (!spec.chain && spec.budget < 1) fail("--budget must be at least 1 (got ", spec.budget, ")");
  if (!spec.chain && spec.budget > kMaxTreeBudget)
    fail("--budget ", spec.budget, " is more than ", kMaxTreeBudget, " tree nodes (memory and time grow with budget²)");
  const GenerationLimits lim = check_generation(c, prompt, opt);
  const int64_t ctx = lim.ctx, n_prompt = lim.n_prompt, n_max = lim.n_max;
  const int64_t B = drafter.block_size(), V = c.vocab_size;
  if (drafter.context_len() != 0) fail("the drafter already holds context: use a fresh drafter per generation");

  SpecResult res;
  GenerateResult& r = res.gen;
  SpecStats& st = res.stats;
  st.tau_histogram.assign(size_t(B + 1), 0);
  r.n_prompt = n_prompt;
  if (n_max == 0) {
    r.finish_reason = "length";
    return res;
  }
  // Rows: the committed sequence plus one round's scratch tree.
  const int64_t max_nodes = spec.chain ? B - 1 : spec.budget;
  LatentCache cache(c.num_hidden_layers, c.latent_dim(), n_prompt + n_max + max_nodes + 1);
  const std::vector<int32_t>& taps_of = drafter.tap_layers();
  const int64_t n_taps = int64_t(taps_of.size());
  ForwardStats fst;

  // Emits one token; false when generation must stop (a stop id, or the length limit).
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

  // Prefill: the same forward as AR (expanded MLA), plus the drafter's context features.
  std::vector<float> logits(static_cast<size_t>(V)), taps(static_cast<size_t>(n_prompt * n_taps * c.hidden_size));
  double t0 = now_s();
  {
    ForwardArgs a;
    a.ids = prompt.data();
    a.n = n_prompt;
    a.form = AttnForm::expanded;
    a.logits = logits.data();
    a.tap_layers = &taps_of;
    a.taps = n_taps ? taps.data() : nullptr;
    a.stats = &fst;
    model.forward(cache, a);
  }
  drafter.append_context(n_taps ? taps.data() : nullptr, n_prompt);
  r.prefill_ms = st.prefill_ms = (now_s() - t0) * 1e3;
  r.prefill_weight_bytes = fst.weight_bytes;
  st.target_forwards = 1;
  fst = {};

  t0 = now_s();
  int32_t bonus = choose(logits.data(), n_prompt);
  emit(bonus, logits.data());
  std::vector<float> draft_logits;
  while (!done) {
    const int64_t start = cache.size();  // the bonus token's position
    // Draft positions this round: the block, cut so no node lies past the context or the length
    // limit. While generation goes on, at least one remains: emitted < n_max ≤ ctx − n_prompt.
    const int64_t L = std::min({B - 1, ctx - 1 - start, n_max - int64_t(r.output_ids.size())});
    if (L < 1) fail("internal: no draft position left at ", start);
    double td = now_s();
    const DraftRound round = draft_round(drafter, bonus, start, L, spec, V, draft_logits);
    const DraftTree& tree = round.tree;
    st.draft_ms += (now_s() - td) * 1e3;

    // Verify: one target forward over [bonus, nodes…] at positions start + depth, ancestors only.
    const int64_t n = tree.size();
    std::vector<float> vlogits(static_cast<size_t>(n * V)), vtaps(static_cast<size_t>(n * n_taps * c.hidden_size));
    double tv = now_s();
    ForwardArgs a;
    a.ids = tree.tokens.data();
    a.n = n;
    a.positions = round.positions.data();
    a.visibility = round.visibility.data();
    a.commit = false;
    a.form = AttnForm::absorbed;
    a.all_logits = true;
    a.logits = vlogits.data();
    a.tap_layers = &taps_of;
    a.taps = n_taps ? vtaps.data() : nullptr;
    a.stats = &fst;
    model.forward(cache, a);
    st.verify_ms += (now_s() - tv) * 1e3;
    ++st.target_forwards;
    ++st.rounds;
    st.drafted += n - 1;

    // Walk: follow the target's own choice while it matches a child; the first miss is the bonus.
    const std::vector<int32_t> path = accept_walk(tree, vlogits.data(), V, start, choose, emit, &bonus);
    const int64_t tau = int64_t(path.size());  // accepted drafts + 1
    st.accepted += tau - 1;
    ++st.tau_histogram[size_t(std::min(tau, B))];
    if (done) break;
    // Keep the accepted rows' latent KV (gathered into place), drop the rest; feed their features on.
    cache.compact(start, path);
    std::vector<float> acc_taps(static_cast<size_t>(tau * n_taps * c.hidden_size));
    for (int64_t k = 0; k < tau && n_taps; ++k)
      std::copy_n(&vtaps[size_t(path[size_t(k)]) * size_t(n_taps * c.hidden_size)], n_taps * c.hidden_size,
                  &acc_taps[size_t(k * n_taps * c.hidden_size)]);
    drafter.append_context(n_taps ? acc_taps.data() : nullptr, tau);
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = fst.weight_bytes;
  r.n_target_forwards = st.target_forwards;
  return res;
}

}  // namespace kd
