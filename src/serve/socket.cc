#include "socket.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace modelcache::serve::detail {

int ReceiveDatagram(int fd, size_t max_bytes, size_t max_fds, int flags,
                    Datagram* out) {
  out->fds.clear();
  out->bytes.resize(max_bytes);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (max_fds ? max_fds : 1)));
  iovec iov{out->bytes.data(), out->bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, flags | MSG_TRUNC | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    out->bytes.clear();
    return -1;
  }
  // Take every descriptor first, so that none leaks whatever happens next.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out->fds.emplace_back(received);
      }
    }
  }
  out->real_bytes = static_cast<size_t>(n);
  out->truncated =
      (msg.msg_flags & MSG_TRUNC) != 0 || static_cast<size_t>(n) > max_bytes;
  out->fds_truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  out->bytes.resize(static_cast<size_t>(n) < max_bytes ? static_cast<size_t>(n)
                                                       : max_bytes);
  return n == 0 ? 0 : 1;
}

int SendDatagram(int fd, std::string_view bytes, std::span<const int> fds,
                 int flags) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(fd, &msg, flags | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n < 0 ? -1 : 0;
}

}  // namespace modelcache::serve::detail
