// Datagrams with file descriptors over SOCK_SEQPACKET UNIX sockets, shared
// by the daemon and the client.
#ifndef MODELCACHE_SRC_SERVE_SOCKET_H_
#define MODELCACHE_SRC_SERVE_SOCKET_H_

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/unique_fd.h"

namespace modelcache::serve::detail {

struct Datagram {
  std::string bytes;  // at most the size asked for
  std::vector<base::UniqueFd> fds;
  size_t real_bytes = 0;       // the datagram's size, even when truncated
  bool truncated = false;      // larger than the buffer (MSG_TRUNC)
  bool fds_truncated = false;  // more descriptors than room (MSG_CTRUNC); the
                               // kernel closed those that did not fit
};

// Receives one datagram of at most `max_bytes` bytes and `max_fds`
// descriptors (received close-on-exec). Returns 1 for a datagram, 0 at the
// end of the stream (an empty datagram reads the same: SOCK_SEQPACKET cannot
// tell them apart), -1 with errno set (EAGAIN with MSG_DONTWAIT when none is
// waiting). `flags` are recvmsg's (MSG_DONTWAIT).
int ReceiveDatagram(int fd, size_t max_bytes, size_t max_fds, int flags,
                    Datagram* out);

// Sends `bytes` with `fds` as one datagram, never raising SIGPIPE. Returns 0,
// or -1 with errno set (EAGAIN with MSG_DONTWAIT when the socket is full,
// EPIPE or ECONNRESET when the peer is gone).
int SendDatagram(int fd, std::string_view bytes, std::span<const int> fds,
                 int flags);

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_SOCKET_H_
