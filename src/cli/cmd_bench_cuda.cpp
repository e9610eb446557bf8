// `kdtree bench --device cuda`: prefill, AR decode and the DDTree verify cost curve of the GPU
// target, each against its byte floor (PERF.md): bytes a step must read at least (every weight it
// touches once — routed experts as actually touched — plus the latent KV it attends to) over the
// streaming read bandwidth measured in the same run. Times are CUDA-event medians.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "model/make_model.h"
#include "model/tp_plan.h"
#ifdef KDTREE_HAVE_CUDA
#include "model/deepseek_v3_cuda.h"
#include "model/deepseek_v3_cuda_tp.h"
#include "cli/bench_cuda.h"
#include "cli/device.h"
#include "io/checkpoint.h"
#endif

namespace kd::cli {

#ifndef KDTREE_HAVE_CUDA
int cmd_bench_cuda(const BenchOptions&) {
  fail("--device cuda: this build has no CUDA backend (configure with -DKDTREE_CUDA=ON where nvcc is installed)");
}
#else

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// PERF.md's k2-slice: K2's exact shapes, 1 dense + 11 MoE layers. ranks > 1: the shapes one of
// `ranks` tensor-parallel ranks computes (model/tp_plan.h) — its heads, its slice of every MLP's
// intermediate dimension, its lm_head rows; the latent projections, router and KV unsplit — so its
// kernels are exactly a rank's, without the reductions (timed apart).
// K2's shapes with `layers` layers (the first dense, as K2's first_k_dense_replace = 1; 0: the preset's 12).
ModelConfig k2_slice_config(int32_t ranks, int64_t layers) {
  nlohmann::json j = nlohmann::json::parse(preset_config_json("k2"));
  j["num_hidden_layers"] = layers > 0 ? layers : 12;
  if (ranks > 1) {
    const TpPlan p = plan_tp(parse_model_config(j.dump(), "preset k2-slice"), ranks);
    j["num_attention_heads"] = p.heads_per_rank;
    j["num_key_value_heads"] = p.heads_per_rank;
    j["moe_intermediate_size"] = p.moe_intermediate_per_rank;
    j["intermediate_size"] = p.dense_intermediate_per_rank;
    j["vocab_size"] = p.vocab_rows_per_rank;
    j["bos_token_id"] = 1;  // K2's ids lie past a rank's vocabulary rows; the benchmark feeds its own tokens
    j["eos_token_id"] = 2;
  }
  return parse_model_config(j.dump(), "preset k2-slice");
}

}  // namespace

BenchTarget load_bench_target(const BenchOptions& o, int64_t max_tokens, const char* what) {
  if (!o.preset.empty() && !o.model.empty()) fail("give -m DIR or --preset, not both");
  if (!o.preset.empty() && o.preset != "k2-slice") fail("--preset ", o.preset, ": unknown (the GPU benchmark preset is k2-slice)");
  if (o.preset.empty() && o.model.empty()) fail(what, " needs -m DIR or --preset k2-slice");
  if (!cuda_device_available()) fail("--device cuda: ", cuda_device_name());
  if (!o.tp.devices.empty())
    fail("--devices: ", what, " runs on GPU 0 (pick another with CUDA_VISIBLE_DEVICES; --devices applies with -m DIR --tp R)");
  const uint64_t limit = uint64_t(o.tp.gpu_memory_limit_gib * double(1ull << 30));
  BenchTarget b;
  if (!o.preset.empty()) {
    const ModelConfig cfg = k2_slice_config(o.tp.tp, o.preset_layers);
    check_gpu_memory_plan(cfg, {0}, limit, max_tokens, cat("bench --device cuda --preset ", o.preset));
    log_info("making k2-slice's random weights on the GPU …");
    b.target = std::make_unique<CudaTarget>(cfg, max_tokens, 1234, true);
    const std::string depth = o.preset_layers > 0 ? cat(", ", o.preset_layers, " layers") : std::string();
    b.label = o.tp.tp > 1 ? cat("k2-slice", depth, ", one rank of TP ", o.tp.tp, " (random, INT4 g32 experts)")
                          : cat("k2-slice", depth, " (random, INT4 g32 experts)");
  } else {
    Checkpoint ck(o.model);
    check_gpu_memory_plan(ck.config(), {0}, limit, max_tokens, "bench --device cuda");  // before a weight is read
    DeepseekV3 model(ck);
    Progress progress("loading weights to GPU 0", plan_tp(ck.config(), 1).weight_bytes_by_rank[0], "B");
    b.target = std::make_unique<CudaTarget>(model, max_tokens, &progress);  // the weights are on the device now
    progress.finish();
    b.label = o.model;
  }
  return b;
}


