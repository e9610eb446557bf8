#include "cli/device.h"

#include "core/error.h"
#include "core/log.h"
#include "decode/dflash_drafter.h"
#include "cli/int_flag.h"
#include "model/deepseek_v3_tp.h"
#include "model/dflash.h"
#include "model/tp_plan.h"
#ifdef KDTREE_HAVE_CUDA
#include "model/deepseek_v3_cuda.h"
#include "model/deepseek_v3_cuda_tp.h"
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

void add_draft_yarn_flag(CLI::App* c, bool& legacy) {
  c->add_flag("--draft-yarn-legacy-mscale", legacy,
              "A YaRN DFlash drafter scales RoPE's cos/sin by the legacy 0.1·ln(factor) + 1 (SGLang's and vLLM's generic "
              "YaRN) instead of the reference rule of z-lab's DFlashDraftModel (transformers: rope_scaling.attention_factor, "
              "else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), 1.0 for Kimi-K2.5-DFlash). Only for "
              "a drafter trained with the legacy value; refused when config.json gives attention_factor");
}

void add_tp_flags(CLI::App* c, TpFlags& f) {
  c->add_option("--tp,--tensor-parallel", f.tp,
                "Tensor-parallel ranks R (default 1): attention heads, every MLP's intermediate dimension and the "
                "vocabulary split R ways, two rank-order reductions a layer, output identical alone or batched and "
                "DDTree == AR at every R. On the CPU: R in-process ranks (a thread each); with --device cuda: a rank "
                "per GPU of --devices, over NCCL. R must divide the heads and the MLP widths (kdtree inspect --tp R "
                "shows the plan)")
      ->transform(whole_number(f.tp))
      ->check(CLI::Range(1, 64));
  c->add_option("--devices", f.devices, "With --device cuda: the GPUs of the ranks, one id each (default 0, 1, … R−1); the same id for "
                "every rank (--devices 0,0) runs them all on that GPU, the one-GPU emulation")
      ->delimiter(',')
      ->transform(whole_number(int32_t{}))
      ->check(CLI::Range(0, 1023));
  c->add_option("--gpu-memory-limit", f.gpu_memory_limit_gib,
                "With --device cuda: GiB kdtree may use on each GPU (default: its free memory). The memory plan — weights, "
                "a workspace estimate and the KV of the context, per rank (kdtree inspect --gpu-memory-limit GIB [--tp R] "
                "prints it) — is checked against it before any weight is read, and refused with the numbers and what to do "
                "when it does not fit; the KV pool gets only what the limit leaves")
      ->check(CLI::PositiveNumber);
}

void check_tp_flags(const TpFlags& f, bool cuda, const ModelConfig& c) {
  if (!f.devices.empty() && !cuda) fail("--devices lists GPUs: it applies with --device cuda only");
  if (f.gpu_memory_limit_gib > 0 && !cuda) fail("--gpu-memory-limit: it applies with --device cuda only (the CPU maps the weights)");
  if (!f.devices.empty() && int32_t(f.devices.size()) != f.tp)
    fail("--devices lists ", f.devices.size(), " GPUs for --tp ", f.tp, ": give one GPU a rank");
  if (cuda && f.tp == 1 && !f.devices.empty() && f.devices[0] != 0)
    fail("--devices ", f.devices[0], ": the one-GPU target runs on GPU 0; pick another with CUDA_VISIBLE_DEVICES=", f.devices[0]);
  if (f.tp > 1) plan_tp(c, f.tp);  // refuses an R that does not divide the shapes, naming the valid R
}

std::vector<int32_t> tp_devices(const TpFlags& tp) {
  if (!tp.devices.empty()) return tp.devices;
  if (tp.tp == 1) return {0};
#ifdef KDTREE_HAVE_CUDA
  const int n = cuda_device_count();
#else
  const int n = 0;
#endif
  if (n < tp.tp) {
    std::string zeros = "0";
    for (int32_t r = 1; r < tp.tp; ++r) zeros += ",0";
    fail("--tp ", tp.tp, " --device cuda: this machine has ", n, " GPU", n == 1 ? "" : "s", "; give each rank one with --devices, "
         "or run every rank on GPU 0 with --devices ", zeros, " (the one-GPU emulation: the same sharded math, slower)");
  }
  std::vector<int32_t> devs;
  for (int32_t r = 0; r < tp.tp; ++r) devs.push_back(r);
  return devs;
}

