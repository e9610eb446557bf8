#include "server/metrics.h"

#include <cstdio>

#include "core/error.h"

namespace kd {

namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void metric(std::string& out, const std::string& name, const char* type, const std::string& help, double v) {
  out += cat("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ", num(v), "\n");
}

}  // namespace

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string& out) const {
  out += cat("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += cat(name, "_bucket{le=\"", num(bounds_[i]), "\"} ", cum, "\n");
  }
  cum += counts_.back();
  out += cat(name, "_bucket{le=\"+Inf\"} ", cum, "\n", name, "_sum ", num(sum_), "\n", name, "_count ", count_, "\n");
}

// Buckets span a CPU toy model (sub-millisecond tokens) to a long prompt on a big one.
ServerMetrics::ServerMetrics()
    : ttft_({0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      tpot_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      e2e_({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}) {}

void ServerMetrics::observe_request(double ttft_s, double tpot_s, bool has_tpot, double e2e_s) {
  std::lock_guard<std::mutex> lk(mu_);
  ttft_.observe(ttft_s);
  if (has_tpot) tpot_.observe(tpot_s);
  e2e_.observe(e2e_s);
}

void ServerMetrics::count_response(int status) {
  std::lock_guard<std::mutex> lk(mu_);
  ++responses_[status];
}

void ServerMetrics::count_client_gone() {
  std::lock_guard<std::mutex> lk(mu_);
  ++clients_gone_;
}

std::string ServerMetrics::render(const EngineMetrics* e, bool loading, const GrammarCacheStats* g) const {
  std::string out;
  metric(out, "kdtree_model_loading", "gauge", "1 while the model loads (requests get 503)", loading ? 1 : 0);
  if (e) {
    metric(out, "kdtree_requests_running", "gauge", "Requests in the running batch", double(e->running));
    metric(out, "kdtree_requests_waiting", "gauge", "Requests queued for admission", double(e->waiting));
    metric(out, "kdtree_requests_finished_total", "counter", "Requests the engine finished", double(e->requests_finished));
    metric(out, "kdtree_prompt_tokens_total", "counter", "Prompt tokens processed (prefix-cache hits included)", double(e->prompt_tokens));
    metric(out, "kdtree_generation_tokens_total", "counter", "Tokens generated", double(e->generated_tokens));
    metric(out, "kdtree_engine_steps_total", "counter", "Engine steps (batched target forwards)", double(e->steps));
    metric(out, "kdtree_kv_blocks_used", "gauge", "KV blocks in use", double(e->kv_blocks_used));
    metric(out, "kdtree_kv_blocks_total", "gauge", "KV blocks in the pool", double(e->kv_blocks_total));
    metric(out, "kdtree_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use",
           e->kv_blocks_total > 0 ? double(e->kv_blocks_used) / double(e->kv_blocks_total) : 0.0);
    metric(out, "kdtree_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache", double(e->prefix_query_tokens));
    metric(out, "kdtree_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache", double(e->prefix_hit_tokens));
    metric(out, "kdtree_prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total",
           e->prefix_query_tokens > 0 ? double(e->prefix_hit_tokens) / double(e->prefix_query_tokens) : 0.0);
    metric(out, "kdtree_spec_rounds_total", "counter", "Speculative rounds", double(e->spec_rounds));
    metric(out, "kdtree_spec_draft_tokens_total", "counter", "Drafted tokens (tree nodes)", double(e->spec_drafted));
    metric(out, "kdtree_spec_accepted_tokens_total", "counter", "Accepted drafted tokens", double(e->spec_accepted));
    metric(out, "kdtree_spec_mean_accepted_length", "gauge", "Tokens committed per speculative round (tau)",
           e->spec_rounds > 0 ? double(e->spec_accepted + e->spec_rounds) / double(e->spec_rounds) : 0.0);
  }
  if (g) {
    metric(out, "kdtree_grammar_cache_hits_total", "counter",
           "Constrained requests whose schema / grammar / strict tools were compiled for an earlier request", double(g->hits));
    metric(out, "kdtree_grammar_cache_misses_total", "counter", "Constrained requests that compiled their grammar", double(g->misses));
    metric(out, "kdtree_grammar_cache_entries", "gauge", "Compiled grammars kept", double(g->entries));
    metric(out, "kdtree_grammar_masks_shared_total", "counter",
           "Token masks a constrained request found computed by an earlier request with its grammar", double(g->mask_hits));
    metric(out, "kdtree_grammar_masks_walked_total", "counter", "Token masks a constrained request computed by a vocabulary walk (states a shared mask can key)",
           double(g->mask_misses));
    metric(out, "kdtree_grammar_masks_bytes", "gauge", "Bytes of shared token masks kept", double(g->mask_bytes));
  }
  std::lock_guard<std::mutex> lk(mu_);
  ttft_.render("kdtree_time_to_first_token_seconds", "Request arrival to first generated token", out);
  tpot_.render("kdtree_time_per_output_token_seconds", "Mean time per generated token after the first", out);
  e2e_.render("kdtree_e2e_request_latency_seconds", "Request arrival to the last token", out);
  metric(out, "kdtree_client_disconnects_total", "counter", "Requests cancelled because the client left before the answer was complete",
         double(clients_gone_));
  out += "# HELP kdtree_http_responses_total HTTP responses by status code\n# TYPE kdtree_http_responses_total counter\n";
  for (const auto& [code, n] : responses_) out += cat("kdtree_http_responses_total{code=\"", code, "\"} ", n, "\n");
  return out;
}

}  // namespace kd
