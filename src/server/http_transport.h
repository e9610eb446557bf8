// HTTP/1.1 for a server that faces the network (issue 21), on Boost.Beast: it knows connections,
// requests and limits, nothing of OpenAI (http_server.cpp holds the routes).
//
// Why Beast and not cpp-httplib 0.11 (Debian 12's, used before): httplib gives each connection a
// worker thread that blocks on the socket, so 110 clients trickling a byte a second took every
// worker; its limits are compile-time macros of a prebuilt library (a 64 MB request line was
// buffered whole), it decompresses gzip bodies past --max-body and reads chunked bodies whole before
// the size check. Beast's parser has explicit header and body limits that apply to chunked bodies
// too, decodes no content coding, and its asynchronous reads let one I/O thread hold thousands of
// slow connections that cost a socket each, not a thread.
//
// Shape of a connection's life:
//   accept (refused fast with 503 above max_connections)
//   → wait for the first byte            (idle_timeout_s)
//   → request line + headers             (header_timeout_s from the first byte, ≤ max_header_bytes: 431)
//   → Content-Encoding / Transfer-Encoding checks (415 / 501), Expect: 100-continue answered
//   → body                               (timeout_s for the whole body, ≤ max_body_bytes: 413)
//   → the handler: on the I/O thread for routes that never block (health, metrics), else on a
//     worker of a fixed pool (503 when every worker and the backlog are taken)
//   → the answer: whole, or chunked (SSE); every write must make progress within timeout_s
//   → keep-alive: back to waiting for the first byte, or close.
// Deadlines are per phase of a request, never per byte, so a trickling client cannot hold a
// connection past them.
//
// Shutdown (stop()): stop accepting, close connections that are between requests, give requests in
// flight shutdown_grace_s to finish, then tell handlers to cancel (HttpExchange::cancelled()) and
// close whatever is left a second later. run() returns once every worker is idle.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kd {

struct HttpLimits {
  size_t max_header_bytes = size_t(64) << 10;  // request line + every header, together
  size_t max_body_bytes = size_t(16) << 20;    // after de-chunking; no content coding is decoded
  int64_t idle_timeout_s = 5;     // a connection waiting for (the first byte of) a request
  int64_t header_timeout_s = 30;  // from the first byte to the end of the headers
  int64_t timeout_s = 60;         // the whole body; and each write of an answer
  int64_t shutdown_grace_s = 5;   // requests in flight when stop() is called may finish within this
  int max_connections = 1024;     // open connections; more are answered 503 and closed
  int workers = 64;               // handler threads (each open generation request holds one)
  int io_threads = 2;
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // "GET", "POST", …
  std::string target;  // as sent: path and query
  std::string path;    // percent-decoded, without the query
  HttpHeaders headers;  // names lower-cased
  std::string body;
  std::string remote;  // peer address, for logs
  // The value of header `name` (lower-case), "" when absent.
  const std::string& header(std::string_view name) const;
};

// One request's answer, written by its handler. Every call is safe from the handler's thread; a
// write that fails (client gone, no progress within timeout_s, server closing) returns false and
// every later one does too.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  // A whole answer (Content-Length). Call once, instead of the stream calls.
  virtual void reply(int status, std::string body, const std::string& content_type, const HttpHeaders& extra = {}) = 0;
  // A chunked answer: the header, then chunks, then end_stream().
  virtual bool start_stream(int status, const std::string& content_type, const HttpHeaders& extra = {}) = 0;
  virtual bool write_chunk(std::string_view data) = 0;
  virtual void end_stream() = 0;
  // False once the peer closed or reset the connection (POLLRDHUP: a half-close counts, as in nginx).
  virtual bool peer_alive() = 0;
  // True once the shutdown grace is over: stop generating and answer now.
  virtual bool cancelled() const = 0;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpExchange&)>;

struct HttpCallbacks {
  HttpHandler handle;  // runs on a worker thread
  // True for requests whose handler never blocks: run it on the I/O thread, so that /health answers
  // while every worker is taken. Such handlers must reply() and not stream.
  std::function<bool(const HttpRequest&)> is_quick;
  // The body of an error the transport answers itself (status, message) → JSON text.
  std::function<std::string(int, const std::string&)> error_body;
  std::function<void(int)> on_response;  // every answer's status (metrics); may be empty
};

class HttpTransport {
 public:
  HttpTransport(HttpLimits limits, HttpCallbacks callbacks);
  ~HttpTransport();
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Binds and listens (backlog SOMAXCONN); port 0 picks a free port. Throws kd::Error naming host:port.
  void bind(const std::string& host, int port);
  int port() const;
  const HttpLimits& limits() const;
  void run();   // serves until stop() completes; call after bind(), on its own thread
  void stop();  // graceful, as described above; returns at once (run() returns when done)
  void stop_now();  // skips the grace period (a second SIGTERM)

  struct Impl;  // opaque (http_transport.cpp); public so that its connections can name it

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kd
