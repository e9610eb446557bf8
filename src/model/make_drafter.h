// `make_drafter`: a random DFlash drafter (SPEC-DDTREE.md §1 "Checkpoint format") for a target
// checkpoint, in the published layout (config.json + bf16 model.safetensors), for tests, the demo
// and benchmarks of the speculative loop before a trained drafter is at hand.
#pragma once
#include <cstdint>
#include <string>

namespace kd {

// Writes the drafter to out_dir (refuses a non-empty out_dir unless force). Shape:
// - hidden and vocab from the target; num_target_layers = the target's layers;
// - target_layer_ids = default_target_layer_ids(N, k) with k = min(num_layers, N) taps: z-lab's
//   default takes one tap per draft layer (Kimi-K2.5-DFlash: 6 layers, 6 taps); a target shallower
//   than the drafter cannot offer that many distinct taps, so k is capped at N;
// - mask_token_id = vocab − 2 (Kimi-K2.5-DFlash uses 163838 = 163840 − 2);
// - a 7168-wide target gets Kimi-K2.5-DFlash's attention and MLP (64 Q / 8 KV heads, head_dim 128,
//   intermediate 18432); others get the largest head_dim in {128, 64, …, 2} that divides hidden
//   and leaves at least 4 heads (fewer only when hidden < 8), hidden/head_dim Q heads, KV heads a
//   quarter of those from 8 heads up (Qwen3-8B-DFlash: 32/8) and half below, intermediate 3·hidden;
// - rope_theta, max_position_embeddings, rms_norm_eps and the YaRN rope_scaling (when the target has
//   one) copied from the target, mscale and mscale_all_dim written out, so the drafter's YaRN
//   amplitude is their ratio (dflash.h; 1.0 for the K2 preset's 1 and 1).
// Every tensor is bf16 and depends only on (seed, its name). Reloads the result as a check.
void make_drafter(const std::string& target_dir, const std::string& out_dir, uint64_t seed, int32_t num_layers,
                  int32_t block_size, bool force);

}  // namespace kd
