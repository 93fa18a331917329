// Swap scheduling (budget.h, "Who waits"): a request that needs room held by
// models in use may be overtaken for at most drain_after; then those models
// drain (no new lease, their leases end, the whole set is evicted for the
// waiter), and the requests queued behind the drain go on after it. Time is
// a fake clock the tests advance (BudgetOptions::now, ClockAdvanced);
// interleavings are pinned by the budget's own counters (waiters, drains,
// queued_behind_drain), never by sleeping.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../../src/core/test_hooks.h"
#include "../test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"

namespace modelcache {
namespace {

using std::chrono::seconds;
using ::testing::HasSubstr;
using testing::SimpleLoader;
using testing::SpinUntil;
using testing::WaitForRoom;

// A clock that moves only when the test moves it.
class FakeClock {
 public:
  Clock::time_point Now() const {
    return Clock::time_point(std::chrono::nanoseconds(ns_.load()));
  }
  void Advance(std::chrono::nanoseconds by) { ns_.fetch_add(by.count()); }
  std::function<Clock::time_point()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  std::atomic<int64_t> ns_{int64_t{1} << 40};
};

std::shared_ptr<Budget> MakeBudget(uint64_t capacity,
                                   std::chrono::nanoseconds drain_after,
                                   FakeClock* clock) {
  return std::make_shared<Budget>(
      capacity, "gpu",
      BudgetOptions{.drain_after = drain_after, .now = clock->AsFunction()});
}

CacheOptions On(std::shared_ptr<Budget> budget, const std::string& name,
                FakeClock* clock) {
  CacheOptions options;
  options.name = name;
  options.budget = std::move(budget);
  options.shard_bits = 1;
  options.now = clock->AsFunction();
  return options;
}

// Acquires `key` on a thread of its own, waiting for room; the lease (or
// the error) is there once Join returns.
class Request {
 public:
  Request(ModelCache& cache, std::string key, uint64_t bytes,
          AcquireOptions options = WaitForRoom())
      : thread_([this, &cache, key, bytes, options] {
          try {
            lease_ =
                cache.Acquire(key, bytes, SimpleLoader(key, bytes), options);
          } catch (const Error& e) {
            code_ = e.code();
            message_ = e.what();
          }
        }) {}
  ~Request() {
    if (thread_.joinable()) thread_.join();
  }
  void Join() { thread_.join(); }
  // Joins the request and says whether it got its lease:
  // ASSERT_TRUE(request.Served()).
  ::testing::AssertionResult Served() {
    Join();
    if (!code_) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << message_;
  }
  Lease& lease() { return lease_; }
  std::optional<ErrorCode> code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Lease lease_;
  std::optional<ErrorCode> code_;
  std::string message_;
  std::thread thread_;
};

TEST(Drain, AModelInContinuousUseDrainsForTheWaiterAndItsRequestsGoOnAfter) {
  FakeClock clock;
  auto budget = MakeBudget(100, seconds(2), &clock);
  ModelCache cache(On(budget, "models", &clock));
  // A is in continuous use: one lease always out, the next taken before
  // the last ends.
  Lease a1 = cache.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->waiters() == 1; }, "B waits for room");

  // Within drain_after, A's requests overtake B.
  clock.Advance(seconds(1));
  budget->ClockAdvanced();
  std::optional<Lease> a2 = cache.TryAcquire("A");
  ASSERT_TRUE(a2.has_value()) << "a hit overtakes within drain_after";
  a1.Release();
  EXPECT_EQ(budget->drains(), 0u);

