// The pieces of one DDTree round (the engine's step runs them for every sequence in one verify
// forward): drafting the tree after a bonus token, and the accept walk over the target's choices.
#pragma once
#include <cstdint>
#include <vector>

#include "decode/generate.h"
#include "model/drafter.h"
#include "decode/tree.h"

namespace kd {

struct DraftRound {
  DraftTree tree;                   // node 0 is the bonus token
  std::vector<int32_t> positions;   // [n] RoPE positions: start + depth
  std::vector<uint8_t> visibility;  // [n, n] ancestor-or-self mask
};

// Drafts `L` ≥ 1 positions after `bonus` (at position start == drafter.context_len()) and builds
// the tree (or chain) to verify. A drafter that can hand back the tree builder's top-k from the
// device (Drafter::top_k_on_device: the same tree, bit for bit) does so unless device_top_k is false
// (the GPU tests' host reference); others bring their logits to the host, into draft_logits
// (scratch of [block − 1, vocab]).
// filter (optional): the grammar's per-node test (tree.h NodeFilter); the tree then holds only
// prefixes it allows.
DraftRound draft_round(Drafter& drafter, int32_t bonus, int64_t start, int64_t L, const SpecOptions& spec,
                       int64_t vocab, std::vector<float>& draft_logits, bool device_top_k = true,
                       const NodeFilter& filter = {});
// The same tree before it becomes a round (--budget auto truncates it first: tree.h truncate_tree).
DraftTree draft_tree(Drafter& drafter, int32_t bonus, int64_t start, int64_t L, const SpecOptions& spec, int64_t vocab,
                     std::vector<float>& draft_logits, bool device_top_k = true, const NodeFilter& filter = {});

// The round for a built tree: node 0 set to the bonus, positions start + depth, visibility.
DraftRound make_round(DraftTree tree, int32_t bonus, int64_t start);

// The accept walk: from the root, the target's own choice at each node (choose(node, position) →
// token, from that node's logits row or its device argmax) is emitted (emit(token, node) → false
// stops generation); while it matches a child the walk descends. Returns the path of accepted
// nodes, root first (τ = its size). *next_bonus is the last emitted token when the walk left the
// tree (the next round's bonus); untouched when emit stopped.
template <class Choose, class Emit>
std::vector<int32_t> accept_walk(const DraftTree& tree, int64_t start, Choose&& choose, Emit&& emit, int32_t* next_bonus) {
  std::vector<int32_t> path = {0};
  int32_t cur = 0;
  for (;;) {
    const int32_t tok = choose(cur, start + tree.depths[size_t(cur)] + 1);
    if (!emit(tok, cur)) break;
    const int32_t child = tree.child_with_token(cur, tok);
    if (child < 0) {
      *next_bonus = tok;
      break;
    }
    cur = child;
    path.push_back(child);
  }
  return path;
}

}  // namespace kd
