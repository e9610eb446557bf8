#include "server/http_transport.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/resource.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "core/log.h"

namespace kd {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

const std::string& HttpRequest::header(std::string_view name) const {
  static const std::string none;
  for (const auto& [k, v] : headers)
    if (k == name) return v;
  return none;
}

namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The path of a request target, percent-decoded ("%2F" → "/"); the query is dropped.
std::string decode_path(std::string_view target) {
  target = target.substr(0, target.find('?'));
  std::string out;
  out.reserve(target.size());
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] == '%' && i + 2 < target.size()) {
      const int hi = hex(target[i + 1]), lo = hex(target[i + 2]);
      if (hi >= 0 && lo >= 0) {
        out += char(hi * 16 + lo);
        i += 2;
        continue;
      }
    }
    out += target[i];
  }
  return out;
}

// Status line and headers of an answer, ending in the blank line.
std::string response_head(int status, const std::string& content_type, const HttpHeaders& extra, bool keep_alive,
                          std::optional<size_t> content_length, bool chunked) {
  const auto reason = http::obsolete_reason(http::int_to_status(unsigned(status)));
  std::string h = cat("HTTP/1.1 ", status, " ", reason.empty() ? std::string_view("Unknown") : std::string_view(reason.data(), reason.size()),
                      "\r\nServer: kdtree\r\n");
  if (!content_type.empty()) h += "Content-Type: " + content_type + "\r\n";
  for (const auto& [k, v] : extra) h += k + ": " + v + "\r\n";
  if (content_length) h += cat("Content-Length: ", *content_length, "\r\n");
  if (chunked) h += "Transfer-Encoding: chunked\r\n";
  if (!keep_alive) h += "Connection: close\r\n";
  return h + "\r\n";
}

}  // namespace

struct Connection;

struct HttpTransport::Impl {
  HttpLimits lim;
  HttpCallbacks cb;
  // Declared before the I/O context: connections still queued in it when it is destroyed deregister here.
  std::atomic<int> open{0};
  std::mutex conns_mu;
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> conns;
  uint64_t next_conn = 0;
  net::io_context ioc;
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_backoff{ioc};
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  int port = 0;

  // Workers: a fixed pool with a bounded backlog.
  std::mutex mu;
  std::condition_variable cv, idle_cv;
  std::deque<std::function<void()>> queue;
  int busy = 0;
  bool workers_stop = false;

  std::atomic<bool> stopping{false}, cancelling{false};
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stop_requested = false, stop_now_requested = false;

  Impl(HttpLimits l, HttpCallbacks c) : lim(l), cb(std::move(c)) { raise_fd_limit(); }

  // Each connection is a descriptor: take the hard limit, and keep the cap below it.
  void raise_fd_limit() {
    rlimit rl{};
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    if (rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      setrlimit(RLIMIT_NOFILE, &rl);
      getrlimit(RLIMIT_NOFILE, &rl);
    }
    const int64_t room = int64_t(rl.rlim_cur) - 256;  // model files, drafters, the engine's own
    if (rl.rlim_cur != RLIM_INFINITY && lim.max_connections > room) {
      log_info("http: the descriptor limit is ", rl.rlim_cur, "; connections capped at ", std::max<int64_t>(16, room));
      lim.max_connections = int(std::max<int64_t>(16, room));
    }
  }

  bool submit(std::function<void()> f) {
    std::lock_guard<std::mutex> lk(mu);
    if (workers_stop || int(queue.size()) >= lim.workers) return false;  // backlog: as long as the pool
    queue.push_back(std::move(f));
    cv.notify_one();
    return true;
  }

  void worker_loop() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return !queue.empty() || workers_stop; });
      if (queue.empty()) return;
      auto f = std::move(queue.front());
      queue.pop_front();
      ++busy;
      lk.unlock();
      f();
      lk.lock();
      --busy;
      idle_cv.notify_all();
    }
  }

  void do_accept();
  void refuse(tcp::socket s);
  void for_each_connection(const std::function<void(const std::shared_ptr<Connection>&)>& f);
};

// One client connection. Every member but `broken` is touched only on the connection's strand (the
// socket's executor), or by the worker that owns the connection while `handling` is true and no
// read is pending.
struct Connection : std::enable_shared_from_this<Connection> {
  HttpTransport::Impl& t;
  beast::tcp_stream stream;
  beast::flat_buffer buf;
  std::optional<http::request_parser<http::string_body>> parser;
  uint64_t id = 0;
  bool handling = false;  // a request is being answered (worker or inline)
  bool closed = false;
  std::string remote;

