// modelcache replay in trace time: how misses wait for room. A miss whose
// model fits loads at once, whatever waits for room (no head-of-line
// blocking, as in the cache, whose Budget::Reserve has no queue).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"
#include "nlohmann/json.hpp"

namespace modelcache::replay {
namespace {

constexpr uint64_t kGB = 1'000'000'000;

// 1 GB/s and 100 ms a load: a load of b bytes takes 100 + b / 1e6 ms.
SimulateOptions OnePathOptions(double hold_ms) {
  SimulateOptions options;
  options.time = TimeModel{1e9, 100, /*slots=*/4};
  options.hold_ms = hold_ms;
  return options;
}

// Model a every `period_ms` from 0 to `end_ms`, plus the given requests;
// sorted by time, then model.
Trace EveryPeriod(std::vector<uint64_t> sizes, int64_t period_ms,
                  int64_t end_ms,
                  std::vector<std::pair<int64_t, uint32_t>> others) {
  Trace trace;
  for (size_t m = 0; m < sizes.size(); ++m) {
    trace.models.push_back(std::string(1, static_cast<char>('A' + m)));
  }
  trace.sizes = std::move(sizes);
  for (int64_t t = 0; t <= end_ms; t += period_ms) others.push_back({t, 0});
  std::sort(others.begin(), others.end());
  for (auto [t, m] : others) trace.requests.push_back(Request{t, m});
  return trace;
}

// Room for 2 GB. A (1 GB) is in continuous use from its load on: every 7 ms
// to 9,996 ms, each request holding its lease 20 ms. B (2 GB) at 200 ms
// waits for room that only A can give. C (0.5 GB) every 50 ms from 1,200 ms
// (after A's load, so that the two loads do not share the link) fits
// beside A: it loads at once and is a hit from then on, never waiting
// behind B.
TEST(RoomWait, AMissThatFitsDoesNotWaitBehindOneThatNeedsRoom) {
  std::vector<std::pair<int64_t, uint32_t>> others = {{200, 1}};
  for (int64_t t = 1200; t <= 10'000; t += 50) others.push_back({t, 2});
  const Trace trace =
      EveryPeriod({kGB, 2 * kGB, kGB / 2}, 7, 10'000, std::move(others));
  ASSERT_EQ(trace.requests.size(), 1429u + 1 + 177);
  SimulateOptions options = OnePathOptions(20);
  options.drain_after_ms = kNeverDrain;  // the wait for room alone
  const RunResult r = Simulate(trace, "lru", 2 * kGB, options);
  EXPECT_EQ(r.rejected, 0u);
  EXPECT_EQ(r.drains, 0u);
  // A's requests up to 1,099 ms join its load (1,100 ms), C's up to 1,750
  // ms join its own (1,200 to 1,800 ms), and B waits: 158 + 12 + 1.
  EXPECT_EQ(r.cold_starts, 171u);
  EXPECT_EQ(r.loads_per_model, (std::vector<uint32_t>{1, 1, 1}));
  EXPECT_EQ(r.bytes_loaded, 3 * kGB + kGB / 2);
  // B gets its room when A's and C's last leases have ended (10,016 and
  // 10,020 ms) and loads for 2,100 ms.
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 10'020 + 2'100 - 200);
  // The 17 longest waits (1% of 1,607) are B's and A's first 16: C's never
  // count.
  EXPECT_DOUBLE_EQ(r.wait_ms.p99, 1100 - 7 * 15);
}

// ---- The drain ----
//
// The starvation scenario: room for one model (1 GB), A every 7 ms from 0 to
// 5,000 ms, each request holding its lease 20 ms, so that A, once loaded,
// is never idle; one request for B at 200 ms. A load takes 10 ms and 100 ms
// of transfer (10 GB/s), so A is resident and in use when B comes.
constexpr double kLoadMs = 110, kLeaseMs = 20;

Trace Starvation() { return EveryPeriod({kGB, kGB}, 7, 5000, {{200, 1}}); }

SimulateOptions StarvationOptions(std::optional<double> drain_after_ms) {
  SimulateOptions options;
  options.time = TimeModel{1e10, 10, /*slots=*/4};
  options.hold_ms = kLeaseMs;
  options.drain_after_ms = drain_after_ms;
  return options;
}

// When each model's loads completed (the cache's kLoaded events).
struct Loads {
  std::vector<std::pair<double, std::string>> at;
  double First(const std::string& key, double after = -1) const {
    for (const auto& [t, k] : at) {
      if (k == key && t > after) return t;
    }
    return -1;
  }
};

RunResult RunWithLoads(const Trace& trace, SimulateOptions options,
                       Loads* loads) {
  options.on_event = [loads](double t, const CacheEvent& e) {
    if (e.type == EventType::kLoaded) loads->at.emplace_back(t, e.key);
  };
  return Simulate(trace, "lru", kGB, options);
}

// drain_after 0 is strict arrival order: B's drain starts at its arrival,
// A's requests from then on queue, and B loads when A's last lease (taken
// at 196 ms) ends at 216 ms. Then A's queued requests wait for room in
// their turn: A's load drains B as soon as B's one lease ends.
TEST(Drain, AtZeroTheWaiterIsServedAfterTheLeasesInUse) {
  Loads loads;
  const RunResult r = RunWithLoads(Starvation(), StarvationOptions(0), &loads);
  EXPECT_EQ(r.rejected, 0u);
  EXPECT_DOUBLE_EQ(loads.First("B"), 216 + kLoadMs);
  // A loads again after B's lease: 326 + 20 ms, then 110 ms.
  EXPECT_DOUBLE_EQ(loads.First("A", 216), 346 + kLoadMs);
  // B's drain, then A's.
  EXPECT_EQ(r.drains, 2u);
  EXPECT_EQ(r.loads_per_model, (std::vector<uint32_t>{2, 1}));
  EXPECT_EQ(r.evictions, 2u);
  // The longest wait is A's first request queued behind B's drain (203 ms).
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 456 - 203);
  EXPECT_EQ(r.drain_after_ms, std::optional<double>(0));
}

// inf is today's behaviour: A's requests overtake B for as long as they
// come, and B loads only when A's traffic is over (its last request at
// 4,998 ms holds until 5,018 ms).
TEST(Drain, AtInfinityTheWaiterWaitsForTheTrafficToEnd) {
  Loads loads;
  const RunResult r =
      RunWithLoads(Starvation(), StarvationOptions(kNeverDrain), &loads);
  EXPECT_EQ(r.drains, 0u);
  EXPECT_DOUBLE_EQ(loads.First("B"), 5018 + kLoadMs);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 5018 + kLoadMs - 200);
  EXPECT_EQ(r.loads_per_model, (std::vector<uint32_t>{1, 1}));
}

// B is served within drain_after, plus the longest lease in use when its
// drain began, plus its own load, however busy A is; and A's requests go on
// after it. For drain_after 0, a few values, and the default.
TEST(Drain, TheWaiterIsServedWithinTheBound) {
  for (const std::optional<double> drain_after :
       {std::optional<double>(0), std::optional<double>(50),
        std::optional<double>(1000), std::optional<double>()}) {
    const double after =
        drain_after ? *drain_after : DefaultDrainAfterMs(kLoadMs);
    SCOPED_TRACE(after);
    Loads loads;
    const RunResult r =
        RunWithLoads(Starvation(), StarvationOptions(drain_after), &loads);
    EXPECT_EQ(r.rejected, 0u);
    const double b_served = loads.First("B");
    EXPECT_GT(b_served, 200);
    EXPECT_LE(b_served - 200, after + kLeaseMs + kLoadMs);
    // A is loaded again after B, and its requests are served to the end.
    EXPECT_GT(loads.First("A", b_served), b_served);
    EXPECT_GE(r.drains, 1u);
    EXPECT_EQ(r.requests, 715u + 1);
  }
}

// The default weighs the waiter's load as a cache does: what the node last
// measured loading that model, and the 1 s floor for one never loaded (not
// the load its time model would give it). Room for one of A and B (1 GB
// each, 1,100 ms to load); A is in continuous use. B's first wait drains
// after the floor; its second, after four times the load it measured.
TEST(Drain, ByDefaultAWaitIsOvertakenForFourTimesItsModelsLastLoad) {
  constexpr double kBigLoadMs = 1100;
  Loads loads;
  SimulateOptions options = OnePathOptions(kLeaseMs);
  const RunResult r =
      RunWithLoads(EveryPeriod({kGB, kGB}, 7, 20'000, {{200, 1}, {10'000, 1}}),
                   options, &loads);
  EXPECT_EQ(r.rejected, 0u);
  const double first = loads.First("B");
  EXPECT_GT(first, 200 + 1000 + kBigLoadMs);
  EXPECT_LE(first, 200 + 1000 + kLeaseMs + kBigLoadMs);
  const double second = loads.First("B", 10'000);
  EXPECT_GT(second, 10'000 + 4 * kBigLoadMs + kBigLoadMs);
  EXPECT_LE(second, 10'000 + 4 * kBigLoadMs + kLeaseMs + kBigLoadMs);
}

// A waiter that leaves (SimulateOptions::max_wait_ms) ends its drain: A's
// leases here last 1,000 ms, longer than B waits (300 ms), so B leaves at
// 500 ms with A still leased. Nothing is evicted, and A's requests queued
// behind the drain are admitted then as hits, with the waits they had.
TEST(Drain, AWaiterThatLeavesEndsItsDrain) {
  SimulateOptions options = StarvationOptions(0);
  options.hold_ms = 1000;
  options.max_wait_ms = 300;
  Loads loads;
  const RunResult r = RunWithLoads(Starvation(), options, &loads);
  EXPECT_EQ(r.drains, 1u);
  EXPECT_EQ(r.rejected, 1u);  // B
  EXPECT_EQ(r.evictions, 0u);
  EXPECT_EQ(r.loads_per_model, (std::vector<uint32_t>{1, 0}));
  EXPECT_EQ(loads.First("B"), -1);
  // A's first request queued behind the drain came at 203 ms and was
  // admitted at 500 ms.
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 500 - 203);
  EXPECT_EQ(r.hits, 715u - /*A's load*/ 16);
}

// Requests queued behind a drain may leave too. B is asked for at 200 and
// at 300 ms; every lease lasts 1,000 ms and a request leaves after 600 ms.
// B's drain starts at 200 ms and lasts while someone waits for B: to 900
// ms, when the second request for B leaves (A's lease taken at 196 ms is
// still out). A's requests queued behind it from 203 to 294 ms leave first
// (803 to 894 ms); those from 301 ms on are admitted at 900 ms as hits.
TEST(Drain, RequestsQueuedBehindADrainMayLeave) {
  SimulateOptions options = StarvationOptions(0);
  options.hold_ms = 1000;
  options.max_wait_ms = 600;
  Loads loads;
  const RunResult r = RunWithLoads(
      EveryPeriod({kGB, kGB}, 7, 5000, {{200, 1}, {300, 1}}), options, &loads);
  EXPECT_EQ(r.requests, 717u);
  EXPECT_EQ(r.drains, 1u);
  EXPECT_EQ(r.rejected, 2u + 14);
  EXPECT_EQ(r.evictions, 0u);
  EXPECT_EQ(loads.First("B"), -1);
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 900 - 301);
  // Each request is a hit or a cold start (those that left among them).
  EXPECT_EQ(r.hits + r.cold_starts, 717u);
}

