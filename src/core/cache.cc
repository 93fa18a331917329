// ModelCache implementation.
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
// Eviction order: an ordered set of (priority, seq, record) per shard. A hit
// only updates the record's own (priority, seq); its set entry is re-sorted
// lazily when an eviction scan reaches it. Policies guarantee that a record's
// key never decreases, so the first evictable entry whose key is current is
// the true minimum. Nothing is ever removed from the set except when its
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
// record becomes evictable while the budget is over a shrunken capacity, the
// budget evicts until usage is back within it (Budget::NotifyEvictable).
//
// Events: emitted after the state change they report, outside every lock; a
// callback's exception is caught and counted, so it can never leave a lease
// or a load half done.
//
// Invariants (CheckInvariants, and asserted in debug builds):
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
//
// Locking: shard mutexes are never nested and never held while user code
// runs (loader, unloader, value deleter, event callback) or while the budget
// evicts. The budget's mutex may be taken under a shard mutex (it is a leaf).
// alias_mu_ comes before any shard mutex and is never taken under one.
#include "modelcache/core/cache.h"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "format.h"
#include "modelcache/base/mutex.h"
#include "test_hooks.h"

namespace modelcache {
namespace detail {
namespace {

std::atomic<uint64_t> next_record_id{1};

[[noreturn]] void InvariantFailed(const char* what, const std::string& key) {
  std::fprintf(stderr, "modelcache: invariant violated: %s (key '%s')\n", what,
               key.c_str());
  std::abort();
}

#define MC_CHECK(cond, what, key)            \
  do {                                       \
    if (!(cond)) InvariantFailed(what, key); \
  } while (0)

size_t HashKey(std::string_view key) {
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
// a precise clock read on every hit: the coarse monotonic clock is the same
// clock as steady_clock on Linux at a few milliseconds' resolution.
Clock::time_point CoarseNow() {
#if defined(CLOCK_MONOTONIC_COARSE)
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
      std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
#else
  return Clock::now();
#endif
}

}  // namespace

enum class RecordState { kLoading, kResident, kUnloading, kGone, kFailed };

// Fields are guarded by the mutex of shard `shard` (one mutex per shard; the
// analysis cannot name it from here, so the rule is checked by review and by
// CheckInvariants). `key`, `id`, `shard` are immutable. `value`, `bytes` are
// not modified while a lease exists, which is what lets Lease read them
// without a lock.
//
// Layout: a hit reads and writes only the first cache line (state, flags,
// lease count, the policy's inputs, priority and sequence), and records are
// cache-line aligned so that no other allocation shares that line. Two
// threads hitting different models then never contend for a line, and a
// thread hitting a model last touched by another core moves one line, not
// three.
struct alignas(64) Record {
  Record(std::string k, uint64_t i, uint32_t s)
      : key(std::move(k)), id(i), shard(s) {}

  // ---- hot: read and written by every hit and lease release ----
  RecordState state = RecordState::kLoading;
  bool retired = false;
  bool pinned = false;
  bool stale = false;          // invalidated while loading
  bool unload_failed = false;  // retired record whose unloader threw
  bool in_order = false;
  int leases = 0;
  uint64_t bytes = 0;  // reserved while loading, resident size after
  uint64_t accesses = 0;
  double load_seconds = 0;
  double priority = 0;  // current order key
  uint64_t seq = 0;
  Clock::time_point last_use{};

