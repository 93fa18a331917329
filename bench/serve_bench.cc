// `modelcache serve` measured beside what a worker would do on its own.
// Each mode writes one JSON file (--out) and prints a table.
//
//   modelcache_serve_bench acquire [--iterations N] [--bytes B] --out F
//       Acquire + release of a resident model from a second process (this
//       one; the daemon is another), p50 and p99: a first acquire (a round
//       trip, mapping the copy), a copy the process holds, an idle
//       delegation revived (silently, and telling the daemon), beside a
//       ping and the in-process hit path of a HostWeightStore (acquire +
//       release of a resident copy), interleaved in the same run.
//   modelcache_serve_bench acquire-floor [--iterations N] [--bytes B] --out F
//       What any first acquire costs here whatever the daemon does: a round
//       trip between two processes whose reply carries two sealed memfds,
//       then the copy checked, mapped and unmapped, then a release message,
//       each beside the bare round trip (single-threaded, and with a second
//       thread parked in poll as a Client's keeper is).
//   modelcache_serve_bench recall [--counts 1,100] [--runs 10] --out F
//       A load that needs the room of N idle delegations of another process
//       (recalled, then evicted) beside the same load when those N models
//       are resident with no lease (evicted only); the difference is what
//       the recalls cost, from the reservation's need to the room.
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
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
#include "serve_bench_util.h"

