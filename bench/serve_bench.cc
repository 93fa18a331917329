// `modelcache serve` measured beside what a worker would do on its own.
// Each mode writes one JSON file (--out) and prints a table.
//
//   modelcache_serve_bench acquire [--iterations N] [--bytes B] --out F
//       Acquire + map + release of a resident model from a second process
//       (this one; the daemon is another), p50 and p99, beside the
//       in-process hit path of a HostWeightStore (acquire + release of a
//       resident copy) in the same run.
//   modelcache_serve_bench memory [--bytes 2GiB] [--workers 1,2,4,8] --out F
//       Host RAM for N worker processes using one file: through the daemon,
//       each loading its own copy with kPread, each mapping it with kMmap.
//       Measures Shmem and MemAvailable (/proc/meminfo) before and while the
//       workers hold their copies, and the total PSS of the workers and the
//       daemon (/proc/PID/smaps_rollup). kPread runs that would take more
//       than half of MemAvailable are skipped, and said so.
//   modelcache_serve_bench first-tensor [--bytes 2GiB] [--runs N] --out F
//       A fresh worker process's time to its first tensor and to the last
//       byte of a resident model, against a kPread load with a warm page
//       cache; timed inside the new process from the start of main().
//
//   modelcache_serve_bench loop [--bytes 2GiB] [--idle-processes 500]
//       [--out F]
//       The event loop under load: the p99 and max of a client's ping round
//       trip, in one run, while idle; while one orphan group exists and
//       500 idle processes run; while a copy of --bytes is freed by an
//       unload; while a 1,000-model catalog is reloaded (SIGHUP); while
//       PUT /v1/budget evicts 100 copies. Each phase pings for a fixed
//       window from the moment its action starts.
//
// Not a test: nothing here asserts a time. The figures go to docs/benchmarks.md
// with the command that produced them.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/base/bytes.h"
#include "modelcache/serve/client.h"
#include "modelcache/weights/host_store.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace w = modelcache::weights;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const Clock::time_point g_started = Clock::now();

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "serve_bench: %s\n", what.c_str());
  std::exit(2);
}

std::string Self() {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) Die("cannot find my own binary");
  return std::string(path, static_cast<size_t>(n));
}

// ---- files and the daemon ----

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
    // 64 F32 tensors, like a model's layers.
    w::SafetensorsWriter writer;
    const uint64_t per = std::max<uint64_t>(bytes / 64 / 4, 1);
    for (int i = 0; i < 64; ++i) {
      writer.AddTensor("layer" + std::to_string(i), w::Dtype::kF32, {per},
                       w::PatternFill(static_cast<uint64_t>(i)));
    }
    writer.Write(file);
    std::ofstream(catalog)
        << R"({"models": [{"id": "model", "files": ["model.safetensors"]}]})";
  }
  ~Setup() {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }
};

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
  pid_t pid() const { return pid_; }
  std::string ReadLine() {
    std::string line;
    char c;
    while (::read(from_, &c, 1) == 1 && c != '\n') line += c;
    return line;
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

// `modelcache serve` on the setup, ready when constructed.
std::unique_ptr<Child> StartDaemon(const Setup& s, uint64_t capacity) {
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) Die("pipe");
  const int high = ::fcntl(ready[1], F_DUPFD_CLOEXEC, 64);
  ::close(ready[1]);
  auto daemon = std::make_unique<Child>(
      std::vector<std::string>{MODELCACHE_CLI, "serve", "--catalog", s.catalog,
                               "--model-root", s.root, "--socket", s.socket,
                               "--http", "off", "--admin-socket", "off",
                               "--host-capacity", std::to_string(capacity),
                               "--ready-grace", "0", "--ready-fd", "3"},
      3, high);
  ::close(high);
  char buffer[1024];
  while (::read(ready[0], buffer, sizeof(buffer)) > 0) {
  }
  ::close(ready[0]);
  return daemon;
}

