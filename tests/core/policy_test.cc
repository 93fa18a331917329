// Eviction policies: one suite of policy-independent contracts run over every
// policy and shard count, then tests of what each policy promises.
//
// Policy-independent: a leased or pinned record is never evicted; nothing is
// evicted while everything fits; the budget is never exceeded whatever the
// sequence of operations; a victim whose unloader fails stays resident and
// eviction moves on. Policy-specific: exact LRU order with one shard; GDSF
// keeps a frequently used large model where LRU would drop it; GDSF ages old
// entries out through its inflation value; priorities never decrease;
// next-use evicts the model expected last (by its gaps, kept across
// evictions, not counting prefetches), cools models idle past their gaps
// unless their gaps look memoryless (then ranks them by their mean gap), and
// lets a ranked warm-up evict only models expected later.

#include "modelcache/core/policy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../test_util.h"
#include "modelcache/core/cache.h"

namespace modelcache {
namespace {

using ::testing::ElementsAre;
using testing::ErrorMessage;
using testing::FailAtOnce;
using ::testing::HasSubstr;
using testing::Models;
using testing::ResidentKeys;

constexpr uint64_t kGiB = uint64_t{1} << 30;

bool IsResident(const ModelCache& cache, const std::string& key) {
  std::optional<EntryInfo> e = cache.Entry(key);
  return e.has_value() && e->state == EntryState::kResident;
}

// Acquires `key` (loading it if needed) and releases the lease at once.
void Use(ModelCache& cache, Models& models, const std::string& key,
         uint64_t bytes) {
  Lease lease = cache.Acquire(key, bytes, models.For(key, bytes));
  ASSERT_TRUE(lease);
}

CacheOptions OptionsFor(std::shared_ptr<const EvictionPolicy> policy,
                        int shard_bits, uint64_t capacity) {
  CacheOptions options;
  options.name = "policy";
  options.capacity_bytes = capacity;
  options.policy = std::move(policy);
  options.shard_bits = shard_bits;
  return options;
}

// ---- Every policy, every shard count. ----

struct PolicyCase {
  std::string name;
  std::function<std::shared_ptr<const EvictionPolicy>()> make;
  int shard_bits;
  // Whether the victim order depends only on access history and sizes. Not
  // for gdsf-time, which ranks by measured load times.
  bool history_ordered;
};

std::vector<PolicyCase> AllPolicyCases() {
  std::vector<PolicyCase> cases;
  for (int shard_bits : {0, 4}) {
    const std::string shards = "Shards" + std::to_string(shard_bits);
    cases.push_back(
        {"Lru" + shards, [] { return NewLruPolicy(); }, shard_bits, true});
    cases.push_back({"GdsfBytes" + shards,
                     [] { return NewGdsfPolicy(ReloadCost::kBytes); },
                     shard_bits, true});
    cases.push_back({"GdsfLoadTime" + shards,
                     [] { return NewGdsfPolicy(ReloadCost::kLoadTime); },
                     shard_bits, false});
    cases.push_back({"GdsfUniform" + shards,
                     [] { return NewGdsfPolicy(ReloadCost::kUniform); },
                     shard_bits, true});
    cases.push_back({"GdsfClassic" + shards,
                     [] { return NewClassicGdsfPolicy(); }, shard_bits, true});
    cases.push_back({"FaasCache" + shards,
                     [] { return NewFaasCachePolicy(0.1, 2e9); }, shard_bits,
                     true});
    // Ranks by the real clock's gaps, so not by history alone.
    cases.push_back({"NextUse" + shards, [] { return NewNextUsePolicy(); },
                     shard_bits, false});
    cases.push_back({"NextUseUniform" + shards,
                     [] { return PolicyByName("next-use-uniform").eviction; },
                     shard_bits, false});
  }
  return cases;
}

void PrintTo(const PolicyCase& c, std::ostream* os) { *os << c.name; }

class PolicyContractTest : public ::testing::TestWithParam<PolicyCase> {
 protected:
  CacheOptions Options(uint64_t capacity) {
    std::shared_ptr<const EvictionPolicy> policy = GetParam().make();
    EXPECT_NE(policy, nullptr);
    return OptionsFor(std::move(policy), GetParam().shard_bits, capacity);
  }
  void Use(ModelCache& cache, const std::string& key, uint64_t bytes) {
    modelcache::Use(cache, models_, key, bytes);
  }

  Models models_;  // declared first: outlives the caches of each test
};

TEST_P(PolicyContractTest, NeverEvictsALeasedOrPinnedRecord) {
  ModelCache cache(Options(400));
  // The protected records are the oldest and least used: every policy would
  // rank them first if it could take them.
  Lease leased = cache.Acquire("leased", 100, models_.For("leased", 100));
  cache.Prefetch("pinned", 100, models_.For("pinned", 100));
  cache.Pin("pinned");

  for (int i = 0; i < 24; ++i) {
    const std::string key = "stream-" + std::to_string(i);
    Use(cache, key, 100);
    if (i % 3 == 0) Use(cache, key, 100);  // some are used twice
    ASSERT_TRUE(IsResident(cache, "leased")) << "after " << key;
    ASSERT_TRUE(IsResident(cache, "pinned")) << "after " << key;
    ASSERT_LE(cache.budget().used(), 400u);
  }
  EXPECT_GE(cache.Stats().evictions, 20u);

  // A lease on 200 bytes takes all that is evictable.
  Lease big = cache.Acquire("big", 200, models_.For("big", 200), FailAtOnce());
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("big", "leased", "pinned"));

