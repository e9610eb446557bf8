// The GPU benchmarks' timed paths (DESIGN.md §3: bench timing lives in the CLI, not the backend):
// the target's own forward pieces driven with CUDA events around them, logits kept on the device.
// Only `kdtree bench --device cuda` uses them; the decode loop never does.
#ifdef KDTREE_HAVE_CUDA
#include "model/deepseek_v3_cuda_impl.h"

#include <string>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "backend/cuda/device_comm.h"
#include "cli/bench_cuda.h"
#include "core/error.h"
#include "core/log.h"

namespace kd::cli {

using cuda::check;

double timed_reduction_us(int32_t ranks, int64_t rows, int64_t row_len, int64_t calls) {
  double us = 0;
  run_device_ranks(ranks, [&](DeviceComm& c, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    void* mem = nullptr;
    cuda::check(cudaMalloc(&mem, size_t(rows * row_len) * 4), "reduction buffer");
    float* buf = static_cast<float*>(mem);
    cuda::check(cudaMemsetAsync(buf, 0, size_t(rows * row_len) * 4, s), "memset");
    for (int64_t i = 0; i < 10; ++i) c.all_reduce_sum(buf, rows, row_len, stream);  // warm-up
    cuda::check(cudaStreamSynchronize(s), "sync");
    const double t0 = now_s();
    for (int64_t i = 0; i < calls; ++i) c.all_reduce_sum(buf, rows, row_len, stream);
    cuda::check(cudaStreamSynchronize(s), "sync");
    if (c.rank() == 0) us = (now_s() - t0) * 1e6 / double(calls);
    cudaFree(buf);
  });
  return us;
}

double measure_read_gbps() { return cuda::measure_read_gbps(int64_t(4) << 30, 10); }
double measure_mma_tflops() { return cuda::measure_mma_tflops(10); }
KernelChainFigures measure_kernel_chain() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  const cuda::ChainTiming one = cuda::measure_kernel_chain(256, 1, 20), wide = cuda::measure_kernel_chain(256, sms, 20);
  KernelChainFigures f;
  f.serial_1 = one.us_per_kernel_serial;
  f.overlap_1 = one.us_per_kernel_overlap;
  f.serial_wide = wide.us_per_kernel_serial;
  f.overlap_wide = wide.us_per_kernel_overlap;
  f.wide_blocks = sms;
  f.stale = one.stale + wide.stale;
  f.overlap = one.overlap_available;
  f.forward_mode = cuda::pdl_mode();
  return f;
}

namespace {

double elapsed_ms(CudaTarget::Impl& m) {
  float ms = 0;
  check(cudaEventSynchronize(m.ev1), "cudaEventSynchronize");
  check(cudaEventElapsedTime(&ms, m.ev0, m.ev1), "cudaEventElapsedTime");
  return double(ms);
}

// One AR step on the device alone: n = 1, causal, inputs and start there; the argmax becomes the next id.
void decode_step(CudaTarget::Impl& m) {
  // n = 1: in = [id | position | cnt | start | tab | wrow | base | voff | logit row | vis | table];
  // one contiguous block, so the new row's cache row is its position.
  int32_t* start = m.in + 3;
  cuda::single_step_setup(m.in + 1, m.in + 2, m.in + 5, start, m.stream);
  m.run(1, 1, m.cap, 1, nullptr, nullptr);
  cuda::argmax_rows(m.logits, 1, m.cfg.vocab_size, m.in, m.stream);  // the next step's token, on the device
  cuda::advance(start, 1, m.stream);
}


}  // namespace

double timed_prefill_ms(CudaTarget& t, const std::vector<int32_t>& prompt) {
  CudaTarget::Impl& m = t.impl();
  m.size = 0;
  const int64_t n = int64_t(prompt.size());
  m.upload_own(prompt.data(), n, nullptr, nullptr, false, true, false);
  check(cudaStreamSynchronize(m.stream), "upload");
  // `ncu --nvtx --nvtx-include "prefill #1/"` profiles exactly one prefill (the k-th call of the process: "#k").
  static int calls = 0;
  const std::string range = "prefill #" + std::to_string(++calls);
  nvtxRangePushA(range.c_str());
  check(cudaEventRecord(m.ev0, m.stream), "cudaEventRecord");
  m.run(n, m.staged_vis, n, 1, nullptr, nullptr);
  check(cudaEventRecord(m.ev1, m.stream), "cudaEventRecord");
  const double ms = elapsed_ms(m);
  nvtxRangePop();
  m.size = n;
  return ms;
}



