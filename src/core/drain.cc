// The cache's side of a drain (budget.h, "Who waits"; the scheduler is
// budget_drain.cc, whose design note gives a record's drain states): marking
// a record draining and ending that, where it stands, evicting it for the
// drain's waiter, and the wait of an acquire queued behind it. A draining
// record is resident and stays in the map and the order; it is only not
// leased (Acquire queues, Lookup and TryAcquire miss) and not evictable by
// anyone but its drain (Evictable() is false for it, so the running count
// of evictable bytes, I9, leaves it out).
#include <memory>
#include <string>
#include <thread>

#include "cache_internal.h"
#include "format.h"
#include "test_hooks.h"

namespace modelcache::detail {

bool CacheCore::SetDraining(const VictimCandidate& victim, bool draining,
                            const std::string& for_what) {
  auto rec = std::static_pointer_cast<Record>(victim.handle);
  Shard& shard = shards_[rec->shard];
  bool now_evictable = false;
  uint64_t bytes = 0;
  {
    base::MutexLock lock(&shard.mu);
    bytes = rec->bytes;
    if (draining) {
      if (rec->state != RecordState::kResident || rec->retired || rec->pinned ||
          rec->draining) {
        return false;
      }
      rec->draining = true;
      rec->drain_for = for_what;
      RecountLocked(shard, rec.get());
    } else {
      if (!rec->draining) return true;
      rec->draining = false;
      rec->drain_for.clear();
      RecountLocked(shard, rec.get());
      now_evictable = Evictable(*rec);
    }
  }
  // Outside the shard's lock, as every event: an observer may act on it
  // (the daemon tells the processes that reuse the copy locally to stop).
  if (Observed()) {
    Emit({draining ? EventType::kDrainStarted : EventType::kDrainEnded,
          rec->key,
          bytes,
          0,
          {}});
  }
  if (draining) return true;
  // The acquires queued behind it go on: to a lease, or (when it was
  // evicted or removed meanwhile) to a load of their own.
  shard.changed.NotifyAll();
  if (now_evictable) budget_->NotifyEvictable();
  return true;
}

DrainState CacheCore::DrainStateOf(const VictimCandidate& victim) {
  auto rec = std::static_pointer_cast<Record>(victim.handle);
  Shard& shard = shards_[rec->shard];
  base::MutexLock lock(&shard.mu);
  switch (rec->state) {
    case RecordState::kGone:
    case RecordState::kFailed:
    case RecordState::kLoading:
      return DrainState::kGone;
    case RecordState::kUnloading:
      // Someone else is unloading it (a removal, a retired record's last
      // lease): its bytes come back, or it is resident again.
      return DrainState::kLeased;
    case RecordState::kResident:
      break;
  }
  if (rec->retired) {
    // Freed when its last lease ends, with no eviction of ours.
    if (rec->unload_failed) return DrainState::kBlocked;
    return rec->leases > 0 ? DrainState::kLeased : DrainState::kGone;
  }
  if (rec->pinned || !rec->draining) return DrainState::kBlocked;
  return rec->leases > 0 ? DrainState::kLeased : DrainState::kIdle;
}

EvictOutcome CacheCore::EvictDrained(const VictimCandidate& victim) {
  auto rec = std::static_pointer_cast<Record>(victim.handle);
  Shard& shard = shards_[rec->shard];
  uint64_t bytes = 0;
  {
    base::MutexLock lock(&shard.mu);
    bytes = rec->bytes;
    if (rec->state != RecordState::kResident || rec->retired || rec->pinned ||
        !rec->draining || rec->leases > 0) {
      return EvictOutcome::kChanged;
    }
    // The drain ends for this record here: evicted, or (if its unloader
    // throws) resident and leasable again at its place in the order.
    rec->draining = false;
    rec->drain_for.clear();
    rec->state = RecordState::kUnloading;
    rec->owner = std::this_thread::get_id();
    RecountLocked(shard, rec.get());
  }
  if (!UnloadResident(shard, rec, EventType::kEvicted)) {
    return EvictOutcome::kEvicted;
  }
  // Its unloader threw: resident and leasable again.
  if (Observed()) {
    Emit({EventType::kDrainEnded, rec->key, bytes, 0, {}});
  }
  return EvictOutcome::kUnloadFailed;
}

void CacheCore::WaitWhileDraining(Shard& shard,
                                  const std::shared_ptr<Record>& rec,
                                  const AcquireOptions& options,
                                  std::optional<Clock::time_point>* arrival) {
  if (!*arrival) *arrival = budget_->Now();
  budget_->CountQueuedBehindDrain();
  ++rec->drain_waiters;
  // Until the drain ends, or the record leaves (evicted for the drain's
  // waiter, removed, retired): then the acquire looks the key up again.
  auto queued = [&] {
    shard.mu.AssertHeld();
    return rec->draining && rec->state == RecordState::kResident &&
           !rec->retired;
  };
  while (queued()) {
    if (auto hook =
            acquire_waits_behind_drain.load(std::memory_order_acquire)) {
      hook();
    }
    if (!WaitForChange(shard, options, &rec->drain_waiters, queued)) {
      --rec->drain_waiters;
      ++shard.counters.misses;
      ++shard.counters.refused;
      throw Error(ErrorCode::kTimeout,
                  "timed out waiting for '" + rec->key + "' in cache '" +
                      options_.name + "': it is draining for " +
                      rec->drain_for + ", which has waited longer");
    }
  }
  --rec->drain_waiters;
}

}  // namespace modelcache::detail
