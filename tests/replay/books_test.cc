// The replay's books (src/replay/books.h), from their contract: what they
// integrate over the trace's span, how they reduce counts to ratios, and the
// waits' percentiles in bounded memory (WaitDistribution: exact up to a
// limit, then never low and at most 0.1% high).
#include "../../src/replay/books.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {
namespace {

constexpr double kGiB = 1073741824.0;

std::vector<double> Quantiles() { return {0.0, 0.5, 0.9, 0.99, 0.999, 1.0}; }

std::vector<double> Exact(std::vector<double> waits,
                          const std::vector<double>& p) {
  std::sort(waits.begin(), waits.end());
  std::vector<double> out;
  for (double q : p) out.push_back(Percentile(waits, q));
  return out;
}

TEST(WaitDistributionTest, ExactWhileAtMostTheLimitAreNotZero) {
  std::mt19937_64 rng(7);
  std::exponential_distribution<double> wait(1.0 / 250.0);
  std::vector<double> waits;
  WaitDistribution d(/*max_exact=*/1000);
  for (int i = 0; i < 3000; ++i) {
    // Two in three requests are hits: zeros are counted, not kept.
    const double ms = i % 3 == 0 ? wait(rng) : 0.0;
    waits.push_back(ms);
    d.Add(ms);
  }
  EXPECT_TRUE(d.exact());
  EXPECT_EQ(d.count(), 3000u);
  EXPECT_EQ(std::move(d).Percentiles(Quantiles()), Exact(waits, Quantiles()));
}

TEST(WaitDistributionTest,
     BeyondTheLimitNeverLowAndAtMostATenthOfAPercentHigh) {
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> wait(3.0, 2.5);  // ms, a long tail
  std::vector<double> waits;
  WaitDistribution d(/*max_exact=*/100);
  for (int i = 0; i < 50000; ++i) {
    const double ms = i % 4 == 0 ? 0.0 : wait(rng);
    waits.push_back(ms);
    d.Add(ms);
  }
  EXPECT_FALSE(d.exact());
  EXPECT_EQ(d.count(), 50000u);
  const double longest = *std::max_element(waits.begin(), waits.end());
  EXPECT_EQ(d.max(), longest);
  const std::vector<double> p = Quantiles();
  const std::vector<double> exact = Exact(waits, p);
  const std::vector<double> got = std::move(d).Percentiles(p);
  ASSERT_EQ(got.size(), p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    SCOPED_TRACE(p[i]);
    EXPECT_GE(got[i], exact[i]);
    EXPECT_LE(got[i], exact[i] * 1.001);
    EXPECT_LE(got[i], longest);
  }
}

TEST(WaitDistributionTest, NoWaitsGiveZeros) {
  WaitDistribution d(10);
  EXPECT_EQ(std::move(d).Percentiles({0.5, 0.99}),
            (std::vector<double>{0.0, 0.0}));
}

TraceHeader TwoModels() {
  TraceHeader h;
  h.models = {"small", "large"};
  h.sizes = {uint64_t{1} << 30, uint64_t{3} << 30};
  h.requests = 4;
  h.t_first_ms = 0;
  h.t_last_ms = 3600000;  // one hour
  return h;
}

TEST(BooksTest, IntegratesTheStateOverTheSpanOnly) {
  const TraceHeader trace = TwoModels();
  Books books(trace, 0, 3600000, /*max_exact_waits=*/1000);
  Books::State state;
  state.idle_bytes = uint64_t{2} << 30;
  state.loading = true;
  state.queued = 3;
  state.resident_bytes = uint64_t{4} << 30;
  // Half an hour before the span is not counted; the first half hour is.
  books.Advance(-1800000, 1800000, state);
  state = {};
  state.resident_bytes = uint64_t{4} << 30;
  // The second half hour, and beyond the span (not counted).
  books.Advance(1800000, 7200000, state);
  const RunResult r =
      std::move(books).Finish(CacheStats{}, TimeModel{}, /*timed=*/true);
  EXPECT_DOUBLE_EQ(r.idle_gib_hours, 1.0);  // 2 GiB for half an hour
  EXPECT_DOUBLE_EQ(r.disk_busy_ratio, 0.5);
  EXPECT_DOUBLE_EQ(r.load_queue_mean, 1.5);
  ASSERT_EQ(r.bins.size(), 240u);
  for (const auto& bin : r.bins) {
    EXPECT_DOUBLE_EQ(bin.mean_bytes, 4 * kGiB);
  }
}

TEST(BooksTest, CountsOnlyTheRequestsItIsToldOfAndReducesThemToRatios) {
  const TraceHeader trace = TwoModels();
  Books books(trace, 0, 3600000, 1000);
  books.ColdStart(1);  // large: loads, waits 2 s
  books.LoadStarted(1);
  books.LoadEnded(1600, /*prewarm=*/false);
  books.Waited(2000);
  books.Hit(1);
  books.Waited(0);
  books.Hit(0);
  books.Waited(0);
  books.TooLarge(0);  // counted as a miss, not as served
  CacheStats cache;
  cache.bytes_loaded = uint64_t{3} << 30;
  cache.evictions = 2;
  const RunResult r = std::move(books).Finish(cache, TimeModel{}, true);
  EXPECT_EQ(r.requests, 4u);
  EXPECT_EQ(r.hits, 2u);
  EXPECT_EQ(r.misses, 2u);
  EXPECT_EQ(r.too_large, 1u);
  EXPECT_EQ(r.cold_starts, 1u);
  EXPECT_DOUBLE_EQ(r.hit_ratio, 0.5);
  EXPECT_DOUBLE_EQ(r.cold_start_ratio, 0.25);
  // Missed: 3 GiB (the cold start) + 1 GiB (too large) of 8 GiB requested.
  EXPECT_DOUBLE_EQ(r.byte_miss_ratio, 0.5);
  EXPECT_EQ(r.loads_per_model, (std::vector<uint32_t>{0, 1}));
  EXPECT_DOUBLE_EQ(r.load_seconds, 1.6);
  EXPECT_EQ(r.bytes_loaded, uint64_t{3} << 30);
  EXPECT_EQ(r.evictions, 2u);
  // Three waits served: 0, 0 and 2 s.
  EXPECT_EQ(r.wait_ms.p50, 0);
  EXPECT_EQ(r.wait_ms.max, 2000);
  // Per model cold-start ratios 0 (small) and 1/2 (large); p75 by nearest
  // rank of two is the larger.
  EXPECT_DOUBLE_EQ(r.p75_model_cold_start_ratio, 0.5);
}

TEST(BooksTest, ALinkBusyMostOfTheSpanIsOverloaded) {
  const TraceHeader trace = TwoModels();
  TimeModel time;
  time.bandwidth_bytes_per_second = 1e6;  // 1 MB/s
  CacheStats cache;
  // 3,240 s of the link in a span of 3,600 s: 90%.
  cache.bytes_loaded = 3240ull * 1000000ull;
  {
    Books books(trace, 0, 3600000, 10);
    EXPECT_TRUE(std::move(books).Finish(cache, time, true).overloaded);
  }
  cache.bytes_loaded -= 1000000;
  {
    Books books(trace, 0, 3600000, 10);
    EXPECT_FALSE(std::move(books).Finish(cache, time, true).overloaded);
  }
  {
    cache.bytes_loaded += 2000000;
    Books books(trace, 0, 3600000, 10);  // untimed replays never are
    EXPECT_FALSE(std::move(books).Finish(cache, time, false).overloaded);
  }
}

}  // namespace
}  // namespace modelcache::replay