  // ---- cold ----
  double order_priority = 0;  // key of its entry in the order set
  uint64_t order_seq = 0;
  const std::string key;
  const uint64_t id;
  const uint32_t shard;
  int waiters = 0;         // acquires waiting for this record's load
  int unload_waiters = 0;  // callers waiting for its unload to finish
  // The thread running this record's loader (kLoading) or unloader
  // (kUnloading); meaningless in other states. A call from that thread that
  // would wait for this record would wait for itself: it fails instead.
  std::thread::id owner;
  std::shared_ptr<void> value;
  std::function<void()> unload;
  // The load's outcome, for its waiters: `error` (null on success) is set
  // before Complete() and never changes after it.
  std::exception_ptr error;
  std::atomic<bool> completed{false};
  // Made by the first waiter only (most loads have none); completed by the
  // load, which reads it after the state change that stops new waiters.
  std::shared_ptr<std::promise<void>> done_promise;
  std::shared_future<void> done;
  void Complete(const std::shared_ptr<std::promise<void>>& promise) {
    completed.store(true, std::memory_order_release);
    if (promise) promise->set_value();
  }
};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(Record, last_use) + sizeof(Clock::time_point) <= 64,
              "a hit must touch only the record's first cache line");
#pragma GCC diagnostic pop

struct OrderKey {
  double priority;
  uint64_t seq;
  Record* record;
  bool operator<(const OrderKey& o) const {
    if (priority != o.priority) return priority < o.priority;
    if (seq != o.seq) return seq < o.seq;
    return record < o.record;
  }
};

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
// line, so a hit moves one shard line between cores, not three.
struct alignas(64) Shard {
  base::Mutex mu;
  uint64_t seq MC_GUARDED_BY(mu) = 0;
  uint64_t hits MC_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<std::string, Slot, KeyHash, KeyEqual> map
      MC_GUARDED_BY(mu);
  base::CondVar changed;  // a record of this shard changed state
  std::set<OrderKey> order MC_GUARDED_BY(mu);
  std::unordered_map<Record*, std::shared_ptr<Record>> retired
      MC_GUARDED_BY(mu);
  ShardCounters counters MC_GUARDED_BY(mu);
};

class CacheCore final : public BudgetMember,
                        public std::enable_shared_from_this<CacheCore> {
 public:
  explicit CacheCore(CacheOptions options);
  ~CacheCore() override = default;

  void Shutdown();

  Lease Acquire(std::string_view key, uint64_t expected_bytes,
                const Loader& loader, const AcquireOptions& options);
  std::optional<Lease> Lookup(std::string_view key);
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
  void ReleaseLease(Record* record);

  Budget& budget() { return *budget_; }
  const std::string& name() const { return options_.name; }

  // BudgetMember.
  bool BestVictim(const std::unordered_set<uint64_t>& skip,
                  VictimCandidate* out) override;
  EvictOutcome TryEvict(const VictimCandidate& victim) override;
  void DescribeHolders(std::vector<std::string>* out) override;
  uint64_t UnevictableBytes() override;

 private:
  Shard& ShardFor(std::string_view key) {
    return shards_[ShardIndex(HashKey(key))];
  }
  Shard& ShardFor(const HashedKey& key) {
    return shards_[ShardIndex(key.hash)];
  }
  // High bits pick the shard; the map's buckets use the low ones.
  size_t ShardIndex(size_t hash) const { return (hash >> 40) & shard_mask_; }
  Lease MakeLease(Record* record) { return Lease(this, record); }
  Clock::time_point Now() const {
    return options_.now ? options_.now() : CoarseNow();
  }

  // Resolves `key` through an alias, if it is one.
  std::string_view Canonical(std::string_view key, std::string* storage);

  static bool Evictable(const Record& r) {
    return r.state == RecordState::kResident && !r.retired && r.leases == 0 &&
           !r.pinned;
  }
  void TouchLocked(Shard& shard, Record* r, double hint = 0)
      MC_REQUIRES(shard.mu);
  void InsertOrderLocked(Shard& shard, Record* r) MC_REQUIRES(shard.mu);
  void EraseOrderLocked(Shard& shard, Record* r) MC_REQUIRES(shard.mu);
  void RetireLocked(Shard& shard, const std::shared_ptr<Record>& r)
      MC_REQUIRES(shard.mu);

  // Waits, up to `deadline`, until `rec` leaves its current state (a load
  // or an unload in progress), counted among its waiters meanwhile. Takes
  // its own reference: the map slot the caller found it in may be erased
  // while this waits.
  void WaitWhileBusy(Shard& shard, std::shared_ptr<Record> rec,
                     Clock::time_point deadline, const char* what)
      MC_REQUIRES(shard.mu);
  Lease JoinLoad(Shard& shard, const std::shared_ptr<Record>& rec,
                 const std::shared_future<void>& done,
                 Clock::time_point deadline);
  Lease LoadAsOwner(Shard& shard, const std::shared_ptr<Record>& rec,
                    uint64_t expected_bytes, const Loader& loader,
                    const AcquireOptions& options);
  void FailLoad(Shard& shard, const std::shared_ptr<Record>& rec,
                std::exception_ptr error, uint64_t reserved, bool loader_threw);

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
  const size_t shard_mask_;
  std::unique_ptr<Shard[]> shards_;
  std::atomic<bool> shut_down_{false};
  std::atomic<uint64_t> callback_errors_{0};

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

CacheCore::CacheCore(CacheOptions options)
    : options_(std::move(options)),
      budget_(options_.budget ? options_.budget
                              : std::make_shared<Budget>(
                                    options_.capacity_bytes, options_.name)),
      policy_(options_.policy ? options_.policy : NewLruPolicy()),
      policy_monotone_(policy_->monotone()),
      shard_mask_((size_t{1} << std::clamp(options_.shard_bits, 0, 12)) - 1),
      shards_(new Shard[shard_mask_ + 1]) {}

std::string_view CacheCore::Canonical(std::string_view key,
                                      std::string* storage) {
  Shard& shard = ShardFor(key);
  base::MutexLock lock(&shard.mu);
  auto it = shard.map.find(key);
  if (it == shard.map.end() || it->second.record) return key;
  *storage = it->second.alias_of;
  return *storage;
}

void CacheCore::TouchLocked(Shard& shard, Record* r, double hint) {
  ++r->accesses;
  r->priority = policy_->Priority(
      AccessInfo{r->bytes, r->accesses, r->load_seconds, hint},
      budget_->policy_clock());
  r->seq = ++shard.seq;
  if (!policy_monotone_ && r->in_order) {
    // The new key may be smaller than the filed one: re-file it now.
    EraseOrderLocked(shard, r);
    InsertOrderLocked(shard, r);
  }
}

void CacheCore::InsertOrderLocked(Shard& shard, Record* r) {
  assert(!r->in_order);
  r->order_priority = r->priority;
  r->order_seq = r->seq;
  shard.order.insert(OrderKey{r->priority, r->seq, r});
  r->in_order = true;
}

void CacheCore::EraseOrderLocked(Shard& shard, Record* r) {
  if (!r->in_order) return;
  const size_t erased =
      shard.order.erase(OrderKey{r->order_priority, r->order_seq, r});
  assert(erased == 1);
  (void)erased;
  r->in_order = false;
}

void CacheCore::RetireLocked(Shard& shard, const std::shared_ptr<Record>& r) {
  EraseOrderLocked(shard, r.get());
  auto it = shard.map.find(r->key);
  assert(it != shard.map.end() && it->second.record == r);
  shard.map.erase(it);
  r->retired = true;
  shard.retired.emplace(r.get(), r);
  ++shard.counters.removals;
}

void CacheCore::CheckNotOwnThread(const Record& r, const char* what) const {
  if ((r.state != RecordState::kLoading &&
       r.state != RecordState::kUnloading) ||
      r.owner != std::this_thread::get_id()) {
    return;
  }
  throw Error(ErrorCode::kFailedPrecondition,
              std::string(what) + " '" + r.key + "' in cache '" +
                  options_.name + "' from its own " +
                  (r.state == RecordState::kLoading ? "loader" : "unloader") +
                  ": it would wait for itself");
}

Lease CacheCore::Acquire(std::string_view key, uint64_t expected_bytes,
                         const Loader& loader, const AcquireOptions& options) {
  std::string alias_target;
  for (;;) {
    const HashedKey hashed(key);
    Shard& shard = ShardFor(hashed);
    std::shared_ptr<Record> owned;   // set when this call becomes the loader
    std::shared_ptr<Record> joined;  // set when it waits for another's load
    std::shared_future<void> done;   // completed with `joined`'s load
    {
      base::MutexLock lock(&shard.mu);
      auto it = shard.map.find(hashed);
      if (it == shard.map.end()) {
        owned = std::make_shared<Record>(
            std::string(key), next_record_id++,
            static_cast<uint32_t>(&shard - shards_.get()));
        owned->owner = std::this_thread::get_id();
        shard.map.emplace(owned->key, Slot{owned, {}});
        ++shard.counters.misses;
      } else if (!it->second.record) {
        alias_target = it->second.alias_of;
      } else {
        Record* r = it->second.record.get();
        switch (r->state) {
          case RecordState::kResident:
            TouchLocked(shard, r, options.policy_hint);
            ++r->leases;
            ++shard.hits;
            return MakeLease(r);
          case RecordState::kLoading:
            CheckNotOwnThread(*r, "acquired");
            if (r->stale) {
              // Invalidated while loading: this acquire came after the
              // invalidation, so it must not receive the stale model. Wait
              // for that load to end (it is then retired), then load afresh.
              WaitWhileBusy(shard, it->second.record, options.deadline,
                            "the invalidated load of");
              continue;
            }
            // Join the load in flight; its completion grants us a lease.
            joined = it->second.record;
            if (!joined->done_promise) {
              joined->done_promise = std::make_shared<std::promise<void>>();
              joined->done = joined->done_promise->get_future().share();
            }
            done = joined->done;
            ++joined->waiters;
            ++shard.counters.misses;
            break;
          case RecordState::kUnloading:
            // An eviction or removal is running its unloader: wait for the
            // outcome, then look again.
            CheckNotOwnThread(*r, "acquired");
            WaitWhileBusy(shard, it->second.record, options.deadline,
                          "the unload of");
            continue;
          case RecordState::kGone:
          case RecordState::kFailed:
            InvariantFailed("a gone record is still in the map", r->key);
        }
      }
    }
    if (owned) {
      return LoadAsOwner(shard, owned, expected_bytes, loader, options);
    }
    if (joined) return JoinLoad(shard, joined, done, options.deadline);
    // An alias: look the canonical key up. Targets are never aliases, but
    // an alias re-pointed between two lookups could be met again; the
    // deadline bounds even that.
    if (options.deadline != Clock::time_point::max() &&
        Clock::now() >= options.deadline) {
      throw Error(ErrorCode::kTimeout,
                  "timed out resolving '" + std::string(key) + "'");
    }
    key = alias_target;
  }
}

void CacheCore::WaitWhileBusy(Shard& shard, std::shared_ptr<Record> rec,
                              Clock::time_point deadline, const char* what) {
  const RecordState busy = rec->state;
  ++rec->unload_waiters;
  while (rec->state == busy) {
    if (!shard.changed.WaitUntil(&shard.mu, deadline) && rec->state == busy) {
      --rec->unload_waiters;
      throw Error(
          ErrorCode::kTimeout,
          "timed out waiting for " + std::string(what) + " '" + rec->key + "'");
    }
  }
  --rec->unload_waiters;
}

Lease CacheCore::JoinLoad(Shard& shard, const std::shared_ptr<Record>& rec,
                          const std::shared_future<void>& done,
                          Clock::time_point deadline) {
  // Waits without the shard lock, so that when a load completes its waiters
  // wake in parallel rather than queueing on the mutex one by one.
  const bool ready =
      deadline == Clock::time_point::max()
          ? (done.wait(), true)
          : done.wait_until(deadline) == std::future_status::ready;
  if (!ready) {
    base::MutexLock lock(&shard.mu);
    if (rec->state == RecordState::kLoading) {
      --rec->waiters;
      throw Error(ErrorCode::kTimeout,
                  "timed out waiting for the load of '" + rec->key + "'");
    }
    // It completed as the deadline passed (Complete() may not have run yet,
    // but the outcome is visible under the lock): the lease granted to us
    // stands, or the load's error is ours too.
    if (rec->error) std::rethrow_exception(rec->error);
    return MakeLease(rec.get());
  }
  // The outcome was published before `done` became ready; this acquire makes
  // that visible to ThreadSanitizer too, which cannot see inside the future.
  const bool completed = rec->completed.load(std::memory_order_acquire);
  assert(completed);
  (void)completed;
  if (rec->error) std::rethrow_exception(rec->error);
  return MakeLease(rec.get());  // granted when the load completed
}

Lease CacheCore::LoadAsOwner(Shard& shard, const std::shared_ptr<Record>& rec,
                             uint64_t expected_bytes, const Loader& loader,
                             const AcquireOptions& options) {
  if (options_.idle_ttl.count() > 0) EvictExpired();
  try {
    budget_->Reserve(expected_bytes, options.when_full, options.deadline);
  } catch (...) {
    FailLoad(shard, rec, std::current_exception(), 0, false);
    throw;
  }
  {
    base::MutexLock lock(&shard.mu);
    rec->bytes = expected_bytes;
  }

  const auto start = Clock::now();
  Loaded loaded;
  try {
    loaded = loader();
  } catch (...) {
    FailLoad(shard, rec, std::current_exception(), expected_bytes, true);
    throw;
  }
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();

  // Adjust the reservation to the real size. A real size over the whole
  // budget can never fit: Reserve refuses it before evicting anything.
  if (loaded.bytes > expected_bytes) {
    try {
      budget_->Reserve(loaded.bytes - expected_bytes, options.when_full,
                       options.deadline, /*already_reserved=*/expected_bytes);
    } catch (const Error& e) {
      auto error = std::current_exception();
      if (e.code() == ErrorCode::kTooLarge) {
        error = std::make_exception_ptr(
            Error(ErrorCode::kTooLarge,
                  "'" + rec->key + "' loaded at " + FormatBytes(loaded.bytes) +
                      " (expected " + FormatBytes(expected_bytes) +
                      "), more than the whole budget: " + e.what()));
      }
      try {
        if (loaded.unload) loaded.unload();
      } catch (...) {
        // The load is refused either way; its own cleanup error is secondary.
      }
      loaded.value.reset();
      FailLoad(shard, rec, error, expected_bytes, false);
      std::rethrow_exception(error);
    } catch (...) {
      auto error = std::current_exception();
      try {
        if (loaded.unload) loaded.unload();
      } catch (...) {
        // The load is refused either way; its own cleanup error is secondary.
      }
      loaded.value.reset();
      FailLoad(shard, rec, error, expected_bytes, false);
      throw;
    }
  } else if (loaded.bytes < expected_bytes) {
    budget_->Release(expected_bytes - loaded.bytes);
  }

  bool retired_now = false;
  std::shared_ptr<std::promise<void>> waiters_promise;
  {
    base::MutexLock lock(&shard.mu);
    assert(rec->state == RecordState::kLoading && rec->leases == 0);
    waiters_promise = rec->done_promise;
    rec->state = RecordState::kResident;
    rec->bytes = loaded.bytes;
    rec->value = std::move(loaded.value);
    rec->unload = std::move(loaded.unload);
    rec->load_seconds = seconds;
    // One lease for this caller and one for every waiter, granted together
    // with residency so that nothing can evict the model before they use it.
    rec->leases = 1 + rec->waiters;
    rec->accesses = static_cast<uint64_t>(rec->waiters);
    rec->waiters = 0;  // each of them now holds its lease
    TouchLocked(shard, rec.get(), options.policy_hint);
    rec->last_use = Now();
    ++shard.counters.loads;
    shard.counters.bytes_loaded += rec->bytes;
    shard.counters.load_seconds += seconds;
    budget_->policy_clock().epoch.fetch_add(1, std::memory_order_relaxed);
    if (rec->stale) {
      RetireLocked(shard, rec);
      retired_now = true;
    } else {
      InsertOrderLocked(shard, rec.get());
    }
  }
  if (auto hook = after_load_published.load(std::memory_order_acquire)) {
    hook(rec->key);
  }
  rec->Complete(waiters_promise);
  shard.changed.NotifyAll();
  Lease lease = MakeLease(rec.get());
  if (Observed()) {
    Emit({EventType::kLoaded, rec->key, rec->bytes, seconds, {}});
    if (retired_now) Emit({EventType::kRetired, rec->key, rec->bytes, 0, {}});
  }
  return lease;
}

void CacheCore::FailLoad(Shard& shard, const std::shared_ptr<Record>& rec,
                         std::exception_ptr error, uint64_t reserved,
                         bool loader_threw) {
  // Read the exception before waiters can see it: once they are woken,
  // they may rethrow and free it on their own threads.
  std::string message;
  if (Observed() && loader_threw) message = DescribeException(error);
  std::shared_ptr<std::promise<void>> waiters_promise;
  {
    base::MutexLock lock(&shard.mu);
    waiters_promise = rec->done_promise;
    auto it = shard.map.find(rec->key);
    assert(it != shard.map.end() && it->second.record == rec);
    shard.map.erase(it);
    rec->state = RecordState::kFailed;
    rec->error = error;
    rec->bytes = 0;
    rec->waiters = 0;  // each of them rethrows `error`
    if (loader_threw) {
      ++shard.counters.load_failures;
    } else {
      ++shard.counters.refused;
    }
  }
  rec->Complete(waiters_promise);
  shard.changed.NotifyAll();
  budget_->Release(reserved);
  if (Observed() && loader_threw) {
    Emit({EventType::kLoadFailed, rec->key, 0, 0, std::move(message)});
  }
}

std::optional<Lease> CacheCore::Lookup(std::string_view key) {
  std::string storage;
  key = Canonical(key, &storage);
  Shard& shard = ShardFor(key);
  base::MutexLock lock(&shard.mu);
  auto it = shard.map.find(key);
  if (it == shard.map.end() || !it->second.record ||
      it->second.record->state != RecordState::kResident) {
    ++shard.counters.misses;
    return std::nullopt;
  }
  Record* r = it->second.record.get();
  TouchLocked(shard, r);
  ++r->leases;
  ++shard.hits;
  return MakeLease(r);
}

void CacheCore::ReleaseLease(Record* r) {
  Shard& shard = shards_[r->shard];
  std::shared_ptr<Record> to_free;
  bool now_evictable = false;
  {
    base::MutexLock lock(&shard.mu);
    assert(r->leases > 0);
    if (--r->leases == 0) {
      if (r->retired) {
        auto it = shard.retired.find(r);
        assert(it != shard.retired.end());
        to_free = it->second;
        r->state = RecordState::kUnloading;
        r->owner = std::this_thread::get_id();
      } else {
        // Idle from now: an idle TTL counts from the end of the last lease.
        // (Only here and at the load: a hit leaves a lease, so stamping it
        // too would add a clock read to every hit and change nothing an
        // expiry can see.)
        r->last_use = Now();
        now_evictable = !r->pinned;
      }
    }
  }
  if (to_free) {
    FreeRetired(shard, to_free);
  } else if (now_evictable) {
    budget_->NotifyEvictable();
  }
}

void CacheCore::FreeRetired(Shard& shard, const std::shared_ptr<Record>& rec) {
  std::exception_ptr error;
  try {
    if (rec->unload) rec->unload();
  } catch (...) {
    error = std::current_exception();
  }
  std::shared_ptr<void> value;
  uint64_t bytes = 0;
  {
    base::MutexLock lock(&shard.mu);
    if (error) {
      // Keep it counted; Prune() tries again.
      rec->state = RecordState::kResident;
      rec->unload_failed = true;
      ++shard.counters.failed_unloads;
    } else {
      shard.retired.erase(rec.get());
      rec->state = RecordState::kGone;
      value = std::move(rec->value);
      bytes = rec->bytes;
    }
  }
  if (error) {
    if (Observed()) {
      Emit({EventType::kUnloadFailed, rec->key, rec->bytes, 0,
            DescribeException(error)});
    }
    return;
  }
  value.reset();
  budget_->Release(bytes);
  if (Observed()) Emit({EventType::kRetiredFreed, rec->key, bytes, 0, {}});
}

std::exception_ptr CacheCore::UnloadResident(Shard& shard,
                                             const std::shared_ptr<Record>& rec,
                                             EventType reason) {
  std::exception_ptr error;
  try {
    if (rec->unload) rec->unload();
  } catch (...) {
    error = std::current_exception();
  }
  std::shared_ptr<void> value;
  uint64_t bytes = 0;
  double priority = 0;
  {
    base::MutexLock lock(&shard.mu);
    assert(rec->state == RecordState::kUnloading && rec->leases == 0);
    if (error) {
      rec->state = RecordState::kResident;  // its order entry never moved
      ++shard.counters.failed_unloads;
    } else {
      EraseOrderLocked(shard, rec.get());
      auto it = shard.map.find(rec->key);
      assert(it != shard.map.end() && it->second.record == rec);
      shard.map.erase(it);
      rec->state = RecordState::kGone;
      value = std::move(rec->value);
      bytes = rec->bytes;
      priority = rec->priority;
      switch (reason) {
        case EventType::kExpired:
          ++shard.counters.expirations;
          break;
        case EventType::kRemoved:
          ++shard.counters.removals;
          break;
        default:
          ++shard.counters.evictions;
          break;
      }
    }
  }
  shard.changed.NotifyAll();
  if (error) {
    if (Observed()) {
      Emit({EventType::kUnloadFailed, rec->key, rec->bytes, 0,
            DescribeException(error)});
    }
    return error;
  }
  value.reset();
  budget_->Release(bytes);
  if (reason != EventType::kRemoved) {
    PolicyClock& clock = budget_->policy_clock();
    policy_->OnEvict(priority, clock);
    clock.epoch.fetch_add(1, std::memory_order_relaxed);
  }
  if (Observed()) Emit({reason, rec->key, bytes, 0, {}});
  return nullptr;
}

bool CacheCore::BestVictim(const std::unordered_set<uint64_t>& skip,
                           VictimCandidate* out) {
  bool found = false;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    for (auto it = shard.order.begin(); it != shard.order.end();) {
      Record* r = it->record;
      if (it->priority != r->priority || it->seq != r->seq) {
        // Touched since it was filed: re-file it at its current key, which
        // is larger than the old one but may still precede `next`, so the
        // scan resumes from whichever of the two comes first.
        auto next = std::next(it);
        auto node = shard.order.extract(it);
        node.value() = OrderKey{r->priority, r->seq, r};
        r->order_priority = r->priority;
        r->order_seq = r->seq;
        auto refiled = shard.order.insert(std::move(node)).position;
        it = (next == shard.order.end() || *refiled < *next) ? refiled : next;
        continue;
      }
      if (!Evictable(*r) || skip.count(r->id) > 0) {
        ++it;
        continue;
      }
      if (!found || r->priority < out->priority ||
          (r->priority == out->priority && r->seq < out->seq)) {
        auto owner = shard.map.find(r->key)->second.record;
        out->priority = r->priority;
        out->seq = r->seq;
        out->record_id = r->id;
        out->handle = std::shared_ptr<void>(owner, owner.get());
        found = true;
      }
      break;  // the first current, evictable entry is this shard's best
    }
  }
  return found;
}

EvictOutcome CacheCore::TryEvict(const VictimCandidate& victim) {
  auto rec = std::static_pointer_cast<Record>(victim.handle);
  return EvictIfEvictable(rec, EventType::kEvicted, Clock::time_point::max());
}

EvictOutcome CacheCore::EvictIfEvictable(const std::shared_ptr<Record>& rec,
                                         EventType reason,
                                         Clock::time_point idle_before) {
  Shard& shard = shards_[rec->shard];
  {
    base::MutexLock lock(&shard.mu);
    if (!Evictable(*rec) || rec->last_use >= idle_before) {
      return EvictOutcome::kChanged;
    }
    rec->state = RecordState::kUnloading;
    rec->owner = std::this_thread::get_id();
  }
  return UnloadResident(shard, rec, reason) ? EvictOutcome::kUnloadFailed
                                            : EvictOutcome::kEvicted;
}

void CacheCore::DescribeHolders(std::vector<std::string>* out) {
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    auto describe = [&](const Record& r) {
      std::string why;
      if (r.state == RecordState::kLoading) why = "loading";
      if (r.state == RecordState::kUnloading) why = "unloading";
      if (r.leases > 0) {
        why += (why.empty() ? "" : ", ") + std::to_string(r.leases) +
               (r.leases == 1 ? " lease" : " leases");
      }
      if (r.pinned) why += (why.empty() ? "" : ", ") + std::string("pinned");
      if (r.retired) why += (why.empty() ? "" : ", ") + std::string("retired");
      if (r.unload_failed) why += ", unload failed";
      if (why.empty()) why = "evictable";
      out->push_back("'" + r.key + "' (" + FormatBytes(r.bytes) + ", " + why +
                     ")");
    };
    for (const auto& [key, slot] : shard.map) {
      if (slot.record) describe(*slot.record);
    }
    for (const auto& [ptr, rec] : shard.retired) describe(*rec);
  }
}

uint64_t CacheCore::UnevictableBytes() {
  uint64_t bytes = 0;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    for (const auto& [key, slot] : shard.map) {
      if (slot.record && !Evictable(*slot.record)) bytes += slot.record->bytes;
    }
    for (const auto& [ptr, rec] : shard.retired) bytes += rec->bytes;
  }
  return bytes;
}

