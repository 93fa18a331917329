// Plays a trace live, in real time, against a real system, and replays it
// through the replay's simulation with the same time model, so that a test
// can check the prediction against what happened (docs/benchmarks.md,
// "Replay against live runs").
//
// The time model both sides share: every load takes `load_ms` (the live
// loader sleeps that long: it is the workload's load time, not
// synchronisation), loads do not share a link and are not limited in number
// (TimeModel{infinite bandwidth, load_ms, unlimited slots}), and each request
// holds its lease for its service time (the trace's, else `hold_ms`).
//
// Requests are released at their trace times by one dispatcher onto a pool
// of threads (kPrestartedThreads made before the first request) that grows
// whenever none is idle, so that no request waits for a thread. A request's
// wait is from the moment it asks the target to the moment it holds a lease, as
// the replay counts it from its arrival.
//
// What is compared: the live run against the replay of the trace *as it was
// played*: each request at the time it asked (to the millisecond), holding
// its lease as long as it did, every load taking the loads' measured mean.
// On a busy machine a thread wakes late now and then, by milliseconds or
// tens of them, and a late request changes the workload itself (a gap in a
// model's traffic lets a waiter in); the replay is a model of the cache, not
// of the scheduler, so it is given the workload that happened. A test can
// report the replay of the trace as planned (Predict of the Workload)
// beside it.
//
// The live side is a LiveTarget: the library (LibraryTarget: one ModelCache,
// requests on threads) here, the daemon (DaemonTarget in
// live_daemon_test.cc: `modelcache serve` as a process, one protocol
// connection per request in flight) there. The workloads both play and the
// check of agreement (ExpectAgreement) are at the end of this file.
#ifndef MODELCACHE_TESTS_REPLAY_LIVE_HARNESS_H_
#define MODELCACHE_TESTS_REPLAY_LIVE_HARNESS_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay::live {

struct Workload {
  Trace trace;
  double hold_ms = 0;  // for requests the trace gives no service time
  double load_ms = 0;  // every load
  uint64_t capacity = 0;
  std::optional<double> drain_after_ms;  // empty: the library's default
};

// What a run measured (live) or predicted (replay).
struct Outcome {
  uint64_t requests = 0;
  uint64_t served = 0;
  uint64_t loads = 0;
  uint64_t bytes_loaded = 0;
  uint64_t drains = 0;
  double p99_ms = 0;
  double max_ms = 0;
  double seconds = 0;  // wall time of a live run
  double load_ms = 0;  // mean time a load took (live)
};

// A live run: what it measured, the trace as it was played, and how late
// the requests asked against the plan.
struct Played {
  Outcome live;
  Workload as_played;
  double max_late_ms = 0;  // the latest request's delay against its due time
  double p99_late_ms = 0;
};

inline constexpr int kPrestartedThreads = 16;

// One system a trace is played against.
class LiveTarget {
 public:
  virtual ~LiveTarget() = default;
  // Holds a lease on `model` until the returned handle is destroyed. Blocks
  // while the request waits (for a load, for room, behind a drain). Called
  // from many threads at once; throws when the request is refused.
  virtual std::shared_ptr<void> Acquire(const std::string& model,
                                        uint64_t bytes) = 0;
  // Loads, bytes loaded and drains since the target was made.
  virtual Outcome Totals() = 0;
};

