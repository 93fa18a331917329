// The starvation scenario of swap scheduling through `modelcache serve`:
// how long a request that needs room waits while the model holding that
// room is in continuous use by other processes, for several --drain-after
// values. The daemon's half of issue 50's benchmark, beside the library's
// (starvation_bench.cc), with the same workload.
//
// A daemon with room for one model (--host-capacity 6MiB; models A and B
// of 4 MiB each). Three worker processes keep A in use, each through its
// own serve::Client with local reuse, as a server would: each acquires A,
// holds its reference --hold-ms, releases it and asks again, their starts
// staggered so that the references overlap and A is never idle. The
// client's local reuse revives its lease with no message to the daemon, so
// only the daemon's drain recalls (docs/serve.md, "Swap scheduling") end
// it. After --b-after-ms a fifth process asks for B (a `wait` acquire,
// deadline --timeout-ms), holds it --hold-ms and releases it. Loads take
// --load-ms (--throttle-load-latency). Per drain_after, --runs runs, each
// on a fresh daemon (so the default is its floor, 1 s: B was never loaded
// and nothing drained before). The table gives the median and the largest
// wait of B; the bound docs/serve.md promises (drain_after + the longest
// lease in use when the drain began + B's load), nominal (--hold-ms and
// --load-ms) and as each run measured it (the longest reference to A let go
// during the drain, B's load as the daemon timed it); B's wait past the
// drain's due time in two parts (until the last reference to A was let go,
// then until B was served); how many A requests were served while B
// waited, how long after B was served A was served again, and the
// daemon's drains.
//
// Times are taken in each process on CLOCK_MONOTONIC (steady_clock), which
// all processes share; the workers report theirs as lines on stdout. A
// reference counts as let go when its holder starts to release it: the
// release call may return a few milliseconds after the daemon has it.
//
//   modelcache_serve_starvation_bench [--runs N] [--hold-ms H]
//       [--load-ms L] [--b-after-ms T] [--timeout-ms D]
//       [--drain-after 0,50ms,500ms,default,inf] [--verbose]
//
// --verbose writes each run's figures on stderr ("run: ...").
//
// Not a test: nothing here asserts a time. The figures go to
// docs/benchmarks.md with the command that produced them.
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/core/budget.h"
#include "modelcache/serve/client.h"
#include "serve_bench_util.h"