  // B has waited drain_after: A drains. No new lease, no lookup.
  clock.Advance(seconds(1));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 1; }, "A drains");
  EXPECT_TRUE(cache.Entry("A")->draining);
  EXPECT_FALSE(cache.TryAcquire("A").has_value());
  EXPECT_FALSE(cache.Lookup("A").has_value());
  Request a3(cache, "A", 60);
  SpinUntil([&] { return budget->queued_behind_drain() == 1; },
            "A's request queues behind the drain");
  EXPECT_EQ(cache.Entry("A")->leases, 1);  // only the lease already out

  // The lease out ends: A is evicted for B, which is served.
  a2->Release();
  ASSERT_TRUE(b.Served());
  ASSERT_TRUE(b.lease());
  EXPECT_EQ(cache.Stats().evictions, 1u);

  // A's request goes on after B, under the same rule, keeping its arrival:
  // once it has waited drain_after, B drains for it.
  SpinUntil([&] { return budget->waiters() == 1; }, "A's request waits");
  EXPECT_TRUE(cache.TryAcquire("B").has_value()) << "B's requests overtake";
  clock.Advance(seconds(2));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 2; }, "B drains for A");
  EXPECT_FALSE(cache.TryAcquire("B").has_value());
  b.lease().Release();
  ASSERT_TRUE(a3.Served());
  EXPECT_EQ(a3.lease().key(), "A");
  a3.lease().Release();
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
  EXPECT_EQ(budget->used(), 60u);
}

TEST(Drain, DrainAfterZeroIsStrictArrivalOrder) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(cache, "B", 60);
  // Without the clock moving at all.
  SpinUntil([&] { return budget->drains() == 1; }, "A drains at once");
  EXPECT_FALSE(cache.TryAcquire("A").has_value());
  a.Release();
  ASSERT_TRUE(b.Served());
  EXPECT_EQ(cache.CheckInvariants(), 60u);
}

// A drain's waiter takes the room of a model outside its set that falls
// idle, as any reservation would, rather than wait for its set's leases:
// the set was never evicted and takes leases again.
TEST(Drain, AWaiterTakesAnIdleModelOutsideItsSetAndItsSetIsLeftResident) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 50, SimpleLoader("A", 50));
  Lease c = cache.Acquire("C", 50, SimpleLoader("C", 50));
  Request b(cache, "B", 50);
  SpinUntil([&] { return budget->drains() == 1; }, "A (least recent) drains");
  EXPECT_TRUE(cache.TryAcquire("C").has_value()) << "C is outside the set";
  c.Release();
  SpinUntil(
      [&] {
        const auto entry = cache.Entry("B");
        return entry && entry->leases == 1;
      },
      "B served while A's lease is out");
  if (HasFatalFailure()) {
    a.Release();  // so that the waiter ends
    return;
  }
  ASSERT_TRUE(b.Served());
  EXPECT_FALSE(cache.Entry("C").has_value()) << "C made the room";
  EXPECT_EQ(cache.Entry("A")->leases, 1);
  std::optional<Lease> a2 = cache.TryAcquire("A");
  EXPECT_TRUE(a2.has_value()) << "the drain ended with its waiter";
  EXPECT_EQ(cache.CheckInvariants(), 100u);
}

// With the idle members of its set and idle models outside it together
// covering its shortfall, the waiter takes them before its set's last
// lease ends.
TEST(Drain, AWaiterTakesItsSetsIdleMembersWithIdleModelsOutsideIt) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 30, SimpleLoader("A", 30));
  Lease d = cache.Acquire("D", 30, SimpleLoader("D", 30));
  Lease c = cache.Acquire("C", 40, SimpleLoader("C", 40));
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->drains() == 1; }, "A and D drain");
  EXPECT_FALSE(cache.TryAcquire("D").has_value()) << "D is in the set";
  c.Release();  // 40 idle outside the set: short of 60 alone
  a.Release();  // with A's 30, enough
  SpinUntil(
      [&] {
        const auto entry = cache.Entry("B");
        return entry && entry->leases == 1;
      },
      "B served while D's lease is out");
  if (HasFatalFailure()) {
    d.Release();  // so that the waiter ends
    return;
  }
  ASSERT_TRUE(b.Served());
  EXPECT_FALSE(cache.Entry("A").has_value());
  EXPECT_EQ(cache.Entry("D")->leases, 1);
  std::optional<Lease> d2 = cache.TryAcquire("D");
  EXPECT_TRUE(d2.has_value()) << "the drain ended with its waiter";
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
}

