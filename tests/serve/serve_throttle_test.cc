// The load throttle's disk (src/serve/throttle.h): replay's processor
// sharing, exactly.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "throttle.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// ---- the load throttle's disk: replay's processor sharing, exactly ----

using detail::SharedDisk;

TEST(ServeThrottleDisk, ALoneTransferTakesItsBytesOverTheBandwidth) {
  SharedDisk disk(100);  // bytes per second
  disk.Add(1, 100);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 1.0);
  EXPECT_EQ(disk.Advance(0.999), 0);
  EXPECT_FALSE(disk.Done(1));
  EXPECT_EQ(disk.Advance(1.0), 1);
  EXPECT_TRUE(disk.Done(1));
  EXPECT_EQ(disk.NextDeparture(), std::numeric_limits<double>::infinity());
}

TEST(ServeThrottleDisk, TransfersAtOnceShareTheBandwidthEqually) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  disk.Add(2, 300);
  // 50 B/s each: the shorter ends at 2 s; the other, alone from then, has
  // 200 bytes left at 100 B/s: 4 s, the sum of both over the bandwidth.
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 2.0);
  EXPECT_EQ(disk.Advance(1.999), 0);
  EXPECT_EQ(disk.Advance(2.0), 1);
  EXPECT_TRUE(disk.Done(1));
  EXPECT_FALSE(disk.Done(2));
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 4.0);
  EXPECT_EQ(disk.Advance(4.0), 1);
  EXPECT_TRUE(disk.Done(2));
}

TEST(ServeThrottleDisk, OneStepOverADepartureSpeedsTheRestUpFromThen) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  disk.Add(2, 300);
  // One step from 0 to 3 s: 1 ends at 2 s, then 2 moves alone for 1 s.
  EXPECT_EQ(disk.Advance(3.0), 1);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 4.0);
}

TEST(ServeThrottleDisk, ALaterTransferSlowsTheFirstFromItsArrival) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  EXPECT_EQ(disk.Advance(0.5), 0);  // 50 bytes moved alone
  disk.Add(2, 100);
  // 50 B/s each: 1 ends at 1.5 s; 2 has 50 bytes left, alone: 2 s.
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 1.5);
  EXPECT_EQ(disk.Advance(1.5), 1);
  EXPECT_TRUE(disk.Done(1));
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 2.0);
  EXPECT_EQ(disk.Advance(2.0), 1);
}

TEST(ServeThrottleDisk, ARemovedTransferLeavesTheBandwidthToTheOthers) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  disk.Add(2, 100);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 2.0);
  disk.Remove(2);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 1.0);
}

TEST(ServeThrottleDisk, NothingToMoveOrNoBandwidthLimitIsDoneAtOnce) {
  SharedDisk disk(100);
  disk.Add(1, 0);
  EXPECT_TRUE(disk.Done(1));
  SharedDisk unlimited(std::numeric_limits<double>::infinity());
  unlimited.Add(1, uint64_t{1} << 40);
  EXPECT_TRUE(unlimited.Done(1));
  EXPECT_EQ(unlimited.moving(), 0u);
}

}  // namespace
}  // namespace modelcache::serve
