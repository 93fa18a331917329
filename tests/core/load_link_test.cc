// The load path's fluid model (modelcache/core/load_link.h): processor
// sharing, exactly, in the throttle's seconds and the replay's milliseconds.
#include "modelcache/core/load_link.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace modelcache {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
using Class = LoadLink::Class;

// Steps the link as the replay does, from one end to the next, at most
// `steps` times; the transfers ended, in the order they ended.
std::vector<uint64_t> StepToTheEnd(LoadLink& link, int steps) {
  std::vector<uint64_t> ended;
  for (int i = 0; i < steps && link.moving() > 0; ++i) {
    link.AdvanceTo(link.NextEnd());
    for (const uint64_t id : link.TakeDone()) ended.push_back(id);
  }
  return ended;
}

// The next transfer to end is `id`, at `t`: Advance(t) ends it alone.
void ExpectEndsNext(LoadLink& link, uint64_t id, double t) {
  EXPECT_DOUBLE_EQ(link.RunOut(), t);
  EXPECT_EQ(link.Advance(t), 1u);
  EXPECT_TRUE(link.Done(id));
}

TEST(LoadLinkTest, ALoneTransferTakesItsBytesOverTheBandwidth) {
  LoadLink link(100);  // bytes per second
  ASSERT_TRUE(link.Add(1, 100));
  EXPECT_DOUBLE_EQ(link.RunOut(), 1.0);
  EXPECT_EQ(link.Advance(0.999), 0u);
  EXPECT_FALSE(link.Done(1));
  EXPECT_EQ(link.Advance(1.0), 1u);
  EXPECT_TRUE(link.Done(1));
  EXPECT_EQ(link.RunOut(), kInf);
}

TEST(LoadLinkTest, TransfersAtOnceShareTheBandwidthEqually) {
  LoadLink link(100);
  link.Add(1, 100);
  link.Add(2, 300);
  // 50 B/s each: the shorter ends at 2 s; the other, alone from then, has
  // 200 bytes left at 100 B/s: 4 s, the sum of both over the bandwidth.
  EXPECT_DOUBLE_EQ(link.RunOut(), 2.0);
  EXPECT_EQ(link.Advance(1.999), 0u);
  EXPECT_EQ(link.Advance(2.0), 1u);
  EXPECT_TRUE(link.Done(1));
  EXPECT_FALSE(link.Done(2));
  ExpectEndsNext(link, 2, 4.0);
}

TEST(LoadLinkTest, OneStepOverAnEndSpeedsTheRestUpFromThen) {
  LoadLink link(100);
  link.Add(1, 100);
  link.Add(2, 300);
  // One step from 0 to 3 s: 1 ends at 2 s, then 2 moves alone for 1 s.
  EXPECT_EQ(link.Advance(3.0), 1u);
  EXPECT_DOUBLE_EQ(link.RunOut(), 4.0);
  EXPECT_DOUBLE_EQ(link.now(), 3.0);
}

TEST(LoadLinkTest, ALaterTransferSlowsTheFirstFromItsArrival) {
  LoadLink link(100);
  link.Add(1, 100);
  EXPECT_EQ(link.Advance(0.5), 0u);  // 50 bytes moved alone
  link.Add(2, 100);
  // 50 B/s each: 1 ends at 1.5 s; 2 has 50 bytes left, alone: 2 s.
  ExpectEndsNext(link, 1, 1.5);
  EXPECT_DOUBLE_EQ(link.RunOut(), 2.0);
  EXPECT_EQ(link.Advance(2.0), 1u);
}

TEST(LoadLinkTest, ARemovedTransferLeavesTheBandwidthToTheOthers) {
  LoadLink link(100);
  link.Add(1, 100);
  link.Add(2, 100);
  EXPECT_DOUBLE_EQ(link.RunOut(), 2.0);
  link.Remove(2);
  EXPECT_TRUE(link.Done(2));
  EXPECT_DOUBLE_EQ(link.RunOut(), 1.0);
  link.Remove(7);  // not on the link: nothing
  EXPECT_EQ(link.moving(), 1u);
}

TEST(LoadLinkTest, NothingToMoveOrNoBandwidthLimitIsDoneAtOnce) {
  LoadLink link(100);
  EXPECT_FALSE(link.Add(1, 0));
  EXPECT_TRUE(link.Done(1));
  LoadLink unlimited(kInf);
  EXPECT_FALSE(unlimited.Add(1, uint64_t{1} << 40));
  EXPECT_TRUE(unlimited.Done(1));
  EXPECT_EQ(unlimited.moving(), 0u);
  EXPECT_EQ(unlimited.RunOut(), kInf);
}

TEST(LoadLinkTest, TicksPerSecondIsTheCallersUnitOfTime) {
  // The replay's unit: milliseconds. 2 MB at 2 GB/s: 1 ms.
  LoadLink link(2e9, /*ticks_per_second=*/1000);
  link.AdvanceTo(10);
  link.Add(1, 2'000'000);
  EXPECT_DOUBLE_EQ(link.NextEnd(), 11.0);
  link.Add(2, 2'000'000);
  EXPECT_DOUBLE_EQ(link.NextEnd(), 12.0);  // two at 1 GB/s each
}

TEST(LoadLinkTest, AdvanceToMovesBytesButEndsNothing) {
  LoadLink link(100);
  link.Add(1, 100);
  link.AdvanceTo(1.0);
  EXPECT_FALSE(link.Done(1));  // still on the link, with nothing left
  EXPECT_DOUBLE_EQ(link.NextEnd(), 1.0);
  EXPECT_EQ(link.TakeDone(), std::vector<uint64_t>{1});
  EXPECT_TRUE(link.Done(1));
  link.AdvanceTo(0.5);  // earlier: ignored
  EXPECT_DOUBLE_EQ(link.now(), 1.0);
}

