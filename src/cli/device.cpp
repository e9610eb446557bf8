#include "cli/device.h"

#include "core/error.h"
#include "core/log.h"
#include "decode/dflash_drafter.h"
#include "model/dflash.h"
#ifdef KDTREE_HAVE_CUDA
#include "model/deepseek_v3_cuda.h"
#include "model/dflash_cuda.h"
#endif

namespace kd::cli {

bool use_cuda(const std::string& device) {
  const bool cuda = device == "cuda";
  if (device != "cpu" && !cuda) fail("--device ", device, ": unknown device (choose cpu or cuda)");
#ifndef KDTREE_HAVE_CUDA
  if (cuda) fail("--device cuda: this build has no CUDA backend (configure with -DKDTREE_CUDA=ON where nvcc is installed)");
#else
  if (cuda && !cuda_device_available()) fail("--device cuda: ", cuda_device_name());
#endif
  return cuda;
}

LoadedTarget::LoadedTarget(const std::string& device, const std::string& checkpoint_dir) {
  [[maybe_unused]] const bool cuda = use_cuda(device);
  ckpt_ = std::make_unique<Checkpoint>(checkpoint_dir);
  model_ = std::make_unique<DeepseekV3>(*ckpt_);
#ifdef KDTREE_HAVE_CUDA
  if (cuda) {
    // A one-row KV to start with: the engine lends its pool's blocks (Target::init_kv).
    auto gpu = std::make_unique<CudaTarget>(*model_, 1);
    log_info("CUDA target on ", cuda_device_name(), ": ", double(gpu->device_weight_bytes()) / 1e9, " GB of weights");
    gpu_ = std::move(gpu);
  }
#endif
}

LoadedTarget::~LoadedTarget() = default;

const Target& LoadedTarget::target() const { return gpu_ ? *gpu_ : static_cast<const Target&>(*model_); }

LoadedTarget::Drafters LoadedTarget::dflash_drafters(const std::string& dir, int64_t max_tokens) const {
  // The directory is read once (DFlashDrafter::load validates it against the target); on the GPU its
  // weights are uploaded once too, and each sequence's drafter holds only its context.
  std::shared_ptr<const DFlashDrafter> host = DFlashDrafter::load(dir, model_->config());
  std::function<std::unique_ptr<Drafter>()> make;
#ifdef KDTREE_HAVE_CUDA
  if (gpu_) {
    CudaTarget* g = static_cast<CudaTarget*>(gpu_.get());
    auto weights = std::make_shared<const CudaDFlashWeights>(host);
    make = [weights, g, max_tokens] { return std::make_unique<CudaDFlash>(weights, *g, max_tokens); };
  }
#endif
  if (!make) {
    const DeepseekV3* m = model_.get();
    make = [host, m, max_tokens] { return std::make_unique<DFlashAdapter>(host, *m, max_tokens); };
  }
  Drafters d;
  d.first = make();
  d.make = std::move(make);
  return d;
}

}  // namespace kd::cli
