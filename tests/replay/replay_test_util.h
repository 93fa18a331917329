// What the replay suites share beyond ../test_util.h: comparing two runs.
#ifndef MODELCACHE_TESTS_REPLAY_REPLAY_TEST_UTIL_H_
#define MODELCACHE_TESTS_REPLAY_REPLAY_TEST_UTIL_H_

#include <cstddef>

#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {

// Every field of two runs but the time they took (and, unless
// `same_waits`, the waits' percentiles but the largest).
inline void ExpectSameResult(const RunResult& a, const RunResult& b,
                             bool same_waits = true) {
  EXPECT_EQ(a.policy, b.policy);
  EXPECT_EQ(a.offline, b.offline);
  EXPECT_EQ(a.capacity_bytes, b.capacity_bytes);
  EXPECT_EQ(a.requests, b.requests);
  EXPECT_EQ(a.hits, b.hits);
  EXPECT_EQ(a.misses, b.misses);
  EXPECT_EQ(a.too_large, b.too_large);
  EXPECT_EQ(a.blocked, b.blocked);
  EXPECT_EQ(a.bytes_loaded, b.bytes_loaded);
  EXPECT_EQ(a.evictions, b.evictions);
  EXPECT_EQ(a.hit_ratio, b.hit_ratio);
  EXPECT_EQ(a.byte_miss_ratio, b.byte_miss_ratio);
  EXPECT_EQ(a.peak_resident_bytes, b.peak_resident_bytes);
  EXPECT_EQ(a.resident_over_time, b.resident_over_time);
  EXPECT_EQ(a.loads_per_model, b.loads_per_model);
  EXPECT_EQ(a.timed, b.timed);
  EXPECT_EQ(a.cold_starts, b.cold_starts);
  EXPECT_EQ(a.cold_start_ratio, b.cold_start_ratio);
  if (same_waits) {
    EXPECT_EQ(a.wait_ms.p50, b.wait_ms.p50);
    EXPECT_EQ(a.wait_ms.p95, b.wait_ms.p95);
    EXPECT_EQ(a.wait_ms.p99, b.wait_ms.p99);
    EXPECT_EQ(a.wait_ms.p999, b.wait_ms.p999);
    EXPECT_EQ(a.wait_quantiles, b.wait_quantiles);
  }
  EXPECT_EQ(a.wait_ms.max, b.wait_ms.max);
  EXPECT_EQ(a.rejected, b.rejected);
  EXPECT_EQ(a.drain_after_ms, b.drain_after_ms);
  EXPECT_EQ(a.drains, b.drains);
  EXPECT_EQ(a.drain_queued, b.drain_queued);
  EXPECT_EQ(a.prewarms, b.prewarms);
  EXPECT_EQ(a.load_seconds, b.load_seconds);
  EXPECT_EQ(a.disk_busy_ratio, b.disk_busy_ratio);
  EXPECT_EQ(a.load_queue_peak, b.load_queue_peak);
  EXPECT_EQ(a.load_queue_mean, b.load_queue_mean);
  EXPECT_EQ(a.idle_gib_hours, b.idle_gib_hours);
  EXPECT_EQ(a.p75_model_cold_start_ratio, b.p75_model_cold_start_ratio);
  EXPECT_EQ(a.overloaded, b.overloaded);
  ASSERT_EQ(a.bins.size(), b.bins.size());
  for (size_t i = 0; i < a.bins.size(); ++i) {
    EXPECT_EQ(a.bins[i].t_ms, b.bins[i].t_ms);
    EXPECT_EQ(a.bins[i].min_bytes, b.bins[i].min_bytes);
    EXPECT_EQ(a.bins[i].mean_bytes, b.bins[i].mean_bytes);
    EXPECT_EQ(a.bins[i].max_bytes, b.bins[i].max_bytes);
    EXPECT_EQ(a.bins[i].queue, b.bins[i].queue);
  }
}

}  // namespace modelcache::replay

#endif  // MODELCACHE_TESTS_REPLAY_REPLAY_TEST_UTIL_H_
