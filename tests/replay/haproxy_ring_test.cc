// The ring against the real HAProxy (Debian's haproxy, 2.6): every request
// for a few hundred model ids goes through `balance hash path,field(4,/)` to
// the server that modelcache/replay/ring.h predicts, and so does every row
// that `modelcache ring` prints.
//
// The set-up, all on loopback and all owned by this process:
// - The test is every backend server: one listening socket per server,
//   bound to 127.0.0.1 on a port the kernel picks. A request's server is the
//   socket it arrives on. The test answers it (200, `X-Node: <name>`,
//   Connection: close) or holds it unanswered, which keeps it in flight on
//   that server for as long as the test wants: that is how the bounded-load
//   test sets each server's in-flight count exactly. One server's socket is
//   bound but not listening, so connections to it are refused at once and
//   HAProxy redispatches (retries 1, option redispatch) to another server
//   with the refused one avoided.
// - HAProxy gets its frontends' listening sockets and its admin stats
//   socket from the test (`bind fd@N`, `stats socket fd@N`), already
//   listening, so there is no port to race for and nothing to wait for
//   before the first request. It runs in the foreground (-db) with one
//   thread, dies with the test (PR_SET_PDEATHSIG) and is stopped by pid in
//   TearDown, after a failure too.
// - Servers go down and up at run time through the stats socket (`disable
//   server`, `enable server`), as a failed health check would take them.
// - Synchronisation: a request's server is known when its connection
//   arrives (HAProxy counts it in flight before it connects). Before each
//   bounded-load step the test reads HAProxy's own count of requests in
//   flight per server (`show stat`, scur) until it equals the test's, so a
//   request just answered has been released by HAProxy too. Every wait is
//   bounded and also ends when HAProxy exits.
//
// Skips with the reason when no haproxy binary is found (scripts/
// install-deps.sh installs it); MODELCACHE_HAPROXY names another one.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "modelcache/base/text.h"
#include "modelcache/replay/cluster.h"
#include "modelcache/replay/ring.h"
#include "ring_command.h"

namespace modelcache::replay {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWait = std::chrono::seconds(20);  // any one wait, at most

// ---- small POSIX helpers ----

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

std::string Errno(const std::string& what) {
  const int error = errno;
  return what + ": " + base::ErrnoText(error);
}

// A TCP socket on 127.0.0.1, port chosen by the kernel; listening or not.
Fd LoopbackSocket(bool listening, uint16_t* port) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) throw std::runtime_error(Errno("socket"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error(Errno("bind 127.0.0.1"));
  }
  if (listening && listen(fd.get(), 64) != 0) {
    throw std::runtime_error(Errno("listen"));
  }
  socklen_t len = sizeof addr;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

Fd ConnectTcp(uint16_t port) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error(
        Errno("connect 127.0.0.1:" + std::to_string(port)));
  }
  return fd;
}

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error(Errno("send"));
    done += static_cast<size_t>(n);
  }
}

// Waits until `fd` is readable, or HAProxy (`pidfd`) exits, or kWait
// passes; throws in the latter two cases.
void WaitReadable(int fd, int pidfd, const std::string& what) {
  const auto deadline = Clock::now() + kWait;
  while (true) {
    pollfd fds[2] = {{fd, POLLIN, 0}, {pidfd, POLLIN, 0}};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - Clock::now());
    if (left.count() <= 0)
      throw std::runtime_error("timed out waiting for " + what);
    const int n = poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error(Errno("poll"));
    if (fds[1].revents)
      throw std::runtime_error("haproxy exited while waiting for " + what);
    if (fds[0].revents) return;
  }
}

