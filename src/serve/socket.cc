#include "socket.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace modelcache::serve::detail {

int ReceiveDatagram(int fd, size_t max_bytes, size_t max_fds, int flags,
                    Datagram* out) {
  out->fds.clear();
  // Per thread and reused: a fresh 64 KiB buffer (zeroed) per datagram
  // would cost more than the rest of a hit.
  thread_local std::vector<char> buffer;
  thread_local std::vector<char> control;
  if (buffer.size() < max_bytes + 1) buffer.resize(max_bytes + 1);
  const size_t control_bytes =
      CMSG_SPACE(sizeof(int) * (max_fds ? max_fds : 1));
  if (control.size() < control_bytes) control.resize(control_bytes);
  iovec iov{buffer.data(), max_bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control_bytes;
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
  const size_t kept =
      static_cast<size_t>(n) < max_bytes ? static_cast<size_t>(n) : max_bytes;
  out->real_bytes = static_cast<size_t>(n);
  out->truncated =
      (msg.msg_flags & MSG_TRUNC) != 0 || static_cast<size_t>(n) > max_bytes;
  out->fds_truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  out->bytes.assign(buffer.data(), kept);
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
