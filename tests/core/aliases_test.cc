// Aliases: one level deep for every call, a name and not a model, and
// safe against concurrent changes. Each test here was written from a
// sentence of cache.h (AddAlias, Remove) and failed on the code before its
// fix; the alias half of seed 001's books (an eviction order that tracked an
// alias never loaded) is in lifecycle_test.cc (AliasesShareOneLifecycle).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <barrier>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "modelcache/core/cache.h"

namespace modelcache {
namespace {

using testing::ErrorMessage;
using ::testing::HasSubstr;
using testing::ResidentKeys;
using testing::SimpleLoader;

// ---- 2. Aliases: one level deep, for every call. ----

TEST(Aliases, AliasChainsAreRefusedSoEveryCallResolvesAliasesAlike) {
  ModelCache cache({.capacity_bytes = 100});
  cache.AddAlias("a", "b");
  EXPECT_THAT(ErrorMessage([&] { cache.AddAlias("b", "c"); },
                           ErrorCode::kInvalidArgument),
              HasSubstr("alias 'a' names it"));
  EXPECT_THAT(ErrorMessage([&] { cache.AddAlias("x", "a"); },
                           ErrorCode::kInvalidArgument),
              HasSubstr("'a' is itself an alias of 'b'"));
  EXPECT_EQ(cache.Resolve("a"), "b");

  std::atomic<int> loads{0};
  Lease lease = cache.Acquire("a", 10, SimpleLoader("b", 10, &loads));
  EXPECT_EQ(lease.key(), "b");
  ASSERT_TRUE(cache.Lookup("a").has_value());
  ASSERT_TRUE(cache.Entry("a").has_value());
  EXPECT_EQ(cache.Entry("a")->key, "b");
  cache.Pin("a");
  EXPECT_TRUE(cache.Entry("b")->pinned);
  cache.Unpin("a");
  lease.Release();
  EXPECT_EQ(cache.Remove("a"), RemoveOutcome::kRemoved);
  EXPECT_FALSE(cache.Entry("b").has_value());
  EXPECT_EQ(loads.load(), 1);

  // Once "a" no longer names "b", "b" may become an alias itself.
  EXPECT_TRUE(cache.RemoveAlias("a"));
  cache.AddAlias("b", "c");
  EXPECT_EQ(cache.Resolve("b"), "c");
  cache.CheckInvariants();
}

TEST(Aliases, RemovingTheModelAnAliasNamesKeepsTheAlias) {
  ModelCache cache({.capacity_bytes = 100});
  cache.AddAlias("latest", "v2");
  std::atomic<int> loads{0};
  cache.Acquire("latest", 10, SimpleLoader("v2", 10, &loads)).Release();
  EXPECT_EQ(cache.Remove("latest"), RemoveOutcome::kRemoved);
  EXPECT_FALSE(cache.Entry("v2").has_value());
  EXPECT_EQ(cache.Resolve("latest"), "v2") << "the alias is a name: it stays";
  Lease again = cache.Acquire("latest", 10, SimpleLoader("v2", 10, &loads));
  EXPECT_EQ(again.key(), "v2");
  EXPECT_EQ(loads.load(), 2);
  EXPECT_TRUE(cache.RemoveAlias("latest"));
  EXPECT_EQ(cache.Resolve("latest"), "latest");
}

TEST(Aliases, OpposingAliasesAddedConcurrentlyNeverFormACycle) {
  ModelCache cache({.capacity_bytes = 100});
  constexpr int kRounds = 300;
  std::barrier sync(2);
  std::atomic<int> both_succeeded{0}, none_succeeded{0};
  std::atomic<bool> ab{false}, ba{false};
  auto add = [&](const char* alias, const char* target, std::atomic<bool>* ok) {
    for (int round = 0; round < kRounds; ++round) {
      sync.arrive_and_wait();  // both threads race from here
      try {
        cache.AddAlias(alias, target);
        ok->store(true);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        ok->store(false);
      }
      sync.arrive_and_wait();  // both finished: tally and reset (one thread)
      if (alias[0] == 'a') {
        if (ab.load() && ba.load()) ++both_succeeded;
        if (!ab.load() && !ba.load()) ++none_succeeded;
        cache.CheckInvariants();
        cache.RemoveAlias("a");
        cache.RemoveAlias("b");
      }
      sync.arrive_and_wait();
    }
  };
  std::thread t1(add, "a", "b", &ab);
  std::thread t2(add, "b", "a", &ba);
  t1.join();
  t2.join();
  EXPECT_EQ(both_succeeded.load(), 0) << "a cycle a -> b -> a was formed";
  EXPECT_EQ(none_succeeded.load(), 0);

  // With one of them in place, an acquire through the other name resolves in
  // one step and returns.
  cache.AddAlias("a", "b");
  EXPECT_THROW(cache.AddAlias("b", "a"), Error);
  AcquireOptions options;
  options.deadline = Clock::now() + std::chrono::seconds(30);
  EXPECT_EQ(cache.Acquire("a", 10, SimpleLoader("b", 10), options).key(), "b");
}

}  // namespace
}  // namespace modelcache
