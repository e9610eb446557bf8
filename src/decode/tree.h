// DDTree's draft tree (SPEC-DDTREE.md §2, Algorithm 1): from per-position draft logits, the
// `budget` prefixes with the highest surrogate probability under the factorised draft
// distribution, found best-first with a heap. Nodes are numbered in pop order (root 0 = the bonus
// token), so parent[i] < i and every node's ancestors precede it.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "sample/top_k.h"  // DraftTopK, draft_top_k

namespace kd {

// Most tree nodes a round may verify (`run --budget`, `serve --budget`). The verify pass holds an
// ancestor mask and attention scores per node pair, so memory and time grow with budget²: 100,000
// took 11 GB and never finished a round. Acceptance stops improving far below this cap (the tree is
// at most block_size − 1 deep), so it bounds hostile or mistaken input, not useful work.
inline constexpr int64_t kMaxTreeBudget = 1024;

struct DraftTree {
  int64_t positions = 0;          // L: draft positions (block size − 1)
  std::vector<int32_t> tokens;    // [n + 1]; tokens[0] is the root (set by the caller, −1 until then)
  std::vector<int32_t> depths;    // [n + 1]; root 0, nodes 1..L
  std::vector<int32_t> parents;   // [n + 1]; parents[0] = −1
  std::vector<int32_t> ranks;     // [n + 1]; rank of the token within its position's top-K (root 0)
  std::vector<double> scores;     // [n + 1]; surrogate log-probability σ (root 0)
  std::vector<std::vector<int32_t>> children;  // [n + 1]; in pop order

  int64_t size() const { return int64_t(tokens.size()); }  // n + 1, root included
  // Index of cur's child carrying `token`, or −1.
  int32_t child_with_token(int32_t cur, int32_t token) const;
  // Ancestor-or-self visibility: mask[i * size() + j] = 1 when j is i or an ancestor of i.
  std::vector<uint8_t> visibility() const;
};

// logits: [positions, vocab] fp32 draft logits (temperature 1). budget ≥ 1 nodes, root excluded.
// Per position, tokens are ranked by logit (ties: lower id) and the first min(budget, vocab) kept,
// minus any with a −inf logit (zero draft probability: never a node); logp = fp32(logit − LSE) with
// the LSE in double; σ in double, updated incrementally (sibling: σ − logp[d−1,r] + logp[d−1,r+1];
// child: σ + logp[d,0]); heap ties broken by the smaller rank tuple, then the smaller parent index
// (the order of Python tuples in the reference).
DraftTree build_draft_tree(const float* logits, int64_t positions, int64_t vocab, int64_t budget);
// The same from draft_top_k(logits, positions, vocab, min(budget, vocab)).
DraftTree build_draft_tree(const DraftTopK& top, int64_t budget);

// Constrained decoding (a grammar): filter(parent, token) says whether `token` may follow node
// `parent`'s path; a node is added, at index size(), exactly when the filter returned true for it
// (so a caller can keep per-node state in step). Rejected candidates are skipped — their next-ranked
// sibling still enters the heap — so the budget goes to prefixes the grammar allows. An empty filter
// is the unfiltered build.
using NodeFilter = std::function<bool(int32_t parent, int32_t token)>;
DraftTree build_draft_tree(const DraftTopK& top, int64_t budget, const NodeFilter& filter);

// The first `nodes` nodes of `tree` (clamped to its size) with the root: again a tree in pop order.
// Truncating an unfiltered build_draft_tree(top-k of min(B, vocab), B) to N ≤ B nodes gives exactly
// build_draft_tree(top-k of min(N, vocab), N) (--budget auto drafts once at its largest budget):
// both heaps pop the same first N entries, because an entry of rank r exists only after its
// rank r − 1 sibling popped, so an N-node tree holds ranks ≤ N − 1 — all inside the smaller top-k,
// which is a prefix of the larger one with the same log-probabilities — and the entries only the
// larger top-k adds (rank ≥ N) cannot pop among the first N. (A grammar filter breaks this: a
// rejected candidate spends a rank but no budget.) A chain truncates to the shorter chain.
DraftTree truncate_tree(const DraftTree& tree, int64_t nodes);
// The root alone (an AR step as a round: --budget auto's fallback).
DraftTree root_tree(int64_t positions);

// The single chain of top-1 tokens (DFlash verify): `positions` nodes, node i's parent is i − 1.
DraftTree build_draft_chain(const float* logits, int64_t positions, int64_t vocab);
// The same from draft_top_k(logits, positions, vocab, k ≥ 1) (rank 0 only); with a filter, the
// chain ends before the first token it rejects.
DraftTree build_draft_chain(const DraftTopK& top, const NodeFilter& filter = {});

}  // namespace kd
