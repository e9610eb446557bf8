// `kdtree serve`: the OpenAI-compatible HTTP server (src/server/). Binds first, then loads the
// model while /health answers 503; SIGINT / SIGTERM stop it cleanly (streams in flight are cancelled).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <memory>
#include <pthread.h>
#include <thread>

#include "cli/commands.h"
#include "cli/device.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "decode/tree.h"
#include "tokenizer/tokenizer.h"

namespace kd::cli {

void add_serve(CLI::App& app, ServeOptions& o) {
  auto* c = app.add_subcommand("serve", "OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, "
                                        "/health, /metrics, /tokenize, /detokenize");
  c->add_option("-m,--model", o.model, "Checkpoint directory (config.json + *.safetensors + a tokenizer)")->required();
  c->add_option("-a,--alias", o.alias, "Model id clients use (default: the directory's name)");
  c->add_option("--draft", o.draft,
                "A DFlash drafter checkpoint directory: decode with DDTree speculation (each running sequence's "
                "tree joins one batched verify pass). synthetic:PROFILE drafters need the target's continuation in "
                "advance and only work with `kdtree run`");
  c->add_option("--spec", o.spec, "With --draft: ddtree (tree, default) or dflash (the drafter's top-1 chain)")
      ->check(CLI::IsMember({"ddtree", "dflash"}));
  add_draft_yarn_flag(c, o.draft_yarn_legacy_mscale);
  add_budget_flags(c, o.budget, /*range_is_usage_error=*/true);  // --budget N|auto, --budget-max (cli/budget_flags.h)
  c->add_option("--host", o.host, "Address to bind (default 127.0.0.1: local only; 0.0.0.0 exposes the server)");
  c->add_option("--port", o.port, "TCP port (default 8080; 0 picks a free one and logs it)")
      ->transform(whole_number(o.port))->check(CLI::Range(0, 65535));
  c->add_option("--api-key", o.api_key,
                "Require 'Authorization: Bearer KEY' on every route but /health (default: $KDTREE_API_KEY, else none)");
  c->add_option("--parallel", o.parallel, "Sequences decoded at once in the running batch (default 4)")
      ->transform(whole_number(o.parallel))
      ->check(CLI::Range(1, 1024));
  c->add_option("-c,--ctx-size", o.ctx_size, "Context limit per request in tokens (default 4096; 0 = the model's maximum)")
      ->transform(whole_number(o.ctx_size))
      ->check(CLI::NonNegativeNumber);
  c->add_option("--kv-tokens", o.kv_tokens, "Latent KV pool size in tokens, shared by all sequences and the prefix cache "
                                            "(default: parallel × ctx-size); requests that do not fit wait")
      ->transform(whole_number(o.kv_tokens))
      ->check(CLI::NonNegativeNumber);
  c->add_option("--kv-block", o.kv_block, "Tokens per KV block: paging and prefix-cache granularity (default 16)")
      ->transform(whole_number(o.kv_block))
      ->check(CLI::Range(1, 4096));
  c->add_option("--prefill-chunk", o.prefill_chunk, "Prompt tokens per sequence per step, so long prompts do not stall "
                                                    "running streams (default 256)")
      ->transform(whole_number(o.prefill_chunk))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--step-prefill-tokens", o.step_prefill_tokens,
                "Prompt tokens of all requests together in one step (default 2048; 0 = no limit): chunks go to "
                "prefilling requests in arrival order until it is spent, so several long prompts at once cannot "
                "stretch the running streams' time per token past a step of this many rows")
      ->transform(whole_number(o.step_prefill_tokens))
      ->check(CLI::Range(0, 1 << 24));
  c->add_option("--max-queue", o.max_queue, "Waiting requests beyond which new ones get 503 + Retry-After (default 64)")
      ->transform(whole_number(o.max_queue))
      ->check(CLI::Range(0, 1 << 20));
  c->add_flag("--no-prefix-cache", o.no_prefix_cache, "Do not reuse the KV of shared prompt prefixes");
  c->add_option("--timeout", o.timeout_s, "Seconds a request body may take to arrive, and a write of the answer may stall, "
                                          "before the connection is dropped (default 60; a deadline, not reset by each byte)")
      ->transform(whole_number(o.timeout_s))
      ->check(CLI::Range(1, 86400));
  c->add_option("--header-timeout", o.header_timeout_s, "Seconds from a request's first byte to the end of its headers (default 30)")
      ->transform(whole_number(o.header_timeout_s))
      ->check(CLI::Range(1, 3600));
  c->add_option("--idle-timeout", o.idle_timeout_s, "Seconds a connection may wait for its next request before it is closed (default 5)")
      ->transform(whole_number(o.idle_timeout_s))
      ->check(CLI::Range(1, 3600));
  c->add_option("--max-body", o.max_body_mb, "Largest request body in MiB, chunked or not; larger ones get 413 (default 16). "
                                             "Compressed bodies (Content-Encoding) are refused with 415")
      ->transform(whole_number(o.max_body_mb))
      ->check(CLI::Range(1, 4096));
  c->add_option("--max-header", o.max_header_kb, "Largest request line + headers in KiB; larger get 431 (default 64)")
      ->transform(whole_number(o.max_header_kb))
      ->check(CLI::Range(1, 1024));
  c->add_option("--max-connections", o.max_connections, "Open connections at most; more are answered 503 at once and closed "
                                                        "(default 1024, within the descriptor limit)")
      ->transform(whole_number(o.max_connections))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--threads-http", o.threads_http, "HTTP worker threads; each request being answered holds one, a slow client "
                                                  "does not (default: parallel + max-queue + 32, at least 64)")
      ->transform(whole_number(o.threads_http))
      ->check(CLI::Range(1, 4096));
  c->add_option("--shutdown-grace", o.shutdown_grace_s, "On SIGTERM/SIGINT: seconds requests in flight may take to finish before "
                                                        "they are cancelled (default 5; a second signal stops at once)")
      ->transform(whole_number(o.shutdown_grace_s))
      ->check(CLI::Range(0, 3600));
  c->add_option("--device", o.device,
                "cpu (default) or cuda: the target, its paged KV (sized to --kv-tokens or the free GPU memory) and a "
                "DFlash drafter on GPU 0");
  add_tp_flags(c, o.tp);
}