RemoveOutcome CacheCore::Remove(std::string_view key,
                                Clock::time_point deadline, bool invalidate) {
  std::string storage;
  key = Canonical(key, &storage);
  Shard& shard = ShardFor(key);
  std::shared_ptr<Record> rec;
  bool retired = false;
  {
    base::MutexLock lock(&shard.mu);
    for (;;) {
      auto it = shard.map.find(key);
      if (it == shard.map.end() || !it->second.record) {
        return RemoveOutcome::kNotFound;
      }
      rec = it->second.record;
      if (rec->state == RecordState::kLoading && invalidate) {
        rec->stale = true;  // retired the moment its load completes
        return RemoveOutcome::kRetired;
      }
      CheckNotOwnThread(*rec, invalidate ? "invalidated" : "removed");
      if (rec->state == RecordState::kLoading ||
          rec->state == RecordState::kUnloading) {
        // Serialised after the mutation in progress.
        ++rec->unload_waiters;
        const bool notified = shard.changed.WaitUntil(&shard.mu, deadline);
        --rec->unload_waiters;
        if (!notified && (rec->state == RecordState::kLoading ||
                          rec->state == RecordState::kUnloading)) {
          throw Error(ErrorCode::kTimeout,
                      "timed out waiting to remove '" + rec->key + "'");
        }
        continue;
      }
      assert(rec->state == RecordState::kResident);
      if (rec->leases > 0) {
        RetireLocked(shard, rec);
        retired = true;
      } else {
        rec->state = RecordState::kUnloading;
        rec->owner = std::this_thread::get_id();
      }
      break;
    }
  }
  if (retired) {
    if (Observed()) Emit({EventType::kRetired, rec->key, rec->bytes, 0, {}});
    return RemoveOutcome::kRetired;
  }
  if (auto error = UnloadResident(shard, rec, EventType::kRemoved)) {
    std::rethrow_exception(error);
  }
  return RemoveOutcome::kRemoved;
}

