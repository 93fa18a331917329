// The daemon's side of systemd's notification and descriptor-passing
// protocols, written against the documented wire format (sd_notify(3),
// sd_listen_fds(3), sd_pid_notify_with_fds(3)) rather than libsystemd.
//
// Design note: the file descriptor store.
//
//   `modelcache serve` keeps each copy in sealed memfds, which die with the
//   last descriptor of them. Run as a systemd service (Type=notify) it can
//   hand those descriptors to the service manager ("FDSTORE=1" with the
//   descriptors attached, under a name, "FDNAME="), which then holds them
//   while the service restarts, whether asked to (systemctl restart) or
//   after a crash. On the next start systemd passes every stored descriptor
//   back to the new main process, from descriptor 3 on (SD_LISTEN_FDS_START),
//   with LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES saying which and under
//   which names: TakeListenFds reads them. So a restart need not read the
//   weights again, and a crash does not free memory that a worker may still
//   map (the workers' mappings keep the pages anyway; the store keeps them
//   reachable for the next daemon).
//
//   What systemd does, and what it does not (systemd 252, Debian 12):
//   - It keeps at most FileDescriptorStoreMax= descriptors for the unit
//     (0 by default: nothing is kept). Past that a descriptor is dropped
//     and only its log says so: a datagram that went (Notify returned
//     true) is no proof that it was stored.
//   - It drops a descriptor already in the store (the same file and the
//     same open flags), even one sent under another name.
//   - Several descriptors may share one name; FDSTOREREMOVE=1 with FDNAME=
//     closes every stored descriptor of that name. Order on the way back is
//     not promised: match them by name (and, within a name, by content,
//     e.g. fstat or the memfd's name), never by position.
//   - It closes a stored descriptor on POLLHUP or POLLERR (a memfd cannot
//     be polled, which it accepts: a memfd stays until removed), and all of
//     them once the unit is fully stopped with
//     no job queued for it (systemctl stop), unless
//     FileDescriptorStorePreserve= (systemd >= 254) says otherwise.
//   - It accepts the messages only from the processes NotifyAccess= allows
//     (FileDescriptorStoreMax= alone implies NotifyAccess=main). It learns
//     the sender from the kernel (SCM_CREDENTIALS, which the kernel adds for
//     a receiver with SO_PASSCRED): the sender attaches nothing for that.
//   - A datagram carries at most 253 descriptors (the kernel's SCM_MAX_FD)
//     and systemd reads at most 4096 bytes of text (longer ones it ignores
//     whole); Notify refuses more of either rather than send what would be
//     lost.
//   All of this needs systemd as the service manager: with none (or one
//   that sets no NOTIFY_SOCKET) the notifier is disabled, every call returns
//   false, and the daemon runs as it does without it.
//
// Thread-safety: a SystemdNotifier is immutable once built; its methods may
// be called from any thread at once (each Notify uses a socket of its own).
// TakeListenFds reads and changes the environment: call it once, at start,
// before any thread runs.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_SYSTEMD_H_
#define MODELCACHE_SRC_SERVE_DAEMON_SYSTEMD_H_

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/unique_fd.h"

namespace modelcache::serve::detail {

// The first descriptor systemd passes (SD_LISTEN_FDS_START).
inline constexpr int kListenFdsStart = 3;
// The most descriptors one datagram carries (the kernel's SCM_MAX_FD).
inline constexpr size_t kMaxNotifyFds = 253;
// The most text systemd reads of one notification datagram.
inline constexpr size_t kMaxNotifyBytes = 4096;
// The longest FDNAME systemd accepts.
inline constexpr size_t kMaxFdNameBytes = 255;

// Whether systemd would accept `name` as an FDNAME: 1 to 255 characters of
// printable ASCII (' ' to '~') other than ':', which separates the names in
// LISTEN_FDNAMES. (systemd also accepts the empty name; it reads back as an
// empty field of LISTEN_FDNAMES, so it is refused here.)
bool IsValidFdName(std::string_view name);

// Sends notifications to the service manager's socket ($NOTIFY_SOCKET).
class SystemdNotifier {
 public:
  // How long one Notify waits for room in the manager's socket.
  static constexpr std::chrono::milliseconds kDefaultSendTimeout{1000};

