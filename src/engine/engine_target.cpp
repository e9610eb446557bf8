#include "engine/engine_target.h"

#include <algorithm>
#include <limits>

namespace kd {

namespace {

class CpuEngineTarget final : public EngineTarget {
 public:
  explicit CpuEngineTarget(const DeepseekV3& m) : model_(m) {}
  const ModelConfig& config() const override { return model_.config(); }
  std::string device() const override { return "cpu"; }
  int64_t max_context() const override { return model_.config().max_position_embeddings; }
  int64_t max_kv_tokens(int64_t) const override { return std::numeric_limits<int64_t>::max(); }
  bool host_kv() const override { return true; }
  void init_kv(int64_t, int64_t) override {}
  AttnForm prefill_form() const override { return AttnForm::expanded; }
  bool supports(AttnForm) const override { return true; }
  void forward_batch(const std::vector<SeqForward>& seqs) override { model_.forward_batch(seqs); }
  void keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) override {
    for (int64_t k = 0; k < int64_t(path.size()); ++k) {
      const int64_t from = path[size_t(k)];
      if (from == k) continue;
      for (int64_t l = 0; l < kv.n_layers; ++l) std::copy_n(kv.row(l, start + from), kv.dim, kv.row(l, start + k));
    }
  }

 private:
  const DeepseekV3& model_;
};

}  // namespace

std::unique_ptr<EngineTarget> cpu_engine_target(const DeepseekV3& model) { return std::make_unique<CpuEngineTarget>(model); }

}  // namespace kd
