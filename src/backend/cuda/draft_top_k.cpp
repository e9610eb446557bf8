// DeviceDraftTopK (draft_top_k.h): the device pass, then the host's exact resolution of each row.
#include "backend/cuda/draft_top_k.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kd {

using cuda::check;
using cuda::DraftRowInfo;

DeviceDraftTopK::~DeviceDraftTopK() {
  if (dev_) cudaFree(dev_);
  if (host_) cudaFreeHost(host_);
  if (cand_) cudaFree(cand_);
}

static size_t layout_bytes(int64_t rows, int64_t k) {
  return size_t(rows) * sizeof(DraftRowInfo) + size_t(rows * k) * 8;
}

void DeviceDraftTopK::reserve(int64_t rows, int64_t vocab, int64_t k) {
  const size_t cand = size_t(cuda::draft_top_k_scratch(rows, vocab, k)) * 8;
  if (cand > cand_bytes_) {
    if (cand_) cudaFree(cand_);
    cand_ = nullptr;
    cand_bytes_ = 0;
    check(cudaMalloc(&cand_, cand), "allocate draft top-k candidates");
    cand_bytes_ = cand;
  }
  const size_t need = layout_bytes(rows, k);
  if (need <= bytes_) return;
  if (dev_) cudaFree(dev_);
  if (host_) cudaFreeHost(host_);
  dev_ = host_ = nullptr;
  bytes_ = 0;
  check(cudaMalloc(&dev_, need), "allocate draft top-k");
  check(cudaMallocHost(&host_, need), "allocate pinned draft top-k");
  bytes_ = need;
}

namespace {

// The LSE interval of one row: [A, B] ∋ the CPU's mx + log(S) for any S in [lo, hi].
struct LseBounds {
  double a, b;
};
LseBounds lse_bounds(double mx, double lo, double hi) {
  double la = std::log(lo), lb = std::log(hi);
  if (lo != hi) {
    // glibc's log is within 1 ulp of log, so log_glibc(S) ≥ log_glibc(lo) − 2 ulps (and up for
    // hi), whether or not it is monotone; 8 steps cover that with room.
    for (int i = 0; i < 8; ++i) {
      la = std::nextafter(la, -std::numeric_limits<double>::infinity());
      lb = std::nextafter(lb, std::numeric_limits<double>::infinity());
    }
  }
  return {mx + la, mx + lb};
}

}  // namespace

DraftTopK DeviceDraftTopK::run(const float* logits_dev, int64_t rows, int64_t vocab, int64_t k, cudaStream_t s) {
  if (rows < 1 || vocab < 1) fail("draft top-k: need at least one position and one token (got ", rows, " × ", vocab, ")");
  if (k < 1 || k > vocab) fail("draft top-k: k must be in [1, ", vocab, "] (got ", k, ")");
  if (vocab >= (int64_t(1) << 31) - 1) fail("draft top-k: vocabulary of ", vocab, " tokens is too large for int32 ids");
  reserve(rows, vocab, k);
  auto* info_d = static_cast<DraftRowInfo*>(dev_);
  auto* ids_d = reinterpret_cast<int32_t*>(info_d + rows);
  auto* vals_d = reinterpret_cast<float*>(ids_d + rows * k);
  cuda::draft_top_k(logits_dev, rows, vocab, k, static_cast<unsigned long long*>(cand_), ids_d, vals_d, info_d,
                    sequential_sum_, s);
  check(cudaMemcpyAsync(host_, dev_, layout_bytes(rows, k), cudaMemcpyDeviceToHost, s), "download draft top-k");
  check(cudaStreamSynchronize(s), "draft top-k");
  const auto* info = static_cast<const DraftRowInfo*>(host_);
  const auto* ids = reinterpret_cast<const int32_t*>(info + rows);
  const auto* vals = reinterpret_cast<const float*>(ids + rows * k);
  last_bounds_.clear();
  for (int64_t p = 0; p < rows; ++p) last_bounds_.push_back({info[p].lo, info[p].hi});

  DraftTopK t;
  t.positions = rows;
  t.k = k;
  t.ids.assign(ids, ids + rows * k);
  t.logp.resize(size_t(rows * k));
  t.valid.assign(size_t(rows), 0);
  std::vector<float> row;
  for (int64_t p = 0; p < rows; ++p) {
    const DraftRowInfo& in = info[p];
    bool exact = in.bad < 0 && std::isfinite(in.max) && in.lo > 0 && in.lo <= in.hi && std::isfinite(in.hi);
    if (exact) {
      const LseBounds lse = lse_bounds(double(in.max), in.lo, in.hi);
      for (int64_t r = 0; r < k && exact; ++r) {
        const float x = vals[p * k + r];
        const float a = float(double(x) - lse.a), b = float(double(x) - lse.b);
        exact = std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
        t.logp[size_t(p * k + r)] = a;
        if (std::isfinite(x)) t.valid[size_t(p)] = r + 1;
      }
    }
    if (!exact) {
      // The CPU's own code on the full row (and its error, if the row has one).
      row.resize(size_t(vocab));
      check(cudaMemcpy(row.data(), logits_dev + p * vocab, size_t(vocab) * 4, cudaMemcpyDeviceToHost), "download draft row");
      t.valid[size_t(p)] =
          draft_top_k_row(row.data(), p, vocab, k, &t.ids[size_t(p * k)], &t.logp[size_t(p * k)]);
      ++fallback_rows_;
    }
    ++rows_done_;
  }
  return t;
}

}  // namespace kd
