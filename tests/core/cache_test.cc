// Basic scenarios of ModelCache, ported from leveldb's util/cache_test.cc
// (hit and miss, erase, entries pinned by handles, eviction order, a request
// beyond capacity, heavy entries, prune, capacity zero) and extended with
// what a model cache adds: leases, pins, aliases, real sizes, events, idle
// TTL, failing loaders and unloaders.
//
// Every test uses small fake models whose loaders and unloaders count what
// they do, so that "loaded once", "unloaded exactly once" and "never loaded"
// are checked, not assumed.

#include "modelcache/core/cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <latch>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../test_util.h"

namespace modelcache {
namespace {

using ::testing::ElementsAre;
using testing::ErrorMessage;
using testing::FailAtOnce;
using testing::FakeModel;
using ::testing::HasSubstr;
using testing::Hooks;
using ::testing::IsEmpty;
using testing::Models;
using testing::ResidentKeys;
using testing::UnloadError;
using ::testing::UnorderedElementsAre;
using testing::WaitForRoom;

// ---- Helpers over the public API. ----

int LeasesOf(const ModelCache& cache, const std::string& key) {
  std::optional<EntryInfo> e = cache.Entry(key);
  return e ? e->leases : -1;
}

// "type:key:bytes", or "type:key" for a failure, which the tests match by
// key alone.
std::string Describe(const CacheEvent& e) {
  std::string text = std::string(EventTypeName(e.type)) + ":" + e.key;
  if (e.type == EventType::kLoadFailed || e.type == EventType::kUnloadFailed) {
    return text;
  }
  return text + ":" + std::to_string(e.bytes);
}

// Everything an observer can see of a cache's books.
struct Books {
  uint64_t used = 0;
  CacheStats stats;
  std::vector<EntryInfo> entries;
};

Books Snapshot(const ModelCache& cache) {
  Books books;
  books.used = cache.budget().used();
  books.stats = cache.Stats();
  books.entries = cache.Entries();
  std::sort(
      books.entries.begin(), books.entries.end(),
      [](const EntryInfo& a, const EntryInfo& b) { return a.key < b.key; });
  return books;
}

void ExpectSameBooks(const Books& before, const Books& after) {
  EXPECT_EQ(after.used, before.used);
  // A refused request is still a request: it counts one miss and one
  // refusal (checked by the callers); everything else must be unchanged.
  CacheStats expected = before.stats;
  expected.misses += after.stats.refused - before.stats.refused;
  expected.refused = after.stats.refused;
  EXPECT_EQ(after.stats, expected);
  EXPECT_EQ(after.entries, before.entries);
}

class CacheBasicTest : public ::testing::Test {
 protected:
  // One shard, so that the eviction order is exact LRU; events recorded.
  CacheOptions Options(uint64_t capacity) {
    CacheOptions options;
    options.name = "basic";
    options.capacity_bytes = capacity;
    options.shard_bits = 0;
    options.on_event = [this](const CacheEvent& e) {
      std::lock_guard<std::mutex> lock(events_mu_);
      events_.push_back(e);
    };
    return options;
  }

  // Acquires `key` (loading it if needed) and releases the lease at once.
  void Use(ModelCache& cache, const std::string& key, uint64_t bytes) {
    Lease lease = cache.Acquire(key, bytes, models_.For(key, bytes));
    ASSERT_TRUE(lease);
  }

  std::vector<CacheEvent> TakeRawEvents() {
    std::lock_guard<std::mutex> lock(events_mu_);
    return std::exchange(events_, {});
  }
  std::vector<std::string> TakeEvents() {
    std::vector<std::string> out;
    for (const CacheEvent& e : TakeRawEvents()) out.push_back(Describe(e));
    return out;
  }

  static void ExpectConsistent(const ModelCache& cache) {
    EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
  }