namespace {

using modelcache_bench::AdminHttp;
using modelcache_bench::Child;
using modelcache_bench::Die;
using modelcache_bench::Percentile;
using modelcache_bench::Self;
using modelcache_bench::Setup;
using modelcache_bench::StartDaemon;
using modelcache_bench::Write;
namespace fs = std::filesystem;
namespace w = modelcache::weights;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const Clock::time_point g_started = Clock::now();

uint64_t Touch(std::span<const std::byte> bytes) {
  uint64_t sum = 0;
  for (size_t i = 0; i < bytes.size(); i += 4096) {
    sum += static_cast<unsigned char>(bytes[i]);
  }
  return sum;
}

// ---- acquire ----

int Acquire(uint64_t bytes, int iterations, const std::string& out) {
  Setup s(bytes);
  auto daemon = StartDaemon(s, bytes * 4);
  namespace serve = modelcache::serve;
  // Each path on a client of its own:
  //   round trip: every acquire a lease of its own (no local reuse), so
  //     acquire + map + release as a first acquire does it;
  //   held: a reference stays alive, so each acquire is a local reference;
  //   revived: each release leaves the lease idle and the next acquire
  //     revives it within the idle-notice delay (no message at all);
  //   told: each revival finds the lease told "idle" (a 20 us notice
  //     delay, so the keeper has said it by the loop's next round; the
  //     release wakes it): the revival sends nothing.
  serve::ClientOptions round_trip_options;
  round_trip_options.local_reuse = false;
  auto round_trip = serve::Client::Connect(s.socket, round_trip_options);
  auto held_client = serve::Client::Connect(s.socket);
  serve::ClientOptions revived_options;
  revived_options.idle_notice_delay = std::chrono::seconds(3600);
  auto revived = serve::Client::Connect(s.socket, revived_options);
  serve::ClientOptions told_options;
  told_options.idle_notice_delay = std::chrono::microseconds(20);
  auto told = serve::Client::Connect(s.socket, told_options);
  { auto warm = round_trip.Acquire("model", std::chrono::seconds(60)); }
  serve::RemoteWeights kept =
      held_client.Acquire("model", std::chrono::seconds(60));
  { auto warm = revived.Acquire("model", std::chrono::seconds(60)); }
  { auto warm = told.Acquire("model", std::chrono::seconds(60)); }
  w::HostStoreOptions options;
  options.capacity_bytes = bytes * 4;
  options.load.mode = w::LoadMode::kPread;
  w::HostWeightStore store(options);
  { auto warm = store.Acquire(s.file); }

  struct Path {
    const char* key;
    const char* label;
    std::function<void()> run;
    std::vector<double> us;
  };
  const auto remote = [](serve::Client& client) {
    return [&client] {
      auto copy = client.Acquire("model", std::chrono::seconds(60));
      if (copy.tensors().size() != 64) Die("wrong tensors");
    };
  };
  std::vector<Path> paths;
  paths.push_back({"ping_round_trip_us",
                   "one ping round trip to the daemon",
                   [&] { round_trip.Ping(); },
                   {}});
  paths.push_back({"remote_acquire_map_release_us",
                   "first acquire + map + release (a round trip)",
                   remote(round_trip),
                   {}});
  paths.push_back({"held_acquire_release_us",
                   "acquire + release of a copy the process holds",
                   remote(held_client),
                   {}});
  paths.push_back({"idle_revival_acquire_release_us",
                   "acquire + release of an idle delegation",
                   remote(revived),
                   {}});
  paths.push_back({"told_idle_revival_acquire_release_us",
                   "the same, the daemon told it is idle",
                   remote(told),
                   {}});
  paths.push_back({"in_process_host_store_hit_us",
                   "in-process HostWeightStore hit + release",
                   [&] {
                     auto copy = store.Acquire(s.file);
                     if (copy.weights().tensors().size() != 64) {
                       Die("wrong tensors");
                     }
                   },
                   {}});
  for (Path& path : paths) path.us.reserve(static_cast<size_t>(iterations));
  // Interleaved, so that every path sees the same phases of the machine.
  for (int i = 0; i < iterations; ++i) {
    for (Path& path : paths) {
      const auto t0 = Clock::now();
      path.run();
      path.us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  json result = {{"benchmark", "serve_acquire"},
                 {"model_bytes", bytes},
                 {"tensors", 64},
                 {"iterations", iterations}};
  const double hit = Percentile(paths.back().us, 0.5);
  const double ping = Percentile(paths.front().us, 0.5);
  for (const Path& path : paths) {
    const double p50 = Percentile(path.us, 0.5);
    result[path.key] = {{"p50", p50}, {"p99", Percentile(path.us, 0.99)}};
    std::printf("%-48s p50 %8.2f us  p99 %8.2f us  %6.2fx hit  %5.2fx ping\n",
                path.label, p50, Percentile(path.us, 0.99), p50 / hit,
                p50 / ping);
  }
  Write(out, result);
  return kept ? 0 : 1;
}

// ---- acquire-floor ----

// What any first acquire costs on this machine, whatever the daemon does: a
// SOCK_SEQPACKET round trip between two processes (a child that answers at
// once) whose reply carries a copy's two sealed memfds, the client's work on
// a copy (its seals and sizes, mmap, MADV_DONTFORK, munmap, close) and the
// release message, each beside a bare round trip, interleaved in one run.
// Once without and once with a second thread parked in poll, as a Client's
// keeper is (munmap in a threaded process may have to flush other CPUs).
// The ratios bound what the protocol's first acquire can reach: a lease's
// end unmaps before its release, and each lease's copy comes as descriptors.
int AcquireFloor(uint64_t bytes, int iterations, const std::string& out) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    Die("socketpair");
  }
  const auto sealed = [](const char* name, uint64_t size) {
    const int fd = ::memfd_create(name, MFD_ALLOW_SEALING | MFD_CLOEXEC);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0 ||
        ::fcntl(fd, F_ADD_SEALS,
                F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
            0) {
      Die("memfd");
    }
    return fd;
  };
  const int header_fd = sealed("floor:header", 4096);
  const int data_fd = sealed("floor:data", bytes);
  const pid_t answerer = ::fork();
  if (answerer < 0) Die("fork");
  if (answerer == 0) {
    // 'p': an empty reply; 'a': one with both memfds; 'r': no reply.
    ::close(sv[0]);
    char op;
    while (::recv(sv[1], &op, 1, 0) == 1) {
      if (op == 'r') continue;
      char reply = 'k';
      iovec io{&reply, 1};
      msghdr m{};
      m.msg_iov = &io;
      m.msg_iovlen = 1;
      alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
      if (op == 'a') {
        m.msg_control = control;
        m.msg_controllen = sizeof(control);
        cmsghdr* h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(2 * sizeof(int));
        const int fds[2] = {header_fd, data_fd};
        std::memcpy(CMSG_DATA(h), fds, sizeof(fds));
      }
      if (::sendmsg(sv[1], &m, 0) != 1) break;
    }
    ::_exit(0);
  }
  ::close(sv[1]);
  const int sock = sv[0];
  const auto round_trip = [sock](char op, int* fds) {
    if (::send(sock, &op, 1, 0) != 1) Die("send");
    pollfd p{sock, POLLIN, 0};
    ::poll(&p, 1, -1);
    char reply;
    iovec io{&reply, 1};
    msghdr m{};
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
    m.msg_control = control;
    m.msg_controllen = sizeof(control);
    if (::recvmsg(sock, &m, MSG_CMSG_CLOEXEC) != 1) Die("recvmsg");
    if (fds != nullptr) {
      const cmsghdr* h = CMSG_FIRSTHDR(&m);
      if (h == nullptr) Die("no descriptors");
      std::memcpy(fds, CMSG_DATA(h), 2 * sizeof(int));
    }
  };
  const auto map_copy = [bytes](const int* fds) {
    struct stat st[2];
    for (int i = 0; i < 2; ++i) {
      if (::fcntl(fds[i], F_GET_SEALS) < 0 || ::fstat(fds[i], &st[i]) != 0) {
        Die("checks");
      }
    }
    void* base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fds[1], 0);
    if (base == MAP_FAILED) Die("mmap");
    ::madvise(base, bytes, MADV_DONTFORK);
    return base;
  };
  struct Path {
    const char* key;
    const char* label;
    std::function<void()> run;
    std::vector<double> us;
  };
  std::vector<Path> paths;
  paths.push_back({"round_trip_us",
                   "a bare round trip",
                   [&] { round_trip('p', nullptr); },
                   {}});
  paths.push_back({"memfds_us",
                   "the reply carries 2 memfds (closed)",
                   [&] {
                     int fds[2];
                     round_trip('a', fds);
                     ::close(fds[0]);
                     ::close(fds[1]);
                   },
                   {}});
  paths.push_back({"mapped_us",
                   "+ checked, mapped, unmapped",
                   [&] {
                     int fds[2];
                     round_trip('a', fds);
                     void* base = map_copy(fds);
                     ::munmap(base, bytes);
                     ::close(fds[0]);
                     ::close(fds[1]);
                   },
                   {}});
  paths.push_back({"released_us",
                   "+ a release message",
                   [&] {
                     int fds[2];
                     round_trip('a', fds);
                     void* base = map_copy(fds);
                     ::munmap(base, bytes);
                     const char release = 'r';
                     if (::send(sock, &release, 1, 0) != 1) Die("send");
                     ::close(fds[0]);
                     ::close(fds[1]);
                   },
                   {}});
  json result = {{"benchmark", "serve_acquire_floor"},
                 {"model_bytes", bytes},
                 {"iterations", iterations}};
  for (const bool threaded : {false, true}) {
    int park[2];
    if (::pipe2(park, O_CLOEXEC) != 0) Die("pipe");
    std::thread parked;
    if (threaded) {
      parked = std::thread([fd = park[0]] {
        pollfd p{fd, POLLIN, 0};
        ::poll(&p, 1, -1);
      });
    }
    for (Path& path : paths) {
      path.us.clear();
      path.us.reserve(static_cast<size_t>(iterations));
    }
    for (int i = 0; i < iterations; ++i) {
      for (Path& path : paths) {
        const auto t0 = Clock::now();
        path.run();
        path.us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - t0)
                .count());
      }
    }
    if (threaded) {
      const char go = 'g';
      if (::write(park[1], &go, 1) != 1) Die("write");
      parked.join();
    }
    ::close(park[0]);
    ::close(park[1]);
    const char* run = threaded ? "with_a_parked_thread" : "single_threaded";
    std::printf("%s\n", threaded ? "with a second thread parked in poll:"
                                 : "single-threaded:");
    const double base = Percentile(paths.front().us, 0.5);
    for (const Path& path : paths) {
      const double p50 = Percentile(path.us, 0.5);
      result[run][path.key] = {{"p50", p50},
                               {"p99", Percentile(path.us, 0.99)}};
      std::printf("  %-40s p50 %8.2f us  p99 %8.2f us  %5.2fx round trip\n",
                  path.label, p50, Percentile(path.us, 0.99), p50 / base);
    }
  }
  ::close(sock);
  ::waitpid(answerer, nullptr, 0);
  ::close(header_fd);
  ::close(data_fd);
  Write(out, result);
  return 0;
}

