// One serialised lifecycle per resolved key: the scenarios of Roboflow
// inference's ModelManager bug (per-model lock generations, waiter/newcomer
// races, rollback of failed removals and evictions) and the single-flight
// contract.
//
// Every schedule is driven by gates inside loaders and unloaders and by
// waiting for observable state (EntryInfo::waiters), never by sleeping.
#include <atomic>
#include <latch>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../../src/core/test_hooks.h"
#include "gtest/gtest.h"
#include "modelcache/core/cache.h"
#include "../test_util.h"

namespace modelcache {
namespace {

using testing::ConstructionCounter;
using testing::FakeModel;
using testing::Gate;
using testing::SimpleLoader;
using testing::SpinUntil;
using testing::WaitersOn;
using testing::WaitForRoom;

CacheOptions Options(uint64_t capacity, int shard_bits = 4) {
  CacheOptions options;
  options.capacity_bytes = capacity;
  options.shard_bits = shard_bits;
  return options;
}

// Unloaders for a test's 10-byte models. Each records its key in `unloaded`
// when it succeeds; the unloader of `failing` throws "unload of KEY failed"
// instead, only once when `once`, otherwise until StopFailing(). Declare it
// before the cache, so that it outlives the cache and its unloaders.
class Unloads {
 public:
  Unloads(std::string failing, bool once)
      : failing_(std::move(failing)), once_(once) {}
  std::function<void()> Of(const std::string& key) {
    return [this, key] {
      if (key == failing_ && fails_) {
        if (once_) fails_ = false;
        throw std::runtime_error("unload of " + key + " failed");
      }
      unloaded.push_back(key);
    };
  }
  Loader LoaderOf(const std::string& key) {
    return SimpleLoader(key, 10, nullptr, Of(key));
  }
  void StopFailing() { fails_ = false; }

  std::vector<std::string> unloaded;

 private:
  const std::string failing_;
  const bool once_;
  bool fails_ = true;
};

// A loader of a 10-byte model of `key` that counts its construction in
// `constructions` and blocks in it until `gate` opens.
Loader GatedLoader(const std::string& key, ConstructionCounter* constructions,
                   Gate* gate) {
  return [key, constructions, gate] {
    constructions->Enter();
    gate->Pass();
    constructions->Leave();
    return Loaded{std::make_shared<FakeModel>(key, 1), 10, {}};
  };
}

TEST(CacheLifecycle, ConcurrentAcquiresOfOneColdKeyConstructOnce) {
  ModelCache cache(Options(1000));
  ConstructionCounter constructions;
  Gate release_load;
  Loader loader = GatedLoader("x", &constructions, &release_load);
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> served{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      Lease lease = cache.Acquire("x", 10, loader);
      ASSERT_TRUE(lease);
      EXPECT_EQ(lease.get<FakeModel>()->generation, 1);
      served.fetch_add(1);
    });
  }
  SpinUntil([&] { return WaitersOn(cache, "x") == kThreads - 1; },
            "every other caller joins the load");
  EXPECT_EQ(served.load(), 0);
  release_load.Open();
  for (auto& t : threads) t.join();
  EXPECT_EQ(constructions.started.load(), 1);
  EXPECT_EQ(served.load(), kThreads);
  CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.loads, 1u);
  EXPECT_EQ(stats.misses, static_cast<uint64_t>(kThreads));
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

// What the load's completion publishes, seen from the hook that runs after
// the record became resident and before its waiters are woken.
std::atomic<ModelCache*> published_cache{nullptr};
std::atomic<int> leases_at_publication{-1};
std::atomic<int> waiters_at_publication{-1};

void RecordPublication(std::string_view key) {
  const std::optional<EntryInfo> entry =
      published_cache.load()->Entry(std::string(key));
  leases_at_publication = entry ? entry->leases : -2;
  waiters_at_publication = entry ? entry->waiters : -2;
}