void CacheCore::SetPinned(std::string_view key, bool pinned) {
  std::string storage;
  key = Canonical(key, &storage);
  Shard& shard = ShardFor(key);
  bool now_evictable = false;
  {
    base::MutexLock lock(&shard.mu);
    auto it = shard.map.find(key);
    if (it == shard.map.end() || !it->second.record ||
        it->second.record->state != RecordState::kResident) {
      throw Error(ErrorCode::kNotFound,
                  "cannot " + std::string(pinned ? "pin" : "unpin") + " '" +
                      std::string(key) + "': not resident in cache '" +
                      options_.name + "'");
    }
    Record* r = it->second.record.get();
    now_evictable = r->pinned && !pinned && r->leases == 0;
    r->pinned = pinned;
  }
  if (now_evictable) budget_->NotifyEvictable();
}

void CacheCore::AddAlias(std::string_view alias, std::string_view canonical) {
  const std::string alias_key(alias);
  const std::string canonical_key(canonical);
  if (alias == canonical) {
    throw Error(ErrorCode::kInvalidArgument,
                "alias '" + alias_key + "' names itself");
  }
  base::MutexLock aliases(&alias_mu_);
  if (auto it = alias_target_.find(canonical_key); it != alias_target_.end()) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot alias '" + alias_key + "' to '" + canonical_key +
                    "': '" + canonical_key + "' is itself an alias of '" +
                    it->second + "'");
  }
  if (auto it = aliases_of_.find(alias_key); it != aliases_of_.end()) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot make '" + alias_key + "' an alias: alias '" +
                    it->second.front() + "' names it");
  }
  {
    Shard& shard = ShardFor(alias);
    base::MutexLock lock(&shard.mu);
    auto it = shard.map.find(alias);
    if (it != shard.map.end() && it->second.record) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "cannot alias '" + alias_key + "': a model is loaded under that key");
    }
    if (it == shard.map.end()) {
      shard.map.emplace(alias_key, Slot{nullptr, canonical_key});
    } else {
      it->second.alias_of = canonical_key;
    }
  }
  if (auto old = alias_target_.find(alias_key); old != alias_target_.end()) {
    auto& names = aliases_of_[old->second];
    std::erase(names, alias_key);
    if (names.empty()) aliases_of_.erase(old->second);
  }
  alias_target_[alias_key] = canonical_key;
  aliases_of_[canonical_key].push_back(alias_key);
}

