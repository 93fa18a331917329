// A byte budget that one or several caches draw from.
//
// Several caches may share one Budget (for example one cache of checkpoints
// and one of LoRA adapters over the same host RAM). When one of them needs
// room, the budget evicts the lowest-priority evictable record among all its
// members, whichever cache holds it.
//
// A reservation evicts only when evicting makes it succeed: it first adds up
// what it could evict across every member (unleased, unpinned, resident, and
// ranked below its bar) and evicts nothing when that cannot make room. Such a
// request fails at once (WhenFull::kFail) or waits, still evicting nothing,
// until enough becomes evictable or its deadline passes (WhenFull::kWait).
// So one large request that cannot fit while others are leased never flushes
// the idle models it could not use.
//
// Who waits (swap scheduling): reservations that must wait for room are
// filed in arrival order (ReserveOptions::arrival), and the oldest is the
// one that may drain. Room that frees up without a drain goes to the first
// waiter it serves to look again after the change, which may be a younger
// one: only a drain keeps its room for its waiter. While one waits for room
// that only leased models can give, requests for those models are admitted at
// once: they overtake it, which groups requests by model and saves swaps.
// That lasts at most `drain_after` (BudgetOptions, set_drain_after; by
// default kDrainAfterAuto, which weighs the waiter's load time and how long
// the budget's recent drains lasted): once the
// oldest such waiter has waited that long, the models whose eviction it needs
// drain. They are chosen in eviction-policy order, idle and leased alike,
// until they cover its shortfall, leaving out what the waiter holds itself
// (ReserveOptions::holds) and what is pinned. A draining model takes no new
// lease (an Acquire of it queues until the drain ends; TryAcquire and Lookup
// return nothing), its leases out end as their requests finish, and when the
// last of them ends the whole set is evicted in one step for the waiter,
// which alone may use the bytes: while a drain runs, other reservations get
// only the room no one is owed. If idle models come to cover the waiter's
// shortfall first (outside the set, or the set's idle members with them),
// it evicts those instead, as any reservation would, and the rest of the
// set takes leases again. A drain ends with its waiter
// (served, timed out, interrupted); a waiter that did not get its room has
// evicted nothing. One drain runs at a time, for the oldest waiter that a drain
// can serve.
//
// The bound: a waiter that can be served by draining is served within
// drain_after, plus the longest lease in use when its drain began, plus its
// own load (the k-th waiter adds up the drains ahead of it). Outside it: a
// request too large for the budget (kTooLarge at once), and room held by
// pins or by leases the waiter holds itself, where it waits to its deadline.
//
// Locking: the budget's mutex is a leaf, and the budget never calls a member
// while holding it, so no lock-order inversion is possible. A member may call
// Release (and Resize, which calls no member) while holding its own locks.
// Reserve, SetCapacity, EvictOverCapacity and NotifyEvictable may evict
// (call members and their unloaders), so a member calls them with none of
// its locks held.
#ifndef MODELCACHE_CORE_BUDGET_H_
#define MODELCACHE_CORE_BUDGET_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "modelcache/base/mutex.h"
#include "modelcache/core/policy.h"

