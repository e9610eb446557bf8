// The engine tests' event sink (tests/unit/test_engine.cpp on the CPU, tests/gpu/test_cuda_engine.cpp
// on the GPU): every event an Engine sends each request, gathered per request for checks.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"

namespace kd::test {

// Everything the engine sent one request, gathered for checks.
struct Collected {
  std::vector<int32_t> ids;
  std::vector<float> logits;
  std::vector<TokenLogprob> logprobs;
  int n_events = 0, n_done = 0;
  std::string finish_reason, error;
  RequestStats stats;
};

class Sink {
 public:
  // A callback recording into slot `k`; it asks to cancel after `cancel_after` tokens (−1: never).
  std::function<bool(const EngineEvent&)> callback(size_t k, int64_t cancel_after = -1) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (got_.size() <= k) got_.resize(k + 1);
    }
    return [this, k, cancel_after](const EngineEvent& ev) {
      std::lock_guard<std::mutex> lk(mu_);
      Collected& c = got_[k];
      ++c.n_events;
      log_.push_back({k, ev.ids.size()});
      c.ids.insert(c.ids.end(), ev.ids.begin(), ev.ids.end());
      c.logits.insert(c.logits.end(), ev.logits.begin(), ev.logits.end());
      c.logprobs.insert(c.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      if (ev.done) {
        ++c.n_done;
        c.finish_reason = ev.finish_reason;
        c.error = ev.error;
        c.stats = ev.stats;
        ++done_;
        cv_.notify_all();
      }
      return cancel_after < 0 || int64_t(c.ids.size()) < cancel_after;
    };
  }
  void wait_done(size_t n) {
    std::unique_lock<std::mutex> lk(mu_);
    ASSERT_TRUE(cv_.wait_for(lk, std::chrono::seconds(300), [&] { return done_ >= n; })) << "timed out: " << done_ << "/" << n;
  }
  // (request, tokens) of every event so far, in arrival order.
  std::vector<std::pair<size_t, size_t>> log() {
    std::lock_guard<std::mutex> lk(mu_);
    return log_;
  }
  Collected get(size_t k) {
    std::lock_guard<std::mutex> lk(mu_);
    return got_[k];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Collected> got_;
  std::vector<std::pair<size_t, size_t>> log_;
  size_t done_ = 0;
};

// A request's prompt and generation settings (the engine tests' cases).
struct Case {
  std::vector<int32_t> prompt;
  GenerateOptions gen;
};

// Submits case `c` with the sink's callback for slot k; returns the engine's request id.
inline uint64_t submit_case(Engine& eng, Sink& sink, size_t k, const Case& c) {
  EngineRequest r;
  r.prompt = c.prompt;
  r.gen = c.gen;
  r.on_event = sink.callback(k);
  return eng.submit(std::move(r));
}

}  // namespace kd::test