// "Never evict a model in use" holds for waiters only if each holds its
// lease from the moment the model is resident, not from when it wakes:
// otherwise the owner could release, and an eviction take the model, before
// a waiter runs. So the leases must all be there before any waiter wakes.
TEST(CacheLifecycle, WaitersHoldTheirLeasesBeforeAnyOfThemWakes) {
  ModelCache cache(Options(1000));
  Gate release_load;
  auto loader = [&] {
    release_load.Pass();
    return Loaded{std::make_shared<FakeModel>("x", 1), 10, {}};
  };
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] { EXPECT_TRUE(cache.Acquire("x", 10, loader)); });
  }
  SpinUntil([&] { return WaitersOn(cache, "x") == kThreads - 1; },
            "every other caller joins the load");
  published_cache = &cache;
  detail::after_load_published = &RecordPublication;
  release_load.Open();
  for (auto& t : threads) t.join();
  detail::after_load_published = nullptr;
  EXPECT_EQ(leases_at_publication.load(), kThreads);
  EXPECT_EQ(waiters_at_publication.load(), 0);
  EXPECT_EQ(cache.Entry("x")->leases, 0);
  EXPECT_EQ(cache.CheckInvariants(), 10u);  // "x" resident, unleased
}

TEST(CacheLifecycle, TimedOutWaiterDoesNotRetireTheActiveLoad) {
  ModelCache cache(Options(1000));
  std::atomic<int> calls{0};
  Gate release_load;
  std::thread owner([&] {
    Lease lease = cache.Acquire("x", 10, [&] {
      calls.fetch_add(1);
      release_load.Pass();
      return Loaded{std::make_shared<FakeModel>("x", 1), 10, {}};
    });
    EXPECT_TRUE(lease);
  });
  SpinUntil([&] { return cache.Entry("x").has_value(); }, "load starts");

  // A waiter whose deadline has already passed gives up at once.
  AcquireOptions impatient;
  impatient.deadline = Clock::now();
  try {
    cache.Acquire("x", 10, SimpleLoader("x", 10, &calls), impatient);
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  }
  // The load in flight is untouched: still loading, nobody waits on it.
  ASSERT_TRUE(cache.Entry("x").has_value());
  EXPECT_EQ(cache.Entry("x")->state, EntryState::kLoading);
  EXPECT_EQ(cache.Entry("x")->waiters, 0);

  release_load.Open();
  owner.join();
  Lease again = cache.Acquire("x", 10, SimpleLoader("x", 10, &calls));
  EXPECT_EQ(again.get<FakeModel>()->generation, 1);
  EXPECT_EQ(calls.load(), 1);
}

TEST(CacheLifecycle,
     FailedLoadWithSeveralWaitersDeliversOneErrorAndNoSecondConstruction) {
  ModelCache cache(Options(1000));
  ConstructionCounter constructions;
  Gate release_load;
  auto failing = [&]() -> Loaded {
    constructions.Enter();
    release_load.Pass();
    constructions.Leave();
    throw std::runtime_error("disk on fire");
  };
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<const void*> error_objects(kThreads, nullptr);
  // Held until the threads are joined (see KeptErrors in tests/test_util.h).
  std::vector<std::exception_ptr> errors(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      try {
        cache.Acquire("x", 10, failing);
        ADD_FAILURE() << "expected the loader's error";
      } catch (const std::runtime_error& e) {
        errors[i] = std::current_exception();
        EXPECT_STREQ(e.what(), "disk on fire");
        error_objects[i] = &e;
      }
    });
  }
  SpinUntil([&] { return WaitersOn(cache, "x") == kThreads - 1; },
            "every other caller joins the failing load");
  release_load.Open();
  for (auto& t : threads) t.join();
  EXPECT_EQ(constructions.started.load(), 1);
  EXPECT_EQ(constructions.max_running.load(), 1);
  // The waiters were handed the owner's exception object itself.
  for (int i = 1; i < kThreads; ++i) {
    EXPECT_EQ(error_objects[i], error_objects[0]);
  }
  // Nothing is cached and nothing stays reserved.
  EXPECT_FALSE(cache.Entry("x").has_value());
  EXPECT_EQ(cache.budget().used(), 0u);
  EXPECT_EQ(cache.Stats().load_failures, 1u);
}

