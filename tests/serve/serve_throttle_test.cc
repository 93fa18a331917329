// The daemon's load throttle (src/serve/throttle.h) on the steady clock. The
// fluid model it runs is core's LoadLink, tested exactly on its own in
// tests/core/load_link_test.cc; here, what the throttle adds: the latency
// before a transfer joins, a hold that never ends before the model's time,
// and Stop().
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <thread>

#include "modelcache/base/errors.h"
#include "throttle.h"

namespace modelcache::serve {
namespace {

using detail::LoadThrottle;
using Clock = LoadThrottle::Clock;
using std::chrono::milliseconds;

// The error a hold ends with; none when it ends by itself.
std::optional<ErrorCode> CodeOf(LoadThrottle& throttle, Clock::time_point start,
                                uint64_t bytes) {
  try {
    throttle.Hold(start, bytes);
  } catch (const Error& e) {
    return e.code();
  }
  return std::nullopt;
}

TEST(ServeThrottle, AHoldEndsNoEarlierThanItsLatencyAndItsBytesAtTheBandwidth) {
  // 2 ms of latency, then 3000 bytes at 1 MB/s alone: 3 ms.
  LoadThrottle throttle(1e6, milliseconds(2));
  const Clock::time_point start = Clock::now();
  const Clock::duration held = throttle.Hold(start, 3000);
  const Clock::time_point end = Clock::now();
  EXPECT_GE(end - start, milliseconds(5));
  EXPECT_LE(held, end - start);
  EXPECT_DOUBLE_EQ(throttle.held_seconds(),
                   std::chrono::duration<double>(held).count());
}

TEST(ServeThrottle, ALatencyAlreadyPastAndNoBytesHoldNothingMore) {
  LoadThrottle throttle(1e6, milliseconds(5));
  const Clock::time_point start = Clock::now() - milliseconds(10);
  const Clock::duration held = throttle.Hold(start, 0);
  EXPECT_GE(held, Clock::duration::zero());
  EXPECT_EQ(throttle.bytes_per_second(), 1e6);
  EXPECT_EQ(throttle.latency(), milliseconds(5));
}

TEST(ServeThrottle, WithoutABandwidthLimitOnlyTheLatencyHolds) {
  LoadThrottle throttle(std::numeric_limits<double>::infinity(),
                        milliseconds(3));
  const Clock::time_point start = Clock::now();
  throttle.Hold(start, uint64_t{1} << 40);
  EXPECT_GE(Clock::now() - start, milliseconds(3));
}

TEST(ServeThrottle, StopEndsEveryHoldNowAndFromNowOn) {
  // 1 byte a second: a hold of a terabyte would never end by itself. Stop()
  // comes while the other thread holds or before it starts to: either way
  // its hold ends with kUnavailable.
  LoadThrottle throttle(1, milliseconds(0));
  std::optional<ErrorCode> during;
  std::thread holder(
      [&] { during = CodeOf(throttle, Clock::now(), uint64_t{1} << 40); });
  throttle.Stop();
  holder.join();
  EXPECT_EQ(during, ErrorCode::kUnavailable);
  // From now on, at once, latency or not.
  LoadThrottle waiting(1e6, std::chrono::hours(1));
  waiting.Stop();
  EXPECT_EQ(CodeOf(waiting, Clock::now(), 1), ErrorCode::kUnavailable);
}

}  // namespace
}  // namespace modelcache::serve