// The bytes a drain frees, and the free bytes its waiter needs beside
// them, are the waiter's alone. Room for 2 GB: A (1 GB) in continuous use;
// B (2 GB) at 200 ms drains A at once (drain_after 0) and is owed the free
// 1 GB as well; C (0.5 GB) at 205 ms would fit in that free gigabyte but
// may not take it: B loads when A's last lease ends (216 ms), and C only
// after B.
TEST(Drain, OtherMissesUseOnlyBytesNoOneIsOwed) {
  Loads loads;
  SimulateOptions options = StarvationOptions(0);
  options.on_event = [&loads](double t, const CacheEvent& e) {
    if (e.type == EventType::kLoaded) loads.at.emplace_back(t, e.key);
  };
  const RunResult r = Simulate(
      EveryPeriod({kGB, 2 * kGB, kGB / 2}, 7, 1000, {{200, 1}, {205, 2}}),
      "lru", 2 * kGB, options);
  EXPECT_EQ(r.rejected, 0u);
  EXPECT_DOUBLE_EQ(loads.First("B"), 216 + 10 + 200);
  EXPECT_GT(loads.First("C"), loads.First("B"));
}

// The drain's waiter takes the room of a model outside its set that goes
// idle, as the budget's drain does, rather than wait for its set's lease.
// Room for 2 GB: A (1 GB) at 0 ms holds its lease 500 ms; C (1 GB) at 20 ms
// holds its lease 100 ms; B (1 GB) at 150 ms drains A, the least recently
// used (leased from 110 ms, C from 130 ms). C is idle from 230 ms on: B
// evicts C and loads then; A, never evicted, stays resident.
TEST(Drain, TheWaiterTakesAnIdleModelOutsideItsSet) {
  Trace trace;
  trace.models = {"A", "B", "C"};
  trace.sizes = {kGB, kGB, kGB};
  trace.requests = {Request{0, 0}, Request{20, 2}, Request{150, 1}};
  trace.hold_ms = {500, 100, 10};
  std::vector<std::string> evicted;
  Loads loads;
  SimulateOptions options = StarvationOptions(0);
  // Each load takes kLoadMs, whatever else loads.
  options.time = TimeModel{std::numeric_limits<double>::infinity(), kLoadMs,
                           /*slots=*/0};
  options.on_event = [&](double t, const CacheEvent& e) {
    if (e.type == EventType::kLoaded) loads.at.emplace_back(t, e.key);
    if (e.type == EventType::kEvicted) evicted.push_back(e.key);
  };
  const RunResult r = Simulate(trace, "lru", 2 * kGB, options);
  EXPECT_EQ(r.rejected, 0u);
  EXPECT_EQ(r.drains, 1u);
  EXPECT_DOUBLE_EQ(loads.First("B"), 230 + kLoadMs);
  EXPECT_EQ(evicted, (std::vector<std::string>{"C"}));
  EXPECT_DOUBLE_EQ(r.wait_ms.max, 230 + kLoadMs - 150);
}