bool CacheCore::RemoveAlias(std::string_view alias) {
  const std::string alias_key(alias);
  base::MutexLock aliases(&alias_mu_);
  auto target = alias_target_.find(alias_key);
  if (target == alias_target_.end()) return false;
  {
    Shard& shard = ShardFor(alias);
    base::MutexLock lock(&shard.mu);
    auto it = shard.map.find(alias);
    assert(it != shard.map.end() && !it->second.record);
    shard.map.erase(it);
  }
  auto& names = aliases_of_[target->second];
  std::erase(names, alias_key);
  if (names.empty()) aliases_of_.erase(target->second);
  alias_target_.erase(target);
  return true;
}

std::string CacheCore::Resolve(std::string_view key) {
  std::string storage;
  return std::string(Canonical(key, &storage));
}

size_t CacheCore::EvictExpired() {
  if (options_.idle_ttl.count() <= 0) return 0;
  const Clock::time_point idle_before =
      Now() - std::chrono::duration_cast<Clock::duration>(options_.idle_ttl);
  std::vector<std::shared_ptr<Record>> expired;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    for (const auto& [key, slot] : shard.map) {
      if (slot.record && Evictable(*slot.record) &&
          slot.record->last_use < idle_before) {
        expired.push_back(slot.record);
      }
    }
  }
  size_t evicted = 0;
  for (const auto& rec : expired) {
    if (EvictIfEvictable(rec, EventType::kExpired, idle_before) ==
        EvictOutcome::kEvicted) {
      ++evicted;
    }
  }
  return evicted;
}

