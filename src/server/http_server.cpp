#include "server/http_server.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>

#include "core/log.h"
#include "core/untrusted.h"

namespace kd {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

void send_error(HttpExchange& ex, int status, const std::string& type, const std::string& message,
                const std::string& param = "", const HttpHeaders& extra = {}) {
  ex.reply(status, error_json(status, type, message, param), "application/json", extra);
}

void send_api_error(HttpExchange& ex, const ApiError& e) { send_error(ex, e.status, e.type, e.what(), e.param); }

void send_json(HttpExchange& ex, const json& j) {
  ex.reply(200, j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

// Constant time in the length of the expected key: every byte is compared whatever differs first.
bool same_secret(std::string_view given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

// What the engine thread hands to the HTTP thread of one request.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<EngineEvent> events;
  std::atomic<bool> abandon{false};  // client gone or a stop string matched: cancel at the next event
  // A non-streamed request's liveness probe, run by the engine thread at every event (under mu) so
  // that a departed client's sequence ends within a step even when the handler thread is not
  // scheduled; set and cleared by the handler (under mu) around its wait, while the exchange lives
  // and nothing else writes to it. client_gone: the probe said so (under mu).
  std::function<bool()> probe;
  bool client_gone = false;
};

// The one decision that a request's client has gone (its probe, its handler's poll and a failed write
// may each see it, on two threads): true for the first caller only, which then counts it; the probe
// is dropped with it.
bool claim_gone(Channel& c) {
  std::lock_guard<std::mutex> lk(c.mu);
  if (c.client_gone) return false;
  c.client_gone = true;
  c.probe = nullptr;
  return true;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A request body as a JSON object, depth-bounded (core/untrusted.h); nullopt after answering 400.
std::optional<json> json_body(const HttpRequest& req, HttpExchange& ex) {
  try {
    json body = parse_json(req.body, "request body");
    if (body.is_object()) return body;
  } catch (const Error& e) {
    send_error(ex, 400, "invalid_request_error", e.what());
    return std::nullopt;
  }
  send_error(ex, 400, "invalid_request_error", "request body: expected a JSON object");
  return std::nullopt;
}

bool is_generate_path(const std::string& p) {
  return p == "/v1/chat/completions" || p == "/chat/completions" || p == "/v1/completions" || p == "/completions";
}

bool is_post_path(const std::string& p) { return is_generate_path(p) || p == "/tokenize" || p == "/detokenize"; }

bool is_get_path(const std::string& p) {
  return p == "/health" || p == "/metrics" || p == "/v1/models" || p == "/models" || p.rfind("/v1/models/", 0) == 0 ||
         p.rfind("/models/", 0) == 0;
}

}  // namespace

HttpServer::HttpServer(ServerOptions opt) : opt_(std::move(opt)) {
  created_ = int64_t(std::time(nullptr));
  HttpCallbacks cb;
  cb.handle = [this](const HttpRequest& req, HttpExchange& ex) { route(req, ex); };
  // Everything but the generation and tokenizer routes answers from memory: on the I/O thread, so
  // that /health and /metrics answer while every worker is busy.
  cb.is_quick = [](const HttpRequest& req) { return !(req.method == "POST" && is_post_path(req.path)); };
  cb.error_body = [](int status, const std::string& message) {
    return error_json(status, status >= 500 && status != 503 ? "server_error" : status == 503 ? "unavailable_error" : "invalid_request_error",
                      message);
  };
  cb.on_response = [this](int status) { metrics_.count_response(status); };
  http_ = std::make_unique<HttpTransport>(opt_.limits, std::move(cb));
}

HttpServer::~HttpServer() { stop_now(); }

void HttpServer::bind() {
  http_->bind(opt_.host, opt_.port);
  port_ = http_->port();
}

void HttpServer::listen() { http_->run(); }
void HttpServer::stop() { http_->stop(); }
void HttpServer::stop_now() { http_->stop_now(); }

void HttpServer::set_ready(ServedModel model, Engine& engine) {
  model_ = std::move(model);
  engine_ = &engine;
  ready_ = true;
}

bool HttpServer::ready(HttpExchange& ex) {
  if (ready_) return true;
  send_error(ex, 503, "unavailable_error", "loading model", "", {{"Retry-After", "1"}});
  return false;
}

// RFC 7235: the scheme is case-insensitive ("bearer" is "Bearer"), one or more spaces follow it.
bool HttpServer::authorized(const HttpRequest& req) const {
  std::string_view auth = req.header("authorization");
  constexpr std::string_view scheme = "bearer";
  if (auth.size() <= scheme.size()) return false;
  for (size_t i = 0; i < scheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(auth[i])) != scheme[i]) return false;
  auth.remove_prefix(scheme.size());
  if (auth.front() != ' ') return false;
  while (!auth.empty() && auth.front() == ' ') auth.remove_prefix(1);
  while (!auth.empty() && (auth.back() == ' ' || auth.back() == '\t')) auth.remove_suffix(1);
  return same_secret(auth, opt_.api_key);
}

void HttpServer::route(const HttpRequest& req, HttpExchange& ex) {
  const std::string& p = req.path;
  log_debug("http ", req.method, " ", p, " from ", req.remote);
  if (!opt_.api_key.empty() && p != "/health" && !authorized(req))
    return send_error(ex, 401, "authentication_error", "invalid or missing API key (send 'Authorization: Bearer KEY')");
  if (req.method == "GET" && is_get_path(p)) {
    if (p == "/health") {
      if (!ready_) return send_error(ex, 503, "unavailable_error", "loading model");
      return ex.reply(200, R"({"status":"ok"})", "application/json");
    }
    if (p == "/metrics") {
      EngineMetrics em;
      GrammarCacheStats gs;
      if (ready_) em = engine_->metrics(), gs = grammar_cache_stats(model_);
      return ex.reply(200, metrics_.render(ready_ ? &em : nullptr, !ready_, ready_ ? &gs : nullptr), "text/plain; version=0.0.4");
    }
    if (p == "/v1/models" || p == "/models") return handle_models(ex);
    // One model, as OpenAI's GET /v1/models/{model}; ids may hold '/' (as Hugging Face names do).
    return handle_model(p.substr(p.rfind("/models/", 0) == 0 ? 8 : 11), ex);
  }
  if (req.method == "POST" && is_post_path(p)) {
    if (p == "/tokenize") return handle_tokenize(req, ex);
    if (p == "/detokenize") return handle_detokenize(req, ex);
    return handle_generate(p.find("chat") != std::string::npos ? Endpoint::chat : Endpoint::completion, req, ex);
  }
  if (is_get_path(p) || is_post_path(p))
    return send_error(ex, 405, "invalid_request_error", cat("method ", req.method.substr(0, 16), " not allowed on ", p),
                      "", {{"Allow", is_get_path(p) ? "GET" : "POST"}});
  send_error(ex, 404, "not_found_error", cat("no route ", req.method.substr(0, 16), " ", escaped_excerpt(p, 80)));
}

nlohmann::json HttpServer::model_object() const {
  return {{"id", model_.name}, {"object", "model"}, {"created", created_}, {"owned_by", "kdtree"},
          {"meta", {{"n_ctx", model_.context}, {"n_vocab", model_.vocab_size},
                    {"chat_template", chat_template_kind_name(model_.chat_template)}}}};
}

void HttpServer::handle_models(HttpExchange& ex) {
  if (!ready(ex)) return;
  send_json(ex, json{{"object", "list"}, {"data", json::array({model_object()})}});
}

void HttpServer::handle_model(const std::string& id, HttpExchange& ex) {
  if (!ready(ex)) return;
  if (id != model_.name)
    return send_error(ex, 404, "invalid_request_error",
                      cat("model '", escaped_excerpt(id, 80), "' not found (this server serves '", model_.name, "')"), "model");
  send_json(ex, model_object());
}

void HttpServer::handle_tokenize(const HttpRequest& req, HttpExchange& ex) {
  if (!ready(ex)) return;
  const std::optional<json> body = json_body(req, ex);
  if (!body) return;
  try {
    send_json(ex, tokenize_response(*body, model_));
  } catch (const ApiError& e) {
    send_api_error(ex, e);
  } catch (const Error& e) {  // the chat template's errors (tool schemas, messages)
    send_error(ex, 400, "invalid_request_error", e.what());
  }
}

void HttpServer::handle_detokenize(const HttpRequest& req, HttpExchange& ex) {
  if (!ready(ex)) return;
  const std::optional<json> body = json_body(req, ex);
  if (!body) return;
  try {
    send_json(ex, detokenize_response(*body, model_));
  } catch (const ApiError& e) {
    send_api_error(ex, e);
  }
}

void HttpServer::handle_generate(Endpoint ep, const HttpRequest& req, HttpExchange& ex) {
  const auto t_arrival = Clock::now();
  if (!ready(ex)) return;
  PreparedRequest prep;
  try {
    ApiRequest r = parse_api_request(ep, req.body);
    if (!r.model.empty() && r.model != model_.name)
      throw ApiError(404, "invalid_request_error", cat("model '", escaped_excerpt(r.model, 80), "' not found (this server serves '", model_.name, "')"), "model");
    if (!r.seed) r.seed = std::random_device{}() | (uint64_t(std::random_device{}()) << 32);  // unseeded: random, as OpenAI
    prep = prepare_request(r, model_);
  } catch (const ApiError& e) {
    return send_api_error(ex, e);
  } catch (const Error& e) {  // tokenizer errors name the bad bytes
    return send_error(ex, 400, "invalid_request_error", e.what());
  }
  const uint64_t serial = next_id_++;
  prep.response.id = cat(ep == Endpoint::chat ? "chatcmpl-" : "cmpl-", serial);
  prep.response.model = model_.name;
  prep.response.created = int64_t(std::time(nullptr));

  auto ch = std::make_shared<Channel>();
  EngineRequest er;
  er.prompt = prep.prompt;
  er.gen = prep.gen;
  er.top_logprobs = prep.top_logprobs;
  er.grammar = prep.grammar;
  er.on_event = [this, ch](const EngineEvent& ev) {
    bool gone = false;
    {
      std::lock_guard<std::mutex> lk(ch->mu);
      ch->events.push_back(ev);
      if (!ev.done && ch->probe && !ch->abandon.load() && !ch->probe()) {  // (no probe once gone: claim_gone)
        gone = ch->client_gone = true;
        ch->probe = nullptr;
      }
    }
    if (gone) metrics_.count_client_gone();  // here, so the count is in before the sequence is freed
    ch->cv.notify_one();
    return !gone && !ch->abandon.load();
  };
  uint64_t engine_id = 0;
  try {
    engine_id = engine_->submit(std::move(er));
  } catch (const EngineFull& e) {
    return send_error(ex, 503, "unavailable_error", cat("server busy: ", e.what()), "", {{"Retry-After", "1"}});
  } catch (const Error& e) {
    return send_error(ex, 400, "invalid_request_error", e.what());
  }

  // Pumps the engine's events through the builder. emit(payload) returns false when the client is
  // gone; the request is then cancelled. Returns the final event (done) or nullopt if abandoned.
  auto builder = std::make_shared<ResponseBuilder>(*model_.tokenizer, prep.response);
  auto pump_events = [this, ch, builder, engine_id, t_arrival, &ex](const std::function<bool(const std::string&)>& emit,
                                                                   const std::function<bool()>& client_alive) -> bool {
    bool first = true;
    Clock::time_point t_first{};
    for (;;) {
      std::deque<EngineEvent> batch;
      bool gone = false;
      {
        std::unique_lock<std::mutex> lk(ch->mu);
        ch->cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return !ch->events.empty(); });
        batch.swap(ch->events);
        gone = ch->client_gone;
      }
      if (gone) {  // the engine's probe saw the client leave (and counted it); the sequence is ending
        ch->abandon = true;
        return false;
      }
      if (ex.cancelled()) {  // shutting down past the grace period: do not let a long generation hold the exit
        ch->abandon = true;
        engine_->cancel(engine_id);
        emit(error_json(503, "unavailable_error", "server shutting down"));
        return false;
      }
      // Look for a departed client at every wake-up, idle or not (one poll() with a zero timeout):
      // a non-streaming request writes nothing until it is done, so no failed write would tell. The
      // engine thread probes too (Channel::probe) — the check that bounds the delay to a step when
      // this thread waits for a core; this one covers the wait before the first token.
      if (!client_alive()) {
        if (claim_gone(*ch)) metrics_.count_client_gone();
        ch->abandon = true;
        engine_->cancel(engine_id);
        return false;
      }
      if (batch.empty()) continue;
      for (EngineEvent& ev : batch) {
        if (!ev.ids.empty() && first) {
          first = false;
          t_first = Clock::now();
        }
        for (const std::string& p : builder->add(ev.ids, ev.logprobs)) {
          if (!emit(p)) {
            if (claim_gone(*ch)) metrics_.count_client_gone();
            ch->abandon = true;
            engine_->cancel(engine_id);
            return false;
          }
        }
        if (builder->stop_matched() && !ch->abandon) {
          ch->abandon = true;  // a stop string ended the answer: free the sequence now
          engine_->cancel(engine_id);
        }
        if (!ev.done) continue;
        if (ev.finish_reason == "error") {
          // A grammar past the matcher's limits is the request's fault: 400, as any refused grammar.
          if (ev.request_error) emit(error_json(400, "invalid_request_error", ev.error));
          else emit(error_json(500, "server_error", ev.error));
          return false;
        }
        if (ev.finish_reason == "cancelled" && !builder->stop_matched()) {
          emit(error_json(503, "unavailable_error", "request cancelled (server shutting down)"));
          return false;
        }
        if (ev.grammar_incomplete) builder->set_grammar_incomplete();
        for (const std::string& p : builder->finish(ev.finish_reason, ev.stats)) emit(p);
        const double e2e = seconds_since(t_arrival);
        if (!first) {
          const double ttft = std::chrono::duration<double>(t_first - t_arrival).count();
          const int64_t n = builder->n_generated();
          metrics_.observe_request(ttft, n > 1 ? (e2e - ttft) / double(n - 1) : 0.0, n > 1, e2e);
        }
        return true;
      }
    }
  };
  // Nothing may escape: a request whose answer failed must not keep generating for nobody.
  auto pump = [this, ch, engine_id, pump_events](const std::function<bool(const std::string&)>& emit,
                                                 const std::function<bool()>& client_alive) -> bool {
    try {
      return pump_events(emit, client_alive);
    } catch (const std::exception& e) {
      log_line(LogLevel::quiet, cat("server error while answering: ", e.what()));
      ch->abandon = true;
      engine_->cancel(engine_id);
      emit(error_json(500, "server_error", e.what()));
      return false;
    }
  };
  auto client_alive = [&ex] { return ex.peer_alive(); };