namespace {

// `bench --device cuda -m DIR --tp R`: the tensor-parallel target made from the checkpoint (as run and
// serve make it: LoadedTarget, its memory plan and devices), timed through the Target interface as the
// engine drives it — one sequence in a paged KV, argmax outputs, a host sync a forward — wall-clock
// medians: prefill, AR decode steps and the verify cost curve. The reductions' share: a reduction of
// 1 and 17 rows among R ranks on this GPU, timed alone (the emulation's SharedDeviceComm), times the
// 2 a layer a step makes; over NCCL (a GPU a rank) it is not timed here.
int bench_cuda_tp(const BenchOptions& o) {
  const std::vector<int64_t> nodes = verify_sizes_or_default(o);
  const int64_t cap = o.n_prompt + std::max<int64_t>(o.n_gen, *std::max_element(nodes.begin(), nodes.end()) + 1) + 2;
  const LoadedTarget lt("cuda", o.model, o.tp, cap);
  const auto& t = static_cast<const CudaTpTarget&>(lt.target());
  const ModelConfig& c = t.config();
  const int32_t R = t.ranks();
  const int64_t bt = 16, nb = (cap + bt - 1) / bt;
  t.init_kv(nb, bt);
  KvView kv;
  kv.dim = c.latent_dim();
  kv.n_layers = c.num_hidden_layers;
  kv.block_tokens = bt;
  for (int64_t b = 0; b < nb; ++b) kv.blocks.push_back(int32_t(b));
  std::vector<int32_t> am_ids(static_cast<size_t>(cap));
  std::vector<float> am_vals(static_cast<size_t>(cap));
  // One forward of the sequence (rows after `start` committed rows), argmax outputs; wall milliseconds.
  auto forward = [&](const std::vector<int32_t>& ids, int64_t start, const int32_t* pos, const uint8_t* vis, bool all_rows) {
    SeqForward s;
    s.kv = kv;
    s.start = start;
    s.args.ids = ids.data();
    s.args.n = int64_t(ids.size());
    s.args.positions = pos;
    s.args.visibility = vis;
    s.args.all_logits = all_rows;
    s.args.argmax_ids = am_ids.data();
    s.args.argmax_vals = am_vals.data();
    const double t0 = now_s();
    t.forward_batch({s});
    return (now_s() - t0) * 1e3;
  };
  std::vector<int32_t> prompt(static_cast<size_t>(o.n_prompt));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));
  std::vector<double> pp, tg;
  for (int64_t rep = 0; rep < o.repetitions + 1; ++rep) {  // the first repetition warms up and is dropped
    const double ms = forward(prompt, 0, nullptr, nullptr, false);
    std::vector<double> steps;
    for (int64_t i = 0; i < o.n_gen; ++i) steps.push_back(forward({am_ids[0]}, o.n_prompt + i, nullptr, nullptr, false));
    if (rep == 0) continue;
    pp.push_back(ms);
    tg.insert(tg.end(), steps.begin(), steps.end());
  }
  struct Point {
    int64_t N;
    double ms;
  };
  std::vector<Point> curve;
  forward(prompt, 0, nullptr, nullptr, false);
  for (int64_t N : nodes) {
    // [root + N nodes] shaped like a DDTree tree (a chain of 7, then siblings on it), uncommitted.
    const int64_t n = N + 1;
    std::vector<int32_t> ids(static_cast<size_t>(n)), pos(static_cast<size_t>(n)), parent(static_cast<size_t>(n), -1);
    std::vector<int32_t> depth(static_cast<size_t>(n), 0);
    std::vector<uint8_t> vis(static_cast<size_t>(n * n), 0);
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0) {
        parent[size_t(i)] = i <= 7 ? int32_t(i - 1) : int32_t((i * 5) % 7);
        depth[size_t(i)] = depth[size_t(parent[size_t(i)])] + 1;
      }
      ids[size_t(i)] = int32_t((i * 131 + 11) % c.vocab_size);
      for (int64_t a = i; a >= 0; a = parent[size_t(a)]) vis[size_t(i * n + a)] = 1;
      pos[size_t(i)] = int32_t(o.n_prompt + depth[size_t(i)]);
    }
    std::vector<double> runs;
    for (int64_t rep = 0; rep < o.repetitions + 1; ++rep) {
      const double ms = forward(ids, o.n_prompt, pos.data(), vis.data(), true);
      if (rep > 0) runs.push_back(ms);
    }
    curve.push_back({N, median(runs)});
  }
  const double pp_ms = median(pp), tg_ms = median(tg);
  const int64_t reductions = 2 * c.num_hidden_layers;
  double red_us_1 = 0, red_us_17 = 0;
  if (t.shared_device()) {
    red_us_1 = timed_reduction_us(R, 1, c.hidden_size, 200);
    red_us_17 = timed_reduction_us(R, 17, c.hidden_size, 200);
  }
  const double red_ms = double(reductions) * red_us_1 * 1e-3;
  uint64_t weights = 0;
  for (int32_t r = 0; r < R; ++r) weights += t.rank(r).device_weight_bytes();
  if (o.json) {
    nlohmann::ordered_json j = {
        {"model", o.model}, {"backend", "cuda"}, {"device", t.device()}, {"weights_bytes", weights},
        {"repetitions", o.repetitions},
        {"prefill", {{"tokens", o.n_prompt}, {"ms", pp_ms}, {"tokens_per_s", double(o.n_prompt) / pp_ms * 1e3}}},
        {"decode", {{"steps", o.n_gen}, {"ms_per_token", tg_ms}, {"tokens_per_s", 1e3 / tg_ms}}}};
    nlohmann::ordered_json jc = nlohmann::ordered_json::array();
    for (const Point& p : curve) jc.push_back({{"nodes", p.N}, {"rows", p.N + 1}, {"ms", p.ms}, {"cost_ratio", p.ms / curve[0].ms}});
    j["verify_curve"] = jc;
    nlohmann::ordered_json jt = {{"ranks", R}, {"devices", o.tp.devices}, {"shared_device", t.shared_device()},
                                 {"reductions_per_step", reductions}};
    if (t.shared_device())
      jt.update({{"reduction_us_1_row", red_us_1}, {"reduction_us_17_rows", red_us_17}, {"reduction_ms_per_step", red_ms},
                 {"reduction_share_of_decode", red_ms / tg_ms}, {"reduction_timed", "alone, among the ranks on this GPU"}});
    j["tensor_parallel"] = jt;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("target: %s; weights on the device(s) %.3f GB (all ranks)\n", t.device().c_str(), double(weights) / 1e9);
  std::printf("| model | backend | test | ms | t/s |\n| --- | --- | --- | ---: | ---: |\n");
  std::printf("| %s | cuda tp%d | pp%lld | %.2f | %.1f |\n", o.model.c_str(), R, (long long)o.n_prompt, pp_ms, double(o.n_prompt) / pp_ms * 1e3);
  std::printf("| %s | cuda tp%d | tg%lld (per token) | %.3f | %.1f |\n", o.model.c_str(), R, (long long)o.n_gen, tg_ms, 1e3 / tg_ms);
  std::printf("\n| verify nodes N (+root) | ms | cost(N)/cost(%lld) |\n| ---: | ---: | ---: |\n", (long long)curve[0].N);
  for (const Point& p : curve) std::printf("| %lld | %.3f | %.2f |\n", (long long)p.N, p.ms, p.ms / curve[0].ms);
  if (t.shared_device())
    std::printf("\nreductions: %lld a step; one among %d ranks on this GPU, timed alone: %.1f us (1 row), %.1f us (17 rows) → "
                "%.3f ms of the %.3f ms decode step (%.0f %%)\n",
                (long long)reductions, R, red_us_1, red_us_17, red_ms, tg_ms, 100 * red_ms / tg_ms);
  else
    std::printf("\nreductions: %lld a step over NCCL (a GPU a rank), inside the times above; not timed apart\n", (long long)reductions);
  std::printf("\nwall-clock medians of %lld repetitions (decode: of every step), after one warm-up; each forward ends in a host "
              "sync, as the engine's do\n",
              (long long)o.repetitions);
  return 0;
}

}  // namespace