TEST(CacheLifecycle, FailuresAreNotCachedAndTheNextAcquireLoadsAgain) {
  ModelCache cache(Options(1000));
  int attempts = 0;
  auto flaky = [&]() -> Loaded {
    if (++attempts == 1) throw std::runtime_error("transient");
    return Loaded{std::make_shared<FakeModel>("x", attempts), 10, {}};
  };
  EXPECT_THROW(cache.Acquire("x", 10, flaky), std::runtime_error);
  EXPECT_FALSE(cache.Entry("x").has_value());
  Lease lease = cache.Acquire("x", 10, flaky);
  EXPECT_EQ(lease.get<FakeModel>()->generation, 2);
  EXPECT_EQ(attempts, 2);
}

TEST(CacheLifecycle, FailedRemovalKeepsTheModelAndItsPlaceInTheOrder) {
  Unloads unloads("a", /*once=*/true);
  ModelCache cache(Options(30, /*shard_bits=*/0));
  for (const char* key : {"a", "b", "c"}) {
    cache.Prefetch(key, 10, unloads.LoaderOf(key));
  }
  try {
    cache.Remove("a");
    FAIL() << "expected the unloader's error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "unload of a failed");
  }
  ASSERT_TRUE(cache.Entry("a").has_value());
  EXPECT_EQ(cache.Entry("a")->state, EntryState::kResident);
  EXPECT_EQ(cache.budget().used(), 30u);
  EXPECT_EQ(cache.Stats().failed_unloads, 1u);

  // "a" is still the least recently used: the next load evicts it first.
  cache.Prefetch("d", 10, unloads.LoaderOf("d"));
  EXPECT_EQ(unloads.unloaded, std::vector<std::string>{"a"});
  EXPECT_FALSE(cache.Entry("a").has_value());
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

TEST(CacheLifecycle, AliasesShareOneLifecycle) {
  ModelCache cache(Options(1000));
  cache.AddAlias("latest", "model-v2");
  ConstructionCounter constructions;
  Gate release_load;
  Loader loader = GatedLoader("model-v2", &constructions, &release_load);
  std::thread by_key(
      [&] { EXPECT_TRUE(cache.Acquire("model-v2", 10, loader)); });
  SpinUntil([&] { return cache.Entry("model-v2").has_value(); }, "load starts");
  std::thread by_alias([&] {
    Lease lease = cache.Acquire("latest", 10, loader);
    EXPECT_EQ(lease.key(), "model-v2");
  });
  SpinUntil([&] { return WaitersOn(cache, "model-v2") == 1; },
            "the alias joins the canonical load");
  release_load.Open();
  by_key.join();
  by_alias.join();
  EXPECT_EQ(constructions.started.load(), 1);
  // Books under the canonical key only.
  auto entries = cache.Entries();
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].key, "model-v2");
  EXPECT_EQ(cache.Remove("latest"), RemoveOutcome::kRemoved);
  EXPECT_TRUE(cache.Entries().empty());
}

TEST(CacheLifecycle, LoadsOfDifferentKeysRunInParallel) {
  ModelCache cache(Options(1000));
  // Each loader waits for the other to start: serialised loads would never
  // get there and the gates would report it.
  std::latch both_loading(2);
  auto loader = [&](const std::string& key) {
    return [&, key] {
      both_loading.count_down();
      SpinUntil([&] { return both_loading.try_wait(); }, "other load starts");
      return Loaded{std::make_shared<FakeModel>(key, 1), 10, {}};
    };
  };
  std::thread a([&] { EXPECT_TRUE(cache.Acquire("a", 10, loader("a"))); });
  std::thread b([&] { EXPECT_TRUE(cache.Acquire("b", 10, loader("b"))); });
  a.join();
  b.join();
  EXPECT_EQ(cache.Stats().loads, 2u);
}

