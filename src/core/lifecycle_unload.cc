// The record lifecycle, its way out: a lease ends, a record is retired,
// unloaded, evicted, removed or invalidated, pinned or unpinned, expired,
// pruned, and the cache shuts down. The way in, with a load's own outcomes
// (resident, failed, or retired at once when invalidated meanwhile), and the
// helpers both halves use are in lifecycle.cc. EvictIfEvictable is the one
// eviction step, shared by the budget's evictions (victims.cc), the
// keep-alive's unloads (keep_alive_actions.cc), expiry and Prune.
#include <algorithm>
#include <cassert>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "cache_internal.h"
#include "format.h"
#include "test_hooks.h"

namespace modelcache::detail {

void CacheCore::ReleaseLease(Record* r, bool request_end) {
  Shard& shard = shards_[r->shard];
  std::shared_ptr<Record> to_free;
  bool now_evictable = false;
  {
    base::MutexLock lock(&shard.mu);
    assert(r->leases > 0);
    if (keep_alive_) [[unlikely]] {
      // The model's last request ended: plan its keep-alive, also when a
      // Prefetch's own lease outlasted it.
      if (r->leases == 1 && !r->retired && (request_end || r->request_ended)) {
        r->request_ended = false;
        keep_alive_->OnIdle(r->key, NowMs());
      } else if (request_end) {
        r->request_ended = true;
      }
    }
    if (--r->leases == 0) {
      if (r->retired) {
        auto it = shard.retired.find(r);
        assert(it != shard.retired.end());
        to_free = it->second;
        r->state = RecordState::kUnloading;
        r->owner = std::this_thread::get_id();
      } else {
        RecountLocked(shard, r);
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
    // Over a capacity that shrank, the end of a last lease is when the
    // budget evicts again, retired record or not: a victim whose unloader
    // threw at the shrink is tried again here (Budget::SetCapacity).
    budget_->NotifyEvictable();
  } else if (now_evictable) {
    budget_->NotifyEvictable();
  }
}

void CacheCore::FreeRetired(Shard& shard, const std::shared_ptr<Record>& rec) {
  const std::exception_ptr error = CallUnloader(rec->unload);
  // User-owned state leaves the record under the lock and is dropped after
  // it: whoever drops the record last may hold a shard lock (I7).
  std::shared_ptr<void> value;
  std::function<void()> unload;
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
      unload = std::move(rec->unload);
      bytes = rec->bytes;
    }
  }
  if (error) {
    if (Observed()) {
      Emit({EventType::kUnloadFailed, rec->key, rec->bytes, 0,
            DescribeException(error), error});
    }
    return;
  }
  value.reset();
  unload = nullptr;
  budget_->Release(bytes);
  if (Observed()) Emit({EventType::kRetiredFreed, rec->key, bytes, 0, {}});
}

std::exception_ptr CacheCore::UnloadResident(Shard& shard,
                                             const std::shared_ptr<Record>& rec,
                                             EventType reason) {
  const std::exception_ptr error = CallUnloader(rec->unload);
  // Dropped after the lock, as in FreeRetired.
  std::shared_ptr<void> value;
  std::function<void()> unload;
  uint64_t bytes = 0;
  double priority = 0;
  {
    base::MutexLock lock(&shard.mu);
    assert(rec->state == RecordState::kUnloading && rec->leases == 0);
    if (error) {
      rec->state = RecordState::kResident;  // its order entry never moved
      RecountLocked(shard, rec.get());
      ++shard.counters.failed_unloads;
    } else {
      shard.order.Erase(rec.get());
      auto it = shard.map.find(rec->key);
      assert(it != shard.map.end() && it->second.record == rec);
      shard.map.erase(it);
      rec->state = RecordState::kGone;
      value = std::move(rec->value);
      unload = std::move(rec->unload);
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
            DescribeException(error), error});
    }
    return error;
  }
  value.reset();
  unload = nullptr;
  budget_->Release(bytes);
  if (reason != EventType::kRemoved) {
    PolicyClock& clock = budget_->policy_clock();
    policy_->OnEvict(priority, clock);
    clock.epoch.fetch_add(1, std::memory_order_relaxed);
  }
  if (Observed()) Emit({reason, rec->key, bytes, 0, {}});
  return nullptr;
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
    RecountLocked(shard, rec.get());
  }
  return UnloadResident(shard, rec, reason) ? EvictOutcome::kUnloadFailed
                                            : EvictOutcome::kEvicted;
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
      // A removal ends the record's part in a drain: its bytes come back
      // with no eviction of the drain's, and its queued acquires look again.
      rec->draining = false;
      if (rec->leases > 0) {
        RetireLocked(shard, rec);
        retired = true;
      } else {
        rec->state = RecordState::kUnloading;
        rec->owner = std::this_thread::get_id();
        RecountLocked(shard, rec.get());
      }
      break;
    }
  }
  if (retired) {
    // Acquires queued behind its drain, if it drained, look again.
    shard.changed.NotifyAll();
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
  bool now_drainable = false;
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
    now_drainable = r->pinned && !pinned && r->leases > 0;
    r->pinned = pinned;
    RecountLocked(shard, r);
  }
  if (now_evictable) budget_->NotifyEvictable();
  if (now_drainable) budget_->NotifyDrainable();
}

size_t CacheCore::EvictExpired() {
  if (options_.idle_ttl.count() <= 0) return 0;
  const Clock::time_point idle_before =
      Now() - std::chrono::duration_cast<Clock::duration>(options_.idle_ttl);
  std::vector<std::shared_ptr<Record>> expired;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    for (const auto& [key, slot] : shard.map) {
      if (slot.record && Evictable(*slot.record) &&
          slot.record->last_use < idle_before) {
        expired.push_back(slot.record);
      }
    }
  });
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
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
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
  });
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

void CacheCore::Shutdown() {
  if (shut_down_.exchange(true)) return;
  // No keep-alive action runs from here on: a prewarm in progress ends first.
  if (keep_alive_) keep_alive_->Stop();
  budget_->Unregister(this);
  uint64_t to_release = 0;
  std::vector<std::shared_ptr<Record>> records;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
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
      RecountLocked(shard, slot.record.get());
      records.push_back(slot.record);
    }
    for (auto& [ptr, rec] : shard.retired) {
      assert(rec->leases == 0 && "cache destroyed with a lease out");
      rec->state = RecordState::kGone;
      records.push_back(rec);
    }
    shard.map.clear();
    shard.order.Clear();
    shard.retired.clear();
  });
  for (auto& rec : records) {
    // The cache is going away: its bytes are returned whatever the unloader
    // says, since nobody could ever retry.
    if (auto error = CallUnloader(rec->unload); error && Observed()) {
      Emit({EventType::kUnloadFailed, rec->key, rec->bytes, 0,
            DescribeException(error), error});
    }
    rec->value.reset();
    rec->unload = nullptr;
    to_release += rec->bytes;
  }
  budget_->Release(to_release);
}

}  // namespace modelcache::detail