  // Declared first: destroyed after any cache a test makes.
  Models models_;
  std::mutex events_mu_;
  std::vector<CacheEvent> events_;
};

// ---- leveldb: HitAndMiss ----

TEST_F(CacheBasicTest, HitAndMiss) {
  ModelCache cache(Options(1000));
  {
    Lease first = cache.Acquire("alpha", 100, models_.For("alpha", 100));
    ASSERT_TRUE(first);
    EXPECT_EQ(first.key(), "alpha");
    EXPECT_EQ(first.bytes(), 100u);
    EXPECT_EQ(first.get<FakeModel>()->key, "alpha");
    EXPECT_EQ(first.get<FakeModel>()->generation, 1);

    Lease second = cache.Acquire("alpha", 100, models_.For("alpha", 100));
    EXPECT_EQ(second.value(), first.value());
    EXPECT_EQ(LeasesOf(cache, "alpha"), 2);
  }
  EXPECT_EQ(models_.loads("alpha"), 1);
  // load_seconds is measured, not chosen by the test: taken as it is.
  CacheStats s = cache.Stats();
  EXPECT_EQ(s, (CacheStats{.hits = 1,
                           .misses = 1,
                           .loads = 1,
                           .bytes_loaded = 100,
                           .load_seconds = s.load_seconds,
                           .resident_entries = 1,
                           .resident_bytes = 100,
                           .capacity_bytes = 1000,
                           .budget_used_bytes = 100,
                           .high_water_bytes = 100}));

  // Still a hit once no lease is left; another key is a miss.
  Use(cache, "alpha", 100);
  Use(cache, "beta", 50);
  EXPECT_EQ(models_.loads("alpha"), 1);
  EXPECT_EQ(models_.loads("beta"), 1);
  s = cache.Stats();
  EXPECT_EQ(s, (CacheStats{.hits = 2,
                           .misses = 2,
                           .loads = 2,
                           .bytes_loaded = 150,
                           .load_seconds = s.load_seconds,
                           .resident_entries = 2,
                           .resident_bytes = 150,
                           .capacity_bytes = 1000,
                           .budget_used_bytes = 150,
                           .high_water_bytes = 150}));
  EXPECT_EQ(cache.budget().used(), 150u);

  std::optional<EntryInfo> alpha = cache.Entry("alpha");
  ASSERT_TRUE(alpha.has_value());
  EXPECT_EQ(*alpha, (EntryInfo{.key = "alpha",
                               .state = EntryState::kResident,
                               .bytes = 100,
                               .leases = 0,
                               .accesses = 3,
                               .last_use = alpha->last_use}));
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, LookupOfAbsentKeyIsNullopt) {
  ModelCache cache(Options(1000));
  EXPECT_FALSE(cache.Lookup("absent").has_value());
  EXPECT_EQ(cache.Stats().misses, 1u);
  EXPECT_EQ(cache.Stats().loads, 0u);
  EXPECT_THAT(cache.Entries(), IsEmpty());
  EXPECT_FALSE(cache.Entry("absent").has_value());

  Use(cache, "present", 100);
  std::optional<Lease> found = cache.Lookup("present");
  ASSERT_TRUE(found.has_value());
  ASSERT_TRUE(*found);
  EXPECT_EQ(found->get<FakeModel>()->key, "present");
  EXPECT_EQ(LeasesOf(cache, "present"), 1);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.loads, 1u);
  EXPECT_EQ(models_.loads("present"), 1);
}

// ---- leveldb: Erase ----

TEST_F(CacheBasicTest, EraseUnloadsExactlyOnceAndReturnsTheBytes) {
  ModelCache cache(Options(1000));
  Use(cache, "alpha", 100);
  Use(cache, "beta", 200);
  TakeEvents();

  EXPECT_EQ(cache.Remove("alpha"), RemoveOutcome::kRemoved);
  EXPECT_FALSE(cache.Entry("alpha").has_value());
  EXPECT_FALSE(cache.Lookup("alpha").has_value());
  EXPECT_THAT(models_.unloaded("alpha"), ElementsAre(1));
  EXPECT_EQ(cache.budget().used(), 200u);
  EXPECT_EQ(models_.live(), 1);

  // Erasing again finds nothing and unloads nothing.
  EXPECT_EQ(cache.Remove("alpha"), RemoveOutcome::kNotFound);
  EXPECT_EQ(models_.unload_attempts("alpha"), 1);

  EXPECT_EQ(cache.Remove("beta"), RemoveOutcome::kRemoved);
  EXPECT_EQ(cache.budget().used(), 0u);
  EXPECT_EQ(models_.live(), 0);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.removals, 2u);
  EXPECT_EQ(s.resident_entries, 0u);
  EXPECT_EQ(s.resident_bytes, 0u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_THAT(TakeEvents(),
              ElementsAre("removed:alpha:100", "removed:beta:200"));
  ExpectConsistent(cache);
}

// ---- leveldb: EntriesArePinned ----

TEST_F(CacheBasicTest, EntriesPinnedByLeasesAreRetiredNotUnloaded) {
  ModelCache cache(Options(1000));
  Lease old1 = cache.Acquire("alpha", 100, models_.For("alpha", 100));
  Lease old2 = cache.Acquire("alpha", 100, models_.For("alpha", 100));
  TakeEvents();

  EXPECT_EQ(cache.Remove("alpha"), RemoveOutcome::kRetired);
  EXPECT_EQ(models_.unload_attempts("alpha"), 0);
  EXPECT_FALSE(cache.Lookup("alpha").has_value());
  EXPECT_EQ(cache.budget().used(), 100u);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.retired_entries, 1u);
  EXPECT_EQ(s.retired_bytes, 100u);
  EXPECT_EQ(s.resident_entries, 0u);
  EXPECT_EQ(s.removals, 1u);

  // A new acquire loads a fresh copy; the old leases still see the old one.
  Lease fresh = cache.Acquire("alpha", 100, models_.For("alpha", 100));
  EXPECT_EQ(models_.loads("alpha"), 2);
  EXPECT_EQ(fresh.get<FakeModel>()->generation, 2);
  EXPECT_EQ(old1.get<FakeModel>()->generation, 1);
  EXPECT_EQ(old2.get<FakeModel>()->generation, 1);
  EXPECT_NE(fresh.value(), old1.value());
  EXPECT_EQ(cache.budget().used(), 200u);
  EXPECT_EQ(LeasesOf(cache, "alpha"), 1);

  old1.Release();
  EXPECT_EQ(models_.unload_attempts("alpha"), 0);
  EXPECT_EQ(cache.budget().used(), 200u);

