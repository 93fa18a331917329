// ModelCache: a type-erased residency cache of loaded models.
//
// A model is identified by a key (or an alias of one) and loaded by a
// caller-supplied Loader. The cache guarantees:
//
//  * At most one load per key is in flight, however many acquires race for
//    it; every waiter receives the loader's result, or the same exception.
//    Failures are never cached: the next acquire loads again.
//  * A load runs outside every lock, so loads of different keys proceed in
//    parallel, and a load hands its caller (and every waiter) a lease
//    atomically: nothing can evict a model between loading it and using it.
//  * Bytes are reserved in the Budget before the loader runs, adjusted to the
//    real size after, and returned on failure. Nothing is admitted over
//    budget: when the room cannot be made by evicting, the caller either
//    waits (up to its deadline) or gets ErrorCode::kCapacity, as
//    AcquireOptions says.
//  * A request that waits for room is never starved by the traffic of the
//    models that hold it. Requests for those models may overtake it for at
//    most the budget's drain_after (CacheOptions::drain_after); then those
//    models drain: an Acquire of a draining model queues (whatever its
//    WhenFull, up to its deadline) and takes no lease, Lookup and TryAcquire
//    return nothing for it, the leases out end as their requests finish, and
//    the waiter gets the room before anyone else. So it is served within
//    drain_after, plus the longest lease in use when the drain began, plus
//    its own load (budget.h, "Who waits", says what is outside that bound:
//    pinned room, and leases the waiter holds itself, AcquireOptions::holds).
//  * A request evicts only when the eviction makes it fit: when every
//    unleased, unpinned model on the budget (in every cache sharing it)
//    could not make room, nothing is evicted for it, whether it fails at
//    once or waits. (A race with another thread can still waste an eviction;
//    Budget::Reserve says exactly when, and CacheStats::wasted_evictions
//    counts it.)
//  * A record with a lease or a pin is never evicted or unloaded. Remove of a
//    leased record retires it: new acquires no longer see it, its bytes stay
//    counted until its last lease ends, and then it is unloaded.
//  * Load, remove and invalidate of one key are serialised: one record per
//    key at a time, and a new one only after the old one left the cache.
//  * A failed unload keeps the record resident, its bytes counted, at its
//    place in the eviction order, and reports the error; eviction moves on to
//    the next victim. The record is tried again by the next reservation that
//    looks for room, by Prune, and, while the budget is over a capacity that
//    shrank, at the next end of a last lease or unpin (Budget::SetCapacity).
//  * User code (loaders, unloaders, value deleters, event callbacks) always
//    runs outside the cache's locks, so it may acquire, release and remove
//    freely; a Lease may be destroyed on any thread and in any context. The
//    one call that cannot succeed is waiting for oneself: a loader (or
//    unloader) that acquires or removes the very key it is loading (or
//    unloading), directly or through an alias, gets ErrorCode::
//    kFailedPrecondition at once instead of a deadlock.
//  * An event callback that throws changes nothing: the exception is caught
//    and counted in CacheStats::callback_errors, and the call that emitted
//    the event completes as if the callback had returned.
//
// Example:
//
//   modelcache::ModelCache cache(
//       {.name = "models", .capacity_bytes = 8ull << 30});
//   modelcache::Lease lease = cache.Acquire("sdxl", 6ull << 30, [] {
//     auto model = std::make_shared<Model>(LoadFromDisk("sdxl"));
//     return modelcache::Loaded{model, model->bytes()};
//   });
//   Run(*lease.get<Model>());
#ifndef MODELCACHE_CORE_CACHE_H_
#define MODELCACHE_CORE_CACHE_H_

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/policy.h"

