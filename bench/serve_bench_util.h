// What the benchmarks of `modelcache serve` share: model files and a
// catalog in a temporary directory, child processes started and stopped by
// pid (the daemon and the bench's own workers), and the admin socket's HTTP.
// Each bench binary defines MODELCACHE_CLI, the `modelcache` binary it runs
// as the daemon.
#ifndef MODELCACHE_BENCH_SERVE_BENCH_UTIL_H_
#define MODELCACHE_BENCH_SERVE_BENCH_UTIL_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/weights/safetensors_writer.h"

extern char** environ;

namespace modelcache_bench {

namespace fs = std::filesystem;

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "serve_bench: %s\n", what.c_str());
  std::exit(2);
}

// This binary's path, to run it again as a worker.
inline std::string Self() {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) Die("cannot find my own binary");
  return std::string(path, static_cast<size_t>(n));
}

// A safetensors file of about `bytes`: 64 F32 tensors, like a model's layers.
inline void WriteModel(const std::string& path, uint64_t bytes,
                       uint64_t seed = 0) {
  namespace w = modelcache::weights;
  w::SafetensorsWriter writer;
  const uint64_t per = std::max<uint64_t>(bytes / 64 / 4, 1);
  for (int i = 0; i < 64; ++i) {
    writer.AddTensor("layer" + std::to_string(i), w::Dtype::kF32, {per},
                     w::PatternFill(seed * 64 + static_cast<uint64_t>(i)));
  }
  writer.Write(path);
}

// A temporary directory with a model root holding one model, "model" (the
// file model.safetensors, of about `bytes`), and a catalog naming it; the
// daemon's socket goes in run/. A bench that needs other models writes
// their files beneath `root` and the catalog again.
struct Setup {
  fs::path dir;
  std::string root;
  std::string catalog;
  std::string socket;
  std::string file;  // the model's one file