size_t CacheCore::Prune() {
  std::vector<std::shared_ptr<Record>> victims;
  std::vector<std::pair<Shard*, std::shared_ptr<Record>>> failed_retired;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    for (const auto& [key, slot] : shard.map) {
      if (slot.record && Evictable(*slot.record))
        victims.push_back(slot.record);
    }
    for (const auto& [ptr, rec] : shard.retired) {
      if (rec->unload_failed && rec->leases == 0 &&
          rec->state == RecordState::kResident) {
        rec->state = RecordState::kUnloading;
        rec->owner = std::this_thread::get_id();
        failed_retired.emplace_back(&shard, rec);
      }
    }
  }
  size_t evicted = 0;
  for (const auto& rec : victims) {
    if (EvictIfEvictable(rec, EventType::kEvicted, Clock::time_point::max()) ==
        EvictOutcome::kEvicted) {
      ++evicted;
    }
  }
  for (auto& [shard, rec] : failed_retired) FreeRetired(*shard, rec);
  return evicted;
}

CacheStats CacheCore::Stats() {
  CacheStats stats;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    const ShardCounters c = shard.counters;
    stats.hits += shard.hits;
    stats.misses += c.misses;
    stats.refused += c.refused;
    stats.loads += c.loads;
    stats.load_failures += c.load_failures;
    stats.evictions += c.evictions;
    stats.expirations += c.expirations;
    stats.failed_unloads += c.failed_unloads;
    stats.removals += c.removals;
    stats.bytes_loaded += c.bytes_loaded;
    stats.load_seconds += c.load_seconds;
    for (const auto& [key, slot] : shard.map) {
      if (slot.record && slot.record->state != RecordState::kLoading) {
        ++stats.resident_entries;
        stats.resident_bytes += slot.record->bytes;
      }
    }
    for (const auto& [ptr, rec] : shard.retired) {
      ++stats.retired_entries;
      stats.retired_bytes += rec->bytes;
    }
  }
  stats.capacity_bytes = budget_->capacity();
  stats.budget_used_bytes = budget_->used();
  stats.high_water_bytes = budget_->high_water();
  stats.callback_errors = callback_errors_.load(std::memory_order_relaxed);
  return stats;
}

