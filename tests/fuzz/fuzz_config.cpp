// libFuzzer target: config.json parsing must either produce a config whose derived quantities are
// finite and in range, or throw kd::Error.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "io/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    kd::ModelConfig c = kd::parse_model_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
    if (!std::isfinite(c.softmax_scale()) || c.latent_dim() <= 0) std::abort();
    for (float f : c.rope_inv_freq())
      if (!std::isfinite(f)) std::abort();
    (void)c.quant.is_quantized("model.layers.1.mlp.experts.0.gate_proj");
  } catch (const kd::Error&) {
  }
  return 0;
}