// ---- The reports ----

// Each row says its drain_after, its drains and its longest wait; the JSON
// has the same fields; the HTML report draws p99 wait and bytes loaded
// against drain_after when several are compared.
TEST(DrainReport, RowsJsonAndChartsNameTheDrain) {
  const Trace trace = Starvation();
  std::vector<RunResult> runs;
  for (const std::optional<double> drain_after :
       {std::optional<double>(0), std::optional<double>(),
        std::optional<double>(kNeverDrain)}) {
    ReplayOptions options;
    static_cast<SimulateOptions&>(options) = StarvationOptions(drain_after);
    for (RunResult& r : ReplayAll(trace, {"lru"}, {kGB, 2 * kGB}, options, 1)) {
      runs.push_back(std::move(r));
    }
  }
  ASSERT_EQ(runs.size(), 6u);
  RunInfo info;
  info.timed = true;
  info.time = StarvationOptions(0).time;

  const std::string table = ResultsTable(trace, runs, info);
  EXPECT_NE(table.find("drain_after"), std::string::npos);
  std::vector<std::string> rows;
  for (size_t at = 0, end; (end = table.find('\n', at)) != std::string::npos;
       at = end + 1) {
    const std::string line = table.substr(at, end - at);
    if (line.rfind("lru ", 0) == 0) rows.push_back(line);
  }
  ASSERT_EQ(rows.size(), 6u);
  // The row for 0 at 1 GB: drain_after, its 2 drains, and its longest wait.
  EXPECT_NE(rows[0].find(" 0ms      2 "), std::string::npos) << rows[0];
  EXPECT_NE(rows[0].find(" 253ms "), std::string::npos) << rows[0];
  EXPECT_NE(rows[2].find(" default "), std::string::npos) << rows[2];
  EXPECT_NE(rows[4].find(" inf      0 "), std::string::npos) << rows[4];

  const nlohmann::json doc =
      nlohmann::json::parse(ResultsJson(trace, runs, info));
  const nlohmann::json& zero = doc["results"][0];
  EXPECT_EQ(zero["drain_after"], "0ms");
  EXPECT_EQ(zero["drain_after_ms"], 0.0);
  EXPECT_EQ(zero["drains"], 2);
  EXPECT_EQ(zero["max_wait_ms"], 253.0);
  EXPECT_EQ(doc["results"][2]["drain_after"], "default");
  EXPECT_TRUE(doc["results"][2]["drain_after_ms"].is_null());
  EXPECT_EQ(doc["results"][4]["drain_after"], "inf");
  EXPECT_TRUE(doc["results"][4]["drain_after_ms"].is_null());
  EXPECT_EQ(doc["results"][4]["drains"], 0);

  const std::string html = HtmlReport(trace, "drain", runs, info);
  EXPECT_NE(html.find("id=\"chart-drain-p99\""), std::string::npos);
  EXPECT_NE(html.find("id=\"chart-drain-loaded\""), std::string::npos);
  // One line per capacity, each with a point per drain_after.
  EXPECT_NE(html.find("lru 1"), std::string::npos);
  // A single drain_after draws no such chart.
  const std::vector<RunResult> one(runs.begin(), runs.begin() + 2);
  EXPECT_EQ(HtmlReport(trace, "drain", one, info).find("chart-drain-p99"),
            std::string::npos);
}

}  // namespace
}  // namespace modelcache::replay