std::vector<double> timed_decode_ms(CudaTarget& t, int32_t first_token, int64_t steps, bool graph) {
  CudaTarget::Impl& m = t.impl();
  if (m.size + steps > m.cap) fail("decode benchmark: ", m.size, " + ", steps, " rows exceed the cache (", m.cap, ")");
  // The graphed layout (vcap = n² = 1 visible-list slot before the block table), which decode_step's run(1, 1, …)
  // reads; a causal row leaves its slot unused.
  m.upload_own(&first_token, 1, nullptr, nullptr, false, true, /*graphed=*/true);
  check(cudaStreamSynchronize(m.stream), "upload token");
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    // The whole step (≈ 20 kernels a layer) as one graph: the launch gaps go, the work stays.
    check(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    decode_step(m);
    check(cudaStreamEndCapture(m.stream, &g), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
  }
  std::vector<cudaEvent_t> ev(static_cast<size_t>(steps + 1));
  for (auto& e : ev) check(cudaEventCreate(&e), "cudaEventCreate");
  // `ncu --nvtx --nvtx-include "decode graph/"` profiles the timed steps only.
  nvtxRangePushA(graph ? "decode graph" : "decode launches");
  check(cudaEventRecord(ev[0], m.stream), "cudaEventRecord");
  for (int64_t i = 0; i < steps; ++i) {
    if (graph)
      check(cudaGraphLaunch(exec, m.stream), "cudaGraphLaunch");
    else
      decode_step(m);
    check(cudaEventRecord(ev[size_t(i + 1)], m.stream), "cudaEventRecord");
  }
  check(cudaStreamSynchronize(m.stream), "decode");
  nvtxRangePop();
  m.size += steps;
  std::vector<double> ms;
  for (int64_t i = 0; i < steps; ++i) {
    float step_ms = 0;
    check(cudaEventElapsedTime(&step_ms, ev[size_t(i)], ev[size_t(i + 1)]), "cudaEventElapsedTime");
    ms.push_back(double(step_ms));
  }
  for (auto& e : ev) cudaEventDestroy(e);
  if (exec) cudaGraphExecDestroy(exec);
  if (g) cudaGraphDestroy(g);
  int32_t last = 0;
  check(cudaMemcpy(&last, m.in, 4, cudaMemcpyDeviceToHost), "download token");
  if (last < 0) fail("decode benchmark: the logits held a NaN");
  return ms;
}

double timed_verify_ms(CudaTarget& t, const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                                   const std::vector<uint8_t>& visibility, std::vector<int32_t>* distinct, bool graph) {
  CudaTarget::Impl& m = t.impl();
  const int64_t n = int64_t(ids.size());
  if (int64_t(positions.size()) != n || int64_t(visibility.size()) != n * n) fail("verify benchmark: inconsistent tree arrays");
  const int64_t start = m.upload_own(ids.data(), n, positions.data(), visibility.data(), true, true, graph);
  check(cudaStreamSynchronize(m.stream), "upload");
  // graph: the path a DDTree round takes (forward_seqs → run_graphed, one graph per tree size): the
  // shape's first forward launches, its second is captured; both happen here, untimed, on the
  // shape's first call only (a key list beyond the kernel's bound never captures: two launches).
  if (graph)
    for (int warm = 0; warm < 2 && !m.graph_captured(n, n); ++warm) m.run_graphed(n, start + n, n, nullptr, nullptr);
  const std::string range = "verify " + std::to_string(n - 1) + (graph ? " graph" : " launches");
  nvtxRangePushA(range.c_str());  // `ncu --nvtx --nvtx-include "verify 16 graph/"` profiles one shape
  check(cudaEventRecord(m.ev0, m.stream), "cudaEventRecord");
  if (graph)
    m.run_graphed(n, start + n, n, nullptr, nullptr);
  else
    m.run(n, m.staged_vis, start + n, n, nullptr, nullptr);
  check(cudaEventRecord(m.ev1, m.stream), "cudaEventRecord");
  const double ms = elapsed_ms(m);
  nvtxRangePop();
  if (distinct) {
    std::vector<int32_t> all(static_cast<size_t>(m.cfg.num_hidden_layers));
    check(cudaMemcpy(all.data(), m.active_log, all.size() * 4, cudaMemcpyDeviceToHost), "download counts");
    distinct->clear();
    for (size_t l = 0; l < all.size(); ++l) distinct->push_back(m.layers[l].moe ? all[l] : 0);
  }
  return ms;  // uncommitted: the cache keeps its size
}

}  // namespace kd::cli
#endif  // KDTREE_HAVE_CUDA