  old2.Release();  // the last lease of the retired copy frees it
  EXPECT_THAT(models_.unloaded("alpha"), ElementsAre(1));
  EXPECT_EQ(cache.budget().used(), 100u);
  s = cache.Stats();
  EXPECT_EQ(s.retired_entries, 0u);
  EXPECT_EQ(s.retired_bytes, 0u);
  EXPECT_EQ(s.resident_entries, 1u);
  EXPECT_EQ(fresh.get<FakeModel>()->generation, 2);

  fresh.Release();  // the fresh copy stays resident
  EXPECT_THAT(models_.unloaded("alpha"), ElementsAre(1));
  EXPECT_EQ(models_.live(), 1);
  EXPECT_THAT(TakeEvents(), ElementsAre("retired:alpha:100", "loaded:alpha:100",
                                        "retired_freed:alpha:100"));
  ExpectConsistent(cache);
}

// ---- leveldb: EvictionPolicy ----

TEST_F(CacheBasicTest, EvictionOrderIsLeastRecentlyUsed) {
  ModelCache cache(Options(300));
  Use(cache, "a", 100);
  Use(cache, "b", 100);
  Use(cache, "c", 100);
  Use(cache, "a", 100);  // a is now the most recently used
  TakeEvents();

  Use(cache, "d", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a", "c", "d"));
  EXPECT_FALSE(cache.Entry("b").has_value());
  EXPECT_THAT(TakeEvents(), ElementsAre("evicted:b:100", "loaded:d:100"));

  Use(cache, "e", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a", "d", "e"));

  Use(cache, "f", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("d", "e", "f"));

  EXPECT_EQ(cache.Stats().evictions, 3u);
  EXPECT_EQ(models_.loads("a"), 1);
  EXPECT_THAT(models_.unloaded("a"), ElementsAre(1));
  EXPECT_THAT(models_.unloaded("b"), ElementsAre(1));
  EXPECT_THAT(models_.unloaded("c"), ElementsAre(1));
  EXPECT_EQ(cache.budget().used(), 300u);
  ExpectConsistent(cache);
}

// ---- leveldb: UseExceedsCacheSize, without the silent overshoot ----

TEST_F(CacheBasicTest, RequestBeyondCapacityWhileAllHeldFailsNamingHolders) {
  ModelCache cache(Options(300));
  Lease held = cache.Acquire("held-model", 100, models_.For("held-model", 100));
  cache.Prefetch("pinned-model", 200, models_.For("pinned-model", 200));
  cache.Pin("pinned-model");
  TakeEvents();
  const Books before = Snapshot(cache);

  const std::string message = ErrorMessage(
      [&] {
        cache.Acquire("newcomer", 100, models_.For("newcomer", 100),
                      FailAtOnce());
      },
      ErrorCode::kCapacity);
  EXPECT_THAT(message, HasSubstr("held-model"));
  EXPECT_THAT(message, HasSubstr("pinned-model"));
  EXPECT_EQ(models_.loads("newcomer"), 0);
  ExpectSameBooks(before, Snapshot(cache));
  EXPECT_THAT(TakeEvents(), IsEmpty());

  // Once the lease ends the same request succeeds by evicting that record.
  held.Release();
  Lease newcomer = cache.Acquire("newcomer", 100, models_.For("newcomer", 100),
                                 FailAtOnce());
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("newcomer", "pinned-model"));
  EXPECT_EQ(models_.unload_attempts("pinned-model"), 0);
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, RequestBeyondCapacityWithPastDeadlineTimesOut) {
  ModelCache cache(Options(300));
  Lease held = cache.Acquire("held-model", 100, models_.For("held-model", 100));
  cache.Prefetch("pinned-model", 200, models_.For("pinned-model", 200));
  cache.Pin("pinned-model");
  const Books before = Snapshot(cache);

  ErrorMessage(
      [&] {
        cache.Acquire("newcomer", 100, models_.For("newcomer", 100),
                      WaitForRoom(Clock::now() - std::chrono::seconds(1)));
      },
      ErrorCode::kTimeout);
  EXPECT_EQ(models_.loads("newcomer"), 0);
  ExpectSameBooks(before, Snapshot(cache));

  // A deadline in the near future is waited for, then times out the same way.
  ErrorMessage(
      [&] {
        cache.Acquire(
            "newcomer", 100, models_.For("newcomer", 100),
            WaitForRoom(Clock::now() + std::chrono::milliseconds(20)));
      },
      ErrorCode::kTimeout);
  EXPECT_EQ(models_.loads("newcomer"), 0);
  ExpectSameBooks(before, Snapshot(cache));
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, WaitingAcquireProceedsWhenTheHolderReleasesElsewhere) {
  ModelCache cache(Options(100));
  std::optional<Lease> held =
      cache.Acquire("held-model", 100, models_.For("held-model", 100));
  std::latch acquiring(1);
  std::thread holder([&] {
    acquiring.wait();
    held.reset();  // may land before or during the wait: both must work
  });
  acquiring.count_down();
  Lease newcomer =
      cache.Acquire("newcomer", 100, models_.For("newcomer", 100),
                    WaitForRoom(Clock::now() + std::chrono::seconds(60)));
  holder.join();
  EXPECT_TRUE(newcomer);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("newcomer"));
  EXPECT_THAT(models_.unloaded("held-model"), ElementsAre(1));
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, ModelLargerThanTheBudgetIsRefusedAtOnce) {
  ModelCache cache(Options(1000));
  Use(cache, "small", 100);
  const Books before = Snapshot(cache);

  // Even a caller willing to wait forever is refused at once.
  ErrorMessage(
      [&] {
        cache.Acquire("huge", 1001, models_.For("huge", 1001),
                      WaitForRoom(Clock::time_point::max()));
      },
      ErrorCode::kTooLarge);
  ErrorMessage([&] { cache.Prefetch("huge", 1001, models_.For("huge", 1001)); },
               ErrorCode::kTooLarge);
  EXPECT_EQ(models_.loads("huge"), 0);
  ExpectSameBooks(before, Snapshot(cache));
  EXPECT_EQ(cache.Stats().refused, before.stats.refused + 2);

  // Exactly the capacity is not too large.
  Use(cache, "whole", 1000);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("whole"));
  ExpectConsistent(cache);
}

