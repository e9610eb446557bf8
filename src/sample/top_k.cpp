#include "sample/top_k.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace kd {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Throws the row's first defect in token order (NaN, +inf, or no finite logit), if it has one.
void check_row(const float* row, int64_t p, int64_t vocab) {
  bool finite = false;
  for (int64_t v = 0; v < vocab; ++v) {
    if (std::isnan(row[v])) fail("draft logits: NaN at position ", p, ", token ", v);
    if (row[v] == kInf) fail("draft logits: +inf at position ", p, ", token ", v);
    finite = finite || row[v] != -kInf;
  }
  if (!finite) fail("draft logits: position ", p, " has no finite logit");
}

// True when the row has a NaN or +inf or no finite logit — one branch-free pass the compiler
// vectorises; the rare defective row is then walked again by check_row for its message.
bool row_defective(const float* row, int64_t vocab) {
  bool bad = false, finite = false;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = row[v];
    bad |= !(x < kInf);  // NaN or +inf
    finite |= x > -kInf;
  }
  return bad || !finite;
}

// The k best (value desc, id asc) of a checked row: a bounded heap whose top is the worst kept.
// Tokens come in id order, so a newcomer beats the top only with a strictly larger value; most
// are rejected by one comparison against the threshold. The k kept are then sorted by the order,
// which makes the result exactly std::partial_sort's under that (total) order.
void best_k(const float* row, int64_t vocab, int64_t k, int32_t* ids) {
  auto better = [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  thread_local std::vector<int32_t> heap;  // max-heap under "worse first": heap.front() is the worst kept
  heap.clear();
  int64_t v = 0;
  for (; v < vocab && int64_t(heap.size()) < k; ++v) {
    heap.push_back(int32_t(v));
    std::push_heap(heap.begin(), heap.end(), better);
  }
  float thr = row[heap.front()];
  for (; v < vocab; ++v) {
    if (!(row[v] > thr)) continue;
    std::pop_heap(heap.begin(), heap.end(), better);
    heap.back() = int32_t(v);
    std::push_heap(heap.begin(), heap.end(), better);
    thr = row[heap.front()];
  }
  std::sort(heap.begin(), heap.end(), better);
  std::copy(heap.begin(), heap.end(), ids);
}

// A checked row: the LSE as the header states, then the best k and their log-probabilities.
int64_t top_k_checked(const float* row, int64_t vocab, int64_t k, int32_t* ids, float* logp) {
  float mxf = -kInf;
  for (int64_t v = 0; v < vocab; ++v) mxf = std::max(mxf, row[v]);
  const double mx = double(mxf);  // the max of the widened values: widening keeps order
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - mx);
  const double lse = mx + std::log(sum);
  best_k(row, vocab, k, ids);
  int64_t valid = 0;
  for (int64_t r = 0; r < k; ++r) {
    const float x = row[ids[r]];
    logp[r] = float(double(x) - lse);
    if (std::isfinite(x)) valid = r + 1;
  }
  return valid;
}

}  // namespace

int64_t draft_top_k_row(const float* row, int64_t p, int64_t vocab, int64_t k, int32_t* ids, float* logp) {
  if (row_defective(row, vocab)) check_row(row, p, vocab);
  return top_k_checked(row, vocab, k, ids, logp);
}

DraftTopK draft_top_k(const float* logits, int64_t positions, int64_t vocab, int64_t k) {
  if (positions < 1 || vocab < 1) fail("draft top-k: need at least one position and one token (got ", positions, " × ", vocab, ")");
  if (k < 1 || k > vocab) fail("draft top-k: k must be in [1, ", vocab, "] (got ", k, ")");
  // Every row checked first, in order, so the error is the first position's whatever the split.
  for (int64_t p = 0; p < positions; ++p)
    if (row_defective(logits + p * vocab, vocab)) check_row(logits + p * vocab, p, vocab);
  DraftTopK t;
  t.positions = positions;
  t.k = k;
  t.ids.resize(size_t(positions * k));
  t.logp.resize(size_t(positions * k));
  t.valid.assign(size_t(positions), 0);
  // Rows are independent (each one thread's, in its fixed order): split across the pool — a
  // block's 15 rows of a 6,256-token vocabulary took 0.7 ms on one core, as long as the lm_head.
  ThreadPool::global().parallel_for(positions, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      t.valid[size_t(p)] =
          top_k_checked(logits + p * vocab, vocab, k, &t.ids[size_t(p * k)], &t.logp[size_t(p * k)]);
  });
  return t;
}

}  // namespace kd