namespace modelcache {

// The default drain_after (kDrainAfterAuto) adapts to the swap it admits
// and to what drains have cost: the largest of kDrainAfterFloor (also the
// load term for a key never loaded), kDrainAfterLoadMultiple times the
// waiter's expected load time (ReserveOptions::expected_load: a cache passes
// what it last measured loading that key, on the budget's clock), and
// kDrainAfterDrainMultiple times the budget's recent drains (recent_drains():
// how long its drains lasted, from the start of each to its waiter getting
// the room or leaving, an average weighted 1 / kRecentDrainsWeight to the
// latest). So a swap (a drain and the load it admits) takes at most
// 1 / (1 + kDrainAfterLoadMultiple) of the time, the models a drain stops
// are stopped at most about 1 / (1 + kDrainAfterDrainMultiple) of the time
// (a drain lasts as long as the longest lease in its set, minutes where
// requests take minutes), and a small model's waiter does not drain the
// models in use after a few milliseconds. Nothing of it costs a hit: a
// drain measures its own length. Chosen on the replay's sweeps of the
// multiples and the weight on two workloads at five capacities each, and
// checked on four more (docs/benchmarks.md, "drain-after": the weight was
// chosen again when a drain's waiter came to take idle room outside its
// set); `modelcache
// replay` uses the same function (replay/simulate.h). Change them there and
// here together.
inline constexpr int64_t kDrainAfterLoadMultiple = 4;
inline constexpr std::chrono::milliseconds kDrainAfterFloor{1000};
inline constexpr int64_t kDrainAfterDrainMultiple = 8;
inline constexpr int64_t kRecentDrainsWeight = 2;
// drain_after = kDrainAfterAuto: the rule above, per waiter. The default.
inline constexpr std::chrono::nanoseconds kDrainAfterAuto{-1};
inline constexpr std::chrono::nanoseconds kDefaultDrainAfter = kDrainAfterAuto;
// drain_after = kDrainNever: models in use never drain (a waiter waits for
// them to fall idle, however long their traffic lasts).
inline constexpr std::chrono::nanoseconds kDrainNever =
    std::chrono::nanoseconds::max();

// What kDrainAfterAuto means for a waiter whose load is expected to take
// `expected_load` (zero or less: unknown), on a budget whose drains lasted
// `recent_drains` of late (zero: none yet): max(kDrainAfterFloor,
// kDrainAfterLoadMultiple x expected_load, kDrainAfterDrainMultiple x
// recent_drains), kDrainNever where that would overflow.
constexpr std::chrono::nanoseconds DefaultDrainAfter(
    std::chrono::nanoseconds expected_load,
    std::chrono::nanoseconds recent_drains = std::chrono::nanoseconds(0)) {
  std::chrono::nanoseconds after = kDrainAfterFloor;
  for (const auto& [time, multiple] :
       {std::pair{expected_load, kDrainAfterLoadMultiple},
        std::pair{recent_drains, kDrainAfterDrainMultiple}}) {
    if (time.count() <= 0) continue;
    if (time > kDrainNever / multiple) return kDrainNever;
    if (time * multiple > after) after = time * multiple;
  }
  return after;
}

// The budget's recent drains (see above) after one that lasted `drain`.
constexpr std::chrono::nanoseconds NextRecentDrains(
    std::chrono::nanoseconds recent, std::chrono::nanoseconds drain) {
  if (drain.count() < 0) drain = std::chrono::nanoseconds(0);
  if (recent.count() <= 0) return drain;
  return recent + (drain - recent) / kRecentDrainsWeight;
}

// What an acquire does when evicting cannot make the room it needs. Either
// way it evicts nothing meanwhile.
enum class WhenFull {
  // Fail at once with ErrorCode::kCapacity, naming what holds the memory.
  kFail,
  // Wait until enough becomes evictable or free (a lease ends, an unpin, a
  // release), up to the deadline, then fail with ErrorCode::kTimeout.
  kWait,
};

// A check that a blocked call runs now and then, so that its caller can end
// the wait early: a language binding servicing signals (the Python package
// raises KeyboardInterrupt from here), a server shutting down.
struct WaitInterrupt {
  // Called about every `every` while the call is blocked (waiting for
  // another caller's load, for an unload, or for capacity), with no lock of
  // any cache or budget held, on the blocked thread. If it throws, the call
  // stops waiting and propagates that exception as it would a timeout:
  // nothing it reserved stays reserved, it keeps no lease, and a load it
  // joined goes on for its other waiters. Empty: never called, and waits
  // are not sliced.
  std::function<void()> check;
  std::chrono::milliseconds every{50};
};

namespace detail {

// A record the budget may evict, as offered by a member.
struct VictimCandidate {
  double priority = 0;
  uint64_t seq = 0;
  uint64_t record_id = 0;
  uint64_t bytes = 0;
  std::shared_ptr<void> handle;  // keeps the member's record alive
};

enum class EvictOutcome { kEvicted, kChanged, kUnloadFailed };

// Where a record of a drain set stands (BudgetMember::DrainState).
enum class DrainState {
  kGone,     // its bytes are back in the budget, or will be with no eviction
  kLeased,   // leases still out: the drain waits for them
  kIdle,     // no lease: ready to be evicted with the rest of the set
  kBlocked,  // pinned, or a retired record whose unloader failed: no drain
             // can free it
};

// Implemented by every ModelCache on the budget (the host weight store and
// the device caches are ModelCaches too).
class BudgetMember {
 public:
  virtual ~BudgetMember() = default;
  // The member's best victim not in `skip` (record ids), if any.
  virtual bool BestVictim(const std::unordered_set<uint64_t>& skip,
                          VictimCandidate* out) = 0;
  // Evicts `victim` if it is still evictable. Runs the unloader outside
  // every lock and releases the bytes to the budget on success.
  virtual EvictOutcome TryEvict(const VictimCandidate& victim) = 0;
  // Bytes of the records BestVictim could offer now: resident, unleased,
  // unpinned, not in `skip`, with a priority below `evict_below`. Called
  // before every eviction: with `skip` empty and no bar (the common case) it
  // must not depend on the number of records.
  virtual uint64_t EvictableBytes(const std::unordered_set<uint64_t>& skip,
                                  double evict_below) = 0;
  // Appends "key (size, why held)" items for a capacity error: every record
  // that holds bytes, except the record with id `exclude` (the refused
  // reservation's own; 0 for none).
  virtual void DescribeHolders(std::vector<std::string>* out,
                               uint64_t exclude) = 0;
  // Bytes no eviction could free now: leased, pinned, retired, or in flight.
  virtual uint64_t UnevictableBytes() = 0;

