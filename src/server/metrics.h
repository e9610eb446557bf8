// The server's Prometheus metrics (/metrics, text exposition format 0.0.4): engine gauges and
// counters read from Engine::metrics() at scrape time, plus latency histograms the HTTP layer
// records per finished request (TTFT, TPOT, end-to-end) and HTTP responses by status code.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/prepare.h"

namespace kd {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // Prometheus lines for `name` (cumulative _bucket{le=…}, _sum, _count). Caller holds the lock.
  void render(const std::string& name, const std::string& help, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // [bounds + 1]: the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  // A request that produced tokens: seconds from arrival to the first token, per later token, total.
  void observe_request(double ttft_s, double tpot_s, bool has_tpot, double e2e_s);
  void count_response(int status);
  void count_client_gone();  // a client left before its answer was complete; its request was cancelled
  // engine and grammars null while loading
  std::string render(const EngineMetrics* engine, bool loading, const GrammarCacheStats* grammars = nullptr) const;

 private:
  mutable std::mutex mu_;
  Histogram ttft_, tpot_, e2e_;
  std::map<int, uint64_t> responses_;  // HTTP status → count
  uint64_t clients_gone_ = 0;
};

}  // namespace kd
