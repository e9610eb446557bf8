// Token selection from one row of logits: greedy, and temperature / top-k / top-p / min-p sampling
// driven by a caller-supplied uniform (normally position_uniform(seed, seq_id, position), rng.h).
//
// The result is a pure, deterministic function of (logits, params, u): no hidden RNG state, and no
// dependence on earlier calls, the thread, or how std::nth_element arranges elements it leaves
// unsorted. That is what lets a DDTree round reproduce the AR loop's samples (DESIGN.md §2).
//
// Pipeline of sample() when temperature > 0 (all arithmetic after the logit read is in double):
//   1. m = max logit. Weight w_i = exp((logit_i - m) / temperature), so the top token has w = 1
//      exactly and nothing overflows however small the temperature (ties at the top stay ties).
//      w_i is softmax up to the factor Z = sum_i w_i; every stage below compares weights, which
//      orders and thresholds exactly as the normalised probabilities would. Tokens with w = 0
//      (-inf logits, or underflow) are dropped here: they can never be sampled. If some logits are
//      +inf, those tokens share the mass equally (the limit of softmax) and all others get w = 0.
//   2. Candidates are ranked by weight descending, ties by lower token id (a total order, so the
//      ranking is unique). Only as much of the ranking as a stage needs is materialised.
//   3. top-k (k > 0): keep the first k.
//   4. top-p (p < 1): keep the smallest prefix whose cumulative weight >= p x (weight kept after
//      top-k), i.e. top-p is measured on the distribution renormalised after top-k, as in HF
//      transformers, vLLM and llama.cpp. At least one token is always kept.
//   5. min-p (> 0): drop tokens whose weight < min_p x max weight (= min_p, since max w = 1).
//      min_p = 1 keeps the top token and its exact ties.
//   6. Renormalise and invert the CDF: total = sum of kept weights (sorted order; or Z in index
//      order when no stage removed anything), target = u x total, pick the first candidate in
//      ranked order whose running sum exceeds target; if rounding leaves none, the last kept one.
// temperature == 0 is greedy: argmax(logits), the other fields and u are ignored.
#pragma once
#include <cstdint>

namespace kd {

struct SamplingParams {
  float temperature = 0.0f;  // 0 → greedy; otherwise finite and > 0
  int32_t top_k = 0;         // 0 → off; >= n behaves as off
  float top_p = 1.0f;        // 1 → off; in (0, 1]
  float min_p = 0.0f;        // 0 → off; in [0, 1]
  uint64_t seed = 0;         // key of position_uniform; not read by sample() itself
};

// Throws kd::Error naming the field when a value is out of range (NaN included).
void validate(const SamplingParams& p);

// Greedy choice over logits[n]: index of the largest logit, the LOWEST index on exact ties.
// Throws kd::Error on n <= 0, on any NaN, or when every logit is -inf (nothing is selectable).
int32_t argmax(const float* logits, int32_t n);

// One token from logits[n] (see the pipeline above) with the uniform u in [0, 1).
// Throws kd::Error on invalid params, u outside [0, 1), n <= 0, any NaN logit, or all -inf.
// Scratch memory is thread_local (24 bytes per vocabulary entry: a weight and a candidate slot), so
// concurrent calls from different threads are safe and a call never allocates once its thread has
// seen the vocabulary size. Cost at n = 163840 on one core: ~1.3 ms, mostly the exp pass; a flat
// distribution whose inverse CDF lands deep in the ranking pays for sorting that deep (~10-15 ms).
int32_t sample(const float* logits, int32_t n, const SamplingParams& p, float u);

}  // namespace kd
