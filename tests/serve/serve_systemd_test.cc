// The daemon's side of systemd's notification and descriptor-passing
// protocols (src/serve/systemd.h), against a fake service manager: a
// datagram socket of the test's own, named by NOTIFY_SOCKET, and child
// processes given descriptors 3 and 4 with LISTEN_* as systemd gives them.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/base/text.h"
#include "modelcache/weights/memfd.h"
#include "socket.h"
#include "systemd.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

bool SameFile(int a, int b) {
  struct stat sa {
  }, sb{};
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

base::UniqueFd Memfd(const std::string& name, const std::string& text) {
  return weights::CreateSealedMemfd(
      name, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

// ---- notifications ----

// The service manager's end: a datagram socket bound to a path (or an
// abstract name), which NOTIFY_SOCKET names while a test runs.
class NotifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int serial = 0;
    path_ = (fs::temp_directory_path() /
             ("mc_notify_" + std::to_string(::getpid()) + "_" +
              std::to_string(serial++)))
                .string();
    ::unlink(path_.c_str());
    manager_ = Bind(path_, false);
    ::setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("NOTIFY_SOCKET");
    ::unlink(path_.c_str());
  }

  static base::UniqueFd Bind(const std::string& name, bool abstract) {
    base::UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    EXPECT_TRUE(fd) << base::ErrnoText(errno);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const size_t offset = abstract ? 1 : 0;
    std::memcpy(addr.sun_path + offset, name.data(), name.size());
    const socklen_t length =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + offset +
                               name.size() + (abstract ? 0 : 1));
    EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), length), 0)
        << base::ErrnoText(errno);
    return fd;
  }

  // The next datagram the manager holds; a notification is queued by the
  // time Notify returns, so none waiting means none was sent.
  static detail::Datagram Next(int fd) {
    detail::Datagram d;
    const int got = detail::ReceiveDatagram(fd, 8192, 300, MSG_DONTWAIT, &d);
    if (got < 0) {
      const int error = errno;
      d.bytes = "(none: " + base::ErrnoText(error) + ")";
    }
    return d;
  }
  detail::Datagram Next() { return Next(manager_.get()); }

  std::string path_;
  base::UniqueFd manager_;
};

TEST_F(NotifyTest, StatesReachTheManager) {
  const detail::SystemdNotifier notifier;
  ASSERT_TRUE(notifier.enabled());
  EXPECT_EQ(notifier.address(), path_);
  EXPECT_EQ(notifier.error(), "");

  std::string error;
  EXPECT_TRUE(notifier.Ready("3 models loaded", &error)) << error;
  EXPECT_EQ(Next().bytes, "READY=1\nSTATUS=3 models loaded");
  EXPECT_TRUE(notifier.Ready());
  EXPECT_EQ(Next().bytes, "READY=1");
  // A newline in a status cannot add an assignment of its own.
  EXPECT_TRUE(notifier.Status("serving\nREADY=1"));
  EXPECT_EQ(Next().bytes, "STATUS=serving READY=1");
  EXPECT_TRUE(notifier.Stopping());
  EXPECT_EQ(Next().bytes, "STOPPING=1");
  EXPECT_TRUE(notifier.Reloading());
  const std::string reloading = Next().bytes;
  EXPECT_THAT(reloading, StartsWith("RELOADING=1\nMONOTONIC_USEC="));
  EXPECT_GT(reloading.size(), std::strlen("RELOADING=1\nMONOTONIC_USEC="));
  EXPECT_TRUE(notifier.Notify("WATCHDOG=1"));
  EXPECT_EQ(Next().bytes, "WATCHDOG=1");
  EXPECT_THAT(Next().bytes, StartsWith("(none"));
}

TEST_F(NotifyTest, StoreFdsPassesTheSameFilesAndRemoveFdsNamesThem) {
  const detail::SystemdNotifier notifier;
  const base::UniqueFd a = Memfd("systemd-test-a", "weights of a");
  const base::UniqueFd b = Memfd("systemd-test-b", "table of a");
  const int fds[] = {a.get(), b.get()};
  std::string error;
  ASSERT_TRUE(notifier.StoreFds("copy-1.model_a", fds, &error)) << error;
  const detail::Datagram stored = Next();
  EXPECT_EQ(stored.bytes, "FDSTORE=1\nFDNAME=copy-1.model_a");
  ASSERT_EQ(stored.fds.size(), 2u);
  EXPECT_FALSE(stored.fds_truncated);
  EXPECT_TRUE(SameFile(stored.fds[0].get(), a.get()));
  EXPECT_TRUE(SameFile(stored.fds[1].get(), b.get()));
  EXPECT_FALSE(SameFile(stored.fds[0].get(), b.get()));
  // The caller keeps its own descriptors.
  EXPECT_GE(::fcntl(a.get(), F_GETFD), 0);
  EXPECT_GE(::fcntl(b.get(), F_GETFD), 0);

  ASSERT_TRUE(notifier.RemoveFds("copy-1.model_a", &error)) << error;
  const detail::Datagram removed = Next();
  EXPECT_EQ(removed.bytes, "FDSTOREREMOVE=1\nFDNAME=copy-1.model_a");
  EXPECT_TRUE(removed.fds.empty());
}

