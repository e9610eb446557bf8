// `kdtree quantize` and `kdtree ppl` (issue 19): options and entry points, declared apart from
// commands.h so the two quality commands stay in their own files (cmd_quantize.cpp, cmd_ppl.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace CLI { class App; }

namespace kd::cli {

struct QuantizeCliOptions {
  std::string model, output;
  int32_t group = 32;
  std::vector<std::string> ignore;
  std::string max_shard_size = "5GB";
  bool json = false;
};
void add_quantize(CLI::App& app, QuantizeCliOptions& o);
int cmd_quantize(const QuantizeCliOptions& o);

struct PplCliOptions {
  std::string model, file, device = "cpu", save_logits, kl_base, bos = "auto";
  int64_t ctx = 512, stride = 0, chunks = 0;
  int32_t top_k = 32;
  bool json = false;
};
void add_ppl(CLI::App& app, PplCliOptions& o);
int cmd_ppl(const PplCliOptions& o);

}  // namespace kd::cli
