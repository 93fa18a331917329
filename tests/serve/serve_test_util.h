// The kit of the serve tests: model files and catalogs, processes started
// and always stopped by pid, the daemon as a real process (`modelcache
// serve`) with its HTTP API, worker processes driven line by line through
// pipes, raw protocol connections, and the checks that must hold after
// every test ("Never").
//
// Synchronisation is on observable state only: a process's answer on a pipe,
// the daemon's ready line, its HTTP books, a pidfd. Polling the daemon's
// books is a round trip each time, never a sleep; the bounds only turn a
// hang into a failure.
#ifndef MODELCACHE_TESTS_SERVE_SERVE_TEST_UTIL_H_
#define MODELCACHE_TESTS_SERVE_SERVE_TEST_UTIL_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "modelcache/base/text.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"
#include "proc_maps.h"
#include "protocol.h"
#include "socket.h"

extern char** environ;

namespace modelcache::serve::testing {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr auto kBound = std::chrono::seconds(120);

// ---- files ----

// A fresh folder of mode 0700 for one test (sockets, models, catalogs),
// removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (fs::temp_directory_path() / "mcserve_XXXXXX").string();
    const char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string operator/(const std::string& name) const {
    return (path_ / name).string();
  }

 private:
  fs::path path_;
};

// Writes a safetensors file of about `data_bytes` bytes (F32 tensors of a
// seeded pattern) and returns its data buffer's checksum (Checksum below).
inline uint64_t Checksum(std::span<const std::byte> bytes,
                         uint64_t h = 1469598103934665603ull) {
  for (const std::byte b : bytes) {
    h ^= static_cast<unsigned char>(b);
    h *= 1099511628211ull;
  }
  return h;
}

inline uint64_t WriteModel(const std::string& path, uint64_t data_bytes,
                           uint64_t seed) {
  fs::create_directories(fs::path(path).parent_path());
  weights::SafetensorsWriter writer;
  const uint64_t floats = std::max<uint64_t>(data_bytes / 8, 1);
  writer.SetMetadata("seed", std::to_string(seed));
  writer.AddTensor("first", weights::Dtype::kF32, {floats},
                   weights::PatternFill(seed));
  writer.AddTensor("second", weights::Dtype::kF32, {floats},
                   weights::PatternFill(seed + 1));
  writer.AddTensor("scalar", weights::Dtype::kI64, {},
                   weights::PatternFill(seed + 2));
  writer.Write(path);
  return Checksum(weights::WeightSet::Open(path).data());
}

struct ModelSpec {
  std::string id;
  std::vector<std::string> files;
  bool pinned = false;
  std::vector<std::string> aliases;
  int priority = 0;
};

inline void WriteCatalog(const std::string& path,
                         const std::vector<ModelSpec>& models) {
  json list = json::array();
  for (const ModelSpec& m : models) {
    json entry = {{"id", m.id}, {"files", m.files}};
    if (m.pinned) entry["pinned"] = true;
    if (!m.aliases.empty()) entry["aliases"] = m.aliases;
    if (m.priority != 0) entry["priority"] = m.priority;
    list.push_back(entry);
  }
  std::ofstream(path) << json{{"models", list}}.dump(2);
}

// ---- processes ----

// `fd` moved to a number of 64 or more (close-on-exec), so that dup2 to a
// small number in a child never meets itself (which would keep the flag).
inline int High(int fd) {
  const int high = ::fcntl(fd, F_DUPFD_CLOEXEC, 64);
  ::close(fd);
  return high;
}

