// `kdtree bench --serve C1,C2,…`: the serving engine's load test (the Engine over the target —
// everything `kdtree serve` runs but HTTP and the tokenizer), on the CPU (-m DIR) or the GPU
// (--device cuda: the paged CUDA target; --preset k2-slice: random weights made on the GPU), and with
// --tp R over the tensor-parallel target (R CPU ranks, or one rank a GPU of --devices) as serve --tp R.
// For each concurrency C: max(8, 2C) requests of -p random prompt tokens and -n new tokens
// (greedy, ignore_eos) submitted at once to an engine with --parallel C; tokens/s over the level,
// TTFT (submit → first token) and TPOT ((done − first) / (tokens − 1)) percentiles. Then TTFT of a
// -p-token prompt alone, without and with a prefix-cache hit (the same prompt again), median of
// -r pairs. With --long-prompt P, last, the chunked-prefill test (issue 17 §4): --streams S
// requests decode while one P-token prompt arrives, for each --prefill-chunks K — what the long
// prompt's TTFT costs the running streams' token gaps, and the other way round.
#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/commands.h"
#include "cli/device.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#ifdef KDTREE_HAVE_CUDA
#include "cli/bench_cuda.h"
#include "model/deepseek_v3_cuda.h"
#endif

namespace kd::cli {

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

// The chunked-prefill test at one prefill chunk K: S streams decode (prompts of n_prompt tokens);
// once each has committed 9 tokens (8 gaps of steady decoding), one prompt of P tokens arrives;
// when its first token is out the streams are cancelled. Per stream, the time of each token; a gap
// is "during" when it ends after the long prompt was submitted and no later than its first token.
// The step's prompt-row budget is lifted (step_prefill_tokens 0) so that K alone sets the chunk.
struct LongRun {
  int64_t chunk = 0;
  double ttft_ms = 0, before_p50 = 0, during_p50 = 0, during_p99 = 0, during_max = 0;
  int64_t gaps_during = 0, steps_during = 0;
  int64_t max_prefill_rows = 0;  // over the engine's whole run (the streams' own prefill included)
};

LongRun run_long(const Target& t, const BenchOptions& o, int64_t chunk, int64_t ctx,
                 const std::function<std::vector<int32_t>(int64_t)>& prompt_of) {
  const int64_t S = o.streams, P = o.long_prompt;
  EngineOptions eo;
  eo.n_parallel = S + 1;
  eo.context = ctx;
  eo.kv_tokens = (S + 1) * (ctx + 2 * eo.kv_block);  // each request's worst case, in whole blocks
  eo.prefix_cache = false;
  eo.prefill_chunk = chunk;
  eo.step_prefill_tokens = 0;
  eo.max_queue = 1 << 20;
  Engine eng(t, eo);
  run_level(eng, {prompt_of(o.n_prompt)}, 2);  // warm-up (first-use costs)

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<double>> times(static_cast<size_t>(S));
  std::vector<std::string> finish(static_cast<size_t>(S));
  size_t streams_done = 0, warm = 0;
  bool stop = false;
  for (int64_t k = 0; k < S; ++k) {
    EngineRequest r;
    r.prompt = prompt_of(o.n_prompt);
    r.gen.max_new_tokens = ctx - o.n_prompt;
    r.gen.ignore_eos = true;
    r.on_event = [&, k](const EngineEvent& ev) {
      const double now = now_s();
      std::lock_guard<std::mutex> lk(mu);
      auto& tk = times[size_t(k)];
      const size_t had = tk.size();
      for (size_t i = 0; i < ev.ids.size(); ++i) tk.push_back(now);
      if (had < 9 && tk.size() >= 9) ++warm;
      if (ev.done) {
        finish[size_t(k)] = ev.finish_reason;
        ++streams_done;
      }
      cv.notify_all();
      return !stop;
    };
    eng.submit(std::move(r));
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return warm == size_t(S) || streams_done > 0; });
    if (streams_done > 0) fail("bench --long-prompt: a stream ended before the long prompt was sent (context ", ctx, ")");
  }
  const EngineMetrics m0 = eng.metrics();
  Timing lt;
  bool long_done = false;
  {
    EngineRequest r;
    r.prompt = prompt_of(P);
    r.gen.max_new_tokens = 1;
    r.gen.ignore_eos = true;
    r.on_event = [&](const EngineEvent& ev) {
      const double now = now_s();
      std::lock_guard<std::mutex> lk(mu);
      if (!ev.ids.empty() && lt.first == 0) lt.first = now;
      if (ev.done) {
        lt.finish = ev.finish_reason;
        long_done = true;
        stop = true;  // the streams' next events cancel them
      }
      cv.notify_all();
      return true;
    };
    std::lock_guard<std::mutex> lk(mu);
    lt.submit = now_s();
    eng.submit(std::move(r));
  }
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return long_done; });
  const EngineMetrics m1 = eng.metrics();
  if (lt.finish != "length") fail("bench --long-prompt: the long prompt ended with '", lt.finish, "'");
  cv.wait(lk, [&] { return streams_done == size_t(S); });
  LongRun r;
  r.chunk = chunk;
  r.ttft_ms = (lt.first - lt.submit) * 1e3;
  std::vector<double> before, during;
  for (int64_t k = 0; k < S; ++k) {
    const auto& tk = times[size_t(k)];
    if (finish[size_t(k)] == "length" && tk.back() <= lt.first)
      fail("bench --long-prompt: stream ", k, " reached the context (", ctx, " tokens) before the long prompt's first token");
    for (size_t i = 1; i < tk.size(); ++i) {
      const double g = (tk[i] - tk[i - 1]) * 1e3;
      if (tk[i] <= lt.submit)
        before.push_back(g);
      else if (tk[i] <= lt.first)
        during.push_back(g);
    }
  }
  r.before_p50 = pct(before, 0.5);
  r.during_p50 = pct(during, 0.5);
  r.during_p99 = pct(during, 0.99);
  r.during_max = during.empty() ? 0 : *std::max_element(during.begin(), during.end());
  r.gaps_during = int64_t(during.size());
  r.steps_during = int64_t(m1.steps - m0.steps);
  r.max_prefill_rows = m1.max_prefill_rows;
  return r;
}

}  // namespace