TEST(LoadLinkTest, WithinHalfAByteAStepperEndsItWhenItLooksAnAdvancerAtItsEnd) {
  // 100 and 300 bytes at 100 B/s, 50 B/s each: at 1.999 s, 0.05 bytes of
  // the first are left.
  LoadLink stepped(100), advanced(100);
  stepped.Add(1, 100);
  stepped.Add(2, 300);
  advanced.Add(1, 100);
  advanced.Add(2, 300);
  stepped.AdvanceTo(1.999);
  EXPECT_DOUBLE_EQ(stepped.NextEnd(), 1.999);  // done now, for the replay
  EXPECT_EQ(stepped.TakeDone(), std::vector<uint64_t>{1});
  EXPECT_EQ(advanced.Advance(1.999), 0u);  // for the throttle: at 2 s
  EXPECT_DOUBLE_EQ(advanced.RunOut(), 2.0);
  EXPECT_FALSE(advanced.Done(1));
}

TEST(LoadLinkTest, TransfersThatEndAtTheSameInstantEndTogether) {
  LoadLink link(100);
  link.Add(1, 100);
  link.Add(2, 100);
  link.Add(3, 400);
  link.AdvanceTo(link.NextEnd());  // 3 s, each at a third
  std::vector<uint64_t> done = link.TakeDone();
  std::sort(done.begin(), done.end());
  EXPECT_EQ(done, (std::vector<uint64_t>{1, 2}));
  EXPECT_DOUBLE_EQ(link.NextEnd(), 6.0);  // 300 left, alone
}

TEST(LoadLinkTest, BackgroundTransfersMoveOnlyWhileNoForegroundOneDoes) {
  LoadLink link(100);
  link.Add(1, 100, Class::kBackground);
  EXPECT_DOUBLE_EQ(link.RunOut(), 1.0);
  EXPECT_EQ(link.Advance(0.5), 0u);  // 50 bytes of the background one moved
  link.Add(2, 100, Class::kForeground);
  EXPECT_EQ(link.moving(Class::kForeground), 1u);
  EXPECT_EQ(link.moving(Class::kBackground), 1u);
  // The foreground one has the whole bandwidth: it ends at 1.5 s, and the
  // background one, stopped meanwhile, ends 0.5 s later.
  ExpectEndsNext(link, 2, 1.5);
  ExpectEndsNext(link, 1, 2.0);
}

TEST(LoadLinkTest, APromotedTransferKeepsItsBytesAndSharesTheForeground) {
  LoadLink link(100);
  link.Add(1, 100, Class::kBackground);
  link.Add(2, 100, Class::kForeground);
  EXPECT_EQ(link.Advance(0.5), 0u);  // 2 has 50 left; 1 has not moved
  link.Promote(1);
  EXPECT_EQ(link.moving(Class::kForeground), 2u);
  EXPECT_EQ(link.moving(Class::kBackground), 0u);
  // 50 B/s each: 2 ends at 1.5 s; 1, alone from then with 50 left: 2 s.
  EXPECT_DOUBLE_EQ(link.RunOut(), 1.5);
  EXPECT_EQ(link.Advance(2.0), 2u);
  link.Promote(1);  // not on the link: nothing
  EXPECT_EQ(link.moving(), 0u);
}

TEST(LoadLinkTest, ClearForgetsEveryTransferAndKeepsTheTime) {
  LoadLink link(100);
  link.Add(1, 100);
  link.Add(2, 100, Class::kBackground);
  link.Advance(0.25);
  link.Clear();
  EXPECT_EQ(link.moving(), 0u);
  EXPECT_TRUE(link.Done(1));
  EXPECT_TRUE(link.Done(2));
  EXPECT_DOUBLE_EQ(link.now(), 0.25);
}

// Late on the clock a double's step of time moves more than a byte: a
// transfer can be left with bytes whose time, added to now, is lost. It is
// done then, not left on the link for ever (the replay's fix, which the
// throttle runs too).
TEST(LoadLinkTest, LateOnTheReplaysClockWhatTheClockCannotMoveIsDone) {
  // Milliseconds from 2^40 (35 years), 2 GB/s: a step of 2^-12 ms moves
  // about 488 bytes; 1,000,002 bytes end 2 bytes short of the step that
  // would reach them.
  LoadLink link(2e9, /*ticks_per_second=*/1000);
  link.AdvanceTo(std::ldexp(1.0, 40));
  link.Add(1, 1'000'002);
  EXPECT_EQ(StepToTheEnd(link, 10), std::vector<uint64_t>{1});
  EXPECT_TRUE(link.Done(1));
}

TEST(LoadLinkTest, LateOnTheThrottlesClockWhatTheClockCannotMoveIsDone) {
  // Seconds from 2^32 (136 years), 2 GB/s: a step of 2^-20 s moves about
  // 1907 bytes; 1,000,000 bytes end 549 bytes short of the step that would
  // reach them.
  LoadLink link(2e9);
  link.AdvanceTo(std::ldexp(1.0, 32));
  link.Add(1, 1'000'000);
  link.Add(2, 3'000'000);
  EXPECT_EQ(StepToTheEnd(link, 10), (std::vector<uint64_t>{1, 2}));
  // The throttle's own step, which ends transfers on the way.
  link.Add(3, 1'000'000);
  EXPECT_EQ(link.Advance(link.now() + 1), 1u);
  EXPECT_TRUE(link.Done(3));
}

}  // namespace
}  // namespace modelcache
