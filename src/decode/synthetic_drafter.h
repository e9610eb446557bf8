// The synthetic drafter: measurement and tests only (`run --draft synthetic:…`, bench).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/drafter.h"

namespace kd {

// A drafter for measurement and tests, clearly not a model: it knows the target's own continuation
// (`truth`, indexed by absolute position, from an AR run with the same settings) and puts the true
// token at rank r with probability profile[r] (non-increasing; the remaining mass: not among the
// ranked tokens). It is calibrated: its draft distribution gives the rank-r token probability
// profile[r] and spreads the rest evenly. The draw for position p is a pure function of (seed, p).
// profile = {1} is the oracle.
class SyntheticDrafter : public Drafter {
 public:
  SyntheticDrafter(std::vector<int32_t> truth, std::vector<double> profile, int64_t block_size, int64_t vocab,
                   uint64_t seed);
  // "oracle" or comma-separated rank probabilities, e.g. "0.7,0.2"; throws on a bad spec.
  static std::vector<double> parse_profile(const std::string& spec);
  std::string name() const override;
  int64_t block_size() const override { return block_; }
  const std::vector<int32_t>& tap_layers() const override { return no_taps_; }
  void append_context(const float*, int64_t n) override { ctx_ += n; }
  int64_t context_len() const override { return ctx_; }
  void draft(int32_t bonus, int64_t start, float* logits) override;

 private:
  std::vector<int32_t> truth_;
  std::vector<double> profile_;
  int64_t block_, vocab_, ctx_ = 0;
  uint64_t seed_;
  std::vector<int32_t> no_taps_;
};

}  // namespace kd
