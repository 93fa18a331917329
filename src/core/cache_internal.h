// ModelCache's internals: the sharded key space, the record lifecycle, and
// the CacheCore that implements ModelCache. Not part of the public API.
//
// Design note
// -----------
// The key space is split into 2^shard_bits shards. A shard owns, under its
// mutex: a map from key to Slot (a record, or an alias naming a canonical
// key), an eviction order, the records it retired, and its counters. A record
// lives in exactly one shard, the one its canonical key hashes to.
//
// Record states and transitions (all under the record's shard mutex):
//
//   (absent) --Acquire miss--> kLoading --load ok--> kResident
//   kLoading --load/reservation failed--> kFailed (out of the map)
//   kResident --evict/remove, unleased--> kUnloading
//   kUnloading --unloader ok--> kGone (out of the map)
//   kUnloading --unloader threw--> kResident (same place in the order)
//   kResident --remove/invalidate while leased--> retired (out of the map,
//       still counted) --last lease ends--> kUnloading --unloader ok--> kGone
//   retired kUnloading --unloader threw--> retired kResident, unload_failed
//       (still counted) --Prune--> kUnloading again
//   kLoading --Invalidate--> kLoading, stale --load ok--> retired at once
//       (the waiters that joined before the invalidation hold it)
//
// Draining (Record::draining; the budget's scheduler, budget_drain.cc,
// decides, drain.cc carries it out) is a flag on a kResident record in the
// map, not a state of its own:
//
//   kResident --chosen for an overdue waiter's drain set--> kResident,
//       draining: no new lease (Acquire queues on the shard's condvar,
//       Lookup and TryAcquire miss), not evictable but by its drain
//   draining --the drain ends (its waiter served, timed out, interrupted)
//       --> kResident, leased again by the acquires queued behind it
//   draining, no lease, the whole set idle --the waiter evicts it-->
//       kUnloading --> kGone (the queued acquires load it again, with their
//       arrival) or, if the unloader threw, kResident at its place
//   draining --Remove, leased--> retired (queued acquires look again);
//       --Remove, unleased--> kUnloading as any removal
//   draining --pinned meanwhile--> left out of the set, the flag cleared
//
// Single flight: a new record is created only when the map has no slot for
// the key, and it leaves the map only in a transition above, under the shard
// mutex. So at most one record per key is in the map, at most one load runs
// per key, and a record is replaced only after it has left the map. Callers
// that meet a kLoading record wait on it (holding a reference and counted in
// `waiters`); the load's completion grants each of them a lease in the same
// critical section that makes the record resident, so no eviction can slip
// in between. Callers that meet kUnloading, or a stale kLoading record,
// wait for it to leave that state and look the key up again: an acquire that
// comes after Invalidate loads afresh, after the stale load, never beside it.
//
// Waiting for oneself: a record in kLoading or kUnloading remembers the
// thread running its loader or unloader (`owner`). That thread's own acquire
// or removal of the key would wait for itself; it fails with
// kFailedPrecondition instead.
//
// Aliases: an alias is a slot in the shard its name hashes to, so a lookup
// resolves it under that shard's mutex in the same probe that finds records.
// Mutations go through alias_mu_ as well, which keeps the alias table and
// its reverse (target -> aliases) and lets AddAlias check "the target is not
// an alias, the alias is not a target" and insert as one step: no chain or
// cycle can form, so every call resolves a name in one step.
//
// Eviction order: one EvictionOrder per shard (eviction_order.h), kept
// lazily: a hit updates only the record's own key, and its entry is moved
// when a scan for a victim reaches it. An entry is removed only when its
// record leaves the map, which is why a failed unload keeps its place.
//
// Hit path: a hit locks one shard, finds the key in a flat (open-addressing)
// hash map, bumps the record's lease count and policy inputs, and unlocks;
// releasing the lease locks the shard once more. Records are cache-line
// aligned with everything a hit writes in their first line, and each shard's
// mutex, sequence and hit counter share one line, so a hit moves two lines
// between cores when another core touched them last. The shard mutexes spin
// briefly before sleeping (see base::Mutex), because their critical sections
// are shorter than a futex round trip.
//
// Bytes: reserved in the Budget before the loader runs (Budget::Reserve may
// evict, from this cache or its peers, outside every lock), adjusted to the
// real size after (a real size over the whole budget is refused before any
// eviction), returned on failure and when a record is unloaded. When a
// record becomes evictable, or a retired record's last lease ends, while the
// budget is over a shrunken capacity, the budget evicts until usage is back
// within it (Budget::NotifyEvictable).
//
// Events: emitted after the state change they report, outside every lock; a
// callback's exception is caught and counted, so it can never leave a lease
// or a load half done.
//
// Invariants: CheckInvariants() verifies those that a snapshot can show (I1
// to I4, I6, I8, and I5 as "no record being unloaded holds a lease"), and
// the stress and property tests call it after every round and every step;
// the debug build asserts the local ones (a lease count that stays >= 0, one
// order entry per record, the state a transition starts from) where they
// change. I5 over time is also checked by the stress tests' unloaders (one
// that runs while its model is in use fails the test); I7 is a rule about
// when state is dropped, which no snapshot shows: the tests that drop values
// under contention guard it (CacheContract.AWaiterForAnUnloadNeverDrops...).
//   I1. Every map record has the key it is filed under, lives in this shard
//       and is not retired; its state is kLoading, kResident or kUnloading.
//   I2. A record has exactly one order entry iff it is kResident or
//       kUnloading in the map; the entry's key is <= the record's key.
//   I3. Retired records are out of the map and the order; they hold leases,
//       are being unloaded (kUnloading), or their unloader failed.
//   I4. Bytes the budget holds for this cache = sum of resident, unloading
//       and retired sizes + reservations of loads in flight.
//   I5. No record with a lease is ever unloaded.
//   I6. Aliases are one level deep: no alias target is an alias, and each
//       alias slot in a shard map matches the alias table.
//   I7. User-owned state (the value, the unloader) leaves a record under
//       the shard lock and is dropped after it. A record itself may be
//       dropped by whichever holder is last, even under a lock, so it must
//       hold nothing whose destructor is user code by then.
//   I8. Request histories (only for a policy that keeps them) number at most
//       kHistoryKeysPerShard per shard. A time-dependent policy's records
//       are still filed in the order, by access sequence; the victim search
//       ranks them afresh instead of taking the order's first.
//   I9. A shard's running count of evictable bytes (Shard::evictable_bytes)
//       is the sum of the sizes of its evictable records, and a record is
//       counted (counted_evictable) iff it is evictable. The budget's
//       "would evicting make it fit" check reads these counts instead of
//       scanning every record, so it costs the same at 100 resident models
//       as at 100,000.
//   I10. A draining record is kResident, in the map, not retired and not
//       pinned when it is chosen; it takes no lease while it drains, so a
//       set all of whose leases ended stays idle until its waiter evicts
//       it, and a waiter that gives up first has evicted nothing of it.
//
// Locking: shard mutexes are never nested and never held while user code
// runs (loader, unloader, value deleter, event callback) or while the budget
// evicts. The budget's mutex may be taken under a shard mutex (it is a leaf).
// alias_mu_ comes before any shard mutex and is never taken under one.
//
// Files: CacheCore's members are defined by concern. Every transition above
// is in lifecycle.cc (a record's way in: acquire, join, load, fail, lookup)
// and lifecycle_unload.cc (its way out: release, retire, unload, evict,
// remove, expire, prune, shutdown), but a drain's, which are in drain.cc
// (mark, unmark, evict a drained record, queue behind it); victims.cc
// answers the budget's victim search, aliases.cc mutates aliases,
// keep_alive_actions.cc runs the keep-alive driver's actions, introspection.cc
// reports. None of them changes a record's state but through the lifecycle
// (EvictIfEvictable, Prefetch). src/core/CMakeLists.txt lists the files.
#ifndef MODELCACHE_SRC_CORE_CACHE_INTERNAL_H_
#define MODELCACHE_SRC_CORE_CACHE_INTERNAL_H_

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "eviction_order.h"
#include "keep_alive_driver.h"
#include "modelcache/base/mutex.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"
#include "record.h"