TEST(Drain, DrainNeverIsTheOldRuleModelsInUseAreNeverMadeToGiveUpTheirRoom) {
  FakeClock clock;
  auto budget = MakeBudget(100, kDrainNever, &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->waiters() == 1; }, "B waits for room");
  clock.Advance(std::chrono::hours(24));
  budget->ClockAdvanced();
  std::optional<Lease> again = cache.TryAcquire("A");
  EXPECT_TRUE(again.has_value());
  EXPECT_EQ(budget->drains(), 0u);
  again.reset();
  a.Release();
  ASSERT_TRUE(b.Served());
}

TEST(Drain, ADeadlinePassingWhileQueuedBehindADrainNamesWhatItWaitedFor) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->drains() == 1; }, "A drains");
  const std::string e = testing::ErrorMessage(
      [&] {
        cache.Acquire("A", 60, SimpleLoader("A", 60),
                      WaitForRoom(Clock::now()));
      },
      ErrorCode::kTimeout);
  EXPECT_THAT(e, HasSubstr("'A'"));
  EXPECT_THAT(e, HasSubstr("draining for 'B' in cache 'models'"));
  EXPECT_EQ(cache.Entry("A")->leases, 1);  // it took no lease
  a.Release();
  ASSERT_TRUE(b.Served());
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
}

TEST(Drain, AWaiterThatGivesUpFirstEvictedNothingAndItsQueueTakesLeases) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  // An idle model the drain also needs (B: 80 = 10 free + I + A).
  cache.Prefetch("I", 30, SimpleLoader("I", 30));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  std::atomic<bool> give_up{false};
  AcquireOptions options = WaitForRoom();
  options.interrupt.every = std::chrono::milliseconds(1);
  options.interrupt.check = [&] {
    if (give_up.load()) throw std::runtime_error("interrupted");
  };
  std::optional<std::string> b_error;
  std::thread b([&] {
    try {
      cache.Acquire("B", 80, SimpleLoader("B", 80), options);
    } catch (const std::runtime_error& e) {
      b_error = e.what();
    }
  });
  SpinUntil([&] { return budget->drains() == 1; }, "I and A drain");
  EXPECT_FALSE(cache.Lookup("I").has_value()) << "an idle model drains too";
  Request queued(cache, "A", 60);
  SpinUntil([&] { return budget->queued_behind_drain() == 1; },
            "A's request queues");
  give_up = true;
  b.join();
  ASSERT_EQ(b_error, "interrupted");
  // The drain ended with its waiter: nothing was evicted, the queued
  // request got its lease, and the set takes leases again.
  ASSERT_TRUE(queued.Served());
  EXPECT_EQ(cache.Stats().evictions, 0u);
  EXPECT_EQ(cache.Stats().loads, 2u);
  EXPECT_TRUE(cache.Lookup("I").has_value());
  EXPECT_EQ(cache.CheckInvariants(), 90u);
}

// The drain's start and end reach the cache's observer (EventType
// kDrainStarted, kDrainEnded), after the state change and outside the
// cache's locks (the observer asks the cache from there): the daemon learns
// so that a copy its clients reuse locally must stop taking references.
struct DrainEvents {
  std::mutex mu;
  std::vector<std::string> seen;
  std::atomic<ModelCache*> cache{nullptr};

  void Observe(CacheOptions* options) {
    options->on_event = [this](const CacheEvent& e) {
      if (e.type == EventType::kLoaded) return;
      std::string what = std::string(EventTypeName(e.type)) + ":" + e.key;
      if (e.type == EventType::kDrainStarted ||
          e.type == EventType::kDrainEnded) {
        const std::optional<EntryInfo> entry = cache.load()->Entry(e.key);
        what += entry && entry->draining ? " draining" : " leasable";
      }
      std::lock_guard lock(mu);
      seen.push_back(what);
    };
  }
  std::vector<std::string> Seen() {
    std::lock_guard lock(mu);
    return seen;
  }
};

// A cache on a budget of 100 bytes that drains at once, observed.
struct ObservedCache {
  FakeClock clock;
  std::shared_ptr<Budget> budget =
      MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  DrainEvents events;
  ModelCache cache{Options()};

  ObservedCache() { events.cache = &cache; }
  CacheOptions Options() {
    CacheOptions options = On(budget, "models", &clock);
    events.Observe(&options);
    return options;
  }
};