  // Now nothing is evictable: a clear capacity error, no load, no eviction.
  const uint64_t evictions = cache.Stats().evictions;
  const std::string message = ErrorMessage(
      [&] {
        cache.Acquire("more", 100, models_.For("more", 100), FailAtOnce());
      },
      ErrorCode::kCapacity);
  EXPECT_THAT(message, HasSubstr("leased"));
  EXPECT_THAT(message, HasSubstr("pinned"));
  EXPECT_EQ(models_.loads("more"), 0);
  EXPECT_EQ(cache.Stats().evictions, evictions);
  EXPECT_EQ(models_.unload_attempts("leased"), 0);
  EXPECT_EQ(models_.unload_attempts("pinned"), 0);
  EXPECT_EQ(models_.unload_attempts("big"), 0);
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

TEST_P(PolicyContractTest, EvictsOnlyWhenNeeded) {
  ModelCache cache(Options(1000));
  // Exactly the capacity, with different sizes and access counts.
  Use(cache, "a", 100);
  Use(cache, "b", 200);
  Use(cache, "b", 200);
  Use(cache, "c", 300);
  Use(cache, "d", 400);
  Use(cache, "d", 400);
  Use(cache, "d", 400);
  EXPECT_EQ(cache.budget().used(), 1000u);
  EXPECT_EQ(cache.Stats().evictions, 0u);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a", "b", "c", "d"));

  // Hits never evict.
  const std::map<std::string, uint64_t> sizes = {
      {"a", 100}, {"b", 200}, {"c", 300}, {"d", 400}};
  for (const char* key : {"a", "b", "c", "d", "a"}) {
    Use(cache, key, sizes.at(key));
  }
  EXPECT_EQ(cache.Stats().evictions, 0u);
  EXPECT_EQ(models_.total_loads(), 4);

  // 100 more: any one victim frees enough, so exactly one goes.
  Use(cache, "e", 100);
  EXPECT_EQ(cache.Stats().evictions, 1u);
  EXPECT_EQ(ResidentKeys(cache).size(), 4u);
  EXPECT_TRUE(IsResident(cache, "e"));
  EXPECT_EQ(models_.total_unloads(), 1);
  EXPECT_LE(cache.budget().used(), 1000u);
  EXPECT_EQ(cache.CheckInvariants(), cache.budget().used());
}

TEST_P(PolicyContractTest, UsedNeverExceedsCapacityAfterAnySequence) {
  constexpr uint64_t kCapacity = 1000;
  constexpr int kKeys = 12;
  ModelCache cache(Options(kCapacity));
  auto size_of = [](int i) -> uint64_t { return 60 + (i * 97) % 300; };

  std::mt19937 rng(20240601u + GetParam().shard_bits);
  std::vector<Lease> held;
  std::set<std::string> pinned;
  for (int step = 0; step < 3000; ++step) {
    const int k = static_cast<int>(rng() % kKeys);
    const std::string key = "m" + std::to_string(k);
    const uint64_t bytes = size_of(k);
    const int op = static_cast<int>(rng() % 100);
    std::string what;
    try {
      if (op < 40) {
        what = "acquire";
        Lease lease =
            cache.Acquire(key, bytes, models_.For(key, bytes), FailAtOnce());
        if (held.size() < 3 && rng() % 2 == 0) held.push_back(std::move(lease));
      } else if (op < 52) {
        what = "release";
        if (!held.empty()) held.erase(held.begin() + rng() % held.size());
      } else if (op < 58) {
        what = "lookup";
        std::optional<Lease> lease = cache.Lookup(key);
        if (lease && held.size() < 3) held.push_back(std::move(*lease));
      } else if (op < 66) {
        what = "prefetch";
        cache.Prefetch(key, bytes, models_.For(key, bytes), FailAtOnce());
      } else if (op < 72) {
        what = "remove";
        cache.Remove(key);
      } else if (op < 76) {
        what = "invalidate";
        cache.Invalidate(key);
      } else if (op < 84) {
        what = "pin";
        if (pinned.size() < 2) {
          cache.Pin(key);
          pinned.insert(key);
        }
      } else if (op < 94) {
        what = "unpin";
        if (!pinned.empty()) {
          std::string victim = *pinned.begin();
          pinned.erase(pinned.begin());
          cache.Unpin(victim);
        }
      } else if (op < 97) {
        what = "prune";
        cache.Prune();
      } else {
        what = "evict-expired";
        cache.EvictExpired();
      }
    } catch (const Error& e) {
      // Full of leases and pins, or a pin of a key not resident.
      ASSERT_TRUE(e.code() == ErrorCode::kCapacity ||
                  e.code() == ErrorCode::kNotFound)
          << "step " << step << " " << what << " " << key << ": " << e.what();
    }
    SCOPED_TRACE("step " + std::to_string(step) + " " + what + " " + key);
    const uint64_t used = cache.budget().used();
    ASSERT_LE(used, kCapacity);
    ASSERT_LE(cache.budget().high_water(), kCapacity);
    ASSERT_EQ(cache.CheckInvariants(), used);
    const CacheStats s = cache.Stats();
    ASSERT_EQ(s.resident_bytes + s.retired_bytes, used);
    const int records =
        static_cast<int>(s.resident_entries + s.retired_entries);
    ASSERT_EQ(models_.total_loads() - models_.total_unloads(), records);
    ASSERT_EQ(models_.live(), records);
  }
  EXPECT_GT(cache.Stats().evictions, 0u);
  EXPECT_GT(cache.Stats().loads, 100u);
}

TEST_P(PolicyContractTest, FailedUnloadDuringEvictionKeepsTheVictimResident) {
  ModelCache cache(Options(300));
  // "fragile" is the oldest and least used of the evictable records.
  Use(cache, "fragile", 100);
  Use(cache, "sturdy", 100);
  for (int i = 0; i < 5; ++i) Use(cache, "sturdy", 100);
  Lease held = cache.Acquire("held", 100, models_.For("held", 100));
  models_.FailUnloads("fragile", true);

  // One record must go. Whatever the policy tries first, fragile stays and
  // the eviction moves on to sturdy.
  Lease newcomer = cache.Acquire("newcomer", 100, models_.For("newcomer", 100),
                                 FailAtOnce());
  EXPECT_TRUE(IsResident(cache, "fragile"));
  EXPECT_FALSE(cache.Entry("sturdy").has_value());
  EXPECT_TRUE(IsResident(cache, "newcomer"));
  EXPECT_EQ(models_.unloads("sturdy"), 1);
  EXPECT_EQ(cache.budget().used(), 300u);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.failed_unloads,
            static_cast<uint64_t>(models_.unload_attempts("fragile")));
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.resident_entries, 3u);
  EXPECT_EQ(cache.CheckInvariants(), 300u);
  if (GetParam().history_ordered) {
    // It was the first victim, and it was tried exactly once.
    EXPECT_EQ(models_.unload_attempts("fragile"), 1);
  }

  // Its place is kept: once its unloader works, it goes before newcomer.
  models_.FailUnloads("fragile", false);
  newcomer.Release();
  Use(cache, "later", 100);
  if (GetParam().history_ordered) {
    EXPECT_FALSE(cache.Entry("fragile").has_value());
    EXPECT_TRUE(IsResident(cache, "newcomer"));
    EXPECT_EQ(models_.unloads("fragile"), 1);
  }
  EXPECT_EQ(cache.budget().used(), 300u);
  EXPECT_EQ(cache.CheckInvariants(), 300u);
}

TEST_P(PolicyContractTest, ShrinkingPastAFailedUnloadKeepsItResident) {
  ModelCache cache(Options(300));
  Use(cache, "a", 100);
  Use(cache, "b", 100);
  Use(cache, "c", 100);
  models_.FailUnloads("b", true);

  EXPECT_EQ(cache.SetCapacity(0), 100u);  // b's bytes are still held
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("b"));
  EXPECT_EQ(cache.budget().used(), 100u);
  EXPECT_EQ(models_.unloads("a"), 1);
  EXPECT_EQ(models_.unloads("c"), 1);
  EXPECT_EQ(cache.Stats().failed_unloads, 1u);
  EXPECT_EQ(cache.Stats().evictions, 2u);
  EXPECT_EQ(cache.CheckInvariants(), 100u);

  // Still the same record: a hit, not a reload.
  models_.FailUnloads("b", false);
  EXPECT_EQ(cache.SetCapacity(300), 0u);
  Use(cache, "b", 100);
  EXPECT_EQ(models_.loads("b"), 1);
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, PolicyContractTest,
                         ::testing::ValuesIn(AllPolicyCases()),
                         [](const ::testing::TestParamInfo<PolicyCase>& info) {
                           return info.param.name;
                         });

