// Budgets: reservation before load, shared budgets with cross-cache
// eviction, waiting for capacity, and the exact return of every byte (seed
// 000's phantom memory).
#include <stdexcept>
#include <thread>

#include "../../src/core/test_hooks.h"
#include "gtest/gtest.h"
#include "modelcache/core/cache.h"
#include "../test_util.h"

namespace modelcache {
namespace {

using testing::FakeModel;
using testing::Gate;
using testing::SimpleLoader;
using testing::SpinUntil;
using testing::WaitForRoom;

CacheOptions On(std::shared_ptr<Budget> budget, const std::string& name) {
  CacheOptions options;
  options.name = name;
  options.budget = std::move(budget);
  options.shard_bits = 2;
  return options;
}

TEST(CacheBudget, BytesAreReservedBeforeTheLoaderRuns) {
  auto budget = std::make_shared<Budget>(100, "host");
  ModelCache cache(On(budget, "models"));
  uint64_t used_during_load = 0;
  cache.Prefetch("x", 60, [&] {
    used_during_load = budget->used();
    return Loaded{std::make_shared<FakeModel>("x", 1), 40, {}};
  });
  EXPECT_EQ(used_during_load, 60u);
  EXPECT_EQ(budget->used(), 40u);  // adjusted to the real size
  EXPECT_EQ(cache.CheckInvariants(), 40u);
}

TEST(CacheBudget, RealSizeLargerThanRoomRefusesTheLoadAndKeepsTheBooks) {
  auto budget = std::make_shared<Budget>(100, "host");
  ModelCache cache(On(budget, "models"));
  Lease held = cache.Acquire("held", 70, SimpleLoader("held", 70));
  int unloads = 0;
  try {
    cache.Acquire("x", 20, [&] {
      return Loaded{std::make_shared<FakeModel>("x", 1), 50,
                    [&] { ++unloads; }};
    });
    FAIL() << "expected a capacity error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCapacity);
    EXPECT_NE(std::string(e.what()).find("'held'"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(unloads, 1);  // the refused model was cleaned up
  EXPECT_FALSE(cache.Entry("x").has_value());
  EXPECT_EQ(budget->used(), 70u);
  EXPECT_EQ(budget->high_water(), 90u);  // never above capacity
}

TEST(CacheBudget, TwoCachesShareABudgetAndEvictFromEachOther) {
  std::vector<std::string> unloaded;  // outlives the caches' unloaders
  auto budget = std::make_shared<Budget>(30, "host");
  ModelCache checkpoints(On(budget, "checkpoints"));
  ModelCache adapters(On(budget, "adapters"));
  auto loader = [&](const std::string& key) {
    return SimpleLoader(key, 10, nullptr,
                        [&, key] { unloaded.push_back(key); });
  };
  checkpoints.Prefetch("ckpt-1", 10, loader("ckpt-1"));
  adapters.Prefetch("lora-1", 10, loader("lora-1"));
  checkpoints.Prefetch("ckpt-2", 10, loader("ckpt-2"));
  // Full. A new adapter evicts the globally least recently used record,
  // which lives in the other cache.
  adapters.Prefetch("lora-2", 10, loader("lora-2"));
  EXPECT_EQ(unloaded, std::vector<std::string>{"ckpt-1"});
  // And the other way round.
  checkpoints.Prefetch("ckpt-3", 10, loader("ckpt-3"));
  EXPECT_EQ(unloaded, (std::vector<std::string>{"ckpt-1", "lora-1"}));
  EXPECT_EQ(budget->used(),
            checkpoints.CheckInvariants() + adapters.CheckInvariants());
  EXPECT_EQ(budget->used(), 30u);
}

TEST(CacheBudget, CacheDestroyedWithoutShutdownReturnsEveryByte) {
  auto budget = std::make_shared<Budget>(100, "host");
  ModelCache survivor(On(budget, "survivor"));
  survivor.Prefetch("s", 10, SimpleLoader("s", 10));
  int unloads = 0;
  {
    ModelCache dropped(On(budget, "dropped"));
    dropped.Prefetch("a", 30,
                     SimpleLoader("a", 30, nullptr, [&] { ++unloads; }));
    dropped.Prefetch("b", 40,
                     SimpleLoader("b", 40, nullptr, [&] { ++unloads; }));
    EXPECT_EQ(budget->used(), 80u);
  }
  EXPECT_EQ(unloads, 2);
  EXPECT_EQ(budget->used(), 10u);
  // The survivor can use the whole remainder: no phantom bytes.
  survivor.Prefetch("big", 90, SimpleLoader("big", 90));
  EXPECT_EQ(budget->used(), 100u);
}

TEST(CacheBudget, AcquireWaitsForALeaseToEndWhenAsked) {
  auto budget = std::make_shared<Budget>(20, "host");
  ModelCache cache(On(budget, "models"));
  Lease a = cache.Acquire("a", 10, SimpleLoader("a", 10));
  Lease b = cache.Acquire("b", 10, SimpleLoader("b", 10));
  std::atomic<bool> served{false};
  std::thread waiter([&] {
    const AcquireOptions wait = WaitForRoom();
    Lease c = cache.Acquire("c", 10, SimpleLoader("c", 10), wait);
    EXPECT_TRUE(c);
    served.store(true);
  });
  SpinUntil([&] { return budget->waiters() == 1; }, "acquire waits for room");
  EXPECT_FALSE(served.load());
  a.Release();  // "a" becomes evictable: the waiter evicts it and loads
  waiter.join();
  EXPECT_TRUE(served.load());
  EXPECT_FALSE(cache.Entry("a").has_value());
  EXPECT_EQ(budget->used(), 20u);
}

TEST(CacheBudget, WaitForCapacityTimesOutWithBooksUnchanged) {
  auto budget = std::make_shared<Budget>(20, "host");
  ModelCache cache(On(budget, "models"));
  Lease a = cache.Acquire("a", 20, SimpleLoader("a", 20));
  const AcquireOptions wait = WaitForRoom(Clock::now());
  int calls = 0;
  try {
    cache.Acquire(
        "c", 10,
        [&] {
          ++calls;
          return Loaded{};
        },
        wait);
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  }
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(budget->used(), 20u);
  EXPECT_EQ(budget->waiters(), 0);
  EXPECT_FALSE(cache.Entry("c").has_value());
}

TEST(CacheBudget, CapacityErrorNamesWhatHoldsTheMemory) {
  auto budget = std::make_shared<Budget>(30, "host");
  ModelCache cache(On(budget, "models"));
  Lease a = cache.Acquire("alpha", 10, SimpleLoader("alpha", 10));
  cache.Prefetch("beta", 20, SimpleLoader("beta", 20));
  cache.Pin("beta");
  try {
    cache.Acquire("gamma", 10, SimpleLoader("gamma", 10));
    FAIL() << "expected a capacity error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCapacity);
    const std::string message = e.what();
    EXPECT_NE(message.find("'alpha' (10 B, 1 lease)"), std::string::npos)
        << message;
    EXPECT_NE(message.find("'beta' (20 B, pinned)"), std::string::npos)
        << message;
  }
  EXPECT_EQ(budget->used(), 30u);
}

TEST(CacheBudget, ModelLargerThanTheBudgetIsRefusedBeforeLoading) {
  auto budget = std::make_shared<Budget>(30, "host");
  ModelCache cache(On(budget, "models"));
  int calls = 0;
  try {
    cache.Acquire("huge", 31, [&] {
      ++calls;
      return Loaded{};
    });
    FAIL() << "expected kTooLarge";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTooLarge);
  }
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(budget->used(), 0u);
}

TEST(CacheBudget, ShrinkingASharedBudgetEvictsAcrossCaches) {
  auto budget = std::make_shared<Budget>(40, "host");
  ModelCache a(On(budget, "a"));
  ModelCache b(On(budget, "b"));
  a.Prefetch("a1", 10, SimpleLoader("a1", 10));
  b.Prefetch("b1", 10, SimpleLoader("b1", 10));
  Lease held = a.Acquire("a2", 10, SimpleLoader("a2", 10));
  b.Prefetch("b2", 10, SimpleLoader("b2", 10));
  EXPECT_EQ(budget->SetCapacity(5), 5u);  // only the leased a2 is left
  EXPECT_EQ(budget->used(), 10u);
  EXPECT_TRUE(a.Entry("a2").has_value());
  EXPECT_EQ(a.Entries().size() + b.Entries().size(), 1u);
}

TEST(CacheBudget, PeerEvictionDuringACacheDestructionIsSafe) {
  // A peer evicting from a cache that is being destroyed must neither touch
  // freed records nor release their bytes twice.
  auto budget = std::make_shared<Budget>(20, "host");
  ModelCache survivor(On(budget, "survivor"));
  for (int round = 0; round < 50; ++round) {
    auto doomed = std::make_unique<ModelCache>(On(budget, "doomed"));
    doomed->Prefetch("d1", 10, SimpleLoader("d1", 10));
    doomed->Prefetch("d2", 10, SimpleLoader("d2", 10));
    std::thread peer([&] {
      const AcquireOptions wait = WaitForRoom();
      const std::string key = std::to_string(round) + "-survivor";
      survivor.Prefetch(key, 10, SimpleLoader(key, 10), wait);
    });
    doomed.reset();
    peer.join();
    EXPECT_EQ(budget->used(), survivor.CheckInvariants());
  }
}

std::atomic<int> shutdowns_waiting{0};
void CountShutdownWaiting() { shutdowns_waiting.fetch_add(1); }

TEST(CacheBudget, DestructionWaitsForAPeerEvictionStillUnloading) {
  // A peer found a victim in `doomed` before `doomed` began to go away, and
  // its unloader is still running. The destructor must wait for it rather
  // than unload the victim a second time and return its bytes twice.
  auto budget = std::make_shared<Budget>(20, "host");
  ModelCache survivor(On(budget, "survivor"));
  auto doomed = std::make_unique<ModelCache>(On(budget, "doomed"));
  Gate release_unload;
  std::atomic<int> unloads_started{0};
  std::atomic<int> unloads_done{0};
  auto blocking_loader = [&](const std::string& key) -> Loader {
    return [&, key] {
      return Loaded{std::make_shared<FakeModel>(key, 1), 10, [&] {
                      unloads_started.fetch_add(1);
                      release_unload.Pass();
                      unloads_done.fetch_add(1);
                    }};
    };
  };
  doomed->Prefetch("d1", 10, blocking_loader("d1"));
  doomed->Prefetch("d2", 10, blocking_loader("d2"));
  std::thread peer([&] {
    const AcquireOptions wait = WaitForRoom();
    survivor.Prefetch("s", 10, SimpleLoader("s", 10), wait);
  });
  SpinUntil([&] { return unloads_started.load() == 1; },
            "the peer's eviction runs its unloader");
  shutdowns_waiting = 0;
  detail::shutdown_waits_for_unload = &CountShutdownWaiting;
  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    doomed.reset();
    destroyed = true;
  });
  // Without the wait, the destructor unloads the victim again (a second
  // unloader start) or finishes while the first unload is still running.
  SpinUntil(
      [&] {
        return shutdowns_waiting.load() > 0 || unloads_started.load() > 1 ||
               destroyed.load();
      },
      "the destructor reaches the record being unloaded");
  EXPECT_GT(shutdowns_waiting.load(), 0);
  EXPECT_EQ(unloads_started.load(), 1);
  EXPECT_FALSE(destroyed.load());
  release_unload.Open();
  peer.join();
  destroyer.join();
  detail::shutdown_waits_for_unload = nullptr;
  EXPECT_EQ(unloads_done.load(), 2);  // each model unloaded exactly once
  EXPECT_EQ(budget->used(), 10u);     // only the survivor's model
  EXPECT_EQ(survivor.CheckInvariants(), 10u);
}

}  // namespace
}  // namespace modelcache