namespace {

sigset_t stop_signals() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGINT);
  sigaddset(&s, SIGTERM);
  return s;
}

}  // namespace

int cmd_serve(const ServeOptions& o) {
  [[maybe_unused]] const bool cuda = use_cuda(o.device);  // read only where the CUDA backend is built
  if (o.draft.rfind("synthetic:", 0) == 0)
    fail("--draft ", o.draft, ": a synthetic drafter must know each answer in advance, which a server cannot; "
                             "use a DFlash drafter directory (or `kdtree run --draft synthetic:...`)");
  if (o.draft.empty() && (!o.spec.empty() || !o.budget.budget.empty() || !o.budget.budget_max.empty()))
    fail("--spec, --budget and --budget-max need --draft DIR");
  const std::string spec_mode = o.draft.empty() ? "" : o.spec.empty() ? "ddtree" : o.spec;
  check_budget_flags(o.budget, spec_mode);
  if (o.draft.empty() && o.draft_yarn_legacy_mscale) fail("--draft-yarn-legacy-mscale needs --draft DIR (a DFlash drafter)");
  if (!std::filesystem::is_directory(o.model)) fail(o.model, ": not a directory (expected a checkpoint directory)");
  // A bad --tp, or a memory plan the GPUs cannot hold, fails here, not after the port opens (the checkpoint
  // itself is read by the loader, which checks again).
  if (o.tp.tp > 1 || !o.tp.devices.empty() || o.tp.gpu_memory_limit_gib > 0 || cuda) {
    const ModelConfig cfg = load_checkpoint_config(o.model);
    check_tp_flags(o.tp, cuda, cfg);
    check_gpu_memory(o.tp, cuda, cfg, o.kv_tokens > 0 ? o.kv_tokens : o.ctx_size);
  }

  ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  if (so.api_key.empty())
    if (const char* k = std::getenv("KDTREE_API_KEY")) so.api_key = k;
  HttpLimits& lim = so.limits;
  lim.timeout_s = o.timeout_s;
  lim.header_timeout_s = o.header_timeout_s;
  lim.idle_timeout_s = o.idle_timeout_s;
  lim.max_body_bytes = size_t(o.max_body_mb) << 20;
  lim.max_header_bytes = size_t(o.max_header_kb) << 10;
  lim.max_connections = o.max_connections;
  lim.shutdown_grace_s = o.shutdown_grace_s;
  // Every running and waiting request holds a worker; the slack serves the requests that are
  // answered 503 once the engine's queue is full (/health and /metrics need none).
  lim.workers = o.threads_http > 0 ? o.threads_http : int(std::max<int64_t>(64, o.parallel + o.max_queue + 32));

  // Signals go to this thread only (sigwait below): block them before any thread starts.
  const sigset_t sigs = stop_signals();
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  HttpServer server(so);
  server.bind();
  log_info("listening on http://", o.host, ":", server.port(), (so.api_key.empty() ? "" : " (API key required)"),
           "; loading ", o.model, " …");
  std::atomic<bool> http_done{false};
  std::thread http([&server, &http_done] {
    server.listen();
    http_done = true;
  });

  // Load on a thread of its own so that a signal can still stop the server while it loads.
  std::atomic<int> load_state{0};  // 0 loading, 1 ready, 2 failed
  std::string load_error;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<LoadedTarget> lt;
  std::unique_ptr<Engine> engine;
  // KDTREE_SERVE_LOAD_DELAY_MS: a testing aid that holds the server in its loading state for that long
  // (tests/server check what it answers meanwhile and that a signal then stops it at once).
  const char* load_delay = std::getenv("KDTREE_SERVE_LOAD_DELAY_MS");
  std::atomic<bool> abandon_load{false};
  std::thread loader([&] {
    try {
      const double t0 = now_s();
      if (load_delay) {
        const double until = t0 + std::strtod(load_delay, nullptr) / 1e3;
        while (now_s() < until && !abandon_load) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (abandon_load) fail("stopped while loading");
      }
      tok = load_tokenizer(o.model);
      // On GPUs the memory plan must hold --kv-tokens, else one request's --ctx-size, of KV beside the weights.
      lt = std::make_unique<LoadedTarget>(o.device, o.model, o.tp, o.kv_tokens > 0 ? o.kv_tokens : o.ctx_size);
      const Target& target = lt->target();
      const ModelConfig& cfg = lt->config();
      if (tok->vocab_size() > cfg.vocab_size)
        fail(o.model, ": the tokenizer has ", tok->vocab_size(), " ids but the model's vocabulary holds ", cfg.vocab_size);
      EngineOptions eo;
      eo.n_parallel = o.parallel;
      eo.context = o.ctx_size > 0 ? std::min(o.ctx_size, cfg.max_position_embeddings) : cfg.max_position_embeddings;
      eo.kv_tokens = o.kv_tokens;
      eo.kv_block = o.kv_block;
      eo.prefill_chunk = o.prefill_chunk;
      eo.step_prefill_tokens = o.step_prefill_tokens;
      eo.max_queue = o.max_queue;
      eo.prefix_cache = !o.no_prefix_cache;
      if (!o.draft.empty()) {
        // One drafter per running sequence; on the GPU beside a GPU target (its context K/V there).
        DFlashLoadOptions dopt;
        dopt.yarn_legacy_mscale = o.draft_yarn_legacy_mscale;
        LoadedTarget::Drafters d = lt->dflash_drafters(o.draft, std::min(eo.context, target.max_context()), dopt);
        eo.make_drafter = std::move(d.make);
        apply_budget_flags(o.budget, spec_mode, eo.spec);
      }
      ServedModel sm;
      sm.name = o.alias.empty() ? std::filesystem::path(o.model).lexically_normal().filename().string() : o.alias;
      if (sm.name.empty()) sm.name = std::filesystem::path(o.model).lexically_normal().parent_path().filename().string();
      sm.tokenizer = tok.get();
      sm.chat_template = tok->kind() == "tiktoken" ? ChatTemplateKind::kimi : ChatTemplateKind::deepseek_v3;
      sm.vocab_size = int32_t(cfg.vocab_size);
      engine = std::make_unique<Engine>(target, eo);
      sm.context = engine->context();
      sm.eos_ids = cfg.eos_token_ids;
      sm.defaults = load_generation_defaults(o.model);
      server.set_ready(std::move(sm), *engine);
      log_info("model '", o.model, "' ready on ", target.device(), " in ", (now_s() - t0) * 1e3, " ms (",
               cfg.num_hidden_layers, " layers, context ", engine->context(), ", parallel ", eo.n_parallel, ", KV pool ",
               engine->kv_tokens(), " tokens", o.draft.empty() ? "" : ", DDTree drafter " + o.draft, ")");
      load_state = 1;
    } catch (const std::exception& e) {
      load_error = e.what();
      load_state = 2;
    }
  });

  int rc = 0;
  auto next_signal = [&sigs](int ms) {
    timespec ts{ms / 1000, (ms % 1000) * 1000L * 1000L};
    const int sig = sigtimedwait(&sigs, nullptr, &ts);
    return sig == SIGINT || sig == SIGTERM ? sig : 0;
  };
  for (;;) {
    if (const int sig = next_signal(200)) {
      log_info("signal ", sig, ": stopping (requests in flight have ", o.shutdown_grace_s, " s; a second signal stops at once)");
      break;
    }
    if (load_state == 2) {
      std::fprintf(stderr, "error: %s\n", load_error.c_str());
      rc = 1;
      break;
    }
  }
  server.stop();
  // A load still running may be stuck on a file (a network filesystem, a device): it must not hold
  // the exit. Weights are mmapped, so nothing is lost by leaving without it.
  abandon_load = true;
  for (int i = 0; i < 100 && load_state == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (load_state == 0) {
    log_info("the model was still loading: exiting without waiting for it");
    std::fflush(nullptr);
    std::_Exit(rc);
  }
  loader.join();
  while (!http_done) {
    if (const int sig = next_signal(100)) {
      log_info("signal ", sig, ": stopping now");
      server.stop_now();
    }
  }
  http.join();
  engine.reset();  // after the server: no handler touches it any more
  lt.reset();
  return rc;
}

}  // namespace kd::cli
