// The capacity an SLO needs (FindSloCapacities, slo.cc): answers computed
// by hand on small traces, the rule for waits that are not monotone in
// capacity, resolution, the runs it is given, threads, and bad options.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {
namespace {

using ::testing::HasSubstr;

// Loads take exactly 1 s (no bandwidth limit, no slot limit) and requests
// come 10 s apart, so a request waits 1 s when it misses and 0 when it hits,
// and no two loads overlap.
ReplayOptions OneSecondLoads() {
  ReplayOptions options;
  options.timed = true;
  options.time.bandwidth_bytes_per_second =
      std::numeric_limits<double>::infinity();
  options.time.latency_ms = 1000;
  options.time.slots = 0;
  return options;
}

// Model c (50 B) `c_requests` times, then a (300 B) and b (400 B)
// alternating, `pairs` times. Below 700 B a and b do not both fit and every
// request for them misses; from 700 B on only the first of each misses (and
// at most one more while c leaves). So with c once and pairs >= 500, p99
// wait is 1 s below 700 B and 0 from 700 B on: the answer is 700 B exactly.
Trace HotPair(int pairs, int c_requests = 1) {
  Trace trace;
  trace.models = {"a", "b", "c"};
  trace.sizes = {300, 400, 50};
  int64_t t = 0;
  trace.requests.push_back({t, 2});
  for (int i = 1; i < c_requests; ++i)
    trace.requests.push_back({t += 10000, 2});
  for (int i = 0; i < pairs; ++i) {
    trace.requests.push_back({t += 10000, 0});
    trace.requests.push_back({t += 10000, 1});
  }
  return trace;
}

SloSearchOptions Exact(double slo_ms, double percentile = 99) {
  SloSearchOptions slo;
  slo.slo_ms = slo_ms;
  slo.percentile = percentile;
  slo.resolution_fraction = 0;
  slo.resolution_bytes = 1;
  return slo;
}

bool Meets(const SloProbe& p, double slo_ms) {
  return p.served_all && p.wait_ms <= slo_ms;
}

TEST(SloSearch, FindsTheCapacityAtWhichTheHotPairFits) {
  const Trace trace = HotPair(500);
  const std::vector<std::string> policies = {"lru", "gdsf", "next-use",
                                             "belady"};
  const auto answers = FindSloCapacities(trace, policies, OneSecondLoads(),
                                         Exact(500), /*threads=*/2);
  ASSERT_EQ(answers.size(), policies.size());
  for (size_t i = 0; i < answers.size(); ++i) {
    const SloAnswer& a = answers[i];
    EXPECT_EQ(a.policy, policies[i]);
    ASSERT_TRUE(a.capacity_bytes) << a.policy;
    EXPECT_EQ(*a.capacity_bytes, 700u) << a.policy;
    EXPECT_EQ(a.failing_bytes, 699u) << a.policy;
    EXPECT_TRUE(a.monotone) << a.policy;
    // The probes it reports are the ones that decided: 699 failed with 1 s,
    // 700 and the sum of all models (750) met it.
    auto at = [&](uint64_t capacity) {
      return std::find_if(
          a.probes.begin(), a.probes.end(),
          [&](const SloProbe& p) { return p.capacity_bytes == capacity; });
    };
    ASSERT_NE(at(699), a.probes.end()) << a.policy;
    EXPECT_EQ(at(699)->wait_ms, 1000) << a.policy;
    ASSERT_NE(at(700), a.probes.end()) << a.policy;
    EXPECT_EQ(at(700)->wait_ms, 0) << a.policy;
    ASSERT_NE(at(750), a.probes.end()) << a.policy;
    EXPECT_TRUE(std::is_sorted(a.probes.begin(), a.probes.end(),
                               [](const SloProbe& x, const SloProbe& y) {
                                 return x.capacity_bytes < y.capacity_bytes;
                               }));
    // Nothing below the largest requested model (400 B) is replayed.
    EXPECT_GE(a.probes.front().capacity_bytes, 400u) << a.policy;
  }
}

TEST(SloSearch, AnswersNoneWhenNoCapacityMeetsIt) {
  // Every request is for a model not seen before, so every request waits
  // 1 s at any capacity.
  Trace trace;
  for (int m = 0; m < 20; ++m) {
    trace.models.push_back("m" + std::to_string(m));
    trace.sizes.push_back(100 + 10 * m);
    trace.requests.push_back({10000 * m, static_cast<uint32_t>(m)});
  }
  const uint64_t all =
      std::accumulate(trace.sizes.begin(), trace.sizes.end(), uint64_t{0});
  const auto answers =
      FindSloCapacities(trace, {"lru"}, OneSecondLoads(), Exact(999), 2);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_FALSE(answers[0].capacity_bytes);
  EXPECT_EQ(answers[0].failing_bytes, all);
  ASSERT_FALSE(answers[0].probes.empty());
  EXPECT_EQ(answers[0].probes.back().capacity_bytes, all);
  EXPECT_EQ(answers[0].probes.back().wait_ms, 1000);
  // A 1 s SLO is met at once: by the largest model alone.
  const auto met =
      FindSloCapacities(trace, {"lru"}, OneSecondLoads(), Exact(1000), 2);
  ASSERT_TRUE(met[0].capacity_bytes);
  EXPECT_EQ(*met[0].capacity_bytes, 290u);
}

TEST(SloSearch, AnswersTheLargestModelWhenEveryCapacityThatFitsItMeetsIt) {
  // The longest wait is the first load's, 1 s, at any capacity.
  const Trace trace = HotPair(50);
  const auto answers = FindSloCapacities(trace, {"lru"}, OneSecondLoads(),
                                         Exact(1000, /*percentile=*/100), 1);
  ASSERT_TRUE(answers[0].capacity_bytes);
  EXPECT_EQ(*answers[0].capacity_bytes, 400u);
  EXPECT_EQ(answers[0].failing_bytes, 399u);
}

TEST(SloSearch, ThePercentileIsOfTheWaits) {
  // 600 requests for c, then 200 pairs: 1001 requests. Below 700 B the 400
  // requests for a and b and c's first wait, 401 in all: p50 (the 501st
  // shortest wait) is 0, p70 (the 701st) is 1 s. From 700 B on at most 4
  // wait. So p50 is met by the largest model alone (400 B), p70 from 700 B.
  const Trace trace = HotPair(200, 600);
  auto p50 =
      FindSloCapacities(trace, {"lru"}, OneSecondLoads(), Exact(500, 50), 2);
  ASSERT_TRUE(p50[0].capacity_bytes);
  EXPECT_EQ(*p50[0].capacity_bytes, 400u);
  auto p70 =
      FindSloCapacities(trace, {"lru"}, OneSecondLoads(), Exact(500, 70), 2);
  ASSERT_TRUE(p70[0].capacity_bytes);
  EXPECT_EQ(*p70[0].capacity_bytes, 700u);
}

TEST(SloSearch, TheAnswerIsWithinTheResolutionOfAFailingProbe) {
  const Trace trace = HotPair(500);
  for (const auto& [fraction, bytes] : std::vector<std::pair<double, uint64_t>>{
           {0, 64}, {0.05, 0}, {0.01, 8}}) {
    SloSearchOptions slo = Exact(500);
    slo.resolution_fraction = fraction;
    slo.resolution_bytes = bytes;
    const auto a =
        FindSloCapacities(trace, {"lru"}, OneSecondLoads(), slo, 2)[0];
    ASSERT_TRUE(a.capacity_bytes);
    const uint64_t answer = *a.capacity_bytes;
    const uint64_t allowed = std::max<uint64_t>(
        bytes, static_cast<uint64_t>(std::ceil(fraction * answer)));
    EXPECT_GE(answer, 700u);
    EXPECT_LT(a.failing_bytes, 700u);
    EXPECT_LE(answer - a.failing_bytes, allowed) << fraction << " " << bytes;
  }
}

TEST(SloSearch, RunsItIsGivenAreProbes) {
  const Trace trace = HotPair(500);
  const ReplayOptions options = OneSecondLoads();
  const auto without =
      FindSloCapacities(trace, {"lru"}, options, Exact(500), 2);
  ASSERT_TRUE(without[0].capacity_bytes);
  // Given runs inside the range, and given every run the sweep would make
  // (the sum of all models, 750 B, and nothing else: 400 to 750 B is less
  // than twice): the search still bisects down to the same answer.
  for (const std::vector<uint64_t>& given :
       {std::vector<uint64_t>{500, 720}, std::vector<uint64_t>{600, 750}}) {
    const auto known = ReplayAll(trace, {"lru", "gdsf"}, given, options, 2);
    const auto with =
        FindSloCapacities(trace, {"lru"}, options, Exact(500), 2, known);
    ASSERT_TRUE(with[0].capacity_bytes);
    EXPECT_EQ(*with[0].capacity_bytes, *without[0].capacity_bytes);
    EXPECT_EQ(with[0].failing_bytes, 699u);
    std::vector<uint64_t> probed;
    for (const SloProbe& p : with[0].probes) probed.push_back(p.capacity_bytes);
    for (uint64_t c : given) EXPECT_THAT(probed, ::testing::Contains(c));
  }
}

// Four models (a 1 B, b 2 B, c 3 B, d 1 B) requested c c c b a b d d d a,
// 10 s apart. At 4 B every model misses once: after c's requests, b evicts
// c, and then a, b and d (4 B) fit together. At 5 and 6 B c and b fit
// together, and gdsf's choices among them cost a fifth miss (replayed
// below). With one-second loads, p60 (the 6th shortest of 10
// waits) is 0 with at most 4 misses and 1 s with 5: so the SLO is met at 4
// B, missed at 5 and 6 B, and met again at 7 B, the sum of all models.
Trace NotMonotone() {
  Trace trace;
  trace.models = {"a", "b", "c", "d"};
  trace.sizes = {1, 2, 3, 1};
  const std::string order = "cccbabddda";
  for (size_t i = 0; i < order.size(); ++i) {
    trace.requests.push_back({static_cast<int64_t>(i) * 10000,
                              static_cast<uint32_t>(order[i] - 'a')});
  }
  return trace;
}

TEST(SloSearch, AMetCapacityBelowAFailedOneIsNotTheAnswer) {
  const Trace trace = NotMonotone();
  const ReplayOptions options = OneSecondLoads();
  const SloSearchOptions slo = Exact(500, /*percentile=*/60);
  // The premise, replayed: 4 misses at 4 B and 7 B, 5 at 5 and 6 B.
  const auto runs = ReplayAll(trace, {"gdsf"}, {4, 5, 6, 7}, options, 1);
  ASSERT_EQ(runs.size(), 4u);
  for (const RunResult& r : runs) {
    const bool met = r.capacity_bytes == 4 || r.capacity_bytes == 7;
    ASSERT_EQ(r.misses, met ? 4u : 5u) << r.capacity_bytes;
    ASSERT_EQ(WaitAtPercentile(r, 60), met ? 0 : 1000) << r.capacity_bytes;
  }

  // Given the runs at 4 and 5 B, the search answers 7 B: 5 B failed above
  // 4 B, so 4 B is not an answer, and a smaller capacity that met the SLO
  // anyway is reported.
  const auto given =
      FindSloCapacities(trace, {"gdsf"}, options, slo, 2, {runs[0], runs[1]});
  ASSERT_TRUE(given[0].capacity_bytes);
  EXPECT_EQ(*given[0].capacity_bytes, 7u);
  EXPECT_EQ(given[0].failing_bytes, 6u);
  EXPECT_FALSE(given[0].monotone);
  std::vector<uint64_t> probed;
  for (const SloProbe& p : given[0].probes) probed.push_back(p.capacity_bytes);
  EXPECT_THAT(probed, ::testing::IsSupersetOf({4u, 5u, 6u, 7u}));

  // On its own, the sweep replays 7 B (the sum of all models) and 5 B (so
  // that probes from the largest model, 3 B, up are at most twice apart),
  // and bisection then 6 B. It never replays 4 B: the same answer, with
  // nothing below it to report.
  const auto alone = FindSloCapacities(trace, {"gdsf"}, options, slo, 2);
  ASSERT_TRUE(alone[0].capacity_bytes);
  EXPECT_EQ(*alone[0].capacity_bytes, 7u);
  EXPECT_EQ(alone[0].failing_bytes, 6u);
  EXPECT_TRUE(alone[0].monotone);
  probed.clear();
  for (const SloProbe& p : alone[0].probes) probed.push_back(p.capacity_bytes);
  EXPECT_THAT(probed, ::testing::ElementsAre(5u, 6u, 7u));
}

// A trace with loads that overlap and queue: Zipf-like popularity over 24
// models of assorted sizes, requests 0-400 ms apart, loads at 1 GB/s over 2
// slots.
Trace Busy(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Trace trace;
  for (int m = 0; m < 24; ++m) {
    trace.models.push_back("m" + std::to_string(m));
    trace.sizes.push_back((uint64_t{50} + rng() % 950) << 20);
  }
  std::vector<double> weights;
  for (int m = 0; m < 24; ++m) weights.push_back(1.0 / std::pow(m + 1, 1.1));
  std::discrete_distribution<uint32_t> pick(weights.begin(), weights.end());
  int64_t t = 0;
  for (int i = 0; i < 3000; ++i) {
    t += static_cast<int64_t>(rng() % 400);
    trace.requests.push_back({t, pick(rng)});
  }
  return trace;
}

TEST(SloSearch, AnswersFollowTheRuleAndDoNotDependOnThreads) {
  const Trace trace = Busy(7);
  ReplayOptions options;
  options.time.bandwidth_bytes_per_second = 1e9;
  options.time.latency_ms = 50;
  options.time.slots = 2;
  SloSearchOptions slo;
  slo.slo_ms = 2000;
  slo.resolution_bytes = 16 << 20;
  slo.curve_slo_ms = {1000, 4000, 8000};
  const std::vector<std::string> policies = {"lru", "gdsf", "next-use"};
  const auto one = FindSloCapacities(trace, policies, options, slo, 1);
  const auto four = FindSloCapacities(trace, policies, options, slo, 4);
  ASSERT_EQ(one.size(), four.size());
  uint64_t largest = 0;
  for (uint64_t s : trace.sizes) largest = std::max(largest, s);
  for (size_t i = 0; i < one.size(); ++i) {
    const SloAnswer& a = one[i];
    EXPECT_EQ(a.capacity_bytes, four[i].capacity_bytes) << a.policy;
    ASSERT_EQ(a.probes.size(), four[i].probes.size()) << a.policy;
    for (size_t k = 0; k < a.probes.size(); ++k) {
      EXPECT_EQ(a.probes[k].capacity_bytes, four[i].probes[k].capacity_bytes);
      EXPECT_EQ(a.probes[k].wait_ms, four[i].probes[k].wait_ms);
    }
    EXPECT_EQ(a.curve, four[i].curve) << a.policy;
    ASSERT_TRUE(a.capacity_bytes) << a.policy;
    // The rule: every probe at or above the answer met the SLO, the failing
    // end is a probe that failed (or the largest model less one byte), and
    // they are within the resolution.
    bool failing_seen = a.failing_bytes == largest - 1;
    bool met_below = false;
    for (const SloProbe& p : a.probes) {
      if (p.capacity_bytes >= *a.capacity_bytes) {
        EXPECT_TRUE(Meets(p, slo.slo_ms))
            << a.policy << " " << p.capacity_bytes;
      } else if (p.capacity_bytes == a.failing_bytes) {
        failing_seen = true;
        EXPECT_FALSE(Meets(p, slo.slo_ms)) << a.policy;
      } else if (p.capacity_bytes > a.failing_bytes) {
        ADD_FAILURE() << a.policy << ": a probe inside the bracket";
      } else if (Meets(p, slo.slo_ms)) {
        met_below = true;
      }
    }
    EXPECT_TRUE(failing_seen) << a.policy;
    EXPECT_EQ(a.monotone, !met_below) << a.policy;
    EXPECT_LE(*a.capacity_bytes - a.failing_bytes,
              std::max<uint64_t>(slo.resolution_bytes,
                                 std::ceil(0.01 * *a.capacity_bytes)))
        << a.policy;
    // The curve's answers follow the same rule on the same probes; a longer
    // SLO never needs more.
    ASSERT_EQ(a.curve.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      const SloAnswer from_probes =
          SloAnswerFromProbes(a.probes, largest, slo.curve_slo_ms[k]);
      EXPECT_EQ(a.curve[k], from_probes.capacity_bytes) << a.policy;
    }
    if (a.curve[0] && a.curve[1]) {
      EXPECT_LE(*a.curve[1], *a.curve[0]);
    }
    if (a.curve[1] && a.curve[2]) {
      EXPECT_LE(*a.curve[2], *a.curve[1]);
    }
  }
}

TEST(SloAnswerFromProbes, IsTheSmallestCapacityAboveWhichEveryProbeMetIt) {
  auto probe = [](uint64_t capacity, double wait_ms, bool served_all = true) {
    return SloProbe{capacity, wait_ms, served_all};
  };
  // 200 met the SLO, 300 did not: the wait is not monotone, and the answer
  // is 400, above the failing 300.
  const SloAnswer a =
      SloAnswerFromProbes({probe(500, 100), probe(100, 2000), probe(300, 1500),
                           probe(400, 200), probe(200, 500)},
                          /*largest_model=*/80, /*slo_ms=*/1000);
  ASSERT_TRUE(a.capacity_bytes);
  EXPECT_EQ(*a.capacity_bytes, 400u);
  EXPECT_EQ(a.failing_bytes, 300u);
  EXPECT_FALSE(a.monotone);
  ASSERT_EQ(a.probes.size(), 5u);
  EXPECT_EQ(a.probes.front().capacity_bytes, 100u);

  // A probe that did not serve every request (one was rejected) fails
  // whatever its wait.
  const SloAnswer rejected = SloAnswerFromProbes(
      {probe(100, 0, /*served_all=*/false), probe(200, 900)}, 80, 1000);
  EXPECT_EQ(rejected.capacity_bytes, 200u);
  EXPECT_EQ(rejected.failing_bytes, 100u);
  EXPECT_TRUE(rejected.monotone);

  // The largest probe failed: none, though a smaller one met it.
  const SloAnswer none =
      SloAnswerFromProbes({probe(100, 10), probe(200, 5000)}, 80, 1000);
  EXPECT_FALSE(none.capacity_bytes);
  EXPECT_EQ(none.failing_bytes, 200u);
  EXPECT_FALSE(none.monotone);

  // Every probe met it: the failing end is the largest model less a byte.
  const SloAnswer all = SloAnswerFromProbes({probe(100, 10)}, 80, 1000);
  EXPECT_EQ(all.capacity_bytes, 100u);
  EXPECT_EQ(all.failing_bytes, 79u);
  EXPECT_TRUE(all.monotone);

  EXPECT_FALSE(SloAnswerFromProbes({}, 80, 1000).capacity_bytes);
}

TEST(SloSearch, WaitAtPercentileIsTheReplaysNearestRankPercentile) {
  const Trace trace = Busy(3);
  ReplayOptions options;
  options.time.bandwidth_bytes_per_second = 1e9;
  const RunResult r = Simulate(trace, "lru", uint64_t{3} << 30, options);
  ASSERT_EQ(r.wait_quantiles.size(), 1000u);
  EXPECT_EQ(WaitAtPercentile(r, 50), r.wait_ms.p50);
  EXPECT_EQ(WaitAtPercentile(r, 99), r.wait_ms.p99);
  EXPECT_EQ(WaitAtPercentile(r, 99.9), r.wait_ms.p999);
  EXPECT_EQ(WaitAtPercentile(r, 100), r.wait_ms.max);
  EXPECT_EQ(WaitAtPercentile(r, 90), r.wait_quantiles[899]);
  EXPECT_EQ(WaitAtPercentile(r, 0.1), r.wait_quantiles[0]);
  EXPECT_EQ(PercentileName(99), "p99");
  EXPECT_EQ(PercentileName(99.9), "p99.9");
  EXPECT_EQ(PercentileName(100), "max");
}

TEST(SloSearch, BadOptionsAreClearErrors) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto error_of = [](const SloSearchOptions& slo) -> std::string {
    try {
      ValidateSloOptions(slo);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return e.what();
    }
    return "";
  };
  for (double ms : {0.0, -5.0, nan, inf}) {
    SloSearchOptions slo;
    slo.slo_ms = ms;
    EXPECT_THAT(error_of(slo), HasSubstr("the SLO must be a positive, finite"));
    slo = {};
    slo.curve_slo_ms = {1000, ms};
    EXPECT_THAT(error_of(slo), HasSubstr("a curve SLO must be"));
  }
  for (double p : {0.0, -1.0, 100.1, 99.95, nan}) {
    SloSearchOptions slo;
    slo.percentile = p;
    EXPECT_THAT(error_of(slo), HasSubstr("percentile must be in (0, 100]"));
  }
  for (auto [fraction, bytes] : std::vector<std::pair<double, uint64_t>>{
           {0, 0}, {nan, 256}, {inf, 0}, {-0.01, 256}}) {
    SloSearchOptions slo;
    slo.resolution_fraction = fraction;
    slo.resolution_bytes = bytes;
    EXPECT_THAT(error_of(slo), HasSubstr("the SLO's resolution must be"));
  }
  EXPECT_EQ(error_of({}), "");

  const Trace trace = HotPair(5);
  EXPECT_THROW(FindSloCapacities(trace, {"fifo"}, OneSecondLoads(), {}, 1),
               Error);
  SloSearchOptions zero;
  zero.slo_ms = 0;
  EXPECT_THROW(FindSloCapacities(trace, {"lru"}, OneSecondLoads(), zero, 1),
               Error);
}

}  // namespace
}  // namespace modelcache::replay