namespace modelcache::detail {

// Reports a broken invariant and aborts: the books can no longer be trusted.
[[noreturn]] void InvariantFailed(const char* what, const std::string& key);

#define MC_INVARIANT(cond, what, key)                              \
  do {                                                             \
    if (!(cond)) ::modelcache::detail::InvariantFailed(what, key); \
  } while (0)

inline size_t HashKey(std::string_view key) {
  return std::hash<std::string_view>{}(key);
}

// A key with its hash computed once: it picks the shard and then finds the
// slot without hashing again.
struct HashedKey {
  explicit HashedKey(std::string_view k) : key(k), hash(HashKey(k)) {}
  std::string_view key;
  size_t hash;
};

struct KeyHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return HashKey(s); }
  size_t operator()(const HashedKey& k) const { return k.hash; }
};

struct KeyEqual {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const {
    return a == b;
  }
  bool operator()(const HashedKey& a, std::string_view b) const {
    return a.key == b;
  }
  bool operator()(std::string_view a, const HashedKey& b) const {
    return a == b.key;
  }
};

// Last-use stamps need minutes-scale precision (idle TTLs), not the cost of
// a precise clock read: the coarse monotonic clock is the same clock as
// steady_clock on Linux at a few milliseconds' resolution.
inline Clock::time_point CoarseNow() {
#if defined(CLOCK_MONOTONIC_COARSE)
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
      std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
#else
  return Clock::now();
#endif
}

