// libFuzzer target: model.safetensors.index.json, as the target's Checkpoint reads it (k25-sharded:
// config.json and three shards copied into a scratch directory) and as DFlashDrafter reads its own
// (dflash-rope's weights). Either the checkpoint opens with every listed tensor present in the shard
// the index names, or kd::Error — never a crash, an unbounded recursion, a path outside the
// directory or a library exception.
// Input: byte 0 bit 0 picks the reader (0: Checkpoint, 1: DFlashDrafter); the rest is the index as
// JSON text when it starts like it, else template mode (json_gen.h) over the fixture's index (and,
// for the drafter, an index naming its model.safetensors). The index is written, the directory
// opened, and nothing else changes between runs.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/log.h"
#include "fuzz_common.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/dflash.h"

namespace {

struct Fixture {
  kdfuzz::Templates target_index, drafter_index;
  kd::ModelConfig drafter_target;  // k2-bf16, which dflash-rope drafts for
  kdfuzz::ScratchDir scratch;
  std::string target_dir, drafter_dir;
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.target_index.add_text(kdfuzz::read_file(kdfuzz::source_path("tests/fixtures/k25-sharded/model.safetensors.index.json")));
    // The drafter has no published index: one naming every tensor of its single file.
    const std::string st = kdfuzz::read_file(kdfuzz::source_path("tests/fixtures/dflash-rope/model.safetensors"));
    const auto header = kdfuzz::ojson::parse(kdfuzz::safetensors_header_text(st));
    kdfuzz::ojson idx = {{"metadata", {{"total_size", st.size()}}}, {"weight_map", kdfuzz::ojson::object()}};
    for (auto it = header.begin(); it != header.end(); ++it)
      if (it.key() != "__metadata__") idx["weight_map"][it.key()] = "model.safetensors";
    x.drafter_index.add(idx);
    x.drafter_target = kd::parse_model_config(kdfuzz::read_file(kdfuzz::source_path("tests/fixtures/k2-bf16/config.json")), "k2-bf16");
    return x;
  }();
  static const bool populated = [] {
    kd::set_log_level(kd::LogLevel::quiet);  // no "mapping shards" progress line per run
    f.target_dir = f.scratch.populate("target", "tests/fixtures/k25-sharded",
                                      {"config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                       "model-00003-of-00003.safetensors"});
    f.drafter_dir = f.scratch.populate("drafter", "tests/fixtures/dflash-rope", {"config.json", "model.safetensors"});
    return true;
  }();
  (void)populated;
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Fixture& f = fixture();
  const bool drafter = data[0] & 1;
  const std::string text = kdfuzz::json_input(drafter ? f.drafter_index : f.target_index, data + 1, size - 1);
  const std::string& dir = drafter ? f.drafter_dir : f.target_dir;
  kdfuzz::write_file(dir + "/model.safetensors.index.json", text);
  try {
    if (drafter) {
      kd::DFlashDrafter d(dir, f.drafter_target);
      (void)d.weight_bytes();
    } else {
      kd::Checkpoint c(dir);
      for (const auto& [name, ref] : c.tensors())
        if (ref.info->name != name || ref.info->end > ref.file->file_size()) std::abort();
    }
  } catch (const kd::Error&) {
  }
  return 0;
}
