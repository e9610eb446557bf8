#include "core/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <memory>

namespace kd {

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
}

namespace {
constexpr int kSpins = 4000;  // ~100 µs of pause instructions before a thread sleeps
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

namespace {
// Set while this thread runs a parallel_for chunk: a parallel_for called from inside one (a
// per-expert MLP inside a loop over experts) runs inline on the calling thread instead of
// re-entering the pool. The split never changes results (one thread per output element).
thread_local bool t_in_job = false;
struct InJob {
  InJob() { t_in_job = true; }
  ~InJob() { t_in_job = false; }
};
}  // namespace

void ThreadPool::worker(int idx) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    int spins = 0;
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      if (stop_.load(std::memory_order_acquire)) return;
      if (++spins < kSpins) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stop_.load() || generation_.load() != seen; });
    }
    seen = g;
    const auto r = ranges_[size_t(idx)];
    if (r.first < r.second) {
      InJob in_job;
      (*job_)(r.first, r.second);
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (t_in_job) {
    fn(0, n);
    return;
  }
  int64_t chunks = std::min<int64_t>(n_threads_, std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  // One caller at a time: tensor-parallel ranks (one thread each, model/deepseek_v3_tp.h) share the
  // pool, taking turns per loop; a chunk's nested calls run inline and never come here.
  std::lock_guard<std::mutex> one_caller(call_mu_);
  ranges_.assign(size_t(n_threads_), {0, 0});
  for (int64_t c = 0; c < chunks; ++c) ranges_[size_t(c)] = {n * c / chunks, n * (c + 1) / chunks};
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);  // a worker between its check and its wait cannot miss this
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_work_.notify_all();
  {
    InJob in_job;
    fn(ranges_[0].first, ranges_[0].second);  // the caller takes chunk 0
  }
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpins) {
      cpu_relax();
      continue;
    }
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return pending_.load() == 0; });
  }
}

namespace {
std::unique_ptr<ThreadPool>& global_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
}  // namespace

ThreadPool& ThreadPool::global() {
  // Tensor-parallel ranks may make the first call at once, from their own threads.
  static std::mutex first_call;
  std::lock_guard<std::mutex> lk(first_call);
  auto& p = global_slot();
  if (!p) {
    int n = int(std::thread::hardware_concurrency());
    if (const char* e = std::getenv("KDTREE_THREADS")) n = std::atoi(e);
    p = std::make_unique<ThreadPool>(n > 0 ? n : 1);
  }
  return *p;
}

void ThreadPool::set_global_threads(int n) { global_slot() = std::make_unique<ThreadPool>(n); }

}  // namespace kd
