#include "decode/dflash_drafter.h"

#include "core/error.h"

namespace kd {

DFlashAdapter::DFlashAdapter(std::shared_ptr<const DFlashDrafter> drafter, const DeepseekV3& target, int64_t max_tokens)
    : target_(target), drafter_(std::move(drafter)) {
  if (!drafter_) fail("DFlash drafter: no drafter weights given");
  check_fits_target(drafter_->config(), target.config(), drafter_->dir() + "/config.json", /*warn=*/false);
  ctx_ = drafter_->new_context(max_tokens);
  for (int64_t l : drafter_->config().target_layer_ids) taps_.push_back(int32_t(l));
}

DFlashAdapter::DFlashAdapter(const std::string& dir, const DeepseekV3& target, int64_t max_tokens)
    : DFlashAdapter(DFlashDrafter::load(dir, target.config()), target, max_tokens) {}

void DFlashAdapter::draft(int32_t bonus, int64_t start, float* logits) {
  if (start != ctx_.len) fail("DFlash drafter: block at position ", start, " but the context holds ", ctx_.len, " tokens");
  std::vector<int32_t> block(static_cast<size_t>(block_size()), drafter_->config().mask_token_id);
  block[0] = bonus;
  drafter_->draft(ctx_, block.data(), target_.embedding(), target_.lm_head(), logits);
}

}  // namespace kd