  // ---- Draining (see "Who waits" above). ----
  // Like BestVictim, but leased records count too: the member's lowest
  // ranked record that is resident, unpinned, not retired, not draining and
  // not in `skip`, with its bytes.
  virtual bool BestDrainVictim(const std::unordered_set<uint64_t>& skip,
                               VictimCandidate* out) = 0;
  // Marks `victim` draining for the request `for_what` (true), or ends its
  // drain (false), waking the acquires queued behind it. Returns false (and
  // marks nothing) when starting a drain of a record that is no longer
  // resident, or that is pinned.
  virtual bool SetDraining(const VictimCandidate& victim, bool draining,
                           const std::string& for_what) = 0;
  virtual DrainState DrainStateOf(const VictimCandidate& victim) = 0;
  // Evicts a draining victim whose last lease ended (kIdle), as TryEvict
  // does an evictable one; kChanged when it is not idle and draining.
  virtual EvictOutcome EvictDrained(const VictimCandidate& victim) = 0;
};

}  // namespace detail

// How a reservation may make room (Budget::Reserve).
struct ReserveOptions {
  WhenFull when_full = WhenFull::kFail;
  std::chrono::steady_clock::time_point deadline =
      std::chrono::steady_clock::time_point::max();
  // Bytes the reservation already holds (0 for a new one): the whole,
  // already_reserved + bytes, must fit the capacity.
  uint64_t already_reserved = 0;
  // Run while waiting for capacity, as WaitInterrupt says (when not null).
  const WaitInterrupt* interrupt = nullptr;
  // Evict only records whose priority is below this; the others do not count
  // as evictable.
  double evict_below = std::numeric_limits<double>::infinity();
  // The id of the record the bytes are for (detail::VictimCandidate::
  // record_id), left out of the holders a capacity error names; 0 for none.
  uint64_t for_record = 0;
  // Bytes that move into the budget from outside it (memory the owner
  // counted apart, such as a copy a predecessor left mapped): the capacity
  // grows by them in the same step as the reservation is made, so that no
  // other reservation can take that room first. At most `bytes` count.
  // Whether the reservation fits, and what it must evict, is judged against
  // the capacity with them; but until the step that makes the reservation
  // the capacity is what it was, for every other call: a reservation that
  // waits has grown nothing yet (a release meanwhile that leaves usage over
  // the capacity still leaves it over, and SetCapacity's eviction goes on),
  // and one that fails leaves the capacity as it was.
  uint64_t grow_capacity = 0;
  // When the request arrived, in the budget's clock (BudgetOptions::now):
  // waiters for room are served, and drain, in this order. Unset: the time
  // of the call. A request that queued before (behind a drain, in a
  // server's queue) passes the time it came.
  std::optional<std::chrono::steady_clock::time_point> arrival;
  // Records (VictimCandidate::record_id) the caller holds leases on while it
  // waits: they count as pins for its drain (draining them would make it
  // wait for itself), and room they hold is outside the drain's bound.
  std::vector<uint64_t> holds;
  // What the bytes are for, as a drain names its waiter to the requests
  // queued behind it ("'B' in cache 'gpu0'"); empty: the byte count.
  std::string for_what;
  // How long the load the bytes are for is expected to take, on the
  // budget's clock: its drain_after under kDrainAfterAuto is
  // DefaultDrainAfter(expected_load). Zero: unknown (kDrainAfterFloor).
  std::chrono::nanoseconds expected_load{0};
};

struct BudgetOptions {
  // See "Who waits" above: how long a waiter for room may be overtaken by
  // requests for the models that hold it before they drain. Zero: strict
  // arrival order; kDrainNever: they never drain; kDrainAfterAuto (the
  // default): DefaultDrainAfter of each waiter's expected load time.
  std::chrono::nanoseconds drain_after = kDefaultDrainAfter;
  // The clock of arrivals and of drain_after; steady_clock::now when empty.
  // With another clock, call ClockAdvanced after moving it, so that waiters
  // look again. Called with no lock held.
  std::function<std::chrono::steady_clock::time_point()> now;
};

class Budget {
 public:
  explicit Budget(uint64_t capacity_bytes, std::string name = "budget",
                  BudgetOptions options = {});
  ~Budget();  // REQUIRES: no member is registered
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  const std::string& name() const { return name_; }
  uint64_t capacity() const MC_EXCLUDES(mu_);
  // Bytes held: resident and retired records plus outstanding reservations.
  uint64_t used() const MC_EXCLUDES(mu_);
  // The largest `used` ever seen.
  uint64_t high_water() const MC_EXCLUDES(mu_);
  // Reservations currently looking for room (evicting or waiting).
  int waiters() const { return waiters_.load(); }
  // Evictions made for reservations that then failed anyway (see Reserve):
  // the bytes a concurrent lease, pin or reservation, or a failed unloader,
  // made useless.
  uint64_t wasted_evictions() const { return wasted_evictions_.load(); }

