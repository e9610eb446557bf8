#include "backend/cpu/host_comm.h"

#include <barrier>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"

namespace kd {

namespace {
enum class Op { all_reduce_sum, all_gather, barrier };
const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce_sum: return "all_reduce_sum";
    case Op::all_gather: return "all_gather";
    case Op::barrier: return "barrier";
  }
  return "?";
}
}  // namespace

struct HostCommGroup::Impl {
  // What rank r asks for in the current call; written by r's thread only, before it arrives at `publish`.
  struct Slot {
    Op op = Op::barrier;
    const void* src = nullptr;  // all_reduce_sum: its partials [n_rows, row_len] fp32; all_gather: its bytes
    int64_t n_rows = 0, row_len = 0;
    size_t n_bytes = 0;
    bool left = false;
    std::string left_why;
  };
  struct Validate {
    Impl* impl;
    void operator()() noexcept { impl->validate(); }
  };

  explicit Impl(int32_t ranks) : R(ranks), slots(size_t(ranks)), publish(ranks, Validate{this}), done(ranks) {
    for (int32_t r = 0; r < R; ++r) comms.emplace_back(std::make_unique<RankComm>(this, r));
  }

  // Runs once per publish phase, after every rank has arrived and before any is released: checks that the
  // ranks agree, and sizes the shared result. No rank reads `error` or `result` of this call before it
  // ends, and none can start the next phase's check before every rank has read this one's.
  void validate() noexcept {
    error.clear();
    int32_t first = -1;
    for (int32_t r = 0; r < R; ++r)
      if (!slots[size_t(r)].left) {
        first = r;
        break;
      }
    if (first < 0) return;  // everyone has left
    try {
      for (int32_t r = 0; r < R; ++r)
        if (slots[size_t(r)].left) {
          error = cat("host comm: rank ", r, " of ", R, " left the group (", slots[size_t(r)].left_why, ") while rank ", first,
                      " called ", op_name(slots[size_t(first)].op));
          return;
        }
      const Slot& a = slots[size_t(first)];
      bool agree = true;
      for (const Slot& b : slots) agree = agree && b.op == a.op && b.n_rows == a.n_rows && b.row_len == a.row_len && b.n_bytes == a.n_bytes;
      if (!agree) {
        error = "host comm: the ranks' calls disagree:";
        for (int32_t r = 0; r < R; ++r) {
          const Slot& s = slots[size_t(r)];
          error += cat(r ? ";" : "", " rank ", r, " ", op_name(s.op));
          if (s.op == Op::all_reduce_sum) error += cat(" of ", s.n_rows, " rows × ", s.row_len, " fp32");
          if (s.op == Op::all_gather) error += cat(" of ", s.n_bytes, " bytes");
        }
        return;
      }
      if (a.op == Op::all_reduce_sum) {
        if (a.n_rows < 0 || a.row_len < 0) {
          error = cat("host comm: all_reduce_sum of ", a.n_rows, " rows × ", a.row_len, ": sizes must not be negative");
          return;
        }
        result.resize(size_t(a.n_rows) * size_t(a.row_len));
      }
    } catch (const std::exception& e) {
      error = cat("host comm: ", e.what());
    }
  }

  // Publishes rank r's call and waits for all ranks; throws, on every rank alike, if they disagree.
  void enter(int32_t r, Op op, const void* src, int64_t n_rows, int64_t row_len, size_t n_bytes) {
    Slot& s = slots[size_t(r)];
    s.op = op;
    s.src = src;
    s.n_rows = n_rows;
    s.row_len = row_len;
    s.n_bytes = n_bytes;
    publish.arrive_and_wait();
    if (!error.empty()) throw Error(error);
  }

  void all_reduce_sum(int32_t r, float* rows, int64_t n_rows, int64_t row_len) {
    enter(r, Op::all_reduce_sum, rows, n_rows, row_len, 0);
    // Rank r computes elements [lo, hi) of the flat buffer for everyone. Each element is rank 0's value
    // plus rank 1's, plus rank 2's, … in that order (starting from p0, not from 0.0f: 0 + (−0) would be +0),
    // so its bits depend on the partials alone — not on n_rows, the row's place, or the slicing.
    const size_t n = size_t(n_rows) * size_t(row_len);
    const size_t lo = n * size_t(r) / size_t(R), hi = n * size_t(r + 1) / size_t(R);
    float* out = result.data();
    if (hi > lo) {
      std::memcpy(out + lo, static_cast<const float*>(slots[0].src) + lo, (hi - lo) * sizeof(float));
      for (int32_t q = 1; q < R; ++q) {
        const float* p = static_cast<const float*>(slots[size_t(q)].src);
        for (size_t i = lo; i < hi; ++i) out[i] += p[i];
      }
    }
    done.arrive_and_wait();  // every slice written, and every rank's partials read
    if (n) std::memcpy(rows, out, n * sizeof(float));
  }