namespace modelcache {

using Clock = std::chrono::steady_clock;

// What a loader produces.
struct Loaded {
  // The model. Its deleter runs after a successful unload, outside locks.
  std::shared_ptr<void> value;
  // Real resident size; the reservation is adjusted to it. A real size
  // larger than the whole budget is refused with kTooLarge (the value is
  // unloaded, nothing is evicted for it).
  uint64_t bytes = 0;
  // Optional: releases resources before the value is dropped (for example
  // device memory). May throw; then the record stays resident and counted.
  std::function<void()> unload;
};

using Loader = std::function<Loaded()>;

struct AcquireOptions {
  // Bounds every wait of this call: for another caller's load, for an
  // unload in progress, and for capacity.
  Clock::time_point deadline = Clock::time_point::max();
  // What a miss does when its bytes cannot be had by evicting: fail at once
  // with kCapacity, or wait for enough to become evictable. Either way it
  // evicts nothing until evicting can make the room.
  WhenFull when_full = WhenFull::kFail;
  // Passed to the eviction policy as AccessInfo::hint (Belady's needs it).
  double policy_hint = 0.0;
  // Lets the caller end a blocked wait early (see WaitInterrupt); the call
  // then throws the check's exception, as it would kTimeout.
  WaitInterrupt interrupt;
  // Whether this call is a request for the model, as opposed to a load
  // ahead of demand (a prewarm). A policy that learns from when requests
  // come (EvictionPolicy::history_length() > 0, such as next-use) counts
  // only requests. Prefetch always passes false.
  bool request = true;
  // When the request arrived, in the cache's clock (CacheOptions::now), for a
  // request that waited before this call: in a server's own queue, or in a
  // replay's queue of loads. A policy that learns from when requests come
  // records this time instead of the call's. Unset: the call's time.
  std::optional<Clock::time_point> arrival;
  // Make room only by evicting entries the policy ranks below this key, as
  // ranked now (for a key not resident: its first access, with its request
  // history). For loads ahead of demand: a prewarm may replace a model
  // expected later than it, never one expected sooner. When that frees too
  // little, the call fails (kFail) or waits (kWait) as when nothing is
  // evictable.
  bool evict_only_lower_ranked = false;
  // Bytes of this load that the budget's owner counted outside the budget
  // until now (ReserveOptions::grow_capacity): the capacity grows by them as
  // the load's bytes are reserved, in one step. An acquire that is refused
  // or waits has grown nothing, and one whose reservation succeeds keeps the
  // growth even if its loader then throws. Only the reservation of
  // `expected_bytes` grows it (by at most that much): a model that loads
  // larger reserves the rest from the budget as it stands.
  uint64_t grow_capacity = 0;
  // False: make room only from free bytes, evicting nothing (a prewarm into
  // free memory). When that is too little, the call fails (kFail) or waits
  // (kWait) as when nothing is evictable.
  bool evict = true;
  // Leases (Lease::id(), on any cache of this budget) that the caller holds
  // while this call waits for room and that it will not let go of before
  // the call returns. A drain for this call never takes them (it would wait
  // for itself); room they hold is outside the drain's bound, as pinned room
  // is. A caller that holds a lease it does not list here can make its own
  // drain wait for that lease until the deadline.
  std::vector<uint64_t> holds;
};

enum class EventType {
  kLoaded,        // a load completed; bytes and seconds set
  kLoadFailed,    // a load threw; error set
  kEvicted,       // a record was evicted: to make room, or by SetCapacity/Prune
  kExpired,       // a record idle past the TTL was evicted
  kUnloadFailed,  // an unloader threw; the record stays resident
  kRemoved,       // Remove/Invalidate unloaded a record
  kRetired,       // Remove/Invalidate retired a leased record
  kRetiredFreed,  // the last lease of a retired record ended; it is gone
  // A resident record started draining for an older request for room: it
  // takes no new lease until its drain ends (budget.h, "Who waits"). A
  // process that hands out references of its own to a record's copy (the
  // daemon's clients) learns here to stop doing so.
  kDrainStarted,
  // A draining record takes leases again: its drain ended without evicting
  // it (its waiter was served, timed out or went away, it was pinned, or
  // its unloader threw). An evicted one gets kEvicted instead.
  kDrainEnded,
};

const char* EventTypeName(EventType type);

struct CacheEvent {
  EventType type;
  std::string key;
  uint64_t bytes = 0;
  double seconds = 0;  // load time, for kLoaded
  std::string error;   // for kLoadFailed and kUnloadFailed
  // For kLoadFailed and kUnloadFailed: what the loader or unloader threw,
  // the object itself (a binding's callback can give its user the original
  // exception, e.g. a Python one with its traceback). Null otherwise.
  std::exception_ptr exception;
};

// CacheOptions::shard_bits above this means this (4,096 shards).
inline constexpr int kMaxShardBits = 12;

// How to load a model ahead of demand, for a keep-alive policy's prewarm
// (CacheOptions::prewarm_source).
struct PrewarmSource {
  uint64_t expected_bytes = 0;
  Loader loader;
};

struct CacheOptions {
  std::string name = "cache";
  // The budget to draw from, possibly shared with other caches. When null,
  // the cache makes its own of `capacity_bytes`.
  std::shared_ptr<Budget> budget;
  uint64_t capacity_bytes = 0;
  // Eviction order; LRU when null.
  std::shared_ptr<const EvictionPolicy> policy;
  // Records unleased for longer than this are evicted by EvictExpired(),
  // which every miss that starts a load also runs. A record's idle time counts
  // from the end of its last lease (every acquire holds one), so a model held
  // for longer than the TTL is not expired the moment it is released. Zero
  // disables it.
  std::chrono::nanoseconds idle_ttl{0};
  // Time source for idle_ttl and last-use stamps. When empty, the coarse
  // monotonic clock (the steady_clock's clock, read at a few milliseconds'
  // resolution, which idle TTLs do not need finer). Called under the cache's
  // locks: it must not call into the cache.
  std::function<Clock::time_point()> now;
  // log2 of the number of lock shards, clamped to [0, kMaxShardBits]. 0
  // gives one shard and an exact global eviction order; more shards let
  // concurrent hits on different keys proceed without contention.
  int shard_bits = 4;
  // For the budget the cache makes (when `budget` is null): how long a
  // request waiting for room may be overtaken by requests for the models
  // that hold it before they drain (BudgetOptions::drain_after; budget.h,
  // "Who waits"). The default, kDrainAfterAuto: the largest of 1 s (also
  // the load term for a key never loaded), four times what this cache last
  // measured loading the waiter's key (on the budget's clock), and eight
  // times how long the budget's recent drains lasted (DefaultDrainAfter,
  // chosen on the sweeps in docs/benchmarks.md). Zero:
  // strict arrival order; kDrainNever: today's rule, a model in use is never
  // made to give up its room. A shared budget has its own
  // (Budget::set_drain_after). The budget's clock is `now`.
  std::chrono::nanoseconds drain_after = kDefaultDrainAfter;
  // Called outside every lock, on the thread that caused the event. If it
  // throws, the exception is caught and counted (CacheStats::
  // callback_errors); the cache's state is the same as if it had returned.
  std::function<void(const CacheEvent&)> on_event;

