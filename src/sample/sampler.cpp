// Sampling pipeline of sampler.h. A 163840-token vocabulary is never fully sorted unless a stage
// really needs the whole ranking: weights are histogrammed by binary exponent during the exp pass,
// and candidates are gathered into the ranking heaviest-bucket first, only as deep as a stage reads
// (the top-k, the top-p nucleus, the inverse-CDF prefix). Every value that reaches the output is
// accumulated either in token-id order or in ranked order, both unique — never in the order that
// gathering or nth_element happened to leave an unsorted tail in.
#include "sample/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"

namespace kd {
namespace {

struct Cand {
  double w;    // unnormalised probability exp((logit - max) / T), in (0, 1]
  int32_t id;  // token id
};

// Strict total order of sampler.h step 2: heavier first, then lower token id. Because ids are
// unique, the ranking of any candidate set is unique.
inline bool ranks_before(const Cand& a, const Cand& b) {
  return a.w > b.w || (a.w == b.w && a.id < b.id);
}

// Bit test rather than std::isnan, so the check survives -ffast-math builds.
inline bool is_nan(float x) { return (std::bit_cast<uint32_t>(x) & 0x7fffffffu) > 0x7f800000u; }

// Bucket b holds weights in [2^-b, 2^(1-b)), so bucket 0 is exactly w = 1 (the max, and its ties);
// the last bucket takes everything below 2^-62, subnormals included. Heavier buckets hold only
// higher-ranked candidates, so the union of buckets [0, B) is always a prefix of the ranking.
constexpr int kBuckets = 64;
inline int bucket_of(double w) {  // w in (0, 1]
  // floor(log2 w) from the exponent field; -1023 for subnormals, which land in the last bucket.
  const int e = int((std::bit_cast<uint64_t>(w) >> 52) & 0x7ff) - 1023;
  return std::min(-e, kBuckets - 1);
}
// Smallest weight of buckets [0, n_buckets): 2^(1-n_buckets), or 0 once every bucket is in.
inline double bucket_floor(int n_buckets) {
  return n_buckets >= kBuckets ? 0.0 : std::ldexp(1.0, 1 - n_buckets);
}

// The candidates (tokens with w > 0) in ranked order, materialised lazily; the first end() of the
// ranking survive the stages so far. Invariants, with g = min(gathered, end):
//   c[0, g) is a ranked prefix of the kept candidates (until the first truncation: exactly those
//   with w >= bucket_floor(n_buckets)); c[0, sorted) is its sorted head, and c[sorted, g) ranks
//   after it in an unspecified arrangement that must never influence a result.
class Ranking {
 public:
  Ranking(const double* w, int32_t n, const std::array<int64_t, kBuckets>& hist, Cand* c)
      : w_(w), n_(n), hist_(hist), c_(c) {
    for (int64_t h : hist) end_ += size_t(h);
  }
  size_t end() const { return end_; }
  const Cand& operator[](size_t i) const { return c_[i]; }  // valid for i < sorted

  // Extends the sorted head to min(m, end).
  void sort_prefix(size_t m) {
    m = std::min(m, end_);
    if (m <= sorted_) return;
    gather(m);
    const size_t g = std::min(gathered_, end_);
    if (m < g) std::nth_element(c_ + sorted_, c_ + m, c_ + g, ranks_before);
    std::sort(c_ + sorted_, c_ + m, ranks_before);
    sorted_ = m;
  }

  // Keeps only the first m candidates in ranked order (m >= 1).
  void truncate(size_t m) {
    if (m >= end_) return;
    gather(m);
    const size_t g = std::min(gathered_, end_);
    if (m > sorted_ && m < g) std::nth_element(c_ + sorted_, c_ + m, c_ + g, ranks_before);
    end_ = gathered_ = m;
    sorted_ = std::min(sorted_, m);
  }

  // How many kept candidates have w >= thr; they are the first that many in ranked order.
  size_t count_at_least(double thr) {
    if (thr > 0.0) gather_buckets(bucket_of(std::min(thr, 1.0)) + 1);
    size_t k = 0;
    for (size_t i = 0, g = std::min(gathered_, end_); i < g; ++i) k += c_[i].w >= thr;
    return k;
  }

  // Sum of all kept weights, accumulated in ranked order.
  double ranked_sum() {
    sort_prefix(end_);
    double s = 0.0;
    for (size_t i = 0; i < end_; ++i) s += c_[i].w;
    return s;
  }

  // Smallest count c in [1, end] whose ranked running sum reaches `thr` (>= thr, or > thr when
  // `strict`); end when rounding keeps it from ever reaching. Sorts only as far as it reads, in
  // blocks growing 8x, so peaked distributions touch a few hundred candidates.
  size_t prefix_reaching(double thr, bool strict) {
    double cum = 0.0;
    size_t i = 0;
    for (size_t m = kFirstBlock;; m = sorted_ * 8) {
      sort_prefix(m);
      for (; i < sorted_; ++i) {
        cum += c_[i].w;
        if (strict ? cum > thr : cum >= thr) return i + 1;
      }
      if (sorted_ == end_) return end_;
    }
  }

 private:
  static constexpr size_t kFirstBlock = 128;

  // Gathers whole buckets until at least m candidates (m <= end) are in.
  void gather(size_t m) {
    if (gathered_ >= m) return;
    size_t have = gathered_;
    int b = n_buckets_;
    while (have < m && b < kBuckets) have += size_t(hist_[size_t(b++)]);
    gather_buckets(b);
  }

