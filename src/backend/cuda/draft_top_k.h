// What the DDTree tree builder reads of the draft logits — draft_top_k(logits, rows, vocab, k)
// (src/decode/tree.h) — computed from logits already on the device, bit for bit, downloading
// [rows, k] ids and logits plus 24 bytes per row instead of [rows, vocab] logits.
//
// Why bit-identical. The ids: the device picks the k best by the CPU's strict total order (logit
// desc, −0 == +0, lower id first), which has a unique answer. The log-probabilities need the CPU's
// LSE = max + log(S), S = Σ_v exp(double(x_v) − max) added in token order in double. That sum
// cannot be reproduced on the GPU (its exp is not glibc's), but it can be bounded exactly: the
// device adds the same terms in the same order, once with every term rounded down past any
// possible glibc/CUDA difference and once rounded up, and round-to-nearest addition is monotone in
// both operands, so lo ≤ S_cpu ≤ hi. On the host, log (glibc, the CPU's own) of lo and hi widened
// by 8 ulps brackets log(S_cpu), mx + · is monotone, and logp = fp32(double(x) − LSE) is monotone
// in the LSE: when the two ends give the same float, that float is the CPU's. When lo == hi, S is
// known exactly and the host computes the LSE exactly as the CPU. A row whose ends differ for some
// rank (an interval ~1e-13 wide straddling a float rounding boundary: rare, mostly a top token
// with probability ≥ 1 − 1e-4), or with a NaN / +inf / no finite logit, is downloaded in full and
// run through draft_top_k_row — the CPU code itself, which also throws the CPU's errors.
//
// Cost on an H200 at K2's shape (15 rows × 163840), sync and download included: 0.44 ms at k = 16,
// 0.59 ms at k = 64 — mostly the bounds (the exps, and the in-order sum, which a warp adds 256
// terms a step: sample_kernels.cu) — against ≈ 19–26 ms for the 9.8 MB download plus the host's
// exp pass and partial sort it replaces.
#pragma once
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <vector>

#include "sample/top_k.h"

namespace kd {

// Beyond this k the device selection (k passes over the row) is no longer cheap (k = 200 at K2's
// shape: 12 ms, against 21 ms for the host path); the generation loop keeps the host path there.
constexpr int64_t kMaxDeviceTopK = 128;

class DeviceDraftTopK {
 public:
  DeviceDraftTopK() = default;
  ~DeviceDraftTopK();
  DeviceDraftTopK(const DeviceDraftTopK&) = delete;
  DeviceDraftTopK& operator=(const DeviceDraftTopK&) = delete;

  // logits_dev: device fp32 [rows, vocab], written on `stream`; 1 ≤ k ≤ vocab. One host sync.
  DraftTopK run(const float* logits_dev, int64_t rows, int64_t vocab, int64_t k, cudaStream_t stream);
  int64_t fallback_rows() const { return fallback_rows_; }  // rows resolved from a full download
  int64_t rows_done() const { return rows_done_; }
  // Tests: the last run's bounds [lo, hi] per row (0, 0 for a bad row), and the adder's reference
  // mode (one term at a time) to compare the warp-wide adder against.
  const std::vector<std::array<double, 2>>& last_bounds() const { return last_bounds_; }
  void set_sequential_sum(bool on) { sequential_sum_ = on; }

 private:
  void reserve(int64_t rows, int64_t vocab, int64_t k);
  void* dev_ = nullptr;   // [info rows | ids rows·k | vals rows·k]
  void* host_ = nullptr;  // pinned mirror
  void* cand_ = nullptr;  // per-chunk candidates (device only)
  size_t bytes_ = 0, cand_bytes_ = 0;
  int64_t fallback_rows_ = 0, rows_done_ = 0;
  bool sequential_sum_ = false;
  std::vector<std::array<double, 2>> last_bounds_;
};

}  // namespace kd
