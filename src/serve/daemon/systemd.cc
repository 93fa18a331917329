#include "systemd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "modelcache/base/text.h"
#include "socket.h"

namespace modelcache::serve::detail {
namespace {

bool Fail(std::string* error, std::string message) {
  if (error != nullptr) *error = std::move(message);
  return false;
}

// The address of `address` (a path, or '@' and an abstract name), or a
// message saying why there is none.
struct Address {
  sockaddr_un addr{};
  socklen_t length = 0;
};
std::optional<Address> ParseAddress(const std::string& address,
                                    std::string* error) {
  Address out;
  out.addr.sun_family = AF_UNIX;
  const size_t room = sizeof(out.addr.sun_path);
  if (address[0] == '/') {
    // A path needs its terminating NUL within sun_path.
    if (address.size() >= room) {
      *error = "NOTIFY_SOCKET path is longer than " + std::to_string(room - 1) +
               " bytes";
      return std::nullopt;
    }
    std::memcpy(out.addr.sun_path, address.data(), address.size());
    out.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) +
                                        address.size() + 1);
    return out;
  }
  if (address[0] == '@') {
    // An abstract name: sun_path[0] is NUL and the name is the rest of the
    // address, with no terminator (so the length counts exactly the name).
    if (address.size() > room) {
      *error = "NOTIFY_SOCKET abstract name is longer than " +
               std::to_string(room - 1) + " bytes";
      return std::nullopt;
    }
    out.addr.sun_path[0] = '\0';
    std::memcpy(out.addr.sun_path + 1, address.data() + 1, address.size() - 1);
    out.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) +
                                        address.size());
    return out;
  }
  *error = "NOTIFY_SOCKET \"" + address +
           "\" is neither an absolute path nor an abstract name ('@...')";
  return std::nullopt;
}

// `text` with newlines (and NULs) as spaces: a value that cannot add
// assignments of its own to a notification.
std::string OneLine(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c == '\n' || c == '\0') c = ' ';
  }
  return out;
}

bool CheckFdName(std::string_view name, std::string* error) {
  if (IsValidFdName(name)) return true;
  return Fail(error,
              "invalid FDNAME \"" + OneLine(name) +
                  "\": systemd takes 1 to 255 characters of printable ASCII "
                  "other than ':'");
}

std::string_view NotifySocketFromEnvironment() {
  const char* address = std::getenv("NOTIFY_SOCKET");
  return address != nullptr ? address : "";
}

std::optional<std::string> TakeVariable(const char* name) {
  const char* value = std::getenv(name);
  std::optional<std::string> out;
  if (value != nullptr) out = value;
  ::unsetenv(name);
  return out;
}

// A decimal number and nothing else (no sign, no space), at most `max`.
std::optional<long long> ParseCount(const std::string& text, long long max) {
  long long value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || text[0] == '-' || ec != std::errc() || ptr != end ||
      value > max) {
    return std::nullopt;
  }
  return value;
}

}  // namespace

bool IsValidFdName(std::string_view name) {
  if (name.empty() || name.size() > kMaxFdNameBytes) return false;
  for (const char c : name) {
    if (c < ' ' || c > '~' || c == ':') return false;
  }
  return true;
}

SystemdNotifier::SystemdNotifier()
    : SystemdNotifier(NotifySocketFromEnvironment()) {}

SystemdNotifier::SystemdNotifier(std::string_view address,
                                 std::chrono::milliseconds send_timeout)
    : address_(address), send_timeout_(send_timeout) {
  if (address_.empty()) return;
  enabled_ = ParseAddress(address_, &error_).has_value();
}

bool SystemdNotifier::Notify(std::string_view state, std::span<const int> fds,
                             std::string* error) const {
  if (!enabled_) {
    return Fail(error, error_.empty()
                           ? "no service manager to notify (NOTIFY_SOCKET is "
                             "not set)"
                           : error_);
  }
  if (state.empty()) return Fail(error, "empty notification");
  if (state.size() > kMaxNotifyBytes) {
    return Fail(error, "notification of " + std::to_string(state.size()) +
                           " bytes (systemd reads at most " +
                           std::to_string(kMaxNotifyBytes) + ")");
  }
  if (state.find('\0') != std::string_view::npos) {
    return Fail(error, "notification holds a NUL byte");
  }
  if (fds.size() > kMaxNotifyFds) {
    return Fail(error, std::to_string(fds.size()) +
                           " descriptors in one notification (at most " +
                           std::to_string(kMaxNotifyFds) + ")");
  }
  std::string message;
  const std::optional<Address> address = ParseAddress(address_, &message);
  if (!address) return Fail(error, message);
  // A socket per notification, as sd_notify has: nothing is shared between
  // threads, and a manager that re-executes (and binds its socket anew) is
  // found again by the next one.
  base::UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd) {
    const int e = errno;
    return Fail(error, "socket: " + base::ErrnoText(e));
  }
  if (send_timeout_.count() > 0) {
    // Connected, a datagram socket waits for room in its peer's queue, and
    // SO_SNDTIMEO bounds that wait.
    timeval timeout{};
    timeout.tv_sec = static_cast<time_t>(send_timeout_.count() / 1000);
    timeout.tv_usec =
        static_cast<suseconds_t>(send_timeout_.count() % 1000) * 1000;
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout,
                     sizeof(timeout)) != 0) {
      const int e = errno;
      return Fail(error, "SO_SNDTIMEO: " + base::ErrnoText(e));
    }
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address->addr),
                address->length) != 0) {
    const int e = errno;
    return Fail(error, "connect to NOTIFY_SOCKET " + address_ + ": " +
                           base::ErrnoText(e));
  }
  if (SendDatagram(fd.get(), state, fds,
                   send_timeout_.count() > 0 ? 0 : MSG_DONTWAIT) != 0) {
    const int saved = errno;
    return Fail(error, "send to NOTIFY_SOCKET " + address_ + ": " +
                           (saved == EAGAIN || saved == EWOULDBLOCK
                                ? std::string("the service manager's socket "
                                              "is full")
                                : base::ErrnoText(saved)));
  }
  return true;
}