namespace {
EntryInfo InfoOf(const Record& r) {
  EntryState state = EntryState::kResident;
  if (r.retired) {
    state = EntryState::kRetired;
  } else if (r.state == RecordState::kLoading) {
    state = EntryState::kLoading;
  } else if (r.state == RecordState::kUnloading) {
    state = EntryState::kUnloading;
  }
  return EntryInfo{
      r.key,    state,      r.bytes,   r.leases, r.waiters + r.unload_waiters,
      r.pinned, r.accesses, r.last_use};
}
}  // namespace

std::vector<EntryInfo> CacheCore::Entries() {
  std::vector<EntryInfo> entries;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    for (const auto& [key, slot] : shard.map) {
      if (slot.record) entries.push_back(InfoOf(*slot.record));
    }
    for (const auto& [ptr, rec] : shard.retired)
      entries.push_back(InfoOf(*rec));
  }
  std::sort(
      entries.begin(), entries.end(),
      [](const EntryInfo& a, const EntryInfo& b) { return a.key < b.key; });
  return entries;
}

std::optional<EntryInfo> CacheCore::Entry(std::string_view key) {
  std::string storage;
  key = Canonical(key, &storage);
  Shard& shard = ShardFor(key);
  base::MutexLock lock(&shard.mu);
  auto it = shard.map.find(key);
  if (it == shard.map.end() || !it->second.record) return std::nullopt;
  return InfoOf(*it->second.record);
}

uint64_t CacheCore::CheckInvariants() {
  uint64_t accounted = 0;
  base::MutexLock aliases(&alias_mu_);  // I6: before any shard mutex
  size_t alias_slots = 0;
  for (const auto& [alias, target] : alias_target_) {
    MC_CHECK(!alias_target_.contains(target), "alias of an alias", alias);
    MC_CHECK(!aliases_of_.contains(alias), "an alias is a target", alias);
  }
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    size_t ordered_records = 0;
    for (const auto& [key, slot] : shard.map) {
      if (!slot.record) {
        auto target = alias_target_.find(key);
        MC_CHECK(
            target != alias_target_.end() && target->second == slot.alias_of,
            "alias slot out of step with the alias table", key);
        ++alias_slots;
        continue;
      }
      const Record& r = *slot.record;
      MC_CHECK(r.key == key, "record filed under another key", key);  // I1
      MC_CHECK(r.shard == i, "record in the wrong shard", key);
      MC_CHECK(!r.retired, "retired record still in the map", key);
      MC_CHECK(r.state == RecordState::kLoading ||
                   r.state == RecordState::kResident ||
                   r.state == RecordState::kUnloading,
               "record in the map in a final state", key);
      MC_CHECK(r.leases >= 0 && r.waiters >= 0, "negative count", key);
      const bool should_be_ordered = r.state != RecordState::kLoading;  // I2
      MC_CHECK(r.in_order == should_be_ordered, "order membership wrong", key);
      if (r.in_order) {
        ++ordered_records;
        MC_CHECK(shard.order.count(OrderKey{r.order_priority, r.order_seq,
                                            slot.record.get()}) == 1,
                 "order entry missing", key);
        MC_CHECK(r.order_priority < r.priority ||
                     (r.order_priority == r.priority && r.order_seq <= r.seq),
                 "order entry ahead of its record", key);
      }
      if (r.state == RecordState::kLoading) {
        MC_CHECK(r.leases == 0, "lease on a record still loading", key);
      }
      accounted += r.bytes;  // I4 (a loading record's bytes = reservation)
    }
    MC_CHECK(shard.order.size() == ordered_records,
             "order has entries for records not in the map", "");
    for (const auto& [ptr, rec] : shard.retired) {  // I3
      MC_CHECK(rec->retired && !rec->in_order, "retired record misfiled",
               rec->key);
      MC_CHECK(rec->leases > 0 || rec->unload_failed ||
                   rec->state == RecordState::kUnloading,
               "retired record without leases not freed", rec->key);
      accounted += rec->bytes;
    }
  }
  MC_CHECK(alias_slots == alias_target_.size(), "alias without a slot", "");
  return accounted;
}