TEST_F(NotifyTest, InvalidFdNamesAreRefusedAndNothingIsSent) {
  EXPECT_TRUE(detail::IsValidFdName("stored"));
  EXPECT_TRUE(detail::IsValidFdName("copy 7=x.y-z_~!"));
  EXPECT_TRUE(detail::IsValidFdName(std::string(255, 'a')));

  const detail::SystemdNotifier notifier;
  const base::UniqueFd a = Memfd("systemd-test-a", "weights");
  const int fds[] = {a.get()};
  for (const std::string& name :
       {std::string(), std::string("a:b"), std::string("a\nFDSTORE=1"),
        std::string(256, 'a'), std::string("caf\xc3\xa9"),
        std::string("del\x7f"), std::string("tab\t")}) {
    SCOPED_TRACE(name);
    EXPECT_FALSE(detail::IsValidFdName(name));
    std::string error;
    EXPECT_FALSE(notifier.StoreFds(name, fds, &error));
    EXPECT_THAT(error, HasSubstr("invalid FDNAME"));
    error.clear();
    EXPECT_FALSE(notifier.RemoveFds(name, &error));
    EXPECT_THAT(error, HasSubstr("invalid FDNAME"));
  }
  EXPECT_THAT(Next().bytes, StartsWith("(none"));
}

TEST_F(NotifyTest, WhatSystemdWouldDropIsRefused) {
  const detail::SystemdNotifier notifier;
  const base::UniqueFd a = Memfd("systemd-test-a", "weights");
  std::string error;
  EXPECT_FALSE(notifier.StoreFds("empty", {}, &error));
  EXPECT_THAT(error, HasSubstr("without a descriptor"));
  const std::vector<int> too_many(detail::kMaxNotifyFds + 1, a.get());
  EXPECT_FALSE(notifier.StoreFds("many", too_many, &error));
  EXPECT_THAT(error, HasSubstr("254 descriptors"));
  EXPECT_FALSE(
      notifier.Status(std::string(detail::kMaxNotifyBytes, 'x'), &error));
  EXPECT_THAT(error, HasSubstr("at most 4096"));
  EXPECT_FALSE(notifier.Notify(std::string_view("A=1\0B=2", 7), {}, &error));
  EXPECT_THAT(error, HasSubstr("NUL"));
  EXPECT_FALSE(notifier.Notify("", {}, &error));
  EXPECT_THAT(Next().bytes, StartsWith("(none"));
  // The most one datagram carries still goes.
  const std::vector<int> most(detail::kMaxNotifyFds, a.get());
  ASSERT_TRUE(notifier.StoreFds("most", most, &error)) << error;
  EXPECT_EQ(Next().fds.size(), detail::kMaxNotifyFds);
}

TEST_F(NotifyTest, AbstractAddress) {
  const std::string name = "mc_notify_abstract_" + std::to_string(::getpid());
  const base::UniqueFd manager = Bind(name, true);
  const detail::SystemdNotifier notifier("@" + name);
  ASSERT_TRUE(notifier.enabled()) << notifier.error();
  std::string error;
  EXPECT_TRUE(notifier.Ready("abstract", &error)) << error;
  EXPECT_EQ(Next(manager.get()).bytes, "READY=1\nSTATUS=abstract");
  // Not the path of the same name.
  EXPECT_THAT(Next().bytes, StartsWith("(none"));
}

