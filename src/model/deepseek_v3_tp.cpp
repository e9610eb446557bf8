#include "model/deepseek_v3_tp.h"

#include <algorithm>

#include "backend/cpu/host_comm.h"
#include "core/error.h"
#include "core/log.h"

namespace kd {

DeepseekV3Tp::DeepseekV3Tp(const Checkpoint& ckpt, int32_t ranks) {
  if (ranks < 2) fail("tensor parallel: --tp ", ranks, " (the tensor-parallel target needs R ≥ 2; R = 1 is the plain target)");
  for (int32_t r = 0; r < ranks; ++r) ranks_.push_back(std::make_unique<DeepseekV3>(ckpt, TpRank{r, ranks}));
  threads_ = std::make_unique<HostRankThreads>(ranks);
}

DeepseekV3Tp::~DeepseekV3Tp() = default;

std::string DeepseekV3Tp::device() const { return cat("cpu, tensor parallel over ", ranks(), " ranks"); }

namespace {
// Rank 0's communicator with the wall time of its calls added up (comm_seconds): the reduction itself
// and the wait for the slowest rank to bring its partials.
class TimedComm final : public Comm {
 public:
  TimedComm(Comm& inner, double& seconds) : inner_(inner), seconds_(seconds) {}
  int32_t rank() const override { return inner_.rank(); }
  int32_t size() const override { return inner_.size(); }
  void all_reduce_sum(float* rows, int64_t n_rows, int64_t row_len) override {
    const double t0 = now_s();
    inner_.all_reduce_sum(rows, n_rows, row_len);
    seconds_ += now_s() - t0;
  }
  void all_gather(const void* send, size_t n_bytes, void* recv) override {
    const double t0 = now_s();
    inner_.all_gather(send, n_bytes, recv);
    seconds_ += now_s() - t0;
  }
  void barrier() override { inner_.barrier(); }

 private:
  Comm& inner_;
  double& seconds_;
};
}  // namespace

void DeepseekV3Tp::forward_batch(const std::vector<SeqForward>& seqs, ForwardStats* stats) const {
  std::vector<ForwardStats> st(ranks_.size());
  threads_->run([&](Comm& comm) {
    const size_t r = size_t(comm.rank());
    if (r == 0) {
      TimedComm timed(comm, comm_s_);
      ranks_[r]->forward_rank(seqs, timed, stats ? &st[r] : nullptr);
    } else {
      ranks_[r]->forward_rank(seqs, comm, stats ? &st[r] : nullptr);
    }
  });
  if (stats)
    for (const ForwardStats& s : st) stats->weight_bytes += s.weight_bytes;
}

void DeepseekV3Tp::logits_row(int64_t seq, int64_t row, float* out) const {
  for (const auto& r : ranks_) std::copy_n(r->kept_logits(seq, row), r->vocab_rows(), out + r->vocab_begin());
}

void DeepseekV3Tp::keep_rows(const KvView& kv, int64_t start, const std::vector<int32_t>& path) const {
  ranks_[0]->keep_rows(kv, start, path);  // one copy of the rows, shared by the ranks
}

}  // namespace kd
