// The DeepSeek-V3 / Kimi K2 target on one NVIDIA GPU: the GPU twin of model/deepseek_v3.h, one
// more implementation of the Target interface (model/target.h). A plain C++ header: no CUDA types,
// so the CLI, tests and the engine include it freely; its kernels live in src/backend/cuda/.
//
// It holds the weights on the device — bf16 attention / dense / shared experts / router / lm_head,
// INT4 routed experts repacked at load (docs/formats.md "Device INT4 layout") — and the latent KV
// in bf16 ([layers][n_blocks · block_tokens][kv_lora_rank + qk_rope_head_dim]), lent through block
// tables. Activations are fp32, every accumulation fp32, the router and softmax fp32 (DESIGN.md §4).
// The forward always uses the absorbed MLA form (decode, verify and prefill): AttnForm::expanded is
// refused. Batches of at most 64 rows replay captured CUDA graphs (one per shape, captured on its
// second use): AR decode steps, verify trees, short chunks — for `run` and `serve` alike.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "io/config.h"
#include "model/deepseek_v3.h"

namespace kd {

class Progress;

bool cuda_device_available();   // a CUDA device is present and usable
std::string cuda_device_name();
int cuda_device_count();         // GPUs visible to this process (0 when none or on error)  // "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)", or why there is none

class CudaTarget final : public Target {
 public:
  // Uploads the model's weights; the KV is one block of max_tokens rows (the single-sequence
  // forwards below) until init_kv lends it as blocks. progress (optional): advanced by every byte
  // uploaded (one bar over a whole load, e.g. all ranks of a tensor-parallel target).
  CudaTarget(const DeepseekV3& model, int64_t max_tokens, Progress* progress = nullptr);
  // Random weights made on the GPU for a config (benchmarks: `bench --preset k2-slice`); INT4 g32
  // routed experts when int4_experts, bf16 elsewhere.
  CudaTarget(const ModelConfig& cfg, int64_t max_tokens, uint64_t seed, bool int4_experts);
  ~CudaTarget() override;
  CudaTarget(const CudaTarget&) = delete;
  CudaTarget& operator=(const CudaTarget&) = delete;

  // Target (model/target.h). device_argmax: greedy rows need not bring their logits to the host;
  // device_taps: a drafter on this GPU reads the taps where the forward left them.
  const ModelConfig& config() const override;
  std::string device() const override;
  int64_t max_context() const override;  // max_keys()
  int64_t max_kv_tokens(int64_t block_tokens) const override;
  bool host_kv() const override { return false; }
  void init_kv(int64_t n_blocks, int64_t block_tokens) const override;  // (drops the captured graphs)
  AttnForm prefill_form() const override { return AttnForm::absorbed; }
  bool supports(AttnForm form) const override { return form == AttnForm::absorbed; }
  bool device_argmax() const override;
  bool device_taps() const override;
  bool shape_warmup() const override { return graphs(); }
  void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr) const override;
  void logits_row(int64_t seq, int64_t row, float* out) const override;
  void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const override;

  // The single sequence of the one-block KV (tests, the bench's timed paths in cli/bench_cuda.h,
  // the GPU drafter's tests): a batch
  // of one through forward_batch. forward: ForwardArgs over the committed size() rows (commit
  // advances it); forward_device_taps: the same with the taps left on the device, returned
  // ([n, tap_layers, hidden] fp32, valid until the next forward); compact: keep_rows, then size().
  int64_t size() const;        // committed rows
  int64_t max_tokens() const;  // KV rows
  void reset();                // empties the single sequence
  void forward(const ForwardArgs& a);
  const float* forward_device_taps(const ForwardArgs& a);
  void compact(int64_t start, const std::vector<int32_t>& keep);
  // Graph replay on (default) or off (every kernel launched one by one); both compute the same bits
  // (tests/gpu compare them).
  void set_graphs(bool on);
  bool graphs() const;
  // Argmax outputs and device taps offered (default), or not: the host paths they replace, which
  // compute the same bits (tests/gpu compare them).
  void set_device_outputs(bool on);
  // Rows of drafter taps this target has brought to the host so far (a GPU drafter's: none).
  uint64_t host_tap_rows() const;

  // Latent KV bytes of one token over every layer (the engine sizes its pool with it).
  int64_t kv_bytes_per_token() const;
  static int64_t free_device_bytes();  // cudaMemGetInfo's free bytes
  // At most `bytes` of KV pool from now on (--gpu-memory-limit: what the limit leaves beside the
  // weights and the workspace estimate); max_kv_tokens is the smaller of this and the free-memory rule.
  // Negative: no cap (the default).
  void cap_kv_bytes(int64_t bytes);
  // A tensor-parallel rank holds only its vocabulary rows of lm_head; a GPU drafter beside it (it
  // shares the target's lm_head) needs them all: uploads the whole matrix (the unsharded checkpoint's
  // lm_head, [vocab, hidden]) once more beside the rank's slice — done once, later calls return — and
  // takes its bytes from the KV cap where one is set. Refused when it cannot fit, with the numbers.
  void add_draft_lm_head(const Weight& lm_head);
  int64_t max_keys() const;  // longest key list one row may attend to (the context, within the attention's int32 positions)

  // Bytes a forward over these rows must read at least: every weight it touches once (experts: the
  // distinct ones given per MoE layer; null → top-k for one row), the KV cache rows it attends to.
  uint64_t floor_bytes(int64_t cached_rows, int64_t n_rows, const std::vector<int32_t>* distinct_experts) const;
  uint64_t device_weight_bytes() const;  // weights resident on the device

  struct Impl;  // defined in deepseek_v3_cuda_impl.h (device pointers; only the CUDA .cpp files see it)
  Impl& impl() const { return *impl_; }  // for the GPU drafter (embedding, lm_head, stream)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kd