TEST_F(NotifyTest, NoManagerDisablesTheNotifier) {
  ::unsetenv("NOTIFY_SOCKET");
  const detail::SystemdNotifier none;
  EXPECT_FALSE(none.enabled());
  EXPECT_EQ(none.error(), "");
  std::string error;
  EXPECT_FALSE(none.Notify("READY=1", {}, &error));
  EXPECT_THAT(error, HasSubstr("NOTIFY_SOCKET is not set"));
  EXPECT_FALSE(none.Ready());
  const base::UniqueFd a = Memfd("systemd-test-a", "weights");
  const int fds[] = {a.get()};
  EXPECT_FALSE(none.StoreFds("stored", fds));

  ::setenv("NOTIFY_SOCKET", "", 1);
  EXPECT_FALSE(detail::SystemdNotifier().enabled());
  for (const std::string& address :
       {std::string("relative/path"), std::string("vsock:2:1234"),
        "/" + std::string(200, 'p'), "@" + std::string(200, 'p')}) {
    const detail::SystemdNotifier refused(address);
    EXPECT_FALSE(refused.enabled()) << address;
    EXPECT_NE(refused.error(), "") << address;
    EXPECT_FALSE(refused.Notify("READY=1", {}, &error));
    EXPECT_EQ(error, refused.error());
  }
  EXPECT_THAT(Next().bytes, StartsWith("(none"));
}

TEST_F(NotifyTest, AGoneManagerIsAFailureNotAWait) {
  const detail::SystemdNotifier notifier;
  manager_.reset();
  ::unlink(path_.c_str());
  std::string error;
  EXPECT_FALSE(notifier.Ready("", &error));
  EXPECT_THAT(error, HasSubstr("connect to NOTIFY_SOCKET " + path_));
}

TEST_F(NotifyTest, AFullManagerSocketDoesNotBlock) {
  // With no send timeout, a manager that reads nothing fills up and Notify
  // fails at once rather than wait.
  const detail::SystemdNotifier notifier(path_, std::chrono::milliseconds(0));
  std::string error;
  int sent = 0;
  while (sent < 100000 && notifier.Status("filling", &error)) ++sent;
  EXPECT_GT(sent, 0);
  EXPECT_LT(sent, 100000);
  EXPECT_THAT(error, HasSubstr("the service manager's socket is full"));
  // Room again once the manager reads.
  EXPECT_EQ(Next().bytes, "STATUS=filling");
  EXPECT_TRUE(notifier.Status("room", &error)) << error;
}

// ---- descriptors passed at start ----

// Unsets LISTEN_* around an in-process test: the runner's own descriptors
// 3 and 4 must never be taken, so only the paths that take none run here.
class ListenEnvTest : public ::testing::Test {
 protected:
  void SetUp() override { Clear(); }
  void TearDown() override { Clear(); }
  static void Clear() {
    ::unsetenv("LISTEN_PID");
    ::unsetenv("LISTEN_FDS");
    ::unsetenv("LISTEN_FDNAMES");
  }
  static bool AllUnset() {
    return std::getenv("LISTEN_PID") == nullptr &&
           std::getenv("LISTEN_FDS") == nullptr &&
           std::getenv("LISTEN_FDNAMES") == nullptr;
  }
  static std::string Pid() { return std::to_string(::getpid()); }
};

TEST_F(ListenEnvTest, NotActivatedGivesNoneAndNoError) {
  detail::ListenFds none = detail::TakeListenFds();
  EXPECT_TRUE(none.fds.empty());
  EXPECT_EQ(none.error, "");

  // LISTEN_FDS without LISTEN_PID is not for us either.
  ::setenv("LISTEN_FDS", "2", 1);
  ::setenv("LISTEN_FDNAMES", "a:b", 1);
  none = detail::TakeListenFds();
  EXPECT_TRUE(none.fds.empty());
  EXPECT_EQ(none.error, "");
  EXPECT_TRUE(AllUnset());

  ::setenv("LISTEN_PID", Pid().c_str(), 1);
  none = detail::TakeListenFds();
  EXPECT_TRUE(none.fds.empty());
  EXPECT_EQ(none.error, "");

  ::setenv("LISTEN_PID", Pid().c_str(), 1);
  ::setenv("LISTEN_FDS", "0", 1);
  none = detail::TakeListenFds();
  EXPECT_TRUE(none.fds.empty());
  EXPECT_EQ(none.error, "");
  EXPECT_TRUE(AllUnset());
}

TEST_F(ListenEnvTest, AnotherProcesssDescriptorsAreNotTaken) {
  // What a child of an activated process inherits when the parent left the
  // variables set: they name the parent.
  ::setenv("LISTEN_PID", std::to_string(::getpid() + 1).c_str(), 1);
  ::setenv("LISTEN_FDS", "2", 1);
  ::setenv("LISTEN_FDNAMES", "a:b", 1);
  const detail::ListenFds none = detail::TakeListenFds();
  EXPECT_TRUE(none.fds.empty());
  EXPECT_EQ(none.error, "");
  EXPECT_TRUE(AllUnset());
}