// The library: one ModelCache with its own budget (shard_bits 0, LRU, the
// replay's order), requests waiting for room up to a deadline far beyond
// the run.
class LibraryTarget : public LiveTarget {
 public:
  explicit LibraryTarget(const Workload& w) : load_ms_(w.load_ms) {
    CacheOptions options;
    options.name = "live";
    options.capacity_bytes = w.capacity;
    options.shard_bits = 0;
    if (w.drain_after_ms) {
      options.drain_after =
          std::isinf(*w.drain_after_ms)
              ? kDrainNever
              : std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::duration<double, std::milli>(
                        *w.drain_after_ms));
    }
    cache_.emplace(std::move(options));
  }
  std::shared_ptr<void> Acquire(const std::string& model,
                                uint64_t bytes) override {
    AcquireOptions options;
    options.when_full = WhenFull::kWait;
    options.deadline = Clock::now() + std::chrono::seconds(60);
    const double load_ms = load_ms_;
    Lease lease = cache_->Acquire(
        model, bytes,
        [bytes, load_ms] {
          std::this_thread::sleep_for(
              std::chrono::duration<double, std::milli>(load_ms));
          return Loaded{std::make_shared<int>(0), bytes};
        },
        options);
    return std::make_shared<Lease>(std::move(lease));
  }
  Outcome Totals() override {
    const CacheStats stats = cache_->Stats();
    Outcome out;
    out.loads = stats.loads;
    out.bytes_loaded = stats.bytes_loaded;
    out.drains = cache_->budget().drains();
    out.load_ms =
        stats.loads == 0 ? 0 : stats.load_seconds * 1000.0 / stats.loads;
    return out;
  }

 private:
  const double load_ms_;
  std::optional<ModelCache> cache_;
};

// Plays `w.trace` against `target` in real time.
inline Played PlayLive(const Workload& w, LiveTarget& target) {
  using Steady = std::chrono::steady_clock;
  auto ms = [](Steady::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  const Trace& trace = w.trace;
  const size_t n = trace.requests.size();
  // Per request: when it asked, got its lease and let it go; -1 if refused.
  std::vector<double> asked(n, -1), leased(n, -1), released(n, -1);

  std::mutex mu;
  std::condition_variable cv;
  std::deque<size_t> queue;  // requests due, not yet taken by a thread
  size_t idle = 0;
  bool done = false;
  const Steady::time_point start =
      Steady::now() + std::chrono::milliseconds(20);

  auto serve = [&](size_t i) {
    const Request& r = trace.requests[i];
    const double hold =
        trace.hold_ms.empty() ? w.hold_ms : double{trace.hold_ms[i]};
    asked[i] = ms(Steady::now() - start);
    try {
      std::shared_ptr<void> lease =
          target.Acquire(trace.models[r.model], trace.sizes[r.model]);
      leased[i] = ms(Steady::now() - start);
      // The service time: the request holds its lease this long.
      std::this_thread::sleep_for(
          std::chrono::duration<double, std::milli>(hold));
      lease.reset();
      released[i] = ms(Steady::now() - start);
    } catch (const Error&) {
      leased[i] = -1;  // refused or timed out: not served
    }
  };
  auto worker = [&] {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      ++idle;
      cv.wait(lock, [&] { return done || !queue.empty(); });
      --idle;
      if (queue.empty()) return;  // done
      const size_t i = queue.front();
      queue.pop_front();
      lock.unlock();
      serve(i);
      lock.lock();
    }
  };

  // Threads made before the first request, so that making one is rarely on
  // a request's path.
  std::vector<std::thread> threads;
  for (int t = 0; t < kPrestartedThreads; ++t) threads.emplace_back(worker);
  for (size_t i = 0; i < n; ++i) {
    // The trace's clock paces the requests: this is the workload.
    std::this_thread::sleep_until(
        start + std::chrono::milliseconds(trace.requests[i].t_ms -
                                          trace.requests[0].t_ms));
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(i);
    if (idle < queue.size()) {
      threads.emplace_back(worker);
    } else {
      cv.notify_one();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();

  Played played;
  Outcome& out = played.live;
  out = target.Totals();
  out.seconds = ms(Steady::now() - start) / 1000.0;
  out.requests = n;
  std::vector<double> waits, late;
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i) {
    late.push_back(asked[i] - static_cast<double>(trace.requests[i].t_ms -
                                                  trace.requests[0].t_ms));
    order.push_back(i);
    if (leased[i] >= 0) waits.push_back(leased[i] - asked[i]);
  }
  std::sort(waits.begin(), waits.end());
  std::sort(late.begin(), late.end());
  played.max_late_ms = late.empty() ? 0 : late.back();
  played.p99_late_ms = Percentile(late, 0.99);
  out.served = waits.size();
  out.p99_ms = Percentile(waits, 0.99);
  out.max_ms = waits.empty() ? 0 : waits.back();

  // The trace as played: arrivals to the millisecond, in the order asked,
  // with the holds that happened.
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return asked[a] < asked[b]; });
  Workload& p = played.as_played;
  p = w;
  p.trace.requests.clear();
  p.trace.hold_ms.clear();
  for (size_t i : order) {
    p.trace.requests.push_back(
        Request{std::llround(asked[i]), trace.requests[i].model});
    p.trace.hold_ms.push_back(
        leased[i] >= 0 ? static_cast<float>(released[i] - leased[i]) : 0.0f);
  }
  for (size_t k = 1; k < p.trace.requests.size(); ++k) {
    // Rounding keeps the order: never earlier than the one before.
    p.trace.requests[k].t_ms =
        std::max(p.trace.requests[k].t_ms, p.trace.requests[k - 1].t_ms);
  }
  if (out.load_ms > 0) p.load_ms = out.load_ms;
  return played;
}

