// `kdtree make-model`: write a random model in the real checkpoint format.
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/int_flag.h"
#include "core/log.h"
#include "model/dflash.h"
#include "model/make_drafter.h"

namespace kd::cli {

void add_make_model(CLI::App& app, MakeModelOptions& o) {
  std::string presets;
  for (const auto& p : model_presets()) presets += "\n  " + p.name + ": " + p.description;
  auto* c = app.add_subcommand("make-model", "Write a random model (config.json + bf16/INT4 safetensors) in the published format");
  auto* p = c->add_option("--preset", o.preset, "Shape to write:" + presets);
  auto* f = c->add_option("--config", o.config_path, "Follow this config.json instead of a preset");
  auto* d = c->add_option("--drafter-for", o.drafter_for,
                          "Write a random DFlash drafter (published DFlashDraftModel format) for this target directory");
  p->excludes(f);
  d->excludes(p, f);
  c->add_option("--draft-layers", o.draft_layers, "Drafter layers (with --drafter-for)")
      ->transform(whole_number(o.draft_layers))
      ->check(CLI::Range(1, 64));
  c->add_option("--block-size", o.block_size, "Drafter block size (with --drafter-for)")
      ->transform(whole_number(o.block_size))
      ->check(CLI::Range(2, int(kMaxDFlashBlockSize)));
  c->add_option("-o,--out", o.out_dir, "Output directory")->required();
  c->add_option("--tokenizer", o.tokenizer_dir,
                 "Install this directory's tokenizer (tiktoken.model + tokenizer_config.json, or tokenizer.json) in the model");
  c->add_option("-s,--seed", o.seed, "Seed of the random weights in [0, 2^64 − 1] (same seed → same bytes)")
      ->transform(whole_number(o.seed));
  c->add_option("--shards", o.shards, "Split into this many .safetensors files with an index")
      ->transform(whole_number(o.shards))
      ->check(CLI::Range(1, 99999));
  c->add_flag("--force", o.force, "Overwrite a non-empty output directory");
}

int cmd_make_model(const MakeModelOptions& o) {
  const double t0 = now_s();
  if (!o.drafter_for.empty()) {
    make_drafter(o.drafter_for, o.out_dir, o.seed, o.draft_layers, o.block_size, o.force);
    log_info("wrote drafter ", o.out_dir, " in ", (now_s() - t0), " s");
    return 0;
  }
  if (o.preset.empty() && o.config_path.empty()) fail("make-model needs --preset NAME, --config FILE or --drafter-for DIR");
  make_model(o);
  log_info("wrote ", o.out_dir, " in ", (now_s() - t0), " s");
  return 0;
}

}  // namespace kd::cli