  if (!prep.response.stream) {
    std::string body;
    int status = 200;
    bool done = false;
    {
      // The probe lives for the wait only: it is cleared (on every way out) before the reply writes to
      // the exchange it reads. Shutting down, the I/O thread closes sockets: it leaves that to the 503.
      struct Probe {
        Channel& c;
        Probe(Channel& ch, std::function<bool()> f) : c(ch) {
          std::lock_guard<std::mutex> lk(c.mu);
          c.probe = std::move(f);
        }
        ~Probe() {
          std::lock_guard<std::mutex> lk(c.mu);
          c.probe = nullptr;
        }
      } probe(*ch, [&ex] { return ex.cancelled() || ex.peer_alive(); });
      done = pump(
          [&](const std::string& p) {
            body = p;
            if (p.rfind("{\"error\"", 0) == 0) status = json::parse(p)["error"]["code"].get<int>();
            return true;
          },
          client_alive);
    }
    if (!done && body.empty()) {  // the client left (nginx's 499): nobody reads this
      status = 499;
      body = error_json(499, "invalid_request_error", "client closed the connection");
    }
    ex.reply(status, std::move(body), "application/json");
    return;
  }
  if (!ex.start_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}})) {
    if (claim_gone(*ch)) metrics_.count_client_gone();
    ch->abandon = true;
    engine_->cancel(engine_id);
    return;
  }
  auto emit = [&ex](const std::string& p) { return ex.write_chunk("data: " + p + "\n\n"); };
  if (pump(emit, client_alive)) ex.write_chunk("data: [DONE]\n\n");
  ex.end_stream();
}

}  // namespace kd