inline int PidfdOpen(pid_t pid) {
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

// A child process, stopped (SIGKILL) and reaped by its destructor if it is
// still running. Its stdin and stdout are pipes when asked for.
class Process {
 public:
  struct Spec {
    std::vector<std::string> argv;
    // (descriptor here, number in the child)
    std::vector<std::pair<int, int>> fds;
    bool pipes = false;
    // NAME=value added to (or replacing) the environment.
    std::vector<std::string> env;
    // LISTEN_PID=<the child's pid> in its environment (systemd's protocol).
    bool listen_pid = false;
  };

  explicit Process(const Spec& spec) {
    int in[2] = {-1, -1};
    int out[2] = {-1, -1};
    if (spec.pipes) {
      if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
        throw std::runtime_error("pipe");
      }
    }
    std::vector<char*> argv;
    for (const std::string& a : spec.argv) {
      argv.push_back(const_cast<char*>(a.c_str()));
    }
    argv.push_back(nullptr);
    std::vector<std::string> env_strings = spec.env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view var(*e);
      const std::string_view name = var.substr(0, var.find('='));
      bool replaced = name == "LISTEN_PID" && spec.listen_pid;
      for (const std::string& mine : spec.env) {
        replaced = replaced || mine.substr(0, mine.find('=')) == name;
      }
      if (!replaced) env_strings.emplace_back(var);
    }
    // The child writes its pid in here (no allocation after fork).
    char listen_pid[32] = "LISTEN_PID=";
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    if (spec.listen_pid) envp.push_back(listen_pid);
    envp.push_back(nullptr);
    // fork and exec rather than posix_spawn, for PR_SET_PDEATHSIG: a test
    // killed by its timeout takes its children with it. (The signal follows
    // the thread that forks: tests keep a thread alive as long as the
    // processes it started.) Only async-signal-safe calls in the child.
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      if (spec.pipes) {
        ::dup2(in[0], 0);
        ::dup2(out[1], 1);
      }
      for (const auto& [here, there] : spec.fds) ::dup2(here, there);
      if (spec.listen_pid) {
        char digits[24];
        int n = 0;
        for (pid_t p = ::getpid(); p > 0; p /= 10) digits[n++] = '0' + p % 10;
        char* at = listen_pid + 11;  // after "LISTEN_PID="
        while (n > 0) *at++ = digits[--n];
        *at = '\0';
      }
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    if (spec.pipes) {
      ::close(in[0]);
      ::close(out[1]);
      to_child_ = in[1];
      from_child_ = out[0];
    }
    if (pid_ < 0) {
      const int error = errno;
      pid_ = -1;
      throw std::runtime_error("fork for " + spec.argv[0] + ": " +
                               base::ErrnoText(error));
    }
    pidfd_ = PidfdOpen(pid_);
  }
  ~Process() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int status;
      ::waitpid(pid_, &status, 0);
    }
    for (const int fd : {to_child_, from_child_, pidfd_}) {
      if (fd >= 0) ::close(fd);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  int pidfd() const { return pidfd_; }
  bool Exited() const {
    pollfd p{pidfd_, POLLIN, 0};
    return reaped_ || ::poll(&p, 1, 0) > 0;
  }
  void Signal(int signal) {
    if (!reaped_) ::kill(pid_, signal);
  }
  // Waits for the exit and reaps; returns the wait status. A process that
  // does not end within the bound fails the test and is killed.
  int Wait(std::chrono::seconds bound = kBound) {
    if (reaped_) return status_;
    pollfd p{pidfd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(bound.count() * 1000)) <= 0) {
      ADD_FAILURE() << "pid " << pid_ << " did not exit within "
                    << bound.count() << " s; killing it";
      ::kill(pid_, SIGKILL);
    }
    ::waitpid(pid_, &status_, 0);
    reaped_ = true;
    return status_;
  }
  void WriteLine(const std::string& line) {
    const std::string text = line + "\n";
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n =
          ::write(to_child_, text.data() + done, text.size() - done);
      if (n <= 0)
        throw std::runtime_error("write to pid " + std::to_string(pid_));
      done += static_cast<size_t>(n);
    }
  }
  // The next line of the child's stdout; "" at its end.
  std::string ReadLine(std::chrono::seconds bound = kBound) {
    const auto deadline = Clock::now() + bound;
    for (;;) {
      const size_t newline = buffer_.find('\n');
      if (newline != std::string::npos) {
        std::string line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      if (left.count() <= 0) {
        ADD_FAILURE() << "no line from pid " << pid_ << " within "
                      << bound.count() << " s";
        return "";
      }
      // The pipe blocks: read only once poll says it holds something, or
      // a silent child would hold this read past the bound.
      pollfd p{from_child_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(from_child_, chunk, sizeof(chunk));
      if (n == 0) return "";
      if (n > 0) buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

 private:
  pid_t pid_ = -1;
  int pidfd_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string buffer_;
};

// `modelcache ARGS`: its exit status and what it printed (both streams).
inline std::pair<int, std::string> RunCli(const TempDir& dir,
                                          const std::string& args) {
  const std::string out = dir / "cli.txt";
  Process::Spec spec;
  spec.argv = {"/bin/sh", "-c",
               std::string(MODELCACHE_CLI) + " " + args + " >" + out + " 2>&1"};
  Process p(spec);
  const int status = p.Wait();
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

// ---- HTTP ----

struct HttpResult {
  int status = 0;
  std::string body;
  json Json() const {
    return json::parse(body, nullptr, /*allow_exceptions=*/false);
  }
};

// ---- the daemon ----

struct DaemonOptions {
  std::string catalog;
  std::string root;
  std::string socket;
  std::string capacity = "1GiB";
  std::vector<std::string> args;  // more flags
  bool gate = false;              // --test-load-gate-fd
  bool pause_hook = false;        // --test-pause-reads-fd
  bool capacity_hook = false;     // --test-capacity-hold-fd
  std::vector<std::string> env;   // NAME=value for the daemon
  // When set, the daemon's standard error (its log) is appended to this
  // file, for tests that read what it says.
  std::string log_file;
  // Descriptors passed as systemd passes its fd store's: (name, descriptor
  // here), as 3, 4, ... with LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID. The
  // next Start passes them (and clears the list). Not with gate or
  // pause_hook.
  std::vector<std::pair<std::string, int>> listen_fds;
};

// `modelcache serve` started with a ready pipe; SIGTERM, then SIGKILL when
// it does not stop, at the end.
class Daemon {
 public:
  explicit Daemon(const DaemonOptions& options) : options_(options) { Start(); }
  ~Daemon() {
    CloseGate();
    if (pause_hook_ >= 0) ::close(pause_hook_);
    if (capacity_hook_ >= 0) ::close(capacity_hook_);
    if (process_ && !process_->Exited()) {
      process_->Signal(SIGTERM);
      process_->Wait();
    }
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Starts it again (after a kill): same options.
  void Start() { Launch(/*takeover=*/false); }

  // A takeover: a successor with the same flags and --takeover, started
  // beside the running daemon. Once the successor is ready it is this
  // Daemon, and the old one's wait status is returned (a takeover's
  // contract: it exits 0). When the successor does not get ready this
  // throws, and the old one serves on as this Daemon. Not with `gate` or
  // `pause_hook` (their descriptors are the old process's).
  int Takeover() {
    if (options_.gate || options_.pause_hook || options_.capacity_hook) {
      throw std::runtime_error("Takeover: not with gate or pause_hook");
    }
    std::unique_ptr<Process> old = std::move(process_);
    try {
      Launch(/*takeover=*/true);
    } catch (...) {
      process_ = std::move(old);
      throw;
    }
    return old->Wait();
  }

 private:
  void Launch(bool takeover) {
    int ready[2];
    if (::pipe2(ready, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    ready[1] = High(ready[1]);
    Process::Spec spec;
    spec.env = options_.env;
    // systemd's descriptors from 3 on; the ready pipe after them.
    std::vector<base::UniqueFd> passed;
    std::string names;
    for (const auto& [name, fd] : options_.listen_fds) {
      passed.emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 64));
      spec.fds.push_back(
          {passed.back().get(), 3 + static_cast<int>(spec.fds.size())});
      names += (names.empty() ? "" : ":") + name;
    }
    if (!passed.empty()) {
      if (options_.gate || options_.pause_hook || options_.capacity_hook) {
        throw std::runtime_error("listen_fds: not with gate or pause_hook");
      }
      spec.env.push_back("LISTEN_FDS=" + std::to_string(passed.size()));
      spec.env.push_back("LISTEN_FDNAMES=" + names);
      spec.listen_pid = true;
      options_.listen_fds.clear();
    }
    const int ready_there = 3 + static_cast<int>(passed.size());
    spec.argv = {MODELCACHE_CLI,    "serve",
                 "--catalog",       options_.catalog,
                 "--model-root",    options_.root,
                 "--socket",        options_.socket,
                 "--http",          "127.0.0.1:0",
                 "--host-capacity", options_.capacity,
                 "--ready-grace",   "0",
                 "--orphan-rescan", "50ms",
                 "--ready-fd",      std::to_string(ready_there)};
    spec.fds.push_back({ready[1], ready_there});
    if (options_.gate) {
      int gate[2];
      if (::pipe2(gate, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
      gate[0] = High(gate[0]);
      gate_ = gate[1];
      spec.fds.push_back({gate[0], 4});
      spec.argv.push_back("--test-load-gate-fd");
      spec.argv.push_back("4");
      gate_read_ = gate[0];
    }
    int hook_there = -1;
    if (options_.pause_hook) {
      int pair[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        throw std::runtime_error("socketpair");
      }
      if (pause_hook_ >= 0) ::close(pause_hook_);
      pause_hook_ = pair[0];
      hook_there = High(pair[1]);
      spec.fds.push_back({hook_there, 5});
      spec.argv.push_back("--test-pause-reads-fd");
      spec.argv.push_back("5");
    }
    int capacity_there = -1;
    if (options_.capacity_hook) {
      int pair[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        throw std::runtime_error("socketpair");
      }
      if (capacity_hook_ >= 0) ::close(capacity_hook_);
      capacity_hook_ = pair[0];
      capacity_there = High(pair[1]);
      spec.fds.push_back({capacity_there, 6});
      spec.argv.push_back("--test-capacity-hold-fd");
      spec.argv.push_back("6");
    }
    for (const std::string& a : options_.args) spec.argv.push_back(a);
    if (takeover) spec.argv.push_back("--takeover");
    int log = -1;
    if (!options_.log_file.empty()) {
      log = ::open(options_.log_file.c_str(),
                   O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (log < 0) throw std::runtime_error("open " + options_.log_file);
      log = High(log);
      spec.fds.push_back({log, 2});
    }
    process_ = std::make_unique<Process>(spec);
    if (log >= 0) ::close(log);
    ::close(ready[1]);
    if (gate_read_ >= 0) {
      ::close(gate_read_);
      gate_read_ = -1;
    }
    if (hook_there >= 0) ::close(hook_there);
    if (capacity_there >= 0) ::close(capacity_there);
    std::string line;
    char buffer[1024];
    ssize_t n;
    pollfd p{ready[0], POLLIN, 0};
    while (::poll(&p, 1, static_cast<int>(kBound.count() * 1000)) > 0 &&
           (n = ::read(ready[0], buffer, sizeof(buffer))) > 0) {
      line.append(buffer, static_cast<size_t>(n));
    }
    ::close(ready[0]);
    const json info = json::parse(line, nullptr, false);
    if (info.is_discarded() || !info.is_object()) {
      throw std::runtime_error("the daemon did not get ready (exit status " +
                               std::to_string(process_->Wait()) + ")");
    }
    const std::string http = info["http"].get<std::string>();
    http_port_ = std::stoi(http.substr(http.rfind(':') + 1));
    admin_socket_ = info["admin_socket"].get<std::string>();
    memfd_prefix_ = info["memfd_prefix"].get<std::string>();
    // Measured at the first start only: a daemon started again (after a
    // kill, a takeover, on systemd's descriptors) may hold copies and
    // clients from the start, and with none of them it has what the first
    // had.
    if (baseline_fds_ == 0) baseline_fds_ = QuiescentFds();
  }

 public:
  // The daemon's descriptors less one pidfd per orphan-mapping process: the
  // least of a few readings, since the server side of an HTTP request the
  // test has just made (OrphanPids' own, the readiness check's) may still be
  // open for a moment, and such a transient only ever adds.
  int QuiescentFds() {
    int least = std::numeric_limits<int>::max();
    for (int i = 0; i < 20; ++i) {
      const int fds = OpenFds();  // before the request OrphanPids makes
      least = std::min(least, fds - OrphanPids());
      std::this_thread::yield();
    }
    return least;
  }

  // Processes mapping a predecessor's copies: the daemon watches each
  // through a pidfd.
  int OrphanPids() {
    std::set<pid_t> pids;
    const json copies = GetJson("/v1/copies");
    for (const json& o : copies["orphans"]) {
      for (const json& pid : o["pids"]) pids.insert(pid.get<pid_t>());
    }
    return static_cast<int>(pids.size());
  }

  Process& process() { return *process_; }
  pid_t pid() const { return process_->pid(); }
  // What the next Start uses (listen_fds, say).
  DaemonOptions& options() { return options_; }
  const std::string& socket() const { return options_.socket; }
  const std::string& memfd_prefix() const { return memfd_prefix_; }
  int baseline_fds() const { return baseline_fds_; }

  HttpResult Get(const std::string& path) {
    httplib::Client client("127.0.0.1", http_port_);
    client.set_read_timeout(kBound.count(), 0);
    const auto r = client.Get(path.c_str());
    if (!r) return {0, httplib::to_string(r.error())};
    return {r->status, r->body};
  }
  json GetJson(const std::string& path) { return Get(path).Json(); }
  // Through the admin socket (changes allowed), or the public port.
  HttpResult Send(const std::string& method, const std::string& path,
                  const std::string& body = "", bool admin = true) {
    std::unique_ptr<httplib::Client> client;
    if (admin) {
      client = std::make_unique<httplib::Client>(admin_socket_, 80);
      client->set_address_family(AF_UNIX);
    } else {
      client = std::make_unique<httplib::Client>("127.0.0.1", http_port_);
    }
    client->set_read_timeout(kBound.count(), 0);
    httplib::Result r =
        method == "PUT" ? client->Put(path.c_str(), body, "application/json")
                        : client->Post(path.c_str(), body, "application/json");
    if (!r) return {0, httplib::to_string(r.error())};
    return {r->status, r->body};
  }
  // The value of one sample of /metrics, e.g. Metric("modelcache_loads_total")
  // or Metric("modelcache_acquires_total{result=\"hit\"}").
  double Metric(const std::string& sample) {
    std::istringstream text(Get("/metrics").body);
    std::string line;
    while (std::getline(text, line)) {
      if (line.rfind(sample + " ", 0) == 0) {
        return std::stod(line.substr(sample.size() + 1));
      }
    }
    ADD_FAILURE() << "no sample " << sample << " in /metrics";
    return -1;
  }
  json Budget() { return GetJson("/v1/budget"); }
  json Model(const std::string& id) { return GetJson("/v1/models/" + id); }

  int OpenFds() const {
    int n = 0;
    for (const auto& e : fs::directory_iterator(
             "/proc/" + std::to_string(process_->pid()) + "/fd")) {
      (void)e;
      ++n;
    }
    return n;
  }

  // Lets `n` file reads of loads proceed.
  void OpenGate(int n = 1) {
    const std::string bytes(static_cast<size_t>(n), 'g');
    [[maybe_unused]] ssize_t w = ::write(gate_, bytes.data(), bytes.size());
  }
  // Stops the daemon reading its clients' requests, or lets it read again;
  // returns once it is in effect (the hook answers).
  void PauseReads() { Hook('p'); }
  void ResumeReads() { Hook('r'); }
  // With capacity_hook: returns once a PUT /v1/budget (sent by another
  // thread) holds the lock of the store's capacity; it holds it until
  // LetCapacityGo.
  void AwaitCapacityHeld() {
    ASSERT_GE(capacity_hook_, 0) << "started without capacity_hook";
    char held = 0;
    pollfd p{capacity_hook_, POLLIN, 0};
    ASSERT_GT(::poll(&p, 1, static_cast<int>(kBound.count() * 1000)), 0)
        << "no PUT /v1/budget took the capacity's lock";
    ASSERT_EQ(::read(capacity_hook_, &held, 1), 1);
    ASSERT_EQ(held, 'h');
  }
  void LetCapacityGo() {
    const char go = 'g';
    ASSERT_EQ(::write(capacity_hook_, &go, 1), 1);
  }
  // Lets every load proceed from now on.
  void CloseGate() {
    if (gate_ >= 0) {
      ::close(gate_);
      gate_ = -1;
    }
  }

 private:
  void Hook(char command) {
    ASSERT_GE(pause_hook_, 0) << "started without pause_hook";
    ASSERT_EQ(::write(pause_hook_, &command, 1), 1);
    char answer = 0;
    pollfd p{pause_hook_, POLLIN, 0};
    ASSERT_GT(::poll(&p, 1, static_cast<int>(kBound.count() * 1000)), 0)
        << "the daemon did not answer the pause hook";
    ASSERT_EQ(::read(pause_hook_, &answer, 1), 1);
    ASSERT_EQ(answer, command);
  }

  DaemonOptions options_;
  std::unique_ptr<Process> process_;
  int pause_hook_ = -1;
  int capacity_hook_ = -1;
  int gate_ = -1;
  int gate_read_ = -1;
  int http_port_ = 0;
  std::string admin_socket_;
  std::string memfd_prefix_;
  int baseline_fds_ = 0;
};

// Polls `condition` (each call a round trip to the daemon, or a look at
// /proc) until it holds; fails the test naming `what` after the bound.
inline bool Eventually(const std::function<bool()>& condition,
                       const std::string& what) {
  const auto give_up = Clock::now() + kBound;
  while (!condition()) {
    if (Clock::now() > give_up) {
      ADD_FAILURE() << "never: " << what;
      return false;
    }
    std::this_thread::yield();
  }
  return true;
}

// ---- workers ----

// A serve_test_worker process (see serve_test_worker.cc).
class Worker {
 public:
  explicit Worker(const std::string& socket = "") {
    Process::Spec spec;
    spec.argv = {SERVE_TEST_WORKER};
    spec.pipes = true;
    process_ = std::make_unique<Process>(spec);
    if (!socket.empty()) {
      // The first call after the worker started.
      const std::string r = Do("connect " + socket);
      if (r != "ok") ADD_FAILURE() << "connect: " << r;
    }
  }
  ~Worker() {
    if (!process_->Exited()) {
      process_->WriteLine("exit");
      process_->Wait();
    }
  }
  std::string Do(const std::string& command) {
    Send(command);
    return Receive();
  }
  // Do in two halves, for commands that run while the test does more.
  void Send(const std::string& command) { process_->WriteLine(command); }
  std::string Receive() { return process_->ReadLine(); }
  // "ok A B C" -> {"A", "B", "C"}; fails the test on anything else.
  std::vector<std::string> Ok(const std::string& command) {
    const std::string reply = Do(command);
    std::istringstream in(reply);
    std::string word;
    in >> word;
    EXPECT_EQ(word, "ok") << command << " -> " << reply;
    std::vector<std::string> words;
    while (in >> word) words.push_back(word);
    return words;
  }
  Process& process() { return *process_; }
  pid_t pid() const { return process_->pid(); }

 private:
  std::unique_ptr<Process> process_;
};

// ---- raw protocol ----

// A connection of this process, speaking the protocol by hand.
class Raw {
 public:
  explicit Raw(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&address),
                  sizeof(address)) != 0) {
      throw std::runtime_error("connect " + path);
    }
  }
  ~Raw() { Close(); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }
  // Returns false when the send failed (EAGAIN with `dontwait`).
  bool Send(std::string_view bytes, std::span<const int> fds = {},
            bool dontwait = false) {
    return detail::SendDatagram(fd_, bytes, fds, dontwait ? MSG_DONTWAIT : 0) ==
           0;
  }
  // The next datagram; nullopt at the end of the stream or after the bound.
  std::optional<detail::Datagram> Receive(std::chrono::seconds bound = kBound) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(bound.count() * 1000)) <= 0) {
      return std::nullopt;
    }
    detail::Datagram d;
    int r = detail::ReceiveDatagram(fd_, protocol::kMaxMessageBytes, 16, 0, &d);
    // A peer that closed with our data unread reports ECONNRESET once,
    // before the datagrams it queued.
    if (r < 0 && errno == ECONNRESET) {
      r = detail::ReceiveDatagram(fd_, protocol::kMaxMessageBytes, 16, 0, &d);
    }
    if (r <= 0) return std::nullopt;
    return d;
  }
  std::optional<protocol::Reply> Reply(std::chrono::seconds bound = kBound) {
    auto d = Receive(bound);
    if (!d) return std::nullopt;
    last_fds_ = std::move(d->fds);
    protocol::ParsedReply parsed = protocol::ParseReply(d->bytes);
    EXPECT_TRUE(parsed.reply) << parsed.error << ": " << d->bytes;
    return parsed.reply;
  }
  std::vector<base::UniqueFd>& last_fds() { return last_fds_; }

 private:
  int fd_ = -1;
  std::vector<base::UniqueFd> last_fds_;
};

// `promtool check metrics` passes on the daemon's /metrics (written to
// `file` for it).
inline void ExpectPromtoolPasses(Daemon& daemon, const std::string& file) {
  const std::string metrics = daemon.Get("/metrics").body;
  std::ofstream(file) << metrics;
  Process::Spec spec;
  spec.argv = {"/bin/sh", "-c", "promtool check metrics < " + file};
  Process promtool(spec);
  const int status = promtool.Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "promtool check metrics failed on:\n"
      << metrics;
}

// ---- Never ----

// Every memfd of the daemon's instance that a live process maps must be in
// the daemon's books: a copy it holds now, or an orphan it booked. A memfd
// missing from the books is looked for again after them, so that one freed
// while being unmapped (correctly) is not taken for a violation.
inline void ExpectBooksCoverMaps(Daemon& daemon) {
  const auto scan = [&] {
    std::set<std::pair<uint64_t, uint64_t>> mapped;
    for (const detail::MemfdMapping& m :
         detail::ScanMemfdMappings(daemon.memfd_prefix(), daemon.pid())) {
      mapped.insert(
          {static_cast<uint64_t>(makedev(m.dev_major, m.dev_minor)), m.inode});
    }
    return mapped;
  };
  const auto mapped = scan();
  const json books = daemon.GetJson("/v1/copies");
  std::set<std::pair<uint64_t, uint64_t>> known;
  for (const json& m : books["memfds"]) {
    known.insert({m["dev"].get<uint64_t>(), m["inode"].get<uint64_t>()});
  }
  for (const json& o : books["orphans"]) {
    known.insert({o["dev"].get<uint64_t>(), o["inode"].get<uint64_t>()});
  }
  std::set<std::pair<uint64_t, uint64_t>> missing;
  for (const auto& id : mapped) {
    if (known.count(id) == 0) missing.insert(id);
  }
  if (missing.empty()) return;
  const auto again = scan();
  const json books_again = daemon.GetJson("/v1/copies");
  for (const json& m : books_again["memfds"]) {
    known.insert({m["dev"].get<uint64_t>(), m["inode"].get<uint64_t>()});
  }
  for (const json& o : books_again["orphans"]) {
    known.insert({o["dev"].get<uint64_t>(), o["inode"].get<uint64_t>()});
  }
  for (const auto& id : missing) {
    EXPECT_TRUE(again.count(id) == 0 || known.count(id) != 0)
        << "memfd inode " << id.second
        << " is mapped by a live process but not in the daemon's books";
  }
}

inline void ExpectWithinBudget(Daemon& daemon) {
  const json b = daemon.Budget();
  ASSERT_TRUE(b.is_object()) << "no /v1/budget";
  const uint64_t used = b["used_bytes"].get<uint64_t>();
  const uint64_t orphaned = b["orphaned_bytes"].get<uint64_t>();
  const uint64_t capacity = b["capacity_bytes"].get<uint64_t>();
  EXPECT_LE(used + orphaned, capacity) << b.dump();
}

// With every client gone: waits until the daemon holds no lease, unloads
// every model, and checks that the daemon's descriptors are back to what it
// had when it got ready.
inline void ExpectNoFdLeak(Daemon& daemon) {
  Eventually(
      [&] {
        const json b = daemon.Budget();
        return b.is_object() && daemon.Metric("modelcache_leases") == 0 &&
               daemon.Metric("modelcache_clients") == 0;
      },
      "the daemon drops every lease and client");
  const json models = daemon.GetJson("/v1/models");
  for (const json& m : models["models"]) {
    daemon.Send("POST", "/v1/models/" + m["id"].get<std::string>() + "/unload");
  }
  int last = 0;
  Eventually(
      [&] {
        const int fds = daemon.OpenFds();  // before OrphanPids' request
        last = fds - daemon.OrphanPids();
        return last == daemon.baseline_fds();
      },
      "the daemon's descriptors return to their number at start (" +
          std::to_string(daemon.baseline_fds()) + ")");
  EXPECT_EQ(last, daemon.baseline_fds());
}

// Lease ids never repeat, within a daemon and across its restarts.
class LeaseIds {
 public:
  void Add(const std::string& lease) {
    EXPECT_TRUE(seen_.insert(lease).second)
        << "lease id " << lease << " reused";
  }

 private:
  std::set<std::string> seen_;
};

// The fixture of the daemon's tests: models under a root, a catalog, a
// daemon started on them; the Never checks when the test ends.
constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

class ServeTest : public ::testing::Test {
 protected:
  // A model of about `bytes` bytes in one file under the root.
  void AddModel(const std::string& id, uint64_t bytes, uint64_t seed,
                bool pinned = false, std::vector<std::string> aliases = {}) {
    const std::string file = id + "/model.safetensors";
    checksums_[id] = WriteModel(root_ + "/" + file, bytes, seed);
    ModelSpec spec;
    spec.id = id;
    spec.files = {file};
    spec.pinned = pinned;
    spec.aliases = std::move(aliases);
    models_.push_back(spec);
    WriteCatalog(catalog_, models_);
  }

  // `pause_hook`: Daemon::PauseReads and ResumeReads work.
  Daemon& StartDaemon(const std::string& capacity = "1GiB",
                      std::vector<std::string> args = {}, bool gate = false,
                      bool pause_hook = false) {
    DaemonOptions options;
    options.catalog = catalog_;
    options.root = root_;
    options.socket = socket_;
    options.capacity = capacity;
    options.args = std::move(args);
    options.gate = gate;
    options.pause_hook = pause_hook;
    options.log_file = daemon_log_;
    daemon_ = std::make_unique<Daemon>(options);
    return *daemon_;
  }

  // The Never checks, on a daemon still running with every client gone.
  void TearDown() override {
    if (!daemon_ || daemon_->process().Exited()) return;
    ExpectBooksCoverMaps(*daemon_);
    ExpectWithinBudget(*daemon_);
    if (!skip_fd_check_) ExpectNoFdLeak(*daemon_);
  }

  // A copy's bytes in the budget: data and header memfds, in pages.
  uint64_t CopyBytes(const std::string& id) {
    return daemon_->Model(id)["bytes"].get<uint64_t>();
  }

  TempDir dir_;
  const std::string root_ = dir_ / "models";
  const std::string catalog_ = dir_ / "catalog.json";
  const std::string socket_ = dir_ / "run/serve.sock";
  std::vector<ModelSpec> models_;
  std::map<std::string, uint64_t> checksums_;
  std::unique_ptr<Daemon> daemon_;
  // Where StartDaemon's daemon logs (DaemonOptions::log_file); empty: the
  // test's standard error.
  std::string daemon_log_;
  LeaseIds leases_;
  bool skip_fd_check_ = false;
};

}  // namespace modelcache::serve::testing

#endif  // MODELCACHE_TESTS_SERVE_SERVE_TEST_UTIL_H_
