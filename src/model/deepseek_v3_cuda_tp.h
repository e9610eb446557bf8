// The tensor-parallel GPU target (issue 14): R ranks, each a CudaTarget holding its TpRank slice of the
// checkpoint (model/tp_plan.h) and its own copy of the latent KV, driven on R threads; partial sums
// cross a DeviceComm (backend/cuda/device_comm.h) twice a layer in rank order, so a row's bits are the
// same alone or batched and DDTree == AR at every R, as on the CPU (model/deepseek_v3_tp.h, the
// reference these ranks are tested against). Ranks on distinct GPUs talk through NCCL; ranks listed on
// one GPU (`--devices 0,0`) share it through SharedDeviceComm — the single-GPU emulation, which runs the
// same sharded kernels and reductions (without CUDA graphs: its reductions meet on the host).
//
// Outputs: host logits — each rank downloads its vocabulary columns; argmax outputs — each rank's
// (value, index) over its rows of lm_head, combined on the host with sample()'s greedy rule; taps —
// rank 0's (the residual stream is replicated), on the host or left on rank 0's GPU (device_taps), where
// a GPU DFlash drafter reads them: draft_rank() gives it rank 0 with the whole lm_head uploaded beside
// the rank's slice (the drafter shares the target's lm_head, which no rank holds whole).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/weight.h"
#include "io/checkpoint.h"
#include "model/target.h"

namespace kd {

class CudaTarget;
class NcclCommGroup;
class SharedDeviceCommGroup;
class HostRankThreads;

// cudaMemGetInfo's free bytes of GPU `device` (the current device is restored).
uint64_t cuda_free_bytes(int32_t device);
// The memory plan's check before any weight is read (tp_gpu_refusal, model/tp_plan.h, against each GPU's
// free memory and limit_bytes): an Error with the numbers and what to do when a GPU cannot hold its ranks.
// devices: rank r's GPU ({0} for the one-GPU target).
void check_gpu_memory_plan(const ModelConfig& c, const std::vector<int32_t>& devices, uint64_t limit_bytes, int64_t kv_tokens,
                           const std::string& what);

class CudaTpTarget final : public Target {
 public:
  // devices[r]: rank r's GPU (R = devices.size() ≥ 2); all equal → the one-GPU emulation, all distinct →
  // NCCL. An R the config cannot be split into is an Error naming the dimension and the valid R.
  // memory_limit_bytes (--gpu-memory-limit; 0: none): what each GPU may hold — the memory plan is checked
  // against it (and the free memory) before anything is uploaded, and the KV pool gets only what it leaves.
  // The upload shows one progress bar over every rank's bytes.
  CudaTpTarget(const Checkpoint& ckpt, const std::vector<int32_t>& devices, uint64_t memory_limit_bytes = 0);
  ~CudaTpTarget() override;

  int32_t ranks() const { return int32_t(ranks_.size()); }
  const std::vector<int32_t>& devices() const { return devices_; }  // rank r's GPU
  const CudaTarget& rank(int32_t r) const { return *ranks_[size_t(r)]; }
  bool shared_device() const { return shared_ != nullptr; }

  const ModelConfig& config() const override { return cfg_; }
  std::string device() const override;
  int64_t max_context() const override;
  // Every rank holds the whole latent KV: on one shared GPU the pool takes R times its bytes.
  int64_t max_kv_tokens(int64_t block_tokens) const override;
  bool host_kv() const override { return false; }
  void init_kv(int64_t n_blocks, int64_t block_tokens) const override;
  AttnForm prefill_form() const override { return AttnForm::absorbed; }
  bool supports(AttnForm form) const override { return form == AttnForm::absorbed; }
  bool device_argmax() const override { return true; }
  bool device_taps() const override;  // rank 0's taps stay on its GPU when asked
  // Rank 0, where a GPU drafter (CudaDFlash) runs beside the target: its stream, embedding and device
  // taps, and `lm_head` (the unsharded checkpoint's, [vocab, hidden]) uploaded whole to its GPU once
  // (CudaTarget::add_draft_lm_head: + vocab × hidden × 2 bytes on GPU devices()[0]). The current device
  // is left at rank 0's.
  CudaTarget& draft_rank(const Weight& lm_head) const;
  void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr) const override;
  void logits_row(int64_t seq, int64_t row, float* out) const override;
  void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const override;

 private:
  ModelConfig cfg_;
  std::vector<int32_t> devices_;
  std::vector<int64_t> vocab_begin_;  // rank r's first lm_head row
  std::vector<std::unique_ptr<CudaTarget>> ranks_;
  std::unique_ptr<NcclCommGroup> nccl_;            // ranks on distinct GPUs …
  std::unique_ptr<HostRankThreads> nccl_threads_;  // … each driven by a kept thread (rank 0: the caller)
  std::unique_ptr<SharedDeviceCommGroup> shared_;  // ranks on one GPU (the emulation)
};

}  // namespace kd