// The replay of `w` with the same time model.
inline Outcome Predict(const Workload& w) {
  SimulateOptions options;
  options.time = TimeModel{std::numeric_limits<double>::infinity(), w.load_ms,
                           /*slots=*/0};
  options.hold_ms = w.hold_ms;
  options.drain_after_ms = w.drain_after_ms;
  const RunResult r = Simulate(w.trace, "lru", w.capacity, options);
  Outcome out;
  out.requests = r.requests;
  out.served = r.requests - r.rejected - r.too_large;
  for (uint32_t l : r.loads_per_model) out.loads += l;
  out.bytes_loaded = r.bytes_loaded;
  out.drains = r.drains;
  out.p99_ms = r.wait_ms.p99;
  out.max_ms = r.wait_ms.max;
  return out;
}

// ---- the workloads and the check, for every target ----

// The starvation scenario of the issue, shortened to 3 s: room for one
// model, A every 7 ms, each request holding its lease 20 ms (three
// overlap), one request for B at 200 ms; a load takes 110 ms.
inline Workload Starvation(std::optional<double> drain_after_ms) {
  Workload w;
  w.trace.models = {"A", "B"};
  w.trace.sizes = {1000, 1000};
  for (int64_t t = 0; t <= 3000; t += 7) {
    if (t > 200 && t - 7 < 200) w.trace.requests.push_back(Request{200, 1});
    w.trace.requests.push_back(Request{t, 0});
  }
  w.hold_ms = 20;
  w.load_ms = 110;
  w.capacity = 1000;
  w.drain_after_ms = drain_after_ms;
  return w;
}

// A Zipf mix with service times: 6 models, room for 3, model k asked for
// with weight 1/k, Poisson arrivals at 60 a second for 4 s (about 240
// requests), each request holding its lease an exponential time (mean 40
// ms); a load takes 60 ms. Seeded.
inline Workload ZipfMix(std::optional<double> drain_after_ms) {
  Workload w;
  constexpr int kModels = 6;
  for (int m = 0; m < kModels; ++m) {
    w.trace.models.push_back("m" + std::to_string(m));
    w.trace.sizes.push_back(1000);
  }
  std::mt19937_64 rng(20261205);
  std::exponential_distribution<double> gap(60.0 / 1000);  // per ms
  std::exponential_distribution<double> hold(1.0 / 40);
  std::vector<double> weights;
  for (int m = 0; m < kModels; ++m) weights.push_back(1.0 / (m + 1));
  std::discrete_distribution<uint32_t> pick(weights.begin(), weights.end());
  double t = 0;
  for (;;) {
    t += gap(rng);
    if (t > 4000) break;
    w.trace.requests.push_back(Request{static_cast<int64_t>(t), pick(rng)});
    w.trace.hold_ms.push_back(static_cast<float>(hold(rng)));
  }
  w.load_ms = 60;
  w.capacity = 3000;
  w.drain_after_ms = drain_after_ms;
  return w;
}