  // From $NOTIFY_SOCKET (read now: later changes of the environment do not
  // matter); disabled when it is unset or empty. The variable is left set.
  SystemdNotifier();
  // From `address`: an absolute path, or an abstract socket name written
  // with a leading '@'; "" disables. Any other address (relative, too long
  // for sockaddr_un, or of another family such as "vsock:") disables it too,
  // and error() says why. A zero `send_timeout` never waits (MSG_DONTWAIT).
  explicit SystemdNotifier(
      std::string_view address,
      std::chrono::milliseconds send_timeout = kDefaultSendTimeout);

  // Whether there is a manager to notify.
  bool enabled() const { return enabled_; }
  // The address as given ("" when none).
  const std::string& address() const { return address_; }
  // Why the address given was refused ("" when it was not).
  const std::string& error() const { return error_; }

  // Sends `state` (newline-separated VAR=value assignments) with `fds`
  // attached (SCM_RIGHTS; systemd gets duplicates, the caller keeps its
  // own) as one datagram. Returns whether it went; when not, and `error` is
  // not null, says why there. Never raises SIGPIPE; waits at most the send
  // timeout when the manager's socket is full. Refuses more than
  // kMaxNotifyBytes of text or kMaxNotifyFds descriptors.
  bool Notify(std::string_view state, std::span<const int> fds = {},
              std::string* error = nullptr) const;

  // "READY=1\nSTATUS=<status>": start-up is done (Type=notify waits for it);
  // no STATUS= when `status` is empty. Newlines in `status` become spaces,
  // so that it cannot add assignments of its own; so in Status.
  bool Ready(std::string_view status = {}, std::string* error = nullptr) const;
  // "STOPPING=1": the service is shutting down.
  bool Stopping(std::string* error = nullptr) const;
  // "RELOADING=1\nMONOTONIC_USEC=<now>": a reload began; send Ready() when
  // it is done.
  bool Reloading(std::string* error = nullptr) const;
  // "STATUS=<text>": one line that systemctl status shows.
  bool Status(std::string_view text, std::string* error = nullptr) const;
  // "FDSTORE=1\nFDNAME=<name>" with `fds`: asks the manager to keep
  // duplicates of `fds` under `name` (see the top of this file for what it
  // does with them). Refuses, with a message naming it, a name
  // IsValidFdName refuses, and an empty `fds`.
  bool StoreFds(std::string_view name, std::span<const int> fds,
                std::string* error = nullptr) const;
  // "FDSTOREREMOVE=1\nFDNAME=<name>": the manager closes every descriptor
  // it keeps under `name`. Refuses an invalid name as StoreFds does.
  bool RemoveFds(std::string_view name, std::string* error = nullptr) const;

 private:
  std::string address_;
  std::string error_;
  bool enabled_ = false;
  std::chrono::milliseconds send_timeout_ = kDefaultSendTimeout;
};

// One descriptor passed by the service manager, now the caller's.
struct ListenedFd {
  base::UniqueFd fd;
  std::string name;  // from LISTEN_FDNAMES, "unknown" when it names none
};

struct ListenFds {
  std::vector<ListenedFd> fds;  // in the order passed: 3, 4, ...
  std::string error;            // why none were taken ("" when all went)
};

// Takes the descriptors the service manager passed to this process, as
// sd_listen_fds_with_names(unset_environment=1) does:
//   - LISTEN_PID unset, or another process's: none (not for us), no error.
//   - LISTEN_FDS unset or 0: none, no error.
//   - LISTEN_PID or LISTEN_FDS not a decimal number (LISTEN_PID > 0,
//     LISTEN_FDS >= 0), or a descriptor of 3 .. 3+LISTEN_FDS-1 not open:
//     none, an error, and no descriptor is touched.
//   - LISTEN_FDNAMES: ':'-separated names, the i-th for descriptor 3+i;
//     missing, or with fewer names than descriptors, the rest are
//     "unknown". More names than descriptors: none and an error, and the
//     descriptors are closed (which is which cannot be told).
// Each descriptor taken is made close-on-exec. The three variables are
// unset in every case, so that no child takes them for its own.
// Reports every failure in `error`, never by throwing (bar std::bad_alloc).
// REQUIRES: no other thread reads or changes the environment.
ListenFds TakeListenFds();

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_SYSTEMD_H_