// ---- leveldb: HeavyEntries ----

TEST_F(CacheBasicTest, HeavyEntryEvictsEnoughLightOnesToFit) {
  ModelCache cache(Options(1000));
  for (const char* key : {"s1", "s2", "s3", "s4", "s5"}) Use(cache, key, 100);
  Use(cache, "medium", 300);
  EXPECT_EQ(cache.budget().used(), 800u);

  // 600 more needs 400 freed: the four least recently used small ones.
  Use(cache, "big", 600);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("big", "medium", "s5"));
  EXPECT_EQ(cache.budget().used(), 1000u);
  EXPECT_EQ(cache.Stats().evictions, 4u);
  EXPECT_EQ(models_.unload_attempts("s5"), 0);

  // One model the size of the whole budget evicts everything else.
  Use(cache, "giant", 1000);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("giant"));
  EXPECT_EQ(cache.budget().used(), 1000u);
  EXPECT_EQ(cache.budget().high_water(), 1000u);
  EXPECT_EQ(models_.live(), 1);
  ExpectConsistent(cache);
}

// ---- leveldb: Prune ----

TEST_F(CacheBasicTest, PruneEvictsEveryUnleasedUnpinnedRecord) {
  ModelCache cache(Options(1000));
  Lease leased = cache.Acquire("leased", 100, models_.For("leased", 100));
  cache.Prefetch("pinned", 200, models_.For("pinned", 200));
  cache.Pin("pinned");
  Use(cache, "idle-1", 300);
  Use(cache, "idle-2", 50);
  TakeEvents();

  EXPECT_EQ(cache.Prune(), 2u);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("leased", "pinned"));
  EXPECT_EQ(cache.budget().used(), 300u);
  EXPECT_THAT(models_.unloaded("idle-1"), ElementsAre(1));
  EXPECT_THAT(models_.unloaded("idle-2"), ElementsAre(1));
  EXPECT_EQ(models_.unload_attempts("leased"), 0);
  EXPECT_EQ(models_.unload_attempts("pinned"), 0);
  EXPECT_EQ(cache.Stats().evictions, 2u);
  EXPECT_THAT(TakeEvents(),
              UnorderedElementsAre("evicted:idle-1:300", "evicted:idle-2:50"));

  EXPECT_EQ(cache.Prune(), 0u);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("leased", "pinned"));
  ExpectConsistent(cache);
}

// ---- leveldb: ZeroSizeCache ----

TEST_F(CacheBasicTest, CapacityZeroCachesNothing) {
  ModelCache cache(Options(0));
  for (const char* key : {"a", "b"}) {
    ErrorMessage([&] { cache.Acquire(key, 1, models_.For(key, 1)); },
                 ErrorCode::kTooLarge);
    ErrorMessage([&] { cache.Prefetch(key, 1, models_.For(key, 1)); },
                 ErrorCode::kTooLarge);
    EXPECT_EQ(models_.loads(key), 0);
  }
  EXPECT_THAT(cache.Entries(), IsEmpty());
  EXPECT_EQ(cache.budget().used(), 0u);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.loads, 0u);
  EXPECT_EQ(s.resident_entries, 0u);
  EXPECT_EQ(s.capacity_bytes, 0u);
  EXPECT_EQ(s.high_water_bytes, 0u);
}

// ---- Pins ----

TEST_F(CacheBasicTest, PinPreventsEvictionAndUnpinAllowsIt) {
  ModelCache cache(Options(200));
  Use(cache, "a", 100);
  Use(cache, "b", 100);
  cache.Pin("a");
  cache.Pin("a");  // pins do not nest: one Unpin undoes both
  ASSERT_TRUE(cache.Entry("a").has_value());
  EXPECT_TRUE(cache.Entry("a")->pinned);

  Use(cache, "c", 100);  // a is least recently used, but pinned
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a", "c"));
  EXPECT_EQ(models_.unload_attempts("a"), 0);

  // With c leased, a is the only candidate: while pinned nothing can go.
  Lease c = cache.Acquire("c", 100, models_.For("c", 100));
  ErrorMessage([&] { cache.Acquire("d", 100, models_.For("d", 100)); },
               ErrorCode::kCapacity);
  EXPECT_EQ(models_.loads("d"), 0);

  cache.Unpin("a");
  EXPECT_FALSE(cache.Entry("a")->pinned);
  Use(cache, "d", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("c", "d"));
  EXPECT_THAT(models_.unloaded("a"), ElementsAre(1));

  ErrorMessage([&] { cache.Pin("a"); }, ErrorCode::kNotFound);
  ErrorMessage([&] { cache.Pin("never-loaded"); }, ErrorCode::kNotFound);
  ExpectConsistent(cache);
}