// ---- Priority is monotonic, for every policy (no cache involved). ----

struct PolicyMaker {
  std::string name;
  std::function<std::shared_ptr<const EvictionPolicy>()> make;
};

void PrintTo(const PolicyMaker& p, std::ostream* os) { *os << p.name; }

class PolicyPriorityTest : public ::testing::TestWithParam<PolicyMaker> {};

TEST_P(PolicyPriorityTest, PriorityOfOneEntryNeverDecreases) {
  std::shared_ptr<const EvictionPolicy> policy = GetParam().make();
  ASSERT_NE(policy, nullptr);
  std::mt19937 rng(7);
  for (uint64_t bytes :
       {uint64_t{1}, uint64_t{4096}, uint64_t{1} << 20, kGiB, 40 * kGiB}) {
    for (double load_seconds : {0.0, 1e-4, 0.5, 30.0}) {
      SCOPED_TRACE("bytes " + std::to_string(bytes) + " load_seconds " +
                   std::to_string(load_seconds));
      PolicyClock clock;
      AccessInfo entry;
      entry.bytes = bytes;
      entry.accesses = 1;
      entry.load_seconds = load_seconds;
      double last = policy->Priority(entry, clock);
      for (int step = 0; step < 300; ++step) {
        switch (rng() % 4) {
          case 0:  // a load elsewhere
            clock.epoch.fetch_add(1);
            break;
          case 1: {  // an eviction elsewhere, of a victim at or above L
            const double victim =
                clock.inflation.load() + static_cast<double>(rng() % 1000) / 7;
            policy->OnEvict(victim, clock);
            clock.epoch.fetch_add(1);
            break;
          }
          default:  // this entry is acquired again
            ++entry.accesses;
            break;
        }
        const double p = policy->Priority(entry, clock);
        ASSERT_GE(p, last) << "step " << step << " accesses " << entry.accesses
                           << " inflation " << clock.inflation.load();
        last = p;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllPolicies, PolicyPriorityTest,
    ::testing::Values(
        PolicyMaker{"Lru", [] { return NewLruPolicy(); }},
        PolicyMaker{"GdsfBytes",
                    [] { return NewGdsfPolicy(ReloadCost::kBytes); }},
        PolicyMaker{"GdsfLoadTime",
                    [] { return NewGdsfPolicy(ReloadCost::kLoadTime); }},
        PolicyMaker{"GdsfUniform",
                    [] { return NewGdsfPolicy(ReloadCost::kUniform); }},
        PolicyMaker{"GdsfClassic", [] { return NewClassicGdsfPolicy(); }},
        PolicyMaker{"FaasCache", [] { return NewFaasCachePolicy(0.1, 2e9); }}),
    [](const ::testing::TestParamInfo<PolicyMaker>& info) {
      return info.param.name;
    });

// ---- PolicyByName ----

// Priorities of a fixed set of entries under a fixed clock: a fingerprint
// that tells the policies apart.
std::vector<double> Fingerprint(const EvictionPolicy& policy) {
  PolicyClock clock;
  clock.epoch = 9;
  clock.inflation = 1.5;
  std::vector<double> out;
  for (AccessInfo info :
       {AccessInfo{uint64_t{1} << 20, 3, 0.2}, AccessInfo{2 * kGiB, 1, 7.0},
        AccessInfo{kGiB / 4, 5, 0.01}}) {
    out.push_back(policy.Priority(info, clock));
  }
  return out;
}

TEST(PolicyByNameTest, MapsEachNameToItsPolicy) {
  const std::vector<
      std::pair<std::string, std::shared_ptr<const EvictionPolicy>>>
      expected = {{"lru", NewLruPolicy()},
                  {"gdsf", NewGdsfPolicy(ReloadCost::kBytes)},
                  {"gdsf-time", NewGdsfPolicy(ReloadCost::kLoadTime)},
                  {"gdsf-uniform", NewGdsfPolicy(ReloadCost::kUniform)},
                  {"gdsf-classic", NewClassicGdsfPolicy()},
                  {"faascache", NewFaasCachePolicy(0.1, 2e9)}};
  // The fingerprints tell the policies apart...
  for (size_t i = 0; i < expected.size(); ++i) {
    for (size_t j = i + 1; j < expected.size(); ++j) {
      ASSERT_NE(Fingerprint(*expected[i].second),
                Fingerprint(*expected[j].second))
          << expected[i].first << " vs " << expected[j].first;
    }
  }
  // ...and each name gives the matching one.
  for (const auto& [name, reference] : expected) {
    SCOPED_TRACE(name);
    std::shared_ptr<const EvictionPolicy> policy = PolicyByName(name).eviction;
    ASSERT_NE(policy, nullptr);
    EXPECT_EQ(Fingerprint(*policy), Fingerprint(*reference));
    EXPECT_EQ(policy->name(), reference->name());
  }
}

TEST(GdsfPolicyTest, ClassicPriorityIsInflationPlusRawAccesses) {
  auto policy = NewClassicGdsfPolicy();
  PolicyClock clock;
  clock.inflation = 2.5;
  EXPECT_EQ(policy->Priority(AccessInfo{kGiB, 7, 0.3}, clock), 9.5);
  EXPECT_EQ(policy->Priority(AccessInfo{40 * kGiB, 7, 9.0}, clock), 9.5);
}

TEST(FaasCachePolicyTest, PriorityIsInflationPlusAccessesTimesLoadTimePerGiB) {
  // 100 ms latency, 1 GiB/s: a 1 GiB model costs 1.1 s per GiB, a 4 GiB one
  // 4.1 s / 4 GiB.
  auto policy = NewFaasCachePolicy(0.1, static_cast<double>(kGiB));
  PolicyClock clock;
  clock.inflation = 1.0;
  EXPECT_DOUBLE_EQ(policy->Priority(AccessInfo{kGiB, 3, 0}, clock),
                   1.0 + 3 * 1.1);
  EXPECT_DOUBLE_EQ(policy->Priority(AccessInfo{4 * kGiB, 2, 0}, clock),
                   1.0 + 2 * 4.1 / 4);
}

TEST(PolicyByNameTest, UnknownNameIsAnErrorListingEveryValidName) {
  for (const char* name : {"", "unknown", "lfu", "gdsf-", "ttl-", "ttl-10",
                           "ttl-xm", "ttl--1m", "ttl-0m", "ttl-infm"}) {
    SCOPED_TRACE(name);
    const std::string message =
        ErrorMessage([&] { PolicyByName(name); }, ErrorCode::kInvalidArgument);
    EXPECT_THAT(message, HasSubstr("'" + std::string(name) + "'"));
    if (std::string_view(name).substr(0, 4) == "ttl-") {
      EXPECT_THAT(message, HasSubstr("ttl-10m"));
    } else {
      for (const std::string& valid : PolicyNames()) {
        EXPECT_THAT(message, HasSubstr(valid));
      }
      EXPECT_THAT(message, HasSubstr("belady"));
    }
  }
}

// Every name the registry lists is accepted; what it gives: the eviction
// order, a TTL for ttl-<N>, a keep-alive for the prewarm policies, and
// faascache priced by the load cost model given.
TEST(PolicyByNameTest, EveryListedNameGivesARunnablePolicy) {
  for (std::string name : PolicyNames()) {
    if (name == "ttl-<N>m") name = "ttl-10m";
    SCOPED_TRACE(name);
    const NamedPolicy policy = PolicyByName(name);
    EXPECT_EQ(policy.name, name);
    ASSERT_NE(policy.eviction, nullptr);
    EXPECT_FALSE(policy.offline);
    const bool keeps_alive = name == "hybrid-histogram" ||
                             name == "gdsf-prewarm" ||
                             name == "next-use-prewarm";
    EXPECT_EQ(policy.keep_alive != nullptr, keeps_alive);
    EXPECT_EQ(policy.idle_ttl.count() > 0, name == "ttl-10m");
  }
  for (const std::string& name : OfflinePolicyNames()) {
    EXPECT_TRUE(PolicyByName(name).offline) << name;
  }
  EXPECT_EQ(PolicyByName("ttl-90s").idle_ttl, std::chrono::seconds(90));
  EXPECT_EQ(PolicyByName("ttl-1.5h").idle_ttl, std::chrono::minutes(90));
  EXPECT_EQ(PolicyByName("ttl-500ms").idle_ttl, std::chrono::milliseconds(500));
  EXPECT_EQ(
      Fingerprint(*PolicyByName("faascache", LoadCostModel{0.5, 1e9}).eviction),
      Fingerprint(*NewFaasCachePolicy(0.5, 1e9)));
  EXPECT_TRUE(PolicyByName("next-use-prewarm")
                  .keep_alive->prewarm_evicts_lower_ranked());
  EXPECT_FALSE(
      PolicyByName("gdsf-prewarm").keep_alive->prewarm_evicts_lower_ranked());
}

// ---- LRU ----

TEST(LruPolicyTest, EvictsInExactLeastRecentlyUsedOrderWithOneShard) {
  Models models;
  ModelCache cache(OptionsFor(NewLruPolicy(), /*shard_bits=*/0, 500));
  for (int i = 0; i < 5; ++i) Use(cache, models, "k" + std::to_string(i), 100);
  // Touch every key, in an order unlike the load order.
  const std::vector<std::string> touch_order = {"k3", "k0", "k4", "k1", "k2"};
  for (const std::string& key : touch_order) Use(cache, models, key, 100);

  std::set<std::string> expected_resident(touch_order.begin(),
                                          touch_order.end());
  for (size_t i = 0; i < touch_order.size(); ++i) {
    const std::string newcomer = "n" + std::to_string(i);
    Use(cache, models, newcomer, 100);
    expected_resident.erase(touch_order[i]);
    expected_resident.insert(newcomer);
    EXPECT_EQ(ResidentKeys(cache),
              std::vector<std::string>(expected_resident.begin(),
                                       expected_resident.end()))
        << "after loading " << newcomer << ", expected " << touch_order[i]
        << " to be the victim";
  }
  EXPECT_EQ(cache.Stats().evictions, 5u);
}

TEST(LruPolicyTest, DropsAFrequentlyUsedLargeModelLastTouchedLongAgo) {
  // The contrast for GdsfPolicyTest.KeepsAFrequentlyUsedLargeModel.
  Models models;
  ModelCache cache(OptionsFor(NewLruPolicy(), /*shard_bits=*/0, 1000));
  for (int i = 0; i < 3; ++i) Use(cache, models, "large", 600);
  Use(cache, models, "small", 200);
  Use(cache, models, "newcomer", 300);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("newcomer", "small"));
}

// ---- GDSF ----

TEST(GdsfPolicyTest, KeepsAFrequentlyUsedLargeModelOverAOnceUsedSmallOne) {
  Models models;
  ModelCache cache(
      OptionsFor(NewGdsfPolicy(ReloadCost::kBytes), /*shard_bits=*/0, 1000));
  for (int i = 0; i < 3; ++i) Use(cache, models, "large", 600);
  Use(cache, models, "small", 200);  // more recent, but used once
  // 300 more: one of them must go. Dropping the large one would mean loading
  // 600 bytes again for a model requested three times as often.
  Use(cache, models, "newcomer", 300);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("large", "newcomer"));
  EXPECT_EQ(models.loads("large"), 1);
  EXPECT_EQ(models.unloads("small"), 1);
}

TEST(GdsfPolicyTest, UniformCostFavoursSmallModels) {
  Models models;
  ModelCache cache(
      OptionsFor(NewGdsfPolicy(ReloadCost::kUniform), /*shard_bits=*/0, 500));
  Use(cache, models, "small", 100);
  Use(cache, models, "big", 400);  // more recent: LRU would drop small
  Use(cache, models, "newcomer", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("newcomer", "small"));
}

TEST(GdsfPolicyTest, InflationAgesOutAnOldFrequentlyUsedEntry) {
  for (ReloadCost cost : {ReloadCost::kBytes, ReloadCost::kUniform}) {
    SCOPED_TRACE("cost " + std::to_string(static_cast<int>(cost)));
    Models models;
    ModelCache cache(OptionsFor(NewGdsfPolicy(cost), /*shard_bits=*/0, 300));
    for (int i = 0; i < 5; ++i) Use(cache, models, "hot", 100);

    // A stream of models used once each. Without aging their priority would
    // stay below hot's forever; with it, L rises with every eviction.
    int evicted_at = -1;
    for (int i = 0; i < 60 && evicted_at < 0; ++i) {
      Use(cache, models, "cold-" + std::to_string(i), 100);
      if (!cache.Entry("hot").has_value()) evicted_at = i;
    }
    // LRU would have dropped hot at cold-2; GDSF keeps it for a while...
    EXPECT_GE(evicted_at, 6);
    // ...but not forever.
    EXPECT_NE(evicted_at, -1) << "hot was never evicted: no aging";
    EXPECT_GT(cache.budget().policy_clock().inflation.load(), 0.0);
  }
}

TEST(GdsfPolicyTest, BytesCostPriorityIsInflationPlusLogAccesses) {
  std::shared_ptr<const EvictionPolicy> policy =
      NewGdsfPolicy(ReloadCost::kBytes);
  PolicyClock clock;
  clock.inflation = 2.5;
  // Independent of size and load time: L + log2(1 + accesses).
  for (uint64_t bytes : {uint64_t{1}, kGiB, 10 * kGiB}) {
    EXPECT_DOUBLE_EQ(policy->Priority(AccessInfo{bytes, 3, 0.7}, clock), 4.5)
        << bytes;
    EXPECT_DOUBLE_EQ(policy->Priority(AccessInfo{bytes, 1, 9.0}, clock), 3.5)
        << bytes;
    EXPECT_DOUBLE_EQ(policy->Priority(AccessInfo{bytes, 7, 9.0}, clock), 5.5)
        << bytes;
  }
}

TEST(GdsfPolicyTest, OnEvictRaisesInflationToTheVictimsPriority) {
  for (ReloadCost cost :
       {ReloadCost::kBytes, ReloadCost::kLoadTime, ReloadCost::kUniform}) {
    SCOPED_TRACE("cost " + std::to_string(static_cast<int>(cost)));
    std::shared_ptr<const EvictionPolicy> policy = NewGdsfPolicy(cost);
    PolicyClock clock;
    const AccessInfo entry{kGiB, 2, 1.0};
    const double before = policy->Priority(entry, clock);
    policy->OnEvict(7.5, clock);
    EXPECT_DOUBLE_EQ(clock.inflation.load(), 7.5);
    EXPECT_DOUBLE_EQ(policy->Priority(entry, clock), before + 7.5);
    // "Raised": a victim ranked below L (evicted late, by another cache on
    // the same budget) must not lower it, or priorities could decrease.
    policy->OnEvict(3.0, clock);
    EXPECT_DOUBLE_EQ(clock.inflation.load(), 7.5);
  }
}

TEST(GdsfPolicyTest, CostRelationsMatchEachReloadCost) {
  PolicyClock clock;
  clock.inflation = 1.0;
  // Every cost: more accesses rank higher.
  for (ReloadCost cost :
       {ReloadCost::kBytes, ReloadCost::kLoadTime, ReloadCost::kUniform}) {
    std::shared_ptr<const EvictionPolicy> policy = NewGdsfPolicy(cost);
    EXPECT_GT(policy->Priority(AccessInfo{kGiB, 4, 2.0}, clock),
              policy->Priority(AccessInfo{kGiB, 2, 2.0}, clock))
        << static_cast<int>(cost);
  }
  // Uniform: the smaller model ranks higher at equal use.
  std::shared_ptr<const EvictionPolicy> uniform =
      NewGdsfPolicy(ReloadCost::kUniform);
  EXPECT_GT(uniform->Priority(AccessInfo{kGiB / 2, 1, 1.0}, clock),
            uniform->Priority(AccessInfo{2 * kGiB, 1, 1.0}, clock));
  // Load time: slower to load per byte ranks higher.
  std::shared_ptr<const EvictionPolicy> time =
      NewGdsfPolicy(ReloadCost::kLoadTime);
  EXPECT_GT(time->Priority(AccessInfo{kGiB, 1, 8.0}, clock),
            time->Priority(AccessInfo{kGiB, 1, 2.0}, clock));
  EXPECT_GT(time->Priority(AccessInfo{kGiB, 1, 4.0}, clock),
            time->Priority(AccessInfo{4 * kGiB, 1, 4.0}, clock));
}

// ---- next-use: predicted next request ----

// A cache of `capacity` bytes under next-use whose clock is `*seconds`.
CacheOptions NextUseOptions(const double* seconds, uint64_t capacity,
                            int shard_bits = 0) {
  CacheOptions options = OptionsFor(NewNextUsePolicy(), shard_bits, capacity);
  options.now = [seconds] {
    return Clock::time_point(
        std::chrono::nanoseconds(static_cast<int64_t>(*seconds * 1e9)));
  };
  return options;
}

TEST(RequestHistoryTest, WeighsOlderGapsLessAndMeansEachLengthApart) {
  RequestHistory history(4);  // each gap fades by 3/4 per later request
  EXPECT_TRUE(history.empty());
  EXPECT_FALSE(history.has_gaps());
  history.Record(10);
  EXPECT_EQ(history.requests(), 1u);
  EXPECT_FALSE(history.has_gaps());  // one request, no gap yet
  EXPECT_EQ(history.TypicalGapLongerThan(-1), 0.0);
  for (double t : {12.0, 112.0, 114.0}) history.Record(t);  // 2, 100, 2
  EXPECT_TRUE(history.has_gaps());
  // Weights, newest first: 1, 3/4, (3/4)^2; the two 2 s gaps share a bin.
  const double w2 = 1 + 0.75 * 0.75;
  const double w100 = 0.75;
  // The square of the weighted mean square root, over both lengths.
  const double mean_root =
      (std::sqrt(2.0) * w2 + std::sqrt(100.0) * w100) / (w2 + w100);
  EXPECT_DOUBLE_EQ(history.TypicalGapLongerThan(-1), mean_root * mean_root);
  EXPECT_DOUBLE_EQ(history.TypicalGapLongerThan(2), 100.0);
  EXPECT_DOUBLE_EQ(history.TypicalGapLongerThan(99.5), 100.0);
  EXPECT_EQ(history.TypicalGapLongerThan(100), 0.0);  // none longer
  EXPECT_EQ(history.last_request_seconds(), 114.0);
  history.Record(113);  // a lagging clock read: a gap of 0, time kept
  EXPECT_EQ(history.last_request_seconds(), 114.0);
  EXPECT_EQ(history.requests(), 5u);
  RequestHistory latest_only(1);
  for (double t : {0.0, 5.0, 105.0}) latest_only.Record(t);
  EXPECT_DOUBLE_EQ(latest_only.TypicalGapLongerThan(-1), 100.0);
  EXPECT_EQ(latest_only.TypicalGapLongerThan(100), 0.0);
}

TEST(RequestHistoryTest, APauseOutlivesALongBurst) {
  // The pattern that a list of the last 32 gaps forgot: bursts of 100
  // requests a second apart, every ten minutes. Right after a burst the
  // next request is the next burst's, and the history still says so.
  RequestHistory history(32);
  double t = 0;
  for (int burst = 0; burst < 3; ++burst) {
    for (int i = 0; i < 100; ++i) history.Record(t + i);
    t += 600;
  }
  EXPECT_NEAR(history.TypicalGapLongerThan(1.5), 501.0, 1e-9);  // 600 - 99
}

TEST(RequestHistoryTest, ARarePauseDoesNotStretchTheForecastOfShortGaps) {
  // Every five minutes after a night's pause of eight hours: 30 gaps of
  // 300 s since the pause, which still weighs (31/32)^30 = 0.39 against
  // their 19.7 in all.
  RequestHistory sessions(32);
  double t = 0;
  sessions.Record(t);
  t += 8 * 3600;
  sessions.Record(t);
  for (int i = 0; i < 30; ++i) sessions.Record(t += 300);
  const double fade = 31.0 / 32;
  const double w_pause = std::pow(fade, 30);
  const double w_short = (1 - w_pause) / (1 - fade);
  const double mean_root =
      (w_short * std::sqrt(300.0) + w_pause * std::sqrt(8.0 * 3600)) /
      (w_short + w_pause);
  EXPECT_NEAR(sessions.TypicalGapLongerThan(0), mean_root * mean_root, 1e-6);
  EXPECT_NEAR(sessions.TypicalGapLongerThan(0), 410, 1);
  // The plain mean would say (300 w_short + 28800 w_pause) / total = 849 s:
  // later than a model asked for every ten minutes, which would then stay
  // while this one, back in five, went first.
  RequestHistory steady(32);
  for (int i = 0; i < 32; ++i) steady.Record(i * 600.0);
  const std::shared_ptr<const EvictionPolicy> policy = NewNextUsePolicy(32, 0);
  PolicyClock clock;
  AccessInfo session_model{kGiB, 1, 0.0};
  session_model.history = &sessions;
  session_model.now_seconds = t;  // just asked for
  AccessInfo steady_model = session_model;
  steady_model.history = &steady;
  steady_model.now_seconds = steady.last_request_seconds();
  EXPECT_GT(policy->Priority(session_model, clock),
            policy->Priority(steady_model, clock));
}

TEST(RequestHistoryTest, KeepsAtMostSixteenLengthsDroppingTheLightest) {
  RequestHistory history(1000);  // barely fades: the oldest is the lightest
  double t = 0;
  history.Record(t);
  // Gaps of 2^k ms for k = 0..19: twenty lengths, each its own bin; the
  // first four (1, 2, 4 and 8 ms) are dropped as the lightest.
  for (int k = 0; k < 20; ++k) {
    t += std::ldexp(1e-3, k);
    history.Record(t);
  }
  EXPECT_EQ(history.TypicalGapLongerThan(0.0159),
            history.TypicalGapLongerThan(-1));
  EXPECT_LT(history.TypicalGapLongerThan(0.0159),
            history.TypicalGapLongerThan(0.0161));  // the 16 ms bin is kept
  // A long-lived history rescales its weights and keeps its means.
  RequestHistory steady(32);
  for (int i = 0; i < 100000; ++i) steady.Record(i * 7.0);
  EXPECT_DOUBLE_EQ(steady.TypicalGapLongerThan(-1), 7.0);
}

// A gap of a Poisson stream with this mean: the exponential's inverse CDF
// of a uniform draw from the engine (whose output the standard fixes).
double ExponentialGap(std::mt19937_64& rng, double mean) {
  const double u = static_cast<double>(rng() >> 11) * 0x1p-53;  // [0, 1)
  return -mean * std::log1p(-u);
}

TEST(RequestHistoryTest, ExponentialGapsLookMemorylessTimersAndBurstsDoNot) {
  // Requests at random, ten seconds apart on average: once a few dozen gaps
  // are known, the exponential predicts them better nearly every time.
  int memoryless = 0, checked = 0;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    RequestHistory history(32);
    double t = 0;
    history.Record(t);
    for (int i = 0; i < 150; ++i) {
      history.Record(t += ExponentialGap(rng, 10));
      if (i >= 50) {
        ++checked;
        memoryless += history.LooksMemoryless();
      }
    }
  }
  EXPECT_GT(memoryless, 0.9 * checked) << memoryless << " of " << checked;

  // Fewer than two gaps: nothing to judge by.
  RequestHistory young(32);
  for (double t : {0.0, 10.0}) {
    young.Record(t);
    EXPECT_FALSE(young.LooksMemoryless());
  }

  // A timer, every minute give or take 5 s, from its second gap on.
  std::mt19937_64 rng(7);
  RequestHistory timer(32);
  double t = 0;
  timer.Record(t);
  timer.Record(t += 60);
  for (int i = 0; i < 100; ++i) {
    const double jitter = static_cast<double>(rng() >> 11) * 0x1p-53 - 0.5;
    timer.Record(t += 60 + 10 * jitter);
    EXPECT_FALSE(timer.LooksMemoryless()) << "request " << i;
  }

  // Bursts of ten requests a second apart, every ten minutes.
  RequestHistory bursts(32);
  for (int burst = 0; burst < 20; ++burst) {
    for (int i = 0; i < 10; ++i) {
      bursts.Record(600.0 * burst + i);
      if (bursts.requests() >= 3) {
        EXPECT_FALSE(bursts.LooksMemoryless())
            << "burst " << burst << ", request " << i;
      }
    }
  }
}

