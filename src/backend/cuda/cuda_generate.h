// AR and DDTree generation with the target on the GPU (CudaTarget). They follow generate_ar and
// generate_ddtree (src/spec/) step for step — same request checks, same position-keyed sampling on
// the host from the downloaded logits, same tree builder and accept walk — so their output equals
// the CPU decoders' wherever the two targets' logits pick the same tokens, and DDTree == AR on the
// GPU bit for bit (the verify rows reproduce the AR rows: row invariance).
//
// Host round-trips per DDTree round: the drafter runs on the host (DFlash on the CPU, or the
// synthetic stand-in), so its features come down and its draft logits stay there; one upload of
// the tree (ids, positions, key lists), one download of the verify logits [nodes, vocab] (+ taps),
// one upload of the kept rows for compaction. Three synchronisations per round.
#pragma once
#include <functional>
#include <vector>

#include "backend/cuda/cuda_target.h"
#include "spec/ar.h"
#include "spec/ddtree.h"
#include "spec/drafter.h"

namespace kd {

// The target's cache is reset first; it must hold prompt + max_new_tokens rows.
GenerateResult generate_ar_cuda(CudaTarget& target, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                                const std::function<void(int32_t)>& on_token = {});

// The cache must also hold one round's tree (budget + 1 rows, or block size in chain mode).
SpecResult generate_ddtree_cuda(CudaTarget& target, Drafter& drafter, const std::vector<int32_t>& prompt,
                                const GenerateOptions& opt, const SpecOptions& spec,
                                const std::function<void(int32_t)>& on_token = {});

}  // namespace kd