// The bounds are the cluster check's (examples/cluster/cluster.py): loads
// (and bytes loaded) within 10%, p99 wait within 25%.
//
// The p99 bound is 25% of the prediction plus a slack for the scheduler,
// measured in the same run. A live wait for room is a chain of threads
// waking: the holder's at its lease's end, the waiter's to evict and load,
// the loader's at the load's end (and, through the daemon, its event loop's
// and the client's at each message); the replay's waits have no such
// delays. The run measures how late a sleeping thread wakes (each request's
// delay against its due time, as the dispatcher and a worker hand it on)
// and allows kHandOffs times its p99, at least kSlackMs. On a quiet machine
// that is small, so the bound is close to the cluster check's 25%
// (kSlackMs decides only a p99 of a few milliseconds, which these cases do
// not have); on a machine whose cores are busy with other work it widens by
// what the run measured, which the failure message names.
inline constexpr double kSlackMs = 5;
inline constexpr double kHandOffs = 3;

inline std::string DrainText(const std::optional<double>& drain_after_ms) {
  if (!drain_after_ms) return "default";
  if (std::isinf(*drain_after_ms)) return "inf";
  return std::to_string(static_cast<int>(*drain_after_ms)) + " ms";
}

// Plays `w` live against `target` (made for `w`; `system` names it) and
// replays the trace as played; checks that they agree, and prints the row
// of docs/benchmarks.md's table, with the replay of the trace as planned
// beside it and the loads' measured mean time.
inline void ExpectAgreement(const std::string& name, const std::string& system,
                            const Workload& w, LiveTarget& target) {
  const Outcome planned = Predict(w);
  const Played played = PlayLive(w, target);
  const Outcome& live = played.live;
  const Outcome predicted = Predict(played.as_played);
  auto u = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf(
      "| %s | %s | %s | %llu / %llu (%llu) | %.0f / %.0f (%.0f) | "
      "%.0f / %.0f (%.0f) | %llu / %llu (%llu) | %.1f / %.1f | %.1f ms | "
      "%.1f s |\n",
      name.c_str(), system.c_str(), DrainText(w.drain_after_ms).c_str(),
      u(live.loads), u(predicted.loads), u(planned.loads), live.p99_ms,
      predicted.p99_ms, planned.p99_ms, live.max_ms, predicted.max_ms,
      planned.max_ms, u(live.drains), u(predicted.drains), u(planned.drains),
      played.p99_late_ms, played.max_late_ms, live.load_ms, live.seconds);
  std::fflush(stdout);
  EXPECT_EQ(live.served, live.requests) << "a live request was refused";
  EXPECT_EQ(predicted.served, predicted.requests);
  EXPECT_LE(std::abs(static_cast<double>(live.loads) -
                     static_cast<double>(predicted.loads)),
            0.10 * static_cast<double>(predicted.loads))
      << "loads: live " << live.loads << ", replay " << predicted.loads;
  EXPECT_LE(std::abs(static_cast<double>(live.bytes_loaded) -
                     static_cast<double>(predicted.bytes_loaded)),
            0.10 * static_cast<double>(predicted.bytes_loaded))
      << "bytes loaded: live " << live.bytes_loaded << ", replay "
      << predicted.bytes_loaded;
  const double slack = std::max(kSlackMs, kHandOffs * played.p99_late_ms);
  EXPECT_LE(std::abs(live.p99_ms - predicted.p99_ms),
            0.25 * predicted.p99_ms + slack)
      << "p99 wait: live " << live.p99_ms << " ms, replay " << predicted.p99_ms
      << " ms, scheduling slack " << slack << " ms";
}

}  // namespace modelcache::replay::live

#endif  // MODELCACHE_TESTS_REPLAY_LIVE_HARNESS_H_
