#include "backend/cuda/cuda_engine_target.h"

#include <algorithm>

#include "core/error.h"

namespace kd {

namespace {

class CudaEngineTarget final : public EngineTarget {
 public:
  explicit CudaEngineTarget(CudaTarget& t) : t_(t) {}
  const ModelConfig& config() const override { return t_.config(); }
  std::string device() const override { return cat("cuda (", cuda_device_name(), ")"); }
  int64_t max_context() const override { return t_.max_keys(); }
  // The pool is allocated up front on the device: the memory free now, less a tenth of it (at
  // least 4 GiB) for the work buffers of a step (they grow with the rows of the largest batch).
  int64_t max_kv_tokens(int64_t block_tokens) const override {
    const int64_t per = t_.kv_bytes_per_token(), free_b = CudaTarget::free_device_bytes();
    const int64_t budget = free_b - std::max<int64_t>(free_b / 10, int64_t(4) << 30);
    return std::max<int64_t>(0, budget / per / block_tokens * block_tokens);
  }
  bool host_kv() const override { return false; }
  void init_kv(int64_t n_blocks, int64_t block_tokens) override { t_.use_paged_kv(n_blocks, block_tokens); }
  AttnForm prefill_form() const override { return AttnForm::absorbed; }
  bool supports(AttnForm form) const override { return form == AttnForm::absorbed; }
  void forward_batch(const std::vector<SeqForward>& seqs) override { t_.forward_batch(seqs); }
  void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) override { t_.move_rows(kv, start, path); }

 private:
  CudaTarget& t_;
};

}  // namespace

std::unique_ptr<EngineTarget> cuda_engine_target(CudaTarget& target) { return std::make_unique<CudaEngineTarget>(target); }

}  // namespace kd
