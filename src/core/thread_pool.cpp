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
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int idx) {
  uint64_t seen = 0;
  for (;;) {
    std::pair<int64_t, int64_t> r;
    const std::function<void(int64_t, int64_t)>* job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      r = idx < int(ranges_.size()) ? ranges_[size_t(idx)] : std::pair<int64_t, int64_t>{0, 0};
    }
    if (r.first < r.second) (*job)(r.first, r.second);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t chunks = std::min<int64_t>(n_threads_, std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> ranges(size_t(n_threads_), {0, 0});
  for (int64_t c = 0; c < chunks; ++c) ranges[size_t(c)] = {n * c / chunks, n * (c + 1) / chunks};
  {
    std::lock_guard<std::mutex> lk(mu_);
    ranges_ = std::move(ranges);
    job_ = &fn;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  cv_work_.notify_all();
  fn(ranges_[0].first, ranges_[0].second);  // the caller takes chunk 0
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return pending_ == 0; });
}

namespace {
std::unique_ptr<ThreadPool>& global_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
}  // namespace

ThreadPool& ThreadPool::global() {
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