  Connection(HttpTransport::Impl& t_, tcp::socket s) : t(t_), stream(std::move(s)) {
    beast::error_code ec;
    const auto ep = stream.socket().remote_endpoint(ec);
    if (!ec) remote = cat(ep.address().to_string(), ":", ep.port());
  }
  ~Connection() {
    --t.open;
    std::lock_guard<std::mutex> lk(t.conns_mu);
    t.conns.erase(id);
  }

  void close() {
    if (closed) return;
    closed = true;
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream.close();
  }

  // After an answer that ends the connection while the client may still be sending (a 413 on a body
  // in flight): half-close and discard what arrives for a moment, so the client reads the answer
  // instead of a reset (nginx's lingering close).
  void linger_close() {
    if (closed) return;
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    stream.expires_after(std::chrono::seconds(2));
    drain(0);
  }
  void drain(size_t discarded) {
    auto scratch = std::make_shared<std::array<char, 16384>>();
    stream.async_read_some(net::buffer(*scratch), [self = shared_from_this(), scratch, discarded](beast::error_code ec, size_t n) {
      if (ec || discarded + n > (size_t(4) << 20)) return self->close();  // at most 2 s and 4 MiB, kept nowhere
      self->drain(discarded + n);
    });
  }

  // Wait for the first byte of the next request (idle_timeout_s).
  void next_request() {
    handling = false;
    if (t.stopping) return close();
    if (buf.capacity() > (size_t(256) << 10)) buf.shrink_to_fit();
    if (buf.size() > 0) return read_header();  // pipelined: the next request is already here
    stream.expires_after(std::chrono::seconds(t.lim.idle_timeout_s));
    stream.async_read_some(buf.prepare(8192), [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec) return self->close();
      self->buf.commit(n);
      self->read_header();
    });
  }

  void read_header() {
    if (t.stopping) return close();
    parser.emplace();
    parser->header_limit(std::uint32_t(std::min<size_t>(t.lim.max_header_bytes, UINT32_MAX)));
    parser->body_limit(std::uint64_t(t.lim.max_body_bytes));
    stream.expires_after(std::chrono::seconds(t.lim.header_timeout_s));
    http::async_read_header(stream, buf, *parser, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->read_failed(ec);
      self->check_header();
    });
  }

  void check_header() {
    auto& req = parser->get();
    if (const auto ce = trim(std::string_view(req[http::field::content_encoding])); !ce.empty() && !iequals(ce, "identity"))
      return answer_error(415, cat("Content-Encoding '", std::string(ce).substr(0, 40),
                                   "' is not accepted: send the request body uncompressed"));
    if (const auto te = trim(std::string_view(req[http::field::transfer_encoding])); !te.empty() && !iequals(te, "chunked"))
      return answer_error(501, cat("Transfer-Encoding '", std::string(te).substr(0, 40), "' is not supported (only chunked)"));
    if (parser->is_done()) return dispatch();
    if (iequals(trim(std::string_view(req[http::field::expect])), "100-continue")) {
      auto msg = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      stream.expires_after(std::chrono::seconds(t.lim.timeout_s));
      return net::async_write(stream, net::buffer(*msg), [self = shared_from_this(), msg](beast::error_code ec, size_t) {
        if (ec) return self->close();
        self->read_body();
      });
    }
    read_body();
  }

  void read_body() {
    stream.expires_after(std::chrono::seconds(t.lim.timeout_s));
    http::async_read(stream, buf, *parser, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->read_failed(ec);
      self->dispatch();
    });
  }

  void read_failed(beast::error_code ec) {
    if (ec == http::error::header_limit)
      return answer_error(431, cat("the request line and headers exceed ", t.lim.max_header_bytes, " bytes"));
    if (ec == http::error::body_limit)
      return answer_error(413, cat("request body exceeds the size limit of ", t.lim.max_body_bytes, " bytes (--max-body)"));
    // Timed out (the stream has closed the socket), reset, or gone mid-request: nobody to answer.
    const bool parse_error = ec.category() == http::make_error_code(http::error::bad_method).category() &&
                             ec != http::error::end_of_stream && ec != http::error::partial_message;
    if (!parse_error) return close();
    answer_error(400, cat("malformed HTTP request: ", ec.message()));
  }

  // An error the transport answers itself; the connection closes after it.
  void answer_error(int status, const std::string& message, const HttpHeaders& extra = {}) {
    const std::string body = t.cb.error_body(status, message);
    write_then_close(response_head(status, "application/json", extra, false, body.size(), false) + body);
    if (t.cb.on_response) t.cb.on_response(status);
  }

  void write_then_close(std::string bytes) {
    handling = true;
    auto msg = std::make_shared<std::string>(std::move(bytes));
    stream.expires_after(std::chrono::seconds(t.lim.timeout_s));
    net::async_write(stream, net::buffer(*msg), [self = shared_from_this(), msg](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->linger_close();
    });
  }

  void dispatch();
  void handled(bool reusable) {  // on the strand, once a handler's answer is written
    if (reusable && !t.stopping) return next_request();
    linger_close();
  }
};

