// The replay's prediction of swap scheduling (the drain, budget.h "Who
// waits") checked against live runs of the library: each trace is played in
// real time against a ModelCache on threads (live_harness.h) and replayed
// with the same time model, and the two must agree within the bounds the
// cluster check uses (examples/cluster/cluster.py): loads within 10%, p99
// wait within 25%.
//
// The p99 bound is 25% of the prediction plus a slack for the scheduler,
// measured in the same run. A live wait for room is a chain of threads
// waking: the holder's at its lease's end, the waiter's to evict and load,
// the loader's at the load's end; the replay's waits have no such delays.
// The run measures how late a sleeping thread wakes (each request's delay
// against its due time, as the dispatcher and a worker hand it on) and
// allows kHandOffs times its p99, at least kSlackMs. On a quiet machine that
// is small, so the bound is close to the cluster check's 25% (kSlackMs
// decides only a p99 of a few milliseconds, which these cases do not have);
// on a machine whose cores are busy with other work it widens by what the
// run measured, which the failure message names.
//
// Real time: these run only in the release build (the Makefile leaves the
// suite LiveReplay out of the sanitizer and clang builds, where the same
// code paths are covered by the fake-clock tests).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "live_harness.h"

namespace modelcache::replay::live {
namespace {

constexpr double kSlackMs = 5;
constexpr double kHandOffs = 3;

std::string DrainText(const std::optional<double>& drain_after_ms) {
  if (!drain_after_ms) return "default";
  if (std::isinf(*drain_after_ms)) return "inf";
  return std::to_string(static_cast<int>(*drain_after_ms)) + " ms";
}

// Plays `w` live and replays the trace as played (live_harness.h); checks
// that they agree, and prints the row of docs/benchmarks.md's table, with
// the replay of the trace as planned beside it.
void ExpectAgreement(const std::string& name, const Workload& w) {
  const Outcome planned = Predict(w);
  LibraryTarget library(w);
  const Played played = PlayLive(w, library);
  const Outcome& live = played.live;
  const Outcome predicted = Predict(played.as_played);
  auto u = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf(
      "| %s | library | %s | %llu / %llu (%llu) | %.0f / %.0f (%.0f) | "
      "%.0f / %.0f (%.0f) | %llu / %llu (%llu) | %.1f / %.1f | %.1f s |\n",
      name.c_str(), DrainText(w.drain_after_ms).c_str(), u(live.loads),
      u(predicted.loads), u(planned.loads), live.p99_ms, predicted.p99_ms,
      planned.p99_ms, live.max_ms, predicted.max_ms, planned.max_ms,
      u(live.drains), u(predicted.drains), u(planned.drains),
      played.p99_late_ms, played.max_late_ms, live.seconds);
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

// The starvation scenario of the issue, shortened to 3 s: room for one
// model, A every 7 ms, each request holding its lease 20 ms (three
// overlap), one request for B at 200 ms; a load takes 110 ms.
Workload Starvation(std::optional<double> drain_after_ms) {
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

TEST(LiveReplay, StarvationAtZero) {
  ExpectAgreement("starvation", Starvation(0.0));
}

TEST(LiveReplay, StarvationAtAFiniteValue) {
  ExpectAgreement("starvation", Starvation(300.0));
}

// The default: B was never loaded, so the library's waiter is overtaken for
// the floor (1 s), as the replay's is (4 x 110 ms is less).
TEST(LiveReplay, StarvationAtTheDefault) {
  ExpectAgreement("starvation", Starvation(std::nullopt));
}

// inf: B waits until A's traffic ends (2.9 s in the replay of the trace as
// planned), or until a gap in it: a request that woke late, on a busy
// machine, leaves A idle for a moment. The replay of the trace as played
// must agree with the live run either way.
TEST(LiveReplay, StarvationAtInfinity) {
  ExpectAgreement("starvation", Starvation(kNeverDrain));
}

// A Zipf mix with service times: 6 models, room for 3, model k asked for
// with weight 1/k, Poisson arrivals at 60 a second for 4 s (about 240
// requests), each request holding its lease an exponential time (mean 40
// ms); a load takes 60 ms. Seeded.
Workload ZipfMix(std::optional<double> drain_after_ms) {
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

TEST(LiveReplay, ZipfMixWithServiceTimesAtTheDefault) {
  ExpectAgreement("zipf", ZipfMix(std::nullopt));
}

// Strict arrival order: every wait for room drains at once, with several
// waiters and leased models. (The replay's drain waiter used to take a
// model that went idle outside its set; the budget waits for its set's
// last lease, and the two disagreed here: p99 267 / 167 ms, drains 32 /
// 52.)
TEST(LiveReplay, ZipfMixWithServiceTimesAtZero) {
  ExpectAgreement("zipf", ZipfMix(0.0));
}

}  // namespace
}  // namespace modelcache::replay::live
