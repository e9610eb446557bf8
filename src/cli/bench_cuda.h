// The GPU benchmarks' shared setup (cmd_bench_cuda.cpp, cmd_bench_serve.cpp; CUDA builds only).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// Timed paths over the target's single sequence (cli/bench_cuda_timing.cpp): the same forward
// pieces the decode loop runs, timed with CUDA events, logits kept on the device.
double timed_prefill_ms(CudaTarget& t, const std::vector<int32_t>& prompt);  // resets, then one forward over the prompt
// n greedy decode steps after the cache's contents, the argmax fed back on the device (no host
// round-trip); per-step milliseconds. graph: each step replays one captured CUDA graph.
std::vector<double> timed_decode_ms(CudaTarget& t, int32_t first_token, int64_t steps, bool graph);
// One uncommitted verify forward over a tree (ids, positions, visibility as ForwardArgs), all
// logits on the device; milliseconds. distinct_experts (optional): per MoE layer, experts touched.
// graph: replayed as a DDTree round replays it (one captured graph per tree size); else launched
// kernel by kernel. Inside an NVTX range "verify N graph|launches" (N = nodes, root excluded).
double timed_verify_ms(CudaTarget& t, const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                       const std::vector<uint8_t>& visibility, std::vector<int32_t>* distinct_experts, bool graph);
// One tensor-parallel reduction of rows × row_len fp32 among `ranks` ranks sharing this GPU
// (SharedDeviceComm: two host barriers a call, then the rank-order sum): microseconds a call, mean of
// `calls` back to back on rank 0's stream.
double timed_reduction_us(int32_t ranks, int64_t rows, int64_t row_len, int64_t calls);
double measure_read_gbps();   // streaming read bandwidth of the device, GB/s (median of 10)
double measure_mma_tflops();  // mma.sync bf16 m16n8k16 rate, register operands, TFLOP/s (median of 10)
// What a kernel boundary costs inside a CUDA graph: a chain of 256 dependent 1-block kernels (and of
// 132-block ones), µs a kernel, with the launch overlap off and on (cuda::measure_kernel_chain);
// `stale` > 0 means a kernel ran before the one it depends on (an error the bench reports).
struct KernelChainFigures {
  double serial_1 = 0, overlap_1 = 0, serial_wide = 0, overlap_wide = 0;
  int wide_blocks = 0;
  int64_t stale = 0;
  bool overlap = false;  // the device has it
  int forward_mode = 0;  // KDTREE_CUDA_PDL as the forward uses it
};
KernelChainFigures measure_kernel_chain();

}  // namespace kd::cli