  // How many bytes a reservation could get now by evicting every unleased,
  // unpinned record: capacity minus what nothing can evict. A snapshot; for
  // deciding how much of a model to place (partial placement).
  uint64_t ObtainableBytes() MC_EXCLUDES(mu_);

  // Changes the capacity. When it shrinks, evicts unleased, unpinned records
  // of every member until used <= capacity or nothing more is evictable;
  // returns the bytes still over the new capacity (held by leases or pins,
  // or by records whose unloader threw). A victim whose unloader throws
  // stays resident, counted, at its place in the eviction order, and the
  // shrink moves on to the next one.
  //
  // While usage stays over capacity, every end of a record's last lease (a
  // retired record's too, whether its unloader then succeeds or throws) and
  // every unpin that leaves a record evictable triggers the same eviction,
  // on the thread that released it, until usage is back within capacity. It
  // starts afresh each time: victims whose unloader threw before are tried
  // again.
  uint64_t SetCapacity(uint64_t capacity_bytes) MC_EXCLUDES(mu_);

  // SetCapacity in two steps, for an owner that changes the capacity under
  // a lock of its own and must not hold that lock across evictions (user
  // code, and as slow as the unloaders). Resize changes the capacity and
  // returns at once, evicting nothing; usage over it stays until
  // EvictOverCapacity, or the next end of a last lease or unpin (see
  // SetCapacity), evicts it. Resize calls no member, so it may be called
  // holding any lock that no member takes.
  void Resize(uint64_t capacity_bytes) MC_EXCLUDES(mu_);
  // Evicts unleased, unpinned records in policy order while usage is over
  // the capacity; returns the bytes still over (0 when within it). Cheap
  // when usage is within the capacity.
  // REQUIRES: the caller holds no lock of any member.
  uint64_t EvictOverCapacity() MC_EXCLUDES(mu_);