TEST_F(ListenEnvTest, MalformedValuesGiveNoneAndAReason) {
  for (const char* pid :
       {"", "abc", "12x", "-5", "+5", " 5", "0", "99999999999999999999"}) {
    SCOPED_TRACE(pid);
    ::setenv("LISTEN_PID", pid, 1);
    ::setenv("LISTEN_FDS", "2", 1);
    const detail::ListenFds none = detail::TakeListenFds();
    EXPECT_TRUE(none.fds.empty());
    EXPECT_THAT(none.error, HasSubstr("LISTEN_PID"));
    EXPECT_TRUE(AllUnset());
  }
  for (const char* count :
       {"", "x", "-1", "2 ", "0x2", "2147483646", "99999999999999999999"}) {
    SCOPED_TRACE(count);
    ::setenv("LISTEN_PID", Pid().c_str(), 1);
    ::setenv("LISTEN_FDS", count, 1);
    ::setenv("LISTEN_FDNAMES", "a:b", 1);
    const detail::ListenFds none = detail::TakeListenFds();
    EXPECT_TRUE(none.fds.empty());
    EXPECT_THAT(none.error, HasSubstr("LISTEN_FDS"));
    EXPECT_TRUE(AllUnset());
  }
}

// What a child reports back: "ok", or what went wrong. Its arguments are
// descriptors of the files that 3 and 4 were made of, above both.
using ChildCheck = std::function<std::string(int a, int b)>;