TEST(Drain, ItsStartAndItsEvictionReachTheObserver) {
  ObservedCache observed;
  auto& budget = observed.budget;
  auto& events = observed.events;
  auto& cache = observed.cache;
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->drains() == 1; }, "A drains");
  EXPECT_THAT(events.Seen(),
              ::testing::ElementsAre("drain_started:A draining"));
  a.Release();
  ASSERT_TRUE(b.Served());
  // Evicted for its waiter: no drain_ended, the eviction says it.
  EXPECT_THAT(events.Seen(),
              ::testing::ElementsAre("drain_started:A draining", "evicted:A"));
}

TEST(Drain, ItsEndWithoutAnEvictionReachesTheObserver) {
  ObservedCache observed;
  auto& budget = observed.budget;
  auto& events = observed.events;
  auto& cache = observed.cache;
  cache.Prefetch("I", 30, SimpleLoader("I", 30));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  std::atomic<bool> give_up{false};
  AcquireOptions options = WaitForRoom();
  options.interrupt.every = std::chrono::milliseconds(1);
  options.interrupt.check = [&] {
    if (give_up.load()) throw std::runtime_error("interrupted");
  };
  std::thread b([&] {
    try {
      cache.Acquire("B", 80, SimpleLoader("B", 80), options);
    } catch (const std::runtime_error&) {
    }
  });
  SpinUntil([&] { return budget->drains() == 1; }, "I and A drain");
  SpinUntil([&] { return events.Seen().size() == 2; }, "both are told");
  EXPECT_THAT(events.Seen(),
              ::testing::UnorderedElementsAre("drain_started:I draining",
                                              "drain_started:A draining"));
  give_up = true;
  b.join();
  SpinUntil([&] { return events.Seen().size() == 4; }, "both end");
  const std::vector<std::string> seen = events.Seen();
  EXPECT_THAT(std::vector<std::string>(seen.begin() + 2, seen.end()),
              ::testing::UnorderedElementsAre("drain_ended:I leasable",
                                              "drain_ended:A leasable"));
  EXPECT_EQ(cache.Stats().evictions, 0u);
}

TEST(Drain, PinnedRoomIsNeverDrainedTheWaiterWaitsToItsDeadline) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  cache.Prefetch("P", 60, SimpleLoader("P", 60));
  cache.Pin("P");
  const std::string e = testing::ErrorMessage(
      [&] {
        cache.Acquire("B", 60, SimpleLoader("B", 60),
                      WaitForRoom(Clock::now()));
      },
      ErrorCode::kTimeout);
  EXPECT_THAT(e, HasSubstr("'P'"));
  EXPECT_EQ(budget->drains(), 0u);
  EXPECT_TRUE(cache.Lookup("P").has_value());
  EXPECT_EQ(cache.Stats().evictions, 0u);
}

TEST(Drain, LeasesTheWaiterHoldsCountAsPins) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  AcquireOptions options = WaitForRoom(Clock::now());
  options.holds = {a.id()};
  testing::ErrorMessage(
      [&] { cache.Acquire("B", 60, SimpleLoader("B", 60), options); },
      ErrorCode::kTimeout);
  EXPECT_EQ(budget->drains(), 0u);
  EXPECT_TRUE(cache.TryAcquire("A").has_value());
}

TEST(Drain, ARequestTooLargeForTheBudgetIsRefusedAtOnceAndDrainsNothing) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  testing::ErrorMessage(
      [&] { cache.Acquire("B", 200, SimpleLoader("B", 200), WaitForRoom()); },
      ErrorCode::kTooLarge);
  EXPECT_EQ(budget->drains(), 0u);
  EXPECT_EQ(budget->waiters(), 0);
  EXPECT_TRUE(cache.TryAcquire("A").has_value());
}