  PolicyClock& policy_clock() { return clock_; }

  // See BudgetOptions::drain_after (kDrainAfterAuto: the adaptive default).
  // A change applies to waiters already waiting as well (measured from
  // their arrival).
  std::chrono::nanoseconds drain_after() const {
    return std::chrono::nanoseconds(
        drain_after_ns_.load(std::memory_order_relaxed));
  }
  void set_drain_after(std::chrono::nanoseconds drain_after) MC_EXCLUDES(mu_);
  // The budget's clock (BudgetOptions::now).
  std::chrono::steady_clock::time_point Now() const {
    return now_ ? now_() : std::chrono::steady_clock::now();
  }
  // For an injected clock (BudgetOptions::now): wakes the waiters, which
  // look again whether drain_after has passed.
  void ClockAdvanced() MC_EXCLUDES(mu_);
  // Drains started since the budget was made, and the requests queued
  // behind one (CountQueuedBehindDrain) since.
  uint64_t drains() const { return drains_.load(std::memory_order_relaxed); }
  // How long its drains lasted of late, from the start of each until its
  // waiter got the room or left (NextRecentDrains); zero before the first.
  // kDrainAfterAuto weighs it (DefaultDrainAfter).
  std::chrono::nanoseconds recent_drains() const {
    return std::chrono::nanoseconds(
        recent_drains_ns_.load(std::memory_order_relaxed));
  }
  uint64_t queued_behind_drain() const {
    return queued_behind_drain_.load(std::memory_order_relaxed);
  }
  void CountQueuedBehindDrain() {
    queued_behind_drain_.fetch_add(1, std::memory_order_relaxed);
  }
  // When the oldest reservation now waiting for room arrived (budget clock);
  // nullopt when none waits.
  std::optional<std::chrono::steady_clock::time_point> OldestWaitArrival() const
      MC_EXCLUDES(mu_);

  // ---- For cache and store implementations. ----