void check_gpu_memory([[maybe_unused]] const TpFlags& tp, bool cuda, [[maybe_unused]] const ModelConfig& c,
                      [[maybe_unused]] int64_t kv_tokens) {
  if (!cuda) return;
#ifdef KDTREE_HAVE_CUDA
  check_gpu_memory_plan(c, tp_devices(tp), uint64_t(tp.gpu_memory_limit_gib * double(1ull << 30)), kv_tokens,
                        tp.tp > 1 ? cat("--device cuda --tp ", tp.tp) : std::string("--device cuda"));
#endif
}

LoadedTarget::LoadedTarget(const std::string& device, const std::string& checkpoint_dir, const TpFlags& tp, int64_t kv_tokens) {
  [[maybe_unused]] const bool cuda = use_cuda(device);
  ckpt_ = std::make_unique<Checkpoint>(checkpoint_dir);
  check_tp_flags(tp, cuda, ckpt_->config());
  // The GPUs of the ranks, and the memory plan checked on each before any weight is read.
  [[maybe_unused]] const uint64_t limit = uint64_t(tp.gpu_memory_limit_gib * double(1ull << 30));
  [[maybe_unused]] const std::vector<int32_t> devs = cuda ? tp_devices(tp) : std::vector<int32_t>{};
  if (cuda) check_gpu_memory(tp, cuda, ckpt_->config(), kv_tokens);
  model_ = std::make_unique<DeepseekV3>(*ckpt_);
  if (tp.tp > 1 && !cuda) {
    const double t0 = now_s();
    tp_ = std::make_unique<DeepseekV3Tp>(*ckpt_, tp.tp);
    log_info("tensor parallel over ", tp.tp, " CPU ranks: sliced in ", (now_s() - t0) * 1e3, " ms");
  }
#ifdef KDTREE_HAVE_CUDA
  if (tp.tp > 1 && cuda) {
    tp_ = std::make_unique<CudaTpTarget>(*ckpt_, devs, limit);
    log_info("target: ", tp_->device());
  }
  if (cuda && tp.tp == 1) {
    // A one-row KV to start with: the engine lends its pool's blocks (Target::init_kv).
    const TpPlan plan = plan_tp(model_->config(), 1);
    std::unique_ptr<CudaTarget> gpu;
    {
      Progress progress("loading weights to GPU 0", plan.weight_bytes_by_rank[0], "B");
      gpu = std::make_unique<CudaTarget>(*model_, 1, &progress);
    }
    if (limit > 0)  // the KV pool gets what the limit leaves beside the weights and the workspace estimate
      gpu->cap_kv_bytes(std::max<int64_t>(0, int64_t(limit) - int64_t(gpu->device_weight_bytes()) -
                                                 int64_t(tp_memory(model_->config(), plan, 0).workspace_bytes)));
    log_info("CUDA target on ", cuda_device_name(), ": ", double(gpu->device_weight_bytes()) / 1e9, " GB of weights");
    gpu_ = std::move(gpu);
  }
#endif
}

LoadedTarget::~LoadedTarget() = default;

const Target& LoadedTarget::target() const {
  if (tp_) return *tp_;
  return gpu_ ? *gpu_ : static_cast<const Target&>(*model_);
}

LoadedTarget::Drafters LoadedTarget::dflash_drafters(const std::string& dir, int64_t max_tokens,
                                                     const DFlashLoadOptions& options) const {
  // The directory is read once (DFlashDrafter::load validates it against the target); on the GPU its
  // weights are uploaded once too, and each sequence's drafter holds only its context.
  std::shared_ptr<const DFlashDrafter> host = DFlashDrafter::load(dir, model_->config(), options);
  if (const DFlashConfig& c = host->config(); c.rope.yarn)
    log_info("drafter YaRN: factor ", c.rope.factor, ", cos/sin amplitude ", c.rope_attention_factor, " (",
             yarn_factor_rule_name(c.rope_attention_factor_rule), ")");
  std::function<std::unique_ptr<Drafter>()> make;
#ifdef KDTREE_HAVE_CUDA
  // The GPU drafter beside the target's GPU: the one GPU's, or a tensor-parallel target's rank 0 — from its
  // device taps, with the whole lm_head uploaded there (no rank holds it whole).
  CudaTarget* g = static_cast<CudaTarget*>(gpu_.get());
  if (auto* tp = dynamic_cast<const CudaTpTarget*>(tp_.get())) {
    g = &tp->draft_rank(model_->lm_head());
    log_info("drafter on GPU ", tp->devices()[0], " beside tensor-parallel rank 0, with the whole lm_head there (+",
             double(model_->lm_head().bytes()) / 1e9, " GB)");
  }
  if (g) {
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