TEST(Drain, ADrainSpansTheCachesOfASharedBudget) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache checkpoints(On(budget, "checkpoints", &clock));
  ModelCache adapters(On(budget, "adapters", &clock));
  Lease a = checkpoints.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(adapters, "B", 60);
  SpinUntil([&] { return budget->drains() == 1; }, "A drains");
  EXPECT_FALSE(checkpoints.TryAcquire("A").has_value());
  a.Release();
  ASSERT_TRUE(b.Served());
  EXPECT_FALSE(checkpoints.Entry("A").has_value());
  EXPECT_EQ(checkpoints.CheckInvariants() + adapters.CheckInvariants(),
            budget->used());
}

TEST(Drain, OtherMissesGetOnlyTheRoomNoDrainIsOwed) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 50, SimpleLoader("A", 50));
  Request b(cache, "B", 80);
  SpinUntil([&] { return budget->drains() == 1; }, "A drains");
  // 50 bytes are free, but B is owed them (and A's).
  testing::ErrorMessage([&] { cache.Acquire("C", 20, SimpleLoader("C", 20)); },
                        ErrorCode::kCapacity);
  a.Release();
  ASSERT_TRUE(b.Served());
  // Now the 20 bytes nobody is owed are anyone's.
  Lease c = cache.Acquire("C", 20, SimpleLoader("C", 20));
  EXPECT_EQ(budget->used(), 100u);
}

TEST(Drain, TheOldestWaiterDrainsFirst) {
  FakeClock clock;
  auto budget = MakeBudget(100, seconds(2), &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 50, SimpleLoader("A", 50));
  Lease z = cache.Acquire("Z", 50, SimpleLoader("Z", 50));
  Request b(cache, "B", 50);
  SpinUntil([&] { return budget->waiters() == 1; }, "B waits");
  clock.Advance(seconds(1));
  Request c(cache, "C", 50);
  SpinUntil([&] { return budget->waiters() == 2; }, "C waits");
  clock.Advance(seconds(1));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 1; }, "a drain for B");
  // B's drain takes the lowest ranked (A, the least recently used) only.
  EXPECT_FALSE(cache.TryAcquire("A").has_value());
  std::optional<Lease> z2 = cache.TryAcquire("Z");
  EXPECT_TRUE(z2.has_value());
  a.Release();
  ASSERT_TRUE(b.Served());
  // C has waited drain_after too: Z (or B) drains for it next.
  clock.Advance(seconds(1));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 2; }, "a drain for C");
  z.Release();
  z2.reset();
  b.lease().Release();
  ASSERT_TRUE(c.Served());
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
}

// ---- The default drain_after (kDrainAfterAuto) ----

static_assert(DefaultDrainAfter(std::chrono::nanoseconds(0)) == seconds(1));
static_assert(DefaultDrainAfter(std::chrono::milliseconds(100)) == seconds(1));
static_assert(DefaultDrainAfter(seconds(2)) == seconds(8));
static_assert(DefaultDrainAfter(kDrainNever / 2) == kDrainNever);
static_assert(DefaultDrainAfter(seconds(2), seconds(9)) == seconds(72));
static_assert(DefaultDrainAfter(seconds(30), seconds(9)) == seconds(120));
static_assert(DefaultDrainAfter(std::chrono::nanoseconds(0), kDrainNever / 4) ==
              kDrainNever);
static_assert(NextRecentDrains(std::chrono::nanoseconds(0), seconds(9)) ==
              seconds(9));
static_assert(NextRecentDrains(seconds(9), seconds(1)) == seconds(5));

// Counts the waiter's looks for room that end in going back to sleep
// (detail::reservation_waits_for_room): a look after the clock moved that
// started no drain shows that drain_after has not passed yet.
std::atomic<int> looks{0};
class CountLooks {
 public:
  CountLooks() {
    detail::reservation_waits_for_room.store([] { looks.fetch_add(1); });
  }
  ~CountLooks() { detail::reservation_waits_for_room.store(nullptr); }
};

// Moves the clock by `by` and waits until the waiter has looked again.
void AdvanceAndLook(FakeClock& clock, Budget& budget,
                    std::chrono::nanoseconds by) {
  const int before = looks.load();
  clock.Advance(by);
  budget.ClockAdvanced();
  SpinUntil([&] { return looks.load() > before; }, "the waiter looks again");
}

