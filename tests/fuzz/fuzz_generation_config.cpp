// libFuzzer target: generation_config.json, read twice by kdtree — by the Checkpoint (extra
// eos_token_id stop ids, checked against the vocabulary) and by the server's load_generation_defaults
// (sampling defaults, validated like request fields). Each either succeeds with ids in range and
// sampling values that validate, or throws kd::Error — never a crash (issue 21: a nested
// eos_token_id reached a dump()), an out-of-range float-to-int conversion or a library exception.
// The file is written into a scratch copy of tests/fixtures/k2-int4 (config.json, model.safetensors).
// Input: JSON text as is (first byte '{', '[', '"' or whitespace), or else template mode (json_gen.h)
// over tests/fuzz/shapes/generation_config-*.json (Kimi's stop id, DeepSeek's sampling defaults,
// do_sample false).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/log.h"
#include "fuzz_common.h"
#include "io/checkpoint.h"
#include "server/prepare.h"

namespace {

struct Fixture {
  kdfuzz::Templates templates;
  kdfuzz::ScratchDir scratch;
  std::string dir;
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    for (const char* s : {"kimi", "deepseek", "greedy"})
      x.templates.add_text(kdfuzz::read_file(kdfuzz::source_path(std::string("tests/fuzz/shapes/generation_config-") + s + ".json")));
    return x;
  }();
  static const bool populated = [] {
    kd::set_log_level(kd::LogLevel::quiet);
    f.dir = f.scratch.populate("ckpt", "tests/fixtures/k2-int4", {"config.json", "model.safetensors"});
    return true;
  }();
  (void)populated;
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = fixture();
  kdfuzz::write_file(f.dir + "/generation_config.json", kdfuzz::json_input(f.templates, data, size));
  try {
    kd::Checkpoint c(f.dir);
    for (int32_t id : c.config().eos_token_ids)
      if (id < 0 || id >= c.config().vocab_size) std::abort();
  } catch (const kd::Error&) {
  }
  try {
    const kd::GenerationDefaults d = kd::load_generation_defaults(f.dir);
    for (const auto& v : {d.temperature, d.top_p, d.min_p})
      if (v && !std::isfinite(*v)) std::abort();
  } catch (const kd::Error&) {
  }
  return 0;
}