// Seed 002's interleaving: remove(X) is mid-mutation when a waiter and then a
// newcomer ask for X. Neither may start a second construction beside the
// first, and neither may return before the removal has finished.
TEST(CacheLifecycle,
     RemoveWaiterNewcomerInterleavingConstructsOnceAfterRemoval) {
  ModelCache cache(Options(1000));
  Gate unload_may_finish;
  std::atomic<bool> unload_finished{false};
  ConstructionCounter constructions;
  auto loader = [&] {
    constructions.Enter();
    EXPECT_TRUE(unload_finished.load()) << "constructed during the removal";
    constructions.Leave();
    return Loaded{std::make_shared<FakeModel>("x", 2), 10, {}};
  };
  cache.Prefetch("x", 10, [&] {
    return Loaded{std::make_shared<FakeModel>("x", 1), 10, [&] {
                    unload_may_finish.Pass();
                    unload_finished.store(true);
                  }};
  });

  std::thread remover(
      [&] { EXPECT_EQ(cache.Remove("x"), RemoveOutcome::kRemoved); });
  SpinUntil([&] { return cache.Entry("x")->state == EntryState::kUnloading; },
            "removal is unloading");
  std::atomic<int> returned{0};
  std::thread waiter([&] {
    Lease lease = cache.Acquire("x", 10, loader);
    EXPECT_EQ(lease.get<FakeModel>()->generation, 2);
    returned.fetch_add(1);
  });
  SpinUntil([&] { return WaitersOn(cache, "x") == 1; }, "waiter blocks");
  std::thread newcomer([&] {
    Lease lease = cache.Acquire("x", 10, loader);
    EXPECT_EQ(lease.get<FakeModel>()->generation, 2);
    returned.fetch_add(1);
  });
  SpinUntil([&] { return WaitersOn(cache, "x") == 2; }, "newcomer blocks");
  EXPECT_EQ(returned.load(), 0) << "an acquire bypassed the removal";

  unload_may_finish.Open();
  remover.join();
  waiter.join();
  newcomer.join();
  EXPECT_EQ(constructions.started.load(), 1);
  EXPECT_EQ(constructions.max_running.load(), 1);
  ASSERT_TRUE(cache.Entry("x").has_value());
  EXPECT_EQ(cache.Entries().size(), 1u);
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
  EXPECT_EQ(cache.budget().used(), 10u);
}

TEST(CacheLifecycle, ConcurrentColdAcquiresLeaveOneOrderEntry) {
  for (int round = 0; round < 20; ++round) {
    ModelCache cache(Options(1000, /*shard_bits=*/0));
    constexpr int kThreads = 6;
    std::latch start(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&] {
        start.arrive_and_wait();
        Lease lease = cache.Acquire("x", 10, SimpleLoader("x", 10));
        EXPECT_TRUE(lease);
      });
    }
    for (auto& t : threads) t.join();
    // CheckInvariants aborts on a duplicate or missing order entry.
    EXPECT_EQ(cache.CheckInvariants(), 10u);
    EXPECT_EQ(cache.Entries().size(), 1u);
    EXPECT_EQ(cache.Stats().loads, 1u);
  }
}