namespace {

using modelcache_bench::Child;
using modelcache_bench::Die;
using Clock = std::chrono::steady_clock;
using Ms = std::chrono::duration<double, std::milli>;

constexpr uint64_t kModelBytes = uint64_t{4} << 20;
constexpr uint64_t kCapacity = uint64_t{6} << 20;
constexpr int kAWorkers = 3;

struct Settings {
  int runs = 5;
  double hold_ms = 20;
  double load_ms = 10;
  double b_after_ms = 200;
  double timeout_ms = 5000;
  bool verbose = false;  // each run's figures on stderr
  std::vector<std::string> drain_afters = {"0", "50ms", "500ms", "default",
                                           "inf"};
};

int64_t NowNs() { return Clock::now().time_since_epoch().count(); }

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

void SleepMs(double ms) { std::this_thread::sleep_for(Ms(ms)); }

std::chrono::milliseconds Millis(double ms) {
  return std::chrono::milliseconds(std::llround(ms));
}

// One line on stdout in one write, so that it reaches the bench whole.
void Say(const std::string& line) {
  const std::string text = line + "\n";
  if (::write(1, text.data(), text.size()) !=
      static_cast<ssize_t>(text.size())) {
    std::exit(3);
  }
}

// Blocks until the bench writes a byte on stdin ("go"); false if it closed
// stdin instead.
bool AwaitGo() {
  char c;
  return ::read(0, &c, 1) == 1;
}

bool StdinClosed() {
  pollfd p{0, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

// ---- the workers (this binary, re-run) ----

volatile uint64_t g_sink = 0;  // what the workers read of their weights

// worker a SOCKET HOLD_MS TIMEOUT_MS STAGGER_MS: after "go" and the
// stagger, acquires A, says "a NS" (when it was served), holds it, releases
// it, says "r SERVED_NS ENDING_NS RELEASED_NS PID LEASE LOAD" (when the
// reference's end began, and when it returned: a lease the daemon recalled
// is released by then; the lease's id and how it was found, "local" or the
// daemon's word), and asks again, until stdin closes. A failed acquire says
// "e WHAT".
int WorkerA(const std::string& socket, double hold_ms, double timeout_ms,
            double stagger_ms) {
  auto client = modelcache::serve::Client::Connect(socket);
  client.Ping();
  Say("ready");
  if (!AwaitGo()) return 0;
  SleepMs(stagger_ms);  // the leases overlap
  while (!StdinClosed()) {
    try {
      int64_t served;
      int64_t ending;  // the reference's end begins
      std::string how;
      {
        modelcache::serve::RemoteWeights a =
            client.Acquire("A", Millis(timeout_ms * 2));
        served = NowNs();
        Say("a " + std::to_string(served));
        SleepMs(hold_ms);  // the request's service time
        // Use the weights: a copy unmapped under this reference faults.
        for (const auto& t : a.tensors()) {
          if (!t.data.empty())
            g_sink = g_sink + static_cast<uint8_t>(t.data[0]);
        }
        how = std::to_string(a.lease()) + " " + a.load();
        ending = NowNs();
      }
      Say("r " + std::to_string(served) + " " + std::to_string(ending) + " " +
          std::to_string(NowNs()) + " " + std::to_string(::getpid()) + " " +
          how);
    } catch (const std::exception& e) {
      Say(std::string("e ") + e.what());
    }
  }
  return 0;
}

// worker b SOCKET HOLD_MS TIMEOUT_MS: after "go", acquires B and says
// "b ASKED_NS SERVED_NS" or "f ASKED_NS FAILED_NS WHAT", holds it,
// releases it, says "x RELEASED_NS", and waits for stdin to close.
int WorkerB(const std::string& socket, double hold_ms, double timeout_ms) {
  auto client = modelcache::serve::Client::Connect(socket);
  client.Ping();
  Say("ready");
  if (!AwaitGo()) return 0;
  const int64_t asked = NowNs();
  try {
    {
      modelcache::serve::RemoteWeights b =
          client.Acquire("B", Millis(timeout_ms));
      Say("b " + std::to_string(asked) + " " + std::to_string(NowNs()));
      SleepMs(hold_ms);
    }
    Say("x " + std::to_string(NowNs()));
  } catch (const std::exception& e) {
    Say("f " + std::to_string(asked) + " " + std::to_string(NowNs()) + " " +
        e.what());
  }
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}

// What a --drain-after value means in milliseconds: nullopt for never;
// "default" is its floor (B was never loaded on a fresh daemon).
std::optional<double> DrainAfterMs(const std::string& text) {
  if (text == "inf" || text == "never") return std::nullopt;
  if (text == "default") {
    return Ms(modelcache::DefaultDrainAfter(std::chrono::nanoseconds(0)))
        .count();
  }
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  const std::string unit = end;
  if (unit == "ms" || (unit.empty() && v == 0)) return v;
  if (unit == "us") return v / 1000;
  if (unit == "s") return v * 1000;
  if (unit == "min") return v * 60'000;
  Die("--drain-after: cannot read " + text);
}

// ---- one run ----

struct RunResult {
  std::optional<double> b_wait_ms;  // empty: B was not served
  std::string b_error;
  uint64_t a_served_while_waiting = 0;
  std::optional<double> a_again_ms;  // from B served to A served again
  // When the holder of the last reference to A that ended before B was
  // served let go of it (the room came free soon after), after the drain
  // was due (B asked + drain_after): at most the longest lease out, per
  // docs/serve.md.
  std::optional<double> last_a_after_due_ms;
  // From then to B served: B's load and the messages around it.
  std::optional<double> room_to_b_ms;
  std::optional<double> b_load_ms;  // the daemon's last_load_seconds of B
  // For --verbose: how long B's process held B, and A's load after it.
  std::optional<double> b_held_ms;
  std::optional<double> a_load_ms;
  std::string detail;
  // The bound with what this run measured: drain_after + the longest
  // reference to A that ended while B waited + B's load (the daemon's).
  std::optional<double> measured_bound_ms;
  uint64_t a_errors = 0;
  uint64_t drains = 0;
};

uint64_t Drains(const std::string& admin_socket) {
  std::string metrics;
  if (modelcache_bench::AdminHttp(admin_socket, "GET", "/metrics", "",
                                  &metrics) != 200) {
    Die("cannot read the daemon's /metrics");
  }
  std::istringstream in(metrics);
  std::string line;
  const std::string name = "modelcache_drains_total ";
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) == 0) {
      return std::strtoull(line.c_str() + name.size(), nullptr, 10);
    }
  }
  Die("no modelcache_drains_total in /metrics");
}

