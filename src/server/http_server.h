// The OpenAI-compatible HTTP server (issue 6; docs/architecture.md "Server"): the routes over
// HttpTransport (http_transport.h: connections, limits, deadlines, shutdown). Each request handler
// runs on a worker thread, parses and validates the body,
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
#include "server/http_transport.h"
#include "server/prepare.h"


namespace kd {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;             // 0: any free port (port() tells which)
  std::string api_key;         // empty: no authentication
  HttpLimits limits;           // body/header sizes, deadlines, connections, workers, shutdown grace
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
  void stop();      // graceful: stops accepting, lets requests in flight finish within the grace period,
                    // then cancels streams; listen() returns
  void stop_now();  // the same without the grace period
  // The model is loaded: serve it. `model.tokenizer` and `engine` must outlive the server's listen().
  void set_ready(ServedModel model, Engine& engine);

 private:
  void route(const HttpRequest& req, HttpExchange& ex);
  void handle_generate(Endpoint ep, const HttpRequest& req, HttpExchange& ex);
  void handle_tokenize(const HttpRequest& req, HttpExchange& ex);
  void handle_detokenize(const HttpRequest& req, HttpExchange& ex);
  void handle_models(HttpExchange& ex);
  void handle_model(const std::string& id, HttpExchange& ex);  // 404 unless `id` is the served model
  nlohmann::json model_object() const;  // the served model as /v1/models lists it
  bool ready(HttpExchange& ex);  // false (503 written) while loading
  bool authorized(const HttpRequest& req) const;

  ServerOptions opt_;
  std::unique_ptr<HttpTransport> http_;
  int port_ = 0;
  std::atomic<bool> ready_{false};
  ServedModel model_;
  Engine* engine_ = nullptr;
  ServerMetrics metrics_;
  std::atomic<uint64_t> next_id_{1};
  int64_t created_ = 0;
};

}  // namespace kd
