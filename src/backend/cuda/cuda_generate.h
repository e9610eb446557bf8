// AR and DDTree generation with the target on the GPU (CudaTarget). They follow generate_ar and
// generate_ddtree (src/decode/) step for step — same request checks, same position-keyed sampling,
// same tree builder and accept walk — so their output equals the CPU decoders' wherever the two
// targets' logits pick the same tokens, and DDTree == AR on the GPU bit for bit (the verify rows
// reproduce the AR rows: row invariance).
//
// Per DDTree round, host syncs and PCIe bytes (K2: vocab V = 163840, block B = 16, budget 16 →
// n = 17 verify rows; fp32 logits):
//   before (GPU drafter): 2 syncs, ≈ 21 MB down — the draft logits [B − 1, V] (9.8 MB) for the
//     host tree build, the verify logits [n, V] (11.1 MB) for the host accept walk.
//   now, GPU drafter, temperature 0: 2 syncs, ≈ 2.5 KB down — the drafter's top-k per position
//     ([B − 1, k] ids + logits + 24 B of normaliser bounds: 2.3 KB; draft_top_k.h says why the
//     tree is bit-identical; k ≤ 128, else the host path), the verify argmax ids and picked
//     values (n × 8 B) and the expert counts (4 B a layer). Uploads as before: the tree (ids,
//     positions, key lists, < 2 KB), the kept rows (τ × 4 B, no sync). keep_logits adds the
//     accepted rows only (τ × V × 4 B, one more sync); a draft row whose normaliser bounds cannot
//     pin a float (rare) comes whole (V × 4 B). Host work per round drops to a heap over
//     k × (B − 1) entries: the draft side alone measured 19–26 ms on the H200's host (download,
//     exp pass, partial sort) against 0.45 ms on the device (tests/gpu/test_cuda_round.cpp); the
//     verify side loses an 11 MB download and the host argmax over [n, V].
//   temperature > 0: the verify logits still come down whole ([n, V]; sample() runs on the host —
//     a device sampler bit-identical to src/sample/sampler.cpp is not attempted); the draft side
//     as above. A host drafter (DFlash on the CPU, synthetic) drafts on the host as before, its
//     taps downloaded ([n, taps, hidden]).
// AR decode at temperature 0 without kept logits: one sync and 8 bytes down a step, not V × 4.
// The two syncs that remain: after the draft, the tree is built on the host (a best-first heap
// over k × (B − 1) candidates, microseconds) and the verify's inputs are staged from it; after
// the verify, the host needs the walk's result — the tokens to emit (streaming, stop ids, length
// limit), τ for the compaction, and the next round's bonus token that the next draft starts from.
// Moving those onto the device would need the whole round loop there (a device-side heap and
// walk with stop-id handling); each sync costs ≈ 10–20 µs against a 5–25 ms verify.
#pragma once
#include <functional>
#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "decode/ar.h"
#include "decode/ddtree.h"
#include "model/drafter.h"

namespace kd {

// Which parts of a step stay on the device; off = the host paths they replace (the tests compare
// both). Either way the output is the same bits.
struct CudaRoundOptions {
  bool device_top_k = true;   // DDTree with a CudaDFlash drafter: the tree builder's top-k on the device
  bool device_argmax = true;  // temperature 0: the verify rows' (AR: the step's, unless logits are
                              // kept) argmax on the device
};

// The target's cache is reset first; it must hold prompt + max_new_tokens rows.
GenerateResult generate_ar_cuda(CudaTarget& target, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                                const std::function<void(int32_t)>& on_token = {}, const CudaRoundOptions& round = {});

// The cache must also hold one round's tree (budget + 1 rows, or block size in chain mode).
SpecResult generate_ddtree_cuda(CudaTarget& target, Drafter& drafter, const std::vector<int32_t>& prompt,
                                const GenerateOptions& opt, const SpecOptions& spec,
                                const std::function<void(int32_t)>& on_token = {}, const CudaRoundOptions& round = {});

}  // namespace kd
