// `kdtree bench`: llama-bench style prefill / decode throughput, with the weight bytes streamed
// and the ratio to this machine's measured read bandwidth (the decode ceiling on a CPU).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <numeric>
#include <vector>

#include "cli/budget_flags.h"
#include "cli/commands.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "io/checkpoint.h"
#include "cli/device.h"
#include "model/deepseek_v3.h"
#include "model/deepseek_v3_tp.h"
#include "model/tensor_plan.h"
#include "sample/sampler.h"

namespace kd::cli {

void add_bench(CLI::App& app, BenchOptions& o) {
  auto* c = app.add_subcommand("bench", "Measure prefill and decode speed against the memory-bandwidth ceiling");
  c->add_option("-m,--model", o.model, "Checkpoint directory");
  c->add_option("--preset", o.preset,
                "k2-slice: Kimi K2's exact shapes with 12 layers (1 dense + 11 MoE), INT4 experts, random weights made on "
                "the GPU (--device cuda)");
  c->add_option("--preset-layers", o.preset_layers,
                "k2-slice with L layers instead of 12 (1 dense + L − 1 MoE, K2's shapes each): 6 fit an 80 GB H100 "
                "(the 12 need ≈ 116 GB); the floors are the L-layer model's")
      ->transform(whole_number(o.preset_layers))
      ->check(CLI::Range(1, 61));
  c->add_option("-p,--n-prompt", o.n_prompt, "Prompt tokens for the prefill test")
      ->transform(whole_number(o.n_prompt))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("-n,--n-gen", o.n_gen, "Tokens for the decode test")
      ->transform(whole_number(o.n_gen))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("-r,--repetitions", o.repetitions, "Repetitions; the median is reported")
      ->transform(whole_number(o.repetitions))
      ->check(CLI::Range(1, 1000));
  c->add_option("--device", o.device, "cpu (default) or cuda (GPU 0; prints the verify cost curve too)");
  c->add_flag("--json", o.json, "Print one JSON object");
  c->add_option("--serve", o.serve,
                 "The serving engine's load test instead (CPU with -m DIR, or --device cuda) — for each concurrency C (e.g. "
                 "1,4,16,64), max(8, 2C) requests of -p prompt and -n new tokens submitted at once with --parallel C: "
                 "tokens/s, TTFT and TPOT percentiles; then TTFT of a -p-token prompt without and with a prefix-cache hit")
      ->delimiter(',')
      ->transform(whole_number(o.serve))
      ->check(CLI::Range(1, 1024));
  c->add_option("--long-prompt", o.long_prompt,
                "With --serve, last: the chunked-prefill test — --streams requests (prompts of -p tokens) decode, then one "
                "prompt of this many tokens arrives; for each --prefill-chunks K, its TTFT and the streams' token gaps "
                "(TPOT p50 before it, p50 / p99 / max while it prefills)")
      ->transform(whole_number(o.long_prompt))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--prefill-chunks", o.prefill_chunks,
                "With --long-prompt: the prompt tokens a sequence prefills per step to compare (default 256,2048 and the "
                "whole prompt; serve's --prefill-chunk, its default 256)")
      ->delimiter(',')
      ->transform(whole_number(o.prefill_chunks))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--streams", o.streams, "With --long-prompt: the decoding requests it arrives among (default 8)")
      ->transform(whole_number(o.streams))
      ->check(CLI::Range(1, 256));
  c->add_flag("--verify-curve", o.verify_curve,
              "Also time one DDTree verify forward over N tree nodes, N = 1, 2, 4 … 64, after the prompt: cost(N)/cost(1)");
  c->add_option("--verify-sizes", o.verify_sizes,
                "Tree nodes N of the verify curve (default 1,2,4,8,16,32,64; the first is the cost ratio's base; "
                "on the CPU with --verify-curve)")
      ->delimiter(',')
      ->transform(whole_number(o.verify_sizes))
      ->check(CLI::Range(1, 4096));
  add_tp_flags(c, o.tp);
  c->add_option("--draft", o.draft,
                "A DFlash drafter directory: the speculative bench instead — for each prompt, decode tokens/s of AR and of "
                "--spec at each --budget (median of -r, runs interleaved), the speedup, τ, --budget auto's AR steps, and a "
                "check that the output is AR's; greedy repetition loops (an n-gram of 8+ tokens seen 3+ times) are flagged "
                "and summarised apart. Every run decodes -n tokens (EOS ignored)");
  c->add_option("--spec", o.spec, "With --draft: ddtree (default) or dflash (the drafter's chain)");
  c->add_option("--budget", o.budgets,
                "With --draft: the configurations, comma-separated — DDTree tree nodes N or auto (default auto); with "
                "--spec dflash chain (the whole chain, the default) or auto")
      ->delimiter(',');
  c->add_option("--budget-max", o.budget_max, cat("With --draft and --budget auto: the largest tree (default ", kDefaultBudgetMax, ")"));
  c->add_option("--prompt-ids", o.prompt_ids, "With --draft: one prompt as comma-separated token ids");
  c->add_option("--prompts", o.prompts,
                "With --draft: a JSON array of prompts, each an array of token ids or an object with \"ids\" (as "
                "assets/pair/eval_prompts.json)");
  c->add_option("--prompt-limit", o.prompt_limit, "With --prompts: only the first K prompts (default all)")
      ->transform(whole_number(o.prompt_limit))
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  c->add_option("--json-schema", o.json_schema,
                "With --draft: decode under this JSON Schema (as response_format's json_schema.schema, strict: true; the "
                "server's separators) through the serving engine — per prompt AR under the grammar, then DDTree with the draft "
                "tree masked by the grammar and unmasked: tau, drafted nodes a round, tok/s; every output must equal AR's");
  c->add_option("--gbnf", o.gbnf, "With --draft: as --json-schema, under this GBNF grammar (llama.cpp's format, root rule 'root')");
  c->add_option("--temp", o.temp, "With --draft: sampling temperature (default 0, greedy; T > 0 is seeded, so AR's tokens still match)");
  c->add_option("-s,--seed", o.seed, "With --draft and --temp > 0: the sampling seed (default 0)");
}