TEST(RequestHistoryTest, MemorylessWaitIsTheMeanGapCountingTheIdleTime) {
  RequestHistory history(4);  // each gap fades by 3/4 per later request
  EXPECT_EQ(history.MemorylessWait(5), 0.0);
  history.Record(0);
  EXPECT_EQ(history.MemorylessWait(5), 0.0);  // no gap yet
  history.Record(10);
  history.Record(30);  // gaps of 10 s (weight 3/4) and 20 s (weight 1)
  const double weight = 1.75, gaps = 0.75 * 10 + 20;
  EXPECT_NEAR(history.MemorylessWait(0), gaps / weight, 1e-12);
  // The idle time so far is part of the gap under way.
  EXPECT_NEAR(history.MemorylessWait(7), (gaps + 7) / weight, 1e-12);
  EXPECT_NEAR(history.MemorylessWait(-3), gaps / weight, 1e-12);
}

TEST(NextUsePolicyTest, RanksByThePredictedWaitForTheNextRequest) {
  std::shared_ptr<const EvictionPolicy> policy = NewNextUsePolicy(8, 0);
  EXPECT_EQ(policy->name(), "next-use");
  EXPECT_TRUE(policy->time_dependent());
  EXPECT_EQ(policy->history_length(), 8u);
  PolicyClock clock;
  RequestHistory bursty(8);
  // Bursts of 1 s gaps separated by 60 s pauses.
  for (double t : {0.0, 1.0, 2.0, 62.0, 63.0, 64.0}) bursty.Record(t);
  AccessInfo info{kGiB, 1, 0.0};
  info.history = &bursty;
  info.now_seconds = 64.5;  // inside the burst: gaps of 1 s and 60 s apply
  // Gaps 1, 1, 60, 1, 1 s, weighed (7/8)^4, (7/8)^3, (7/8)^2, 7/8, 1.
  const double f = 7.0 / 8;
  const double w1 = f * f * f * f + f * f * f + f + 1;
  const double w60 = f * f;
  const double mean_root = (w1 * 1 + w60 * std::sqrt(60.0)) / (w1 + w60);
  EXPECT_DOUBLE_EQ(policy->Priority(info, clock),
                   -(mean_root * mean_root - 0.5));
  info.now_seconds = 70;  // past the burst: only the 60 s pause applies
  EXPECT_DOUBLE_EQ(policy->Priority(info, clock), -(60.0 - 6.0));
  info.now_seconds = 164;  // idle longer than any gap: as late as it is idle
  EXPECT_DOUBLE_EQ(policy->Priority(info, clock), -100.0);
  RequestHistory once(8);
  once.Record(0);
  info.history = &once;  // no gap yet: never expected again
  EXPECT_EQ(policy->Priority(info, clock),
            -std::numeric_limits<double>::infinity());
  info.history = nullptr;
  EXPECT_EQ(policy->Priority(info, clock),
            -std::numeric_limits<double>::infinity());
}