// ---- Aliases ----

TEST_F(CacheBasicTest, AliasesShareTheCanonicalRecord) {
  ModelCache cache(Options(1000));
  cache.AddAlias("latest", "model-v1");
  // An alias alone is not a record (Roboflow inference tracked aliases that
  // were never loaded).
  EXPECT_THAT(cache.Entries(), IsEmpty());
  EXPECT_EQ(cache.Stats().resident_entries, 0u);
  EXPECT_EQ(cache.Resolve("latest"), "model-v1");
  EXPECT_EQ(cache.Resolve("model-v1"), "model-v1");

  Lease by_alias = cache.Acquire("latest", 100, models_.For("model-v1", 100));
  EXPECT_EQ(by_alias.key(), "model-v1");
  Lease by_key = cache.Acquire("model-v1", 100, models_.For("model-v1", 100));
  EXPECT_EQ(by_key.value(), by_alias.value());
  EXPECT_EQ(models_.loads("model-v1"), 1);

  std::optional<EntryInfo> entry = cache.Entry("latest");
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->key, "model-v1");
  EXPECT_EQ(entry->leases, 2);
  ASSERT_EQ(cache.Entries().size(), 1u);
  EXPECT_EQ(cache.Entries()[0].key, "model-v1");
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.resident_entries, 1u);
  EXPECT_EQ(s.resident_bytes, 100u);
  EXPECT_EQ(s.loads, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(cache.budget().used(), 100u);

  // An alias may not shadow a record, nor point at another alias.
  ErrorMessage([&] { cache.AddAlias("model-v1", "other"); },
               ErrorCode::kInvalidArgument);
  ErrorMessage([&] { cache.AddAlias("alias-of-alias", "latest"); },
               ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.Resolve("model-v1"), "model-v1");

  // Remove through the alias removes the canonical record.
  by_alias.Release();
  by_key.Release();
  EXPECT_EQ(cache.Remove("latest"), RemoveOutcome::kRemoved);
  EXPECT_FALSE(cache.Entry("model-v1").has_value());
  EXPECT_THAT(models_.unloaded("model-v1"), ElementsAre(1));

  // Re-pointing and removing an alias.
  cache.AddAlias("latest", "model-v2");
  EXPECT_EQ(cache.Resolve("latest"), "model-v2");
  EXPECT_TRUE(cache.RemoveAlias("latest"));
  EXPECT_EQ(cache.Resolve("latest"), "latest");
  EXPECT_FALSE(cache.RemoveAlias("latest"));
  ExpectConsistent(cache);
}

// ---- Real size after loading ----

TEST_F(CacheBasicTest, LoaderReportingARealSizeAdjustsTheBudget) {
  ModelCache cache(Options(1000));
  Lease shrinks = cache.Acquire("shrinks", 400, models_.For("shrinks", 250));
  EXPECT_EQ(shrinks.bytes(), 250u);
  EXPECT_EQ(cache.budget().used(), 250u);
  EXPECT_EQ(cache.Entry("shrinks")->bytes, 250u);

  Lease grows = cache.Acquire("grows", 100, models_.For("grows", 300));
  EXPECT_EQ(grows.bytes(), 300u);
  EXPECT_EQ(cache.budget().used(), 550u);

  CacheStats s = cache.Stats();
  EXPECT_EQ(s.resident_bytes, 550u);
  EXPECT_EQ(s.bytes_loaded, 550u);
  ExpectConsistent(cache);

  // What the reservation over-estimated is free again: 450 fits exactly.
  Lease third =
      cache.Acquire("third", 450, models_.For("third", 450), FailAtOnce());
  EXPECT_EQ(cache.budget().used(), 1000u);
  EXPECT_EQ(cache.Stats().evictions, 0u);
  ExpectConsistent(cache);
}

// ---- SetCapacity ----

TEST_F(CacheBasicTest, ShrinkingCapacityEvictsUnleasedAndReportsTheRest) {
  ModelCache cache(Options(400));
  Lease held = cache.Acquire("a", 100, models_.For("a", 100));
  Use(cache, "b", 100);
  Use(cache, "c", 100);
  Use(cache, "d", 100);

  EXPECT_EQ(cache.SetCapacity(250), 0u);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a", "d"));
  EXPECT_EQ(cache.budget().used(), 200u);
  EXPECT_EQ(cache.budget().capacity(), 250u);
  EXPECT_EQ(cache.Stats().capacity_bytes, 250u);

  // The leased record holds 50 bytes more than the new capacity.
  EXPECT_EQ(cache.SetCapacity(50), 50u);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a"));
  EXPECT_EQ(cache.budget().used(), 100u);
  EXPECT_EQ(models_.unload_attempts("a"), 0);
  for (const char* key : {"b", "c", "d"}) {
    EXPECT_THAT(models_.unloaded(key), ElementsAre(1)) << key;
  }

  // Over capacity, nothing is admitted until the lease ends.
  ErrorMessage([&] { cache.Acquire("e", 10, models_.For("e", 10)); },
               ErrorCode::kCapacity);
  EXPECT_EQ(models_.loads("e"), 0);
  held.Release();
  Use(cache, "e", 10);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("e"));
  EXPECT_EQ(cache.budget().used(), 10u);
  ExpectConsistent(cache);
}