  // Appends the candidates of buckets [n_buckets, b) in token-id order: one pass over w.
  // (bucket_floor(0) = 2 exceeds every weight, so the first gather has no upper bound.)
  void gather_buckets(int b) {
    if (b <= n_buckets_ || gathered_ >= end_) return;
    const double lo = bucket_floor(b), hi = bucket_floor(n_buckets_);
    for (int32_t i = 0; i < n_; ++i) {
      const double w = w_[i];
      if (w >= lo && w < hi && w > 0.0) c_[gathered_++] = {w, i};
    }
    n_buckets_ = b;
  }

  const double* w_;                               // [n] weight by token id, 0 = not a candidate
  int32_t n_;
  const std::array<int64_t, kBuckets>& hist_;     // candidates per bucket
  Cand* c_;                                       // [n] gathered candidates
  size_t end_ = 0, gathered_ = 0, sorted_ = 0;
  int n_buckets_ = 0;                             // buckets [0, n_buckets) are gathered
};

// Max over logits[n]; throws on NaN, n <= 0, or when every logit is -inf. `who` prefixes messages.
float checked_max(const float* logits, int32_t n, const char* who) {
  if (n <= 0) fail(who, ": vocabulary size must be > 0, got ", n);
  if (logits == nullptr) fail(who, ": logits pointer is null (n = ", n, ")");
  float m = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n; ++i) {
    if (is_nan(logits[i])) fail(who, ": logits[", i, "] is NaN (n = ", n, ")");
    m = std::max(m, logits[i]);
  }
  if (m == -std::numeric_limits<float>::infinity())
    fail(who, ": all ", n, " logits are -inf, no token can be selected");
  return m;
}

}  // namespace

void validate(const SamplingParams& p) {
  if (!(std::isfinite(p.temperature) && p.temperature >= 0.0f))
    fail("SamplingParams.temperature must be finite and >= 0 (0 = greedy), got ", p.temperature);
  if (p.top_k < 0) fail("SamplingParams.top_k must be >= 0 (0 = off), got ", p.top_k);
  // Written as negated ranges so that NaN is rejected too.
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    fail("SamplingParams.top_p must be in (0, 1] (1 = off), got ", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    fail("SamplingParams.min_p must be in [0, 1] (0 = off), got ", p.min_p);
}

int32_t argmax(const float* logits, int32_t n) {
  const float m = checked_max(logits, n, "argmax");
  // First index holding the max: the lowest index wins exact ties.
  int32_t i = 0;
  while (logits[i] != m) ++i;
  return i;
}

int32_t sample(const float* logits, int32_t n, const SamplingParams& p, float u) {
  validate(p);
  if (!(u >= 0.0f && u < 1.0f)) fail("sample: uniform u must be in [0, 1), got ", u);
  if (p.temperature == 0.0f) return argmax(logits, n);
  const float m = checked_max(logits, n, "sample");

  // Per-thread scratch, grown once per vocabulary size: w [n] by token id, candidates [n].
  thread_local std::vector<double> w_scratch;
  thread_local std::vector<Cand> c_scratch;
  if (w_scratch.size() < size_t(n)) {
    w_scratch.resize(size_t(n));
    c_scratch.resize(size_t(n));
  }
  double* w = w_scratch.data();

  // Step 1. z = sum of all weights in token-id order (the total when no stage cuts anything).
  std::array<int64_t, kBuckets> hist{};
  double z = 0.0;
  if (m == std::numeric_limits<float>::infinity()) {
    for (int32_t i = 0; i < n; ++i) w[i] = logits[i] == m ? 1.0 : 0.0;
  } else {
    const double t = p.temperature, mx = m;
    // (logit - max) <= 0 before dividing: no overflow for tiny t, and the max gets exactly 1.
    // A -inf logit or an underflow gives w = 0: never ranked, never sampled.
    for (int32_t i = 0; i < n; ++i) w[i] = std::exp((double(logits[i]) - mx) / t);
  }
  for (int32_t i = 0; i < n; ++i) {
    if (w[i] == 0.0) continue;
    z += w[i];
    ++hist[size_t(bucket_of(w[i]))];
  }
  Ranking r(w, n, hist, c_scratch.data());  // end() >= 1: the max token has w = 1
  bool cut = false;

  // Step 3. top-k.
  double kept_total = z;
  if (p.top_k > 0 && size_t(p.top_k) < r.end()) {
    r.truncate(size_t(p.top_k));
    kept_total = r.ranked_sum();
    cut = true;
  }
  // Step 4. top-p on the distribution renormalised after top-k.
  if (p.top_p < 1.0f) {
    const size_t keep = r.prefix_reaching(double(p.top_p) * kept_total, /*strict=*/false);
    if (keep < r.end()) {
      r.truncate(keep);
      cut = true;
    }
  }
  // Step 5. min-p. The max weight is exactly 1, so the threshold is min_p itself; survivors form
  // a ranked prefix (ranking is by weight), so counting them is enough to truncate.
  if (p.min_p > 0.0f) {
    const size_t keep = r.count_at_least(double(p.min_p));
    if (keep < r.end()) {
      r.truncate(keep);
      cut = true;
    }
  }
  // Step 6. Inverse CDF in ranked order; prefix_reaching returns end() when rounding leaves the
  // running sum short of the target, which selects the last kept candidate (weight > 0).
  const double total = cut ? r.ranked_sum() : z;
  const size_t pick = r.prefix_reaching(double(u) * total, /*strict=*/true);
  return r[pick - 1].id;
}

}  // namespace kd
