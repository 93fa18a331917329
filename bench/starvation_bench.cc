// The starvation scenario of swap scheduling, through the library: how long
// a request that needs room waits while the model holding that room is in
// continuous use, for several drain_after values.
//
// A cache with room for one model. Three threads keep model A in use: each
// acquires A, holds its lease --hold-ms, releases it and asks again, their
// starts staggered so that the leases overlap and A is never idle. After
// --b-after-ms a fourth thread asks for B (WhenFull::kWait, a deadline of
// --timeout-ms). Loads take --load-ms (the loader sleeps: that is the
// workload's load time). Per drain_after, --runs runs; the table gives the
// median and the largest wait of B, the bound the header promises
// (drain_after + the longest lease out when the drain began + B's load),
// how many A requests were served while B waited, and how long after B was
// served A's traffic was served again (A reloads once B's lease ends).
//
//   modelcache_starvation_bench [--runs N] [--hold-ms H] [--load-ms L]
//       [--b-after-ms T] [--timeout-ms D]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/core/cache.h"

namespace {

using Ms = std::chrono::duration<double, std::milli>;
using modelcache::Clock;

constexpr uint64_t kModelBytes = uint64_t{1} << 20;
constexpr int kAThreads = 3;

struct Settings {
  int runs = 5;
  double hold_ms = 20;
  double load_ms = 10;
  double b_after_ms = 200;
  double timeout_ms = 5000;
};

struct RunResult {
  std::optional<double> b_wait_ms;  // empty: B timed out
  uint64_t a_served_while_waiting = 0;
  std::optional<double> a_again_ms;  // from B served to A served again
  uint64_t drains = 0;
};

void SleepMs(double ms) { std::this_thread::sleep_for(Ms(ms)); }

modelcache::Loader SlowLoader(double load_ms) {
  return [load_ms] {
    SleepMs(load_ms);  // the workload's load time
    return modelcache::Loaded{std::make_shared<int>(0), kModelBytes};
  };
}

RunResult RunOnce(const Settings& s, std::chrono::nanoseconds drain_after) {
  modelcache::CacheOptions options;
  options.name = "starvation_bench";
  options.capacity_bytes = kModelBytes;
  options.drain_after = drain_after;
  modelcache::ModelCache cache(options);
  const modelcache::Loader loader = SlowLoader(s.load_ms);

  std::atomic<bool> stop{false};
  std::atomic<bool> b_waiting{false};
  std::atomic<uint64_t> a_served_while_waiting{0};
  std::atomic<int64_t> b_served_at_ns{-1};
  std::atomic<int64_t> a_again_at_ns{-1};
  const auto start = Clock::now();
  auto since_start_ns = [start] { return (Clock::now() - start).count(); };

  std::vector<std::thread> a_threads;
  for (int i = 0; i < kAThreads; ++i) {
    a_threads.emplace_back([&, i] {
      SleepMs(s.hold_ms * i / kAThreads);  // stagger: the leases overlap
      while (!stop.load()) {
        modelcache::AcquireOptions acquire;
        acquire.when_full = modelcache::WhenFull::kWait;
        acquire.deadline =
            Clock::now() +
            std::chrono::milliseconds(static_cast<int64_t>(s.timeout_ms) * 2);
        modelcache::Lease lease;
        try {
          lease = cache.Acquire("A", kModelBytes, loader, acquire);
        } catch (const modelcache::Error&) {
          continue;  // stop was set while it waited
        }
        if (b_waiting.load()) a_served_while_waiting.fetch_add(1);
        if (b_served_at_ns.load() >= 0 && a_again_at_ns.load() < 0) {
          int64_t unset = -1;
          a_again_at_ns.compare_exchange_strong(unset, since_start_ns());
        }
        SleepMs(s.hold_ms);  // the request's service time
      }
    });
  }

  RunResult result;
  SleepMs(s.b_after_ms);
  {
    modelcache::AcquireOptions acquire;
    acquire.when_full = modelcache::WhenFull::kWait;
    acquire.deadline = Clock::now() + std::chrono::milliseconds(
                                          static_cast<int64_t>(s.timeout_ms));
    const auto asked = Clock::now();
    b_waiting.store(true);
    try {
      modelcache::Lease b = cache.Acquire("B", kModelBytes, loader, acquire);
      b_waiting.store(false);
      result.b_wait_ms = Ms(Clock::now() - asked).count();
      b_served_at_ns.store(since_start_ns());
      SleepMs(s.hold_ms);
    } catch (const modelcache::Error&) {
      b_waiting.store(false);
      b_served_at_ns.store(since_start_ns());
    }
  }
  // Let A be served again (or give up after the timeout).
  const auto give_up = Clock::now() + Ms(s.timeout_ms);
  while (a_again_at_ns.load() < 0 && Clock::now() < give_up) SleepMs(1);
  stop.store(true);
  for (auto& t : a_threads) t.join();
  result.a_served_while_waiting = a_served_while_waiting.load();
  if (a_again_at_ns.load() >= 0 && result.b_wait_ms) {
    result.a_again_ms = (a_again_at_ns.load() - b_served_at_ns.load()) / 1e6;
  }
  result.drains = cache.budget().drains();
  return result;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The drain_after a waiter gets: the default's for B, a key this fresh
// cache never loaded, on a budget that has not drained yet.
std::chrono::nanoseconds Effective(std::chrono::nanoseconds d) {
  return d == modelcache::kDrainAfterAuto
             ? modelcache::DefaultDrainAfter(std::chrono::nanoseconds(0))
             : d;
}

std::string DrainAfterName(std::chrono::nanoseconds d) {
  if (d == modelcache::kDrainNever) return "inf";
  if (d == modelcache::kDrainAfterAuto) {
    return "default (" + DrainAfterName(Effective(d)) + ")";
  }
  const double ms = std::chrono::duration<double, std::milli>(d).count();
  char buf[32];
  if (ms >= 1000) {
    std::snprintf(buf, sizeof(buf), "%gs", ms / 1000);
  } else {
    std::snprintf(buf, sizeof(buf), "%gms", ms);
  }
  return buf;
}

[[noreturn]] void Usage() {
  std::fprintf(stderr,
               "usage: modelcache_starvation_bench [--runs N] [--hold-ms H] "
               "[--load-ms L] [--b-after-ms T] [--timeout-ms D]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    auto value = [&]() -> double {
      if (i + 1 >= argc) Usage();
      char* end = nullptr;
      const double v = std::strtod(argv[++i], &end);
      if (*end != '\0' || !(v >= 0)) Usage();
      return v;
    };
    if (!std::strcmp(argv[i], "--runs")) {
      s.runs = std::max(1, static_cast<int>(value()));
    } else if (!std::strcmp(argv[i], "--hold-ms")) {
      s.hold_ms = value();
    } else if (!std::strcmp(argv[i], "--load-ms")) {
      s.load_ms = value();
    } else if (!std::strcmp(argv[i], "--b-after-ms")) {
      s.b_after_ms = value();
    } else if (!std::strcmp(argv[i], "--timeout-ms")) {
      s.timeout_ms = value();
    } else {
      Usage();
    }
  }
  const std::vector<std::chrono::nanoseconds> drain_afters = {
      std::chrono::nanoseconds(0),    std::chrono::milliseconds(50),
      std::chrono::milliseconds(500), modelcache::kDefaultDrainAfter,
      modelcache::kDrainNever,
  };
  std::printf(
      "room for 1 model; A in use by %d threads (hold %g ms, overlapping); "
      "B asked at %g ms; loads %g ms; %d runs each; timeout %g ms\n\n",
      kAThreads, s.hold_ms, s.b_after_ms, s.load_ms, s.runs, s.timeout_ms);
  std::printf(
      "| drain_after | B served | B wait median | B wait max | bound | A "
      "served while B waited (median) | A served again after B (median) | "
      "drains |\n|---|---|---|---|---|---|---|---|\n");
  for (const auto drain_after : drain_afters) {
    std::vector<double> waits, a_while, a_again;
    int served = 0;
    uint64_t drains = 0;
    for (int run = 0; run < s.runs; ++run) {
      const RunResult r = RunOnce(s, drain_after);
      a_while.push_back(static_cast<double>(r.a_served_while_waiting));
      drains += r.drains;
      if (!r.b_wait_ms) continue;
      ++served;
      waits.push_back(*r.b_wait_ms);
      if (r.a_again_ms) a_again.push_back(*r.a_again_ms);
    }
    const std::string bound = drain_after == modelcache::kDrainNever
                                  ? "none"
                                  : std::to_string(static_cast<int>(std::lround(
                                        Ms(Effective(drain_after)).count() +
                                        s.hold_ms + s.load_ms))) +
                                        " ms";
    auto ms = [](const std::vector<double>& v, bool max) -> std::string {
      if (v.empty()) return "-";
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.1f ms",
                    max ? *std::max_element(v.begin(), v.end()) : Median(v));
      return buf;
    };
    std::printf("| %s | %d/%d | %s | %s | %s | %.0f | %s | %llu |\n",
                DrainAfterName(drain_after).c_str(), served, s.runs,
                ms(waits, false).c_str(), ms(waits, true).c_str(),
                bound.c_str(), Median(a_while), ms(a_again, false).c_str(),
                static_cast<unsigned long long>(drains));
    std::fflush(stdout);
  }
  return 0;
}