namespace {

// CPU seconds of the whole process (all threads, spinning included). On a shared machine the wall
// clock also counts other tenants' time slices; with KDTREE_THREADS=1 this is the work alone.
double process_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Read-only streaming bandwidth over a buffer much larger than the caches, all threads, in GB/s.
double measure_read_bandwidth() {
  const size_t n = size_t(512) << 20;  // 2 GiB of floats, far past any cache
  std::vector<float> buf(n, 1.0f);
  std::vector<double> runs;
  for (int rep = 0; rep < 9; ++rep) {
    std::vector<float> partial(size_t(ThreadPool::global().size()), 0.0f);
    const double t0 = now_s();
    ThreadPool::global().parallel_for(int64_t(n), 1 << 20, [&](int64_t b, int64_t e) {
      float acc[64] = {};  // enough independent chains that the adds never limit the reads
      for (int64_t i = b; i + 64 <= e; i += 64)
        for (int j = 0; j < 64; ++j) acc[j] += buf[size_t(i + j)];
      float s = 0;
      for (float a : acc) s += a;
      partial[size_t(b * int64_t(partial.size()) / int64_t(n))] = s;
    });
    const double dt = now_s() - t0;
    if (std::accumulate(partial.begin(), partial.end(), 0.0) <= 0) fail("bandwidth probe: bad sum");
    runs.push_back(double(n * sizeof(float)) / dt / 1e9);
  }
  return median(runs);
}

}  // namespace

std::vector<int64_t> verify_sizes_or_default(const BenchOptions& o) {
  return o.verify_sizes.empty() ? std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64} : o.verify_sizes;
}

