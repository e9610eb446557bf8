#include "decode/round.h"

#include <algorithm>
#include <utility>

namespace kd {

DraftTree draft_tree(Drafter& drafter, int32_t bonus, int64_t start, int64_t L, const SpecOptions& spec, int64_t vocab,
                     std::vector<float>& draft_logits, bool device_top_k, const NodeFilter& filter) {
  const int64_t k = spec.chain ? 1 : std::min<int64_t>(spec.budget, vocab);
  DraftTopK top;
  if (device_top_k && drafter.top_k_on_device(bonus, start, L, k, top))
    return spec.chain ? build_draft_chain(top, filter) : build_draft_tree(top, spec.budget, filter);
  draft_logits.resize(static_cast<size_t>((drafter.block_size() - 1) * vocab));
  drafter.draft(bonus, start, draft_logits.data());
  if (filter) {
    const DraftTopK host = draft_top_k(draft_logits.data(), L, vocab, k);
    return spec.chain ? build_draft_chain(host, filter) : build_draft_tree(host, spec.budget, filter);
  }
  return spec.chain ? build_draft_chain(draft_logits.data(), L, vocab) : build_draft_tree(draft_logits.data(), L, vocab, spec.budget);
}

DraftRound draft_round(Drafter& drafter, int32_t bonus, int64_t start, int64_t L, const SpecOptions& spec,
                       int64_t vocab, std::vector<float>& draft_logits, bool device_top_k, const NodeFilter& filter) {
  return make_round(draft_tree(drafter, bonus, start, L, spec, vocab, draft_logits, device_top_k, filter), bonus, start);
}

DraftRound make_round(DraftTree tree, int32_t bonus, int64_t start) {
  DraftRound r;
  r.tree = std::move(tree);
  r.tree.tokens[0] = bonus;
  const int64_t n = r.tree.size();
  r.positions.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r.positions[size_t(i)] = int32_t(start + r.tree.depths[size_t(i)]);
  r.visibility = r.tree.visibility();
  return r;
}

}  // namespace kd