  // Reserves `bytes` more for a reservation that already holds
  // `options.already_reserved`. Throws Error kTooLarge when already_reserved
  // + bytes > capacity (before evicting anything). Exact for every byte count:
  // sums that would pass 2^64 are too large, never wrapped.
  //
  // Room comes from free bytes first, then from evicting members' records,
  // lowest priority first, but only when evicting can make it: when the free
  // bytes plus every record that could be evicted now (unleased, unpinned,
  // resident, ranked below `options.evict_below`, across all members) fall
  // short, nothing is evicted, and the call
  //   * with WhenFull::kFail throws kCapacity at once, naming what holds the
  //     memory (never the reservation's own record, `options.for_record`);
  //   * with WhenFull::kWait waits, evicting nothing, until enough becomes
  //     evictable or free (a lease ends, an unpin, a release, a capacity
  //     change, NotifyEvictable) and looks again, or throws kTimeout at the
  //     deadline. A victim whose unloader threw is passed over until such a
  //     change, and then tried again.
  //
  // The check and the evictions cannot be one atomic step: each member's
  // records are guarded by that member's locks, and a member's unloader runs
  // outside every lock. So a reservation may still evict and then fall short
  // when, between its check and its last eviction, another thread leases or
  // pins a record it counted, another reservation takes the bytes it freed,
  // or a victim's unloader throws. The check is repeated before every
  // eviction, so at most the victims evicted before such a change are lost;
  // each of them is counted in wasted_evictions().
  //
  // A reservation that waits (WhenFull::kWait) is filed in arrival order
  // and may drain the models that hold its room, as "Who waits" above says;
  // while another's drain runs, it gets only the room that drain's waiter
  // is not owed. One that fails or times out has evicted nothing for a
  // drain, and its drain, if it had one, ends with it.
  //
  // REQUIRES: the caller holds no lock of any member.
  void Reserve(uint64_t bytes, const ReserveOptions& options = {})
      MC_EXCLUDES(mu_);
  // REQUIRES: bytes <= used().
  void Release(uint64_t bytes) MC_EXCLUDES(mu_);
  // Evicts the lowest-ranked unleased, unpinned record of any member, for a
  // member whose memory ran out although its books say there is room (a
  // device allocator that rounds up, or that other libraries share). A
  // victim whose unloader throws stays resident, and the next is tried.
  // Returns false when nothing was evicted.
  // REQUIRES: the caller holds no lock of any member.
  bool EvictLowestRanked() MC_EXCLUDES(mu_);
  // A record just became evictable (its last lease ended or it was
  // unpinned), or a retired record's last lease ended: wakes acquires
  // waiting for capacity, and evicts while usage is over capacity (see
  // SetCapacity). Cheap when neither applies.
  // REQUIRES: the caller holds no lock of any member.
  void NotifyEvictable() MC_EXCLUDES(mu_);
  // A record became one a drain may take though not evictable (a load
  // ended with leases out, or a leased record was unpinned): wakes the
  // waiters, so that one no drain could serve looks again. Cheap when no one
  // waits.
  void NotifyDrainable() MC_EXCLUDES(mu_);

  void Register(std::weak_ptr<detail::BudgetMember> member) MC_EXCLUDES(mu_);
  void Unregister(const detail::BudgetMember* member) MC_EXCLUDES(mu_);

 private:
  enum class EvictStep { kEvicted, kUnloadFailed, kNone };
  // Evicts one victim among all members: the lowest ranked not in `skip`
  // and below `evict_below`. A victim whose unloader throws stays resident
  // and joins `skip`.
  EvictStep EvictOne(
      std::unordered_set<uint64_t>* skip,
      double evict_below = std::numeric_limits<double>::infinity())
      MC_EXCLUDES(mu_);
  // What every member could evict now (see BudgetMember::EvictableBytes),
  // saturating at 2^64 - 1.
  uint64_t EvictableBytes(const std::unordered_set<uint64_t>& skip,
                          double evict_below) MC_EXCLUDES(mu_);
  // Evicts until used <= capacity or nothing is evictable; returns the bytes
  // still over capacity.
  uint64_t EvictToCapacity() MC_EXCLUDES(mu_);
  std::vector<std::shared_ptr<detail::BudgetMember>> Members() MC_EXCLUDES(mu_);
  std::string HoldersMessage(uint64_t exclude) MC_EXCLUDES(mu_);

