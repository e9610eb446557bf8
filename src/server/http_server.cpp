#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>

#include "core/log.h"
#include "server/client_socket.h"

namespace kd {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

void send_error(httplib::Response& res, int status, const std::string& type, const std::string& message,
                const std::string& param = "") {
  res.status = status;
  res.set_content(error_json(status, type, message, param), "application/json");
}

void send_api_error(httplib::Response& res, const ApiError& e) { send_error(res, e.status, e.type, e.what(), e.param); }

// Constant time in the length of the expected key: every byte is compared whatever differs first.
bool same_secret(const std::string& given, const std::string& expected) {
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
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

HttpServer::HttpServer(ServerOptions opt) : opt_(std::move(opt)), http_(std::make_unique<httplib::Server>()) {
  created_ = int64_t(std::time(nullptr));
  auto& h = *http_;
  const int threads = opt_.http_threads > 0 ? opt_.http_threads : 96;
  h.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  h.set_read_timeout(time_t(opt_.timeout_s));
  h.set_write_timeout(time_t(opt_.timeout_s));
  h.set_keep_alive_timeout(time_t(opt_.idle_timeout_s));
  h.set_payload_max_length(opt_.max_body_bytes);

  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (opt_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (auth.compare(0, prefix.size(), prefix) != 0 || !same_secret(auth.substr(prefix.size()), opt_.api_key)) {
      send_error(res, 401, "authentication_error", "invalid or missing API key (send 'Authorization: Bearer KEY')");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // httplib's own answers (no route, body too large, unreadable request) get the JSON error shape.
  h.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) send_error(res, 404, "not_found_error", cat("no route ", req.method, " ", req.path));
    else if (res.status == 413) send_error(res, 413, "invalid_request_error", "request body exceeds the size limit");
    else if (res.status == 405) send_error(res, 405, "invalid_request_error", cat("method ", req.method, " not allowed on ", req.path));
    else send_error(res, res.status, res.status >= 500 ? "server_error" : "invalid_request_error", cat("HTTP ", res.status));
  });
  h.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const ApiError& e) {
      send_api_error(res, e);
      return;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    log_line(LogLevel::quiet, cat("server error: ", what));
    send_error(res, 500, "server_error", what);
  });
  h.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics_.count_response(res.status);
    log_debug("http ", req.method, " ", req.path, " → ", res.status);
  });

  h.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready_) return send_error(res, 503, "unavailable_error", "loading model");
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    EngineMetrics em;
    if (ready_) em = engine_->metrics();
    res.set_content(metrics_.render(ready_ ? &em : nullptr, !ready_), "text/plain; version=0.0.4");
  });
  h.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) { handle_models(res); });
  h.Get("/models", [this](const httplib::Request&, httplib::Response& res) { handle_models(res); });
  // One model, as OpenAI's GET /v1/models/{model}; ids may hold '/' (as Hugging Face names do).
  for (const char* path : {R"(/v1/models/(.+))", R"(/models/(.+))"})
    h.Get(path, [this](const httplib::Request& req, httplib::Response& res) { handle_model(req.matches[1].str(), res); });
  for (const char* path : {"/v1/chat/completions", "/chat/completions"})
    h.Post(path, [this](const httplib::Request& req, httplib::Response& res) { handle_generate(Endpoint::chat, req, res); });
  for (const char* path : {"/v1/completions", "/completions"})
    h.Post(path, [this](const httplib::Request& req, httplib::Response& res) { handle_generate(Endpoint::completion, req, res); });
  h.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) { handle_tokenize(req, res); });
  h.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) { handle_detokenize(req, res); });
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::bind() {
  if (opt_.port == 0) {
    port_ = http_->bind_to_any_port(opt_.host);
    if (port_ < 0) fail("cannot bind ", opt_.host, " (any port)");
  } else {
    if (!http_->bind_to_port(opt_.host, opt_.port)) fail("cannot bind ", opt_.host, ":", opt_.port, " (in use, or not a local address)");
    port_ = opt_.port;
  }
}

void HttpServer::listen() { http_->listen_after_bind(); }

void HttpServer::stop() {
  stopping_ = true;
  if (http_ && http_->is_running()) http_->stop();
}

void HttpServer::set_ready(ServedModel model, Engine& engine) {
  model_ = std::move(model);
  engine_ = &engine;
  ready_ = true;
}