int bench_serve(const Target& t, const std::string& label, const std::string& device, const BenchOptions& o) {
  const ModelConfig& c = t.config();
  uint64_t salt = 1;
  auto prompt_of = [&](int64_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (size_t i = 0; i < p.size(); ++i) p[i] = int32_t((i * 7919 + salt * 104729 + 13) % uint64_t(c.vocab_size));
    ++salt;
    return p;
  };
  auto prompt = [&] { return prompt_of(o.n_prompt); };
  const int64_t ctx = o.n_prompt + o.n_gen + 8;

  nlohmann::ordered_json levels = nlohmann::ordered_json::array();
  std::printf("device: %s; %s; prompts of %lld tokens, %lld new tokens each (greedy)\n", device.c_str(), label.c_str(),
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
    Engine eng(t, eo);
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
    Engine eng(t, eo);
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

  nlohmann::ordered_json jlong;
  if (o.long_prompt > 0) {
    // Room for the long prompt, and for each stream to keep decoding while it prefills: a stream
    // commits a token a step, and a step holds at most one chunk of the long prompt, so P / K + 1
    // steps; the smallest chunk bounds it (and 64 steps of slack for the warm-up and the tail).
    std::vector<int64_t> chunks = o.prefill_chunks.empty() ? std::vector<int64_t>{256, 2048, o.long_prompt} : o.prefill_chunks;
    for (int64_t& k : chunks) k = std::min(k, o.long_prompt);
    std::sort(chunks.begin(), chunks.end());
    chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
    const int64_t steps_max = o.long_prompt / chunks.front() + 1 + 64;
    const int64_t lctx = std::max(o.long_prompt + 8, o.n_prompt + steps_max + 8);
    const int64_t limit = std::min(c.max_position_embeddings, t.max_context());
    if (lctx > limit)
      fail("bench --long-prompt ", o.long_prompt, ": needs a context of ", lctx, " tokens (the prompt, or the streams' ",
           steps_max, " steps at a chunk of ", chunks.front(), "), but this target holds ", limit);
    std::printf("\nA %lld-token prompt arriving while %lld streams decode (prompts of %lld tokens; the step's prompt-row budget "
                "lifted, so the chunk alone bounds a step):\n",
                (long long)o.long_prompt, (long long)o.streams, (long long)o.n_prompt);
    std::printf("| prefill chunk | long prompt TTFT ms | stream TPOT p50 before ms | during: p50 ms | p99 ms | max ms | gaps | "
                "steps |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    nlohmann::ordered_json runs = nlohmann::ordered_json::array();
    for (int64_t k : chunks) {
      const LongRun r = run_long(t, o, k, lctx, prompt_of);
      std::printf("| %lld | %.1f | %.2f | %.2f | %.2f | %.2f | %lld | %lld |\n", (long long)k, r.ttft_ms, r.before_p50,
                  r.during_p50, r.during_p99, r.during_max, (long long)r.gaps_during, (long long)r.steps_during);
      std::fflush(stdout);
      runs.push_back({{"prefill_chunk", k}, {"ttft_ms", r.ttft_ms}, {"tpot_before_p50_ms", r.before_p50},
                      {"tpot_during_p50_ms", r.during_p50}, {"tpot_during_p99_ms", r.during_p99},
                      {"tpot_during_max_ms", r.during_max}, {"gaps_during", r.gaps_during}, {"steps_during", r.steps_during},
                      {"max_prefill_rows_run", r.max_prefill_rows}});
    }
    jlong = {{"tokens", o.long_prompt}, {"streams", o.streams}, {"stream_prompt_tokens", o.n_prompt}, {"runs", runs}};
  }
  if (o.json) {
    nlohmann::ordered_json j = {{"model", label},
                                {"device", device},
                                {"prompt_tokens", o.n_prompt},
                                {"new_tokens", o.n_gen},
                                {"levels", levels},
                                {"prefix_ttft_ms", {{"cold", pct(cold, 0.5)}, {"hit", pct(hit, 0.5)}}}};
    if (!jlong.is_null()) j["long_prompt"] = jlong;
    std::printf("%s\n", j.dump(2).c_str());
  }
  return 0;
}

// -m DIR on either device: the target as `serve` loads it (LoadedTarget: the memory plan, --tp R over CPU
// ranks or a GPU a rank of --devices); a one-row GPU cache to start with (each engine lends its pool).
static int bench_serve_checkpoint(const BenchOptions& o) {
  if (o.model.empty()) fail("bench --serve needs -m DIR (or --device cuda --preset k2-slice)");
  const LoadedTarget lt(o.device, o.model, o.tp, 1);
  return bench_serve(lt.target(), o.model, lt.target().device(), o);
}

int cmd_bench_serve_cpu(const BenchOptions& o) { return bench_serve_checkpoint(o); }

#ifndef KDTREE_HAVE_CUDA

int cmd_bench_serve_cuda(const BenchOptions&) {
  fail("--device cuda: this build has no CUDA backend (configure with -DKDTREE_CUDA=ON where nvcc is installed)");
}

#else

int cmd_bench_serve_cuda(const BenchOptions& o) {
  if (o.tp.tp > 1 && !o.preset.empty())
    fail("--preset ", o.preset, " --tp ", o.tp.tp, " --serve: the preset times one rank's share, which no engine serves alone; "
         "the load test under tensor parallelism needs the whole target: -m DIR --tp R");
  if (o.preset.empty()) return bench_serve_checkpoint(o);
  // A one-row cache to start with: each engine replaces it by its paged pool.
  BenchTarget bt = load_bench_target(o, 1, "bench --device cuda --serve");
  return bench_serve(*bt.target, bt.label, cuda_device_name(), o);
}

#endif

}  // namespace kd::cli
