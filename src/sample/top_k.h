// The top-k of a draft distribution as DDTree's tree builder reads it (decode/tree.h), on the host;
// the CUDA backend computes the same bits on the device (backend/cuda/draft_top_k.h). Kept below
// both so that the backend needs no decode header.
#pragma once
#include <cstdint>
#include <vector>

namespace kd {

// What the tree builder reads of the draft logits: per position, the first k tokens by logit
// (ties: lower id) and their log-probabilities. A GPU drafter computes this on the device and
// downloads only these (src/backend/cuda/draft_top_k.h); it must equal draft_top_k() bit for bit.
struct DraftTopK {
  int64_t positions = 0, k = 0;
  std::vector<int32_t> ids;    // [positions, k]
  std::vector<float> logp;     // [positions, k]: fp32(logit − LSE), the LSE in double (see below)
  std::vector<int64_t> valid;  // [positions]: ranks with a finite logit (−inf tokens cannot be drafted)
};

// One position's row [vocab] into ids[k], logp[k]; returns its valid count. Throws naming
// `position` on a NaN or +inf logit (the first in token order) or a row without a finite logit.
// The LSE: max in double, then Σ exp(double(logit) − max) in double in token order, then
// max + log(Σ); logp = fp32(double(logit) − LSE).
int64_t draft_top_k_row(const float* row, int64_t position, int64_t vocab, int64_t k, int32_t* ids, float* logp);
// draft_top_k_row for every position of logits [positions, vocab].
DraftTopK draft_top_k(const float* logits, int64_t positions, int64_t vocab, int64_t k);

}  // namespace kd
