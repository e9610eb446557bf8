#include "decode/tree.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>

#include "core/error.h"

namespace kd {

int32_t DraftTree::child_with_token(int32_t cur, int32_t token) const {
  for (int32_t c : children[size_t(cur)])
    if (tokens[size_t(c)] == token) return c;
  return -1;
}

std::vector<uint8_t> DraftTree::visibility() const {
  const int64_t n = size();
  std::vector<uint8_t> m(size_t(n * n), 0);
  m[0] = 1;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t p = parents[size_t(i)];
    std::copy(m.begin() + p * n, m.begin() + p * n + n, m.begin() + i * n);
    m[size_t(i * n + i)] = 1;
  }
  return m;
}

namespace {

struct HeapEntry {
  double score;
  std::vector<int32_t> ranks;  // the rank tuple ρ: one rank per depth
  int32_t parent;
};

// std::priority_queue pops the "largest"; we want the smallest (−σ, ρ, parent) first.
struct PopsLater {
  bool operator()(const HeapEntry& a, const HeapEntry& b) const {
    if (-a.score != -b.score) return -a.score > -b.score;
    if (a.ranks != b.ranks) return a.ranks > b.ranks;  // lexicographic
    return a.parent > b.parent;
  }
};

DraftTree empty_tree(int64_t positions) {
  DraftTree t;
  t.positions = positions;
  t.tokens = {-1};
  t.depths = {0};
  t.parents = {-1};
  t.ranks = {0};
  t.scores = {0.0};
  t.children.resize(1);
  return t;
}

void add_node(DraftTree& t, int32_t token, int32_t depth, int32_t parent, int32_t rank, double score) {
  t.tokens.push_back(token);
  t.depths.push_back(depth);
  t.parents.push_back(parent);
  t.ranks.push_back(rank);
  t.scores.push_back(score);
  t.children.emplace_back();
  t.children[size_t(parent)].push_back(int32_t(t.tokens.size() - 1));
}

}  // namespace

DraftTree build_draft_tree(const float* logits, int64_t positions, int64_t vocab, int64_t budget) {
  if (positions < 1 || vocab < 1) fail("draft tree: need at least one position and one token (got ", positions, " × ", vocab, ")");
  if (budget < 1) fail("draft tree: budget must be at least 1 (got ", budget, ")");
  return build_draft_tree(draft_top_k(logits, positions, vocab, std::min(budget, vocab)), budget);
}

DraftTree build_draft_tree(const DraftTopK& top, int64_t budget) { return build_draft_tree(top, budget, NodeFilter{}); }

DraftTree build_draft_tree(const DraftTopK& top, int64_t budget, const NodeFilter& filter) {
  if (budget < 1) fail("draft tree: budget must be at least 1 (got ", budget, ")");
  const int64_t positions = top.positions, k = top.k;
  if (positions < 1 || k < 1 || top.ids.size() != size_t(positions * k) || top.logp.size() != top.ids.size() ||
      top.valid.size() != size_t(positions))
    fail("draft tree: malformed top-k (", positions, " positions × ", k, ")");
  auto logp = [&](int64_t pos, int64_t rank) { return double(top.logp[size_t(pos * k + rank)]); };

  DraftTree t = empty_tree(positions);
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, PopsLater> heap;
  heap.push({logp(0, 0), {0}, 0});
  while (!heap.empty() && t.size() - 1 < budget) {
    HeapEntry e = heap.top();
    heap.pop();
    const int32_t depth = int32_t(e.ranks.size()), rank = e.ranks.back();
    const int32_t token = top.ids[size_t((depth - 1) * k + rank)];
    const bool keep = !filter || filter(e.parent, token);
    if (keep) add_node(t, token, depth, e.parent, rank, e.score);
    const int32_t idx = int32_t(t.size() - 1);
    if (rank + 1 < top.valid[size_t(depth - 1)]) {
      HeapEntry sib{e.score - logp(depth - 1, rank) + logp(depth - 1, rank + 1), e.ranks, e.parent};
      sib.ranks.back() = rank + 1;
      heap.push(std::move(sib));
    }
    if (keep && depth < positions) {
      HeapEntry child{e.score + logp(depth, 0), e.ranks, idx};
      child.ranks.push_back(0);
      heap.push(std::move(child));
    }
  }
  return t;
}

DraftTree truncate_tree(const DraftTree& tree, int64_t nodes) {
  if (nodes < 0) fail("draft tree: cannot keep ", nodes, " nodes");
  const size_t n = size_t(std::min(nodes + 1, tree.size()));
  DraftTree t;
  t.positions = tree.positions;
  t.tokens.assign(tree.tokens.begin(), tree.tokens.begin() + ptrdiff_t(n));
  t.depths.assign(tree.depths.begin(), tree.depths.begin() + ptrdiff_t(n));
  t.parents.assign(tree.parents.begin(), tree.parents.begin() + ptrdiff_t(n));
  t.ranks.assign(tree.ranks.begin(), tree.ranks.begin() + ptrdiff_t(n));
  t.scores.assign(tree.scores.begin(), tree.scores.begin() + ptrdiff_t(n));
  t.children.resize(n);
  for (size_t i = 0; i < n; ++i)  // children are in pop order: the kept ones are a prefix
    for (int32_t c : tree.children[i]) {
      if (size_t(c) >= n) break;
      t.children[i].push_back(c);
    }
  return t;
}

DraftTree root_tree(int64_t positions) { return empty_tree(positions); }

DraftTree build_draft_chain(const float* logits, int64_t positions, int64_t vocab) {
  if (positions < 1 || vocab < 1) fail("draft chain: need at least one position and one token");
  return build_draft_chain(draft_top_k(logits, positions, vocab, 1));
}

DraftTree build_draft_chain(const DraftTopK& top, const NodeFilter& filter) {
  const int64_t positions = top.positions, k = top.k;
  if (positions < 1 || k < 1 || top.ids.size() != size_t(positions * k) || top.logp.size() != top.ids.size())
    fail("draft chain: malformed top-k (", positions, " positions × ", k, ")");
  DraftTree t = empty_tree(positions);
  double score = 0;
  for (int64_t p = 0; p < positions; ++p) {
    if (filter && !filter(int32_t(p), top.ids[size_t(p * k)])) break;
    score += double(top.logp[size_t(p * k)]);
    add_node(t, top.ids[size_t(p * k)], int32_t(p + 1), int32_t(p), 0, score);
  }
  return t;
}

}  // namespace kd
