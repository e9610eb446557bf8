// A fixed pool of worker threads for data-parallel loops (the CPU backend splits output rows).
// parallel_for blocks until every chunk is done; chunks are contiguous and deterministic, and each
// output element is computed by exactly one thread in a fixed order, so results never depend on
// the number of threads (row invariance on the CPU).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kd {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // Calls fn(begin, end) over [0, n) split into at most size() contiguous chunks of at least `grain`.
  // Called from inside a chunk (nested), it runs fn(0, n) inline on that thread. Threads outside the
  // pool may call it concurrently: their loops take turns.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool (KDTREE_THREADS or hardware concurrency).
  static ThreadPool& global();
  static void set_global_threads(int n);

 private:
  void worker(int idx);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex call_mu_;  // held by the caller whose loop the workers run
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // written before generation_ is bumped
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace kd