// ---- Events ----

TEST_F(CacheBasicTest, EventsReportEachTransitionWithKeyAndBytes) {
  ModelCache cache(Options(300));
  cache.Acquire("a", 150, models_.For("a", 100));  // reports its real size
  Use(cache, "b", 100);
  Use(cache, "c", 100);
  Use(cache, "d", 100);  // evicts a
  EXPECT_EQ(cache.Remove("b"), RemoveOutcome::kRemoved);
  {
    Lease held = cache.Acquire("c", 100, models_.For("c", 100));
    EXPECT_EQ(cache.Remove("c"), RemoveOutcome::kRetired);
  }
  EXPECT_THROW(cache.Acquire("bad", 100,
                             []() -> Loaded {
                               throw std::runtime_error("disk on fire");
                             }),
               std::runtime_error);
  Use(cache, "e", 100);
  models_.FailUnloads("e", true);
  EXPECT_THROW(cache.Remove("e"), UnloadError);

  const std::vector<CacheEvent> events = TakeRawEvents();
  std::vector<std::string> described;
  for (const CacheEvent& e : events) described.push_back(Describe(e));
  EXPECT_THAT(
      described,
      ElementsAre("loaded:a:100", "loaded:b:100", "loaded:c:100",
                  "evicted:a:100", "loaded:d:100", "removed:b:100",
                  "retired:c:100", "retired_freed:c:100", "load_failed:bad",
                  "loaded:e:100", "unload_failed:e"));
  for (const CacheEvent& e : events) {
    // The failures carry what was thrown, the object itself.
    if (e.type == EventType::kLoadFailed) {
      EXPECT_THAT(e.error, HasSubstr("disk on fire"));
      ASSERT_TRUE(e.exception);
      EXPECT_THROW(std::rethrow_exception(e.exception), std::runtime_error);
    } else if (e.type == EventType::kUnloadFailed) {
      EXPECT_THAT(e.error, HasSubstr("unload of e failed"));
      ASSERT_TRUE(e.exception);
      EXPECT_THROW(std::rethrow_exception(e.exception), UnloadError);
    } else {
      EXPECT_FALSE(e.exception);
    }
    if (e.type == EventType::kLoaded) {
      EXPECT_GE(e.seconds, 0.0);
    }
  }
  models_.FailUnloads("e", false);
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, EventCallbackMayCallBackIntoTheCache) {
  ModelCache* self = nullptr;
  std::optional<Lease> outer;
  std::string side_key;
  std::vector<bool> evicted_still_visible;
  CacheOptions options = Options(300);
  options.on_event = [&](const CacheEvent& e) {
    if (e.type == EventType::kLoaded && e.key == "trigger") {
      Lease side = self->Acquire("side", 100, models_.For("side", 100));
      side_key = side.get<FakeModel>()->key;
      outer.reset();  // releases the lease on "held" from inside a callback
    }
    if (e.type == EventType::kEvicted) {
      evicted_still_visible.push_back(self->Lookup(e.key).has_value());
    }
  };
  ModelCache cache(options);
  self = &cache;

  outer = cache.Acquire("held", 100, models_.For("held", 100));
  Use(cache, "trigger", 100);
  EXPECT_EQ(side_key, "side");
  EXPECT_FALSE(outer.has_value());
  EXPECT_EQ(LeasesOf(cache, "held"), 0);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("held", "side", "trigger"));

  Use(cache, "later", 100);  // evicts "held", the least recently used
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("later", "side", "trigger"));
  EXPECT_THAT(evicted_still_visible, ElementsAre(false));
  ExpectConsistent(cache);
}

// ---- Leases released from inside user code ----

TEST_F(CacheBasicTest, LeaseReleasedInsideAnotherKeysLoaderDoesNotDeadlock) {
  ModelCache cache(Options(1000));
  std::optional<Lease> retired =
      cache.Acquire("retiree", 100, models_.For("retiree", 100));
  std::optional<Lease> plain =
      cache.Acquire("plain", 100, models_.For("plain", 100));
  ASSERT_EQ(cache.Remove("retiree"), RemoveOutcome::kRetired);

  Hooks hooks;
  hooks.during_load = [&] {
    retired.reset();  // the last lease of a retired record: unloads it here
    plain.reset();
  };
  Lease lease = cache.Acquire("loader", 100, models_.For("loader", 100, hooks));
  EXPECT_TRUE(lease);
  EXPECT_THAT(models_.unloaded("retiree"), ElementsAre(1));
  EXPECT_EQ(LeasesOf(cache, "plain"), 0);
  EXPECT_EQ(cache.Stats().retired_bytes, 0u);
  EXPECT_EQ(cache.budget().used(), 200u);
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, LeaseReleasedInsideAnUnloaderDoesNotDeadlock) {
  ModelCache cache(Options(300));
  std::optional<Lease> retired =
      cache.Acquire("retiree", 100, models_.For("retiree", 100));
  ASSERT_EQ(cache.Remove("retiree"), RemoveOutcome::kRetired);
  std::optional<Lease> plain =
      cache.Acquire("plain", 100, models_.For("plain", 100));

  // Inside Remove's unload.
  Hooks hooks;
  hooks.during_unload = [&] {
    retired.reset();
    plain.reset();
  };
  cache.Acquire("victim", 100, models_.For("victim", 100, hooks));
  EXPECT_EQ(cache.Remove("victim"), RemoveOutcome::kRemoved);
  EXPECT_THAT(models_.unloaded("victim"), ElementsAre(1));
  EXPECT_THAT(models_.unloaded("retiree"), ElementsAre(1));
  EXPECT_EQ(LeasesOf(cache, "plain"), 0);
  EXPECT_EQ(cache.budget().used(), 100u);

  // Inside an eviction's unload, during an Acquire.
  plain = cache.Acquire("plain", 100, models_.For("plain", 100));
  Hooks evict_hooks;
  evict_hooks.during_unload = [&] { plain.reset(); };
  cache.Acquire("victim-2", 100, models_.For("victim-2", 100, evict_hooks));
  Use(cache, "filler", 100);
  // Full: plain (leased), victim-2 and filler. Room for 200 means evicting
  // victim-2 (the least recently used unleased record), whose unloader
  // releases plain, and then one more record.
  Lease big = cache.Acquire("big", 200, models_.For("big", 200), FailAtOnce());
  EXPECT_THAT(models_.unloaded("victim-2"), ElementsAre(1));
  EXPECT_FALSE(plain.has_value());
  EXPECT_EQ(cache.budget().used(), 300u);
  EXPECT_EQ(ResidentKeys(cache).size(), 2u);
  EXPECT_TRUE(cache.Entry("big").has_value());
  ExpectConsistent(cache);
}

