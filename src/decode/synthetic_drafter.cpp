#include "decode/synthetic_drafter.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "sample/rng.h"

namespace kd {

SyntheticDrafter::SyntheticDrafter(std::vector<int32_t> truth, std::vector<double> profile, int64_t block_size,
                                   int64_t vocab, uint64_t seed)
    : truth_(std::move(truth)), profile_(std::move(profile)), block_(block_size), vocab_(vocab), seed_(seed) {
  if (block_ < 2) fail("synthetic drafter: block size must be at least 2 (got ", block_, ")");
  if (int64_t(profile_.size()) + 1 > vocab_) fail("synthetic drafter: profile has more ranks than the vocabulary");
}

std::vector<double> SyntheticDrafter::parse_profile(const std::string& spec) {
  if (spec == "oracle") return {1.0};
  std::vector<double> p;
  std::stringstream ss(spec);
  std::string item;
  double sum = 0;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    double v = -1;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || !(v >= 0 && v <= 1))
      fail("synthetic drafter profile '", spec, "': '", item, "' is not a probability in [0, 1]");
    p.push_back(v);
    sum += v;
  }
  if (p.empty() || sum > 1 + 1e-9) fail("synthetic drafter profile '", spec, "': rank probabilities must sum to at most 1");
  for (size_t r = 1; r < p.size(); ++r)
    if (p[r] > p[r - 1]) fail("synthetic drafter profile '", spec, "': rank probabilities must not increase with rank");
  return p;
}

std::string SyntheticDrafter::name() const {
  std::string s = "synthetic (knows the target's continuation; true token at rank r with p = ";
  for (size_t r = 0; r < profile_.size(); ++r) s += cat(r ? "," : "", profile_[r]);
  return s + ")";
}

void SyntheticDrafter::draft(int32_t, int64_t start, float* logits) {
  // A calibrated stand-in: the rank-r token carries probability profile[r] and the mass left over is
  // spread evenly over the other tokens, so the tree builder sees the confidence the profile states.
  const int64_t R = int64_t(profile_.size());
  double rest = 1.0;
  for (double p : profile_) rest -= p;
  const float tail = float(std::log(std::max(rest, 1e-12) / double(vocab_ - R)));
  for (int64_t k = 1; k < block_; ++k) {
    float* row = logits + (k - 1) * vocab_;
    std::fill(row, row + vocab_, tail);
    const int64_t pos = start + k;
    const int32_t truth = pos < int64_t(truth_.size()) ? truth_[size_t(pos)] : -1;
    // Which rank the true token takes at this position: a pure function of (seed, position).
    const double u = position_uniform(seed_ ^ 0x5eed5eedull, 1, uint64_t(pos));
    int64_t rank = R;  // R: not among the ranked tokens
    double acc = 0;
    for (int64_t r = 0; r < R; ++r) {
      acc += profile_[size_t(r)];
      if (u < acc) {
        rank = r;
        break;
      }
    }
    // Decoys (distinct, never the truth) fill the ranks the true token does not take.
    int32_t decoy = int32_t((uint64_t(pos) * 2654435761ull + 17) % uint64_t(vocab_));
    std::vector<int32_t> used;
    for (int64_t r = 0; r < R; ++r) {
      int32_t tok;
      if (r == rank && truth >= 0) {
        tok = truth;
      } else {
        do decoy = int32_t((decoy + 1) % vocab_);
        while (decoy == truth || std::find(used.begin(), used.end(), decoy) != used.end());
        tok = decoy;
      }
      used.push_back(tok);
      // log p_r, nudged down by rank so equal probabilities still rank in profile order.
      row[tok] = float(std::log(std::max(profile_[size_t(r)], 1e-12))) - 1e-4f * float(r);
    }
  }
}

}  // namespace kd
