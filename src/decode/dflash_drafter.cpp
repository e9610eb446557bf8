#include "decode/dflash_drafter.h"

#include "core/error.h"

namespace kd {

DFlashAdapter::DFlashAdapter(const std::string& dir, const DeepseekV3& target, int64_t max_tokens)
    : target_(target), drafter_(dir, target.config()) {
  ctx_ = drafter_.new_context(max_tokens);
  for (int64_t l : drafter_.config().target_layer_ids) taps_.push_back(int32_t(l));
}

void DFlashAdapter::draft(int32_t bonus, int64_t start, float* logits) {
  if (start != ctx_.len) fail("DFlash drafter: block at position ", start, " but the context holds ", ctx_.len, " tokens");
  std::vector<int32_t> block(static_cast<size_t>(block_size()), drafter_.config().mask_token_id);
  block[0] = bonus;
  drafter_.draft(ctx_, block.data(), target_.embedding(), target_.lm_head(), logits);
}

}  // namespace kd