// ---- Idle TTL with an injected clock ----

TEST_F(CacheBasicTest, IdleTtlEvictsOnlyIdleUnleasedRecords) {
  using std::chrono::seconds;
  Clock::time_point now = Clock::time_point() + std::chrono::hours(1);
  CacheOptions options = Options(1000);
  options.idle_ttl = seconds(10);
  options.now = [&now] { return now; };
  ModelCache cache(options);
  const Clock::time_point t0 = now;

  Use(cache, "idle", 100);
  Use(cache, "touched", 100);
  Lease held = cache.Acquire("held", 100, models_.For("held", 100));
  cache.Prefetch("pinned", 100, models_.For("pinned", 100));
  cache.Pin("pinned");
  EXPECT_TRUE(cache.Entry("touched")->last_use == t0);

  now = t0 + seconds(5);
  Use(cache, "touched", 100);  // a hit refreshes last_use
  EXPECT_TRUE(cache.Entry("touched")->last_use == t0 + seconds(5));
  EXPECT_TRUE(cache.Entry("idle")->last_use == t0);
  EXPECT_EQ(cache.EvictExpired(), 0u);

  now = t0 + seconds(11);
  TakeEvents();
  EXPECT_EQ(cache.EvictExpired(), 1u);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("held", "pinned", "touched"));
  EXPECT_THAT(models_.unloaded("idle"), ElementsAre(1));
  EXPECT_EQ(cache.Stats().expirations, 1u);
  EXPECT_THAT(TakeEvents(), ElementsAre("expired:idle:100"));

  // A miss runs the expiry too.
  now = t0 + seconds(16);
  Use(cache, "newcomer", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("held", "newcomer", "pinned"));
  EXPECT_THAT(models_.unloaded("touched"), ElementsAre(1));
  EXPECT_EQ(cache.Stats().expirations, 2u);
  EXPECT_EQ(models_.unload_attempts("held"), 0);
  EXPECT_EQ(models_.unload_attempts("pinned"), 0);
  ExpectConsistent(cache);
}

// ---- Failing loaders and unloaders ----

struct LoadError : std::runtime_error {
  LoadError(const std::string& what, int c)
      : std::runtime_error(what), code(c) {}
  int code;
};

struct NotAStdException {
  int value;
};

TEST_F(CacheBasicTest, LoaderExceptionPropagatesAsIsAndNothingIsCached) {
  ModelCache cache(Options(1000));
  Use(cache, "other", 300);
  const uint64_t used_before = cache.budget().used();
  int attempts = 0;

  try {
    cache.Acquire("flaky", 200, [&]() -> Loaded {
      ++attempts;
      throw LoadError("disk on fire", 42);
    });
    ADD_FAILURE() << "the loader's exception was swallowed";
  } catch (const LoadError& e) {
    EXPECT_STREQ(e.what(), "disk on fire");
    EXPECT_EQ(e.code, 42);
  }
  EXPECT_EQ(attempts, 1);
  EXPECT_FALSE(cache.Entry("flaky").has_value());
  EXPECT_EQ(cache.budget().used(), used_before);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.load_failures, 1u);
  EXPECT_EQ(s.loads, 1u);
  EXPECT_EQ(s.resident_entries, 1u);
  ExpectConsistent(cache);

  // Not even derived from std::exception: still passed through unchanged.
  try {
    cache.Acquire("flaky", 200, [&]() -> Loaded { throw NotAStdException{7}; });
    ADD_FAILURE() << "the loader's exception was swallowed";
  } catch (const NotAStdException& e) {
    EXPECT_EQ(e.value, 7);
  }
  EXPECT_EQ(cache.Stats().load_failures, 2u);
  EXPECT_EQ(cache.budget().used(), used_before);

  // Failures are not cached: the next acquire loads.
  Lease lease = cache.Acquire("flaky", 200, models_.For("flaky", 200));
  EXPECT_EQ(models_.loads("flaky"), 1);
  EXPECT_EQ(lease.get<FakeModel>()->key, "flaky");
  EXPECT_EQ(cache.budget().used(), used_before + 200);
  EXPECT_EQ(cache.Stats().loads, 2u);
  ExpectConsistent(cache);
}