  void all_gather(int32_t r, const void* send, size_t n_bytes, void* recv) {
    enter(r, Op::all_gather, send, 0, 0, n_bytes);
    for (int32_t q = 0; q < R; ++q)
      if (n_bytes) std::memcpy(static_cast<char*>(recv) + size_t(q) * n_bytes, slots[size_t(q)].src, n_bytes);
    done.arrive_and_wait();  // no rank reuses its send buffer before every rank has copied it
  }

  void leave(int32_t r, const std::string& why) {
    slots[size_t(r)].left = true;
    slots[size_t(r)].left_why = why;
    publish.arrive_and_drop();
    done.arrive_and_drop();
  }

  struct RankComm final : Comm {
    RankComm(Impl* g, int32_t r) : group(g), r_(r) {}
    int32_t rank() const override { return r_; }
    int32_t size() const override { return group->R; }
    void all_reduce_sum(float* rows, int64_t n_rows, int64_t row_len) override { group->all_reduce_sum(r_, rows, n_rows, row_len); }
    void all_gather(const void* send, size_t n_bytes, void* recv) override { group->all_gather(r_, send, n_bytes, recv); }
    void barrier() override { group->enter(r_, Op::barrier, nullptr, 0, 0, 0); }
    Impl* group;
    int32_t r_;
  };

  const int32_t R;
  std::vector<Slot> slots;                 // [R]
  std::vector<float> result;               // [n_rows × row_len] of the current all_reduce_sum
  std::string error;                       // this call's disagreement, "" if none
  std::barrier<Validate> publish;
  std::barrier<> done;
  std::vector<std::unique_ptr<RankComm>> comms;  // [R]
};

HostCommGroup::HostCommGroup(int32_t ranks) {
  if (ranks < 1) fail("host comm: a group needs at least 1 rank (got ", ranks, ")");
  impl_ = std::make_unique<Impl>(ranks);
}
HostCommGroup::~HostCommGroup() = default;

int32_t HostCommGroup::size() const { return impl_->R; }

Comm& HostCommGroup::rank(int32_t r) {
  if (r < 0 || r >= impl_->R) fail("host comm: rank ", r, " is outside the group of ", impl_->R);
  return *impl_->comms[size_t(r)];
}

void HostCommGroup::leave(int32_t r, const std::string& why) {
  if (r < 0 || r >= impl_->R) fail("host comm: rank ", r, " is outside the group of ", impl_->R);
  impl_->leave(r, why);
}

struct HostRankThreads::Impl {
  int32_t R = 1;
  std::mutex mu;
  std::condition_variable work, done;
  uint64_t generation = 0;  // bumped by each run
  bool stop = false;
  const std::function<void(Comm&)>* job = nullptr;
  HostCommGroup* group = nullptr;
  int32_t pending = 0;  // kept threads still running this generation
  std::exception_ptr first;
  std::vector<std::thread> threads;

  // Rank r's share of a run; a rank that returns or throws leaves the group (host_comm.h).
  void run_rank(int32_t r) {
    std::string why = "returned";
    try {
      (*job)(group->rank(r));
    } catch (const std::exception& e) {
      why = cat("threw: ", e.what());
      std::lock_guard lock(mu);
      if (!first) first = std::current_exception();
    } catch (...) {
      why = "threw";
      std::lock_guard lock(mu);
      if (!first) first = std::current_exception();
    }
    group->leave(r, why);
  }
  void worker(int32_t r) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu);
        work.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
      }
      run_rank(r);
      std::lock_guard lock(mu);
      if (--pending == 0) done.notify_one();
    }
  }
};

HostRankThreads::HostRankThreads(int32_t ranks) : impl_(std::make_unique<Impl>()) {
  if (ranks < 1) fail("host ranks: ", ranks, " (at least 1)");
  impl_->R = ranks;
  for (int32_t r = 1; r < ranks; ++r) impl_->threads.emplace_back([this, r] { impl_->worker(r); });
}

HostRankThreads::~HostRankThreads() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->work.notify_all();
  for (auto& t : impl_->threads) t.join();
}

int32_t HostRankThreads::size() const { return impl_->R; }

void HostRankThreads::run(const std::function<void(Comm&)>& fn) {
  Impl& m = *impl_;
  HostCommGroup group(m.R);
  {
    std::lock_guard lock(m.mu);
    m.job = &fn;
    m.group = &group;
    m.first = nullptr;
    m.pending = m.R - 1;
    ++m.generation;
  }
  m.work.notify_all();
  m.run_rank(0);
  std::exception_ptr first;
  {
    std::unique_lock lock(m.mu);
    m.done.wait(lock, [&] { return m.pending == 0; });
    first = m.first;
    m.job = nullptr;
    m.group = nullptr;
  }
  if (first) std::rethrow_exception(first);
}

void run_host_ranks(int32_t ranks, const std::function<void(Comm&)>& fn) {
  HostRankThreads threads(ranks);
  threads.run(fn);
}

}  // namespace kd