uint64_t Touch(std::span<const std::byte> bytes) {
  uint64_t sum = 0;
  for (size_t i = 0; i < bytes.size(); i += 4096) {
    sum += static_cast<unsigned char>(bytes[i]);
  }
  return sum;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

void Write(const std::string& out, const json& result) {
  if (out.empty()) return;
  fs::create_directories(fs::path(out).parent_path());
  std::ofstream(out) << result.dump(2) << "\n";
  std::cout << "wrote " << out << "\n";
}

// ---- acquire ----

int Acquire(uint64_t bytes, int iterations, const std::string& out) {
  Setup s(bytes);
  auto daemon = StartDaemon(s, bytes * 4);
  auto client = modelcache::serve::Client::Connect(s.socket);
  { auto warm = client.Acquire("model", std::chrono::seconds(60)); }
  w::HostStoreOptions options;
  options.capacity_bytes = bytes * 4;
  options.load.mode = w::LoadMode::kPread;
  w::HostWeightStore store(options);
  { auto warm = store.Acquire(s.file); }

  std::vector<double> remote;
  std::vector<double> local;
  std::vector<double> ping;
  ping.reserve(static_cast<size_t>(iterations));
  remote.reserve(static_cast<size_t>(iterations));
  local.reserve(static_cast<size_t>(iterations));
  // Interleaved, so that all three see the same phases of the machine.
  for (int i = 0; i < iterations; ++i) {
    const auto tp = Clock::now();
    client.Ping();
    ping.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - tp).count());
    auto t0 = Clock::now();
    {
      auto copy = client.Acquire("model", std::chrono::seconds(60));
      if (copy.tensors().size() != 64) Die("wrong tensors");
    }
    auto t1 = Clock::now();
    {
      auto copy = store.Acquire(s.file);
      if (copy.weights().tensors().size() != 64) Die("wrong tensors");
    }
    auto t2 = Clock::now();
    remote.push_back(
        std::chrono::duration<double, std::micro>(t1 - t0).count());
    local.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  const json result = {
      {"benchmark", "serve_acquire"},
      {"model_bytes", bytes},
      {"tensors", 64},
      {"iterations", iterations},
      {"remote_acquire_map_release_us",
       {{"p50", Percentile(remote, 0.5)}, {"p99", Percentile(remote, 0.99)}}},
      {"in_process_host_store_hit_us",
       {{"p50", Percentile(local, 0.5)}, {"p99", Percentile(local, 0.99)}}},
      {"ping_round_trip_us",
       {{"p50", Percentile(ping, 0.5)}, {"p99", Percentile(ping, 0.99)}}}};
  std::printf(
      "acquire + map + release from a second process: p50 %.1f us, "
      "p99 %.1f us\n",
      Percentile(remote, 0.5), Percentile(remote, 0.99));
  std::printf(
      "in-process HostWeightStore hit + release:      p50 %.2f us, "
      "p99 %.2f us\n",
      Percentile(local, 0.5), Percentile(local, 0.99));
  std::printf(
      "one ping round trip to the daemon:             p50 %.1f us, "
      "p99 %.1f us\n",
      Percentile(ping, 0.5), Percentile(ping, 0.99));
  Write(out, result);
  return 0;
}

// ---- workers (this binary, re-run) ----

// worker MODE PATH: loads (daemon: acquires) and touches every page, says
// "ready FIRST_US LAST_US", then holds everything until stdin closes.
// worker orphan PATH: acquires "small0", closes its connection while it
// still maps the copy (an orphan group in the daemon), says "ready", and
// holds it until stdin closes.
int WorkerMain(const std::string& mode, const std::string& path) {
  if (mode == "orphan") {
    auto client = modelcache::serve::Client::Connect(path);
    modelcache::serve::RemoteWeights held =
        client.Acquire("small0", std::chrono::seconds(600));
    client.Close();
    std::printf("ready\n");
    std::fflush(stdout);
    char c;
    while (::read(0, &c, 1) > 0) {
    }
    return held.tensors().empty() ? 1 : 0;
  }
  std::optional<modelcache::serve::Client> client;
  modelcache::serve::RemoteWeights remote;
  std::optional<w::WeightSet> local;
  double first_us = 0;
  uint64_t sum = 0;
  const auto since_start = [] {
    return std::chrono::duration<double, std::micro>(Clock::now() - g_started)
        .count();
  };
  if (mode == "daemon") {
    client.emplace(modelcache::serve::Client::Connect(path));
    remote = client->Acquire("model", std::chrono::seconds(600));
    const auto& t = remote.tensors().front();
    sum += static_cast<unsigned char>(t.data[0]);
    first_us = since_start();
    for (const auto& file : remote.files()) sum += Touch(file.data());
  } else {
    w::LoadOptions options;
    options.mode = mode == "mmap" ? w::LoadMode::kMmap : w::LoadMode::kPread;
    local.emplace(w::WeightSet::Open(path, options));
    sum += static_cast<unsigned char>(local->data(local->tensors().front())[0]);
    first_us = since_start();
    sum += Touch(local->data());
  }
  const double last_us = since_start();
  std::printf("ready %.1f %.1f %llu\n", first_us, last_us,
              static_cast<unsigned long long>(sum));
  std::fflush(stdout);
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}

