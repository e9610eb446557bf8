// The DeepSeek-V3 / Kimi K2 target on one NVIDIA GPU (calm-style: its own forward with the CPU
// forward's ForwardArgs semantics). A plain C++ header: no CUDA types, so CLI, tests and the spec
// loops include it freely; the kernels live in the .cu files behind it (kernels.h).
//
// It holds the weights on the device — bf16 attention / dense / shared experts / router / lm_head,
// INT4 routed experts repacked at load (docs/formats.md "Device INT4 layout") — and one sequence's
// latent KV cache in bf16 ([layers][capacity][kv_lora_rank + qk_rope_head_dim]). Activations are
// fp32, every accumulation fp32, the router and softmax fp32 (DESIGN.md §4). The forward always uses
// the absorbed MLA form (decode, verify and prefill): AttnForm::expanded is refused.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "io/config.h"
#include "model/deepseek_v3.h"

namespace kd {

bool cuda_device_available();   // a CUDA device is present and usable
std::string cuda_device_name();  // "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)", or why there is none

class CudaTarget {
 public:
  // Uploads the model's weights; the cache holds max_tokens rows (prompt + generation + one tree).
  CudaTarget(const DeepseekV3& model, int64_t max_tokens);
  // Random weights made on the GPU for a config (benchmarks: `bench --preset k2-slice`); INT4 g32
  // routed experts when int4_experts, bf16 elsewhere.
  CudaTarget(const ModelConfig& cfg, int64_t max_tokens, uint64_t seed, bool int4_experts);
  ~CudaTarget();
  CudaTarget(const CudaTarget&) = delete;
  CudaTarget& operator=(const CudaTarget&) = delete;

  const ModelConfig& config() const;
  int64_t size() const;        // committed cache rows
  int64_t max_tokens() const;  // cache capacity
  void reset();                // empties the cache (a new sequence)

  // DeepseekV3::forward's contract over this object's cache: ids [n], positions (null → causal
  // from size()), visibility [n, n] (null → causal), commit, all_logits, logits [n or 1, vocab] on
  // the host (may be null), taps [n, tap_layers, hidden], stats (weight bytes streamed, experts
  // counted as distinct per layer). Synchronises with the device when host outputs are asked for.
  void forward(const ForwardArgs& a);
  // forward, but the taps stay on the device (a.taps must be null): returns them, [n, tap_layers,
  // hidden] fp32 in a work buffer that the next forward overwrites (the GPU drafter reads them there).
  const float* forward_device_taps(const ForwardArgs& a);
  // One-row forwards (AR decode steps) and uncommitted ones (DDTree verify, one per tree size)
  // replay captured CUDA graphs (on by default); off: every kernel is launched one by one. Both
  // compute the same bits (tests/gpu compare them).
  void set_graphs(bool on);
  bool graphs() const;
  // DDTree compaction of the latent cache, as LatentCache::compact.
  void compact(int64_t start, const std::vector<int32_t>& keep);

  // Serving (src/engine/): replaces the single-sequence cache by a pool of n_blocks blocks of
  // block_tokens rows (bf16 [layers][n_blocks · block_tokens][latent]) that the engine lends
  // through block tables (KvPool without host storage). Afterwards only forward_batch and
  // move_rows run; forward / compact / the timed paths are refused.
  void use_paged_kv(int64_t n_blocks, int64_t block_tokens);
  // DeepseekV3::forward_batch's contract: every sequence's rows in one forward, each attending only
  // to its own committed rows (its kv.blocks table) and its own new rows; logits and taps land in
  // each sequence's host buffers. Row invariance makes a sequence's logits bit-identical to a
  // single-sequence forward over the same rows. One host sync.
  void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr);
  // DDTree compaction in a sequence's blocks: rows start + path[k] → start + k (path ascending).
  void move_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path);
  // Latent KV bytes of one token over every layer (the engine sizes its pool with it).
  int64_t kv_bytes_per_token() const;
  static int64_t free_device_bytes();  // cudaMemGetInfo's free bytes
  int64_t max_keys() const;  // longest key list one row may attend to (attention's shared-memory bound)

  // Benchmark paths: the same forward, timed with CUDA events, logits kept on the device.
  double timed_prefill_ms(const std::vector<int32_t>& prompt);  // resets, then one forward over the prompt
  // n greedy decode steps after the cache's contents, the argmax fed back on the device (no host
  // round-trip); per-step milliseconds. graph: each step replays one captured CUDA graph.
  std::vector<double> timed_decode_ms(int32_t first_token, int64_t steps, bool graph);
  // One uncommitted verify forward over a tree (ids, positions, visibility as ForwardArgs), all
  // logits on the device; milliseconds. distinct_experts (optional): per MoE layer, experts touched.
  // graph: replayed as the DDTree round replays it (one captured graph per tree size); else launched
  // kernel by kernel. Inside an NVTX range "verify N graph|launches" (N = nodes, root excluded).
  double timed_verify_ms(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                         const std::vector<uint8_t>& visibility, std::vector<int32_t>* distinct_experts, bool graph);

  // Bytes a forward over these rows must read at least: every weight it touches once (experts: the
  // distinct ones given per MoE layer; null → top-k for one row), the KV cache rows it attends to.
  uint64_t floor_bytes(int64_t cached_rows, int64_t n_rows, const std::vector<int32_t>* distinct_experts) const;
  uint64_t device_weight_bytes() const;  // weights resident on the device

  static double measure_read_gbps();  // streaming read bandwidth of the device, GB/s (median of 10)
  static double measure_mma_tflops();  // mma.sync bf16 m16n8k16 rate, register operands, TFLOP/s (median of 10)

  struct Impl;  // defined in cuda_target_impl.h (device pointers; only the backend's .cpp files see it)
  Impl& impl() { return *impl_; }  // for the backend's GPU drafter (embedding, lm_head, stream)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kd
