#include "model/deepseek_v3_cuda_tp.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <exception>
#include <numeric>
#include <set>

#include "backend/cpu/host_comm.h"
#include "backend/cuda/device_comm.h"
#include "core/error.h"
#include "core/log.h"
#include "model/deepseek_v3.h"
#include "model/deepseek_v3_cuda.h"
#include "model/deepseek_v3_cuda_impl.h"
#include "model/tp_plan.h"

namespace kd {

namespace {
void set_device(int32_t d) {
  const cudaError_t e = cudaSetDevice(d);
  if (e != cudaSuccess) fail("CUDA: cudaSetDevice(", d, "): ", cudaGetErrorString(e));
}
std::string list_devices(const std::vector<int32_t>& devices) {
  std::string s;
  for (int32_t d : devices) s += cat(s.empty() ? "" : ",", d);
  return s;
}
}  // namespace

uint64_t cuda_free_bytes(int32_t device) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = 0;
  set_device(device);
  size_t free_b = 0, total_b = 0;
  const cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
  set_device(prev);
  if (e != cudaSuccess) fail("CUDA: cudaMemGetInfo on GPU ", device, ": ", cudaGetErrorString(e));
  return free_b;
}

void check_gpu_memory_plan(const ModelConfig& c, const std::vector<int32_t>& devices, uint64_t limit_bytes, int64_t kv_tokens,
                           const std::string& what) {
  const std::string why = tp_gpu_refusal(c, devices, cuda_free_bytes, limit_bytes, kv_tokens, what);
  if (!why.empty()) fail(why);
}

CudaTpTarget::CudaTpTarget(const Checkpoint& ckpt, const std::vector<int32_t>& devices, uint64_t memory_limit_bytes)
    : cfg_(ckpt.config()), devices_(devices) {
  const int32_t R = int32_t(devices.size());
  if (R < 2) fail("tensor parallel on GPUs: ", R, " rank (the tensor-parallel target needs R ≥ 2)");
  const TpPlan plan = plan_tp(cfg_, R);  // an R that does not divide the shapes, before anything is uploaded
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess) n_dev = 0;
  for (int32_t d : devices)
    if (d < 0 || d >= n_dev) fail("--devices: GPU ", d, " does not exist (this machine has ", n_dev, ")");
  const bool one_gpu = std::all_of(devices.begin(), devices.end(), [&](int32_t d) { return d == devices[0]; });
  if (!one_gpu && std::set<int32_t>(devices.begin(), devices.end()).size() != devices.size())
    fail("--devices: list a different GPU for every rank (NCCL), or the same GPU for all of them (the one-GPU emulation), "
         "not a mix");
  // The memory plan (model/tp_plan.h, as `inspect --tp R` prints it), checked on every GPU before
  // anything is uploaded: the ranks it holds, their weights and workspace, against its free memory and the limit.
  check_gpu_memory_plan(cfg_, devices, memory_limit_bytes, 0, cat("--tp ", R));
  Progress progress(cat("loading ", R, " ranks to GPU", one_gpu ? " " : "s ", one_gpu ? cat(devices[0]) : list_devices(devices)),
                    std::accumulate(plan.weight_bytes_by_rank.begin(), plan.weight_bytes_by_rank.end(), uint64_t{0}), "B");
  for (int32_t r = 0; r < R; ++r) {
    // Rank r's slice is read from the mmap (views, and copies of its columns of o_proj / down_proj),
    // uploaded, and dropped from the host.
    const double t0 = now_s();
    set_device(devices[size_t(r)]);
    const DeepseekV3 slice(ckpt, TpRank{r, R});
    vocab_begin_.push_back(slice.vocab_begin());
    ranks_.push_back(std::make_unique<CudaTarget>(slice, 1, &progress));
    const double gb = double(ranks_.back()->device_weight_bytes()) / 1e9, dt = now_s() - t0;
    log_debug("TP rank ", r, "/", R, " on GPU ", devices[size_t(r)], ": ", gb, " GB of weights in ", dt, " s (", gb / dt, " GB/s)");
  }
  progress.finish();
  if (memory_limit_bytes > 0) {
    // The KV pool gets what the limit leaves beside the weights and the workspace estimate: on a shared
    // GPU rank 0's cap is the whole GPU's (max_kv_tokens divides it among the ranks).
    const int64_t workspace = int64_t(tp_memory(cfg_, plan, 0).workspace_bytes);
    for (int32_t d : std::set<int32_t>(devices.begin(), devices.end())) {
      int64_t left = int64_t(memory_limit_bytes);
      int32_t first = -1;
      for (int32_t r = 0; r < R; ++r)
        if (devices[size_t(r)] == d) {
          left -= int64_t(ranks_[size_t(r)]->device_weight_bytes()) + workspace;
          if (first < 0) first = r;
          if (!one_gpu) {
            set_device(d);
            ranks_[size_t(r)]->cap_kv_bytes(std::max<int64_t>(0, left));
          }
        }
      if (one_gpu) ranks_[size_t(first)]->cap_kv_bytes(std::max<int64_t>(0, left));
    }
  }
  set_device(devices[0]);
  if (one_gpu) {
    shared_ = std::make_unique<SharedDeviceCommGroup>(R);
  } else {
    nccl_ = std::make_unique<NcclCommGroup>(devices);
    nccl_threads_ = std::make_unique<HostRankThreads>(R);
  }
}

CudaTpTarget::~CudaTpTarget() {
  shared_.reset();
  nccl_threads_.reset();
  nccl_.reset();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    cudaSetDevice(devices_[r]);
    ranks_[r].reset();
  }
}

