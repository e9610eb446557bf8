#include "server/client_socket.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <netinet/in.h>

namespace kd {

namespace {

// The port of an IPv4 / IPv6 socket address; -1 for any other family.
int port_of(const sockaddr_storage& sa) {
  if (sa.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(sa).sin_port);
  if (sa.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(sa).sin6_port);
  return -1;
}

// The socket address (of `fd`'s own end, or its peer's) has this port and numeric host.
bool endpoint_is(int fd, bool peer, const std::string& addr, int port) {
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  auto* p = reinterpret_cast<sockaddr*>(&sa);
  if ((peer ? getpeername(fd, p, &len) : getsockname(fd, p, &len)) != 0 || port_of(sa) != port) return false;
  char host[NI_MAXHOST];
  return getnameinfo(p, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) == 0 && addr == host;
}

}  // namespace

int find_connection_fd(const std::string& local_addr, int local_port, const std::string& peer_addr, int peer_port) {
  if (local_port <= 0 || peer_port <= 0) return -1;
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  const int own = dirfd(dir);
  int found = -1;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long v = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || v == own) continue;  // "." / ".." / the listing itself
    const int fd = static_cast<int>(v);
    // The local end first: it rules out every socket but this server's connections.
    if (!endpoint_is(fd, false, local_addr, local_port) || !endpoint_is(fd, true, peer_addr, peer_port)) continue;
    found = fd;
    break;
  }
  closedir(dir);
  return found;
}

bool peer_hung_up(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  if (poll(&p, 1, 0) < 0) return false;  // EINTR: look again at the next check
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace kd
