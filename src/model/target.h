// The Target interface (DESIGN.md §3): what the one decode loop (src/engine/, the engine's step,
// which `kdtree run` drives with one request) needs from a target model. Two implementations: the
// CPU model (DeepseekV3, model/deepseek_v3.h) and the GPU target (CudaTarget,
// model/deepseek_v3_cuda.h); a tensor-parallel target is one more.
//
// A forward is batched over sequences (SeqForward: each with its KV view, committed rows, RoPE
// positions, optional tree mask, taps request and output mode) and never mixes them: row invariance
// (DESIGN.md §2) makes a sequence's logits, argmaxes and taps the same bits alone or in any batch.
// The KV bookkeeping (block tables, prefix cache) is the caller's (kv/paged_kv.h); the rows' storage
// is the target's when host_kv() is false (device memory, set up by init_kv).
//
// Methods are const: the weights never change; the state a forward touches (work buffers, device
// KV, captured graphs) is the implementation's own. One thread drives a target at a time.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/config.h"
#include "kv/kv_view.h"

namespace kd {

// Which attention form the forward uses. Both give the same result (tests check it):
// expanded re-projects every cached latent through kv_b (HF's form, good for prefill);
// absorbed folds W_UK into the query and W_UV after the weighted sum, attending over the 576-wide
// latent directly (the decode form of vLLM/FlashMLA).
enum class AttnForm { expanded, absorbed };

struct ForwardStats {
  uint64_t weight_bytes = 0;  // weight bytes streamed (each matrix counted once per call)
};

// One target forward over n new tokens that follow a sequence's committed rows. Beyond plain
// causal decoding it serves DDTree's verify pass: explicit RoPE positions (siblings share one),
// an ancestor-only visibility mask over the new rows, rows left uncommitted for compaction, and
// the residual-stream outputs of chosen layers for the drafter.
//
// Outputs of the logit rows (every row when all_logits, else the last): logits on the host, or —
// where the target offers it (Target::device_argmax) — only their argmax and its value, the logits
// staying where they were computed (K2: 8 bytes a row instead of 655 KB).
struct ForwardArgs {
  const int32_t* ids = nullptr;           // [n]
  int64_t n = 0;
  const int32_t* positions = nullptr;     // [n] RoPE positions; null → committed rows + i
  const uint8_t* visibility = nullptr;    // [n, n]: row i sees new row j iff 1; null → causal (j ≤ i)
  bool commit = true;                     // (single-sequence forwards) false: the rows stay scratch at [size, size + n)
  AttnForm form = AttnForm::absorbed;
  bool all_logits = false;                // logits for every row, else only the last
  float* logits = nullptr;                // [n or 1, vocab] on the host; may be null
  // [n or 1] each: per logit row the argmax (lowest index on ties, −1 when the row holds a NaN:
  // sample()'s greedy choice) and the value it picked (−inf: nothing selectable). Only where
  // Target::device_argmax(); then Target::logits_row downloads a row on demand.
  int32_t* argmax_ids = nullptr;
  float* argmax_vals = nullptr;
  const std::vector<int32_t>* tap_layers = nullptr;  // layer ids whose outputs to copy out
  float* taps = nullptr;                  // [n, tap_layers.size(), hidden] on the host
  // Where Target::device_taps(): the taps stay on the device and *device_taps is set to this
  // sequence's [n, tap_layers.size(), hidden] fp32 rows, valid until the next forward.
  const float** device_taps = nullptr;
  ForwardStats* stats = nullptr;
};

// One sequence's share of a batched forward (the engine's step): its KV rows, the rows already
// committed there, and its new tokens. Every new row attends to rows [0, start) of its own
// sequence and to the new rows of its own sequence that args' causal order or visibility mask
// allows — never to another sequence. args.commit and args.stats are not read (the caller commits;
// stats are per batch).
struct SeqForward {
  KvView kv;          // capacity ≥ start + args.n; the new rows' latents are written at start + i
  int64_t start = 0;  // committed rows
  ForwardArgs args;
};

class Target {
 public:
  virtual ~Target() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string device() const = 0;  // "cpu", "cuda (NVIDIA H200 …)"
  // Longest context one sequence may have on this target (≤ max_position_embeddings).
  virtual int64_t max_context() const = 0;
  // Most KV tokens a pool may hold (device memory); INT64_MAX when memory is allocated lazily.
  virtual int64_t max_kv_tokens(int64_t block_tokens) const = 0;
  // true: the KvPool keeps each block's rows in host memory and views carry row pointers.
  virtual bool host_kv() const = 0;
  // Called before the first forward with the pool's geometry (a device target allocates the
  // blocks here; called again, it replaces them).
  virtual void init_kv(int64_t n_blocks, int64_t block_tokens) const = 0;
  // The MLA form of prompt rows: the CPU prefills in the expanded form (HF's), the CUDA target
  // runs the absorbed form throughout.
  virtual AttnForm prefill_form() const = 0;
  virtual bool supports(AttnForm form) const = 0;
  // Output modes a forward may ask for (ForwardArgs::argmax_ids, ForwardArgs::device_taps).
  virtual bool device_argmax() const { return false; }
  virtual bool device_taps() const { return false; }
  // true where the first forwards of a row count cost extra (the CUDA target captures a graph per
  // shape): --budget auto then verifies only the row counts its start-up profile ran.
  virtual bool shape_warmup() const { return false; }
  // Every sequence's rows in one forward; one host sync.
  virtual void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr) const = 0;
  // After a forward in which sequence `seq` (its index in that batch) asked for argmax outputs:
  // its logit row `row` [vocab] (a row the argmax cannot settle: NaN, all −inf, or kept logits).
  virtual void logits_row(int64_t seq, int64_t row, float* out) const {
    (void)seq, (void)row, (void)out;
    fail("the ", device(), " target keeps no logits on a device (it offers no argmax outputs)");
  }
  // DDTree compaction of one sequence: rows start + path[k] → start + k (path ascending, path[k] ≥ k).
  virtual void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const = 0;
};

class LatentCache;
// One sequence's forward over a contiguous host cache (a host_kv() target: the CPU model, its
// tensor-parallel form): makes the rows addressable, runs the forward, commits when args.commit.
// Defined in model/deepseek_v3.cpp.
void forward_cached(const Target& target, LatentCache& cache, const ForwardArgs& args);
// The same for n causal tokens after the cache's rows, committed: logits [n or 1, vocab] (may be null).
void forward_cached(const Target& target, LatentCache& cache, const int32_t* ids, int64_t n, AttnForm form, bool all_logits,
                    float* logits, ForwardStats* stats = nullptr);

}  // namespace kd