std::string CudaTpTarget::device() const {
  return cat("cuda, tensor parallel over ", ranks(), " ranks ",
             shared_device() ? cat("sharing GPU ", devices_[0], " (emulation)") : std::string("over NCCL"), " (", cuda_device_name(), ")");
}

int64_t CudaTpTarget::max_context() const { return ranks_[0]->max_context(); }

int64_t CudaTpTarget::max_kv_tokens(int64_t block_tokens) const {
  if (shared_device()) {
    set_device(devices_[0]);
    return ranks_[0]->max_kv_tokens(block_tokens) / ranks() / block_tokens * block_tokens;
  }
  int64_t m = INT64_MAX;
  for (int32_t r = 0; r < ranks(); ++r) {
    set_device(devices_[size_t(r)]);
    m = std::min(m, ranks_[size_t(r)]->max_kv_tokens(block_tokens));
  }
  set_device(devices_[0]);
  return m;
}

void CudaTpTarget::init_kv(int64_t n_blocks, int64_t block_tokens) const {
  for (int32_t r = 0; r < ranks(); ++r) {
    set_device(devices_[size_t(r)]);
    ranks_[size_t(r)]->init_kv(n_blocks, block_tokens);
  }
  set_device(devices_[0]);
}

void CudaTpTarget::forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats) const {
  const int32_t R = ranks();
  std::vector<std::vector<SeqForward>> per(static_cast<size_t>(R), seqs);
  // Each rank's argmax outputs of every sequence that asked ([seq][rank] ids / values).
  std::vector<std::vector<std::vector<int32_t>>> am_ids(seqs.size());
  std::vector<std::vector<std::vector<float>>> am_vals(seqs.size());
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const ForwardArgs& a = seqs[sq].args;
    const int64_t k = a.all_logits ? a.n : 1;
    if (a.argmax_ids) {
      am_ids[sq].assign(size_t(R), std::vector<int32_t>(size_t(k)));
      am_vals[sq].assign(size_t(R), std::vector<float>(size_t(k)));
    }
    for (int32_t r = 0; r < R; ++r) {
      ForwardArgs& b = per[size_t(r)][sq].args;
      if (r > 0) b.taps = nullptr, b.tap_layers = nullptr, b.device_taps = nullptr;  // the residual stream is replicated: rank 0's
      if (a.argmax_ids) {
        b.argmax_ids = am_ids[sq][size_t(r)].data();
        b.argmax_vals = am_vals[sq][size_t(r)].data();
      }
    }
  }
  std::vector<ForwardStats> st(static_cast<size_t>(R));
  auto rank_forward = [&](int32_t r, DeviceComm& comm) {
    set_device(devices_[size_t(r)]);
    CudaTarget::Impl& m = ranks_[size_t(r)]->impl();
    m.comm = &comm;
    try {
      ranks_[size_t(r)]->forward_batch(per[size_t(r)], stats ? &st[size_t(r)] : nullptr);
    } catch (...) {
      m.comm = nullptr;
      throw;
    }
    m.comm = nullptr;
  };
  if (shared_device()) {
    set_device(devices_[0]);
    shared_->run([&](DeviceComm& comm) { rank_forward(comm.rank(), comm); });
  } else {
    // A thread a rank (each NCCL rank's calls come from its own thread). A rank that fails before the
    // first collective fails on every rank alike (the checks are the same); NCCL has no way out of a
    // collective a peer never joins, so nothing after the first one may throw on one rank alone.
    nccl_threads_->run([&](Comm& host) { rank_forward(host.rank(), nccl_->rank(host.rank())); });
    set_device(devices_[0]);
  }
  // Argmax outputs: the ranks' (value, index) combined (combine_rank_argmax: sample()'s greedy choice).
  for (size_t sq = 0; sq < seqs.size(); ++sq) {
    const ForwardArgs& a = seqs[sq].args;
    if (!a.argmax_ids) continue;
    const int64_t k = a.all_logits ? a.n : 1;
    std::vector<RankArgmax> of_rank(static_cast<size_t>(R));
    for (int64_t i = 0; i < k; ++i) {
      for (int32_t q = 0; q < R; ++q) of_rank[size_t(q)] = {am_vals[sq][size_t(q)][size_t(i)], am_ids[sq][size_t(q)][size_t(i)]};
      const RankArgmax best = combine_rank_argmax(of_rank.data(), R);
      a.argmax_ids[i] = best.idx;
      a.argmax_vals[i] = best.val;
    }
  }
  if (stats)
    for (const ForwardStats& s : st) stats->weight_bytes += s.weight_bytes;
}

bool CudaTpTarget::device_taps() const { return ranks_[0]->device_taps(); }

CudaTarget& CudaTpTarget::draft_rank(const Weight& lm_head) const {
  set_device(devices_[0]);
  ranks_[0]->add_draft_lm_head(lm_head);
  return *ranks_[0];
}

void CudaTpTarget::logits_row(int64_t seq, int64_t row, float* out) const {
  for (int32_t r = 0; r < ranks(); ++r) {
    set_device(devices_[size_t(r)]);
    ranks_[size_t(r)]->logits_row(seq, row, out + vocab_begin_[size_t(r)]);
  }
  set_device(devices_[0]);
}

void CudaTpTarget::keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const {
  for (int32_t r = 0; r < ranks(); ++r) {
    set_device(devices_[size_t(r)]);
    ranks_[size_t(r)]->keep_rows(kv, start, path);  // every rank holds its own copy of the latent
  }
  set_device(devices_[0]);
}

}  // namespace kd