bool HttpServer::ready(httplib::Response& res) {
  if (ready_) return true;
  res.set_header("Retry-After", "1");
  send_error(res, 503, "unavailable_error", "loading model");
  return false;
}

nlohmann::json HttpServer::model_object() const {
  return {{"id", model_.name}, {"object", "model"}, {"created", created_}, {"owned_by", "kdtree"},
          {"meta", {{"n_ctx", model_.context}, {"n_vocab", model_.vocab_size},
                    {"chat_template", chat_template_kind_name(model_.chat_template)}}}};
}

void HttpServer::handle_models(httplib::Response& res) {
  if (!ready(res)) return;
  res.set_content(json{{"object", "list"}, {"data", json::array({model_object()})}}.dump(), "application/json");
}

void HttpServer::handle_model(const std::string& id, httplib::Response& res) {
  if (!ready(res)) return;
  if (id != model_.name)
    return send_error(res, 404, "invalid_request_error", cat("model '", id, "' not found (this server serves '", model_.name, "')"), "model");
  res.set_content(model_object().dump(), "application/json");
}

void HttpServer::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  if (!ready(res)) return;
  const json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) return send_error(res, 400, "invalid_request_error", "request body: expected a JSON object");
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    // The exact prompt a chat request would see (template + tools + thinking), as vLLM offers.
    json chat = body;
    chat.erase("content");
    ApiRequest r = parse_api_request(Endpoint::chat, chat.dump());
    r.max_tokens = 1;
    ids = prepare_request(r, model_).prompt;
  } else {
    auto it = body.find("content");
    if (it == body.end() || !it->is_string())
      return send_error(res, 400, "invalid_request_error", "'content': expected a string (or give 'messages')", "content");
    bool parse_special = true;
    if (auto ps = body.find("parse_special"); ps != body.end()) {
      if (!ps->is_boolean()) return send_error(res, 400, "invalid_request_error", "'parse_special': expected a boolean", "parse_special");
      parse_special = ps->get<bool>();
    }
    try {
      ids = model_.tokenizer->encode(it->get<std::string>(), parse_special);
    } catch (const Error& e) {
      return send_error(res, 400, "invalid_request_error", e.what(), "content");
    }
  }
  json out = {{"tokens", ids}, {"count", ids.size()}};
  auto wp = body.find("with_pieces");
  if (wp != body.end() && !wp->is_boolean() && !wp->is_null())
    return send_error(res, 400, "invalid_request_error", "'with_pieces': expected a boolean", "with_pieces");
  if (wp != body.end() && wp->is_boolean() && wp->get<bool>()) {
    json pieces = json::array();
    for (int32_t id : ids) pieces.push_back({{"id", id}, {"piece", utf8_sanitize(model_.tokenizer->token_bytes(id))}});
    out["tokens"] = pieces;
  }
  res.set_content(out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void HttpServer::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  if (!ready(res)) return;
  const json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) return send_error(res, 400, "invalid_request_error", "request body: expected a JSON object");
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) return send_error(res, 400, "invalid_request_error", "'tokens': expected an array of token ids", "tokens");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= model_.tokenizer->vocab_size())
      return send_error(res, 400, "invalid_request_error", cat("'tokens[", i, "]': not a token id in [0, ", model_.tokenizer->vocab_size(), ")"), "tokens");
    ids.push_back(v.get<int32_t>());
  }
  res.set_content(json{{"content", model_.tokenizer->decode(ids)}}.dump(), "application/json");
}