void CacheCore::Shutdown() {
  if (shut_down_.exchange(true)) return;
  budget_->Unregister(this);
  uint64_t to_release = 0;
  std::vector<std::shared_ptr<Record>> records;
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& shard = shards_[i];
    base::MutexLock lock(&shard.mu);
    // A peer cache sharing the budget may be evicting from this one: it
    // found its victim before Unregister above, and its unloader may still
    // be running. Let it finish; a victim it failed to unload is resident
    // again and is unloaded below, one it unloaded is gone with its bytes.
    while (std::any_of(shard.map.begin(), shard.map.end(), [](const auto& kv) {
      return kv.second.record &&
             kv.second.record->state == RecordState::kUnloading;
    })) {
      if (auto hook = shutdown_waits_for_unload.load()) hook();
      shard.changed.Wait(&shard.mu);
    }
    for (auto& [key, slot] : shard.map) {
      if (!slot.record) continue;
      assert(slot.record->leases == 0 && "cache destroyed with a lease out");
      assert(slot.record->state == RecordState::kResident &&
             "cache destroyed during a load or unload");
      slot.record->state = RecordState::kGone;  // no peer may evict it now
      records.push_back(slot.record);
    }
    for (auto& [ptr, rec] : shard.retired) {
      assert(rec->leases == 0 && "cache destroyed with a lease out");
      rec->state = RecordState::kGone;
      records.push_back(rec);
    }
    shard.map.clear();
    shard.order.clear();
    shard.retired.clear();
  }
  for (auto& rec : records) {
    // The cache is going away: its bytes are returned whatever the unloader
    // says, since nobody could ever retry.
    try {
      if (rec->unload) rec->unload();
    } catch (...) {
      if (Observed()) {
        Emit({EventType::kUnloadFailed, rec->key, rec->bytes, 0,
              DescribeException(std::current_exception())});
      }
    }
    rec->value.reset();
    to_release += rec->bytes;
  }
  budget_->Release(to_release);
}

}  // namespace detail

// ---- Lease ----

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    core_ = other.core_;
    record_ = other.record_;
    other.core_ = nullptr;
    other.record_ = nullptr;
  }
  return *this;
}

void* Lease::value() const { return record_ ? record_->value.get() : nullptr; }

const std::string& Lease::key() const {
  static const std::string kEmpty;
  return record_ ? record_->key : kEmpty;
}

uint64_t Lease::bytes() const { return record_ ? record_->bytes : 0; }

void Lease::Release() {
  if (record_ == nullptr) return;
  detail::CacheCore* core = core_;
  detail::Record* record = record_;
  core_ = nullptr;
  record_ = nullptr;
  core->ReleaseLease(record);
}

// ---- ModelCache ----

ModelCache::ModelCache(CacheOptions options)
    : core_(std::make_shared<detail::CacheCore>(std::move(options))) {
  core_->budget().Register(core_);
}

ModelCache::~ModelCache() { core_->Shutdown(); }

Lease ModelCache::Acquire(std::string_view key, uint64_t expected_bytes,
                          const Loader& loader, const AcquireOptions& options) {
  return core_->Acquire(key, expected_bytes, loader, options);
}

std::optional<Lease> ModelCache::Lookup(std::string_view key) {
  return core_->Lookup(key);
}

void ModelCache::Prefetch(std::string_view key, uint64_t expected_bytes,
                          const Loader& loader, const AcquireOptions& options) {
  core_->Acquire(key, expected_bytes, loader, options).Release();
}

RemoveOutcome ModelCache::Remove(std::string_view key,
                                 Clock::time_point deadline) {
  return core_->Remove(key, deadline, /*invalidate=*/false);
}

RemoveOutcome ModelCache::Invalidate(std::string_view key,
                                     Clock::time_point deadline) {
  return core_->Remove(key, deadline, /*invalidate=*/true);
}

void ModelCache::Pin(std::string_view key) { core_->SetPinned(key, true); }
void ModelCache::Unpin(std::string_view key) { core_->SetPinned(key, false); }

void ModelCache::AddAlias(std::string_view alias, std::string_view canonical) {
  core_->AddAlias(alias, canonical);
}
bool ModelCache::RemoveAlias(std::string_view alias) {
  return core_->RemoveAlias(alias);
}
std::string ModelCache::Resolve(std::string_view key) const {
  return core_->Resolve(key);
}

size_t ModelCache::EvictExpired() { return core_->EvictExpired(); }
size_t ModelCache::Prune() { return core_->Prune(); }
uint64_t ModelCache::SetCapacity(uint64_t capacity_bytes) {
  return core_->budget().SetCapacity(capacity_bytes);
}

CacheStats ModelCache::Stats() const { return core_->Stats(); }
std::vector<EntryInfo> ModelCache::Entries() const { return core_->Entries(); }
std::optional<EntryInfo> ModelCache::Entry(std::string_view key) const {
  return core_->Entry(key);
}
Budget& ModelCache::budget() const { return core_->budget(); }
const std::string& ModelCache::name() const { return core_->name(); }
uint64_t ModelCache::CheckInvariants() const {
  return core_->CheckInvariants();
}

const char* EventTypeName(EventType type) {
  switch (type) {
    case EventType::kLoaded:
      return "loaded";
    case EventType::kLoadFailed:
      return "load_failed";
    case EventType::kEvicted:
      return "evicted";
    case EventType::kExpired:
      return "expired";
    case EventType::kUnloadFailed:
      return "unload_failed";
    case EventType::kRemoved:
      return "removed";
    case EventType::kRetired:
      return "retired";
    case EventType::kRetiredFreed:
      return "retired_freed";
  }
  return "unknown";
}

const char* EntryStateName(EntryState state) {
  switch (state) {
    case EntryState::kLoading:
      return "loading";
    case EntryState::kResident:
      return "resident";
    case EntryState::kUnloading:
      return "unloading";
    case EntryState::kRetired:
      return "retired";
  }
  return "unknown";
}

}  // namespace modelcache