// A loader that takes `load` on the fake clock.
Loader SlowLoader(FakeClock& clock, const std::string& key, uint64_t bytes,
                  std::chrono::nanoseconds load) {
  return [&clock, key, bytes, load] {
    clock.Advance(load);
    return SimpleLoader(key, bytes)();
  };
}

// The default: four times what the cache last measured loading the
// waiter's key. B loaded in 2 s before, so a wait for B's room is
// overtaken for 8 s, not for the 1 s floor.
TEST(Drain, ByDefaultAWaiterIsOvertakenForFourTimesItsKeysLastLoad) {
  CountLooks counting;
  FakeClock clock;
  auto budget = MakeBudget(100, kDrainAfterAuto, &clock);
  EXPECT_EQ(budget->drain_after(), kDrainAfterAuto);
  ModelCache cache(On(budget, "models", &clock));
  cache.Acquire("B", 60, SlowLoader(clock, "B", 60, seconds(2))).Release();
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));  // evicts B
  ASSERT_FALSE(cache.Entry("B").has_value());
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->waiters() == 1; }, "B waits for room");
  AdvanceAndLook(clock, *budget, seconds(1));
  AdvanceAndLook(clock, *budget, std::chrono::milliseconds(6999));
  EXPECT_EQ(budget->drains(), 0u) << "drained before 8 s";
  std::optional<Lease> a2 = cache.TryAcquire("A");
  EXPECT_TRUE(a2.has_value()) << "A's requests overtake B for 8 s";
  a.Release();
  clock.Advance(std::chrono::milliseconds(1));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 1; }, "A drains at 8 s");
  EXPECT_FALSE(cache.TryAcquire("A").has_value());
  a2.reset();
  ASSERT_TRUE(b.Served());
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
}

// A key never loaded has no measured load: its waiter is overtaken for the
// floor, 1 s.
TEST(Drain, ByDefaultAKeyNeverLoadedIsOvertakenForTheFloor) {
  CountLooks counting;
  FakeClock clock;
  ModelCache cache([&] {
    CacheOptions options = On(nullptr, "models", &clock);
    options.capacity_bytes = 100;  // a budget of its own, default drain_after
    return options;
  }());
  Budget& budget = cache.budget();
  EXPECT_EQ(budget.drain_after(), kDrainAfterAuto);
  Lease a = cache.Acquire("A", 60, SlowLoader(clock, "A", 60, seconds(2)));
  Request c(cache, "C", 60);
  SpinUntil([&] { return budget.waiters() == 1; }, "C waits for room");
  AdvanceAndLook(clock, budget, std::chrono::milliseconds(999));
  EXPECT_EQ(budget.drains(), 0u) << "drained before 1 s";
  clock.Advance(std::chrono::milliseconds(1));
  budget.ClockAdvanced();
  SpinUntil([&] { return budget.drains() == 1; }, "A drains at 1 s");
  a.Release();
  ASSERT_TRUE(c.Served());
  EXPECT_EQ(c.lease().key(), "C");
}

// The default also weighs how long the budget's drains lasted: eight times
// its recent drains. B's drain starts at the 1 s floor and ends 9 s later,
// when A's lease does; so C, a key never loaded, is then overtaken for
// 72 s, not for the floor.
TEST(Drain, ByDefaultAWaiterIsOvertakenForEightTimesTheRecentDrains) {
  CountLooks counting;
  FakeClock clock;
  auto budget = MakeBudget(100, kDrainAfterAuto, &clock);
  ModelCache cache(On(budget, "models", &clock));
  Lease a = cache.Acquire("A", 60, SimpleLoader("A", 60));
  Request b(cache, "B", 60);
  SpinUntil([&] { return budget->waiters() == 1; }, "B waits for room");
  EXPECT_EQ(budget->recent_drains(), seconds(0));
  clock.Advance(seconds(1));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 1; }, "A drains at 1 s");
  clock.Advance(seconds(9));
  a.Release();
  ASSERT_TRUE(b.Served());
  EXPECT_EQ(budget->recent_drains(), seconds(9));

  Request c(cache, "C", 60);
  SpinUntil([&] { return budget->waiters() == 1; }, "C waits for room");
  AdvanceAndLook(clock, *budget, seconds(1));
  AdvanceAndLook(clock, *budget, std::chrono::milliseconds(70999));
  EXPECT_EQ(budget->drains(), 1u) << "drained before 72 s";
  EXPECT_TRUE(cache.TryAcquire("B").has_value()) << "B's requests overtake";
  clock.Advance(std::chrono::milliseconds(1));
  budget->ClockAdvanced();
  SpinUntil([&] { return budget->drains() == 2; }, "B drains at 72 s");
  b.lease().Release();
  ASSERT_TRUE(c.Served());
  EXPECT_EQ(c.lease().key(), "C");
  // That drain was immediate: the recent drains move half of the way.
  EXPECT_EQ(budget->recent_drains(), std::chrono::milliseconds(4500));
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
}