// The answer of one request. Inline (on the I/O thread) it buffers the one reply for the connection
// to write; on a worker every write is posted to the connection's strand and waited for.
class Exchange final : public HttpExchange {
 public:
  Exchange(std::shared_ptr<Connection> c, bool on_io_thread, bool keep_alive, bool http10)
      : c_(std::move(c)), inline_(on_io_thread), keep_alive_(keep_alive), http10_(http10) {}

  void reply(int status, std::string body, const std::string& content_type, const HttpHeaders& extra) override {
    if (answered_) fail("http: a second answer to one request");
    answered_ = true;
    status_ = status;
    write(response_head(status, content_type, extra, keep_alive_, body.size(), false) + body);
  }
  bool start_stream(int status, const std::string& content_type, const HttpHeaders& extra) override {
    if (answered_) fail("http: a second answer to one request");
    if (inline_) fail("http: a quick route may not stream");
    answered_ = streaming_ = true;
    status_ = status;
    if (http10_) keep_alive_ = false;  // HTTP/1.0 has no chunked coding: the end of the answer is the close
    return write(response_head(status, content_type, extra, keep_alive_, std::nullopt, !http10_));
  }
  bool write_chunk(std::string_view data) override {
    if (data.empty()) return !broken_;
    if (http10_) return write(std::string(data));
    char len[24];
    std::snprintf(len, sizeof len, "%zx\r\n", data.size());
    return write(cat(len, data, "\r\n"));
  }
  void end_stream() override {
    if (!streaming_ || ended_) return;
    ended_ = true;
    if (!http10_) write("0\r\n\r\n");
  }
  bool peer_alive() override {
    if (broken_) return false;
    const int fd = c_->stream.socket().native_handle();
    if (fd < 0) return false;  // closed under us (shutdown)
    pollfd p{fd, POLLRDHUP, 0};
    if (poll(&p, 1, 0) < 0) return true;  // EINTR: look again next time
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0;
  }
  bool cancelled() const override { return c_->t.cancelling.load(); }

  bool answered() const { return answered_; }
  bool streaming() const { return streaming_; }
  int status() const { return status_; }
  // Whether the connection can carry another request after this answer.
  bool reusable() const { return keep_alive_ && !broken_ && (!streaming_ || ended_); }
  std::string take_pending() { return std::move(pending_); }

 private:
  bool write(std::string bytes) {
    if (broken_) return false;
    if (inline_) {
      pending_ += bytes;
      return true;
    }
    // Fast path: while a handler owns the connection nothing else is pending on the socket, so the
    // worker may write itself. A non-blocking send usually takes the whole (small) SSE event; only
    // what the kernel does not take now goes through the I/O thread, under the write deadline. Saves
    // a thread handoff per event (measured: ~17 % of throughput at 1,300–2,200 events/s, docs/perf.md).
    const int fd = c_->stream.socket().native_handle();
    if (fd < 0) return !(broken_ = true);
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        sent += size_t(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      return !(broken_ = true);  // reset, broken pipe: the client is gone
    }
    if (sent == bytes.size()) return true;
    bytes.erase(0, sent);
    auto done = std::make_shared<std::promise<bool>>();
    auto msg = std::make_shared<std::string>(std::move(bytes));
    auto c = c_;
    net::post(c->stream.get_executor(), [c, done, msg] {
      if (c->closed) return done->set_value(false);
      c->stream.expires_after(std::chrono::seconds(c->t.lim.timeout_s));
      net::async_write(c->stream, net::buffer(*msg), [c, done, msg](beast::error_code ec, size_t) {
        c->stream.expires_never();
        done->set_value(!ec);
      });
    });
    // The I/O threads outlive every worker (run() joins the workers first), so this completes: with
    // success, a failed write, or the timeout.
    if (!done->get_future().get()) broken_ = true;
    return !broken_;
  }