int cmd_bench(const BenchOptions& o) {
  if (o.preset_layers > 0 && o.preset.empty()) fail("--preset-layers sets the k2-slice preset's depth: add --preset k2-slice");
  if (!o.draft.empty()) return cmd_bench_spec(o);
  if (o.spec != "ddtree" || !o.budgets.empty() || !o.budget_max.empty() || !o.prompt_ids.empty() || !o.prompts.empty() ||
      o.prompt_limit != 0 || o.temp != 0 || o.seed != 0 || !o.json_schema.empty() || !o.gbnf.empty())
    fail("--spec, --budget, --budget-max, --prompt-ids, --prompts, --prompt-limit, --temp, --seed, --json-schema and --gbnf are the "
         "speculative bench's: add --draft DIR");
  if (o.serve.empty() && (o.long_prompt > 0 || !o.prefill_chunks.empty() || o.streams != 8))
    fail("--long-prompt, --prefill-chunks and --streams are the --serve load test's: add --serve C (e.g. --serve 1)");
  if (o.long_prompt == 0 && (!o.prefill_chunks.empty() || o.streams != 8))
    fail("--prefill-chunks and --streams set up the chunked-prefill test: add --long-prompt P");
  if (!o.serve.empty() && !o.verify_sizes.empty()) fail("--verify-sizes: the --serve load test has no verify curve");
  if (!o.serve.empty() && o.verify_curve) fail("--verify-curve: the --serve load test has no verify curve");
  if (o.device == "cuda") return o.serve.empty() ? cmd_bench_cuda(o) : cmd_bench_serve_cuda(o);
  if (o.device != "cpu") fail("--device ", o.device, ": unknown device (choose cpu or cuda)");
  if (!o.serve.empty()) {
    if (!o.preset.empty()) fail("--preset ", o.preset, ": presets are benchmarked on the GPU only (--device cuda)");
    return cmd_bench_serve_cpu(o);
  }
  if (!o.preset.empty()) fail("--preset ", o.preset, ": presets are benchmarked on the GPU only (--device cuda)");
  if (!o.verify_sizes.empty() && !o.verify_curve) fail("--verify-sizes: add --verify-curve (on the CPU the verify curve is opt-in)");
  if (o.model.empty()) fail("bench needs -m DIR (or --device cuda --preset k2-slice)");
  Checkpoint ckpt(o.model);
  check_tp_flags(o.tp, false, ckpt.config());
  DeepseekV3 model(ckpt);
  std::unique_ptr<DeepseekV3Tp> tp;
  if (o.tp.tp > 1) tp = std::make_unique<DeepseekV3Tp>(ckpt, o.tp.tp);
  const Target& target = tp ? static_cast<const Target&>(*tp) : model;
  const ModelConfig& c = model.config();
  const ModelStats stats = model_stats(c);
  log_info("measuring memory read bandwidth …");
  const double bw = measure_read_bandwidth();

  std::vector<int32_t> prompt(size_t(o.n_prompt));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));
  std::vector<double> pp_ms, tg_ms, pp_gb, tg_gb, tg_comm_ms;  // tg_comm_ms: rank 0's communicator time (--tp R)
  auto comm_s = [&] { return tp ? tp->comm_seconds() : 0.0; };
  std::vector<float> logits(size_t(c.vocab_size));
  for (int64_t rep = 0; rep < o.repetitions + 1; ++rep) {  // the first repetition warms caches and is dropped
    LatentCache cache = model.new_cache(o.n_prompt + o.n_gen + 1);
    ForwardStats st;
    double t0 = now_s();
    forward_cached(target, cache, prompt.data(), o.n_prompt, AttnForm::expanded, false, logits.data(), &st);
    const double pp = (now_s() - t0) * 1e3;
    const uint64_t pp_bytes = st.weight_bytes;
    st = {};
    const double comm0 = comm_s();
    t0 = now_s();
    for (int64_t i = 0; i < o.n_gen; ++i) {
      int32_t tok = argmax(logits.data(), int32_t(c.vocab_size));
      forward_cached(target, cache, &tok, 1, AttnForm::absorbed, false, logits.data(), &st);
    }
    const double tg = (now_s() - t0) * 1e3;
    if (rep == 0) continue;
    tg_comm_ms.push_back((comm_s() - comm0) * 1e3);
    pp_ms.push_back(pp);
    tg_ms.push_back(tg);
    pp_gb.push_back(double(pp_bytes) / (pp * 1e-3) / 1e9);
    tg_gb.push_back(double(st.weight_bytes) / (tg * 1e-3) / 1e9);
  }
  // Verify cost curve: a forward over [root + N nodes] shaped like a DDTree tree (a chain of 8 with
  // siblings filling the rest), uncommitted, absorbed MLA with the ancestor mask — what a round pays.
  struct VerifyPoint {
    int64_t nodes;
    double ms, cpu_ms;      // wall clock; process CPU time
    double comm_ms;         // --tp R: rank 0's communicator time within ms (0 without TP)
    uint64_t weight_bytes;  // every matrix the forward touched, each routed expert once
  };
  std::vector<VerifyPoint> curve;
  if (o.verify_curve) {
    for (int64_t N : verify_sizes_or_default(o)) {
      const int64_t n = N + 1;
      std::vector<int32_t> ids(static_cast<size_t>(n)), pos(static_cast<size_t>(n)), parent(static_cast<size_t>(n), -1);
      std::vector<int32_t> depth(static_cast<size_t>(n), 0);
      for (int64_t i = 1; i < n; ++i) {
        parent[size_t(i)] = i <= 7 ? int32_t(i - 1) : int32_t((i * 5) % 7);  // a chain, then siblings on it
        depth[size_t(i)] = depth[size_t(parent[size_t(i)])] + 1;
        ids[size_t(i)] = int32_t((i * 131 + 11) % c.vocab_size);
      }
      std::vector<uint8_t> vis(static_cast<size_t>(n * n), 0);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t a = i; a >= 0; a = parent[size_t(a)]) vis[size_t(i * n + a)] = 1;
        pos[size_t(i)] = int32_t(o.n_prompt + depth[size_t(i)]);
      }
      std::vector<float> vlogits(static_cast<size_t>(n * c.vocab_size));
      std::vector<double> runs, cpu_runs, comm_runs;
      ForwardStats vst;
      LatentCache cache = model.new_cache(o.n_prompt + n + 1);
      forward_cached(target, cache, prompt.data(), o.n_prompt, AttnForm::expanded, false, logits.data());
      for (int64_t rep = 0; rep < o.repetitions + 1; ++rep) {
        ForwardArgs a;
        a.ids = ids.data();
        a.n = n;
        a.positions = pos.data();
        a.visibility = vis.data();
        a.commit = false;
        a.all_logits = true;
        a.logits = vlogits.data();
        vst = {};
        a.stats = &vst;
        const double t0 = now_s(), c0 = process_cpu_s(), m0 = comm_s();
        forward_cached(target, cache, a);
        if (rep > 0) {
          runs.push_back((now_s() - t0) * 1e3);
          cpu_runs.push_back((process_cpu_s() - c0) * 1e3);
          comm_runs.push_back((comm_s() - m0) * 1e3);
        }
      }
      curve.push_back({N, median(runs), median(cpu_runs), median(comm_runs), vst.weight_bytes});
    }
  }
  const double pp = median(pp_ms), tg = median(tg_ms);
  const double pp_tps = double(o.n_prompt) / pp * 1e3, tg_tps = double(o.n_gen) / tg * 1e3;
  const double pp_gbps = median(pp_gb), tg_gbps = median(tg_gb);
  const int threads = ThreadPool::global().size();
  // --tp R: per decode token, rank 0's time in the communicator (the reductions and the argmax exchange,
  // with the wait for the slowest rank), median over the repetitions.
  const double tg_comm = tp ? median(tg_comm_ms) / double(o.n_gen) : 0.0;
  const double tg_token_ms = tg / double(o.n_gen);
  if (o.json) {
    nlohmann::ordered_json j = {
        {"model", o.model}, {"backend", "cpu"}, {"tensor_parallel", o.tp.tp}, {"threads", threads}, {"weights_bytes", stats.stored_bytes},
        {"read_bandwidth_gb_per_s", bw}, {"repetitions", o.repetitions},
        {"prefill", {{"tokens", o.n_prompt}, {"ms", pp}, {"tokens_per_s", pp_tps}, {"weight_gb_per_s", pp_gbps}}},
        {"decode", {{"tokens", o.n_gen}, {"ms", tg}, {"tokens_per_s", tg_tps}, {"weight_gb_per_s", tg_gbps},
                    {"fraction_of_read_bandwidth", tg_gbps / bw}}}};
    if (!curve.empty()) {
      nlohmann::ordered_json jc = nlohmann::ordered_json::array();
      for (const VerifyPoint& v : curve) {
        jc.push_back({{"nodes", v.nodes}, {"ms", v.ms}, {"cost_ratio", v.ms / curve[0].ms}, {"cpu_ms", v.cpu_ms}, {"weight_bytes", v.weight_bytes},
                      {"floor_ms", double(v.weight_bytes) / bw * 1e-6}});
        if (tp) jc.back()["comm_ms"] = v.comm_ms;
      }
      j["verify_curve"] = jc;
    }
    if (tp)
      j["tensor_parallel_comm"] = {{"ranks", o.tp.tp}, {"reductions_per_step", 2 * c.num_hidden_layers},
                              {"decode_comm_ms_per_token", tg_comm}, {"decode_ms_per_token", tg_token_ms},
                              {"decode_comm_share", tg_comm / tg_token_ms},
                              {"comm_timed", "rank 0's wall time in the communicator, waits for the other ranks included"}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("| model | size | backend | threads | test | t/s | GB/s | %% of read bw |\n");
  std::printf("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: |\n");
  const std::string backend = o.tp.tp > 1 ? cat("cpu tp", o.tp.tp) : std::string("cpu");
  std::printf("| %s | %.1f MB | %s | %d | pp%lld | %.2f | %.2f | %.1f %% |\n", o.model.c_str(), double(stats.stored_bytes) / 1e6, backend.c_str(),
              threads, (long long)o.n_prompt, pp_tps, pp_gbps, 100 * pp_gbps / bw);
  std::printf("| %s | %.1f MB | %s | %d | tg%lld | %.2f | %.2f | %.1f %% |\n", o.model.c_str(), double(stats.stored_bytes) / 1e6, backend.c_str(),
              threads, (long long)o.n_gen, tg_tps, tg_gbps, 100 * tg_gbps / bw);
  if (!curve.empty()) {
    // Floor: the weight bytes the forward touched (routed experts: the distinct ones its rows chose)
    // at the read bandwidth measured above.
    std::printf("\n| verify nodes N | ms | cost(N)/cost(1) | process CPU ms | weight MB | floor ms | %% of floor |%s\n"
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |%s\n",
                tp ? " comm ms (rank 0) |" : "", tp ? " ---: |" : "");
    for (const VerifyPoint& v : curve) {
      const double floor_ms = double(v.weight_bytes) / bw * 1e-6;
      std::printf("| %lld | %.2f | %.2f | %.2f | %.1f | %.2f | %.0f %% |", (long long)v.nodes, v.ms, v.ms / curve[0].ms, v.cpu_ms,
                  double(v.weight_bytes) / 1e6, floor_ms, 100 * floor_ms / v.ms);
      if (tp) std::printf(" %.2f |", v.comm_ms);
      std::printf("\n");
    }
  }
  if (tp)
    std::printf("\ntensor parallel over %d CPU ranks: %lld reductions a step; rank 0 spends %.3f of a decode token's %.3f ms in the "
                "communicator (%.0f %%: the rank-order sums, the argmax exchange and the wait for the slowest rank)\n",
                o.tp.tp, (long long)(2 * c.num_hidden_layers), tg_comm, tg_token_ms, 100 * tg_comm / tg_token_ms);
  std::printf("\nmeasured read bandwidth: %.2f GB/s (%d threads, median of 9); median of %lld repetitions\n", bw, threads,
              (long long)o.repetitions);
  return 0;
}

}  // namespace kd::cli
