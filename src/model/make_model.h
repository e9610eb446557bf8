// `kdtree make-model`: random models in the real published format (config.json, bf16 safetensors,
// compressed-tensors INT4 experts, optional shards + index), for the demo, tests and benchmarks.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kd {

struct MakeModelOptions {
  std::string preset;       // a name from model_presets(), or empty with config_path
  std::string config_path;  // a config.json to follow instead of a preset
  std::string out_dir;
  uint64_t seed = 0;
  int32_t shards = 1;       // > 1 writes model-0000i-of-0000N.safetensors + model.safetensors.index.json
  bool force = false;       // overwrite a non-empty out_dir
  std::string tokenizer_dir;  // copy tiktoken.model / tokenizer_config.json / tokenizer.json from here
  // A DFlash drafter for this target directory instead of a target model (make_drafter.h).
  std::string drafter_for;
  int32_t draft_layers = 2, block_size = 8;
};

struct ModelPreset {
  std::string name, description;
};
std::vector<ModelPreset> model_presets();
// The config.json text of a preset (throws listing the presets when unknown).
std::string preset_config_json(const std::string& name);

void make_model(const MakeModelOptions& opt);

}  // namespace kd