// Runs `check` in a child process whose descriptors 3 and 4 are
// duplicates of `a` and `b` (inheritable, as after exec), whose 5 is
// closed, and whose environment has `env` ("$PID" stands for the child's
// pid); returns what `check` returned ("ok" for ""), or how the child
// ended. The child is killed and reaped whatever happens here. (`a` and `b`
// may themselves be 3, 4 or 5, which the child reuses: `check` is given
// other descriptors of the same files.)
std::string InChild(int a, int b,
                    const std::vector<std::pair<std::string, std::string>>& env,
                    const ChildCheck& check) {
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) return "pipe2 failed";
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    // Out of the way first: the pipe and the sources may be 3, 4 or 5.
    const int out = ::fcntl(report[1], F_DUPFD_CLOEXEC, 50);
    const int high_a = ::fcntl(a, F_DUPFD_CLOEXEC, 60);
    const int high_b = ::fcntl(b, F_DUPFD_CLOEXEC, 60);
    if (out < 0 || high_a < 0 || high_b < 0 ||
        ::dup2(high_a, detail::kListenFdsStart) < 0 ||
        ::dup2(high_b, detail::kListenFdsStart + 1) < 0) {
      ::_exit(2);
    }
    ::close(detail::kListenFdsStart + 2);
    ::unsetenv("LISTEN_PID");
    ::unsetenv("LISTEN_FDS");
    ::unsetenv("LISTEN_FDNAMES");
    for (const auto& [name, value] : env) {
      ::setenv(
          name.c_str(),
          value == "$PID" ? std::to_string(::getpid()).c_str() : value.c_str(),
          1);
    }
    std::string result = check(high_a, high_b);
    if (result.empty()) result = "ok";
    const ssize_t n = ::write(out, result.data(), result.size());
    ::_exit(n == static_cast<ssize_t>(result.size()) ? 0 : 3);
  }
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } reaper{pid};
  ::close(report[1]);
  std::string result;
  char buffer[512];
  for (;;) {
    const ssize_t n = ::read(report[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    result.append(buffer, static_cast<size_t>(n));
  }
  ::close(report[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  reaper.pid = -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    result += " (child ended with status " + std::to_string(status) + ")";
  }
  return result;
}

// In a child: `taken` holds descriptors 3 and 4, close-on-exec, the files
// of `a` and `b`, under `names`; the variables are gone.
std::string CheckTaken(const detail::ListenFds& taken, int a, int b,
                       const std::vector<std::string>& names) {
  if (!taken.error.empty()) return "error: " + taken.error;
  if (taken.fds.size() != 2) {
    return "took " + std::to_string(taken.fds.size()) + " descriptors";
  }
  const int sources[] = {a, b};
  for (size_t i = 0; i < 2; ++i) {
    const detail::ListenedFd& fd = taken.fds[i];
    if (fd.fd.get() != detail::kListenFdsStart + static_cast<int>(i)) {
      return "descriptor " + std::to_string(fd.fd.get());
    }
    if (fd.name != names[i]) return "name \"" + fd.name + "\"";
    if ((::fcntl(fd.fd.get(), F_GETFD) & FD_CLOEXEC) == 0) {
      return "descriptor " + std::to_string(fd.fd.get()) + " not close-on-exec";
    }
    if (!SameFile(fd.fd.get(), sources[i])) {
      return "descriptor " + std::to_string(fd.fd.get()) + " another file";
    }
  }
  if (std::getenv("LISTEN_PID") != nullptr ||
      std::getenv("LISTEN_FDS") != nullptr ||
      std::getenv("LISTEN_FDNAMES") != nullptr) {
    return "variables left set";
  }
  return "";
}

class ListenFdsTest : public ::testing::Test {
 protected:
  base::UniqueFd a_ = Memfd("systemd-test-a", "weights of a");
  base::UniqueFd b_ = Memfd("systemd-test-b", "table of a");
};

TEST_F(ListenFdsTest, TakesNamedDescriptors) {
  EXPECT_EQ(
      InChild(a_.get(), b_.get(),
              {{"LISTEN_PID", "$PID"},
               {"LISTEN_FDS", "2"},
               {"LISTEN_FDNAMES", "a:b"}},
              [](int a, int b) {
                return CheckTaken(detail::TakeListenFds(), a, b, {"a", "b"});
              }),
      "ok");
}

TEST_F(ListenFdsTest, MissingOrTooFewNamesAreUnknown) {
  EXPECT_EQ(
      InChild(a_.get(), b_.get(), {{"LISTEN_PID", "$PID"}, {"LISTEN_FDS", "2"}},
              [](int a, int b) {
                return CheckTaken(detail::TakeListenFds(), a, b,
                                  {"unknown", "unknown"});
              }),
      "ok");
  EXPECT_EQ(
      InChild(
          a_.get(), b_.get(),
          {{"LISTEN_PID", "$PID"},
           {"LISTEN_FDS", "2"},
           {"LISTEN_FDNAMES", "a"}},
          [](int a, int b) {
            return CheckTaken(detail::TakeListenFds(), a, b, {"a", "unknown"});
          }),
      "ok");
  // An empty field is an empty name, as systemd writes one.
  EXPECT_EQ(
      InChild(a_.get(), b_.get(),
              {{"LISTEN_PID", "$PID"},
               {"LISTEN_FDS", "2"},
               {"LISTEN_FDNAMES", ":b"}},
              [](int a, int b) {
                return CheckTaken(detail::TakeListenFds(), a, b, {"", "b"});
              }),
      "ok");
}

TEST_F(ListenFdsTest, MoreNamesThanDescriptorsTakesNoneAndClosesThem) {
  EXPECT_EQ(
      InChild(a_.get(), b_.get(),
              {{"LISTEN_PID", "$PID"},
               {"LISTEN_FDS", "2"},
               {"LISTEN_FDNAMES", "a:b:c"}},
              [](int, int) {
                const detail::ListenFds none = detail::TakeListenFds();
                if (!none.fds.empty()) return std::string("took some");
                if (none.error.find("LISTEN_FDNAMES names 3") ==
                    std::string::npos) {
                  return "error: " + none.error;
                }
                if (::fcntl(3, F_GETFD) >= 0 || ::fcntl(4, F_GETFD) >= 0) {
                  return std::string("left open");
                }
                return std::string();
              }),
      "ok");
}

TEST_F(ListenFdsTest, ADescriptorNotOpenTakesNoneAndTouchesNone) {
  EXPECT_EQ(
      InChild(a_.get(), b_.get(), {{"LISTEN_PID", "$PID"}, {"LISTEN_FDS", "3"}},
              [](int, int) {
                const detail::ListenFds none = detail::TakeListenFds();
                if (!none.fds.empty()) return std::string("took some");
                if (none.error.find("descriptor 5 is not open") ==
                    std::string::npos) {
                  return "error: " + none.error;
                }
                // Still open, still inheritable: not ours to change.
                if (::fcntl(3, F_GETFD) != 0 || ::fcntl(4, F_GETFD) != 0) {
                  return std::string("touched 3 or 4");
                }
                if (std::getenv("LISTEN_FDS") != nullptr) {
                  return std::string("variables left set");
                }
                return std::string();
              }),
      "ok");
}

}  // namespace
}  // namespace modelcache::serve
