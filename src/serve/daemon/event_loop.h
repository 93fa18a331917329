// The daemon's small wrappers of epoll, pidfds and errno, and the loop's
// constants, shared by the daemon_*.cc files (internal to src/serve).
#ifndef MODELCACHE_SRC_SERVE_DAEMON_EVENT_LOOP_H_
#define MODELCACHE_SRC_SERVE_DAEMON_EVENT_LOOP_H_

#include <poll.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"

// In the daemon's namespace (not a public header): the daemon_*.cc files
// call these unqualified, as they did when they were one file.
namespace modelcache::serve {

// epoll tags: the kind in the top byte, an id below.
enum Tag : uint64_t {
  kListenTag = 1,
  kEventTag = 2,
  kSignalTag = 3,
  kConnTag = 4,        // id: connection
  kConnPidTag = 5,     // id: connection
  kOrphanPidTag = 6,   // id: orphan group
  kRestartPidTag = 7,  // id: pid
  kPauseHookTag = 8
};
inline constexpr int kTagShift = 56;
inline uint64_t Tagged(uint64_t kind, uint64_t id) {
  return (kind << kTagShift) | id;
}

// Datagrams read from one connection per wakeup: a flooding client waits
// its turn behind the others.
inline constexpr int kReadsPerWakeup = 16;
inline constexpr int kAcceptsPerWakeup = 64;
inline constexpr std::chrono::milliseconds kInterruptEvery{10};

[[noreturn]] inline void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

inline uint64_t Fnv1a(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

inline void EpollAdd(int epoll, int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
    const int e = errno;
    throw Error(ErrorCode::kIo, "epoll_ctl: " + base::ErrnoText(e));
  }
}

inline void EpollMod(int epoll, int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  ::epoll_ctl(epoll, EPOLL_CTL_MOD, fd, &ev);
}

inline void EpollDel(int epoll, int fd) {
  if (fd >= 0) ::epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nullptr);
}

// Whether the process behind `pidfd` has exited.
inline bool PeerGone(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
}

inline int PidfdOpen(pid_t pid) {
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

}  // namespace modelcache::serve

#endif  // MODELCACHE_SRC_SERVE_DAEMON_EVENT_LOOP_H_
