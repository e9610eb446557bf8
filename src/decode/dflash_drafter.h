// The DFlash block-diffusion drafter (src/model/dflash.h) behind DDTree's Drafter interface: it
// shares the target's embedding and lm_head, and keeps its own context cache of the target's tapped
// features for every committed token. The weights are a shared, loaded-once DFlashDrafter: build one
// with DFlashDrafter::load and pass it to every sequence's adapter.
#pragma once
#include <memory>
#include <string>

#include "model/deepseek_v3.h"
#include "model/dflash.h"
#include "model/drafter.h"

namespace kd {

class DFlashAdapter : public Drafter {
 public:
  // One sequence's drafter over weights loaded once (checked against the target's config again:
  // a drafter loaded for another target is refused, naming its config.json).
  DFlashAdapter(std::shared_ptr<const DFlashDrafter> drafter, const DeepseekV3& target, int64_t max_tokens);
  // Loads the directory for this adapter alone (DFlashDrafter::load), for tests and one-off use.
  DFlashAdapter(const std::string& dir, const DeepseekV3& target, int64_t max_tokens);
  std::string name() const override { return "DFlash (" + drafter_->dir() + ")"; }
  int64_t block_size() const override { return drafter_->config().block_size; }
  const std::vector<int32_t>& tap_layers() const override { return taps_; }
  void append_context(const float* taps, int64_t n) override { drafter_->append_context(ctx_, taps, n); }
  int64_t context_len() const override { return ctx_.len; }
  void draft(int32_t bonus, int64_t start, float* logits) override;
  const DFlashDrafter& model() const { return *drafter_; }
  const std::shared_ptr<const DFlashDrafter>& shared_model() const { return drafter_; }

 private:
  const DeepseekV3& target_;
  std::shared_ptr<const DFlashDrafter> drafter_;
  DFlashDrafter::Context ctx_;
  std::vector<int32_t> taps_;
};

}  // namespace kd
