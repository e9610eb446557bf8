#include "model/make_drafter.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/dflash.h"
#include "model/random_weights.h"

namespace kd {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

void make_drafter(const std::string& target_dir, const std::string& out_dir, uint64_t seed, int32_t num_layers,
                  int32_t block_size, bool force) {
  const ModelConfig t = load_model_config(target_dir);
  if (num_layers < 1 || num_layers > 64) fail("drafter layers must be in [1, 64], got ", num_layers);
  if (block_size < 2 || block_size > 256)
    fail("drafter block size must be in [2, 256] (the bonus token plus at least one draft), got ", block_size);
  const int64_t H = t.hidden_size, N = t.num_hidden_layers;
  if (t.vocab_size < 2) fail(target_dir, "/config.json: vocab_size = ", t.vocab_size, " leaves no room for a mask token");

  int64_t heads = 64, kv_heads = 8, head_dim = 128, inter = 18432;  // Kimi-K2.5-DFlash (SPEC-DDTREE.md §5)
  if (H != 7168) {
    head_dim = 0;
    for (int64_t hd : {128, 64, 32, 16, 8, 4, 2})
      if (H % hd == 0 && (H / hd >= 4 || (H < 8 && head_dim == 0))) {
        head_dim = hd;
        break;
      }
    if (head_dim == 0) fail(target_dir, "/config.json: hidden_size = ", H, " has no even divisor to use as a head_dim");
    heads = H / head_dim;
    kv_heads = heads >= 8 && heads % 4 == 0 ? heads / 4 : heads % 2 == 0 ? heads / 2 : heads;
    inter = 3 * H;
  }
  const std::vector<int64_t> taps = default_target_layer_ids(N, std::min<int64_t>(num_layers, N));

  const ojson rope = rope_scaling_json(t.rope);  // the target's YaRN, as io/config.cpp reads it back
  ojson layer_types = ojson::array();
  for (int32_t l = 0; l < num_layers; ++l) layer_types.push_back("full_attention");
  const ojson config = {
      {"architectures", {"DFlashDraftModel"}},
      {"auto_map", {{"AutoModel", "dflash.DFlashDraftModel"}}},
      {"model_type", "qwen3"},
      {"attention_bias", false}, {"attention_dropout", 0.0}, {"hidden_act", "silu"},
      {"hidden_size", H}, {"intermediate_size", inter}, {"num_hidden_layers", num_layers},
      {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads}, {"head_dim", head_dim},
      {"rms_norm_eps", t.rms_norm_eps}, {"rope_theta", t.rope_theta}, {"rope_scaling", rope},
      {"max_position_embeddings", t.max_position_embeddings}, {"vocab_size", t.vocab_size},
      {"layer_types", layer_types}, {"sliding_window", nullptr}, {"use_sliding_window", false},
      {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"},
      {"block_size", block_size}, {"num_target_layers", N},
      {"dflash_config", {{"mask_token_id", t.vocab_size - 2}, {"target_layer_ids", taps}}},
  };

  if (fs::exists(out_dir) && !fs::is_empty(out_dir) && !force)
    fail(out_dir, ": exists and is not empty (pass --force to overwrite)");
  fs::create_directories(out_dir);
  {
    std::ofstream f(out_dir + "/config.json", std::ios::binary);
    f << config.dump(2) << "\n";
    if (!f) fail(out_dir, "/config.json: write failed");
  }

  // The same init as make_model: norms 1 + 0.05·N(0,1), matrices N(0, 1/fan_in), all bf16.
  SafetensorsWriter w;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    const bool norm = shape.size() == 1;
    const float stdev = norm ? 0.05f : float(1.0 / std::sqrt(double(shape.back())));
    const uint64_t s = hash_name(name, seed);
    w.add(name, DType::BF16, std::move(shape), [=](uint8_t* dst, uint64_t n) {
      Rng rng{s};
      uint16_t* h = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < n / 2; ++i) h[i] = f32_to_bf16((norm ? 1.0f : 0.0f) + rng.normal() * stdev);
    });
  };
  add("fc.weight", {H, int64_t(taps.size()) * H});
  add("hidden_norm.weight", {H});
  add("norm.weight", {H});
  for (int32_t l = 0; l < num_layers; ++l) {
    const std::string p = cat("layers.", l, ".");
    add(p + "input_layernorm.weight", {H});
    add(p + "post_attention_layernorm.weight", {H});
    add(p + "self_attn.q_proj.weight", {heads * head_dim, H});
    add(p + "self_attn.k_proj.weight", {kv_heads * head_dim, H});
    add(p + "self_attn.v_proj.weight", {kv_heads * head_dim, H});
    add(p + "self_attn.o_proj.weight", {H, heads * head_dim});
    add(p + "self_attn.q_norm.weight", {head_dim});
    add(p + "self_attn.k_norm.weight", {head_dim});
    add(p + "mlp.gate_proj.weight", {inter, H});
    add(p + "mlp.up_proj.weight", {inter, H});
    add(p + "mlp.down_proj.weight", {H, inter});
  }
  w.set_metadata("format", "pt");
  Progress progress("writing " + out_dir, w.total_bytes(), "B");
  w.write(out_dir + "/model.safetensors", [&](uint64_t n) { progress.add(n); });
  progress.finish();
  DFlashDrafter check(out_dir, t);  // the file must load back as the drafter it describes
  log_info("drafter ", out_dir, ": ", num_layers, " layers, block ", block_size, ", ", taps.size(), " taps, ",
           w.total_bytes(), " bytes");
}

}  // namespace kd
