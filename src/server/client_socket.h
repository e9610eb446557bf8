// Seeing a non-streaming client leave while its request is still generating (issue 6).
// cpp-httplib 0.11 hands a route handler no socket and offers no "is the peer still there" check,
// and a non-streaming response writes nothing until the answer is complete, so a failed write
// cannot tell either. The handler runs on the worker thread that owns the connection, and the
// connection's four-tuple (Request's local/remote address and port) names exactly one open socket
// of this process for as long as the handler runs: find it once, then poll it for a hang-up while
// waiting on the engine.
#pragma once
#include <string>

namespace kd {

// The fd of this process's connected TCP socket with these endpoints (addresses as getnameinfo
// NI_NUMERICHOST writes them, which is how httplib fills Request::local_addr / remote_addr);
// -1 when there is none (or /proc/self/fd cannot be read).
int find_connection_fd(const std::string& local_addr, int local_port, const std::string& peer_addr, int peer_port);

// True once the peer closed its side or the connection was reset (POLLRDHUP / POLLHUP / POLLERR).
// Like nginx, a client that half-closes (shutdown(SHUT_WR)) while waiting counts as gone.
// Never blocks.
bool peer_hung_up(int fd);

}  // namespace kd
