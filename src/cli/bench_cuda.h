// The GPU benchmarks' shared setup (cmd_bench_cuda.cpp, cmd_bench_serve.cpp; CUDA builds only).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/deepseek_v3_cuda.h"
#include "cli/commands.h"

namespace kd::cli {

struct BenchTarget {
  std::unique_ptr<CudaTarget> target;
  std::string label;  // what the tables print as the model
};

// Checks -m / --preset and the device, then uploads the checkpoint or makes PERF.md's k2-slice
// (K2's exact shapes, 1 dense + 11 MoE layers, INT4 g32 experts, random weights made on the GPU);
// the single-sequence cache holds max_tokens rows. `what` names the command in errors.
BenchTarget load_bench_target(const BenchOptions& o, int64_t max_tokens, const char* what);

}  // namespace kd::cli