// ---- recall ----

// The time from a reservation's need to its room being free when the room
// is held by N idle delegations of another process, beside the same load
// when those models are resident with no lease (plain evictions), in one
// run: N small models held idle, then one model that needs all their room.
int Recall(const std::vector<int>& counts, int runs, const std::string& out) {
  json rows = json::array();
  std::printf("%5s %14s %14s %14s\n", "N", "recall p50 ms", "evict p50 ms",
              "difference ms");
  for (const int n : counts) {
    const uint64_t small_bytes = 256 << 10;
    Setup s(uint64_t{1} << 20);  // "model": unused here
    json models = json::array();
    for (int i = 0; i < n; ++i) {
      const std::string id = "small" + std::to_string(i);
      w::SafetensorsWriter writer;
      writer.AddTensor("t", w::Dtype::kF32, {small_bytes / 4},
                       w::PatternFill(static_cast<uint64_t>(i)));
      writer.Write(s.root + "/" + id + ".safetensors");
      models.push_back({{"id", id}, {"files", {id + ".safetensors"}}});
    }
    // Room for the N small copies (each a little more than small_bytes: its
    // pages and its header's); the big one needs the room of all N.
    const uint64_t capacity =
        static_cast<uint64_t>(n) * (small_bytes + (16 << 10)) + (64 << 10);
    const uint64_t big_bytes =
        static_cast<uint64_t>(n) * (small_bytes + (16 << 10)) - small_bytes / 2;
    {
      w::SafetensorsWriter writer;
      writer.AddTensor("t", w::Dtype::kF32, {big_bytes / 4}, w::PatternFill(7));
      writer.Write(s.root + "/big.safetensors");
    }
    models.push_back({{"id", "big"}, {"files", {"big.safetensors"}}});
    std::ofstream(s.catalog) << json{{"models", models}}.dump();
    std::vector<double> recall_ms;
    std::vector<double> evict_ms;
    for (int run = 0; run < runs; ++run) {
      for (const bool delegated : {true, false}) {
        auto daemon = StartDaemon(s, capacity);
        // The holder: another process, which acquires the N models and
        // either keeps them idle (delegated) or releases them.
        Child holder({Self(), "worker", delegated ? "hold" : "touch", s.socket,
                      std::to_string(n)},
                     -1, -1, /*pipes=*/true);
        if (holder.ReadLine() != "ready") Die("the holder failed");
        auto client = modelcache::serve::Client::Connect(s.socket);
        const auto t0 = Clock::now();
        {
          auto big = client.Acquire("big", std::chrono::seconds(60));
          if (big.tensors().size() != 1) Die("wrong tensors");
        }
        const double ms =
            std::chrono::duration<double, std::milli>(Clock::now() - t0)
                .count();
        (delegated ? recall_ms : evict_ms).push_back(ms);
        holder.Finish();
      }
    }
    const double recall = Percentile(recall_ms, 0.5);
    const double evict = Percentile(evict_ms, 0.5);
    rows.push_back({{"idle_delegations", n},
                    {"runs", runs},
                    {"load_with_recall_ms_p50", recall},
                    {"load_with_plain_evictions_ms_p50", evict},
                    {"recall_ms_p50", recall - evict}});
    std::printf("%5d %14.3f %14.3f %14.3f\n", n, recall, evict, recall - evict);
  }
  Write(out, {{"benchmark", "serve_recall"}, {"rows", rows}});
  return 0;
}

