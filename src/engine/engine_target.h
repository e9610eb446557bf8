// The model an Engine runs on (DESIGN.md §3): a batched forward over the engine's paged latent KV.
// The engine owns the bookkeeping (KvPool: block tables, refcounts, prefix cache); the target owns
// the weights, the forward and — for a device target — the blocks' storage. Two implementations:
// the CPU model (cpu_engine_target, blocks in host memory inside the KvPool) and the CUDA target
// (src/backend/cuda/cuda_engine_target.h, blocks in a device cache the target allocates).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/deepseek_v3.h"

namespace kd {

class EngineTarget {
 public:
  virtual ~EngineTarget() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string device() const = 0;  // "cpu", "cuda (NVIDIA H200 …)"
  // Longest context one sequence may have on this target (≤ max_position_embeddings).
  virtual int64_t max_context() const = 0;
  // Most KV tokens the pool may hold (device memory); INT64_MAX when memory is allocated lazily.
  virtual int64_t max_kv_tokens(int64_t block_tokens) const = 0;
  // true: the KvPool keeps each block's rows in host memory and views carry row pointers.
  virtual bool host_kv() const = 0;
  // Called once, before the first forward, with the pool's geometry.
  virtual void init_kv(int64_t n_blocks, int64_t block_tokens) = 0;
  // The MLA form of prompt rows: the CPU prefills in the expanded form as generate_ar does, so a
  // served request equals `kdtree run`; the CUDA target runs the absorbed form throughout.
  virtual AttnForm prefill_form() const = 0;
  virtual bool supports(AttnForm form) const = 0;
  // DeepseekV3::forward_batch's contract; kv views come from the engine's KvPool.
  virtual void forward_batch(const std::vector<SeqForward>& seqs) = 0;
  // DDTree compaction of one sequence: rows start + path[k] → start + k (path ascending, path[k] ≥ k).
  virtual void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) = 0;
};

// The CPU model as an engine target (the model must outlive it).
std::unique_ptr<EngineTarget> cpu_engine_target(const DeepseekV3& model);

}  // namespace kd
