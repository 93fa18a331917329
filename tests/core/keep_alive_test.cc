// Keep-alive and prewarm: the hybrid histogram planner on its own (rules of
// Shahrad et al., "Serverless in the Wild", ATC 2020, and our variants), and
// a ModelCache that carries its plans out on an injected clock or on its own
// thread. The replay runs the same planner in trace time; tests/replay/
// keep_alive_agreement_test.cc checks that both take the same decisions.
#include "modelcache/core/keep_alive.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <latch>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../test_util.h"
#include "modelcache/core/cache.h"

namespace modelcache {
namespace {

using ::testing::ElementsAre;
using testing::Models;

constexpr double kMinuteMs = 60'000;

// ---- The planner ----

TEST(IdleHistoryTest, FilesIdleTimesInMinuteBinsAndKeepsTheLastEight) {
  IdleHistory h;
  for (double ms :
       {0.0, 59'999.0, 60'000.0, 239.5 * kMinuteMs, 240 * kMinuteMs, 1e9}) {
    h.Record(ms);
  }
  EXPECT_EQ(h.samples(), 6u);
  EXPECT_EQ(h.out_of_range(), 2u);  // four hours and beyond
  EXPECT_EQ(h.bin(0), 2u);
  EXPECT_EQ(h.bin(1), 1u);
  EXPECT_EQ(h.bin(239), 1u);
  EXPECT_DOUBLE_EQ(h.sum_squares(), 4 + 1 + 1);
  for (int i = 0; i < 10; ++i) h.Record(i);
  EXPECT_EQ(h.recent().size(), IdleHistory::kRecent);
  EXPECT_EQ(h.recent().front(), 2.0);
  EXPECT_EQ(h.recent().back(), 9.0);
}

TEST(HybridHistogramTest, FewerThanFiveIdleTimesKeepTheModelFourHours) {
  auto policy = NewHybridHistogramKeepAlive();
  IdleHistory h;
  for (int i = 0; i < 4; ++i) h.Record(30 * kMinuteMs);
  const KeepAlivePlan plan = policy->Plan(h, 1000, 0);
  EXPECT_FALSE(plan.unload_now);
  EXPECT_EQ(plan.prewarm_at, KeepAlivePlan::kNever);
  EXPECT_DOUBLE_EQ(plan.keep_until, 1000 + 240 * kMinuteMs);
}

TEST(HybridHistogramTest, ARegularIdleTimeUnloadsAndPrewarmsAheadOfIt) {
  // Five idle times in the bin of 30 minutes: one bin out of 240 holds
  // them all (CV far above 2). Prewarm at 90% of the bin's start, keep
  // until 110% of its end.
  IdleHistory h;
  for (int i = 0; i < 5; ++i) h.Record(30.5 * kMinuteMs);
  const KeepAlivePlan plan = NewHybridHistogramKeepAlive()->Plan(h, 1000, 0);
  EXPECT_TRUE(plan.unload_now);
  EXPECT_DOUBLE_EQ(plan.prewarm_at, 1000 + 0.9 * 30 * kMinuteMs);
  EXPECT_DOUBLE_EQ(plan.keep_until, 1000 + 1.1 * 31 * kMinuteMs);
  // Ours: the prewarm starts its expected load time earlier.
  const KeepAlivePlan led =
      NewHybridHistogramKeepAlive({.lead_by_load_time = true})
          ->Plan(h, 1000, 5000);
  EXPECT_DOUBLE_EQ(led.prewarm_at, 1000 + 0.9 * 30 * kMinuteMs - 5000);
  EXPECT_EQ(led.keep_until, plan.keep_until);
}

TEST(HybridHistogramTest, AnIdleTimeInTheFirstBinKeepsTheModelInstead) {
  IdleHistory h;
  for (int i = 0; i < 5; ++i) h.Record(20'000);
  const KeepAlivePlan plan = NewHybridHistogramKeepAlive()->Plan(h, 0, 0);
  EXPECT_FALSE(plan.unload_now);  // prewarm at 90% of 0: just keep it
  EXPECT_DOUBLE_EQ(plan.keep_until, 1.1 * kMinuteMs);
}

TEST(HybridHistogramTest, SpreadIdleTimesAreNotRepresentative) {
  // One idle time in each of 60 bins: the bin counts' CV is below 2.
  IdleHistory h;
  for (int b = 0; b < 60; ++b) h.Record((b + 0.5) * kMinuteMs);
  const KeepAlivePlan plan = NewHybridHistogramKeepAlive()->Plan(h, 0, 0);
  EXPECT_FALSE(plan.unload_now);
  EXPECT_DOUBLE_EQ(plan.keep_until, 240 * kMinuteMs);
}

TEST(HybridHistogramTest, IdleTimesBeyondFourHoursUseTheMovingAverage) {
  IdleHistory h;
  for (double hours : {5.0, 6.0, 7.0, 5.0, 6.0, 7.0}) {
    h.Record(hours * 60 * kMinuteMs);
  }
  const double mean = 6 * 60 * kMinuteMs;
  const KeepAlivePlan plan = NewHybridHistogramKeepAlive()->Plan(h, 0, 0);
  EXPECT_TRUE(plan.unload_now);
  EXPECT_DOUBLE_EQ(plan.prewarm_at, 0.85 * mean);
  EXPECT_DOUBLE_EQ(plan.keep_until, 1.15 * mean);
}

// ---- A cache carrying the plans out ----

// An injected clock in milliseconds, and what happened when.
struct Clocked {
  std::atomic<double> now_ms{0};
  std::mutex mu;
  std::vector<std::tuple<double, std::string, std::string>> events;

  CacheOptions Options(const std::string& policy, uint64_t capacity) {
    CacheOptions options;
    options.name = "keep-alive";
    options.capacity_bytes = capacity;
    options.shard_bits = 0;
    options.WithPolicy(PolicyByName(policy));
    options.now = [this] {
      return Clock::time_point(std::chrono::nanoseconds(
          static_cast<int64_t>(std::llround(now_ms.load() * 1e6))));
    };
    options.on_event = [this](const CacheEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      events.emplace_back(now_ms.load(), EventTypeName(e.type), e.key);
    };
    return options;
  }
};

// Runs requests (instantaneous) at the given times, stepping the clock by
// `step_ms` and running the keep-alive at every step.
void RunRequests(ModelCache& cache, Clocked& clock, Models& models,
                 std::vector<std::pair<double, std::string>> requests,
                 double step_ms, uint64_t bytes) {
  std::sort(requests.begin(), requests.end());
  size_t next = 0;
  const double end = requests.back().first + step_ms;
  for (double t = 0; t <= end; t += step_ms) {
    clock.now_ms = t;
    cache.RunKeepAlive();
    while (next < requests.size() && requests[next].first <= t) {
      const std::string& key = requests[next].second;
      clock.now_ms = requests[next].first;
      cache.RunKeepAlive();
      Lease lease = cache.Acquire(key, bytes, models.For(key, bytes));
      lease.Release();
      cache.RunKeepAlive();  // an unload planned for now
      ++next;
    }
  }
}

// Milliseconds of [from, to] during which `key` was resident, from each
// load to the unload after it: with instantaneous requests, the time the
// model was resident and idle.
double ResidentMs(const Clocked& clock, const std::string& key, double from,
                  double to) {
  double total = 0, since = -1;
  auto add = [&](double a, double b) {
    total += std::max(0.0, std::min(b, to) - std::max(a, from));
  };
  for (const auto& [t, type, k] : clock.events) {
    if (k != key) continue;
    if (type == "loaded") since = t;
    if ((type == "expired" || type == "evicted" || type == "removed") &&
        since >= 0) {
      add(since, t);
      since = -1;
    }
  }
  if (since >= 0) add(since, to);
  return total;
}

// One model every 30 minutes, give or take a minute. Until it has five idle
// times it is kept four hours after each request; then the histogram is
// representative, and it is unloaded when each request ends and prewarmed
// ahead of the next. Every request but the first hits, and after the
// warm-up it holds less idle memory than under a 60-minute TTL (which never
// expires it).
TEST(KeepAliveCacheTest, APeriodicModelIsPrewarmedAndHeldLessThanUnderATtl) {
  std::vector<std::pair<double, std::string>> requests;
  double t = 0;
  for (int i = 0; i < 20; ++i) {
    requests.push_back({t, "periodic"});
    t += (30 + (i % 3) - 1) * kMinuteMs;  // 29, 30, 31 minutes
  }
  const double end = requests.back().first;
  const double warm = requests[6].first;  // five idle times from here on
  Models models;
  Clocked clock;
  CacheOptions options = clock.Options("hybrid-histogram", 1000);
  options.prewarm_source = [&](std::string_view key) {
    return PrewarmSource{100, models.For(std::string(key), 100)};
  };
  ModelCache cache(std::move(options));
  RunRequests(cache, clock, models, requests, kMinuteMs / 4, 100);
  // Six requests make five idle times; from the seventh on, each request
  // finds its model prewarmed.
  const CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.hits, 19u);
  EXPECT_EQ(stats.prewarms, 14u);
  EXPECT_EQ(stats.misses, 1u + 14u);  // the first request, and each prewarm
  EXPECT_EQ(stats.expirations, 15u);  // when each request from the 6th ends
  EXPECT_EQ(models.loads("periodic"), 1 + 14);

  Models ttl_models;
  Clocked ttl_clock;
  ModelCache ttl(ttl_clock.Options("ttl-60m", 1000));
  RunRequests(ttl, ttl_clock, ttl_models, requests, kMinuteMs / 4, 100);
  EXPECT_EQ(ttl.Stats().misses, 1u);
  const double held = ResidentMs(clock, "periodic", warm, end);
  const double held_ttl = ResidentMs(ttl_clock, "periodic", warm, end);
  EXPECT_DOUBLE_EQ(held_ttl, end - warm);
  EXPECT_LT(held, held_ttl / 4);
}

// A prewarm that comes due while a demand load is in flight waits until no
// demand load is; then it starts.
TEST(KeepAliveCacheTest, APrewarmNeverStartsDuringADemandLoad) {
  Models models;
  Clocked clock;
  std::atomic<int> prewarm_loads{0};
  CacheOptions options = clock.Options("hybrid-histogram", 1000);
  options.prewarm_source = [&](std::string_view key) {
    ++prewarm_loads;
    return PrewarmSource{100, models.For(std::string(key), 100)};
  };
  ModelCache cache(std::move(options));
  // Make "p" representative: six requests 30.5 minutes apart.
  std::vector<std::pair<double, std::string>> requests;
  for (int i = 0; i < 6; ++i) requests.push_back({i * 30.5 * kMinuteMs, "p"});
  RunRequests(cache, clock, models, requests, kMinuteMs, 100);
  ASSERT_FALSE(cache.Entry("p").has_value());  // unloaded at its end
  // A demand load of "d" starts and blocks; "p"'s prewarm comes due.
  std::latch loading(1), finish(1);
  std::thread demand([&] {
    Lease d = cache.Acquire("d", 100, models.For("d", 100, {.during_load = [&] {
                                                   loading.count_down();
                                                   finish.wait();
                                                 }}));
  });
  loading.wait();
  clock.now_ms += 28 * kMinuteMs;
  EXPECT_EQ(cache.RunKeepAlive(), 0u);
  EXPECT_EQ(prewarm_loads.load(), 0);
  EXPECT_FALSE(cache.Entry("p").has_value());
  finish.count_down();
  demand.join();
  EXPECT_EQ(cache.RunKeepAlive(), 1u);  // now it may start
  EXPECT_EQ(prewarm_loads.load(), 1);
  ASSERT_TRUE(cache.Entry("p").has_value());
  EXPECT_EQ(cache.Stats().prewarms, 1u);
}

// A prewarm uses free memory only (hybrid-histogram): it evicts nothing.
TEST(KeepAliveCacheTest, APrewarmIntoAFullCacheEvictsNothing) {
  Models models;
  Clocked clock;
  CacheOptions options = clock.Options("hybrid-histogram", 200);
  options.prewarm_source = [&](std::string_view key) {
    return PrewarmSource{100, models.For(std::string(key), 100)};
  };
  ModelCache cache(std::move(options));
  std::vector<std::pair<double, std::string>> requests;
  for (int i = 0; i < 6; ++i) requests.push_back({i * 30.5 * kMinuteMs, "p"});
  RunRequests(cache, clock, models, requests, kMinuteMs, 100);
  // Two idle models fill the cache.
  cache.Prefetch("x", 100, models.For("x", 100));
  cache.Prefetch("y", 100, models.For("y", 100));
  clock.now_ms += 28 * kMinuteMs;
  EXPECT_EQ(cache.RunKeepAlive(), 0u);
  EXPECT_THAT(testing::ResidentKeys(cache), ElementsAre("x", "y"));
  EXPECT_EQ(cache.Stats().evictions, 0u);
}

// A prewarm source that throws is user code failing, as an event callback
// can: counted in callback_errors, the prewarm skipped, the books unchanged,
// and the request, when it comes, loads.
TEST(KeepAliveCacheTest, APrewarmSourceThatThrowsIsCountedAndSkipped) {
  Models models;
  Clocked clock;
  int calls = 0;
  CacheOptions options = clock.Options("hybrid-histogram", 1000);
  options.prewarm_source =
      [&](std::string_view) -> std::optional<PrewarmSource> {
    ++calls;
    throw std::runtime_error("catalog unreachable");
  };
  ModelCache cache(std::move(options));
  std::vector<std::pair<double, std::string>> requests;
  for (int i = 0; i < 6; ++i) requests.push_back({i * 30.5 * kMinuteMs, "p"});
  RunRequests(cache, clock, models, requests, kMinuteMs, 100);
  ASSERT_FALSE(cache.Entry("p").has_value());  // unloaded at its end
  clock.now_ms += 28 * kMinuteMs;
  EXPECT_EQ(cache.RunKeepAlive(), 0u);
  EXPECT_EQ(calls, 1);
  const CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.callback_errors, 1u);
  EXPECT_EQ(stats.prewarms, 0u);
  EXPECT_EQ(stats.load_failures, 0u);
  EXPECT_FALSE(cache.Entry("p").has_value());
  EXPECT_EQ(cache.CheckInvariants(), 0u);
}

// A request after the plan voids it: no unload at keep-until, no prewarm.
TEST(KeepAliveCacheTest, ARequestCancelsThePlanMadeBeforeIt) {
  Models models;
  Clocked clock;
  CacheOptions options = clock.Options("hybrid-histogram", 1000);
  int prewarms = 0;
  options.prewarm_source = [&](std::string_view key) {
    ++prewarms;
    return PrewarmSource{100, models.For(std::string(key), 100)};
  };
  ModelCache cache(std::move(options));
  // Fewer than five idle times: kept for four hours after each request.
  Lease held = cache.Acquire("k", 100, models.For("k", 100));
  held.Release();
  clock.now_ms = 239 * kMinuteMs;
  held = cache.Acquire("k", 100, models.For("k", 100));  // in progress...
  clock.now_ms = 241 * kMinuteMs;  // past the first plan's keep-until
  EXPECT_EQ(cache.RunKeepAlive(), 0u);
  EXPECT_TRUE(cache.Entry("k").has_value());
  held.Release();  // ...plans again: four hours from now
  clock.now_ms = (241 + 239) * kMinuteMs;
  EXPECT_EQ(cache.RunKeepAlive(), 0u);
  EXPECT_TRUE(cache.Entry("k").has_value());
  clock.now_ms = (241 + 241) * kMinuteMs;
  EXPECT_EQ(cache.RunKeepAlive(), 1u);
  EXPECT_FALSE(cache.Entry("k").has_value());
  EXPECT_EQ(cache.Stats().expirations, 1u);
  EXPECT_EQ(prewarms, 0);
}

// A policy that unloads at once and prewarms 1 ms later: on the real clock,
// the cache's own thread carries both out, and the cache stops it when it
// goes away, even with an action far in the future still queued.
class PrewarmSoon final : public KeepAlivePolicy {
 public:
  std::string name() const override { return "prewarm-soon"; }
  KeepAlivePlan Plan(const IdleHistory&, double now_ms, double) const override {
    return {.unload_now = true,
            .prewarm_at = now_ms + 1,
            .keep_until = now_ms + 3.6e6};
  }
};

TEST(KeepAliveCacheTest, TheCachesThreadCarriesPlansOutOnTheRealClock) {
  Models models;
  std::latch unloaded(1), prewarmed(1);
  std::atomic<int> loads{0};
  {
    CacheOptions options;
    options.capacity_bytes = 1000;
    options.keep_alive = std::make_shared<PrewarmSoon>();
    options.prewarm_source = [&](std::string_view key) {
      return PrewarmSource{100, models.For(std::string(key), 100)};
    };
    options.on_event = [&](const CacheEvent& e) {
      if (e.type == EventType::kExpired) unloaded.count_down();
      if (e.type == EventType::kLoaded && ++loads == 2) prewarmed.count_down();
    };
    ModelCache cache(std::move(options));
    cache.Acquire("m", 100, models.For("m", 100)).Release();
    unloaded.wait();
    prewarmed.wait();
    EXPECT_EQ(cache.Stats().prewarms, 1u);
    EXPECT_EQ(models.loads("m"), 2);
  }  // the keep-until an hour away is still queued: the thread stops anyway
}

}  // namespace
}  // namespace modelcache