int cmd_bench_cuda(const BenchOptions& o) {
  if (o.tp.tp > 1 && o.preset.empty() && !o.model.empty()) return bench_cuda_tp(o);
  const std::vector<int64_t> nodes = verify_sizes_or_default(o);
  const int64_t cap = o.n_prompt + std::max<int64_t>(o.n_gen, *std::max_element(nodes.begin(), nodes.end()) + 1) + 2;
  BenchTarget bt = load_bench_target(o, cap, "bench --device cuda");
  std::unique_ptr<CudaTarget> t = std::move(bt.target);
  const std::string label = bt.label;
  const ModelConfig& c = t->config();
  log_info("measuring the device's streaming read bandwidth …");
  const double bw = measure_read_gbps();
  const double mma_tflops = measure_mma_tflops();
  const KernelChainFigures chain = measure_kernel_chain();
  if (chain.stale != 0)
    fail("bench: the kernel-chain probe found ", chain.stale, " slots a kernel read before the kernel it depends on wrote them — "
         "the launch overlap breaks ordering on this device; keep KDTREE_CUDA_PDL at 0 (the default) and report it");
  std::vector<int32_t> prompt(static_cast<size_t>(o.n_prompt));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));

  // Prefill and decode; the first repetition warms up and is dropped.
  // Decode twice: kernels launched one by one, and each step replayed as one CUDA graph.
  std::vector<double> pp, tg, tg_launch;
  for (int64_t rep = 0; rep < o.repetitions + 1; ++rep) {
    const double ms = timed_prefill_ms(*t, prompt);
    const std::vector<double> steps = timed_decode_ms(*t, prompt.back(), o.n_gen, true);
    timed_prefill_ms(*t, prompt);
    const std::vector<double> steps_l = timed_decode_ms(*t, prompt.back(), o.n_gen, false);
    if (rep == 0) continue;
    pp.push_back(ms);
    tg.insert(tg.end(), steps.begin(), steps.end());
    tg_launch.insert(tg_launch.end(), steps_l.begin(), steps_l.end());
  }
  const double pp_ms = median(pp), tg_ms = median(tg), tgl_ms = median(tg_launch);
  const uint64_t tg_bytes = t->floor_bytes(o.n_prompt + o.n_gen / 2, 1, nullptr);
  const double tg_floor_ms = double(tg_bytes) / (bw * 1e9) * 1e3;

  // Verify cost curve: [root + N nodes] shaped like a DDTree tree (a chain of 7, then siblings
  // hanging off it), uncommitted, after the prompt — the target's share of a round.
  struct Point {
    int64_t N;
    double ms, ms_launch, floor_ms, experts;  // ms: replayed as a round replays it (a CUDA graph)
  };
  std::vector<Point> curve;
  for (int64_t N : nodes) {
    const int64_t n = N + 1;
    std::vector<int32_t> ids(static_cast<size_t>(n)), pos(static_cast<size_t>(n)), parent(static_cast<size_t>(n), -1);
    std::vector<int32_t> depth(static_cast<size_t>(n), 0);
    std::vector<uint8_t> vis(static_cast<size_t>(n * n), 0);
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0) {
        parent[size_t(i)] = i <= 7 ? int32_t(i - 1) : int32_t((i * 5) % 7);
        depth[size_t(i)] = depth[size_t(parent[size_t(i)])] + 1;
      }
      ids[size_t(i)] = int32_t((i * 131 + 11) % c.vocab_size);
      for (int64_t a = i; a >= 0; a = parent[size_t(a)]) vis[size_t(i * n + a)] = 1;
      pos[size_t(i)] = int32_t(o.n_prompt + depth[size_t(i)]);
    }
    timed_prefill_ms(*t, prompt);
    std::vector<double> runs, runs_launch;
    std::vector<int32_t> distinct;
    for (int64_t rep = 0; rep < o.repetitions + 1; ++rep) {
      const double ms = timed_verify_ms(*t, ids, pos, vis, &distinct, true);
      const double ms_launch = timed_verify_ms(*t, ids, pos, vis, nullptr, false);
      if (rep > 0) runs.push_back(ms), runs_launch.push_back(ms_launch);
    }
    double sum = 0;
    int64_t moe = 0;
    for (int32_t d : distinct)
      if (d > 0) sum += d, ++moe;
    const uint64_t bytes = t->floor_bytes(o.n_prompt, n, &distinct);
    curve.push_back({N, median(runs), median(runs_launch), double(bytes) / (bw * 1e9) * 1e3, moe ? sum / double(moe) : 0.0});
  }

  const double pp_tps = double(o.n_prompt) / pp_ms * 1e3, tg_tps = 1e3 / tg_ms;
  // Tensor parallel (--tp R): the reductions a step adds, timed among R ranks on this one GPU — a
  // host-synchronised emulation, not NVLink (docs/perf.md states the NVLink figure it stands in for).
  const int32_t R = o.tp.tp;
  const int64_t reductions = 2 * c.num_hidden_layers;
  double red_us_1 = 0, red_us_verify = 0;
  if (R > 1) {
    red_us_1 = timed_reduction_us(R, 1, c.hidden_size, 200);
    red_us_verify = timed_reduction_us(R, 17, c.hidden_size, 200);
  }
  if (o.json) {
    nlohmann::ordered_json j = {
        {"model", label}, {"backend", "cuda"}, {"device", cuda_device_name()}, {"weights_bytes", t->device_weight_bytes()},
        {"read_bandwidth_gb_per_s", bw}, {"mma_bf16_tflops", mma_tflops},
        {"kernel_chain_us",
         {{"launch_overlap", chain.overlap}, {"forward_pdl_mode", chain.forward_mode}, {"one_block_serial", chain.serial_1},
          {"one_block_overlap", chain.overlap_1}, {"wide_blocks", chain.wide_blocks}, {"wide_serial", chain.serial_wide},
          {"wide_overlap", chain.overlap_wide}}},
        {"repetitions", o.repetitions},
        {"prefill", {{"tokens", o.n_prompt}, {"ms", pp_ms}, {"tokens_per_s", pp_tps}}},
        {"decode", {{"steps", o.n_gen}, {"ms_per_token", tg_ms}, {"ms_per_token_without_graph", tgl_ms}, {"tokens_per_s", tg_tps}, {"floor_bytes", tg_bytes},
                    {"floor_ms", tg_floor_ms}, {"gb_per_s", double(tg_bytes) / (tg_ms * 1e-3) / 1e9},
                    {"fraction_of_floor", tg_floor_ms / tg_ms}}}};
    nlohmann::ordered_json jc = nlohmann::ordered_json::array();
    for (const Point& p : curve)
      jc.push_back({{"nodes", p.N}, {"rows", p.N + 1}, {"ms", p.ms}, {"ms_without_graph", p.ms_launch}, {"cost_ratio", p.ms / curve[0].ms},
                    {"distinct_experts_per_layer", p.experts}, {"floor_ms", p.floor_ms}, {"fraction_of_floor", p.floor_ms / p.ms}});
    j["verify_curve"] = jc;
    if (R > 1)
      j["tensor_parallel"] = {{"ranks", R}, {"reductions_per_step", reductions}, {"reduction_us_1_row", red_us_1},
                              {"reduction_us_17_rows", red_us_verify},
                              {"step_ms_with_reductions", tg_ms + double(reductions) * red_us_1 * 1e-3}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("device: %s; weights on device %.2f GB; measured streaming read %.0f GB/s; mma.sync bf16 %.0f TFLOP/s\n",
              cuda_device_name().c_str(), double(t->device_weight_bytes()) / 1e9, bw, mma_tflops);
  std::printf("kernel boundary in a CUDA graph (256 dependent kernels): %.2f µs (1 block) / %.2f µs (%d blocks) serial, "
              "%.2f / %.2f µs with the launch overlap%s; the forward: KDTREE_CUDA_PDL=%d\n",
              chain.serial_1, chain.serial_wide, chain.wide_blocks, chain.overlap_1, chain.overlap_wide,
              chain.overlap ? "" : " (none before sm_90: both serial)", chain.forward_mode);
  std::printf("| model | backend | test | ms | t/s | floor ms | GB/s | %% of floor |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |\n");
  std::printf("| %s | cuda | pp%lld | %.2f | %.1f | | | |\n", label.c_str(), (long long)o.n_prompt, pp_ms, pp_tps);
  std::printf("| %s | cuda | tg%lld (per token, CUDA graph) | %.3f | %.1f | %.3f | %.0f | %.1f %% |\n", label.c_str(),
              (long long)o.n_gen, tg_ms, tg_tps, tg_floor_ms, double(tg_bytes) / (tg_ms * 1e-3) / 1e9, 100 * tg_floor_ms / tg_ms);
  std::printf("| %s | cuda | tg%lld (per token, launches) | %.3f | %.1f | %.3f | %.0f | %.1f %% |\n", label.c_str(),
              (long long)o.n_gen, tgl_ms, 1e3 / tgl_ms, tg_floor_ms, double(tg_bytes) / (tgl_ms * 1e-3) / 1e9,
              100 * tg_floor_ms / tgl_ms);
  std::printf("\n| verify nodes N (+root) | ms (CUDA graph) | ms (launches) | cost(N)/cost(%lld) | distinct experts / MoE layer | floor ms | "
              "%% of floor |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
              (long long)curve[0].N);
  for (const Point& p : curve)
    std::printf("| %lld | %.3f | %.3f | %.2f | %.1f | %.3f | %.1f %% |\n", (long long)p.N, p.ms, p.ms_launch, p.ms / curve[0].ms, p.experts,
                p.floor_ms, 100 * p.floor_ms / p.ms);
  if (R > 1)
    std::printf("\ntensor parallel: one of %d ranks above (shapes / R, no reductions); %lld reductions a step among %d ranks on "
                "this GPU: %.1f us each (1 row), %.1f us (17 rows) → decode step with reductions %.3f ms\n",
                R, (long long)reductions, R, red_us_1, red_us_verify, tg_ms + double(reductions) * red_us_1 * 1e-3);
  std::printf("\nmedians of %lld repetitions (decode: of every step), after one warm-up; floor = bytes that must be read / "
              "measured read bandwidth\n",
              (long long)o.repetitions);
  return 0;
}

#endif

}  // namespace kd::cli
