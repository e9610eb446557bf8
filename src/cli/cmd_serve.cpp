// `kdtree serve`: the OpenAI-compatible HTTP server (src/server/). Binds first, then loads the
// model while /health answers 503; SIGINT / SIGTERM stop it cleanly (streams in flight are cancelled).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <filesystem>
#include <memory>
#include <pthread.h>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "server/http_server.h"
#include "spec/dflash_drafter.h"
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
  c->add_option("--budget", o.budget, "DDTree tree nodes per round, root excluded (default: block size − 1)")
      ->check(CLI::PositiveNumber);
  c->add_option("--host", o.host, "Address to bind (default 127.0.0.1: local only; 0.0.0.0 exposes the server)");
  c->add_option("--port", o.port, "TCP port (default 8080; 0 picks a free one and logs it)")->check(CLI::Range(0, 65535));
  c->add_option("--api-key", o.api_key,
                "Require 'Authorization: Bearer KEY' on every route but /health (default: $KDTREE_API_KEY, else none)");
  c->add_option("--parallel", o.parallel, "Sequences decoded at once in the running batch (default 4)")
      ->check(CLI::Range(1, 1024));
  c->add_option("-c,--ctx-size", o.ctx_size, "Context limit per request in tokens (default 4096; 0 = the model's maximum)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--kv-tokens", o.kv_tokens, "Latent KV pool size in tokens, shared by all sequences and the prefix cache "
                                            "(default: parallel × ctx-size); requests that do not fit wait")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--kv-block", o.kv_block, "Tokens per KV block: paging and prefix-cache granularity (default 16)")
      ->check(CLI::Range(1, 4096));
  c->add_option("--prefill-chunk", o.prefill_chunk, "Prompt tokens per sequence per step, so long prompts do not stall "
                                                    "running streams (default 256)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--max-queue", o.max_queue, "Waiting requests beyond which new ones get 503 + Retry-After (default 64)")
      ->check(CLI::Range(0, 1 << 20));
  c->add_flag("--no-prefix-cache", o.no_prefix_cache, "Do not reuse the KV of shared prompt prefixes");
  c->add_option("--timeout", o.timeout_s, "Seconds a connection may stall reading or writing before it is dropped (default 600)")
      ->check(CLI::Range(1, 86400));
  c->add_option("--idle-timeout", o.idle_timeout_s, "Seconds an idle keep-alive connection stays open (default 5)")
      ->check(CLI::Range(1, 3600));
  c->add_option("--max-body", o.max_body_mb, "Largest request body in MiB; larger ones get 413 (default 16)")
      ->check(CLI::Range(1, 4096));
  c->add_option("--threads-http", o.threads_http, "HTTP worker threads; each open request holds one (default: parallel + max-queue + 32, at least 64)")
      ->check(CLI::Range(1, 4096));
  c->add_option("--device", o.device, "cpu (default) or cuda (not in this build)");
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
  if (o.device != "cpu")
    fail("--device ", o.device, ": this build has only the CPU backend (the CUDA backend is a later issue); use --device cpu");
  if (o.draft.rfind("synthetic:", 0) == 0)
    fail("--draft ", o.draft, ": a synthetic drafter must know each answer in advance, which a server cannot; "
                             "use a DFlash drafter directory (or `kdtree run --draft synthetic:...`)");
  if (o.draft.empty() && (!o.spec.empty() || o.budget > 0)) fail("--spec and --budget need --draft DIR");
  if (o.spec == "dflash" && o.budget > 0) fail("--budget only applies to --spec ddtree");
  if (!std::filesystem::is_directory(o.model)) fail(o.model, ": not a directory (expected a checkpoint directory)");

  ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  if (so.api_key.empty())
    if (const char* k = std::getenv("KDTREE_API_KEY")) so.api_key = k;
  so.timeout_s = o.timeout_s;
  so.idle_timeout_s = o.idle_timeout_s;
  so.max_body_bytes = size_t(o.max_body_mb) << 20;
  // Every running and waiting request holds a worker; the slack serves /health, /metrics and the
  // requests that are answered 503 once the queue is full.
  so.http_threads = o.threads_http > 0 ? o.threads_http : int(std::max<int64_t>(64, o.parallel + o.max_queue + 32));

  // Signals go to this thread only (sigwait below): block them before any thread starts.
  const sigset_t sigs = stop_signals();
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  HttpServer server(so);
  server.bind();
  log_info("listening on http://", o.host, ":", server.port(), (so.api_key.empty() ? "" : " (API key required)"),
           "; loading ", o.model, " …");
  std::thread http([&server] { server.listen(); });

  // Load on a thread of its own so that a signal can still stop the server while it loads.
  std::atomic<int> load_state{0};  // 0 loading, 1 ready, 2 failed
  std::string load_error;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<DeepseekV3> model;
  std::unique_ptr<Engine> engine;
  std::thread loader([&] {
    try {
      const double t0 = now_s();
      tok = load_tokenizer(o.model);
      ckpt = std::make_unique<Checkpoint>(o.model);
      model = std::make_unique<DeepseekV3>(*ckpt);
      const ModelConfig& cfg = model->config();
      if (tok->vocab_size() > cfg.vocab_size)
        fail(o.model, ": the tokenizer has ", tok->vocab_size(), " ids but the model's vocabulary holds ", cfg.vocab_size);
      EngineOptions eo;
      eo.n_parallel = o.parallel;
      eo.context = o.ctx_size > 0 ? std::min(o.ctx_size, cfg.max_position_embeddings) : cfg.max_position_embeddings;
      eo.kv_tokens = o.kv_tokens;
      eo.kv_block = o.kv_block;
      eo.prefill_chunk = o.prefill_chunk;
      eo.max_queue = o.max_queue;
      eo.prefix_cache = !o.no_prefix_cache;
      if (!o.draft.empty()) {
        const DeepseekV3* target = model.get();
        const std::string dir = o.draft;
        const int64_t ctx = eo.context;
        auto probe = std::make_unique<DFlashAdapter>(dir, *target, ctx);  // fail now, not on the first request
        eo.spec.chain = o.spec == "dflash";
        eo.spec.budget = o.budget > 0 ? o.budget : probe->block_size() - 1;
        eo.make_drafter = [dir, target, ctx] { return std::make_unique<DFlashAdapter>(dir, *target, ctx); };
      }
      ServedModel sm;
      sm.name = o.alias.empty() ? std::filesystem::path(o.model).lexically_normal().filename().string() : o.alias;
      if (sm.name.empty()) sm.name = std::filesystem::path(o.model).lexically_normal().parent_path().filename().string();
      sm.tokenizer = tok.get();
      sm.chat_template = tok->kind() == "tiktoken" ? ChatTemplateKind::kimi : ChatTemplateKind::deepseek_v3;
      sm.vocab_size = int32_t(cfg.vocab_size);
      sm.context = eo.context;
      sm.eos_ids = cfg.eos_token_ids;
      sm.defaults = load_generation_defaults(o.model);
      engine = std::make_unique<Engine>(*model, eo);
      server.set_ready(std::move(sm), *engine);
      log_info("model '", o.model, "' ready in ", (now_s() - t0) * 1e3, " ms (", cfg.num_hidden_layers, " layers, context ",
               eo.context, ", parallel ", eo.n_parallel, o.draft.empty() ? "" : ", DDTree drafter " + o.draft, ")");
      load_state = 1;
    } catch (const std::exception& e) {
      load_error = e.what();
      load_state = 2;
    }
  });

  int rc = 0;
  for (;;) {
    timespec ts{0, 200 * 1000 * 1000};
    const int sig = sigtimedwait(&sigs, nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) {
      log_info("signal ", sig, ": stopping");
      break;
    }
    if (load_state == 2) {
      std::fprintf(stderr, "error: %s\n", load_error.c_str());
      rc = 1;
      break;
    }
  }
  loader.join();  // a load in progress finishes first (weights are mmapped: quick)
  server.stop();
  http.join();
  engine.reset();  // after the server: no handler touches it any more
  return rc;
}

}  // namespace kd::cli