  explicit Setup(uint64_t bytes) {
    std::string pattern =
        (fs::temp_directory_path() / "mcbench_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) Die("mkdtemp");
    dir = pattern;
    root = (dir / "models").string();
    catalog = (dir / "catalog.json").string();
    socket = (dir / "run/serve.sock").string();
    file = root + "/model.safetensors";
    fs::create_directories(root);
    WriteModel(file, bytes);
    std::ofstream(catalog)
        << R"({"models": [{"id": "model", "files": ["model.safetensors"]}]})";
  }
  ~Setup() {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }
  Setup(const Setup&) = delete;
  Setup& operator=(const Setup&) = delete;
};

// A process this bench started; the destructor kills it (SIGKILL) and reaps
// it. With `pipes`, its stdin and stdout are pipes to this process.
class Child {
 public:
  Child(const std::vector<std::string>& argv, int ready_fd_in_child = -1,
        int ready_fd = -1, bool pipes = false) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (ready_fd >= 0) {
      posix_spawn_file_actions_adddup2(&actions, ready_fd, ready_fd_in_child);
    }
    int in[2] = {-1, -1};
    int out[2] = {-1, -1};
    if (pipes) {
      if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
        Die("pipe");
      }
      posix_spawn_file_actions_adddup2(&actions, in[0], 0);
      posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    }
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (::posix_spawn(&pid_, args[0], &actions, nullptr, args.data(),
                      environ) != 0) {
      Die("cannot start " + argv[0]);
    }
    posix_spawn_file_actions_destroy(&actions);
    if (pipes) {
      ::close(in[0]);
      ::close(out[1]);
      to_ = in[1];
      from_ = out[0];
    }
  }
  ~Child() { Stop(SIGKILL); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  // The read end of its stdout (with `pipes`), for poll().
  int stdout_fd() const { return from_; }
  // One line of its stdout, without the newline (reads byte by byte, so a
  // caller may go on reading the descriptor itself).
  std::string ReadLine() {
    std::string line;
    char c;
    while (::read(from_, &c, 1) == 1 && c != '\n') line += c;
    return line;
  }
  // Writes to its stdin.
  void Send(std::string_view text) {
    if (::write(to_, text.data(), text.size()) !=
        static_cast<ssize_t>(text.size())) {
      Die("cannot write to a child");
    }
  }
  // Closes the child's stdin (it exits then) and reaps it.
  void Finish() {
    if (to_ >= 0) ::close(to_);
    to_ = -1;
    Stop(0);
  }
  void Stop(int signal) {
    if (pid_ <= 0) return;
    if (signal != 0) ::kill(pid_, signal);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    to_ = from_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
};

// Reads what children (with `pipes`) say on stdout, line by line, as it
// comes, from all of them at once.
class Lines {
 public:
  explicit Lines(const std::vector<Child*>& children) {
    for (Child* c : children) readers_.push_back({c->stdout_fd(), {}});
  }
  // Waits up to `timeout_ms` for output; calls `line` for each whole line.
  template <typename F>
  void Poll(int timeout_ms, F&& line) {
    std::vector<pollfd> fds;
    for (const Reader& r : readers_) fds.push_back({r.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof(buffer));
      if (n <= 0) Die("a child process ended early");
      std::string& pending = readers_[i].pending;
      pending.append(buffer, static_cast<size_t>(n));
      size_t end;
      while ((end = pending.find('\n')) != std::string::npos) {
        line(pending.substr(0, end));
        pending.erase(0, end + 1);
      }
    }
  }

 private:
  struct Reader {
    int fd;
    std::string pending;
  };
  std::vector<Reader> readers_;
};

// `modelcache serve` on the setup with these further flags, ready (its
// --ready-fd line read) when this returns. With `admin_socket`, it listens
// on s.socket + ".admin" too (AdminHttp).
inline std::unique_ptr<Child> StartDaemon(
    const Setup& s, uint64_t capacity,
    const std::vector<std::string>& flags = {}, bool admin_socket = false) {
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) Die("pipe");
  const int high = ::fcntl(ready[1], F_DUPFD_CLOEXEC, 64);
  ::close(ready[1]);
  std::vector<std::string> argv = {
      MODELCACHE_CLI,  "serve", "--catalog",       s.catalog,
      "--model-root",  s.root,  "--socket",        s.socket,
      "--http",        "off",   "--host-capacity", std::to_string(capacity),
      "--ready-grace", "0",     "--ready-fd",      "3"};
  if (!admin_socket) {
    argv.push_back("--admin-socket");
    argv.push_back("off");
  }
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto daemon = std::make_unique<Child>(argv, 3, high);
  ::close(high);
  char buffer[1024];
  ssize_t said = 0;
  ssize_t n;
  while ((n = ::read(ready[0], buffer, sizeof(buffer))) > 0) said += n;
  ::close(ready[0]);
  if (said == 0) Die("the daemon did not start");
  return daemon;
}

inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// Writes `result` to `out` (nothing when `out` is empty).
inline void Write(const std::string& out, const nlohmann::json& result) {
  if (out.empty()) return;
  fs::create_directories(fs::path(out).parent_path());
  std::ofstream(out) << result.dump(2) << "\n";
  std::cout << "wrote " << out << "\n";
}

// One HTTP/1.0 request over the daemon's admin socket; returns the status
// and, with `body`, the reply's body.
inline int AdminHttp(const std::string& socket, const std::string& method,
                     const std::string& path,
                     const std::string& request_body = "",
                     std::string* body = nullptr) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, socket.c_str(), sizeof(address.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    Die("cannot reach the admin socket " + socket);
  }
  const std::string request = method + " " + path +
                              " HTTP/1.0\r\nHost: x\r\nContent-Type: "
                              "application/json\r\nContent-Length: " +
                              std::to_string(request_body.size()) + "\r\n\r\n" +
                              request_body;
  if (::write(fd, request.data(), request.size()) !=
      static_cast<ssize_t>(request.size())) {
    Die("write to the admin socket");
  }
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) {
    reply.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  if (body != nullptr) {
    const size_t end = reply.find("\r\n\r\n");
    *body = end == std::string::npos ? "" : reply.substr(end + 4);
  }
  const size_t space = reply.find(' ');
  return space == std::string::npos ? 0 : std::atoi(reply.c_str() + space + 1);
}

}  // namespace modelcache_bench

#endif  // MODELCACHE_BENCH_SERVE_BENCH_UTIL_H_
