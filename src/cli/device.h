// `--device cpu|cuda` and the target model behind it, made the same way by every command that
// takes it (run, serve, ppl, bench's engine load test): the one place that knows which Target
// implementation a device means.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/dflash.h"
#include "model/drafter.h"
#include "model/target.h"

namespace kd::cli {

// True for cuda, false for cpu; a clear error for anything else, for cuda in a build without the
// CUDA backend, and for cuda on a machine without a usable GPU (the message says why).
bool use_cuda(const std::string& device);

// Tensor parallelism as run, serve, bench and ppl take it (TpFlags, cli/commands.h).
void add_tp_flags(CLI::App* c, TpFlags& f);
// --draft-yarn-legacy-mscale, as run and serve take it (DFlashLoadOptions::yarn_legacy_mscale).
void add_draft_yarn_flag(CLI::App* c, bool& legacy);
// Checks --tp / --devices against the device and the model's shapes (plan_tp: an R that does not divide
// them is refused naming the dimension and the valid R) before any weight is read.
void check_tp_flags(const TpFlags& f, bool cuda, const ModelConfig& c);
// With --device cuda: rank r's GPU (--devices, else 0, 1, … R−1, refused when the machine has fewer).
std::vector<int32_t> tp_devices(const TpFlags& tp);
// With --device cuda: the memory plan for these flags (R ranks on their GPUs; weights, workspace
// estimate, kv_tokens of KV a rank) against each GPU's free memory and --gpu-memory-limit — an Error
// with the numbers and what to do when it does not fit (model/deepseek_v3_cuda_tp.h,
// check_gpu_memory_plan). Nothing is read but config.json. cuda false: nothing to check.
void check_gpu_memory(const TpFlags& tp, bool cuda, const ModelConfig& c, int64_t kv_tokens);

// A checkpoint read once: the CPU model (views into the mmap), and on cuda the GPU target uploaded
// from it. target() is the one the commands run; model() stays for what reads host weights (the
// CPU drafter's shared embedding and lm_head).
class LoadedTarget {
 public:
  // tp.tp > 1: the tensor-parallel target over tp.tp ranks (on the CPU: in-process ranks,
  // model/deepseek_v3_tp.h); the checks of check_tp_flags apply. On cuda the memory plan (weights,
  // workspace, kv_tokens of KV a rank) is checked on every GPU against its free memory and
  // tp.gpu_memory_limit_gib before a weight is read (check_gpu_memory_plan); the upload shows a progress bar.
  LoadedTarget(const std::string& device, const std::string& checkpoint_dir, const TpFlags& tp = {}, int64_t kv_tokens = 0);
  ~LoadedTarget();
  const Target& target() const;
  const DeepseekV3& model() const { return *model_; }
  const ModelConfig& config() const { return model_->config(); }
  bool cuda() const { return gpu_ != nullptr; }
  // Fresh drafters of the DFlash directory `dir` for this target, each holding up to max_tokens of
  // context: on the GPU beside a GPU target (fed from its taps on the device), else on the CPU.
  // The directory is read and validated here, once (the first drafter is handed back as `first`).
  struct Drafters {
    std::function<std::unique_ptr<Drafter>()> make;
    std::unique_ptr<Drafter> first;
  };
  Drafters dflash_drafters(const std::string& dir, int64_t max_tokens, const DFlashLoadOptions& options = {}) const;

 private:
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<DeepseekV3> model_;
  std::unique_ptr<Target> gpu_;
  std::unique_ptr<Target> tp_;  // the tensor-parallel target (R > 1)
};

}  // namespace kd::cli