// The daemon's time for the model's last load.
std::optional<double> LastLoadMs(const std::string& admin_socket,
                                 const std::string& model_id) {
  std::string body;
  if (modelcache_bench::AdminHttp(admin_socket, "GET", "/v1/models/" + model_id,
                                  "", &body) != 200) {
    Die("cannot read /v1/models/" + model_id);
  }
  const nlohmann::json model = nlohmann::json::parse(body);
  if (!model.contains("last_load_seconds") ||
      !model["last_load_seconds"].is_number()) {
    return std::nullopt;
  }
  return model["last_load_seconds"].get<double>() * 1000;
}

RunResult RunOnce(const Settings& s, const modelcache_bench::Setup& setup,
                  const std::string& drain_after) {
  const std::optional<double> drain_after_ms = DrainAfterMs(drain_after);
  std::vector<std::string> flags = {"--throttle-load-latency",
                                    Number(s.load_ms) + "ms"};
  if (drain_after != "default") {
    flags.push_back("--drain-after");
    flags.push_back(drain_after);
  }
  auto daemon = modelcache_bench::StartDaemon(setup, kCapacity, flags,
                                              /*admin_socket=*/true);
  const std::string self = modelcache_bench::Self();
  std::vector<std::unique_ptr<Child>> a_workers;
  for (int i = 0; i < kAWorkers; ++i) {
    a_workers.push_back(std::make_unique<Child>(
        std::vector<std::string>{self, "worker", "a", setup.socket,
                                 Number(s.hold_ms), Number(s.timeout_ms),
                                 Number(s.hold_ms * i / kAWorkers)},
        -1, -1, /*pipes=*/true));
  }
  Child b_worker({self, "worker", "b", setup.socket, Number(s.hold_ms),
                  Number(s.timeout_ms)},
                 -1, -1, /*pipes=*/true);
  std::vector<Child*> children;
  for (auto& a : a_workers) children.push_back(a.get());
  children.push_back(&b_worker);
  for (Child* c : children) {
    if (c->ReadLine() != "ready") Die("a worker did not start");
  }

  RunResult result;
  std::vector<int64_t> a_served;
  struct Reference {
    int64_t served;
    int64_t ending;
    int64_t released;
    std::string rest;  // pid, lease, load
  };
  std::vector<Reference> a_references;
  std::optional<int64_t> b_asked;
  std::optional<int64_t> b_served;  // or failed
  bool b_failed = false;
  std::optional<int64_t> b_released;
  const auto on_line = [&](const std::string& line) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "a") {
      int64_t at;
      in >> at;
      a_served.push_back(at);
    } else if (kind == "r") {
      Reference r;
      in >> r.served >> r.ending >> r.released;
      std::getline(in, r.rest);
      a_references.push_back(r);
    } else if (kind == "e") {
      ++result.a_errors;
    } else if (kind == "x") {
      int64_t at;
      in >> at;
      b_released = at;
    } else if (kind == "b" || kind == "f") {
      int64_t asked, at;
      in >> asked >> at;
      b_asked = asked;
      b_served = at;
      b_failed = kind == "f";
      if (b_failed) {
        std::getline(in, result.b_error);
        if (!result.b_error.empty()) result.b_error.erase(0, 1);
      }
    } else {
      Die("a worker said: " + line);
    }
  };
  modelcache_bench::Lines lines(children);
  for (auto& a : a_workers) a->Send("g");
  const auto go = Clock::now();
  // A's traffic settles; B comes at --b-after-ms.
  while (Clock::now() - go < Ms(s.b_after_ms)) {
    const double left = s.b_after_ms - Ms(Clock::now() - go).count();
    lines.Poll(std::max(1, static_cast<int>(left)), on_line);
  }
  b_worker.Send("g");
  const auto b_sent = Clock::now();
  std::optional<Clock::time_point> b_answered;
  // Until B's answer, then until A is served again (or --timeout-ms).
  for (;;) {
    lines.Poll(10, on_line);
    if (b_served && !b_answered) b_answered = Clock::now();
    if (b_failed) break;
    if (b_released && std::any_of(a_served.begin(), a_served.end(),
                                  [&](int64_t at) { return at > *b_served; })) {
      break;
    }
    if (b_answered && Clock::now() - *b_answered > Ms(s.timeout_ms)) break;
    if (!b_answered && Clock::now() - b_sent > Ms(s.timeout_ms * 3)) {
      Die("B's process did not answer");
    }
  }
  result.drains = Drains(setup.socket + ".admin");

  for (const int64_t at : a_served) {
    if (at >= *b_asked && at < *b_served) ++result.a_served_while_waiting;
  }
  if (!b_failed) {
    result.b_wait_ms = static_cast<double>(*b_served - *b_asked) / 1e6;
    std::optional<int64_t> again;
    for (const int64_t at : a_served) {
      if (at > *b_served && (!again || at < *again)) again = at;
    }
    if (again) {
      result.a_again_ms = static_cast<double>(*again - *b_served) / 1e6;
    }
    result.b_load_ms = LastLoadMs(setup.socket + ".admin", "B");
    result.a_load_ms = LastLoadMs(setup.socket + ".admin", "A");
    if (b_released) {
      result.b_held_ms = static_cast<double>(*b_released - *b_served) / 1e6;
    }
    if (drain_after_ms) {
      const double due = static_cast<double>(*b_asked) + *drain_after_ms * 1e6;
      std::optional<int64_t> last;
      int64_t longest = 0;
      // A reference's end is when its holder let go of it (its release
      // reaches the daemon soon after; the call may return later).
      for (const Reference& r : a_references) {
        if (r.ending >= *b_served) continue;
        if (!last || r.ending > *last) last = r.ending;
        if (static_cast<double>(r.ending) > due) {
          longest = std::max(longest, r.ending - r.served);
        }
      }
      if (last) {
        result.last_a_after_due_ms = (static_cast<double>(*last) - due) / 1e6;
        result.room_to_b_ms = static_cast<double>(*b_served - *last) / 1e6;
      }
      // For --verbose: the references to A out in the 40 ms before B was
      // served, relative to the drain's due time.
      for (const Reference& r : a_references) {
        if (r.released < *b_served - 40'000'000 || r.served > *b_served) {
          continue;
        }
        char buf[200];
        std::snprintf(buf, sizeof(buf),
                      "\n    A reference %+.2f .. %+.2f (released %+.2f) ms "
                      "(pid, lease, load:%s)",
                      (static_cast<double>(r.served) - due) / 1e6,
                      (static_cast<double>(r.ending) - due) / 1e6,
                      (static_cast<double>(r.released) - due) / 1e6,
                      r.rest.c_str());
        result.detail += buf;
      }
      char buf[96];
      std::snprintf(buf, sizeof(buf),
                    "\n    B's load began %+.2f ms, B served %+.2f ms",
                    (static_cast<double>(*b_served) - due) / 1e6 -
                        result.b_load_ms.value_or(0),
                    (static_cast<double>(*b_served) - due) / 1e6);
      result.detail += buf;
      result.measured_bound_ms = *drain_after_ms +
                                 static_cast<double>(longest) / 1e6 +
                                 result.b_load_ms.value_or(0);
    }
  }
  for (Child* c : children) c->Finish();
  daemon->Stop(SIGTERM);
  return result;
}

