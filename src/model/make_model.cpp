#include "model/make_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/int4.h"
#include "core/log.h"
#include "core/untrusted.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/random_weights.h"
#include "model/tensor_plan.h"
#include "tokenizer/tokenizer.h"

namespace kd {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

// Kimi K2.5's text config (SPEC-MODEL.md §1), the base every preset shrinks.
ojson k2_config() {
  return ojson{
      {"architectures", {"DeepseekV3ForCausalLM"}},
      {"model_type", "kimi_k2"},
      {"vocab_size", 163840}, {"hidden_size", 7168}, {"intermediate_size", 18432}, {"moe_intermediate_size", 2048},
      {"num_hidden_layers", 61}, {"num_attention_heads", 64}, {"num_key_value_heads", 64},
      {"q_lora_rank", 1536}, {"kv_lora_rank", 512},
      {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64}, {"v_head_dim", 128},
      {"n_routed_experts", 384}, {"num_experts_per_tok", 8}, {"n_shared_experts", 1},
      {"first_k_dense_replace", 1}, {"moe_layer_freq", 1}, {"n_group", 1}, {"topk_group", 1},
      {"routed_scaling_factor", 2.827}, {"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"},
      {"norm_topk_prob", true}, {"hidden_act", "silu"}, {"attention_bias", false},
      {"rms_norm_eps", 1e-5}, {"rope_theta", 50000.0}, {"max_position_embeddings", 262144},
      {"rope_scaling", {{"type", "yarn"}, {"factor", 64.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                        {"mscale", 1.0}, {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096}}},
      {"tie_word_embeddings", false}, {"bos_token_id", 163584}, {"eos_token_id", 163585},
      {"torch_dtype", "bfloat16"},
      {"quantization_config",
       {{"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}, {"quantization_status", "compressed"},
        {"config_groups",
         {{"group_0",
           {{"targets", {"Linear"}},
            {"weights", {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"},
                         {"group_size", 32}, {"dynamic", false}, {"observer", "minmax"}, {"actorder", nullptr}}},
            {"input_activations", nullptr}, {"output_activations", nullptr}}}}},
        {"ignore", {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"}},
        {"kv_cache_scheme", nullptr}}},
  };
}

ojson shrink(ojson c, int64_t vocab, int64_t hidden, int64_t inter, int64_t moe_inter, int64_t layers, int64_t heads,
             int64_t q_lora, int64_t kv_lora, int64_t nope, int64_t rope, int64_t v, int64_t experts, int64_t topk) {
  c["vocab_size"] = vocab;
  c["hidden_size"] = hidden;
  c["intermediate_size"] = inter;
  c["moe_intermediate_size"] = moe_inter;
  c["num_hidden_layers"] = layers;
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = heads;
  c["q_lora_rank"] = q_lora;
  c["kv_lora_rank"] = kv_lora;
  c["qk_nope_head_dim"] = nope;
  c["qk_rope_head_dim"] = rope;
  c["v_head_dim"] = v;
  c["n_routed_experts"] = experts;
  c["num_experts_per_tok"] = topk;
  c["bos_token_id"] = 1;
  c["eos_token_id"] = 2;
  return c;
}

}  // namespace

std::vector<ModelPreset> model_presets() {
  return {{"tiny", "3 layers, hidden 64, 8 experts top-2, vocab 4256 (Kimi-style specials from 4000), INT4 experts (the demo model, ~1.4 MB)"},
          {"small", "4 layers, hidden 256, 32 experts top-4, vocab 4096, INT4 experts (~6 MB)"},
          {"medium", "8 layers, hidden 1024, 64 experts top-8, vocab 32768, INT4 experts (~330 MB, the CPU benchmark)"},
          {"k2", "Kimi K2.5's exact text shape (61 layers, 384 experts, 594 GB): for `inspect --preset` only"}};
}

std::string preset_config_json(const std::string& name) {
  ojson c = k2_config();
  if (name == "tiny") {
    // Vocabulary laid out like Kimi's on a small scale: 4000 BPE ranks, then 256 special slots
    // ([BOS] = 4000, [EOS] = 4001, …) — the shape of tests/fixtures/tokenizer-kimi-small, which
    // the demo installs with --tokenizer.
    c = shrink(c, 4256, 64, 128, 32, 3, 4, 48, 32, 32, 16, 32, 8, 2);
    c["bos_token_id"] = 4000;
    c["eos_token_id"] = 4001;
  }
  else if (name == "small") c = shrink(c, 4096, 256, 768, 128, 4, 8, 128, 64, 32, 16, 32, 32, 4);
  else if (name == "medium") c = shrink(c, 32768, 1024, 2816, 256, 8, 8, 384, 256, 64, 32, 64, 64, 8);
  else if (name != "k2") {
    std::string names;
    for (const auto& p : model_presets()) names += cat(names.empty() ? "" : ", ", p.name);
    fail("unknown preset '", name, "' (presets: ", names, ")");
  }
  return c.dump(2) + "\n";
}

void make_model(const MakeModelOptions& opt) {
  std::string config_text;
  if (!opt.config_path.empty()) {
    config_text = read_text_file(opt.config_path, kMaxConfigBytes);
  } else {
    if (opt.preset == "k2") fail("preset 'k2' is 594 GB: use it with `kdtree inspect --preset k2`, or pass a smaller --config");
    config_text = preset_config_json(opt.preset);
  }
  const ModelConfig cfg = parse_model_config(config_text, opt.config_path.empty() ? "preset " + opt.preset : opt.config_path);
  if (opt.shards < 1 || opt.shards > 99999) fail("--shards must be in [1, 99999], got ", opt.shards);

  if (fs::exists(opt.out_dir) && !fs::is_empty(opt.out_dir) && !opt.force)
    fail(opt.out_dir, ": exists and is not empty (pass --force to overwrite)");
  fs::create_directories(opt.out_dir);
  {
    std::ofstream f(opt.out_dir + "/config.json", std::ios::binary);
    f << config_text;
    if (!f) fail(opt.out_dir, "/config.json: write failed");
  }

  const std::vector<PlannedTensor> plan = plan_tensors(cfg);
  const int32_t group = cfg.quant.group_size;
  uint64_t total = 0;
  for (const auto& t : plan) total += t.bytes(group);
  const uint64_t per_shard = total / uint64_t(opt.shards) + 1;
  if (size_t(opt.shards) > plan.size())
    fail("--shards ", opt.shards, " exceeds the ", plan.size(), " tensors of this model: every shard must hold one");

  std::vector<SafetensorsWriter> writers(size_t(opt.shards));
  std::vector<size_t> shard_of;  // [plan.size()]
  uint64_t acc = 0;
  for (const auto& t : plan) {
    // By bytes, but never skipping a shard and leaving enough tensors for the shards after it.
    size_t shard = std::min<size_t>(size_t(acc / per_shard), writers.size() - 1);
    const size_t n_left = plan.size() - shard_of.size();
    if (!shard_of.empty()) shard = std::clamp(shard, shard_of.back(), shard_of.back() + 1);
    shard = std::max(shard, writers.size() > n_left ? writers.size() - n_left : size_t(0));
    acc += t.bytes(group);
    SafetensorsWriter& w = writers[shard];
    const uint64_t seed = hash_name(t.name, opt.seed);
    if (t.int4) {
      const int64_t rows = t.shape[0], cols = t.shape[1], words = (cols + 7) / 8;
      // The packed words and scales come from one quantisation pass; cache it for the second fill.
      auto cache = std::make_shared<std::vector<uint16_t>>();
      w.add(t.name + ".weight_packed", DType::I32, {rows, words}, [=](uint8_t* dst, uint64_t) {
        Rng rng{seed};
        const float stdev = float(1.0 / std::sqrt(double(cols)));
        std::vector<float> row(static_cast<size_t>(cols));
        std::vector<int8_t> q(static_cast<size_t>(cols));
        cache->resize(static_cast<size_t>(rows * (cols / group)));
        for (int64_t r = 0; r < rows; ++r) {
          for (auto& x : row) x = rng.normal() * stdev;
          quantize_int4_row(row.data(), cols, group, q.data(), cache->data() + r * (cols / group));
          pack_int4_row(q.data(), cols, reinterpret_cast<uint32_t*>(dst) + r * words);
        }
      });
      w.add(t.name + ".weight_scale", DType::BF16, {rows, cols / group},
            [cache](uint8_t* dst, uint64_t n) { std::memcpy(dst, cache->data(), n); cache->clear(); cache->shrink_to_fit(); });
      const int32_t shape[2] = {int32_t(rows), int32_t(cols)};
      w.add(t.name + ".weight_shape", DType::I32, {2}, [shape](uint8_t* dst, uint64_t n) { std::memcpy(dst, shape, n); });
    } else if (t.fp32) {
      w.add(t.name, DType::F32, t.shape, [=](uint8_t* dst, uint64_t n) {
        Rng rng{seed};
        float* f = reinterpret_cast<float*>(dst);
        for (uint64_t i = 0; i < n / 4; ++i) f[i] = rng.normal() * 0.05f;
      });
    } else {
      const bool norm = t.role == TensorRole::norm;
      const float stdev = norm ? 0.05f : t.role == TensorRole::embed ? 1.0f : float(1.0 / std::sqrt(double(t.shape.back())));
      w.add(t.name, DType::BF16, t.shape, [=](uint8_t* dst, uint64_t n) {
        Rng rng{seed};
        uint16_t* h = reinterpret_cast<uint16_t*>(dst);
        for (uint64_t i = 0; i < n / 2; ++i) h[i] = f32_to_bf16((norm ? 1.0f : 0.0f) + rng.normal() * stdev);
      });
    }
    shard_of.push_back(shard);
  }

  Progress progress("writing " + opt.out_dir, total, "B");
  auto shard_name = [&](size_t i) {
    if (opt.shards == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05d.safetensors", i + 1, opt.shards);
    return std::string(buf);
  };
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t i = 0; i < writers.size(); ++i) {
    writers[i].set_metadata("format", "pt");
    writers[i].write(opt.out_dir + "/" + shard_name(i), [&](uint64_t n) { progress.add(n); });
  }
  progress.finish();
  if (!opt.tokenizer_dir.empty()) {
    // Install a tokenizer beside the weights (a checkpoint directory holds both), after checking
    // that every id it can produce exists in the model.
    const auto t = load_tokenizer(opt.tokenizer_dir);
    if (t->vocab_size() > cfg.vocab_size)
      fail(opt.tokenizer_dir, ": the tokenizer has ", t->vocab_size(), " ids, more than the model's vocab_size ", cfg.vocab_size);
    int copied = 0;
    for (const char* f : {"tiktoken.model", "tokenizer_config.json", "tokenizer.json"})
      if (fs::exists(opt.tokenizer_dir + "/" + f)) {
        fs::copy_file(opt.tokenizer_dir + "/" + f, opt.out_dir + "/" + f, fs::copy_options::overwrite_existing);
        ++copied;
      }
    log_debug("copied ", copied, " tokenizer files from ", opt.tokenizer_dir);
  }
  if (opt.shards > 1) {
    for (size_t i = 0; i < plan.size(); ++i) {
      const PlannedTensor& t = plan[i];
      const size_t shard = shard_of[i];
      if (t.int4) {
        for (const char* suffix : {".weight_packed", ".weight_scale", ".weight_shape"}) weight_map[t.name + suffix] = shard_name(shard);
      } else {
        weight_map[t.name] = shard_name(shard);
      }
    }
    ojson index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream f(opt.out_dir + "/model.safetensors.index.json", std::ios::binary);
    f << index.dump(2) << "\n";
    if (!f) fail(opt.out_dir, "/model.safetensors.index.json: write failed");
  }
}

}  // namespace kd