std::map<std::string, uint64_t> MemInfo() {
  std::ifstream in("/proc/meminfo");
  std::map<std::string, uint64_t> out;
  std::string key;
  uint64_t kib;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    key.pop_back();  // ':'
    out[key] = kib * 1024;
  }
  return out;
}

uint64_t Pss(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  std::string key;
  uint64_t kib;
  std::string rest;
  while (in >> key) {
    if (key == "Pss:") {
      in >> kib;
      return kib * 1024;
    }
    std::getline(in, rest);
  }
  return 0;
}

int Memory(uint64_t bytes, const std::vector<int>& counts,
           const std::string& out) {
  Setup s(bytes);
  // Warm the page cache, as a server that reads its models often has.
  { auto warm = w::WeightSet::Open(s.file, {.mode = w::LoadMode::kPread}); }
  json rows = json::array();
  const double gib = static_cast<double>(uint64_t{1} << 30);
  std::printf("%-7s %3s %12s %12s %12s  %s\n", "mode", "N", "Shmem+", "Avail-",
              "PSS", "(GiB)");
  for (const char* mode : {"daemon", "pread", "mmap"}) {
    for (const int n : counts) {
      const auto before = MemInfo();
      if (std::string(mode) == "pread" &&
          static_cast<double>(n) * static_cast<double>(bytes) >
              0.5 * static_cast<double>(before.at("MemAvailable"))) {
        rows.push_back(
            {{"mode", mode},
             {"workers", n},
             {"skipped", "would take more than half of MemAvailable"}});
        std::printf("%-7s %3d  skipped: more than half of MemAvailable\n", mode,
                    n);
        continue;
      }
      std::unique_ptr<Child> daemon;
      if (std::string(mode) == "daemon") daemon = StartDaemon(s, bytes * 2);
      std::vector<std::unique_ptr<Child>> workers;
      for (int i = 0; i < n; ++i) {
        workers.push_back(std::make_unique<Child>(
            std::vector<std::string>{
                Self(), "worker", mode,
                std::string(mode) == "daemon" ? s.socket : s.file},
            -1, -1, /*pipes=*/true));
      }
      for (auto& worker : workers) {
        if (worker->ReadLine().rfind("ready", 0) != 0) Die("a worker failed");
      }
      const auto during = MemInfo();
      uint64_t pss = 0;
      for (auto& worker : workers) pss += Pss(worker->pid());
      if (daemon) pss += Pss(daemon->pid());
      const double shmem =
          (static_cast<double>(during.at("Shmem")) - before.at("Shmem")) / gib;
      const double avail = (static_cast<double>(before.at("MemAvailable")) -
                            during.at("MemAvailable")) /
                           gib;
      rows.push_back(
          {{"mode", mode},
           {"workers", n},
           {"shmem_added_bytes", static_cast<int64_t>(during.at("Shmem")) -
                                     static_cast<int64_t>(before.at("Shmem"))},
           {"mem_available_drop_bytes",
            static_cast<int64_t>(before.at("MemAvailable")) -
                static_cast<int64_t>(during.at("MemAvailable"))},
           {"total_pss_bytes", pss}});
      std::printf("%-7s %3d %12.2f %12.2f %12.2f\n", mode, n, shmem, avail,
                  static_cast<double>(pss) / gib);
      for (auto& worker : workers) worker->Finish();
      if (daemon) daemon->Stop(SIGTERM);
    }
  }
  Write(out, {{"benchmark", "serve_memory"},
              {"file_bytes", fs::file_size(s.file)},
              {"rows", rows}});
  return 0;
}

