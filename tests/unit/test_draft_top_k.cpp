// The tree builder's top-k (src/decode/tree.h draft_top_k), the piece a GPU drafter reproduces on the
// device: against a brute-force reference written here (full sort by logit desc / id asc, LSE as
// the header states), and build_draft_tree / build_draft_chain from it == from the logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "decode/tree.h"

namespace kd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Brute force: every token sorted; logp = fp32(double(x) − (max + log Σ exp(double(x) − max))).
void reference(const std::vector<float>& row, int64_t k, std::vector<int32_t>* ids, std::vector<float>* logp,
               int64_t* valid) {
  const int64_t V = int64_t(row.size());
  std::vector<int32_t> all(static_cast<size_t>(V));
  std::iota(all.begin(), all.end(), 0);
  std::stable_sort(all.begin(), all.end(), [&](int32_t a, int32_t b) { return row[size_t(a)] > row[size_t(b)]; });
  double mx = -std::numeric_limits<double>::infinity();
  for (float v : row) mx = std::max(mx, double(v));
  double s = 0;
  for (float v : row) s += std::exp(double(v) - mx);
  const double lse = mx + std::log(s);
  ids->assign(all.begin(), all.begin() + k);
  logp->clear();
  *valid = 0;
  for (int64_t r = 0; r < k; ++r) {
    const float x = row[size_t(all[size_t(r)])];
    logp->push_back(float(double(x) - lse));
    if (std::isfinite(x)) *valid = r + 1;
  }
}

// Every row of t (draft_top_k over `rows` at k) against the brute-force reference, bit for bit.
void expect_reference(const DraftTopK& t, const std::vector<std::vector<float>>& rows, int64_t k) {
  for (size_t p = 0; p < rows.size(); ++p) {
    std::vector<int32_t> ids;
    std::vector<float> logp;
    int64_t valid = 0;
    reference(rows[p], k, &ids, &logp, &valid);
    EXPECT_EQ(std::vector<int32_t>(t.ids.begin() + int64_t(p) * k, t.ids.begin() + int64_t(p + 1) * k), ids) << p << " k " << k;
    EXPECT_EQ(0, std::memcmp(&t.logp[p * size_t(k)], logp.data(), size_t(k) * 4)) << p << " k " << k;
    EXPECT_EQ(t.valid[p], valid) << p << " k " << k;
  }
}

TEST(DraftTopK, MatchesBruteForceWithTiesZerosAndNegInf) {
  const int64_t V = 64;
  std::vector<std::vector<float>> rows;
  std::vector<float> r(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) r[size_t(v)] = float((v * 13) % 4);  // four levels
  rows.push_back(r);
  for (int64_t v = 0; v < V; ++v) r[size_t(v)] = v % 2 ? -0.0f : 0.0f;  // ±0 all tie: ids ascending
  r[40] = -1.0f;
  rows.push_back(r);
  for (int64_t v = 0; v < V; ++v) r[size_t(v)] = v < 3 ? float(v) : -kInf;  // 3 finite
  rows.push_back(r);
  std::vector<float> flat;
  for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
  for (int64_t k : {int64_t(1), int64_t(5), int64_t(16), V}) {
    const DraftTopK t = draft_top_k(flat.data(), int64_t(rows.size()), V, k);
    expect_reference(t, rows, k);
  }
}