TEST(NextUsePolicyTest, GapsThatLookMemorylessAreRankedByTheirMeanGap) {
  const std::shared_ptr<const EvictionPolicy> policy =
      PolicyByName("next-use").eviction;
  PolicyClock clock;
  std::mt19937_64 rng(3);
  RequestHistory random(32);
  double t = 0;
  random.Record(t);
  for (int i = 0; i < 100; ++i) random.Record(t += ExponentialGap(rng, 10));
  ASSERT_TRUE(random.LooksMemoryless());
  AccessInfo info{2 * kGiB, 1, 0.0};
  info.history = &random;
  for (double idle : {0.0, 3.0, 40.0, 400.0}) {
    info.now_seconds = t + idle;
    EXPECT_DOUBLE_EQ(policy->Priority(info, clock),
                     -random.MemorylessWait(idle) / std::pow(2.0, 0.25))
        << idle;
  }
  // Gaps that do not look memoryless keep the forecast from the gaps longer
  // than the idle time.
  RequestHistory timer(32);
  for (double s : {0.0, 60.0, 120.0, 180.0}) timer.Record(s);
  ASSERT_FALSE(timer.LooksMemoryless());
  info.history = &timer;
  info.now_seconds = 190;
  EXPECT_DOUBLE_EQ(policy->Priority(info, clock), -50.0 / std::pow(2.0, 0.25));
}

