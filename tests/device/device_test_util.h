// Helpers shared by the device suites.
#ifndef MODELCACHE_TESTS_DEVICE_DEVICE_TEST_UTIL_H_
#define MODELCACHE_TESTS_DEVICE_DEVICE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "modelcache/device/device.h"

namespace modelcache::device::testing {

// `bytes` pseudo-random bytes from `seed` (xorshift): different seeds give
// different contents, so a copy landing in the wrong place shows.
inline std::vector<std::byte> Pattern(uint64_t seed, size_t bytes) {
  std::vector<std::byte> out(bytes);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out[i] = static_cast<std::byte>(x);
  }
  return out;
}

// The books a failed call must leave alone (failure counters excluded).
inline void ExpectSameBooks(const DeviceStats& before,
                            const DeviceStats& after) {
  EXPECT_EQ(after.bytes_allocated, before.bytes_allocated);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.frees, before.frees);
  EXPECT_EQ(after.copies_to_device, before.copies_to_device);
  EXPECT_EQ(after.copies_to_host, before.copies_to_host);
  EXPECT_EQ(after.bytes_copied_to_device, before.bytes_copied_to_device);
  EXPECT_EQ(after.bytes_copied_to_host, before.bytes_copied_to_host);
  EXPECT_EQ(after.high_water_bytes, before.high_water_bytes);
}

}  // namespace modelcache::device::testing

#endif  // MODELCACHE_TESTS_DEVICE_DEVICE_TEST_UTIL_H_
