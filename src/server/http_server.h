// The OpenAI-compatible HTTP server (issue 6; docs/architecture.md "Server"). cpp-httplib accepts
// connections on a pool of worker threads; each request handler parses and validates the body,
// prepares the prompt, submits to the engine and then pumps the engine's events for that request
// through a ResponseBuilder — into one JSON response, or SSE chunks as they come. The server talks
// to the engine only through Engine::submit / cancel / metrics and the per-request event callback.
//
// The server binds before the model loads: until set_ready() every route but /health and /metrics
// answers 503 (and /health says "loading").
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "engine/engine.h"
#include "server/metrics.h"
#include "server/prepare.h"

namespace httplib { class Server; struct Request; struct Response; }

namespace kd {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;             // 0: any free port (port() tells which)
  std::string api_key;         // empty: no authentication
  int64_t timeout_s = 600;     // read / write timeout of a connection (a stalled client is dropped)
  int64_t idle_timeout_s = 5;  // keep-alive: an idle connection is closed after this
  size_t max_body_bytes = size_t(16) << 20;
  int http_threads = 0;        // worker threads; 0: 96
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions opt);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  void bind();      // throws kd::Error naming host:port when the address cannot be bound
  int port() const { return port_; }
  void listen();    // serves until stop(); call after bind(), on its own thread
  void stop();      // stops accepting, cancels streams in flight; listen() returns
  // The model is loaded: serve it. `model.tokenizer` and `engine` must outlive the server's listen().
  void set_ready(ServedModel model, Engine& engine);

 private:
  void handle_generate(Endpoint ep, const httplib::Request& req, httplib::Response& res);
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);
  void handle_models(httplib::Response& res);
  void handle_model(const std::string& id, httplib::Response& res);  // 404 unless `id` is the served model
  nlohmann::json model_object() const;  // the served model as /v1/models lists it
  bool ready(httplib::Response& res);  // false (503 written) while loading

  ServerOptions opt_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  std::atomic<bool> ready_{false}, stopping_{false};
  ServedModel model_;
  Engine* engine_ = nullptr;
  ServerMetrics metrics_;
  std::atomic<uint64_t> next_id_{1};
  int64_t created_ = 0;
};

}  // namespace kd
