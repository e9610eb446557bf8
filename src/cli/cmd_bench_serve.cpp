// `kdtree bench --device cuda --serve C1,C2,…`: the serving engine's load test on the GPU (the
// Engine over the paged CUDA target, everything `kdtree serve` runs but HTTP and the tokenizer).
// For each concurrency C: max(8, 2C) requests of -p random prompt tokens and -n new tokens
// (greedy, ignore_eos) submitted at once to an engine with --parallel C; tokens/s over the level,
// TTFT (submit → first token) and TPOT ((done − first) / (tokens − 1)) percentiles. Then TTFT of a
// -p-token prompt alone, without and with a prefix-cache hit (the same prompt again), median of
// -r pairs. With --preset k2-slice the weights are random, made on the GPU.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#ifdef KDTREE_HAVE_CUDA
#include "model/deepseek_v3_cuda.h"
#include "cli/bench_cuda.h"
#include "engine/engine.h"
#endif

namespace kd::cli {

#ifndef KDTREE_HAVE_CUDA

int cmd_bench_serve_cuda(const BenchOptions&) {
  fail("--device cuda: this build has no CUDA backend (configure with -DKDTREE_CUDA=ON where nvcc is installed)");
}

#else

namespace {

double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5));
  return v[i];
}

struct Timing {
  double submit = 0, first = 0, done = 0;
  int64_t tokens = 0;
  std::string finish;
};

// Submits every prompt at once, waits for all; per-request times in seconds.
std::vector<Timing> run_level(Engine& eng, const std::vector<std::vector<int32_t>>& prompts, int64_t n_gen) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Timing> t(prompts.size());
  size_t done = 0;
  for (size_t k = 0; k < prompts.size(); ++k) {
    EngineRequest r;
    r.prompt = prompts[k];
    r.gen.max_new_tokens = n_gen;
    r.gen.ignore_eos = true;
    r.on_event = [&, k](const EngineEvent& ev) {
      const double now = now_s();
      std::lock_guard<std::mutex> lk(mu);
      if (!ev.ids.empty() && t[k].first == 0) t[k].first = now;
      t[k].tokens += int64_t(ev.ids.size());
      if (ev.done) {
        t[k].done = now;
        t[k].finish = ev.finish_reason;
        ++done;
        cv.notify_all();
      }
      return true;
    };
    t[k].submit = now_s();
    eng.submit(std::move(r));
  }
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done == prompts.size(); });
  for (const Timing& x : t)
    if (x.finish != "length") fail("bench: a request ended with '", x.finish, "'");
  return t;
}

}  // namespace