  // Keep-alive and prewarm (keep_alive.h). The cache records each model's
  // idle times (from the end of its last request to the arrival of the next)
  // and asks the policy for a plan whenever a model's last request ends (its
  // last lease, not a Prefetch's). It carries the plan out on its clock:
  // unloads the model at the plan's time if it is still idle, unpinned and
  // not requested since (an expiration: EventType::kExpired), and prewarms
  // it at the plan's time with a Prefetch through `prewarm_source`.
  //
  // A prewarm never delays a demand load: it starts only while no demand
  // load is in flight in this cache and fewer than `max_prewarms` prewarms
  // are; it never waits for room and evicts nothing (or, for a policy whose
  // prewarm_evicts_lower_ranked(), only idle models ranked below it). One
  // that comes due during a demand load starts when no demand load is left.
  //
  // The plans run on a thread of the cache's, which it stops before it goes
  // away, when `now` is empty (the real clock); with an injected clock, only
  // when the caller runs ModelCache::RunKeepAlive. Null: no keep-alive.
  std::shared_ptr<const KeepAlivePolicy> keep_alive;
  // How to load `key` for a prewarm: its expected size and a loader, or
  // nullopt to skip that prewarm. Called with no lock held, on the thread
  // running the plans. Empty: no prewarms (unloads still happen). If it
  // throws, the exception is caught and counted (CacheStats::
  // callback_errors) and that prewarm is skipped.
  std::function<std::optional<PrewarmSource>(std::string_view key)>
      prewarm_source;
  int max_prewarms = 1;

