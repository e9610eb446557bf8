// The DFlash block drafter (src/model/dflash.h is the CPU reference) on the GPU, beside a
// CudaTarget: its weights on the device (bf16 matrices, fp32 norms), its context K/V on the device
// (fp32 [layers][capacity + block][kv_heads·head_dim]), the target's device embedding and lm_head,
// and the target's stream, so its kernels queue behind the target's forward. The context is fed
// from the target's tapped hidden states without leaving the GPU (append_context_device); the
// host-pointer Drafter methods stay for tests and other loops. A plain C++ header.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "model/dflash.h"
#include "model/drafter.h"
#include "sample/top_k.h"

namespace kd {

// A DFlash drafter's weights on the device (bf16 matrices, gate/up interleaved; fp32 norms and RoPE
// frequencies), uploaded once from a loaded DFlashDrafter — no file is read again — onto the current
// CUDA device, and shared read-only by every sequence's CudaDFlash. Refuses non-BF16 matrices (the
// device linear kernel reads bf16) and rows that are not 16-byte multiples, naming file and tensor.
class CudaDFlashWeights {
 public:
  explicit CudaDFlashWeights(std::shared_ptr<const DFlashDrafter> host);
  ~CudaDFlashWeights();
  CudaDFlashWeights(const CudaDFlashWeights&) = delete;
  CudaDFlashWeights& operator=(const CudaDFlashWeights&) = delete;

  const DFlashDrafter& host() const;
  uint64_t device_bytes() const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

class CudaDFlash : public Drafter {
 public:
  // One sequence's drafter over shared device weights: allocates only its context K/V (max_tokens,
  // capped at max_position_embeddings) and work buffers. The drafter's config is checked against
  // the target's again (a drafter loaded for another target is refused, naming its config.json).
  CudaDFlash(std::shared_ptr<const CudaDFlashWeights> weights, CudaTarget& target, int64_t max_tokens);
  // Loads, validates (DFlashDrafter::load) and uploads the directory for this drafter alone.
  CudaDFlash(const std::string& dir, CudaTarget& target, int64_t max_tokens);
  ~CudaDFlash() override;
  CudaDFlash(const CudaDFlash&) = delete;
  CudaDFlash& operator=(const CudaDFlash&) = delete;

  std::string name() const override;
  int64_t block_size() const override;
  const std::vector<int32_t>& tap_layers() const override;
  // taps on the host [n, taps, hidden]: uploaded, then as append_context_device.
  void append_context(const float* taps, int64_t n) override;
  int64_t context_len() const override;
  // Runs the block forward on the device and downloads the logits [B − 1, vocab] (one sync).
  void draft(int32_t bonus, int64_t start, float* logits) override;
  // The block forward, then draft_top_k(logits, L, vocab, k) of its first L ≤ B − 1 logit rows
  // computed on the device (draft_top_k.h: bit-identical to the host over draft()'s logits),
  // downloading [L, k] ids and logits and 24 bytes a row (one sync; a rare row also comes whole).
  DraftTopK draft_top_k(int32_t bonus, int64_t start, int64_t L, int64_t k);
  int64_t top_k_fallback_rows() const;
  // The Drafter hook (the serving engine's rounds): draft_top_k when k ≤ kMaxDeviceTopK.
  bool top_k_on_device(int32_t bonus, int64_t start, int64_t L, int64_t k, DraftTopK& out) override;  // rows of draft_top_k resolved from a full row download

  // Context features from device taps [rows, taps, hidden]: rows = null → rows 0 … n − 1 in order;
  // else rows[0 … n) (host indices into taps, e.g. a DDTree path). Queued on the target's stream;
  // no host sync.
  bool takes_device_taps() const override { return true; }
  void append_context_device(const float* taps_dev, int64_t n, const int32_t* rows) override;
  // Rows copied into a staging buffer of kStageRows (allocated at the first one) and taken in with
  // one update before the next append, draft or a full buffer: an AR step's rows cost a device copy.
  static constexpr int64_t kStageRows = 64;
  bool stages_device_taps() const override { return true; }
  void stage_context_device(const float* taps_dev, int64_t n) override;
  void reset();  // empties the context (a new sequence)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kd
