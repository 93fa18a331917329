// Contract holes found by testing the public API from outside, each written
// from a sentence of cache.h or budget.h: idle time counts from the end of the
// last lease, a real size over the
// whole budget is too large, byte arithmetic never wraps, a throwing event
// callback changes nothing, a loader cannot wait for itself, releasing the
// last over-capacity lease brings usage back within capacity, and an acquire
// after Invalidate never receives the stale load, and a blocked call can be
// interrupted by its caller (AcquireOptions::interrupt).
//
// Every test here failed on the code before its fix (a wrong result, an
// abort, or a hang that ctest's timeout turns into a failure).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"

namespace modelcache {
namespace {

using testing::ErrorMessage;
using testing::FakeModel;
using testing::Gate;
using ::testing::HasSubstr;
using testing::ResidentKeys;
using testing::SimpleLoader;

// A clock the test moves by hand.
struct ManualClock {
  std::atomic<int64_t> seconds{1000};
  std::function<Clock::time_point()> Fn() {
    return [this] {
      return Clock::time_point(std::chrono::seconds(seconds.load()));
    };
  }
};

int GenerationOf(const Lease& lease) {
  return lease.get<FakeModel>()->generation;
}

// ---- 1. Idle TTL counts from the end of the last lease. ----

TEST(CacheContract, IdleTtlCountsFromTheEndOfTheLastLease) {
  ManualClock clock;
  ModelCache cache({.capacity_bytes = 100,
                    .idle_ttl = std::chrono::seconds(10),
                    .now = clock.Fn(),
                    .shard_bits = 0});
  Lease held = cache.Acquire("a", 10, SimpleLoader("a", 10));
  clock.seconds += 60;  // held for six TTLs
  EXPECT_EQ(cache.EvictExpired(), 0u) << "a leased record is never idle";
  held.Release();
  EXPECT_EQ(cache.EvictExpired(), 0u)
      << "released just now: idle for 0 s, not 60 s";
  // The next miss runs the expiry too; "a" is still not idle for long.
  cache.Acquire("b", 10, SimpleLoader("b", 10)).Release();
  EXPECT_THAT(ResidentKeys(cache), ::testing::ElementsAre("a", "b"));
  clock.seconds += 9;
  EXPECT_EQ(cache.EvictExpired(), 0u);
  clock.seconds += 2;  // 11 s after the release
  EXPECT_EQ(cache.EvictExpired(), 2u);
  EXPECT_EQ(cache.Stats().expirations, 2u);
  EXPECT_EQ(cache.budget().used(), 0u);
}

// ---- 3. A real size over the whole budget. ----

TEST(CacheContract, RealSizeOverTheWholeBudgetIsTooLargeAndEvictsNothing) {
  for (WhenFull when_full : {WhenFull::kFail, WhenFull::kWait}) {
    SCOPED_TRACE(when_full == WhenFull::kFail ? "kFail" : "kWait");
    ModelCache cache({.capacity_bytes = 100});
    cache.Acquire("idle", 30, SimpleLoader("idle", 30)).Release();
    std::atomic<int> unloads{0};
    AcquireOptions options;
    options.when_full = when_full;  // and no deadline: must not wait
    const std::string message = ErrorMessage(
        [&] {
          cache.Acquire("big", 60,
                        SimpleLoader("big", 150, nullptr, [&] { ++unloads; }),
                        options);
        },
        ErrorCode::kTooLarge);
    EXPECT_THAT(message, HasSubstr("'big' loaded at 150 B"));
    EXPECT_EQ(unloads.load(), 1) << "the refused model is unloaded";
    EXPECT_EQ(ResidentKeys(cache), std::vector<std::string>{"idle"})
        << "nothing is evicted for a model that can never fit";
    EXPECT_EQ(cache.Stats().evictions, 0u);
    EXPECT_EQ(cache.budget().used(), 30u);
    EXPECT_EQ(cache.CheckInvariants(), 30u);
  }
}

// ---- 4. Byte arithmetic never wraps. ----

TEST(CacheContract, BudgetArithmeticNeverWrapsNearTwoToTheSixtyFour) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  auto budget = std::make_shared<Budget>(kMax, "huge");
  {
    ModelCache cache({.budget = budget});
    Lease small = cache.Acquire("small", 10, SimpleLoader("small", 10));
    // 10 + (2^64 - 6) wraps to 4: it must be refused, not admitted.
    ErrorMessage(
        [&] {
          cache.Acquire("giant", kMax - 5, SimpleLoader("giant", kMax - 5));
        },
        ErrorCode::kCapacity);
    EXPECT_EQ(budget->used(), 10u);
    // A reservation that already holds bytes is checked as a whole.
    ErrorMessage([&] { budget->Reserve(kMax - 5, {.already_reserved = 10}); },
                 ErrorCode::kTooLarge);
    // A real size that would wrap the reservation's adjustment.
    ErrorMessage(
        [&] { cache.Acquire("grows", 20, SimpleLoader("grows", kMax)); },
        ErrorCode::kCapacity);
    EXPECT_EQ(budget->used(), 10u);
    EXPECT_EQ(cache.CheckInvariants(), 10u);
  }
  EXPECT_EQ(budget->used(), 0u);