// ---- workers (this binary, re-run) ----

// worker MODE PATH: loads (daemon: acquires) and touches every page, says
// "ready FIRST_US LAST_US", then holds everything until stdin closes.
// worker orphan PATH: acquires "small0", closes its connection while it
// still maps the copy (an orphan group in the daemon), says "ready", and
// holds it until stdin closes.
int WorkerMain(const std::string& mode, const std::string& path, int count) {
  if (mode == "hold" || mode == "touch") {
    // hold: acquires small0..small<count-1> and keeps them idle (its
    // client's delegation answers the recalls); touch: the same, released.
    modelcache::serve::ClientOptions options;
    if (mode == "touch") options.keep_idle = std::chrono::milliseconds(0);
    options.idle_notice_delay = std::chrono::microseconds(0);
    auto client = modelcache::serve::Client::Connect(path, options);
    for (int i = 0; i < count; ++i) {
      auto lease = client.Acquire("small" + std::to_string(i),
                                  std::chrono::seconds(600));
    }
    client.Ping();  // after the idle notices: the daemon has them all
    std::printf("ready\n");
    std::fflush(stdout);
    char c;
    while (::read(0, &c, 1) > 0) {
    }
    return 0;
  }
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
  auto daemon = StartDaemon(s, capacity, {"--orphan-rescan", "100ms"},
                            /*admin_socket=*/true);
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
            [&] { ::kill(daemon->pid(), SIGHUP); });

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
  daemon->Stop(SIGTERM);

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
    return WorkerMain(argv[2], argv[3], argc >= 5 ? std::stoi(argv[4]) : 0);
  }
  if (argc < 2) {
    std::fprintf(
        stderr,
        "usage: %s acquire|acquire-floor|memory|first-tensor|loop|recall "
        "[--bytes B] "
        "[--iterations N] [--workers 1,2,4,8] [--counts 1,100] "
        "[--runs N] [--out F]\n",
        argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  uint64_t bytes = mode == "acquire" || mode == "acquire-floor"
                       ? uint64_t{8} << 20
                       : uint64_t{2} << 30;
  int iterations = 20000;
  int runs = 10;
  int idle_processes = 500;
  std::vector<int> workers = {1, 2, 4, 8};
  std::vector<int> counts = {1, 100};
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
    } else if (flag == "--counts") {
      counts.clear();
      std::istringstream in(value);
      std::string n;
      while (std::getline(in, n, ',')) counts.push_back(std::stoi(n));
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
  if (mode == "acquire-floor") return AcquireFloor(bytes, iterations, out);
  if (mode == "memory") return Memory(bytes, workers, out);
  if (mode == "first-tensor") return FirstTensor(bytes, runs, out);
  if (mode == "loop") return Loop(bytes, idle_processes, out);
  if (mode == "recall") return Recall(counts, runs, out);
  Die("unknown mode " + mode);
}