// A block's worth of rows at the trained pair's vocabulary, split across the thread pool and
// selected by a bounded heap: rows with coarse values (many ties, so the id order decides), ±0,
// −inf runs and an ascending row (every token displaces the kept worst) against the reference.
TEST(DraftTopK, WideRowsAcrossThreadsMatchBruteForce) {
  const int64_t P = 15, V = 6256;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<std::vector<float>> rows;
  for (int64_t p = 0; p < P; ++p) {
    std::vector<float> r(static_cast<size_t>(V));
    for (float& v : r) v = p % 3 == 0 ? std::round(nd(rng)) : nd(rng);  // rounded: ties everywhere
    if (p == 4)
      for (int64_t v = 0; v < V; ++v) r[size_t(v)] = float(v);  // ascending: the heap turns over at every token
    if (p == 7)
      for (int64_t v = 0; v < V; ++v) r[size_t(v)] = v % 5 ? -kInf : (v % 2 ? -0.0f : 0.0f);
    rows.push_back(r);
  }
  std::vector<float> flat;
  for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
  for (int64_t k : {int64_t(1), int64_t(16), int64_t(64), int64_t(2000)}) {
    const DraftTopK t = draft_top_k(flat.data(), P, V, k);
    expect_reference(t, rows, k);
  }
}

// Several defective rows: the error is the first position's, whatever thread would reach it first.
TEST(DraftTopK, FirstDefectiveRowIsReported) {
  const int64_t P = 9, V = 40;
  std::vector<float> x(static_cast<size_t>(P * V), 1.0f);
  x[size_t(6 * V + 3)] = std::numeric_limits<float>::quiet_NaN();
  x[size_t(3 * V + 30)] = kInf;
  for (int64_t v = 0; v < V; ++v) x[size_t(8 * V + v)] = -kInf;
  try {
    draft_top_k(x.data(), P, V, 4);
    FAIL() << "defective rows accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("+inf at position 3, token 30"), std::string::npos) << e.what();
  }
  x[size_t(3 * V + 30)] = 1.0f;
  x[size_t(6 * V + 3)] = 1.0f;
  try {
    draft_top_k(x.data(), P, V, 4);
    FAIL() << "a row without a finite logit accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("position 8 has no finite logit"), std::string::npos) << e.what();
  }
}

TEST(DraftTopK, TreeAndChainFromTopKEqualFromLogits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const int64_t P = 7, V = 300;
  std::vector<float> x(static_cast<size_t>(P * V));
  for (float& v : x) v = nd(rng);
  for (int64_t budget : {1, 4, 16, 40}) {
    const DraftTree a = build_draft_tree(x.data(), P, V, budget);
    const DraftTree b = build_draft_tree(draft_top_k(x.data(), P, V, budget), budget);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.parents, b.parents);
    EXPECT_EQ(a.depths, b.depths);
    EXPECT_EQ(a.ranks, b.ranks);
    EXPECT_EQ(a.scores, b.scores);
    EXPECT_EQ(int64_t(a.tokens.size()), budget + 1);
  }
  const DraftTree c = build_draft_chain(x.data(), P, V);
  const DraftTree d = build_draft_chain(draft_top_k(x.data(), P, V, 3));  // rank 0 of a wider top-k
  EXPECT_EQ(c.tokens, d.tokens);
  EXPECT_EQ(c.scores, d.scores);
}

TEST(DraftTopK, ErrorsNameThePositionAndToken) {
  const int64_t V = 10;
  std::vector<float> x(static_cast<size_t>(3 * V), 0.5f);
  x[size_t(2 * V + 7)] = std::numeric_limits<float>::quiet_NaN();
  try {
    draft_top_k(x.data(), 3, V, 2);
    FAIL() << "NaN accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NaN at position 2, token 7"), std::string::npos) << e.what();
  }
  x[size_t(2 * V + 7)] = 0.5f;
  EXPECT_THROW(draft_top_k(x.data(), 3, V, 0), Error);
  EXPECT_THROW(draft_top_k(x.data(), 3, V, V + 1), Error);
  EXPECT_THROW(draft_top_k(x.data(), 0, V, 1), Error);
  DraftTopK bad = draft_top_k(x.data(), 3, V, 2);
  bad.ids.pop_back();
  EXPECT_THROW(build_draft_tree(bad, 2), Error);
  EXPECT_THROW(build_draft_chain(bad), Error);
}

}  // namespace
}  // namespace kd
