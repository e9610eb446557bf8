// The tensor-parallel CPU target (issue 14, DESIGN.md §6): R ranks of the CPU model, each holding its
// TpRank slice of the checkpoint (model/tp_plan.h: heads, MLP intermediate slices, lm_head vocabulary
// rows), driven on R threads through the host communicator (backend/cpu/host_comm.h) — the CPU's
// emulation of one process driving every GPU of a host, so CI tests TP 2/4/8 on every commit with the
// same sharded math, reductions and argmax exchange a multi-GPU target uses.
//
// Exactness: each rank's math is row-invariant and the reductions are (comm.h's contract), so a
// sequence's logits are the same bits alone or in any batch, and DDTree == AR holds at every R. Against
// R = 1 the partial sums of o_proj and of every MLP's down_proj add in another order: logits agree to
// rounding, tokens except at near-ties (tests/unit/test_tensor_parallel.cpp states the tolerance).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/target.h"

namespace kd {

class HostRankThreads;

class DeepseekV3Tp final : public Target {
 public:
  // Every rank's slice, read from the checkpoint's mmap (replicated tensors are views shared by all
  // ranks, split ones views or column copies of the rank's slice only). An R the config cannot be split
  // into is an Error naming the dimension and the valid R.
  DeepseekV3Tp(const Checkpoint& ckpt, int32_t ranks);
  ~DeepseekV3Tp() override;

  int32_t ranks() const { return int32_t(ranks_.size()); }
  const DeepseekV3& rank(int32_t r) const { return *ranks_[size_t(r)]; }

  const ModelConfig& config() const override { return ranks_[0]->config(); }
  std::string device() const override;  // "cpu, tensor parallel over R ranks"
  int64_t max_context() const override { return ranks_[0]->max_context(); }
  int64_t max_kv_tokens(int64_t block_tokens) const override { return ranks_[0]->max_kv_tokens(block_tokens); }
  // The ranks share the pool's host rows (the latent is the same on every rank: rank 0 writes it).
  bool host_kv() const override { return true; }
  void init_kv(int64_t, int64_t) const override {}
  AttnForm prefill_form() const override { return AttnForm::expanded; }
  bool supports(AttnForm) const override { return true; }
  // Greedy rows can come back as argmax outputs: each rank's (value, index) over its vocabulary rows,
  // exchanged and combined as a multi-GPU target does; logits_row assembles a row from the ranks' slices.
  bool device_argmax() const override { return true; }
  // One forward on every rank (the kept rank threads, one host communicator); stats sum the ranks' bytes.
  void forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats = nullptr) const override;
  void logits_row(int64_t seq, int64_t row, float* out) const override;
  void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const override;

  // Wall seconds rank 0 has spent in communicator calls since construction (the two reductions a layer
  // and the argmax exchange, each including the wait for the slowest rank): `bench --tp R`'s share.
  double comm_seconds() const { return comm_s_; }

 private:
  mutable double comm_s_ = 0;
  std::vector<std::unique_ptr<DeepseekV3>> ranks_;
  std::unique_ptr<HostRankThreads> threads_;  // rank r's forward runs on thread r (rank 0: the caller's)
};

}  // namespace kd