TEST(NextUsePolicyTest, TheSizeExponentWeighsTheWaitBySize) {
  std::shared_ptr<const EvictionPolicy> bytes =
      PolicyByName("next-use").eviction;
  std::shared_ptr<const EvictionPolicy> uniform =
      PolicyByName("next-use-uniform").eviction;
  ASSERT_NE(bytes, nullptr);
  ASSERT_NE(uniform, nullptr);
  EXPECT_EQ(bytes->name(), "next-use");
  EXPECT_EQ(uniform->name(), "next-use-uniform");
  EXPECT_EQ(bytes->history_length(), 32u);
  PolicyClock clock;
  RequestHistory every_minute(32);
  for (double t : {0.0, 60.0, 120.0}) every_minute.Record(t);
  AccessInfo small{kGiB / 16, 1, 0.0};
  small.history = &every_minute;
  small.now_seconds = 130;  // due in 50 s
  AccessInfo large = small;
  large.bytes = 16 * kGiB;
  // Bytes: wait / GiB^0.25, so of two models due at once the small one
  // goes first. Cold starts: wait * GiB, the large one goes first.
  EXPECT_DOUBLE_EQ(bytes->Priority(small, clock), -50.0 / 0.5);
  EXPECT_DOUBLE_EQ(bytes->Priority(large, clock), -50.0 / 2.0);
  EXPECT_DOUBLE_EQ(uniform->Priority(small, clock), -50.0 / 16);
  EXPECT_DOUBLE_EQ(uniform->Priority(large, clock), -50.0 * 16);
}

