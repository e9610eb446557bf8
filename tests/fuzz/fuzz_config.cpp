// libFuzzer target: config.json parsing (parse_model_config) must either produce a config whose
// derived quantities are finite and in range, or throw kd::Error — never crash, recurse without bound
// (issue 21: nesting in hidden_size / eos_token_id reached a dump() in the error message) or let a
// library exception escape.
// Input: JSON text as is (first byte '{', '[', '"' or whitespace: the seeds and the fixtures), or
// else template mode (json_gen.h) over the fixtures' config.json files (DeepSeek-V3, Kimi K2 bf16 and
// INT4 with a quantization_config, K2.5's text_config wrapper).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "fuzz_common.h"
#include "io/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kdfuzz::Templates templates = [] {
    kdfuzz::Templates t;
    for (const char* d : {"k2-int4", "k2-bf16", "dsv3-group", "k25-sharded"})
      t.add_text(kdfuzz::read_file(kdfuzz::source_path(std::string("tests/fixtures/") + d + "/config.json")));
    return t;
  }();
  const std::string text = kdfuzz::json_input(templates, data, size);
  try {
    kd::ModelConfig c = kd::parse_model_config(text, "fuzz/config.json");
    if (!std::isfinite(c.softmax_scale()) || c.latent_dim() <= 0) std::abort();
    if (!std::isfinite(c.rope_attention_scaling())) std::abort();
    for (float f : c.rope_inv_freq())
      if (!std::isfinite(f)) std::abort();
    (void)c.quant.is_quantized("model.layers.1.mlp.experts.0.gate_proj");
  } catch (const kd::Error&) {
  }
  return 0;
}