// Reads one HTTP message head (through the blank line), plus a body of
// Content-Length bytes if `with_body`.
std::string ReadMessage(int fd, int pidfd, bool with_body,
                        const std::string& what) {
  std::string data;
  size_t head_end = std::string::npos;
  size_t need = 0;
  char buf[4096];
  while (true) {
    if (head_end == std::string::npos) {
      head_end = data.find("\r\n\r\n");
      if (head_end != std::string::npos) {
        head_end += 4;
        need = head_end;
        if (with_body) {
          std::string lower = data.substr(0, head_end);
          std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
          const size_t at = lower.find("\r\ncontent-length:");
          if (at != std::string::npos)
            need += std::stoul(lower.substr(at + 17));
        }
      }
    }
    if (head_end != std::string::npos && data.size() >= need) return data;
    WaitReadable(fd, pidfd, what);
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error(Errno("recv (" + what + ")"));
    if (n == 0)
      throw std::runtime_error("connection closed during " + what +
                               " after: " + data);
    data.append(buf, static_cast<size_t>(n));
  }
}

// ---- HAProxy ----

std::string FindHaproxy() {
  if (const char* env = getenv("MODELCACHE_HAPROXY"); env && *env) return env;
  std::vector<std::string> dirs;
  if (const char* path = getenv("PATH")) {
    std::stringstream in(path);
    for (std::string dir; std::getline(in, dir, ':');) dirs.push_back(dir);
  }
  for (const char* dir : {"/usr/sbin", "/usr/local/sbin", "/sbin"})
    dirs.push_back(dir);
  for (const std::string& dir : dirs) {
    const std::string candidate = dir + "/haproxy";
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// A process started with fork and exec, stopped and reaped by pid.
class Child {
 public:
  // Runs `argv` with stdout and stderr to `log`, and each of `inherit` as
  // descriptor 100 + its index. It gets SIGKILL if this thread dies.
  void Start(const std::vector<std::string>& argv, const std::string& log,
             const std::vector<int>& inherit) {
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    Fd log_fd(
        open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (log_fd.get() < 0) throw std::runtime_error(Errno("open " + log));
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(Errno("fork"));
    if (pid == 0) {
      // Only async-signal-safe calls until exec.
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(126);
      // Copy first above every target, then into place: a source may sit
      // where another's target is.
      for (size_t i = 0; i < inherit.size(); ++i) {
        if (dup2(inherit[i], 200 + static_cast<int>(i)) < 0) _exit(126);
      }
      for (size_t i = 0; i < inherit.size(); ++i) {
        if (dup2(200 + static_cast<int>(i), 100 + static_cast<int>(i)) < 0)
          _exit(126);
        close(200 + static_cast<int>(i));
      }
      if (dup2(log_fd.get(), 1) < 0 || dup2(log_fd.get(), 2) < 0) _exit(126);
      execv(args[0], args.data());
      _exit(127);
    }
    pid_ = pid;
    pidfd_ = Fd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
    if (pidfd_.get() < 0) {
      Stop();
      throw std::runtime_error(Errno("pidfd_open"));
    }
  }

  // Waits for it to exit by itself; returns its exit status (-1: killed).
  int Wait() {
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    pidfd_.Reset();
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // SIGTERM, then SIGKILL if it has not exited within kWait; reaps it.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    if (pidfd_.get() >= 0) {
      pollfd p{pidfd_.get(), POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(kWait / std::chrono::milliseconds(1))) <=
          0) {
        kill(pid_, SIGKILL);
      }
    } else {
      kill(pid_, SIGKILL);
    }
    Wait();
  }

  ~Child() { Stop(); }
  int pidfd() const { return pidfd_.get(); }

 private:
  pid_t pid_ = -1;
  Fd pidfd_;
};

std::string ReadFile(const std::string& path) {
  std::stringstream out;
  out << std::ifstream(path).rdbuf();
  return out.str();
}

// ---- the cluster under test ----

// Backends, each behind its own frontend (fd@100 + its index).
enum Backend {
  kChash = 0,
  kSdbm,
  kMap,
  kBounded,
  kRoundRobin,
  kLeastConn,
  kBackends
};
const char* const kBackendNames[] = {"be_chash", "be_sdbm", "be_map",
                                     "be_bl",    "be_rr",   "be_lc"};
constexpr int kStatsFd = 100 + kBackends;
constexpr int kBalanceFactor = 150;

// The plain backends' servers (as `modelcache ring --nodes` takes them).
constexpr char kNodes[] = "n1:1:100,n2:2:100,n3:3:50,n4:17:200,n5:1000:1";

// The bounded-load backend (and the round-robin and leastconn ones): small
// weights so that a dozen requests in flight saturate servers; b5 starts
// `disabled`; b6 refuses connections.
std::vector<RingServer> BoundedServers() {
  return {{"b1", 1, 1},    {"b2", 2, 2},       {"b3", 7, 1},
          {"b4", 1000, 3}, {"b5", 5, 1, true}, {"b6", 9, 1}};
}
constexpr size_t kRefusing = 5;  // b6

// One server socket: which backend and server it stands for.
struct ServerSocket {
  Fd fd;
  uint16_t port = 0;
  Backend backend;
  size_t server;
  std::string name;
  bool listening = true;  // false: bound only, so connections are refused
};

// The model ids: the 100 function hashes of the shared Azure trace's memory
// file and 200 names in the shapes model ids take.
std::vector<std::string> ModelIds() {
  std::vector<std::string> ids;
  std::ifstream in(std::string(MODELCACHE_SHARED_DATA) +
                   "/traces/azure-functions-2019-100fn-memory.csv");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) ids.push_back(line.substr(0, line.find(',')));
  const char* const shapes[] = {
      "llama-3-8b-instruct-v%d", "sdxl-lora-%04d",  "bert_base_%d",
      "org%%2Fmodel-%d",         "Qwen2.5-7B.ft%d", "m%d"};
  for (int i = 0; i < 200; ++i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, shapes[i % 6], i);
    ids.push_back(buf);
  }
  return ids;
}

class HaproxyRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    haproxy_ = FindHaproxy();
    if (haproxy_.empty()) {
      GTEST_SKIP() << "no haproxy binary on PATH or in /usr/sbin: install "
                      "Debian's haproxy (scripts/install-deps.sh), or set "
                      "MODELCACHE_HAPROXY";
    }
    char pattern[] = "/tmp/haproxy_ring_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    models_ = ModelIds();
    ASSERT_EQ(models_.size(), 300u) << "the shared trace's memory file";

    for (int b = 0; b < kBackends; ++b) {
      uint16_t port = 0;
      frontends_.push_back(LoopbackSocket(true, &port));
      frontend_ports_.push_back(port);
    }
    stats_ = Fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string stats_path = (dir_ / "admin.sock").string();
    ASSERT_LT(stats_path.size(), sizeof addr.sun_path);
    std::strcpy(addr.sun_path, stats_path.c_str());
    ASSERT_EQ(
        bind(stats_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(listen(stats_.get(), 16), 0);
    stats_path_ = stats_path;

    const std::vector<RingServer> plain = tools::ParseNodeList(kNodes);
    std::string config =
        "global\n"
        "  nbthread 1\n"
        "  stats socket fd@" +
        std::to_string(kStatsFd) +
        " level admin\n"
        "defaults\n"
        "  mode http\n"
        "  timeout connect 200ms\n"
        "  timeout client 60s\n"
        "  timeout server 60s\n"
        "  timeout http-keep-alive 60s\n"
        "  http-reuse never\n"
        "  retries 1\n"
        "  option redispatch\n";
    const char* const balance[] = {
        "hash path,field(4,/)\n  hash-type consistent",
        "hash path,field(4,/)\n  hash-type consistent sdbm",
        "hash path,field(4,/)\n  hash-type map-based",
        "hash path,field(4,/)\n  hash-type consistent",
        "roundrobin",
        "leastconn"};
    for (int b = 0; b < kBackends; ++b) {
      config += "frontend fe_" + std::to_string(b) + "\n  bind fd@" +
                std::to_string(100 + b) + "\n  default_backend " +
                kBackendNames[b] + "\nbackend " + kBackendNames[b] +
                "\n  balance " + balance[b] + "\n";
      const std::vector<RingServer> servers =
          b == kBounded || b == kRoundRobin || b == kLeastConn
              ? BoundedServers()
              : plain;
      if (b == kBounded) {
        config +=
            "  hash-balance-factor " + std::to_string(kBalanceFactor) + "\n";
      }
      for (size_t s = 0; s < servers.size(); ++s) {
        ServerSocket sock;
        sock.listening =
            !(servers.size() == BoundedServers().size() && s == kRefusing);
        sock.fd = LoopbackSocket(sock.listening, &sock.port);
        sock.backend = static_cast<Backend>(b);
        sock.server = s;
        sock.name = servers[s].name;
        config += "  server " + servers[s].name +
                  " 127.0.0.1:" + std::to_string(sock.port) + " id " +
                  std::to_string(servers[s].id) + " weight " +
                  std::to_string(servers[s].weight) +
                  (servers[s].down_at_start ? " disabled" : "") + "\n";
        servers_.push_back(std::move(sock));
      }
    }
    config_path_ = (dir_ / "haproxy.cfg").string();
    std::ofstream(config_path_) << config;

    std::vector<int> inherit;
    for (const Fd& fd : frontends_) inherit.push_back(fd.get());
    inherit.push_back(stats_.get());
    {
      // The configuration first, so that a mistake reads as one.
      Child check;
      check.Start({haproxy_, "-c", "-f", config_path_},
                  (dir_ / "check.log").string(), inherit);
      ASSERT_EQ(check.Wait(), 0) << ReadFile((dir_ / "check.log").string());
    }
    log_path_ = (dir_ / "haproxy.log").string();
    haproxy_process_.Start({haproxy_, "-db", "-f", config_path_}, log_path_,
                           inherit);
    // HAProxy holds its own copies now.
    frontends_.clear();
    stats_.Reset();
  }

  void TearDown() override {
    held_.clear();
    haproxy_process_.Stop();
    if (HasFailure() && !log_path_.empty()) {
      std::cerr << "haproxy log:\n"
                << ReadFile(log_path_) << "\nconfig:\n"
                << ReadFile(config_path_);
    }
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // A request for `model` through `backend`'s frontend, not yet answered.
  struct Pending {
    Fd client;
    Fd server;
    size_t server_index = 0;
    std::string server_name;
    std::string model;
  };

  Pending Send(Backend backend, const std::string& model) {
    Pending p;
    p.model = model;
    p.client = ConnectTcp(frontend_ports_[backend]);
    WriteAll(p.client.get(), "GET /v1/models/" + model +
                                 "/infer HTTP/1.1\r\nHost: cluster\r\n"
                                 "Connection: close\r\n\r\n");
    // Exactly one of this backend's sockets gets the connection.
    const auto deadline = Clock::now() + kWait;
    while (true) {
      std::vector<pollfd> fds;
      std::vector<ServerSocket*> socks;
      for (ServerSocket& s : servers_) {
        if (s.backend != backend || !s.listening) continue;
        fds.push_back({s.fd.get(), POLLIN, 0});
        socks.push_back(&s);
      }
      fds.push_back({haproxy_process_.pidfd(), POLLIN, 0});
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      if (left.count() <= 0) {
        throw std::runtime_error("no server got the request for " + model);
      }
      const int n =
          poll(fds.data(), fds.size(), static_cast<int>(left.count()));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::runtime_error(Errno("poll"));
      if (fds.back().revents) throw std::runtime_error("haproxy exited");
      for (size_t i = 0; i + 1 < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        p.server =
            Fd(accept4(socks[i]->fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (p.server.get() < 0) throw std::runtime_error(Errno("accept"));
        p.server_index = socks[i]->server;
        p.server_name = socks[i]->name;
        const std::string request =
            ReadMessage(p.server.get(), haproxy_process_.pidfd(), false,
                        "the request for " + model);
        const std::string line =
            "GET /v1/models/" + model + "/infer HTTP/1.1\r\n";
        if (request.compare(0, line.size(), line) != 0) {
          throw std::runtime_error("server " + socks[i]->name +
                                   " got an unexpected request: " + request);
        }
        return p;
      }
    }
  }

  // Answers `p` as its server and returns the server's index, checking that
  // the client got the answer.
  size_t Answer(Pending& p) {
    const std::string& name = p.server_name;
    WriteAll(p.server.get(),
             "HTTP/1.1 200 OK\r\nX-Node: " + name +
                 "\r\nContent-Length: " + std::to_string(name.size()) +
                 "\r\nConnection: close\r\n\r\n" + name);
    p.server.Reset();
    const std::string response =
        ReadMessage(p.client.get(), haproxy_process_.pidfd(), true,
                    "the response for " + p.model);
    // HAProxy writes header names in lower case.
    std::string lower = response;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    if (response.compare(0, 12, "HTTP/1.1 200") != 0 ||
        lower.find("\r\nx-node: " + name + "\r\n") == std::string::npos) {
      throw std::runtime_error("unexpected response for " + p.model + ": " +
                               response);
    }
    p.client.Reset();
    return p.server_index;
  }

  // Sends and answers one request; returns the server's index.
  size_t Place(Backend backend, const std::string& model) {
    Pending p = Send(backend, model);
    return Answer(p);
  }

  // One command on the admin socket; returns its answer.
  std::string Admin(const std::string& command) {
    Fd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, stats_path_.c_str());
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) !=
        0) {
      throw std::runtime_error(Errno("connect " + stats_path_));
    }
    WriteAll(fd.get(), command + "\n");
    std::string out;
    char buf[8192];
    while (true) {
      WaitReadable(fd.get(), haproxy_process_.pidfd(), "'" + command + "'");
      const ssize_t n = recv(fd.get(), buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::runtime_error(Errno("recv stats socket"));
      if (n == 0) return out;
      out.append(buf, static_cast<size_t>(n));
    }
  }

  void SetServerState(Backend backend, const std::string& server, bool up) {
    const std::string answer =
        Admin(std::string(up ? "enable" : "disable") + " server " +
              kBackendNames[backend] + "/" + server);
    ASSERT_EQ(answer.find_first_not_of("\n"), std::string::npos) << answer;
  }

  // HAProxy's requests in flight (scur) per server of `backend`.
  std::vector<uint32_t> InFlight(Backend backend,
                                 const std::vector<RingServer>& servers) {
    const std::string stat = Admin("show stat");
    std::vector<uint32_t> counts(servers.size(), 0);
    std::stringstream in(stat);
    for (std::string line; std::getline(in, line);) {
      std::vector<std::string> f;
      std::stringstream fs(line);
      for (std::string x; std::getline(fs, x, ',');) f.push_back(x);
      if (f.size() < 5 || f[0] != kBackendNames[backend]) continue;
      for (size_t s = 0; s < servers.size(); ++s) {
        if (f[1] == servers[s].name)
          counts[s] = static_cast<uint32_t>(std::stoul(f[4]));
      }
    }
    return counts;
  }

  // Reads HAProxy's counts until they equal `expected` (each read is one
  // round trip through HAProxy's event loop, after whatever it had pending).
  void AwaitInFlight(Backend backend, const std::vector<RingServer>& servers,
                     const std::vector<uint32_t>& expected) {
    const auto deadline = Clock::now() + kWait;
    std::vector<uint32_t> seen;
    while (Clock::now() < deadline) {
      seen = InFlight(backend, servers);
      if (seen == expected) return;
    }
    std::string text;
    for (size_t s = 0; s < seen.size(); ++s) {
      text += servers[s].name + "=" + std::to_string(seen[s]) + "/" +
              std::to_string(expected[s]) + " ";
    }
    throw std::runtime_error("haproxy's in-flight counts (seen/expected) " +
                             text);
  }

  std::string haproxy_;
  std::filesystem::path dir_;
  std::vector<std::string> models_;
  std::vector<Fd> frontends_;
  std::vector<uint16_t> frontend_ports_;
  Fd stats_;
  std::string stats_path_;
  std::vector<ServerSocket> servers_;
  std::string config_path_, log_path_;
  Child haproxy_process_;
  std::vector<Pending> held_;
};

TEST_F(HaproxyRingTest, ConsistentHashPlacesEveryModelWhereTheRingSays) {
  ConsistentHashRing ring(tools::ParseNodeList(kNodes));
  const auto place_all = [&] {
    std::vector<size_t> out;
    for (const std::string& m : models_) out.push_back(Place(kChash, m));
    return out;
  };
  const auto expect_ring = [&](const std::vector<size_t>& placed,
                               const char* when) {
    size_t mismatches = 0;
    for (size_t i = 0; i < models_.size(); ++i) {
      const size_t want = ring.Owner(HaproxySampleKey(models_[i], true));
      if (placed[i] != want && ++mismatches <= 5) {
        ADD_FAILURE() << when << ": " << models_[i] << " went to "
                      << ring.server(placed[i]).name << ", the ring says "
                      << ring.server(want).name;
      }
    }
    EXPECT_EQ(mismatches, 0u) << when;
  };

  const std::vector<size_t> before = place_all();
  expect_ring(before, "all up");
  std::set<size_t> used(before.begin(), before.end());
  EXPECT_EQ(used.size(), 5u) << "every server owns some of the models";

  // `modelcache ring` prints the same owners.
  const std::string model_file = (dir_ / "models.txt").string();
  {
    std::ofstream out(model_file);
    for (const std::string& m : models_) out << m << "\n";
  }
  std::ostringstream owners, err;
  ASSERT_EQ(
      tools::RunRing({.nodes = kNodes, .models = model_file}, owners, err), 0)
      << err.str();
  std::string expected_owners = "model,node\n";
  for (size_t i = 0; i < models_.size(); ++i) {
    expected_owners += models_[i] + "," + ring.server(before[i]).name + "\n";
  }
  EXPECT_EQ(owners.str(), expected_owners);

  // n2 goes down at run time: only its models move, where the ring says and
  // where `modelcache ring --kill n2` says.
  SetServerState(kChash, "n2", false);
  ring.SetDown(1);
  const std::vector<size_t> after = place_all();
  expect_ring(after, "n2 down");
  std::ostringstream moved;
  ASSERT_EQ(
      tools::RunRing({.nodes = kNodes, .models = model_file, .kill = {"n2"}},
                     moved, err),
      0);
  std::string expected_moved = "model,from,to\n";
  size_t moved_count = 0;
  for (size_t i = 0; i < models_.size(); ++i) {
    if (before[i] == after[i]) continue;
    EXPECT_EQ(before[i], 1u) << models_[i] << " moved but was not on n2";
    expected_moved += models_[i] + "," + ring.server(before[i]).name + "," +
                      ring.server(after[i]).name + "\n";
    ++moved_count;
  }
  EXPECT_GT(moved_count, 0u);
  EXPECT_EQ(moved.str(), expected_moved);

  // Back up: every model returns.
  SetServerState(kChash, "n2", true);
  ring.SetUp(1);
  EXPECT_EQ(place_all(), before);
}

TEST_F(HaproxyRingTest, WithoutAvalancheAndMapBasedTooAfterAServerGoesDown) {
  const ConsistentHashRing ring(tools::ParseNodeList(kNodes));
  MapBasedHash map(tools::ParseNodeList(kNodes));
  size_t mismatches = 0;
  for (const std::string& m : models_) {
    const size_t placed = Place(kSdbm, m);
    const size_t want = ring.Owner(HaproxySampleKey(m, false));
    if (placed != want && ++mismatches <= 5) {
      ADD_FAILURE() << "consistent sdbm: " << m << " went to "
                    << ring.server(placed).name << ", the ring says "
                    << ring.server(want).name;
    }
  }
  for (bool n3_down : {false, true}) {
    if (n3_down) {
      SetServerState(kMap, "n3", false);
      map.SetDown(2);
    }
    for (const std::string& m : models_) {
      const size_t placed = Place(kMap, m);
      const size_t want = map.Select(HaproxySampleKey(m, false));
      if (placed != want && ++mismatches <= 5) {
        ADD_FAILURE() << "map-based" << (n3_down ? ", n3 down: " : ": ") << m
                      << " went to " << map.server(placed).name
                      << ", the map says " << map.server(want).name;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

// A scripted run of holds (a request kept in flight), probes (answered at
// once) and releases, with a server going down while it has requests in
// flight, a server that was down at start-up coming up (its cumulative
// weight stays 0), and a server that refuses connections (a redispatch that
// avoids it). Every placement is checked against the ring given the
// in-flight counts, which the test sets and HAProxy confirms.
TEST_F(HaproxyRingTest, BoundedLoadPlacesEveryRequestWhereTheRingSays) {
  const std::vector<RingServer> servers = BoundedServers();
  ConsistentHashRing ring(servers, kBalanceFactor);
  std::vector<uint32_t> in_flight(servers.size(), 0);
  std::mt19937 rng(2024);  // rng() itself: the same draws everywhere
  size_t checks = 0, spills = 0, redispatches = 0, mismatches = 0;

  const auto expected = [&](const std::string& model) {
    const uint32_t key = HaproxySampleKey(model, true);
    size_t want = ring.Select(key, in_flight);
    if (want == kRefusing) {
      ++redispatches;
      want = ring.Select(key, in_flight, kRefusing);
    }
    if (want != ring.Owner(key)) ++spills;
    return want;
  };
  const auto check = [&](const std::string& model, size_t want, size_t placed,
                         const char* what) {
    ++checks;
    if (placed != want && ++mismatches <= 5) {
      std::string loads;
      for (uint32_t n : in_flight) loads += std::to_string(n) + " ";
      ADD_FAILURE() << what << " " << model << " went to "
                    << servers[placed].name << ", the ring says "
                    << servers[want].name << " (in flight: " << loads << ")";
    }
  };
  const auto steps = [&](int count) {
    for (int i = 0; i < count; ++i) {
      AwaitInFlight(kBounded, servers, in_flight);
      const uint32_t r = rng() % 10;
      const std::string& model = models_[rng() % models_.size()];
      if (r < 4 && held_.size() < 14) {
        const size_t want = expected(model);
        Pending p = Send(kBounded, model);
        check(model, want, p.server_index, "held");
        ++in_flight[p.server_index];
        held_.push_back(std::move(p));
      } else if (r < 8 || held_.empty()) {
        const size_t want = expected(model);
        check(model, want, Place(kBounded, model), "probe");
      } else {
        const size_t k = rng() % held_.size();
        --in_flight[Answer(held_[k])];
        held_.erase(held_.begin() + static_cast<ptrdiff_t>(k));
      }
    }
  };

  steps(150);
  // b2 goes down with requests in flight: they still count in P until they
  // end, and the shares keep b2's place in the cumulative weights.
  ASSERT_GT(in_flight[1], 0u) << "the script should have b2 busy here";
  SetServerState(kBounded, "b2", false);
  ring.SetDown(1);
  steps(100);
  // b5, down since start-up, comes up.
  SetServerState(kBounded, "b5", true);
  ring.SetUp(4);
  steps(100);
  while (!held_.empty()) {
    --in_flight[Answer(held_.back())];
    held_.pop_back();
  }
  AwaitInFlight(kBounded, servers, in_flight);

  EXPECT_EQ(mismatches, 0u) << "of " << checks << " placements";
  // The script must exercise the rule: placements away from the owner
  // because of load, and redispatches away from the refusing server.
  EXPECT_GE(spills, 20u);
  EXPECT_GE(redispatches, 3u);
  std::cout << checks << " placements checked, " << spills
            << " spilled by load, " << redispatches << " redispatched\n";
}

// Round robin and leastconn through the same script: every request goes to
// the server the replay's Router picks, given the requests in flight (which
// leastconn orders by, in the order servers reached their counts), a server
// going down while busy, one down since start-up coming up, and redispatches
// away from the server that refuses connections (HAProxy counts the refused
// request on it, then takes it back).
TEST_F(HaproxyRingTest, RoundRobinAndLeastconnPickWhatTheRouterPicks) {
  const std::vector<RingServer> servers = BoundedServers();
  for (const Backend backend : {kRoundRobin, kLeastConn}) {
    SCOPED_TRACE(kBackendNames[backend]);
    Router router(servers, ParseRoute(backend == kRoundRobin ? "roundrobin"
                                                             : "leastconn"));
    std::vector<uint32_t> in_flight(servers.size(), 0);
    std::mt19937 rng(7);
    size_t checks = 0, redispatches = 0, mismatches = 0;
    std::set<size_t> used;
    const auto expected = [&] {
      size_t want = router.Pick(0);
      if (want == kRefusing) {
        ++redispatches;
        router.Took(want);
        router.Released(want);
        want = router.Pick(0, kRefusing);
      }
      return want;
    };
    const auto check = [&](size_t want, size_t placed, const char* what) {
      ++checks;
      used.insert(placed);
      if (placed != want && ++mismatches <= 5) {
        std::string loads;
        for (uint32_t n : in_flight) loads += std::to_string(n) + " ";
        ADD_FAILURE() << what << " request " << checks << " went to "
                      << servers[placed].name << ", the router says "
                      << servers[want].name << " (in flight: " << loads << ")";
      }
    };
    const auto steps = [&](int count) {
      for (int i = 0; i < count; ++i) {
        AwaitInFlight(backend, servers, in_flight);
        const uint32_t r = rng() % 10;
        const std::string& model = models_[rng() % models_.size()];
        if (r < 4 && held_.size() < 14) {
          const size_t want = expected();
          Pending p = Send(backend, model);
          check(want, p.server_index, "held");
          router.Took(p.server_index);
          ++in_flight[p.server_index];
          held_.push_back(std::move(p));
        } else if (r < 8 || held_.empty()) {
          const size_t want = expected();
          router.Took(want);
          const size_t placed = Place(backend, model);
          check(want, placed, "probe");
          router.Released(want);
        } else {
          const size_t k = rng() % held_.size();
          const size_t s = Answer(held_[k]);
          router.Released(s);
          --in_flight[s];
          held_.erase(held_.begin() + static_cast<ptrdiff_t>(k));
        }
      }
    };
    steps(80);
    SetServerState(backend, "b2", false);
    router.SetDown(1);
    steps(60);
    SetServerState(backend, "b5", true);
    router.SetUp(4);
    steps(60);
    while (!held_.empty()) {
      --in_flight[Answer(held_.back())];
      held_.pop_back();
    }
    AwaitInFlight(backend, servers, in_flight);
    EXPECT_EQ(mismatches, 0u) << "of " << checks << " requests";
    EXPECT_GE(redispatches, 3u);
    EXPECT_EQ(used.size(), servers.size() - 1) << "all but the refusing one";
    std::cout << kBackendNames[backend] << ": " << checks
              << " requests checked, " << redispatches << " redispatched\n";
  }
}

}  // namespace
}  // namespace modelcache::replay
