// The keep-alive policy runs in two places: the replay's simulation, in
// trace time, and a ModelCache, on its clock (CacheOptions::keep_alive).
// Given the same request times they must take the same decisions: the same
// unloads and prewarms of the same models at the same times.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../test_util.h"
#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"

namespace modelcache {
namespace {

using testing::Models;
using Decision = std::tuple<double, std::string, std::string>;

constexpr double kMinuteMs = 60'000;

// Runs instantaneous requests through `cache` on an injected clock that
// steps by a second, running the keep-alive at every step, and returns the
// loads and keep-alive unloads it saw.
std::vector<Decision> RunLive(
    const std::string& policy,
    const std::vector<std::pair<double, std::string>>& requests) {
  Models models;
  double now_ms = 0;
  std::vector<Decision> decisions;
  CacheOptions options;
  options.capacity_bytes = 1000;
  options.shard_bits = 0;
  options.WithPolicy(PolicyByName(policy));
  options.now = [&] {
    return Clock::time_point(std::chrono::nanoseconds(
        static_cast<int64_t>(std::llround(now_ms * 1e6))));
  };
  options.on_event = [&](const CacheEvent& e) {
    if (e.type == EventType::kLoaded)
      decisions.emplace_back(now_ms, "load", e.key);
    if (e.type == EventType::kExpired) {
      decisions.emplace_back(now_ms, "unload", e.key);
    }
  };
  options.prewarm_source = [&](std::string_view key) {
    return PrewarmSource{100, models.For(std::string(key), 100)};
  };
  ModelCache cache(std::move(options));
  size_t next = 0;
  for (double t = 0; next < requests.size(); t += 1000) {
    now_ms = t;
    cache.RunKeepAlive();
    for (; next < requests.size() && requests[next].first <= t; ++next) {
      const std::string& key = requests[next].second;
      cache.Acquire(key, 100, models.For(key, 100)).Release();
      cache.RunKeepAlive();  // an unload planned for now
    }
  }
  return decisions;
}

// ---- The cache and the replay take the same decisions ----

// The same request times through the replay (trace time, loads that take no
// time) and through a cache on an injected clock: the same unloads and
// prewarms of the same models at the same times (the cache's to the second
// it runs its keep-alive at).
TEST(KeepAliveAgreementTest, TheCacheAndTheReplayTakeTheSameDecisions) {
  std::mt19937_64 rng(7);
  std::vector<std::pair<double, std::string>> requests;
  // A periodic model, a bursty one and a random one over 12 hours.
  for (double t = 0; t < 12 * 60 * kMinuteMs; t += 20 * kMinuteMs) {
    requests.push_back({t + 1000 * (rng() % 30), "periodic"});
  }
  for (double t = 0; t < 12 * 60 * kMinuteMs; t += 90 * kMinuteMs) {
    for (int i = 0; i < 5; ++i) requests.push_back({t + i * 7000, "bursty"});
  }
  std::exponential_distribution<double> gap(1 / (40 * kMinuteMs));
  for (double t = gap(rng); t < 12 * 60 * kMinuteMs; t += gap(rng)) {
    requests.push_back({std::floor(t / 1000) * 1000, "random"});
  }
  std::sort(requests.begin(), requests.end());

  replay::Trace trace;
  trace.models = {"periodic", "bursty", "random"};
  trace.sizes = {100, 100, 100};
  for (const auto& [t, key] : requests) {
    const auto m = std::find(trace.models.begin(), trace.models.end(), key) -
                   trace.models.begin();
    trace.requests.push_back(
        {static_cast<int64_t>(t), static_cast<uint32_t>(m)});
  }
  std::vector<Decision> replayed;
  replay::SimulateOptions options;
  options.time = replay::TimeModel{std::numeric_limits<double>::infinity(), 0,
                                   /*slots=*/0};
  options.on_event = [&](double t, const CacheEvent& e) {
    if (e.type == EventType::kLoaded || e.type == EventType::kRemoved) {
      // Up to the second the cache runs its keep-alive at.
      replayed.emplace_back(std::ceil(t / 1000) * 1000,
                            e.type == EventType::kLoaded ? "load" : "unload",
                            e.key);
    }
  };
  replay::Simulate(trace, "hybrid-histogram", 1000, options);

  const std::vector<Decision> live = RunLive("hybrid-histogram", requests);
  auto sorted = [](auto v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  const auto expected = sorted(replayed);
  const auto actual = sorted(live);
  ASSERT_GT(expected.size(), 20u);
  size_t prewarms = 0;
  for (const auto& [t, type, key] : expected) prewarms += type == "load";
  EXPECT_GT(prewarms, 3u);  // it is the plans, not only the loads, compared
  EXPECT_EQ(actual, expected);
}

}  // namespace
}  // namespace modelcache
