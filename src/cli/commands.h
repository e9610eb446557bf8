// `kdtree` subcommands. One CLI11 parser (main.cpp) declares every flag; each command runs from
// its options struct. stdout carries results only (one JSON object with --json); logs go to stderr.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/budget_flags.h"      // --budget N|auto, --budget-max
#include "cli/quality_commands.h"  // quantize, ppl (issue 19)
#include "model/make_model.h"

namespace CLI { class App; }

namespace kd::cli {

// --tp R (alias --tensor-parallel) and --devices, as run, serve, bench and ppl take them (cli/device.h).
struct TpFlags {
  int32_t tp = 1;
  std::vector<int32_t> devices;  // --devices 0,1,…: the GPUs of the ranks (cuda only)
  double gpu_memory_limit_gib = 0;  // --gpu-memory-limit GiB a GPU (cuda only; 0: the GPU's free memory)
};

struct RunOptions {
  std::string model, prompt, prompt_ids, chat, system, thinking, spec = "ar", draft, device = "cpu", dump_logits,
      decode_attn = "absorbed", chat_template, json_rounds = "tau";
  bool parse_special = false;
  int64_t n_predict = 32, ctx_size = 0, block_size = 8;
  BudgetFlags budget;
  float temp = 0.0f, top_p = 1.0f, min_p = 0.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false, json = false;
  bool draft_yarn_legacy_mscale = false;  // DFlashLoadOptions::yarn_legacy_mscale
  TpFlags tp;
};
void add_run(CLI::App& app, RunOptions& o);
int cmd_run(const RunOptions& o);

struct InspectOptions {
  std::string model, preset, config;
  int64_t ctx = 4096;
  bool json = false;
  int32_t tp = 0;                 // --tp R: print the per-GPU plan for R ranks (0: not asked)
  double gpu_memory_gib = 0;      // --gpu-memory-limit GiB a GPU (0: not given; the plan then assumes 139, an H200)
};
void add_inspect(CLI::App& app, InspectOptions& o);
int cmd_inspect(const InspectOptions& o);

void add_make_model(CLI::App& app, MakeModelOptions& o);
int cmd_make_model(const MakeModelOptions& o);

struct BenchOptions {
  std::string model, device = "cpu", preset;  // preset: k2-slice (random weights made on the GPU; --device cuda)
  int64_t preset_layers = 0;  // --preset-layers L: k2-slice with L layers (0: its 12)
  int64_t n_prompt = 64, n_gen = 32, repetitions = 3;
  bool json = false, verify_curve = false;
  std::vector<int64_t> serve;  // --serve C1,C2,…: the engine load test at these concurrencies (cmd_bench_serve.cpp)
  // … and with --long-prompt P the chunked-prefill test: --streams S decoding while P tokens arrive,
  // at each --prefill-chunks K (empty: 256, 2048 and P).
  int64_t long_prompt = 0, streams = 8;
  std::vector<int64_t> prefill_chunks;
  std::vector<int64_t> verify_sizes;  // --verify-sizes: tree nodes N of the verify curve (empty: verify_sizes_or_default)
  TpFlags tp;
  // --draft DIR: the speculative bench (cmd_bench_spec.cpp) — AR against --spec ddtree|dflash at each of
  // --budget B1,B2,… (N or auto) on --prompt-ids or --prompts FILE (the first --prompt-limit of them).
  std::string draft, spec = "ddtree", budget_max, prompt_ids, prompts;
  // … and with --json-schema FILE or --gbnf FILE, under that grammar through the engine, the draft tree
  // masked and unmasked (cmd_bench_grammar.cpp).
  std::string json_schema, gbnf;
  std::vector<std::string> budgets;
  int64_t prompt_limit = 0;
  double temp = 0;
  uint64_t seed = 0;
};
// A greedy repetition loop, as the speculative bench flags it: some n-gram of at least kLoopNgram
// tokens occurs kLoopCount times or more in the output.
inline constexpr int64_t kLoopNgram = 8, kLoopCount = 3;
bool has_repetition_loop(const std::vector<int32_t>& ids, int64_t min_len, int64_t min_count);
int cmd_bench_spec(const BenchOptions& o);  // `bench --draft DIR`
std::vector<int64_t> verify_sizes_or_default(const BenchOptions& o);  // 1, 2, 4 … 64 unless given
void add_bench(CLI::App& app, BenchOptions& o);
int cmd_bench(const BenchOptions& o);
int cmd_bench_cuda(const BenchOptions& o);  // cmd_bench_cuda.cpp (CUDA builds)
int cmd_bench_serve_cuda(const BenchOptions& o);  // cmd_bench_serve.cpp: `bench --device cuda --serve …`
int cmd_bench_serve_cpu(const BenchOptions& o);   // … and `bench -m DIR --serve …` on the CPU

struct TreeOptions {
  std::string logits;
  int64_t budget = 0;
  bool chain = false, json = false;
};
void add_tree(CLI::App& app, TreeOptions& o);
int cmd_tree(const TreeOptions& o);

// `kdtree plan-budget` (cmd_plan_budget.cpp): --budget auto's choice for a stated cost curve and acceptance.
struct PlanBudgetOptions {
  std::string verify_ms, profile;
  int64_t block_size = 8, budget_max = kDefaultBudgetMax, vocab = 163840;
  std::vector<double> draft_ms;
  bool json = false;
};
void add_plan_budget(CLI::App& app, PlanBudgetOptions& o);
int cmd_plan_budget(const PlanBudgetOptions& o);

struct TokenizeOptions {
  std::string model, file;
  std::optional<std::string> text;  // set (possibly empty) when --text is given
  bool json = false, decode = false, parse_special = false, jsonl = false, bench = false;
};
void add_tokenize(CLI::App& app, TokenizeOptions& o);
int cmd_tokenize(const TokenizeOptions& o);

struct ChatTemplateOptions {
  std::string model, messages, tools, thinking, preserve_thinking, template_name;
  bool no_generation_prompt = false;
};
void add_chat_template(CLI::App& app, ChatTemplateOptions& o);
int cmd_chat_template(const ChatTemplateOptions& o);

struct ServeOptions {
  std::string model, alias, draft, spec, host = "127.0.0.1", api_key, device = "cpu";
  int port = 8080;
  int64_t parallel = 4, ctx_size = 4096, kv_tokens = 0, kv_block = 16, prefill_chunk = 256, max_queue = 64;
  int64_t step_prefill_tokens = 2048;
  BudgetFlags budget;
  int64_t timeout_s = 60, idle_timeout_s = 5, header_timeout_s = 30, max_body_mb = 16, max_header_kb = 64;
  int64_t shutdown_grace_s = 5;
  int threads_http = 0, max_connections = 1024;
  bool no_prefix_cache = false;
  bool draft_yarn_legacy_mscale = false;  // DFlashLoadOptions::yarn_legacy_mscale
  TpFlags tp;
};
void add_serve(CLI::App& app, ServeOptions& o);
int cmd_serve(const ServeOptions& o);

}  // namespace kd::cli