int cmd_bench_serve_cuda(const BenchOptions& o) {
  // A one-row cache to start with: each level's engine replaces it by its paged pool.
  BenchTarget bt = load_bench_target(o, 1, "bench --device cuda --serve");
  std::unique_ptr<CudaTarget> t = std::move(bt.target);
  const std::string label = bt.label;
  const ModelConfig& c = t->config();
  uint64_t salt = 1;
  auto prompt = [&] {
    std::vector<int32_t> p(static_cast<size_t>(o.n_prompt));
    for (size_t i = 0; i < p.size(); ++i) p[i] = int32_t((i * 7919 + salt * 104729 + 13) % uint64_t(c.vocab_size));
    ++salt;
    return p;
  };
  const int64_t ctx = o.n_prompt + o.n_gen + 8;

  nlohmann::ordered_json levels = nlohmann::ordered_json::array();
  std::printf("device: %s; %s; prompts of %lld tokens, %lld new tokens each (greedy)\n", cuda_device_name().c_str(), label.c_str(),
              (long long)o.n_prompt, (long long)o.n_gen);
  std::printf("| concurrency | requests | tok/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | steps | ms/step | "
              "forward ms/step | rows/step |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (int64_t C : o.serve) {
    EngineOptions eo;
    eo.n_parallel = C;
    eo.context = ctx;
    eo.kv_tokens = C * ctx;
    eo.prefix_cache = false;
    eo.max_queue = 1 << 20;
    Engine eng(*t, eo);
    // Warm-up: one request (first-use costs: attention's smem opt-in, buffer growth).
    run_level(eng, {prompt()}, 2);
    const int64_t R = std::max<int64_t>(8, 2 * C);
    std::vector<std::vector<int32_t>> ps;
    for (int64_t k = 0; k < R; ++k) ps.push_back(prompt());
    const EngineMetrics m0 = eng.metrics();
    const std::vector<Timing> tm = run_level(eng, ps, o.n_gen);
    const EngineMetrics m1 = eng.metrics();
    const double steps = double(m1.steps - m0.steps), fwd_ms = (m1.forward_seconds - m0.forward_seconds) * 1e3;
    double t0 = tm[0].submit, t1 = 0;
    int64_t tokens = 0;
    std::vector<double> ttft, tpot;
    for (const Timing& x : tm) {
      t0 = std::min(t0, x.submit);
      t1 = std::max(t1, x.done);
      tokens += x.tokens;
      ttft.push_back((x.first - x.submit) * 1e3);
      if (x.tokens > 1) tpot.push_back((x.done - x.first) * 1e3 / double(x.tokens - 1));
    }
    const double tps = double(tokens) / (t1 - t0);
    std::printf("| %lld | %lld | %.1f | %.1f | %.1f | %.2f | %.2f | %.0f | %.2f | %.2f | %.1f |\n", (long long)C, (long long)R, tps,
                pct(ttft, 0.5), pct(ttft, 0.9), pct(tpot, 0.5), pct(tpot, 0.9), steps,
                (m1.step_seconds - m0.step_seconds) * 1e3 / steps, fwd_ms / steps, double(m1.forward_rows - m0.forward_rows) / steps);
    std::fflush(stdout);
    levels.push_back({{"concurrency", C}, {"requests", R}, {"tokens_per_s", tps}, {"ttft_p50_ms", pct(ttft, 0.5)},
                      {"ttft_p90_ms", pct(ttft, 0.9)}, {"tpot_p50_ms", pct(tpot, 0.5)}, {"tpot_p90_ms", pct(tpot, 0.9)}, {"steps", steps},
                      {"forward_ms_per_step", fwd_ms / steps}});
  }

  // Prefix cache: the same prompt twice on an idle engine; the second prefills only its last
  // partial block (and the last token, whose logits start decoding).
  std::vector<double> cold, hit;
  {
    EngineOptions eo;
    eo.n_parallel = 1;
    eo.context = ctx;
    eo.kv_tokens = 4 * ctx;
    Engine eng(*t, eo);
    run_level(eng, {prompt()}, 2);
    for (int64_t r = 0; r < o.repetitions; ++r) {
      const std::vector<int32_t> p = prompt();
      const Timing a = run_level(eng, {p}, 2)[0];
      const Timing b = run_level(eng, {p}, 2)[0];
      cold.push_back((a.first - a.submit) * 1e3);
      hit.push_back((b.first - b.submit) * 1e3);
    }
  }
  std::printf("\nTTFT of a %lld-token prompt alone, median of %lld: %.2f ms cold, %.2f ms with a prefix-cache hit (%.1fx)\n",
              (long long)o.n_prompt, (long long)o.repetitions, pct(cold, 0.5), pct(hit, 0.5), pct(cold, 0.5) / pct(hit, 0.5));
  if (o.json) {
    nlohmann::ordered_json j = {{"model", label},
                                {"device", cuda_device_name()},
                                {"prompt_tokens", o.n_prompt},
                                {"new_tokens", o.n_gen},
                                {"levels", levels},
                                {"prefix_ttft_ms", {{"cold", pct(cold, 0.5)}, {"hit", pct(hit, 0.5)}}}};
    std::printf("%s\n", j.dump(2).c_str());
  }
  return 0;
}

#endif

}  // namespace kd::cli
