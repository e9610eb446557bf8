// `kdtree quantize`: a bf16 checkpoint directory → compressed-tensors pack-quantized INT4
// (symmetric, group-wise along the input dim; SPEC-MODEL.md §3), the format Kimi K2-Thinking / K2.5
// ship. The bytes are compressed-tensors 0.20.1's own: the scale rule of
// `quantization.utils.helpers.calculate_qparams` and the quantiser of
// `quantization.lifecycle.forward_helpers._quantize` in bf16 arithmetic, packed by
// `pack_to_int32`, written in the tensor order `safetensors.torch.save_file` uses
// (python/make_quality_fixtures.py checks them byte for byte).
//
// Streaming: tensors are read from the input's mmap and written one at a time, so memory is one
// tensor (the largest, usually the embedding), never the model.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/regex.h"
#include "core/dtype.h"

namespace kd {

// compressed-tensors' symmetric INT4 rule for one bf16 row in groups of `group` along cols
// (cols % group == 0): absmax over the group, scale = bf16(absmax / 7.5) — (bit_max − bit_min) / 2
// with the range [−8, 7] — a zero scale replaced by bf16's eps 2^−7; q = round_half_even(clamp(
// bf16(w / scale), −8, 7)). Division and clamp are bf16 ops in torch, so the quotient is rounded to
// bf16 before it is rounded to an integer. NaN / inf weights are the caller's to refuse.
// w: [cols] bf16 bits; q: [cols]; scales: [cols / group] bf16 bits.
void ct_quantize_row_bf16(const uint16_t* w, int64_t cols, int32_t group, int8_t* q, uint16_t* scales);

// compressed-tensors' ignore list syntax (utils/match.py match_name): "re:REGEX" is Python's
// re.match at the start of the module name; anything else is one exact module name. Names that
// look like globs or regexes without "re:" are refused (they would silently match nothing), and so
// are class names (compressed-tensors also matches "Linear"-style classes; kdtree knows no classes).
class IgnoreList {
 public:
  IgnoreList() = default;
  explicit IgnoreList(std::vector<std::string> patterns);  // throws kd::Error naming the bad pattern
  bool matches(const std::string& module) const;
  // Patterns (exact names or "re:" entries) that match none of `modules`.
  std::vector<std::string> unmatched(const std::vector<std::string>& modules) const;
  const std::vector<std::string>& patterns() const { return patterns_; }

 private:
  std::vector<std::string> patterns_;
  std::vector<std::string> exact_;
  std::vector<std::pair<std::string, Regex>> re_;  // (pattern as given, compiled)
};

// Kimi K2-Thinking / K2.5's ignore list: everything but the routed experts stays bf16.
std::vector<std::string> kimi_ignore_list();

// Whether a tensor is the weight of a Linear module (what compressed-tensors' targets ["Linear"]
// select in HF's DeepseekV3): `*_proj.weight`, `kv_a_proj_with_mqa.weight` and `lm_head.weight`,
// 2-D, under the language model. The router (`mlp.gate`, a plain Parameter in HF), embeddings and
// norms are not Linear. `text_prefix` is "model." or "language_model.model.".
bool is_linear_weight(const std::string& tensor, const std::vector<int64_t>& shape, const std::string& text_prefix);

// The safetensors library's order within a file: dtype rank descending (U64, I64, F64, F32, I32,
// BF16, F16, I16, F8, I8, U8, BOOL), then name bytewise.
bool safetensors_order_less(DType a, const std::string& na, DType b, const std::string& nb);

struct QuantizeOptions {
  std::string model_dir, out_dir;
  int32_t group = 32;
  std::vector<std::string> ignore;  // empty: kimi_ignore_list()
  bool ignore_given = false;        // user patterns must each match some Linear module
  uint64_t max_shard_bytes = 5000000000;  // transformers' "5GB"
};

struct QuantizeResult {
  int64_t n_quantized = 0, n_copied = 0, n_shards = 0, n_other_files = 0;
  uint64_t bytes_in = 0, bytes_out = 0;  // tensor data read / written
  double seconds = 0;
  std::vector<std::string> shard_names;
};

// Validates the whole input first (config, every tensor the model needs with its dtype and shape,
// every quantised weight bf16 and finite-sized, the output directory absent or empty), then writes
// OUT_DIR: the shards (model.safetensors, or model-0000i-of-0000n.safetensors + index), config.json
// with the quantization_config, and every other file of the input copied byte for byte.
QuantizeResult quantize_checkpoint(const QuantizeOptions& o);

// The quantization_config block (compressed-tensors' QuantizationConfig.model_dump layout with
// sorted keys, as Kimi's config.json has it) for a group size and ignore list.
std::string quantization_config_json(int32_t group, const std::vector<std::string>& ignore);

}  // namespace kd