TEST(CacheLifecycle, FailedEvictionRestoresSkippedPinnedEntriesInOrder) {
  Unloads unloads("b", /*once=*/false);
  ModelCache cache(Options(40, /*shard_bits=*/0));
  for (const char* key : {"a", "b", "c", "d"}) {
    cache.Prefetch(key, 10, unloads.LoaderOf(key));
  }
  cache.Pin("a");
  // Room for "e": skip pinned a, fail on b, evict c.
  cache.Prefetch("e", 10, unloads.LoaderOf("e"));
  EXPECT_EQ(unloads.unloaded, std::vector<std::string>{"c"});
  EXPECT_EQ(cache.Stats().failed_unloads, 1u);

  // The order is still a, b, d, e: unpinned a goes next, then b.
  cache.Unpin("a");
  unloads.StopFailing();
  cache.Prefetch("f", 10, unloads.LoaderOf("f"));
  cache.Prefetch("g", 10, unloads.LoaderOf("g"));
  cache.Prefetch("h", 10, unloads.LoaderOf("h"));
  EXPECT_EQ(unloads.unloaded, (std::vector<std::string>{"c", "a", "b", "d"}));
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

TEST(CacheLifecycle,
     VictimAcquiredDuringItsOwnEvictionIsReloadedWithConsistentBooks) {
  ModelCache cache(Options(20, /*shard_bits=*/0));
  Gate unload_may_finish;
  std::atomic<bool> evicting{false};
  std::atomic<int> x_loads{0};
  auto x_loader = [&] {
    int generation = x_loads.fetch_add(1) + 1;
    return Loaded{std::make_shared<FakeModel>("x", generation), 10,
                  [&, generation] {
                    if (generation == 1) {
                      evicting.store(true);
                      unload_may_finish.Pass();
                    }
                  }};
  };
  cache.Prefetch("x", 10, x_loader);
  cache.Prefetch("y", 10, SimpleLoader("y", 10));
  // Loading z evicts x (least recently used); x's unloader blocks.
  std::thread loader_of_z(
      [&] { EXPECT_TRUE(cache.Acquire("z", 10, SimpleLoader("z", 10))); });
  SpinUntil([&] { return evicting.load(); }, "x is being evicted");
  std::thread wants_x([&] {
    const AcquireOptions wait = WaitForRoom();
    Lease lease = cache.Acquire("x", 10, x_loader, wait);
    EXPECT_EQ(lease.get<FakeModel>()->generation, 2);
  });
  SpinUntil([&] { return WaitersOn(cache, "x") == 1; },
            "x's acquire waits for the eviction");
  unload_may_finish.Open();
  loader_of_z.join();
  wants_x.join();
  EXPECT_EQ(x_loads.load(), 2);
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
  EXPECT_LE(cache.budget().used(), 20u);
  EXPECT_EQ(cache.Entries().size(), 2u);
}

TEST(CacheLifecycle, RemoveWaitsForTheLoadInFlightThenRetiresTheLeasedResult) {
  ModelCache cache(Options(1000));
  Gate release_load;
  std::promise<Lease> owner_lease;
  std::thread owner([&] {
    owner_lease.set_value(cache.Acquire("x", 10, [&] {
      release_load.Pass();
      return Loaded{std::make_shared<FakeModel>("x", 1), 10, {}};
    }));
  });
  SpinUntil([&] { return cache.Entry("x").has_value(); }, "load starts");
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    EXPECT_EQ(cache.Remove("x"), RemoveOutcome::kRetired);
    removed.store(true);
  });
  SpinUntil([&] { return WaitersOn(cache, "x") == 1; }, "remove waits");
  EXPECT_FALSE(removed.load());
  release_load.Open();
  owner.join();
  remover.join();
  Lease lease = owner_lease.get_future().get();
  EXPECT_EQ(lease.get<FakeModel>()->generation, 1);
  EXPECT_FALSE(cache.Entry("x").has_value());  // hidden from new acquires
  EXPECT_EQ(cache.Stats().retired_bytes, 10u);
  lease.Release();
  EXPECT_EQ(cache.Stats().retired_bytes, 0u);
  EXPECT_EQ(cache.budget().used(), 0u);
}