  std::shared_ptr<Connection> c_;
  bool inline_, keep_alive_, http10_;
  bool answered_ = false, streaming_ = false, ended_ = false, broken_ = false;
  int status_ = 0;
  std::string pending_;
};

void Connection::dispatch() {
  handling = true;
  stream.expires_never();
  auto msg = parser->release();
  parser.reset();
  auto req = std::make_shared<HttpRequest>();
  req->method = std::string(msg.method_string());
  req->target = std::string(msg.target());
  req->path = decode_path(req->target);
  for (const auto& f : msg) req->headers.emplace_back(lower(f.name_string()), std::string(f.value()));
  req->body = std::move(msg.body());
  req->remote = remote;
  const bool keep_alive = msg.keep_alive() && !t.stopping;
  const bool http10 = msg.version() < 11;

  auto run = [&t = t, req](HttpExchange& ex) {
    try {
      t.cb.handle(*req, ex);
    } catch (const std::exception& e) {
      log_line(LogLevel::quiet, cat("server error: ", e.what()));
      auto& x = static_cast<Exchange&>(ex);
      if (!x.answered()) ex.reply(500, t.cb.error_body(500, e.what()), "application/json");
    }
    auto& x = static_cast<Exchange&>(ex);
    if (!x.answered()) ex.reply(500, t.cb.error_body(500, "the handler gave no answer"), "application/json");
    if (x.streaming()) ex.end_stream();
    if (t.cb.on_response) t.cb.on_response(x.status());
  };

  if (t.cb.is_quick && t.cb.is_quick(*req)) {
    Exchange ex(shared_from_this(), true, keep_alive, http10);
    run(ex);
    auto bytes = std::make_shared<std::string>(ex.take_pending());
    const bool reusable = ex.reusable();
    stream.expires_after(std::chrono::seconds(t.lim.timeout_s));
    net::async_write(stream, net::buffer(*bytes), [self = shared_from_this(), bytes, reusable](beast::error_code ec, size_t) {
      if (ec) return self->close();
      self->handled(reusable);
    });
    return;
  }
  auto self = shared_from_this();
  const bool queued = t.submit([self, req, run, keep_alive, http10] {
    Exchange ex(self, false, keep_alive, http10);
    run(ex);
    net::post(self->stream.get_executor(), [self, reusable = ex.reusable()] { self->handled(reusable); });
  });
  if (!queued) answer_error(503, "server busy: every HTTP worker is taken; retry shortly", {{"Retry-After", "1"}});
}

void HttpTransport::Impl::refuse(tcp::socket s) {
  // Fast and without a worker: one non-blocking write, then close.
  const std::string body = cb.error_body(503, "server busy: too many open connections; retry shortly");
  const std::string msg = response_head(503, "application/json", {{"Retry-After", "1"}}, false, body.size(), false) + body;
  beast::error_code ec;
  s.non_blocking(true, ec);
  s.write_some(net::buffer(msg), ec);
  s.shutdown(tcp::socket::shutdown_both, ec);
  s.close(ec);
  if (cb.on_response) cb.on_response(503);
}

void HttpTransport::Impl::do_accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket s) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (ec) {  // EMFILE and friends: back off a moment instead of spinning
      log_debug("http: accept failed: ", ec.message());
      accept_backoff.expires_after(std::chrono::milliseconds(50));
      accept_backoff.async_wait([this](beast::error_code) { if (acceptor.is_open()) do_accept(); });
      return;
    }
    if (stopping) {
      beast::error_code e;
      s.close(e);
    } else if (open.load() >= lim.max_connections) {
      refuse(std::move(s));
    } else {
      ++open;
      auto c = std::make_shared<Connection>(*this, std::move(s));
      {
        std::lock_guard<std::mutex> lk(conns_mu);
        c->id = next_conn++;
        conns[c->id] = c;
      }
      net::post(c->stream.get_executor(), [c] { c->next_request(); });
    }
    do_accept();
  });
}