  // Sets `policy`, `idle_ttl` and `keep_alive` from a named policy
  // (PolicyByName).
  CacheOptions& WithPolicy(const NamedPolicy& named) {
    policy = named.eviction;
    idle_ttl = named.idle_ttl;
    keep_alive = named.keep_alive;
    return *this;
  }
};

// The fields of CacheStats, X(type, name, what it counts): the one list the
// struct, the test printers, the Python package's dict and dataclass, and the
// daemon's JSON and metrics read. Adding a counter is one line here.
#define MODELCACHE_CACHE_STATS_FIELDS(X)                                      \
  X(uint64_t, hits, "acquires and lookups that found the key resident")       \
  X(uint64_t, misses,                                                         \
    "acquires that started or joined a load, and lookups that did not find "  \
    "the key resident")                                                       \
  X(uint64_t, refused,                                                        \
    "misses whose load never ran or was not admitted: too large, no "         \
    "capacity, timed out waiting for room")                                   \
  X(uint64_t, loads, "loads that completed")                                  \
  X(uint64_t, load_failures, "loads whose loader threw")                      \
  X(uint64_t, evictions,                                                      \
    "records evicted to make room, by SetCapacity or "                        \
    "by Prune")                                                               \
  X(uint64_t, expirations,                                                    \
    "idle records unloaded past the idle TTL or their keep-alive")            \
  X(uint64_t, failed_unloads, "unloaders that threw")                         \
  X(uint64_t, removals, "records unloaded or retired by Remove/Invalidate")   \
  X(uint64_t, bytes_loaded, "bytes of the loads that completed")              \
  X(double, load_seconds, "time the completed loads took")                    \
  X(uint64_t, resident_entries, "records resident now")                       \
  X(uint64_t, resident_bytes, "their bytes")                                  \
  X(uint64_t, retired_entries, "records retired and still leased")            \
  X(uint64_t, retired_bytes, "their bytes")                                   \
  X(uint64_t, capacity_bytes, "of the budget")                                \
  X(uint64_t, budget_used_bytes, "of the budget, every cache on it together") \
  X(uint64_t, high_water_bytes, "of the budget: the most ever in use")        \
  X(uint64_t, wasted_evictions,                                               \
    "of the budget: evictions made for reservations that then failed anyway " \
    "(Budget::wasted_evictions; only a race or a failing unloader causes "    \
    "one)")                                                                   \
  X(uint64_t, callback_errors,                                                \
    "event callbacks and prewarm sources that threw (and were caught)")       \
  X(uint64_t, prewarms,                                                       \
    "loads the keep-alive policy made ahead of demand (CacheOptions::"        \
    "keep_alive); each is also counted in loads and misses")

struct CacheStats {
#define MODELCACHE_DECLARE_STAT(type, name, doc) type name = 0;
  MODELCACHE_CACHE_STATS_FIELDS(MODELCACHE_DECLARE_STAT)
#undef MODELCACHE_DECLARE_STAT

  bool operator==(const CacheStats&) const = default;
};

// Calls visit(name, value, doc) for every field of `stats`, in order.
template <typename Visitor>
void ForEachField(const CacheStats& stats, Visitor&& visit) {
#define MODELCACHE_VISIT_STAT(type, name, doc) visit(#name, stats.name, doc);
  MODELCACHE_CACHE_STATS_FIELDS(MODELCACHE_VISIT_STAT)
#undef MODELCACHE_VISIT_STAT
}

enum class EntryState { kLoading, kResident, kUnloading, kRetired };
const char* EntryStateName(EntryState state);

// The fields of EntryInfo, X(type, name, what it is), as for CacheStats.
#define MODELCACHE_ENTRY_INFO_FIELDS(X)                                     \
  X(std::string, key, "the canonical key")                                  \
  X(EntryState, state, "loading, resident, unloading or retired")           \
  X(uint64_t, bytes, "its size (reserved, while loading)")                  \
  X(int, leases, "leases held on it")                                       \
  X(int, waiters,                                                           \
    "callers blocked on it: waiting for its load or unload, or queued "     \
    "behind its drain")                                                     \
  X(bool, pinned, "never evicted while pinned")                             \
  X(uint64_t, accesses, "acquires since it was loaded")                     \
  X(Clock::time_point, last_use,                                            \
    "when it last became idle: its load, or the end of its last lease (an " \
    "idle TTL counts from here)")                                           \
  X(bool, draining,                                                         \
    "draining for an older request for room: it takes no new lease "        \
    "(budget.h, \"Who waits\")")                                            \
  X(std::string, drain_for,                                                 \
    "while draining, the request for room it drains for (\"'key' in cache " \
    "'name'\", or its bytes and budget); empty otherwise")

struct EntryInfo {
#define MODELCACHE_DECLARE_ENTRY_FIELD(type, name, doc) type name{};
  MODELCACHE_ENTRY_INFO_FIELDS(MODELCACHE_DECLARE_ENTRY_FIELD)
#undef MODELCACHE_DECLARE_ENTRY_FIELD