void HttpServer::handle_generate(Endpoint ep, const httplib::Request& req, httplib::Response& res) {
  const auto t_arrival = Clock::now();
  if (!ready(res)) return;
  PreparedRequest prep;
  try {
    ApiRequest r = parse_api_request(ep, req.body);
    if (!r.model.empty() && r.model != model_.name)
      throw ApiError(404, "invalid_request_error", cat("model '", r.model, "' not found (this server serves '", model_.name, "')"), "model");
    if (!r.seed) r.seed = std::random_device{}() | (uint64_t(std::random_device{}()) << 32);  // unseeded: random, as OpenAI
    prep = prepare_request(r, model_);
  } catch (const ApiError& e) {
    return send_api_error(res, e);
  } catch (const Error& e) {  // tokenizer errors name the bad bytes
    return send_error(res, 400, "invalid_request_error", e.what());
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
  er.on_event = [ch](const EngineEvent& ev) {
    {
      std::lock_guard<std::mutex> lk(ch->mu);
      ch->events.push_back(ev);
    }
    ch->cv.notify_one();
    return !ch->abandon.load();
  };
  uint64_t engine_id = 0;
  try {
    engine_id = engine_->submit(std::move(er));
  } catch (const EngineFull& e) {
    res.set_header("Retry-After", "1");
    return send_error(res, 503, "unavailable_error", cat("server busy: ", e.what()));
  } catch (const Error& e) {
    return send_error(res, 400, "invalid_request_error", e.what());
  }

  // Pumps the engine's events through the builder. emit(payload) returns false when the client is
  // gone; the request is then cancelled. Returns the final event (done) or nullopt if abandoned.
  auto builder = std::make_shared<ResponseBuilder>(*model_.tokenizer, prep.response);
  auto pump_events = [this, ch, builder, engine_id, t_arrival](const std::function<bool(const std::string&)>& emit,
                                                              const std::function<bool()>& client_alive) -> bool {
    bool first = true;
    Clock::time_point t_first{};
    Clock::time_point last_check = Clock::now();
    for (;;) {
      std::deque<EngineEvent> batch;
      {
        std::unique_lock<std::mutex> lk(ch->mu);
        ch->cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return !ch->events.empty(); });
        batch.swap(ch->events);
      }
      if (stopping_) {  // shutting down: do not let a long generation hold the exit
        ch->abandon = true;
        engine_->cancel(engine_id);
        emit(error_json(503, "unavailable_error", "server shutting down"));
        return false;
      }
      // Look for a departed client when idle and every 20 ms while events flow (one poll() or
      // select() call): a non-streaming request writes nothing until it is done, so no failed
      // write would tell, and its KV should go back within a few engine steps.
      if (batch.empty() || Clock::now() - last_check >= std::chrono::milliseconds(20)) {
        last_check = Clock::now();
        if (!client_alive()) {
          metrics_.count_client_gone();
          ch->abandon = true;
          engine_->cancel(engine_id);
          return false;
        }
      }
      if (batch.empty()) continue;
      for (EngineEvent& ev : batch) {
        if (!ev.ids.empty() && first) {
          first = false;
          t_first = Clock::now();
        }
        for (const std::string& p : builder->add(ev.ids, ev.logprobs)) {
          if (!emit(p)) {
            metrics_.count_client_gone();
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
          emit(error_json(500, "server_error", ev.error));
          return false;
        }
        if (ev.finish_reason == "cancelled" && !builder->stop_matched()) {
          emit(error_json(503, "unavailable_error", "request cancelled (server shutting down)"));
          return false;
        }
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
  // Nothing may escape: httplib 0.11.4 catches exceptions only around routing, so one thrown from a
  // streaming content provider aborts the process; and a request whose answer failed must not keep
  // generating for nobody.
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

  if (!prep.response.stream) {
    std::string body;
    int status = 200;
    // httplib gives no socket; find this connection's (client_socket.h) to see a client that leaves.
    const int fd = find_connection_fd(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    if (fd < 0) log_debug("request ", serial, ": connection socket not found, a disconnect will not cancel it");
    const bool done = pump(
        [&](const std::string& p) {
          body = p;
          if (p.rfind("{\"error\"", 0) == 0) status = json::parse(p)["error"]["code"].get<int>();
          return true;
        },
        [fd] { return fd < 0 || !peer_hung_up(fd); });
    if (!done && body.empty()) {  // the client left (nginx's 499): nobody reads this, httplib needs an answer
      status = 499;
      body = error_json(499, "invalid_request_error", "client closed the connection");
    }
    res.status = status;
    res.set_content(body, "application/json");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [pump](size_t, httplib::DataSink& sink) {
        auto emit = [&sink](const std::string& p) {
          const std::string frame = "data: " + p + "\n\n";
          return sink.write(frame.data(), frame.size());
        };
        if (pump(emit, [&sink] { return sink.is_writable(); })) {
          const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
        }
        sink.done();
        return true;
      },
      [ch, this, engine_id](bool success) {
        if (!success && !ch->abandon) {  // the connection broke before the provider ran to the end
          metrics_.count_client_gone();
          ch->abandon = true;
          engine_->cancel(engine_id);
        }
      });
}

}  // namespace kd