  // Usage over a shrunken capacity: "capacity - used" must not wrap either.
  ModelCache cache({.capacity_bytes = 100});
  Lease held = cache.Acquire("held", 80, SimpleLoader("held", 80));
  EXPECT_EQ(cache.SetCapacity(50), 30u);
  ErrorMessage([&] { cache.Acquire("one", 1, SimpleLoader("one", 1)); },
               ErrorCode::kCapacity);
  EXPECT_EQ(cache.budget().used(), 80u);
}

// ---- 5. Event callbacks that throw change nothing. ----

struct ThrowingCallback {
  EventType throw_on;
  std::atomic<int> thrown{0};
  void operator()(const CacheEvent& event) {
    if (event.type == throw_on) {
      ++thrown;
      throw std::runtime_error("callback failed");
    }
  }
};

class ThrowingCallbackTest : public ::testing::TestWithParam<EventType> {};

TEST_P(ThrowingCallbackTest, ChangesNothingAndIsCounted) {
  ManualClock clock;
  auto callback = std::make_shared<ThrowingCallback>();
  callback->throw_on = GetParam();
  {
    ModelCache cache(
        {.capacity_bytes = 100,
         .idle_ttl = std::chrono::seconds(10),
         .now = clock.Fn(),
         .shard_bits = 0,
         .on_event = [callback](const CacheEvent& e) { (*callback)(e); }});
    // kLoaded: the lease is handed over, and it is the only one.
    Lease a = cache.Acquire("a", 40, SimpleLoader("a", 40));
    EXPECT_EQ(cache.Entry("a")->leases, 1);
    // kLoadFailed: the caller gets the loader's error, not the callback's.
    EXPECT_THROW(cache.Acquire("bad", 10,
                               []() -> Loaded {
                                 throw std::logic_error("loader failed");
                               }),
                 std::logic_error);
    // kRetired, then kRetiredFreed from a lease's release.
    EXPECT_EQ(cache.Remove("a"), RemoveOutcome::kRetired);
    a.Release();
    // kRemoved.
    cache.Acquire("b", 40, SimpleLoader("b", 40)).Release();
    EXPECT_EQ(cache.Remove("b"), RemoveOutcome::kRemoved);
    // kUnloadFailed: the record stays, at its place.
    cache
        .Acquire("stuck", 40,
                 SimpleLoader("stuck", 40, nullptr,
                              [] { throw std::runtime_error("no"); }))
        .Release();
    EXPECT_THROW(cache.Remove("stuck"), std::runtime_error);
    // kEvicted: an acquire makes room.
    cache.Acquire("c", 40, SimpleLoader("c", 40)).Release();
    cache.Acquire("d", 40, SimpleLoader("d", 40)).Release();
    // kExpired.
    clock.seconds += 60;
    cache.EvictExpired();

    EXPECT_EQ(ResidentKeys(cache), std::vector<std::string>{"stuck"});
    EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
    EXPECT_EQ(cache.budget().used(), 40u);
    for (const EntryInfo& e : cache.Entries()) EXPECT_EQ(e.leases, 0) << e.key;
    const CacheStats stats = cache.Stats();
    EXPECT_GE(callback->thrown.load(), 1) << EventTypeName(GetParam());
    EXPECT_EQ(stats.callback_errors,
              static_cast<uint64_t>(callback->thrown.load()));
    EXPECT_EQ(stats.loads, 5u);
    EXPECT_EQ(stats.load_failures, 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryEventType, ThrowingCallbackTest,
    ::testing::Values(EventType::kLoaded, EventType::kLoadFailed,
                      EventType::kEvicted, EventType::kExpired,
                      EventType::kUnloadFailed, EventType::kRemoved,
                      EventType::kRetired, EventType::kRetiredFreed),
    [](const ::testing::TestParamInfo<EventType>& info) {
      return std::string(EventTypeName(info.param));
    });

// ---- 7. A loader or unloader that waits for its own key. ----

TEST(CacheContract, LoaderAcquiringItsOwnKeyFailsAtOnceNamingTheKey) {
  ModelCache cache({.capacity_bytes = 100});
  cache.AddAlias("alias", "self");
  std::vector<std::string> errors;
  auto expect_precondition = [&](const std::function<void()>& call) {
    try {
      call();
      errors.push_back("no error");
    } catch (const Error& e) {
      errors.push_back(std::string(ErrorCodeName(e.code())) + ": " + e.what());
    }
  };
  Lease lease = cache.Acquire("self", 10, [&] {
    expect_precondition(
        [&] { cache.Acquire("self", 10, SimpleLoader("self", 10)); });
    expect_precondition(
        [&] { cache.Acquire("alias", 10, SimpleLoader("self", 10)); });
    expect_precondition(
        [&] { cache.Prefetch("self", 10, SimpleLoader("self", 10)); });
    expect_precondition([&] { cache.Remove("alias"); });
    // A different key of the same cache is fine.
    cache.Acquire("other", 10, SimpleLoader("other", 10)).Release();
    return Loaded{std::make_shared<FakeModel>("self", 1), 10};
  });
  ASSERT_EQ(errors.size(), 4u);
  for (const std::string& error : errors) {
    EXPECT_THAT(error, HasSubstr("failed_precondition"));
    EXPECT_THAT(error, HasSubstr("'self'"));
    EXPECT_THAT(error, HasSubstr("from its own loader"));
  }
  EXPECT_EQ(cache.Entry("self")->leases, 1);
  lease.Release();
  EXPECT_EQ(cache.Stats().loads, 2u);
  cache.CheckInvariants();
}

TEST(CacheContract, UnloaderAcquiringItsOwnKeyFailsAtOnce) {
  ModelCache cache({.capacity_bytes = 100});
  std::string error;
  cache
      .Acquire(
          "self", 10,
          SimpleLoader("self", 10, nullptr,
                       [&] {
                         try {
                           cache.Acquire("self", 10, SimpleLoader("self", 10));
                         } catch (const Error& e) {
                           error = e.what();
                           EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
                         }
                       }))
      .Release();
  EXPECT_EQ(cache.Remove("self"), RemoveOutcome::kRemoved);
  EXPECT_THAT(error, HasSubstr("from its own unloader"));
  EXPECT_EQ(cache.budget().used(), 0u);
}

TEST(CacheContract, AnotherThreadStillWaitsForTheLoadInFlight) {
  // The check is per thread: a different thread joins the load as before.
  ModelCache cache({.capacity_bytes = 100});
  Gate gate;
  std::atomic<int> loads{0};
  std::thread owner([&] {
    cache
        .Acquire("k", 10,
                 [&] {
                   gate.Pass();
                   ++loads;
                   return Loaded{std::make_shared<FakeModel>("k", 1), 10};
                 })
        .Release();
  });
  testing::SpinUntil([&] { return cache.Entry("k").has_value(); }, "loading");
  std::thread waiter([&] {
    EXPECT_EQ(cache.Acquire("k", 10, SimpleLoader("k", 10)).key(), "k");
  });
  testing::SpinUntil([&] { return testing::WaitersOn(cache, "k") == 1; },
                     "the waiter joined");
  gate.Open();
  owner.join();
  waiter.join();
  EXPECT_EQ(loads.load(), 1);
}

// ---- 8. Releasing the last over-capacity lease evicts. ----

TEST(CacheContract, ReleasingLeasesAfterAShrinkBringsUsageWithinCapacity) {
  ModelCache cache({.capacity_bytes = 100, .shard_bits = 0});
  Lease a = cache.Acquire("a", 40, SimpleLoader("a", 40));
  Lease b = cache.Acquire("b", 40, SimpleLoader("b", 40));
  EXPECT_EQ(cache.SetCapacity(50), 30u) << "both are leased: 30 B over";
  EXPECT_EQ(cache.budget().used(), 80u);
  a.Release();  // usage may now come back within capacity
  EXPECT_EQ(cache.budget().used(), 40u);
  EXPECT_EQ(ResidentKeys(cache), std::vector<std::string>{"b"});
  EXPECT_EQ(cache.Stats().evictions, 1u);
  b.Release();  // within capacity: nothing more goes
  EXPECT_EQ(ResidentKeys(cache), std::vector<std::string>{"b"});

  // The same for a pin: unpinning over capacity evicts.
  cache.Pin("b");
  EXPECT_EQ(cache.SetCapacity(20), 20u) << "b (40 B) is pinned";
  cache.Unpin("b");
  EXPECT_THAT(ResidentKeys(cache), ::testing::IsEmpty());
  EXPECT_EQ(cache.budget().used(), 0u);
  cache.Acquire("c", 10, SimpleLoader("c", 10)).Release();
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

// ---- 9. An acquire after Invalidate never gets the stale load. ----

TEST(CacheContract, AcquireAfterInvalidateWaitsForTheStaleLoadThenLoadsAfresh) {
  ModelCache cache({.capacity_bytes = 100});
  Gate gate;
  std::atomic<int> generation{0};
  auto loader = [&] {
    const int g = ++generation;
    if (g == 1) gate.Pass();
    return Loaded{std::make_shared<FakeModel>("k", g), 10};
  };
  std::optional<int> owner_got, early_got, late_got;
  std::thread owner(
      [&] { owner_got = GenerationOf(cache.Acquire("k", 10, loader)); });
  testing::SpinUntil([&] { return cache.Entry("k").has_value(); }, "loading");
  std::thread early(
      [&] { early_got = GenerationOf(cache.Acquire("k", 10, loader)); });
  testing::SpinUntil([&] { return testing::WaitersOn(cache, "k") == 1; },
                     "the early waiter joined");
  EXPECT_EQ(cache.Invalidate("k"), RemoveOutcome::kRetired);
  // Invalidate has returned: this acquire must not receive generation 1.
  std::thread late(
      [&] { late_got = GenerationOf(cache.Acquire("k", 10, loader)); });
  testing::SpinUntil([&] { return testing::WaitersOn(cache, "k") == 2; },
                     "the late acquire waits");
  gate.Open();
  owner.join();
  early.join();
  late.join();
  EXPECT_EQ(owner_got, 1);
  EXPECT_EQ(early_got, 1) << "joined before the invalidation";
  EXPECT_EQ(late_got, 2) << "arrived after the invalidation";
  EXPECT_EQ(generation.load(), 2);
  EXPECT_EQ(cache.Stats().loads, 2u);
  EXPECT_EQ(cache.budget().used(), 10u) << "the stale copy is freed";
  EXPECT_EQ(cache.CheckInvariants(), 10u);
}

// ---- 10. A blocked call can be interrupted (AcquireOptions::interrupt). ----

struct Interrupted {};

// Options whose check throws once `fire` is set, counting its calls.
AcquireOptions InterruptibleOnce(std::atomic<bool>* fire,
                                 std::atomic<int>* checks) {
  AcquireOptions options;
  options.interrupt.every = std::chrono::milliseconds(1);
  options.interrupt.check = [fire, checks] {
    ++*checks;
    if (fire->load()) throw Interrupted{};
  };
  return options;
}

TEST(CacheContract, InterruptEndsAWaitForAnotherLoadWhichGoesOn) {
  ModelCache cache({.capacity_bytes = 100});
  Gate gate;
  std::atomic<int> loads{0};
  std::thread owner([&] {
    Lease lease = cache.Acquire("k", 10, [&] {
      gate.Pass();
      ++loads;
      return Loaded{std::make_shared<FakeModel>("k", 1), 10};
    });
    EXPECT_EQ(lease.key(), "k");
  });
  testing::SpinUntil([&] { return cache.Entry("k").has_value(); }, "loading");
  std::atomic<bool> fire{false};
  std::atomic<int> checks{0};
  std::thread waiter([&] {
    EXPECT_THROW(cache.Acquire("k", 10, SimpleLoader("k", 10),
                               InterruptibleOnce(&fire, &checks)),
                 Interrupted);
  });
  testing::SpinUntil([&] { return testing::WaitersOn(cache, "k") == 1; },
                     "the waiter joined");
  // The check runs while the waiter is blocked, and only then fires.
  testing::SpinUntil([&] { return checks.load() >= 2; }, "checks ran");
  fire = true;
  waiter.join();
  EXPECT_EQ(testing::WaitersOn(cache, "k"), 0);
  gate.Open();  // the load goes on for its owner
  owner.join();
  EXPECT_EQ(loads.load(), 1);
  EXPECT_EQ(cache.Stats().loads, 1u);
  EXPECT_EQ(cache.Stats().resident_bytes, 10u);
  cache.CheckInvariants();
}

TEST(CacheContract, InterruptEndsAWaitForCapacityAndReservesNothing) {
  ModelCache cache({.capacity_bytes = 100});
  Lease held = cache.Acquire("big", 80, SimpleLoader("big", 80));
  std::atomic<bool> fire{false};
  std::atomic<int> checks{0};
  AcquireOptions options = InterruptibleOnce(&fire, &checks);
  options.when_full = WhenFull::kWait;
  std::atomic<int> calls{0};
  std::thread waiter([&] {
    EXPECT_THROW(
        cache.Acquire("small", 40, SimpleLoader("small", 40, &calls), options),
        Interrupted);
  });
  testing::SpinUntil([&] { return checks.load() >= 2; },
                     "the acquire waits for capacity");
  EXPECT_EQ(cache.budget().waiters(), 1);
  fire = true;
  waiter.join();
  EXPECT_EQ(calls.load(), 0);
  EXPECT_EQ(cache.budget().used(), 80u);
  EXPECT_EQ(cache.budget().waiters(), 0);
  EXPECT_FALSE(cache.Entry("small").has_value());
  held.Release();
  // Nothing of the interrupted call stayed behind: the next acquire loads.
  EXPECT_EQ(
      cache.Acquire("small", 40, SimpleLoader("small", 40, &calls)).bytes(),
      40u);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

TEST(CacheContract, InterruptEndsAWaitForAnUnload) {
  ModelCache cache({.capacity_bytes = 100});
  Gate gate;
  std::atomic<bool> unloading{false};
  cache.Prefetch("k", 10, SimpleLoader("k", 10, nullptr, [&] {
                   unloading = true;
                   gate.Pass();
                 }));
  std::thread remover(
      [&] { EXPECT_EQ(cache.Remove("k"), RemoveOutcome::kRemoved); });
  testing::SpinUntil([&] { return unloading.load(); }, "unloading");
  std::atomic<bool> fire{true};
  std::atomic<int> checks{0};
  EXPECT_THROW(cache.Acquire("k", 10, SimpleLoader("k", 10),
                             InterruptibleOnce(&fire, &checks)),
               Interrupted);
  EXPECT_EQ(checks.load(), 1);
  gate.Open();
  remover.join();
  EXPECT_FALSE(cache.Entry("k").has_value());
  cache.CheckInvariants();
}

TEST(CacheContract, InterruptCheckNeverRunsWhenNothingBlocks) {
  ModelCache cache({.capacity_bytes = 100});
  std::atomic<bool> fire{true};
  std::atomic<int> checks{0};
  const AcquireOptions options = InterruptibleOnce(&fire, &checks);
  cache.Acquire("k", 10, SimpleLoader("k", 10), options).Release();  // miss
  cache.Acquire("k", 10, SimpleLoader("k", 10), options).Release();  // hit
  EXPECT_EQ(checks.load(), 0);
}

// ---- 11. User code's state is dropped outside the cache's locks. ----

// A shared_ptr whose deleter calls into `cache`: dropped under one of the
// cache's locks, it deadlocks (as a language binding's deleter does when it
// waits for its interpreter's lock held by a thread waiting for the cache).
std::shared_ptr<void> CallsBackWhenDropped(ModelCache& cache) {
  return std::shared_ptr<void>(new int(0), [&cache](void* p) {
    (void)cache.Stats();
    delete static_cast<int*>(p);
  });
}

TEST(CacheContract, AWaiterForAnUnloadNeverDropsUserStateUnderALock) {
  // An acquire that waited for an unload may hold the last reference to the
  // unloaded record. Before the fix the unloader (and whatever it owned)
  // was destroyed with that record, under the shard lock: a hang here.
  ModelCache cache({.capacity_bytes = 100, .shard_bits = 0});
  for (int round = 0; round < 300; ++round) {
    Gate gate;
    std::atomic<bool> unloading{false};
    cache.Prefetch("k", 10, [&] {
      std::shared_ptr<void> owned_by_unloader = CallsBackWhenDropped(cache);
      return Loaded{CallsBackWhenDropped(cache), 10,
                    [&unloading, &gate, owned_by_unloader] {
                      unloading = true;
                      gate.Pass();
                    }};
    });
    std::thread remover([&] { cache.Remove("k"); });
    testing::SpinUntil([&] { return unloading.load(); }, "unloading");
    std::thread waiter(
        [&] { cache.Acquire("k", 10, SimpleLoader("k", 10)).Release(); });
    testing::SpinUntil([&] { return testing::WaitersOn(cache, "k") == 1; },
                       "the acquire waits for the unload");
    gate.Open();
    remover.join();
    waiter.join();
    ASSERT_EQ(cache.Remove("k"), RemoveOutcome::kRemoved);
  }
  cache.CheckInvariants();
}

// ---- 12. TryAcquire is the hit half of Acquire. ----

TEST(CacheContract, TryAcquireThenAcquireCountsLikeOneAcquire) {
  ModelCache plain({.capacity_bytes = 100});
  ModelCache split({.capacity_bytes = 100});
  std::atomic<int> calls{0};
  split.AddAlias("alias", "k");
  plain.AddAlias("alias", "k");
  // A miss, then hits by key and by alias, in both caches.
  for (const char* name : {"k", "k", "alias"}) {
    plain.Acquire(name, 10, SimpleLoader("k", 10)).Release();
    std::optional<Lease> hit = split.TryAcquire(name);
    if (!hit) {
      EXPECT_EQ(split.Stats().misses, 0u) << "TryAcquire counted a miss";
      hit = split.Acquire(name, 10, SimpleLoader("k", 10, &calls));
    }
    EXPECT_EQ(hit->key(), "k");
    EXPECT_EQ(split.Entry("k")->leases, 1);
  }
  EXPECT_EQ(calls.load(), 1);
  CacheStats split_stats = split.Stats(), plain_stats = plain.Stats();
  split_stats.load_seconds = plain_stats.load_seconds = 0;  // timing
  EXPECT_EQ(split_stats, plain_stats);
  EXPECT_EQ(split.Entry("k")->accesses, plain.Entry("k")->accesses);
}

TEST(CacheContract, TryAcquireNeverWaitsForALoadInFlight) {
  ModelCache cache({.capacity_bytes = 100});
  Gate gate;
  std::thread owner([&] {
    cache.Acquire("k", 10, [&] {
      gate.Pass();
      return Loaded{std::make_shared<FakeModel>("k", 1), 10};
    });
  });
  testing::SpinUntil([&] { return cache.Entry("k").has_value(); }, "loading");
  EXPECT_FALSE(cache.TryAcquire("k").has_value());  // returns, no wait
  EXPECT_EQ(cache.Stats().hits, 0u);
  gate.Open();
  owner.join();
  EXPECT_TRUE(cache.TryAcquire("k").has_value());
  EXPECT_EQ(cache.Stats().hits, 1u);
}

}  // namespace
}  // namespace modelcache