  // ---- The drain scheduler (budget_drain.cc). ----
  struct Waiter;
  enum class DrainProgress { kAgain, kWait, kCannot };
  // Takes a reservation out of the waiters (mu_ held); on failure, the
  // victims it evicted were for nothing. True when it was draining: the
  // caller then ends that drain with FinishDrain, without the lock.
  bool LeaveLocked(Waiter* waiter, bool failed) MC_REQUIRES(mu_);
  // Files `waiter` among the waiters, in arrival order.
  void EnqueueLocked(Waiter* waiter) MC_REQUIRES(mu_);
  // Takes `waiter` out of the waiters. True when it was draining: the
  // caller then ends its drain with FinishDrain, without the lock.
  bool DequeueLocked(Waiter* waiter) MC_REQUIRES(mu_);
  // Whether `waiter` may start a drain now: none runs, it has waited
  // drain_after, and every older waiter is one that no drain can serve.
  bool MayStartDrainLocked(const Waiter& waiter,
                           std::chrono::steady_clock::time_point now) const
      MC_REQUIRES(mu_);
  bool RefusedLocked(const Waiter& waiter) const MC_REQUIRES(mu_);
  // The drain_after that applies to `waiter` (kDrainAfterAuto resolved by
  // its expected load time).
  std::chrono::nanoseconds DrainAfterOf(const Waiter& waiter) const;
  // One step of `waiter`'s drain: extend its set until it covers the
  // waiter's bytes, and evict the whole set once no lease of it is left.
  // `free_bytes`: capacity (with any growth) minus what is used.
  DrainProgress DrainStep(Waiter* waiter, uint64_t free_bytes,
                          uint64_t* evicted) MC_EXCLUDES(mu_);
  // Ends the drain of a waiter no longer filed: every record of its set
  // takes leases again, and the acquires queued behind them go on.
  void FinishDrain(Waiter* waiter) MC_EXCLUDES(mu_);

  const std::string name_;
  PolicyClock clock_;

  mutable base::Mutex mu_;
  base::CondVar
      changed_;  // signalled when bytes are released or become evictable
  uint64_t capacity_ MC_GUARDED_BY(mu_);
  uint64_t used_ MC_GUARDED_BY(mu_) = 0;
  uint64_t high_water_ MC_GUARDED_BY(mu_) = 0;
  uint64_t change_count_ MC_GUARDED_BY(mu_) = 0;
  // Of change_count_, the changes that make no refused waiter's room
  // drainable (the clock, a drain's start, a refusal that ends no drain of
  // records): a refusal holds until
  // change_count_ - quiet_changes_ moves.
  uint64_t quiet_changes_ MC_GUARDED_BY(mu_) = 0;
  struct MemberSlot {
    const detail::BudgetMember* id;
    std::weak_ptr<detail::BudgetMember> member;
  };
  std::vector<MemberSlot> members_ MC_GUARDED_BY(mu_);
  // Read without the lock by NotifyEvictable; written under it.
  std::atomic<int> waiters_{0};
  // used_ > capacity_ after a shrink. Read without the lock by
  // NotifyEvictable (a stale read only delays the eviction to the next
  // release); written under mu_.
  std::atomic<bool> over_capacity_{false};
  std::atomic<uint64_t> wasted_evictions_{0};

  // The drain scheduler's state (budget_drain.cc).
  const std::function<std::chrono::steady_clock::time_point()> now_;
  std::atomic<int64_t> drain_after_ns_;
  // Reservations waiting for room (WhenFull::kWait), oldest arrival first.
  std::vector<Waiter*> queue_ MC_GUARDED_BY(mu_);
  uint64_t next_ticket_ MC_GUARDED_BY(mu_) = 0;
  // The waiter whose drain runs, if any, and the bytes it is owed: no other
  // reservation may use them.
  Waiter* drain_ MC_GUARDED_BY(mu_) = nullptr;
  uint64_t owed_ MC_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> drains_{0};
  std::atomic<int64_t> recent_drains_ns_{0};
  // When the drain that runs began (drain_ set and its set covering it).
  std::chrono::steady_clock::time_point drain_started_ MC_GUARDED_BY(mu_){};
  std::atomic<uint64_t> queued_behind_drain_{0};
};

}  // namespace modelcache

#endif  // MODELCACHE_CORE_BUDGET_H_