// Runs an unloader (which may be empty) outside every lock; returns its
// exception, if it threw. The one place user unload code is called.
inline std::exception_ptr CallUnloader(const std::function<void()>& unload) {
  if (!unload) return nullptr;
  try {
    unload();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

struct Slot {
  std::shared_ptr<Record> record;  // null for an alias
  std::string alias_of;
};

struct ShardCounters {
  uint64_t misses = 0, refused = 0, loads = 0, load_failures = 0, evictions = 0,
           expirations = 0, failed_unloads = 0, removals = 0, bytes_loaded = 0;
  double load_seconds = 0;
};

// A hit locks `mu` and bumps `seq` and `hits`: they share the first cache
// line, so a hit moves one shard line between cores, not three. They come
// before `mu` because the mutex's lock word (a pthread_mutex_t) is all a
// release build touches of it: its LockRank, which only debug builds read,
// follows the lock word and may spill into the next line (static_assert
// below).
struct alignas(64) Shard {
  uint64_t seq MC_GUARDED_BY(mu) = 0;
  uint64_t hits MC_GUARDED_BY(mu) = 0;
  // Bytes of the shard's evictable records (resident, unleased, unpinned,
  // not retired): the sum of the sizes of those with counted_evictable.
  // Written under `mu` (a plain load and store, no read-modify-write), read
  // without it by EvictableBytes, which sums the shards: a snapshot, as the
  // budget's check is (budget.h). Beside the hit counter because a hit that
  // takes a model's first lease changes it.
  std::atomic<uint64_t> evictable_bytes{0};
  base::Mutex mu;
  absl::flat_hash_map<std::string, Slot, KeyHash, KeyEqual> map
      MC_GUARDED_BY(mu);
  base::CondVar changed;  // a record of this shard changed state
  EvictionOrder order MC_GUARDED_BY(mu);
  std::unordered_map<Record*, std::shared_ptr<Record>> retired
      MC_GUARDED_BY(mu);
  ShardCounters counters MC_GUARDED_BY(mu);
  // Request histories by key, for a policy that asks for them
  // (EvictionPolicy::history_length() > 0); kept for keys not resident too,
  // at most kHistoryKeysPerShard of them.
  absl::flat_hash_map<std::string, RequestHistory, KeyHash, KeyEqual> history
      MC_GUARDED_BY(mu);
  // What each key's last load took on the budget's clock, kept after it is
  // evicted: a load's expected time, from which the budget's default
  // drain_after is judged (budget.h, kDrainAfterAuto). At most
  // kHistoryKeysPerShard keys; past that it starts afresh (a forgotten key
  // gets the floor).
  absl::flat_hash_map<std::string, std::chrono::nanoseconds, KeyHash, KeyEqual>
      load_times MC_GUARDED_BY(mu);
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(Shard, mu) + sizeof(pthread_mutex_t) <= 64,
              "a hit must touch only the shard's first cache line");
#pragma GCC diagnostic pop

// Bounds the request histories a shard keeps: past it, the half least
// recently requested are forgotten (a forgotten key looks new: it is
// evicted first until it is requested twice).
inline constexpr size_t kHistoryKeysPerShard = 4096;

class CacheCore final : public BudgetMember {
 public:
  explicit CacheCore(CacheOptions options);
  ~CacheCore() override = default;

  void Shutdown();

  Lease Acquire(std::string_view key, uint64_t expected_bytes,
                const Loader& loader, const AcquireOptions& options);
  // A lease if `key` is resident (a hit); otherwise counts a miss only when
  // `count_miss` (Lookup does, TryAcquire leaves it to the Acquire after).
  std::optional<Lease> Lookup(std::string_view key, bool count_miss,
                              double policy_hint);
  RemoveOutcome Remove(std::string_view key, Clock::time_point deadline,
                       bool invalidate);
  void SetPinned(std::string_view key, bool pinned);
  void AddAlias(std::string_view alias, std::string_view canonical);
  bool RemoveAlias(std::string_view alias);
  std::string Resolve(std::string_view key);
  size_t EvictExpired();
  size_t Prune();
  CacheStats Stats();
  std::vector<EntryInfo> Entries();
  std::optional<EntryInfo> Entry(std::string_view key);
  uint64_t CheckInvariants();
  // `request_end`: the lease was a request's, not a Prefetch's own.
  void ReleaseLease(Record* record, bool request_end = true);
  void Prefetch(std::string_view key, uint64_t expected_bytes,
                const Loader& loader, const AcquireOptions& options);
  size_t RunKeepAlive();

  // For the keep-alive driver (keep_alive_driver.h), with no lock held.
  // Evicts `key` (canonical) if it is resident and evictable.
  bool KeepAliveUnload(const std::string& key);
  // Prefetches `key` through CacheOptions::prewarm_source if it is absent:
  // never waiting for room, and evicting only idle models ranked below it
  // when `evict_lower_ranked`, nothing otherwise. Never throws.
  bool KeepAlivePrewarm(const std::string& key, bool evict_lower_ranked);
  int DemandLoadsInFlight() const {
    return demand_loads_.load(std::memory_order_acquire);
  }
  double NowMs() const { return NowSeconds() * 1000.0; }

  Budget& budget() { return *budget_; }
  const std::string& name() const { return options_.name; }

  // BudgetMember.
  bool BestVictim(const std::unordered_set<uint64_t>& skip,
                  VictimCandidate* out) override;
  EvictOutcome TryEvict(const VictimCandidate& victim) override;
  uint64_t EvictableBytes(const std::unordered_set<uint64_t>& skip,
                          double evict_below) override;
  void DescribeHolders(std::vector<std::string>* out,
                       uint64_t exclude) override;
  uint64_t UnevictableBytes() override;
  bool BestDrainVictim(const std::unordered_set<uint64_t>& skip,
                       VictimCandidate* out) override;
  bool SetDraining(const VictimCandidate& victim, bool draining,
                   const std::string& for_what) override;
  DrainState DrainStateOf(const VictimCandidate& victim) override;
  EvictOutcome EvictDrained(const VictimCandidate& victim) override;

 private:
  Shard& ShardFor(std::string_view key) {
    return shards_[ShardIndex(HashKey(key))];
  }
  Shard& ShardFor(const HashedKey& key) {
    return shards_[ShardIndex(key.hash)];
  }
  // High bits pick the shard; the map's buckets use the low ones.
  size_t ShardIndex(size_t hash) const { return (hash >> 40) & shard_mask_; }
  // Calls f(shard, index) for every shard in turn, each under its own mutex
  // and never two at once (shard mutexes are never nested). `f` begins with
  // shard.mu.AssertHeld(): the analysis cannot follow the lock into it.
  template <typename F>
  void ForEachShard(F&& f) {
    for (size_t i = 0; i <= shard_mask_; ++i) {
      Shard& shard = shards_[i];
      base::MutexLock lock(&shard.mu);
      f(shard, i);
    }
  }
  Lease MakeLease(Record* record) { return Lease(this, record); }
  Clock::time_point Now() const {
    return options_.now ? options_.now() : CoarseNow();
  }

  // Resolves `key` through an alias, if it is one.
  std::string_view Canonical(std::string_view key, std::string* storage);

  static bool Evictable(const Record& r) {
    return r.state == RecordState::kResident && !r.retired && r.leases == 0 &&
           !r.pinned && !r.draining;
  }
  // Brings `r`'s share of its shard's running count of evictable bytes in
  // line with Evictable(r). Called after every change of a record's state,
  // lease count, pin or retirement (a size changes only while a record is
  // loading, when it is not evictable). Cheap: one comparison when nothing
  // changed, which is every hit but a model's first lease.
  static void RecountLocked(Shard& shard, Record* r) MC_REQUIRES(shard.mu) {
    const bool evictable = Evictable(*r);
    if (evictable == r->counted_evictable) [[likely]] {
      return;
    }
    r->counted_evictable = evictable;
    const uint64_t count =
        shard.evictable_bytes.load(std::memory_order_relaxed);
    shard.evictable_bytes.store(evictable ? count + r->bytes : count - r->bytes,
                                std::memory_order_relaxed);
  }
  void TouchLocked(Shard& shard, Record* r, double hint = 0)
      MC_REQUIRES(shard.mu);
  // Notes a request for `key` in its history, if the policy keeps them and
  // the call is a request (AcquireOptions::request). Inline: on the hit
  // path of a policy without histories it is one test.
  // `in_progress`: another request for the key was in progress (holding a
  // lease, waiting for a load, or loading it), so no idle time ended.
  void NoteRequestLocked(Shard& shard, std::string_view key, bool request,
                         const std::optional<Clock::time_point>& arrival,
                         bool in_progress) MC_REQUIRES(shard.mu) {
    if (!request) return;
    if (history_length_ > 0) [[unlikely]] {
      RecordRequestLocked(shard, key,
                          arrival ? Seconds(*arrival) : NowSeconds());
    }
    if (keep_alive_) [[unlikely]] {
      keep_alive_->OnRequest(
          key, in_progress, (arrival ? Seconds(*arrival) : NowSeconds()) * 1e3);
    }
  }
  void RecordRequestLocked(Shard& shard, std::string_view key, double seconds)
      MC_REQUIRES(shard.mu);
  // The policy's inputs for `r`, at time `now_seconds` for a time-dependent
  // policy.
  AccessInfo AccessInfoLocked(Shard& shard, const Record& r, double hint,
                              double now_seconds) MC_REQUIRES(shard.mu);
  static double Seconds(Clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  }
  double NowSeconds() const { return Seconds(Now()); }
  void RetireLocked(Shard& shard, const std::shared_ptr<Record>& r)
      MC_REQUIRES(shard.mu);

  // Waits, up to the deadline, until `rec` leaves its current state (a load
  // or an unload in progress), counted among its waiters meanwhile. `rec`
  // must be the caller's own reference, declared before its lock (the map
  // slot it came from may be erased while this waits, and the record must
  // not be dropped under the lock). The interrupt check runs with the shard
  // lock released, as WaitInterrupt says.
  void WaitWhileBusy(Shard& shard, const std::shared_ptr<Record>& rec,
                     const AcquireOptions& options, const char* what)
      MC_REQUIRES(shard.mu);
  // One wait of WaitWhileBusy or WaitWhileDraining for a change of `shard`:
  // until it is signalled, the deadline, or (with an interrupt check) the
  // next `interrupt.every`, when the check runs with the shard lock
  // released. False only when the deadline passed and `still_waiting()`
  // holds; true when the caller should look again. What the check throws
  // leaves with the lock held again and `*waiters` counted down (the
  // caller's count of waiters on the record).
  static bool WaitForChange(Shard& shard, const AcquireOptions& options,
                            int* waiters,
                            const std::function<bool()>& still_waiting)
      MC_REQUIRES(shard.mu);
  // Waits, up to the deadline, while `rec` drains (drain.cc): the acquire
  // queues behind the drain and takes no lease. Stamps `arrival` with the
  // budget's clock if it is unset, so that the acquire keeps its place when
  // it goes on to load.
  void WaitWhileDraining(Shard& shard, const std::shared_ptr<Record>& rec,
                         const AcquireOptions& options,
                         std::optional<Clock::time_point>* arrival)
      MC_REQUIRES(shard.mu);
  // The lowest ranked record for which usable(record) holds, as BestVictim
  // ranks them (victims.cc).
  template <typename Usable>
  bool LowestRanked(Usable&& usable, VictimCandidate* out);
  Lease JoinLoad(Shard& shard, const std::shared_ptr<Record>& rec,
                 const std::shared_future<void>& done,
                 const AcquireOptions& options);
  Lease LoadAsOwner(Shard& shard, const std::shared_ptr<Record>& rec,
                    uint64_t expected_bytes, const Loader& loader,
                    const AcquireOptions& options,
                    const std::optional<Clock::time_point>& arrival);
  void FailLoad(Shard& shard, const std::shared_ptr<Record>& rec,
                std::exception_ptr error, uint64_t reserved, bool loader_threw);
  // A load of `rec` ended, after `seconds` (< 0: it failed): the demand
  // loads in flight and the keep-alive's load times follow.
  void LoadEnded(const Record& rec, double seconds);

  // Runs the unloader of `rec` (state kUnloading) and, on success, erases it
  // and returns its bytes. Returns the unloader's exception on failure, in
  // which case the record is kResident again at its old place.
  std::exception_ptr UnloadResident(Shard& shard,
                                    const std::shared_ptr<Record>& rec,
                                    EventType reason);
  // Unloads a retired record whose last lease ended.
  void FreeRetired(Shard& shard, const std::shared_ptr<Record>& rec);
  // Evicts `rec` if it is still evictable (and, for expiry, still idle).
  EvictOutcome EvictIfEvictable(const std::shared_ptr<Record>& rec,
                                EventType reason,
                                Clock::time_point idle_before);

  // A throwing callback must not unwind through the cache: the event is
  // emitted after the state change it reports, and a lease or a load
  // abandoned halfway would leave books nobody can fix.
  void Emit(CacheEvent event) {
    if (!options_.on_event) return;
    try {
      options_.on_event(event);
    } catch (...) {
      callback_errors_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // Throws kFailedPrecondition if this thread is running `r`'s loader or
  // unloader, which `what` would otherwise wait for forever.
  void CheckNotOwnThread(const Record& r, const char* what) const;
  bool Observed() const { return static_cast<bool>(options_.on_event); }

  const CacheOptions options_;
  const std::shared_ptr<Budget> budget_;
  const std::shared_ptr<const EvictionPolicy> policy_;
  const bool policy_monotone_;
  const size_t history_length_;       // policy_->history_length()
  const bool policy_time_dependent_;  // policy_->time_dependent()
  const size_t shard_mask_;
  std::unique_ptr<Shard[]> shards_;
  std::atomic<bool> shut_down_{false};
  std::atomic<uint64_t> callback_errors_{0};
  // Loads started by a request and not yet ended.
  std::atomic<int> demand_loads_{0};
  std::atomic<uint64_t> prewarms_{0};
  // Null without CacheOptions::keep_alive. Created last and stopped first.
  std::unique_ptr<KeepAliveDriver> keep_alive_;

  // Alias mutations are serialised here so that the checks that keep
  // aliases one level deep (no target is an alias, no alias is a target)
  // and the insertion of the alias's slot happen as one step. Lock order:
  // alias_mu_, then a shard mutex. Lookups never take it: they read the
  // alias slots in the shard maps.
  base::Mutex alias_mu_;
  // alias -> canonical, and canonical -> its aliases.
  absl::flat_hash_map<std::string, std::string> alias_target_
      MC_GUARDED_BY(alias_mu_);
  absl::flat_hash_map<std::string, std::vector<std::string>> aliases_of_
      MC_GUARDED_BY(alias_mu_);
};

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_CACHE_INTERNAL_H_
