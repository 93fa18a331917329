// modelcache replay in trace time: hand-computed waits for the load path
// (latency, shared bandwidth, slots, single flight, room), the books (idle
// memory-time, percentiles), keep-alive and prewarm policies, and the
// untimed replay as the limit of an infinitely fast load path.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {
namespace {

using ::testing::ElementsAre;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr uint64_t kGiB = uint64_t{1} << 30;

// 1 GB/s: a byte per nanosecond, 1e6 bytes per ms.
ReplayOptions Timed(double latency_ms, uint32_t slots, double bandwidth = 1e9) {
  ReplayOptions options;
  options.time = TimeModel{bandwidth, latency_ms, slots};
  return options;
}

Trace MakeTrace(std::vector<uint64_t> sizes,
                std::vector<std::pair<int64_t, uint32_t>> requests) {
  Trace trace;
  for (size_t m = 0; m < sizes.size(); ++m) {
    trace.models.push_back(std::string(1, static_cast<char>('a' + m)));
  }
  trace.sizes = std::move(sizes);
  for (auto [t, m] : requests) trace.requests.push_back(Request{t, m});
  return trace;
}

TEST(TimedReplay, OneModelOneSlotWaitsLatencyPlusTransfer) {
  // 100 ms + 1e9 bytes at 1 GB/s.
  Trace trace = MakeTrace({1'000'000'000}, {{0, 0}, {5000, 0}});
  RunResult r = Simulate(trace, "lru", 10 * kGiB, Timed(100, 1));
  EXPECT_TRUE(r.timed);
  EXPECT_EQ(r.cold_starts, 1u);
  EXPECT_EQ(r.hits, 1u);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 1100);
  EXPECT_DOUBLE_EQ(r.wait_ms.p50, 0);  // nearest rank: the hit
  EXPECT_DOUBLE_EQ(r.load_seconds, 1.1);
  EXPECT_EQ(r.load_queue_peak, 0u);  // it started at once: never queued
  // Busy for 1100 ms of the 5000 ms trace.
  EXPECT_DOUBLE_EQ(r.disk_busy_ratio, 1100.0 / 5000);
}

TEST(TimedReplay, LoadsFinishLateInALongTrace) {
  // From 2^33 ms (99 days into a trace) a double's step is 2^-19 ms: at
  // 1 TB/s that moves 1,907 bytes, so a transfer can be left with bytes that
  // no representable step of the clock moves. Each load must still finish
  // (the replay used to spin there for ever).
  std::vector<uint64_t> sizes;
  std::vector<std::pair<int64_t, uint32_t>> requests;
  for (uint32_t m = 0; m < 20; ++m) {
    sizes.push_back(1'000'003 + 7'919 * uint64_t{m});
    requests.push_back({8'600'000'000 + 1'000 * int64_t{m}, m});
  }
  Trace trace = MakeTrace(sizes, requests);
  RunResult r = Simulate(trace, "lru", 10 * kGiB, Timed(100, 1, 1e12));
  EXPECT_EQ(r.cold_starts, 20u);
  EXPECT_EQ(r.bytes_loaded,
            std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}));
  // 100 ms and about a microsecond of transfer, to the clock's step.
  EXPECT_NEAR(r.wait_ms.max, 100.0, 0.01);
  EXPECT_NEAR(r.wait_ms.p50, 100.0, 0.01);
}

// Two loads that end at the same instant complete in the order of their
// requests, whatever the order in which the models first appeared. A and B
// are requested together at 4000 ms and both end at 5148.576 ms: A's request
// came first, so under LRU A is the older of the two and goes for C at
// 6000 ms, and B hits at 7000 ms.
TEST(TimedReplay, LoadsEndingTogetherCompleteInRequestOrder) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::vector<std::pair<int64_t, char>> requests = {
      {0, 'B'},    {1000, 'C'}, {2000, 'D'}, {4000, 'A'},
      {4000, 'B'}, {6000, 'C'}, {7000, 'B'}};
  const std::map<char, uint64_t> size = {{'A', 1000 * kMiB},
                                         {'B', 1000 * kMiB},
                                         {'C', 1000 * kMiB},
                                         {'D', 2000 * kMiB}};
  // The models indexed in the order of their first request (B, C, D, A, as
  // the CSV reader does), and alphabetically (A first).
  for (const std::string order : {"BCDA", "ABCD", "DCBA"}) {
    SCOPED_TRACE(order);
    Trace trace;
    for (char m : order) {
      trace.models.push_back(std::string(1, m));
      trace.sizes.push_back(size.at(m));
    }
    for (auto [t, m] : requests) {
      trace.requests.push_back(
          Request{t, static_cast<uint32_t>(order.find(m))});
    }
    RunResult r = Simulate(trace, "lru", 2000 * kMiB, ReplayOptions{});
    EXPECT_EQ(r.hits, 1u);
    EXPECT_EQ(r.evictions, 4u);
    EXPECT_EQ(r.bytes_loaded, uint64_t{7'340'032'000});
    // A and B: 100 ms and 2 x 1000 MiB at 2 GB/s, shared.
    EXPECT_NEAR(r.wait_ms.max, 1148.576, 1e-6);
  }
}

TEST(TimedReplay, TwoLoadsShareTheBandwidth) {
  // a = 1e9 and b = 3e9 bytes start together: each gets half of 1 GB/s until
  // a finishes at 2a/B = 2000 ms; b then has 2e9 left at the full rate and
  // finishes at (a+b)/B = 4000 ms.
  Trace unequal = MakeTrace({1'000'000'000, 3'000'000'000}, {{0, 0}, {0, 1}});
  RunResult r = Simulate(unequal, "lru", 10 * kGiB, Timed(0, 2));
  EXPECT_DOUBLE_EQ(r.wait_ms.p50, 2000);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 4000);
  // Equal sizes: both finish at (a+b)/B.
  Trace equal = MakeTrace({2'000'000'000, 2'000'000'000}, {{0, 0}, {0, 1}});
  RunResult e = Simulate(equal, "lru", 10 * kGiB, Timed(0, 2));
  EXPECT_DOUBLE_EQ(e.wait_ms.p50, 4000);
  EXPECT_DOUBLE_EQ(e.wait_ms.max, 4000);
}

TEST(TimedReplay, AJoiningRequestWaitsOnlyTheRemainder) {
  // The load runs 0..1100; the second request joins it at 500.
  Trace trace = MakeTrace({1'000'000'000}, {{0, 0}, {500, 0}});
  RunResult r = Simulate(trace, "lru", 10 * kGiB, Timed(100, 1));
  EXPECT_EQ(r.cold_starts, 2u);
  EXPECT_EQ(r.loads_per_model[0], 1u);
  EXPECT_DOUBLE_EQ(r.wait_ms.p50, 600);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 1100);
}

TEST(TimedReplay, LoadsBeyondTheSlotsQueueInOrder) {
  // One slot: a 0..1100, b 1100..2200, c 2200..3300; a hit at 4000 ends the
  // trace. The queue holds 2 for 1100 ms and 1 for 1100 ms of 4000.
  Trace trace = MakeTrace({1'000'000'000, 1'000'000'000, 1'000'000'000},
                          {{0, 0}, {0, 1}, {0, 2}, {4000, 0}});
  RunResult r = Simulate(trace, "lru", 10 * kGiB, Timed(100, 1));
  EXPECT_EQ(r.load_queue_peak, 2u);
  EXPECT_DOUBLE_EQ(r.load_queue_mean, (2 * 1100.0 + 1100.0) / 4000);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 3300);
  EXPECT_DOUBLE_EQ(r.wait_ms.p50, 1100);  // waits 0, 1100, 2200, 3300
  EXPECT_DOUBLE_EQ(Simulate(trace, "lru", 10 * kGiB, Timed(100, 3)).wait_ms.max,
                   3100);  // three at a third of the bandwidth each
}

TEST(TimedReplay, MaxWaitRejectsAndAQueuedLoadNobodyWantsNeverStarts) {
  // As above with --max-wait 1500: b's load is in flight at 1500, so it
  // finishes, but b has left; c is still queued and never loads.
  Trace trace = MakeTrace({1'000'000'000, 1'000'000'000, 1'000'000'000},
                          {{0, 0}, {0, 1}, {0, 2}, {4000, 0}});
  ReplayOptions options = Timed(100, 1);
  options.max_wait_ms = 1500;
  RunResult r = Simulate(trace, "lru", 10 * kGiB, options);
  EXPECT_EQ(r.rejected, 2u);
  EXPECT_EQ(r.loads_per_model[1], 1u);
  EXPECT_EQ(r.loads_per_model[2], 0u);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 1100);
}

TEST(TimedReplay, AHeldLeaseBlocksEvictionUntilItsServiceTimeEnds) {
  // Room for one model. a loads 0..1000 and is served until 2000; b, asked
  // for at 500, cannot evict it until then: it loads 2000..3000.
  Trace trace = MakeTrace({1'000'000'000, 1'000'000'000}, {{0, 0}, {500, 1}});
  ReplayOptions options = Timed(0, 4);
  options.hold_ms = 1000;
  RunResult r = Simulate(trace, "lru", 1'000'000'000, options);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 2500);
  EXPECT_EQ(r.evictions, 1u);
  EXPECT_EQ(r.peak_resident_bytes, 1'000'000'000u);
}

TEST(TimedReplay, IdleMemoryTimeByHand) {
  // 1 GiB at 1 GiB/s, each request served 10 minutes. a loads 0..1000 and is
  // busy until 601000; hit at 1 h, busy until 1 h 10 min; b at 2 h ends the
  // trace. Idle: [601000, 3600000) and [4200000, 7200000), 1 GiB each.
  Trace trace =
      MakeTrace({kGiB, 2 * kGiB}, {{0, 0}, {3'600'000, 0}, {7'200'000, 1}});
  ReplayOptions options = Timed(0, 4, static_cast<double>(kGiB));
  options.hold_ms = 600'000;
  RunResult r = Simulate(trace, "lru", 10 * kGiB, options);
  EXPECT_NEAR(r.idle_gib_hours, (2'999'000.0 + 3'000'000.0) / 3'600'000.0,
              1e-9);
}

TEST(TimedReplay, PercentileIsTheNearestRankOfADirectSort) {
  std::mt19937_64 rng(5);
  for (size_t n : {1u, 2u, 7u, 100u, 1001u}) {
    std::vector<double> values(n);
    for (double& v : values) v = static_cast<double>(rng() % 50);
    std::vector<double> sorted = values;
    std::sort(sorted.begin(), sorted.end());
    for (double p : {0.01, 0.5, 0.95, 0.99, 0.999, 1.0}) {
      // The smallest value with at least p of all values at or below it.
      double expected = kInf;
      for (double v : values) {
        const auto at_or_below = std::count_if(
            values.begin(), values.end(), [&](double w) { return w <= v; });
        if (static_cast<double>(at_or_below) >=
                p * static_cast<double>(n) - 1e-9 &&
            v < expected) {
          expected = v;
        }
      }
      EXPECT_EQ(Percentile(sorted, p), expected) << n << " " << p;
    }
  }
  EXPECT_EQ(Percentile({}, 0.5), 0);
}

TEST(TimedReplay, TtlUnloadsExactlyAfterTenMinutesIdle) {
  // a loads 0..1000 (1 GiB at 1 GiB/s) and is idle from 1000: expired at
  // 601000 (one clock tick after), asked for again at 30 min, expired 10 min
  // after that load ends.
  Trace trace =
      MakeTrace({kGiB, kGiB}, {{0, 0}, {1'800'000, 0}, {3'000'000, 1}});
  ReplayOptions options = Timed(0, 4, static_cast<double>(kGiB));
  std::vector<std::pair<double, std::string>> expired;
  options.on_event = [&](double t, const CacheEvent& e) {
    if (e.type == EventType::kExpired) expired.emplace_back(t, e.key);
  };
  RunResult r = Simulate(trace, "ttl-10m", 10 * kGiB, options);
  ASSERT_EQ(expired.size(), 2u);
  EXPECT_NEAR(expired[0].first, 601'000, 1e-5);
  EXPECT_NEAR(expired[1].first, 1'801'000 + 600'000, 1e-5);
  EXPECT_EQ(expired[0].second, "a");
  EXPECT_EQ(r.cold_starts, 3u);
  // Idle a for 10 minutes twice.
  EXPECT_NEAR(r.idle_gib_hours, 2 * 600'000 / 3'600'000.0, 1e-6);
}

Trace Periodic(uint64_t seed) {
  // One model every 30 minutes, +-1 minute, for a day; each call 1 s.
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> jitter(-60'000, 60'000);
  std::vector<std::pair<int64_t, uint32_t>> requests;
  for (int k = 0; k < 48; ++k) {
    requests.emplace_back(k * 30 * 60'000 + 60'000 + jitter(rng), 0);
  }
  return MakeTrace({kGiB}, requests);
}

TEST(TimedReplay, HybridHistogramPrewarmsAPeriodicModelAndHoldsLessIdle) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    Trace trace = Periodic(seed);
    ReplayOptions options = Timed(100, 4, static_cast<double>(kGiB));
    options.hold_ms = 1000;
    RunResult hybrid = Simulate(trace, "hybrid-histogram", 10 * kGiB, options);
    RunResult ttl = Simulate(trace, "ttl-60m", 10 * kGiB, options);
    // The first request is cold; until the histogram is representative the
    // 4-hour keep-alive keeps the model; after it, a prewarm precedes every
    // request.
    EXPECT_EQ(hybrid.cold_starts, 1u) << seed;
    EXPECT_GE(hybrid.prewarms, 40u);
    EXPECT_EQ(ttl.cold_starts, 1u);
    EXPECT_LT(hybrid.idle_gib_hours, ttl.idle_gib_hours / 2) << seed;
    for (const char* ours_name : {"gdsf-prewarm", "next-use-prewarm"}) {
      RunResult ours = Simulate(trace, ours_name, 10 * kGiB, options);
      EXPECT_EQ(ours.cold_starts, 1u) << ours_name;
      EXPECT_GE(ours.prewarms, 40u) << ours_name;
      EXPECT_LT(ours.idle_gib_hours, ttl.idle_gib_hours / 2) << ours_name;
    }
  }
}

TEST(TimedReplay, APrewarmNeverDelaysADemandLoad) {
  // One slot. A prewarm of p (4e9 bytes) starts at 0; a demand for a (1e9)
  // arrives at 500 and takes the slot's bandwidth at once: 100 ms latency,
  // then 1000 ms at the full rate, as if no prewarm ran.
  Trace trace =
      MakeTrace({1'000'000'000, 4'000'000'000}, {{500, 0}, {9000, 1}});
  ReplayOptions options = Timed(100, 1);
  RunResult alone = Simulate(trace, "lru", 10 * kGiB, options);
  options.prewarms = {Request{0, 1}};
  RunResult with = Simulate(trace, "lru", 10 * kGiB, options);
  EXPECT_DOUBLE_EQ(alone.wait_ms.max, 4100);  // p, loaded at 9000
  EXPECT_EQ(with.cold_starts, 1u);  // a, which waited 1100 ms as alone
  EXPECT_EQ(with.prewarms, 1u);
  EXPECT_DOUBLE_EQ(with.wait_ms.max, 1100);  // p was ready by 9000
  // Room for only one of them: the prewarm gives way.
  RunResult tight = Simulate(trace, "lru", 4'000'000'000, options);
  EXPECT_DOUBLE_EQ(tight.wait_ms.p50, 1100);
  EXPECT_EQ(tight.prewarms, 0u);
}

// The untimed replay is the limit of an infinitely fast load path: the same
// counts, exactly.
void ExpectSameCounts(const Trace& trace, const std::string& policy,
                      uint64_t capacity) {
  SCOPED_TRACE(policy + " " + FormatBytes(capacity));
  ReplayOptions untimed;
  RunResult a = ReplayUntimed(trace, policy, capacity, untimed);
  RunResult b = Simulate(trace, policy, capacity, Timed(0, 0, kInf));
  EXPECT_FALSE(a.timed);
  EXPECT_TRUE(b.timed);
  EXPECT_EQ(a.hits, b.hits);
  EXPECT_EQ(a.misses, b.misses);
  EXPECT_EQ(a.too_large, b.too_large);
  EXPECT_EQ(a.evictions, b.evictions);
  EXPECT_EQ(a.bytes_loaded, b.bytes_loaded);
  EXPECT_EQ(a.byte_miss_ratio, b.byte_miss_ratio);
  EXPECT_EQ(b.wait_ms.max, 0);
}

TEST(TimedReplay, InfinitelyFastLoadsGiveTheUntimedCountsOnTheSharedTrace) {
  Trace trace =
      ReadAzureFunctionsTrace(std::string(MODELCACHE_SHARED_DATA) +
                                  "/traces/azure-functions-2019-100fn.csv",
                              0, nullptr, 42);
  // Few pairs per trace: each takes seconds under ThreadSanitizer.
  ExpectSameCounts(trace, "gdsf", 32 * kGiB);
  // next-use learns from the clock: trace time in both replays.
  ExpectSameCounts(trace, "next-use", 64 * kGiB);
}

TEST(TimedReplay, InfinitelyFastLoadsGiveTheUntimedCountsOnTheDefaultTrace) {
  Trace trace = GenerateDefaultTrace(42);
  // Belady's: the timed replay passes each request's next use as the hint.
  ExpectSameCounts(trace, "belady", 32 * kGiB);
}

// A load is stamped once, at its end, whether or not anyone joined it: the
// first waiter takes its lease when the load ends, as every other waiter
// does. Default time model (100 ms + 2 GB/s, 4 slots); capacity 3.5 GB.
//   a loads 0..600; b loads 1000..2100; a at 1500 is a hit. At 3000, c
//   needs room: b was last used when its load ended (2100), after a (1500),
//   so LRU evicts a, then b too, since c still does not fit. a at 4000
//   misses.
TEST(TimedReplay, ALoadIsStampedAtItsEndSoLruEvictsTheEarlierHitFirst) {
  Trace trace = MakeTrace({1'000'000'000, 2'000'000'000, 2'000'000'000},
                          {{0, 0}, {1000, 1}, {1500, 0}, {3000, 2}, {4000, 0}});
  std::vector<std::string> evicted;
  ReplayOptions options;
  options.on_event = [&](double, const CacheEvent& e) {
    if (e.type == EventType::kEvicted) evicted.push_back(e.key);
  };
  RunResult r = Simulate(trace, "lru", 3'500'000'000, options);
  EXPECT_EQ(r.hits, 1u);
  EXPECT_EQ(r.misses, 4u);
  EXPECT_EQ(r.evictions, 2u);
  EXPECT_EQ(r.bytes_loaded, 6'000'000'000u);
  EXPECT_THAT(evicted, ElementsAre("a", "b"));
  EXPECT_EQ(r.loads_per_model[0], 2u);
}

// One more request joining b's load does not change what LRU evicts: the
// evictions are the same with and without it.
TEST(TimedReplay, AJoinedRequestDoesNotChangeWhatALoadsStampEvicts) {
  auto evictions = [](std::vector<std::pair<int64_t, uint32_t>> requests) {
    Trace trace = MakeTrace({1'000'000'000, 2'000'000'000, 2'000'000'000},
                            std::move(requests));
    std::vector<std::string> evicted;
    ReplayOptions options;
    options.on_event = [&](double, const CacheEvent& e) {
      if (e.type == EventType::kEvicted) evicted.push_back(e.key);
    };
    Simulate(trace, "lru", 3'500'000'000, options);
    return evicted;
  };
  const auto alone =
      evictions({{0, 0}, {1000, 1}, {1500, 0}, {3000, 2}, {4000, 0}});
  const auto joined = evictions(
      {{0, 0}, {1000, 1}, {1050, 1}, {1500, 0}, {3000, 2}, {4000, 0}});
  EXPECT_EQ(joined, alone);
  EXPECT_THAT(joined, ElementsAre("a", "b"));
}

// A load waiting at the head of the queue for room evicts nothing it cannot
// use: z needs 2 GB while x's load holds 2 GB of 3 GB, and the idle i
// (0.5 GB) could never make room, so i stays and its request at 1500 is a
// hit. When x's load ends, z evicts i and x (LRU) and loads.
TEST(TimedReplay, ABlockedQueueHeadDoesNotDrainTheCache) {
  Trace trace = MakeTrace({500'000'000, 2'000'000'000, 2'000'000'000},
                          {{0, 0}, {1000, 1}, {1050, 2}, {1500, 0}});
  trace.models = {"i", "x", "z"};
  std::vector<std::pair<double, std::string>> evicted;
  ReplayOptions options;
  options.on_event = [&](double t, const CacheEvent& e) {
    if (e.type == EventType::kEvicted) evicted.emplace_back(t, e.key);
  };
  RunResult r = Simulate(trace, "lru", 3'000'000'000, options);
  EXPECT_EQ(r.hits, 1u);
  EXPECT_EQ(r.misses, 3u);
  EXPECT_THAT(evicted, ElementsAre(std::pair<double, std::string>{2100, "i"},
                                   std::pair<double, std::string>{2100, "x"}));
}

}  // namespace
}  // namespace modelcache::replay
