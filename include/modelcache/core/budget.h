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
#include <string>
#include <unordered_set>
#include <vector>

#include "modelcache/base/mutex.h"
#include "modelcache/core/policy.h"

namespace modelcache {

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
  std::shared_ptr<void> handle;  // keeps the member's record alive
};

enum class EvictOutcome { kEvicted, kChanged, kUnloadFailed };

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
};

class Budget {
 public:
  explicit Budget(uint64_t capacity_bytes, std::string name = "budget");
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

  const std::string name_;
  PolicyClock clock_;

  mutable base::Mutex mu_;
  base::CondVar
      changed_;  // signalled when bytes are released or become evictable
  uint64_t capacity_ MC_GUARDED_BY(mu_);
  uint64_t used_ MC_GUARDED_BY(mu_) = 0;
  uint64_t high_water_ MC_GUARDED_BY(mu_) = 0;
  uint64_t change_count_ MC_GUARDED_BY(mu_) = 0;
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
};

}  // namespace modelcache

#endif  // MODELCACHE_CORE_BUDGET_H_