bool SystemdNotifier::Ready(std::string_view status, std::string* error) const {
  std::string state = "READY=1";
  if (!status.empty()) state += "\nSTATUS=" + OneLine(status);
  return Notify(state, {}, error);
}

bool SystemdNotifier::Stopping(std::string* error) const {
  return Notify("STOPPING=1", {}, error);
}

bool SystemdNotifier::Reloading(std::string* error) const {
  // systemd (Type=notify-reload, 253 on) wants the time the reload began,
  // to tell this reload's READY=1 from an earlier one's.
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  const long long usec =
      static_cast<long long>(now.tv_sec) * 1000000 + now.tv_nsec / 1000;
  return Notify("RELOADING=1\nMONOTONIC_USEC=" + std::to_string(usec), {},
                error);
}

bool SystemdNotifier::Status(std::string_view text, std::string* error) const {
  return Notify("STATUS=" + OneLine(text), {}, error);
}

bool SystemdNotifier::StoreFds(std::string_view name, std::span<const int> fds,
                               std::string* error) const {
  if (!CheckFdName(name, error)) return false;
  if (fds.empty()) {
    return Fail(error, "FDSTORE for \"" + std::string(name) +
                           "\" without a descriptor");
  }
  return Notify("FDSTORE=1\nFDNAME=" + std::string(name), fds, error);
}

bool SystemdNotifier::RemoveFds(std::string_view name,
                                std::string* error) const {
  if (!CheckFdName(name, error)) return false;
  return Notify("FDSTOREREMOVE=1\nFDNAME=" + std::string(name), {}, error);
}

ListenFds TakeListenFds() {
  ListenFds out;
  // Taken (and unset) first, so that every return below leaves none set.
  const std::optional<std::string> pid = TakeVariable("LISTEN_PID");
  const std::optional<std::string> count = TakeVariable("LISTEN_FDS");
  const std::optional<std::string> names = TakeVariable("LISTEN_FDNAMES");
  if (!pid) return out;
  const std::optional<long long> pid_value = ParseCount(*pid, INT_MAX);
  if (!pid_value || *pid_value == 0) {
    out.error = "LISTEN_PID=\"" + *pid + "\" is not a process id";
    return out;
  }
  // Meant for another process (ours inherited the environment): not ours.
  if (*pid_value != ::getpid()) return out;
  if (!count) return out;
  const std::optional<long long> n =
      ParseCount(*count, INT_MAX - kListenFdsStart);
  if (!n) {
    out.error = "LISTEN_FDS=\"" + *count + "\" is not a descriptor count";
    return out;
  }
  if (*n == 0) return out;

  std::vector<std::string> split;
  if (names) {
    size_t start = 0;
    for (;;) {
      const size_t colon = names->find(':', start);
      split.push_back(names->substr(start, colon - start));
      if (colon == std::string::npos) break;
      start = colon + 1;
    }
  }

  // Every descriptor announced must be open before any is taken: one that
  // is not means the variables are not what they claim, and the others may
  // then be anybody's.
  for (int i = 0; i < *n; ++i) {
    const int fd = kListenFdsStart + i;
    if (::fcntl(fd, F_GETFD) < 0) {
      const int e = errno;
      out.error = "LISTEN_FDS=" + *count + " but descriptor " +
                  std::to_string(fd) + " is not open (" + base::ErrnoText(e) +
                  ")";
      return out;
    }
  }
  if (split.size() > static_cast<size_t>(*n)) {
    // The descriptors are ours, but which is which cannot be told.
    for (int i = 0; i < *n; ++i) ::close(kListenFdsStart + i);
    out.error = "LISTEN_FDNAMES names " + std::to_string(split.size()) +
                " descriptors but LISTEN_FDS=" + *count +
                " (the descriptors were closed)";
    return out;
  }
  out.fds.reserve(static_cast<size_t>(*n));
  for (int i = 0; i < *n; ++i) {
    const int fd = kListenFdsStart + i;
    const int flags = ::fcntl(fd, F_GETFD);
    ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    ListenedFd taken;
    taken.fd.reset(fd);
    taken.name = static_cast<size_t>(i) < split.size() ? split[i] : "unknown";
    out.fds.push_back(std::move(taken));
  }
  return out;
}

}  // namespace modelcache::serve::detail