TEST(CacheLifecycle, InvalidateDuringLoadServesItsWaitersThenReloads) {
  ModelCache cache(Options(1000));
  Gate release_load;
  std::atomic<int> calls{0};
  std::promise<Lease> first;
  std::thread owner([&] {
    first.set_value(cache.Acquire("x", 10, [&] {
      int generation = calls.fetch_add(1) + 1;
      release_load.Pass();
      return Loaded{std::make_shared<FakeModel>("x", generation), 10, {}};
    }));
  });
  SpinUntil([&] { return cache.Entry("x").has_value(); }, "load starts");
  EXPECT_EQ(cache.Invalidate("x"), RemoveOutcome::kRetired);  // does not wait
  release_load.Open();
  owner.join();
  Lease stale = first.get_future().get();
  EXPECT_EQ(stale.get<FakeModel>()->generation, 1);
  Lease fresh = cache.Acquire("x", 10, SimpleLoader("x", 10, &calls));
  EXPECT_EQ(fresh.get<FakeModel>()->generation, 2);
  EXPECT_EQ(cache.budget().used(), 20u);  // both counted until stale ends
  stale.Release();
  EXPECT_EQ(cache.budget().used(), 10u);
}

// Under LRU, hits do not advance the epoch, so a, b, c share one priority and
// are ranked by access sequence alone: a failed unload must not re-file its
// record with a fresh sequence either.
TEST(CacheLifecycle, FailedRemovalKeepsItsPlaceAmongEquallyRankedModels) {
  Unloads unloads("a", /*once=*/true);
  ModelCache cache(Options(30, /*shard_bits=*/0));
  for (const char* key : {"a", "b", "c"}) {
    cache.Prefetch(key, 10, unloads.LoaderOf(key));
  }
  for (const char* key : {"a", "b", "c"}) ASSERT_TRUE(cache.Lookup(key));
  EXPECT_THROW(cache.Remove("a"), std::runtime_error);
  ASSERT_TRUE(cache.Entry("a").has_value());
  cache.Prefetch("d", 10, unloads.LoaderOf("d"));
  EXPECT_EQ(unloads.unloaded, std::vector<std::string>{"a"});
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

TEST(CacheLifecycle, FailedEvictionKeepsItsPlaceAmongEquallyRankedModels) {
  Unloads unloads("b", /*once=*/false);
  ModelCache cache(Options(30, /*shard_bits=*/0));
  for (const char* key : {"a", "b", "c"}) {
    cache.Prefetch(key, 10, unloads.LoaderOf(key));
  }
  for (const char* key : {"b", "c", "a"}) ASSERT_TRUE(cache.Lookup(key));
  // b fails to unload, c goes; b keeps its place at the front.
  cache.Prefetch("d", 10, unloads.LoaderOf("d"));
  EXPECT_EQ(unloads.unloaded, std::vector<std::string>{"c"});
  unloads.StopFailing();
  cache.Prefetch("e", 10, unloads.LoaderOf("e"));
  EXPECT_EQ(unloads.unloaded, (std::vector<std::string>{"c", "b"}));
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

// A retired model's unloader is user code and may call back into its own
// shard (Entry, ending another lease) when its last lease ends.
TEST(CacheLifecycle, RetiredModelsUnloaderMayCallBackIntoTheCache) {
  ModelCache cache(Options(1000, /*shard_bits=*/0));  // every key, one mutex
  std::optional<Lease> other =
      cache.Acquire("other", 10, SimpleLoader("other", 10));
  std::atomic<bool> unloaded{false}, saw_other{false};
  std::optional<Lease> retiree =
      cache.Acquire("retiree", 10, SimpleLoader("retiree", 10, nullptr, [&] {
                      saw_other.store(cache.Entry("other").has_value());
                      other.reset();  // a lease of the same shard ends here
                      unloaded.store(true);
                    }));
  ASSERT_EQ(cache.Remove("retiree"), RemoveOutcome::kRetired);
  std::thread last([&] { retiree.reset(); });  // the unloader runs now
  SpinUntil([&] { return unloaded.load(); },
            "the retired model's unloader calls back without deadlock");
  last.join();
  EXPECT_TRUE(saw_other.load());
  EXPECT_EQ(cache.Entry("other")->leases, 0);
  EXPECT_EQ(cache.Stats().retired_bytes, 0u);
  EXPECT_EQ(cache.budget().used(), 10u);
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

}  // namespace
}  // namespace modelcache
