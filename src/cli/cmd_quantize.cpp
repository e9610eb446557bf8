// `kdtree quantize`: bf16 checkpoint → compressed-tensors pack-quantized INT4 (model/quantize.h).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/quality_commands.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "core/log.h"
#include "model/quantize.h"

namespace kd::cli {

void add_quantize(CLI::App& app, QuantizeCliOptions& o) {
  auto* c = app.add_subcommand(
      "quantize",
      "Write a bf16 checkpoint as compressed-tensors pack-quantized INT4 (symmetric, group-wise; Kimi K2's format)");
  c->add_option("-m,--model", o.model, "bf16 checkpoint directory (config.json + *.safetensors)")->required();
  c->add_option("-o,--output", o.output, "Output directory (created; must be empty or absent)")->required();
  c->add_option("--group", o.group, "Group size along the input dim (32 as Kimi ships; 128 is the common alternative)")
      ->transform(whole_number(o.group))
      ->check(CLI::Range(8, 65536));
  c->add_option("--ignore", o.ignore,
                "Modules to keep in bf16, compressed-tensors syntax: an exact module name or re:REGEX (Python re.match "
                "at the name's start). Repeatable; replaces the default, Kimi's list: lm_head, re:.*self_attn.*, "
                "re:.*shared_experts.*, re:.*mlp\\.(gate|up|gate_up|down)_proj.* (only the routed experts become INT4)");
  c->add_option("--max-shard-size", o.max_shard_size,
                "Largest output shard: bytes, or with a unit KB/MB/GB (powers of 1000, as transformers' max_shard_size) or "
                "KiB/MiB/GiB; default 5GB; one shard is written as model.safetensors, more get an index");
  c->add_flag("--json", o.json, "Print one JSON object (counts, bytes, GB/s, shards) on stdout");
}

namespace {

uint64_t parse_size(const std::string& s) {
  size_t used = 0;
  unsigned long long v = 0;
  try {
    if (s.empty() || s[0] < '0' || s[0] > '9') throw std::invalid_argument(s);
    v = std::stoull(s, &used, 10);
  } catch (const std::exception&) {
    fail("--max-shard-size '", s, "': expected a size such as 5GB, 500MB or 1048576");
  }
  const std::string unit = s.substr(used);
  const std::pair<const char*, uint64_t> units[] = {{"", 1},          {"B", 1},          {"KB", 1000},      {"MB", 1000000},
                                                    {"GB", 1000000000}, {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}};
  for (const auto& [name, mult] : units)
    if (unit == name) {
      if (v > UINT64_MAX / mult) fail("--max-shard-size '", s, "' is too large");
      return v * mult;
    }
  fail("--max-shard-size '", s, "': unknown unit '", unit, "' (use B, KB, MB, GB, KiB, MiB or GiB)");
}

}  // namespace

int cmd_quantize(const QuantizeCliOptions& o) {
  QuantizeOptions q;
  q.model_dir = o.model;
  q.out_dir = o.output;
  q.group = o.group;
  q.ignore = o.ignore;
  q.ignore_given = !o.ignore.empty();
  q.max_shard_bytes = parse_size(o.max_shard_size);
  const QuantizeResult r = quantize_checkpoint(q);
  const double gbps_in = r.seconds > 0 ? double(r.bytes_in) / r.seconds / 1e9 : 0;
  const double gbps_out = r.seconds > 0 ? double(r.bytes_out) / r.seconds / 1e9 : 0;
  if (o.json) {
    nlohmann::ordered_json j = {{"output", o.output},           {"group_size", o.group},
                                {"quantized_modules", r.n_quantized}, {"copied_tensors", r.n_copied},
                                {"other_files", r.n_other_files},  {"shards", r.shard_names},
                                {"bytes_in", r.bytes_in},          {"bytes_out", r.bytes_out},
                                {"seconds", r.seconds},            {"read_gb_per_s", gbps_in},
                                {"write_gb_per_s", gbps_out}};
    std::printf("%s\n", j.dump().c_str());
  }
  log_info("quantize: ", r.n_quantized, " modules to INT4 g", o.group, ", ", r.n_copied, " tensors copied, ", r.n_other_files,
           " other files; ", double(r.bytes_in) / 1e9, " GB read → ", double(r.bytes_out) / 1e9, " GB in ", r.n_shards,
           " shard(s), ", r.seconds, " s (", gbps_in, " GB/s read, ", gbps_out, " GB/s written)");
  return 0;
}

}  // namespace kd::cli