TEST(NextUsePolicyTest, OfTwoModelsDueTogetherTheSizeDecidesWhichGoes) {
  // "small" (100 bytes) and "large" (300) both come every 10 s, so both are
  // due at once when a newcomer needs room. Each case uses the model it
  // expects to keep first, so that the access order, which breaks ties,
  // would evict that one: only the size exponent saves it.
  struct Case {
    const char* policy;
    const char* kept;
    const char* evicted;
  };
  for (const Case& c : {Case{"next-use", "large", "small"},
                        Case{"next-use-uniform", "small", "large"}}) {
    SCOPED_TRACE(c.policy);
    double now = 0;
    Models models;
    CacheOptions options = NextUseOptions(&now, 400);
    options.policy = PolicyByName(c.policy).eviction;
    ModelCache cache(std::move(options));
    const uint64_t kept_bytes = std::string(c.kept) == "small" ? 100 : 300;
    for (now = 0; now <= 30; now += 10) {
      Use(cache, models, c.kept, kept_bytes);
      Use(cache, models, c.evicted, 400 - kept_bytes);
    }
    now = 35;
    Use(cache, models, "new", 100);
    EXPECT_EQ(models.unloads(c.evicted), 1);
    EXPECT_EQ(models.unloads(c.kept), 0);
  }
}

TEST(NextUsePolicyTest, EvictsTheModelWhoseNextRequestIsFurthestNotTheOldest) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 200));
  // "fast" comes every 10 s; "slow" came at 0.5 and 95 s, so it is the most
  // recently used, and LRU would evict "fast".
  Use(cache, models, "fast", 100);
  now = 0.5;
  Use(cache, models, "slow", 100);
  for (now = 10; now <= 90; now += 10) Use(cache, models, "fast", 100);
  now = 95;
  Use(cache, models, "slow", 100);
  now = 96;  // fast's next request is due in 4 s, slow's in 94 s
  Use(cache, models, "new", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("fast", "new"));
  EXPECT_EQ(models.unloads("slow"), 1);
}

TEST(NextUsePolicyTest, AModelIdleLongerThanEveryGapCoolsAndGoes) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 200));
  Use(cache, models, "slow", 100);
  now = 200;
  Use(cache, models, "slow", 100);  // one 200 s gap
  // "cooled" came every 10 s after that, so LRU would evict "slow".
  for (now = 210; now <= 240; now += 10) Use(cache, models, "cooled", 100);
  // At 390 s: "cooled" has been idle 150 s, far longer than any of its
  // gaps, so its next request is put 150 s away (not in the past, which
  // would keep it forever); "slow" is due in 10 s.
  now = 390;
  Use(cache, models, "new", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("new", "slow"));
}

TEST(NextUsePolicyTest, AModelAskedForAtRandomIsNotWrittenOffForOneLongWait) {
  // "random" is asked for at random, every 10 s on average; "minutely" every
  // 60 s. When a newcomer needs room, "random" has waited longer than any of
  // its gaps and longer than a minute, which would cool it (as if it were
  // due as late as it has been idle: later than "minutely"). But for
  // requests at random a long wait says little about the next one, still
  // about 10 s away: "minutely" goes.
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 200));
  std::mt19937_64 rng(5);
  std::vector<double> random_times = {0};
  double longest = 0;
  while (random_times.back() < 1000) {
    const double gap = ExponentialGap(rng, 10);
    longest = std::max(longest, gap);
    random_times.push_back(random_times.back() + gap);
  }
  std::vector<std::pair<double, std::string>> requests;
  for (double s : random_times) requests.emplace_back(s, "random");
  const double arrival = random_times.back() + std::max(1.5 * longest, 100.0);
  for (double s = 0.5; s < arrival - 1; s += 60) {
    requests.emplace_back(s, "minutely");
  }
  requests.emplace_back(arrival - 1, "minutely");
  std::sort(requests.begin(), requests.end());
  for (const auto& [s, key] : requests) {
    now = s;
    Use(cache, models, key, 100);
  }
  now = arrival;
  Use(cache, models, "new", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("new", "random"));
  EXPECT_EQ(models.unloads("minutely"), 1);
}

TEST(NextUsePolicyTest, AModelRequestedOnceGoesFirstEvenIfMostRecent) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 300));
  for (now = 0; now <= 40; now += 20) Use(cache, models, "a", 100);
  for (now = 1; now <= 41; now += 20) Use(cache, models, "b", 100);
  now = 50;
  Use(cache, models, "once", 100);
  now = 51;
  Use(cache, models, "new", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("a", "b", "new"));
  EXPECT_EQ(models.unloads("once"), 1);
}

