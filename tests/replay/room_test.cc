// modelcache replay in trace time: how misses wait for room. A miss whose
// model fits loads at once, whatever waits for room (no head-of-line
// blocking, as in the cache, whose Budget::Reserve has no queue).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"

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
  const RunResult r = Simulate(trace, "lru", 2 * kGB, OnePathOptions(20));
  EXPECT_EQ(r.rejected, 0u);
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

}  // namespace
}  // namespace modelcache::replay