int FirstTensor(uint64_t bytes, int runs, const std::string& out) {
  Setup s(bytes);
  auto daemon = StartDaemon(s, bytes * 2);
  {
    auto client = modelcache::serve::Client::Connect(s.socket);
    auto warm = client.Acquire("model", std::chrono::seconds(600));
  }
  { auto warm = w::WeightSet::Open(s.file, {.mode = w::LoadMode::kPread}); }
  std::map<std::string, std::vector<double>> first;
  std::map<std::string, std::vector<double>> last;
  for (int r = 0; r < runs; ++r) {
    for (const char* mode : {"daemon", "pread"}) {
      Child worker({Self(), "worker", mode,
                    std::string(mode) == "daemon" ? s.socket : s.file},
                   -1, -1, /*pipes=*/true);
      std::istringstream line(worker.ReadLine());
      std::string ready;
      double f = 0;
      double l = 0;
      line >> ready >> f >> l;
      if (ready != "ready") Die("a worker failed");
      first[mode].push_back(f / 1000);
      last[mode].push_back(l / 1000);
      worker.Finish();
    }
  }
  json result = {{"benchmark", "serve_first_tensor"},
                 {"file_bytes", fs::file_size(s.file)},
                 {"runs", runs}};
  for (const char* mode : {"daemon", "pread"}) {
    result[mode] = {{"first_tensor_ms_p50", Percentile(first[mode], 0.5)},
                    {"last_byte_ms_p50", Percentile(last[mode], 0.5)}};
    std::printf(
        "%-6s first tensor %8.2f ms, last byte %8.2f ms (medians of %d)\n",
        mode, Percentile(first[mode], 0.5), Percentile(last[mode], 0.5), runs);
  }
  Write(out, result);
  return 0;
}

// ---- loop ----

// One HTTP/1.0 request over the daemon's admin socket; returns the status.
int AdminHttp(const std::string& socket, const std::string& method,
              const std::string& path, const std::string& body = "") {
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
                              std::to_string(body.size()) + "\r\n\r\n" + body;
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
  const size_t space = reply.find(' ');
  return space == std::string::npos ? 0 : std::atoi(reply.c_str() + space + 1);
}

