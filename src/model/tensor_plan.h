// The tensors a DeepSeek-V3 / Kimi checkpoint holds for a given config, by role — computed from
// config.json alone. make-model writes exactly these; inspect counts parameters and bytes per
// decoded token from them without touching tensor data.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"

namespace kd {

enum class TensorRole { embed, lm_head, norm, attention, dense_mlp, router, router_bias, shared_expert, routed_expert };

struct PlannedTensor {
  std::string name;      // full tensor name; for INT4 modules the module name (no ".weight")
  std::vector<int64_t> shape;  // [rows, cols] (logical, unpacked) or [n]
  TensorRole role;
  bool int4 = false;     // written as weight_packed / weight_scale / weight_shape
  bool fp32 = false;     // stored F32 (the router's correction bias)
  int64_t layer = -1;

  int64_t params() const;
  uint64_t bytes(int32_t group) const;  // as stored
};

std::vector<PlannedTensor> plan_tensors(const ModelConfig& c);

// Sizes derived from the plan (SPEC-MODEL.md §5 gives K2's: 1.0264 T total, 32.86 B active with
// the embedding, ≈ 33.0 GB of weights read per decoded token at batch 1).
struct ModelStats {
  int64_t total_params = 0;
  int64_t active_params = 0;             // per token, embedding matrix excluded
  int64_t active_params_with_embed = 0;
  int64_t int4_modules = 0, dense_tensors = 0;
  uint64_t stored_bytes = 0;             // weights as stored (INT4 packed + scales)
  uint64_t bytes_per_token = 0;          // weights read per decoded token at batch 1 (one embedding row)
  uint64_t bytes_per_token_by_role[9] = {};  // indexed by TensorRole
  uint64_t kv_bytes_per_token_bf16 = 0;  // latent cache, all layers, as a GPU holds it
  uint64_t kv_bytes_per_token_f32 = 0;   // as the CPU backend holds it
};
ModelStats model_stats(const ModelConfig& c);

const char* role_name(TensorRole r);

}  // namespace kd
