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

}  // namespace kd::cli