int Loop(uint64_t bytes, int idle_processes, const std::string& out) {
  Setup s(bytes);  // "model": the big copy
  // 100 small models (the budget's evictions) and 899 tiny ones: a catalog
  // of 1,000 with the big one.
  const uint64_t small_bytes = 256 << 10;
  std::vector<std::string> small;
  for (int i = 0; i < 100; ++i) {
    const std::string id = "small" + std::to_string(i);
    w::SafetensorsWriter writer;
    writer.AddTensor("t", w::Dtype::kF32, {small_bytes / 4},
                     w::PatternFill(static_cast<uint64_t>(i)));
    writer.Write(s.root + "/" + id + ".safetensors");
    small.push_back(id);
  }
  for (int i = 0; i < 899; ++i) {
    w::SafetensorsWriter writer;
    writer.AddTensor("t", w::Dtype::kF32, {16},
                     w::PatternFill(static_cast<uint64_t>(i)));
    writer.Write(s.root + "/tiny" + std::to_string(i) + ".safetensors");
  }
  const auto write_catalog = [&](bool thousand) {
    json models = json::array();
    models.push_back({{"id", "model"}, {"files", {"model.safetensors"}}});
    for (const std::string& id : small) {
      models.push_back({{"id", id}, {"files", {id + ".safetensors"}}});
    }
    if (thousand) {
      for (int i = 0; i < 899; ++i) {
        const std::string id = "tiny" + std::to_string(i);
        models.push_back({{"id", id}, {"files", {id + ".safetensors"}}});
      }
    }
    std::ofstream(s.catalog) << json{{"models", models}}.dump();
  };
  write_catalog(false);
  const uint64_t capacity = bytes * 2 + 200 * small_bytes * 2;
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) Die("pipe");
  const int high = ::fcntl(ready[1], F_DUPFD_CLOEXEC, 64);
  ::close(ready[1]);
  Child daemon({MODELCACHE_CLI, "serve", "--catalog", s.catalog, "--model-root",
                s.root, "--socket", s.socket, "--http", "off",
                "--host-capacity", std::to_string(capacity), "--ready-grace",
                "0", "--orphan-rescan", "100ms", "--ready-fd", "3"},
               3, high);
  ::close(high);
  {
    char buffer[1024];
    while (::read(ready[0], buffer, sizeof(buffer)) > 0) {
    }
    ::close(ready[0]);
  }
  const std::string admin = s.socket + ".admin";

  // The pinger: its own connection, pinging back to back.
  struct Sample {
    Clock::time_point at;
    double us;
  };
  std::vector<Sample> samples;
  samples.reserve(1 << 22);
  std::atomic<bool> stop{false};
  std::thread pinger([&] {
    auto client = modelcache::serve::Client::Connect(s.socket);
    while (!stop.load()) {
      const auto t0 = Clock::now();
      client.Ping(std::chrono::seconds(60));
      samples.push_back(
          {t0, std::chrono::duration<double, std::micro>(Clock::now() - t0)
                   .count()});
    }
  });
  const auto window = std::chrono::milliseconds(1500);
  struct Phase {
    std::string name;
    Clock::time_point start;
    Clock::time_point end;
  };
  std::vector<Phase> phases;
  const auto run_phase = [&](const std::string& name,
                             const std::function<void()>& action) {
    Phase p{name, Clock::now(), {}};
    action();
    ::poll(nullptr, 0, static_cast<int>(window.count()));  // the window
    p.end = Clock::now();
    phases.push_back(p);
    std::cerr << "phase done: " << name << "\n";
  };

  run_phase("idle", [] {});

  // One orphan group (a worker that closed its socket and still maps its
  // copy) while many idle processes run.
  std::vector<std::unique_ptr<Child>> sleepers;
  for (int i = 0; i < idle_processes; ++i) {
    sleepers.push_back(std::make_unique<Child>(
        std::vector<std::string>{"/bin/sleep", "3600"}));
  }
  auto orphan = std::make_unique<Child>(
      std::vector<std::string>{Self(), "worker", "orphan", s.socket}, -1, -1,
      /*pipes=*/true);
  if (orphan->ReadLine() != "ready") Die("the orphan worker did not start");
  run_phase(
      "one orphan group, " + std::to_string(idle_processes) + " idle processes",
      [] {});
  orphan.reset();
  sleepers.clear();

  if (AdminHttp(admin, "POST", "/v1/models/model/load") != 200) {
    Die("cannot load the big model");
  }
  run_phase("unload frees a copy of " + modelcache::FormatBytes(bytes), [&] {
    if (AdminHttp(admin, "POST", "/v1/models/model/unload") != 200) {
      Die("cannot unload the big model");
    }
  });

  write_catalog(true);
  run_phase("SIGHUP reloads a 1,000-model catalog",
            [&] { ::kill(daemon.pid(), SIGHUP); });

  for (const std::string& id : small) {
    if (AdminHttp(admin, "POST", "/v1/models/" + id + "/load") != 200) {
      Die("cannot load " + id);
    }
  }
  run_phase("PUT /v1/budget evicts 100 copies", [&] {
    AdminHttp(admin, "PUT", "/v1/budget", "{\"capacity_bytes\": 4096}");
  });

  stop = true;
  pinger.join();
  daemon.Stop(SIGTERM);

  json rows = json::array();
  std::printf("%-44s %8s %10s %10s %10s\n", "situation", "pings", "p50 us",
              "p99 us", "max us");
  for (const Phase& p : phases) {
    std::vector<double> v;
    for (const Sample& x : samples) {
      if (x.at >= p.start && x.at < p.end) v.push_back(x.us);
    }
    if (v.empty()) continue;
    const double p50 = Percentile(v, 0.5);
    const double p99 = Percentile(v, 0.99);
    const double max = *std::max_element(v.begin(), v.end());
    std::printf("%-44s %8zu %10.1f %10.1f %10.1f\n", p.name.c_str(), v.size(),
                p50, p99, max);
    rows.push_back({{"situation", p.name},
                    {"pings", v.size()},
                    {"p50_us", p50},
                    {"p99_us", p99},
                    {"max_us", max}});
  }
  Write(out, {{"benchmark", "serve_loop"},
              {"bytes", bytes},
              {"idle_processes", idle_processes},
              {"window_ms", window.count()},
              {"phases", rows}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]) == "worker") {
    return WorkerMain(argv[2], argv[3]);
  }
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s acquire|memory|first-tensor|loop [--bytes B] "
                 "[--iterations N] [--workers 1,2,4,8] [--runs N] [--out F]\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  uint64_t bytes = mode == "acquire" ? uint64_t{8} << 20 : uint64_t{2} << 30;
  int iterations = 20000;
  int runs = 10;
  int idle_processes = 500;
  std::vector<int> workers = {1, 2, 4, 8};
  std::string out;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--bytes") {
      bytes = modelcache::ParseBytes(value);
    } else if (flag == "--iterations") {
      iterations = std::stoi(value);
    } else if (flag == "--idle-processes") {
      idle_processes = std::stoi(value);
    } else if (flag == "--runs") {
      runs = std::stoi(value);
    } else if (flag == "--out") {
      out = value;
    } else if (flag == "--workers") {
      workers.clear();
      std::istringstream in(value);
      std::string n;
      while (std::getline(in, n, ',')) workers.push_back(std::stoi(n));
    } else {
      Die("unknown flag " + flag);
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  if (mode == "acquire") return Acquire(bytes, iterations, out);
  if (mode == "memory") return Memory(bytes, workers, out);
  if (mode == "first-tensor") return FirstTensor(bytes, runs, out);
  if (mode == "loop") return Loop(bytes, idle_processes, out);
  Die("unknown mode " + mode);
}