// ---- the table ----

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string Name(const std::string& drain_after) {
  if (drain_after != "default") return drain_after;
  char buf[48];
  std::snprintf(buf, sizeof(buf), "default (%gs)",
                *DrainAfterMs("default") / 1000);
  return buf;
}

// One row of a Markdown table.
void PrintRow(const std::vector<std::string>& cells) {
  std::string row = "|";
  for (const std::string& cell : cells) row += " " + cell + " |";
  std::printf("%s\n", row.c_str());
}

[[noreturn]] void Usage() {
  std::fprintf(stderr,
               "usage: modelcache_serve_starvation_bench [--runs N] "
               "[--hold-ms H] [--load-ms L] [--b-after-ms T] "
               "[--timeout-ms D] [--drain-after 0,50ms,default,inf] "
               "[--verbose]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const auto number = [](const char* text) {
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (*end != '\0' || !(v >= 0)) Usage();
    return v;
  };
  if (argc == 7 && !std::strcmp(argv[1], "worker") &&
      !std::strcmp(argv[2], "a")) {
    return WorkerA(argv[3], number(argv[4]), number(argv[5]), number(argv[6]));
  }
  if (argc == 6 && !std::strcmp(argv[1], "worker") &&
      !std::strcmp(argv[2], "b")) {
    return WorkerB(argv[3], number(argv[4]), number(argv[5]));
  }
  Settings s;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--verbose")) {
      s.verbose = true;
      continue;
    }
    if (i + 1 >= argc) Usage();
    const char* flag = argv[i];
    const char* value = argv[++i];
    if (!std::strcmp(flag, "--runs")) {
      s.runs = std::max(1, static_cast<int>(number(value)));
    } else if (!std::strcmp(flag, "--hold-ms")) {
      s.hold_ms = number(value);
    } else if (!std::strcmp(flag, "--load-ms")) {
      s.load_ms = number(value);
    } else if (!std::strcmp(flag, "--b-after-ms")) {
      s.b_after_ms = number(value);
    } else if (!std::strcmp(flag, "--timeout-ms")) {
      s.timeout_ms = number(value);
    } else if (!std::strcmp(flag, "--drain-after")) {
      s.drain_afters.clear();
      std::istringstream in(value);
      std::string d;
      while (std::getline(in, d, ',')) {
        DrainAfterMs(d);  // dies on what it cannot read
        s.drain_afters.push_back(d);
      }
    } else {
      Usage();
    }
  }
  ::signal(SIGPIPE, SIG_IGN);

  modelcache_bench::Setup setup(1);  // its "model" is not used
  modelcache_bench::WriteModel(setup.root + "/a.safetensors", kModelBytes, 1);
  modelcache_bench::WriteModel(setup.root + "/b.safetensors", kModelBytes, 2);
  std::ofstream(setup.catalog)
      << nlohmann::json{{"models",
                         {{{"id", "A"}, {"files", {"a.safetensors"}}},
                          {{"id", "B"}, {"files", {"b.safetensors"}}}}}}
             .dump();

  std::printf(
      "modelcache serve --host-capacity 6MiB, models A and B of 4 MiB; A in "
      "use by %d processes (hold %g ms, overlapping); B asked at %g ms; "
      "loads %g ms; %d runs each; timeout %g ms\n\n",
      kAWorkers, s.hold_ms, s.b_after_ms, s.load_ms, s.runs, s.timeout_ms);
  const std::vector<std::string> columns = {
      "--drain-after",
      "B served",
      "B wait median",
      "B wait max",
      "bound",
      "within bound",
      "measured bound (median / max)",
      "B wait - measured bound (max)",
      "last reference to A let go, after the drain was due (median / max)",
      "from then to B served (median / max)",
      "B's load, the daemon's (median)",
      "A served while B waited (median)",
      "A served again after B (median)",
      "drains"};
  PrintRow(columns);
  PrintRow(std::vector<std::string>(columns.size(), "---"));
  std::fflush(stdout);
  std::vector<std::string> notes;
  for (const std::string& drain_after : s.drain_afters) {
    std::vector<double> waits, a_while, a_again, lease, room, load;
    std::vector<double> measured_bounds;
    int served = 0;
    std::vector<double> over;  // B's wait past the measured bound
    uint64_t drains = 0;
    uint64_t a_errors = 0;
    std::string b_error;
    for (int run = 0; run < s.runs; ++run) {
      const RunResult r = RunOnce(s, setup, drain_after);
      if (s.verbose) {
        const auto f = [](const std::optional<double>& v) {
          return v ? Number(*v) : std::string("-");
        };
        std::fprintf(stderr,
                     "run: --drain-after %s #%d: B wait %s ms, measured "
                     "bound %s, last A reference let go %s after due, then B "
                     "served %s later, B load %s, A served meanwhile %llu, "
                     "again %s later (B held %s, A's load %s)\n",
                     drain_after.c_str(), run, f(r.b_wait_ms).c_str(),
                     f(r.measured_bound_ms).c_str(),
                     f(r.last_a_after_due_ms).c_str(),
                     f(r.room_to_b_ms).c_str(), f(r.b_load_ms).c_str(),
                     static_cast<unsigned long long>(r.a_served_while_waiting),
                     f(r.a_again_ms).c_str(), f(r.b_held_ms).c_str(),
                     f(r.a_load_ms).c_str());
        if (r.room_to_b_ms && r.b_load_ms && *r.room_to_b_ms < *r.b_load_ms) {
          std::fprintf(stderr,
                       "  B's load began before the last reference "
                       "to A was let go (a copy freed under a reference?):%s\n",
                       r.detail.c_str());
        }
      }
      a_while.push_back(static_cast<double>(r.a_served_while_waiting));
      drains += r.drains;
      a_errors += r.a_errors;
      if (!r.b_wait_ms) {
        if (b_error.empty()) b_error = r.b_error;
        continue;
      }
      ++served;
      waits.push_back(*r.b_wait_ms);
      if (r.a_again_ms) a_again.push_back(*r.a_again_ms);
      if (r.last_a_after_due_ms) lease.push_back(*r.last_a_after_due_ms);
      if (r.room_to_b_ms) room.push_back(*r.room_to_b_ms);
      if (r.b_load_ms) load.push_back(*r.b_load_ms);
      if (r.measured_bound_ms) {
        measured_bounds.push_back(*r.measured_bound_ms);
        over.push_back(*r.b_wait_ms - *r.measured_bound_ms);
      }
    }
    const std::optional<double> after = DrainAfterMs(drain_after);
    const std::optional<double> bound =
        after ? std::optional<double>(*after + s.hold_ms + s.load_ms)
              : std::nullopt;
    const auto ms = [](const std::vector<double>& v, bool max) {
      if (v.empty()) return std::string("-");
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.1f ms",
                    max ? *std::max_element(v.begin(), v.end()) : Median(v));
      return std::string(buf);
    };
    // "median / max"
    const auto both = [](const std::vector<double>& v) {
      if (v.empty()) return std::string("-");
      char buf[48];
      std::snprintf(buf, sizeof(buf), "%.1f / %.1f ms", Median(v),
                    *std::max_element(v.begin(), v.end()));
      return std::string(buf);
    };
    std::string bound_text = "none";
    std::string within = "-";
    if (bound) {
      bound_text = std::to_string(std::lround(*bound)) + " ms";
      const auto in = std::count_if(waits.begin(), waits.end(),
                                    [&](double w) { return w <= *bound; });
      within = std::to_string(in) + "/" + std::to_string(s.runs);
    }
    char a_while_text[32];
    std::snprintf(a_while_text, sizeof(a_while_text), "%.0f", Median(a_while));
    PrintRow({Name(drain_after),
              std::to_string(served) + "/" + std::to_string(s.runs),
              ms(waits, false), ms(waits, true), bound_text, within,
              both(measured_bounds), ms(over, true), both(lease), both(room),
              ms(load, false), a_while_text, ms(a_again, false),
              std::to_string(drains)});
    std::fflush(stdout);
    if (!b_error.empty()) {
      notes.push_back(drain_after + ": B's acquire failed: " + b_error);
    }
    if (a_errors > 0) {
      notes.push_back(drain_after + ": " + std::to_string(a_errors) +
                      " acquires of A failed");
    }
  }
  if (!notes.empty()) std::printf("\n");
  for (const std::string& note : notes) std::printf("%s\n", note.c_str());
  return 0;
}
