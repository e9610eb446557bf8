// libFuzzer target: a DFlash drafter's config.json (parse_dflash_config, check_fits_target against
// the k2-bf16 fixture's config, then the whole DFlashDrafter load from a scratch directory holding
// the fixture drafter's weights). Each either succeeds with finite RoPE frequencies and a sane
// block size, or throws kd::Error — never a crash (issue 21: nesting in architectures /
// target_layer_ids / attention_bias reached a dump()), an unbounded recursion or a library exception.
// Input: JSON text as is (first byte '{', '[', '"' or whitespace), or else template mode (json_gen.h)
// over tests/fixtures/dflash-rope and dflash-yarn config.json (plain RoPE and YaRN).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "fuzz_common.h"
#include "io/config.h"
#include "model/dflash.h"

namespace {

const char* const kDrafters[] = {"dflash-rope", "dflash-yarn"};

struct Fixture {
  kdfuzz::Templates templates;
  kd::ModelConfig target;
  kdfuzz::ScratchDir scratch;
  std::string dirs[2];
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    for (const char* d : kDrafters) x.templates.add_text(kdfuzz::read_file(kdfuzz::source_path(std::string("tests/fixtures/") + d + "/config.json")));
    x.target = kd::parse_model_config(kdfuzz::read_file(kdfuzz::source_path("tests/fixtures/k2-bf16/config.json")), "k2-bf16/config.json");
    return x;
  }();
  static const bool populated = [] {
    for (int i = 0; i < 2; ++i) f.dirs[i] = f.scratch.populate(kDrafters[i], std::string("tests/fixtures/") + kDrafters[i], {"model.safetensors"});
    return true;
  }();
  (void)populated;
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = fixture();
  const std::string text = kdfuzz::json_input(f.templates, data, size);
  kd::DFlashConfig c;
  try {
    c = kd::parse_dflash_config(text, "fuzz/config.json");
    for (float x : c.rope_inv_freq())
      if (!std::isfinite(x)) std::abort();
    if (c.block_size < 2 || !std::isfinite(c.rope_attention_factor)) std::abort();
    kd::check_fits_target(c, f.target, "fuzz/config.json");
  } catch (const kd::Error&) {
    return 0;
  }
  // It fits the target: the full load, which also walks the weights against the config's shapes.
  const std::string& dir = f.dirs[size > 0 && !kdfuzz::looks_like_json_text(data, size) ? data[0] % 2 : 0];
  kdfuzz::write_file(dir + "/config.json", text);
  try {
    kd::DFlashDrafter d(dir, f.target);
    if (d.config().block_size != c.block_size) std::abort();
  } catch (const kd::Error&) {
  }
  return 0;
}