  bool operator==(const EntryInfo&) const = default;
};

// Calls visit(name, value, doc) for every field of `entry`, in order.
template <typename Visitor>
void ForEachField(const EntryInfo& entry, Visitor&& visit) {
#define MODELCACHE_VISIT_ENTRY_FIELD(type, name, doc) \
  visit(#name, entry.name, doc);
  MODELCACHE_ENTRY_INFO_FIELDS(MODELCACHE_VISIT_ENTRY_FIELD)
#undef MODELCACHE_VISIT_ENTRY_FIELD
}

enum class RemoveOutcome {
  kNotFound,  // nothing resident under that key
  kRemoved,   // unloaded and its bytes returned
  kRetired,   // leased: hidden now, freed when its last lease ends
};

namespace detail {
class CacheCore;
struct Record;
}  // namespace detail

// A claim on a resident model. While it exists the model is not evicted or
// unloaded. Move-only; release by destruction or Release(). May be released
// on any thread, including inside a loader, unloader or event callback.
// REQUIRES: the cache outlives its leases.
class Lease {
 public:
  Lease() = default;
  ~Lease() { Release(); }
  Lease(Lease&& other) noexcept : core_(other.core_), record_(other.record_) {
    other.core_ = nullptr;
    other.record_ = nullptr;
  }
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  explicit operator bool() const { return record_ != nullptr; }
  void* value() const;
  template <typename T>
  T* get() const {
    return static_cast<T*>(value());
  }
  const std::string& key() const;  // the canonical key
  uint64_t bytes() const;
  // The leased record's identity, as AcquireOptions::holds and
  // ReserveOptions::holds take it; 0 for an empty lease.
  uint64_t id() const;
  void Release();

 private:
  friend class detail::CacheCore;
  Lease(detail::CacheCore* core, detail::Record* record)
      : core_(core), record_(record) {}

  detail::CacheCore* core_ = nullptr;
  detail::Record* record_ = nullptr;
};

class ModelCache {
 public:
  explicit ModelCache(CacheOptions options);
  // Unloads every resident and retired record and returns its bytes to the
  // budget; there is no separate shutdown call to forget. Waits for a peer
  // cache's eviction that is still unloading one of this cache's records.
  // REQUIRES: no lease is outstanding and no call is in progress.
  ~ModelCache();
  ModelCache(const ModelCache&) = delete;
  ModelCache& operator=(const ModelCache&) = delete;

  // Returns a lease on `key` (or the key it aliases), loading it with
  // `loader` if it is not resident. `expected_bytes` is reserved before the
  // loader runs. A model that drains for an older request is not leased: the
  // call queues until the drain ends (then it takes a lease) or evicts the
  // model (then it loads it again, keeping its arrival time), and a deadline
  // that passes meanwhile is kTimeout naming the model and the request it
  // drains for. Throws Error (kTooLarge, kCapacity, kTimeout) or the
  // loader's own exception; kFailedPrecondition when called from the loader
  // or unloader of that same key on the same thread.
  Lease Acquire(std::string_view key, uint64_t expected_bytes,
                const Loader& loader, const AcquireOptions& options = {});

  // A lease if `key` is resident (and not draining), without loading.
  // Counts a hit or a miss.
  std::optional<Lease> Lookup(std::string_view key);

  // The hit half of Acquire: a lease if `key` (or the key it aliases) is
  // resident now and not draining, counted as a hit exactly as Acquire would
  // count it;
  // otherwise nullopt, counting nothing, so that the caller goes on to
  // Acquire, which counts the miss once. Never waits, never loads, never
  // evicts and runs no user code, so it may be called while holding a lock
  // that user code takes (a language binding holding its interpreter lock
  // on the hit path).
  std::optional<Lease> TryAcquire(std::string_view key,
                                  double policy_hint = 0.0);

  // Loads `key` if absent and leaves it resident without a lease (evictable
  // like any unleased record). It is not a request: a policy that learns
  // from requests does not count it (AcquireOptions::request). Throws like
  // Acquire.
  void Prefetch(std::string_view key, uint64_t expected_bytes,
                const Loader& loader, const AcquireOptions& options = {});

  // Removes the model `key` names, waiting (up to the deadline) for its load
  // or unload in progress. Unleased: unloaded now; if the unloader throws,
  // the record stays resident at its place in the eviction order and the
  // exception propagates. Leased: retired. When `key` is an alias, the model
  // it names is removed and the alias stays (RemoveAlias drops it): an alias
  // is a name, not a model. Throws kFailedPrecondition when called from the
  // loader or unloader of that same key.
  RemoveOutcome Remove(std::string_view key,
                       Clock::time_point deadline = Clock::time_point::max());

  // Like Remove, but a load in progress is not waited for: it is marked
  // stale, the acquires already waiting for it still receive it, and it is
  // retired as soon as it completes. An acquire that arrives after
  // Invalidate returned never receives the stale load: it waits for that
  // load to end and then loads afresh, so there is still at most one load of
  // the key in flight.
  RemoveOutcome Invalidate(std::string_view key, Clock::time_point deadline =
                                                     Clock::time_point::max());

  // A pinned record is never evicted. Throws kNotFound unless `key` is
  // resident. Pins do not nest.
  void Pin(std::string_view key);
  void Unpin(std::string_view key);

  // Makes `alias` another name of `canonical`. Aliases are one level deep:
  // every call resolves a name to its canonical key in one step, and no
  // chain or cycle can form. Throws kInvalidArgument if `alias` == canonical,
  // if a model is loaded under the key `alias`, if `canonical` is itself an
  // alias, or if `alias` is the target of other aliases. Re-pointing an
  // existing alias is allowed.
  void AddAlias(std::string_view alias, std::string_view canonical);
  // Drops the alias; false if `alias` is not one.
  bool RemoveAlias(std::string_view alias);
  // The canonical key for `key`: its alias target, or `key` itself.
  std::string Resolve(std::string_view key) const;

  // Evicts unleased, unpinned records idle past idle_ttl; returns how many.
  size_t EvictExpired();
  // Runs every keep-alive action (CacheOptions::keep_alive) due by now on
  // the cache's clock, and the prewarms held back by a demand load that may
  // start now; returns how many unloaded or prewarmed a model. For an
  // injected clock: with the real clock the cache's own thread runs them as
  // they come due. 0 without a keep-alive policy.
  size_t RunKeepAlive();
  // Evicts every unleased, unpinned record of this cache; returns how many.
  size_t Prune();
  // Sets the capacity of this cache's budget (see Budget::SetCapacity).
  uint64_t SetCapacity(uint64_t capacity_bytes);

  CacheStats Stats() const;
  std::vector<EntryInfo> Entries() const;
  std::optional<EntryInfo> Entry(std::string_view key) const;
  Budget& budget() const;
  const std::string& name() const;

  // Checks the cache's internal invariants and returns the bytes this cache
  // accounts for (resident, unloading, retired, and loading reservations).
  // Aborts with a message on violation. For tests and debug builds.
  uint64_t CheckInvariants() const;

 private:
  std::shared_ptr<detail::CacheCore> core_;
};

}  // namespace modelcache

#endif  // MODELCACHE_CORE_CACHE_H_