TEST_F(CacheBasicTest, FailedUnloadDuringRemoveKeepsRecordAndItsPlace) {
  ModelCache cache(Options(300));
  Use(cache, "a", 100);
  Use(cache, "b", 100);
  Use(cache, "c", 100);
  models_.FailUnloads("b", true);

  try {
    cache.Remove("b");
    ADD_FAILURE() << "the unloader's exception was swallowed";
  } catch (const UnloadError& e) {
    EXPECT_THAT(e.what(), HasSubstr("unload of b failed"));
  }
  std::optional<EntryInfo> b = cache.Entry("b");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->state, EntryState::kResident);
  EXPECT_EQ(b->bytes, 100u);
  EXPECT_EQ(cache.budget().used(), 300u);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.failed_unloads, 1u);
  EXPECT_EQ(s.resident_entries, 3u);
  EXPECT_EQ(s.removals, 0u);
  ExpectConsistent(cache);

  // b is still between a and c in the eviction order.
  models_.FailUnloads("b", false);
  Use(cache, "d", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("b", "c", "d"));
  Use(cache, "e", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("c", "d", "e"));
  EXPECT_THAT(models_.unloaded("b"), ElementsAre(1));
  EXPECT_EQ(models_.loads("b"), 1);
  ExpectConsistent(cache);
}

// ---- Leases ----

TEST_F(CacheBasicTest, LeaseMoveTransfersTheClaim) {
  ModelCache cache(Options(1000));
  Lease empty;
  EXPECT_FALSE(empty);
  empty.Release();  // no-op

  Lease a = cache.Acquire("a", 100, models_.For("a", 100));
  void* const a_value = a.value();
  Lease moved(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(moved);
  EXPECT_EQ(moved.value(), a_value);
  EXPECT_EQ(moved.key(), "a");
  EXPECT_EQ(moved.bytes(), 100u);
  EXPECT_EQ(LeasesOf(cache, "a"), 1);

  // Move-assigning over a live lease releases what it held.
  Lease b = cache.Acquire("b", 100, models_.For("b", 100));
  EXPECT_EQ(LeasesOf(cache, "b"), 1);
  b = std::move(moved);
  EXPECT_FALSE(moved);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(LeasesOf(cache, "b"), 0);
  EXPECT_EQ(LeasesOf(cache, "a"), 1);
  EXPECT_EQ(b.key(), "a");
  EXPECT_EQ(b.value(), a_value);

  b.Release();
  EXPECT_FALSE(b);
  EXPECT_EQ(LeasesOf(cache, "a"), 0);
  b.Release();  // a second release does nothing
  EXPECT_EQ(LeasesOf(cache, "a"), 0);

  // No phantom lease is left: the record is removed, not retired.
  EXPECT_EQ(cache.Remove("a"), RemoveOutcome::kRemoved);
  EXPECT_EQ(cache.Remove("b"), RemoveOutcome::kRemoved);
  EXPECT_EQ(cache.budget().used(), 0u);
  ExpectConsistent(cache);
}

// ---- Prefetch ----

TEST_F(CacheBasicTest, PrefetchLeavesTheModelResidentWithoutLeases) {
  ModelCache cache(Options(200));
  cache.Prefetch("warm", 100, models_.For("warm", 100));
  std::optional<EntryInfo> warm = cache.Entry("warm");
  ASSERT_TRUE(warm.has_value());
  EXPECT_EQ(warm->state, EntryState::kResident);
  EXPECT_EQ(warm->leases, 0);
  EXPECT_EQ(warm->bytes, 100u);
  EXPECT_EQ(cache.budget().used(), 100u);

  cache.Prefetch("warm", 100, models_.For("warm", 100));  // already resident
  EXPECT_EQ(models_.loads("warm"), 1);

  // Evictable like any unleased record: with "other" leased, "warm" is the
  // only candidate for the room "third" needs.
  Lease other = cache.Acquire("other", 100, models_.For("other", 100));
  Lease third =
      cache.Acquire("third", 100, models_.For("third", 100), FailAtOnce());
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("other", "third"));
  EXPECT_THAT(models_.unloaded("warm"), ElementsAre(1));
  ExpectConsistent(cache);
}

// ---- Destruction ----

TEST_F(CacheBasicTest, DestroyingTheCacheUnloadsEveryRecordOnce) {
  auto budget = std::make_shared<Budget>(1000, "shared");
  {
    CacheOptions options = Options(0);
    options.budget = budget;
    ModelCache cache(options);
    Use(cache, "a", 100);
    Use(cache, "b", 200);
    cache.Pin("b");
    EXPECT_EQ(budget->used(), 300u);
  }
  EXPECT_THAT(models_.unloaded("a"), ElementsAre(1));
  EXPECT_THAT(models_.unloaded("b"), ElementsAre(1));
  EXPECT_EQ(models_.live(), 0);
  EXPECT_EQ(budget->used(), 0u);
}

}  // namespace
}  // namespace modelcache