// ---- Waiters no drain can serve ----

// P is pinned and X leased: a drain of X cannot cover W1 or W2, so neither
// drains. Neither may stop X taking leases even for a moment (a hit on X
// would miss for nothing), and each refusal must hold until something a
// drain could use changes: before, every refusal expired the other's, and
// the two waiters retried each other for as long as they waited.
TEST(Drain, WaitersNoDrainCanServeStopNothingAndSleep) {
  ObservedCache observed;
  auto& budget = observed.budget;
  auto& events = observed.events;
  auto& cache = observed.cache;
  cache.Prefetch("P", 50, SimpleLoader("P", 50));
  cache.Pin("P");
  Lease x = cache.Acquire("X", 50, SimpleLoader("X", 50));
  CountLooks count_looks;
  const int looks_before = looks.load();
  // Real deadlines: both wait for them, asleep.
  const auto deadline = Clock::now() + std::chrono::milliseconds(300);
  Request w1(cache, "W1", 60, WaitForRoom(deadline));
  Request w2(cache, "W2", 70, WaitForRoom(deadline));
  w1.Join();
  w2.Join();
  EXPECT_EQ(w1.code(), ErrorCode::kTimeout);
  EXPECT_EQ(w2.code(), ErrorCode::kTimeout);
  EXPECT_THAT(events.Seen(), ::testing::IsEmpty());
  EXPECT_EQ(budget->drains(), 0u);
  // Each looks a few times as the other arrives and refuses; retrying each
  // other, they looked thousands of times in 300 ms.
  EXPECT_LT(looks.load() - looks_before, 20);
  EXPECT_TRUE(cache.TryAcquire("X").has_value());
}

// L is still loading when W looks (a drain takes only resident models) and
// P is pinned, so no drain serves W. L's load ends leased: that makes it
// one a drain may take, and W must look again then, not when L's leases
// end (a busy model's never do).
TEST(Drain, AModelWhoseLoadEndsLeasedDrainsForAWaiterNoDrainCouldServe) {
  FakeClock clock;
  auto budget = MakeBudget(100, std::chrono::nanoseconds(0), &clock);
  ModelCache cache(On(budget, "models", &clock));
  cache.Prefetch("P", 50, SimpleLoader("P", 50));
  cache.Pin("P");
  std::promise<void> finish_load;
  std::shared_future<void> load_may_end = finish_load.get_future().share();
  Lease l;
  std::thread loading([&] {
    l = cache.Acquire("L", 50, [load_may_end] {
      load_may_end.wait();
      return SimpleLoader("L", 50)();
    });
  });
  SpinUntil([&] { return budget->used() == 100; }, "L loads");
  CountLooks count_looks;
  const int looks_before = looks.load();
  Request w(cache, "W", 50);
  SpinUntil([&] { return looks.load() > looks_before; }, "W sleeps");
  EXPECT_EQ(budget->drains(), 0u);
  finish_load.set_value();
  loading.join();
  SpinUntil([&] { return budget->drains() == 1; }, "L drains for W");
  EXPECT_FALSE(cache.TryAcquire("L").has_value());
  l.Release();
  ASSERT_TRUE(w.Served());
  EXPECT_FALSE(cache.Entry("L").has_value());
  EXPECT_EQ(cache.CheckInvariants(), budget->used());
}

}  // namespace
}  // namespace modelcache