TEST(NextUsePolicyTest, WhatWasLearntSurvivesEviction) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 200));
  for (now = 0; now <= 40; now += 10) Use(cache, models, "periodic", 100);
  now = 41;
  Use(cache, models, "x", 100);
  now = 42;
  Use(cache, models, "y", 100);  // "periodic" (due at 50) or "x" (once)
  EXPECT_EQ(models.unloads("x"), 1);
  now = 43;
  Use(cache, models, "z", 100);  // "y" and "z" are once-only: "periodic"...
  now = 44;
  Use(cache, models, "w", 100);
  // ...has stayed through every newcomer: it alone has a history.
  EXPECT_TRUE(IsResident(cache, "periodic"));
  EXPECT_EQ(models.loads("periodic"), 1);
  // Evicted by hand and requested again, it still has its gaps: a newcomer
  // requested once goes before it.
  ASSERT_EQ(cache.Remove("periodic"), RemoveOutcome::kRemoved);
  now = 50;
  Use(cache, models, "periodic", 100);
  now = 51;
  Use(cache, models, "v", 100);
  EXPECT_TRUE(IsResident(cache, "periodic"));
  EXPECT_EQ(models.loads("periodic"), 2);
}

TEST(NextUsePolicyTest, APrefetchIsNotARequest) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 200));
  Use(cache, models, "steady", 100);
  now = 10;
  cache.Prefetch("prefetched", 100, models.For("prefetched", 100));
  now = 60;
  Use(cache, models, "steady", 100);  // a 60 s gap
  now = 61;
  Use(cache, models, "prefetched", 100);  // its first request
  // Were the prefetch a request, "prefetched" would have a 51 s gap and be
  // due sooner than "steady" (due at 120 s); it has no gap, so it goes.
  now = 62;
  Use(cache, models, "new", 100);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("new", "steady"));
}

// A request that waited before its Acquire (AcquireOptions::arrival) is
// learned at its arrival. "x" was requested at 0 and again at 50, but the
// second Acquire runs at 100; "y" was requested at 16 and 96. At 101:
//   arrivals: x's gap is 50 and it has been idle 51, longer than any gap, so
//     it is expected 51 s away; y (gap 80, idle 5) 75 s away: y goes.
//   call times: x's gap would be 100 and its idle 1: 99 s away: x would go.
TEST(NextUsePolicyTest, ARequestIsLearnedAtItsArrival) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 200));
  Use(cache, models, "x", 100);
  now = 16;
  Use(cache, models, "y", 100);
  now = 96;
  Use(cache, models, "y", 100);
  now = 100;
  AcquireOptions waited;
  waited.arrival = Clock::time_point(std::chrono::seconds(50));
  ASSERT_TRUE(cache.Acquire("x", 100, models.For("x", 100), waited));
  now = 101;
  cache.Prefetch("z", 100, models.For("z", 100));
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("x", "z"));
}

TEST(NextUsePolicyTest, AWarmUpEvictsOnlyModelsExpectedLaterThanItself) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 1000));
  // Histories: "p" every 30 s; "q" twice, 2 s apart; "later" at 0 and 95
  // s; "soon" every 10 s, then 5 s.
  Use(cache, models, "later", 100);
  Use(cache, models, "p", 100);
  Use(cache, models, "q", 100);
  now = 2;
  Use(cache, models, "q", 100);
  for (now = 30; now <= 90; now += 30) Use(cache, models, "p", 100);
  for (now = 60; now <= 90; now += 10) Use(cache, models, "soon", 100);
  now = 95;
  Use(cache, models, "soon", 100);
  Use(cache, models, "later", 100);
  ASSERT_EQ(cache.Remove("p"), RemoveOutcome::kRemoved);
  ASSERT_EQ(cache.Remove("q"), RemoveOutcome::kRemoved);
  ASSERT_EQ(cache.SetCapacity(200), 0u);  // "soon" and "later" fill it
  // At 100 s: "soon" is due in 5 s, "p" in 20 s, "later" in 90 s and "q"
  // (idle 98 s, past its only gap) in 98 s.
  now = 100;
  AcquireOptions warm_up;
  warm_up.evict_only_lower_ranked = true;
  cache.Prefetch("p", 100, models.For("p", 100), warm_up);
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("p", "soon"));
  // "q" is expected after both: it may evict neither, and fails whole.
  EXPECT_THAT(
      ErrorMessage(
          [&] { cache.Prefetch("q", 100, models.For("q", 100), warm_up); },
          ErrorCode::kCapacity),
      HasSubstr("nothing ranked below it is evictable"));
  EXPECT_THAT(ResidentKeys(cache), ElementsAre("p", "soon"));
  EXPECT_EQ(models.loads("q"), 1);  // only its first load, at 0 s
  cache.CheckInvariants();
  EXPECT_EQ(cache.budget().used(), 200u);
  // A request is not held back: it evicts as usual.
  Use(cache, models, "q", 100);
  EXPECT_EQ(models.loads("q"), 2);
}

TEST(NextUsePolicyTest, HistoriesStayBoundedWhateverTheNumberOfKeys) {
  double now = 0;
  Models models;
  ModelCache cache(NextUseOptions(&now, 100));
  // Far more distinct keys than a shard keeps histories for; the invariant
  // check verifies the bound.
  for (int i = 0; i < 10000; ++i) {
    now += 1;
    Use(cache, models, "k" + std::to_string(i), 10);
  }
  cache.CheckInvariants();
  EXPECT_LE(cache.Stats().resident_bytes, 100u);
}

}  // namespace
// Every online name runs in a ModelCache: the cache takes its eviction
// order, TTL and keep-alive (CacheOptions::WithPolicy), and its books stay
// exact through loads, hits, evictions and keep-alive actions.
TEST(PolicyByNameTest, EveryListedNameRunsInAModelCache) {
  for (std::string name : PolicyNames()) {
    if (name == "ttl-<N>m") name = "ttl-10m";
    SCOPED_TRACE(name);
    Models models;
    double now = 0;
    CacheOptions options = NextUseOptions(&now, 300);
    options.WithPolicy(PolicyByName(name));
    options.prewarm_source = [&](std::string_view key) {
      return PrewarmSource{100, models.For(std::string(key), 100)};
    };
    ModelCache cache(std::move(options));
    for (int i = 0; i < 40; ++i) {
      now += 45;  // seconds: past the 10-minute TTL now and then
      Use(cache, models, "m" + std::to_string(i % 5), 100);
      cache.RunKeepAlive();
      cache.EvictExpired();
      ASSERT_LE(cache.budget().used(), 300u);
      ASSERT_EQ(cache.CheckInvariants(), cache.budget().used());
    }
    EXPECT_EQ(
        cache.Stats().hits + cache.Stats().misses - cache.Stats().prewarms,
        40u);
  }
}

}  // namespace modelcache
