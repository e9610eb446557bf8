#include "sample/top_k.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace kd {

int64_t draft_top_k_row(const float* row, int64_t p, int64_t vocab, int64_t k, int32_t* ids, float* logp) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < vocab; ++v) {
    if (std::isnan(row[v])) fail("draft logits: NaN at position ", p, ", token ", v);
    if (row[v] == std::numeric_limits<float>::infinity()) fail("draft logits: +inf at position ", p, ", token ", v);
    mx = std::max(mx, double(row[v]));
  }
  if (!std::isfinite(mx)) fail("draft logits: position ", p, " has no finite logit");
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - mx);
  const double lse = mx + std::log(sum);
  thread_local std::vector<int32_t> idx;
  idx.resize(size_t(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  int64_t valid = 0;
  for (int64_t r = 0; r < k; ++r) {
    ids[r] = idx[size_t(r)];
    logp[r] = float(double(row[idx[size_t(r)]]) - lse);
    if (std::isfinite(row[idx[size_t(r)]])) valid = r + 1;
  }
  return valid;
}

DraftTopK draft_top_k(const float* logits, int64_t positions, int64_t vocab, int64_t k) {
  if (positions < 1 || vocab < 1) fail("draft top-k: need at least one position and one token (got ", positions, " × ", vocab, ")");
  if (k < 1 || k > vocab) fail("draft top-k: k must be in [1, ", vocab, "] (got ", k, ")");
  DraftTopK t;
  t.positions = positions;
  t.k = k;
  t.ids.resize(size_t(positions * k));
  t.logp.resize(size_t(positions * k));
  t.valid.assign(size_t(positions), 0);
  for (int64_t p = 0; p < positions; ++p)
    t.valid[size_t(p)] = draft_top_k_row(logits + p * vocab, p, vocab, k, &t.ids[size_t(p * k)], &t.logp[size_t(p * k)]);
  return t;
}

}  // namespace kd