void HttpTransport::Impl::for_each_connection(const std::function<void(const std::shared_ptr<Connection>&)>& f) {
  std::vector<std::shared_ptr<Connection>> live;
  {
    std::lock_guard<std::mutex> lk(conns_mu);
    for (auto& [id, w] : conns)
      if (auto c = w.lock()) live.push_back(std::move(c));
  }
  for (auto& c : live) f(c);
}

HttpTransport::HttpTransport(HttpLimits limits, HttpCallbacks callbacks)
    : impl_(std::make_unique<Impl>(limits, std::move(callbacks))) {}

HttpTransport::~HttpTransport() {
  stop_now();
}

const HttpLimits& HttpTransport::limits() const { return impl_->lim; }
int HttpTransport::port() const { return impl_->port; }

void HttpTransport::bind(const std::string& host, int port) {
  auto& t = *impl_;
  beast::error_code ec;
  tcp::resolver resolver(t.ioc);
  const auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty()) fail("cannot bind ", host, ":", port, ": ", ec ? ec.message() : "no such address");
  const tcp::endpoint ep = results.begin()->endpoint();
  t.acceptor.open(ep.protocol(), ec);
  if (!ec) t.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) t.acceptor.bind(ep, ec);
  if (ec) fail("cannot bind ", host, ":", port, " (", ec.message(), "; in use, or not a local address)");
  // The kernel's accept queue as deep as it allows: a burst of connects must not wait on SYN retries.
  t.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) fail("cannot listen on ", host, ":", port, ": ", ec.message());
  t.port = t.acceptor.local_endpoint().port();
}

void HttpTransport::run() {
  auto& t = *impl_;
  t.work.emplace(t.ioc.get_executor());
  t.do_accept();
  std::vector<std::thread> io, workers;
  for (int i = 0; i < std::max(1, t.lim.io_threads); ++i) io.emplace_back([&t] { t.ioc.run(); });
  for (int i = 0; i < std::max(1, t.lim.workers); ++i) workers.emplace_back([&t] { t.worker_loop(); });

  {
    std::unique_lock<std::mutex> lk(t.stop_mu);
    t.stop_cv.wait(lk, [&] { return t.stop_requested; });
  }
  // 1. No new connections; connections between requests close now.
  t.stopping = true;
  net::post(t.ioc, [&t] {
    beast::error_code ec;
    t.acceptor.close(ec);
    t.accept_backoff.cancel();
  });
  t.for_each_connection([](const std::shared_ptr<Connection>& c) {
    net::post(c->stream.get_executor(), [c] { if (!c->handling) c->close(); });
  });
  // 2. Requests in flight may finish within the grace period.
  const auto grace_end = Clock::now() + std::chrono::seconds(t.lim.shutdown_grace_s);
  auto all_idle = [&t] { return t.busy == 0 && t.queue.empty(); };
  {
    std::unique_lock<std::mutex> lk(t.mu);
    while (!all_idle() && Clock::now() < grace_end) {
      t.idle_cv.wait_for(lk, std::chrono::milliseconds(50));
      std::lock_guard<std::mutex> sl(t.stop_mu);
      if (t.stop_now_requested) break;
    }
  }
  // 3. Then they are told to cancel (handlers look every ≤ 100 ms), and a second later every
  //    connection is closed, which fails any write still waiting on a client.
  t.cancelling = true;
  {
    std::unique_lock<std::mutex> lk(t.mu);
    t.idle_cv.wait_for(lk, std::chrono::seconds(1), all_idle);
  }
  t.for_each_connection([](const std::shared_ptr<Connection>& c) { net::post(c->stream.get_executor(), [c] { c->close(); }); });
  {
    std::lock_guard<std::mutex> lk(t.mu);
    t.workers_stop = true;
    t.cv.notify_all();
  }
  for (auto& w : workers) w.join();
  t.work.reset();
  t.ioc.stop();
  for (auto& th : io) th.join();
}

void HttpTransport::stop() {
  std::lock_guard<std::mutex> lk(impl_->stop_mu);
  impl_->stop_requested = true;
  impl_->stop_cv.notify_all();
}

void HttpTransport::stop_now() {
  std::lock_guard<std::mutex> lk(impl_->stop_mu);
  impl_->stop_requested = impl_->stop_now_requested = true;
  impl_->stop_cv.notify_all();
}

}  // namespace kd
