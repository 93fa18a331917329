// Victim choice: the BudgetMember side of a cache that the budget's
// reservations use to find room. BestVictim offers this cache's lowest
// ranked evictable record (BestDrainVictim the lowest ranked one a drain may
// take, leased or not), EvictableBytes tells whether evicting could make
// a reservation fit (ranking a record as BestVictim does, so the two must
// change together), and TryEvict evicts the chosen victim through the
// lifecycle's eviction step (EvictIfEvictable, lifecycle_unload.cc). What a
// capacity error names, and what no eviction could free, are introspection
// (introspection.cc).
#include <cstdint>
#include <limits>
#include <memory>
#include <unordered_set>

#include "cache_internal.h"

namespace modelcache::detail {

template <typename Usable>
bool CacheCore::LowestRanked(Usable&& usable, VictimCandidate* out) {
  bool found = false;
  const double now_seconds = policy_time_dependent_ ? NowSeconds() : 0;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    Record* r = nullptr;
    double priority = 0;
    if (policy_time_dependent_) {
      // Ranked now: every usable entry of the shard, lowest first, ties to
      // the least recently used.
      shard.order.ForEach([&](Record* candidate) {
        shard.mu.AssertHeld();  // held by ForEachShard's caller frame
        if (!usable(*candidate)) return;
        const double p = policy_->Priority(
            AccessInfoLocked(shard, *candidate, 0, now_seconds),
            budget_->policy_clock());
        if (r == nullptr || p < priority ||
            (p == priority && candidate->seq < r->seq)) {
          r = candidate;
          priority = p;
        }
      });
    } else {
      r = shard.order.FirstWhere(usable);
      if (r != nullptr) priority = r->priority;
    }
    if (r == nullptr) return;
    if (!found || priority < out->priority ||
        (priority == out->priority && r->seq < out->seq)) {
      auto owner = shard.map.find(r->key)->second.record;
      out->priority = priority;
      out->seq = r->seq;
      out->record_id = r->id;
      out->bytes = r->bytes;
      out->handle = std::shared_ptr<void>(owner, owner.get());
      found = true;
    }
  });
  return found;
}

bool CacheCore::BestVictim(const std::unordered_set<uint64_t>& skip,
                           VictimCandidate* out) {
  return LowestRanked(
      [&](const Record& candidate) {
        return Evictable(candidate) && skip.count(candidate.id) == 0;
      },
      out);
}

bool CacheCore::BestDrainVictim(const std::unordered_set<uint64_t>& skip,
                                VictimCandidate* out) {
  // Leased records too: a drain waits for their leases to end.
  return LowestRanked(
      [&](const Record& candidate) {
        return candidate.state == RecordState::kResident &&
               !candidate.retired && !candidate.pinned && !candidate.draining &&
               skip.count(candidate.id) == 0;
      },
      out);
}

EvictOutcome CacheCore::TryEvict(const VictimCandidate& victim) {
  auto rec = std::static_pointer_cast<Record>(victim.handle);
  return EvictIfEvictable(rec, EventType::kEvicted, Clock::time_point::max());
}

uint64_t CacheCore::EvictableBytes(const std::unordered_set<uint64_t>& skip,
                                   double evict_below) {
  uint64_t bytes = 0;
  const bool ranked = evict_below != std::numeric_limits<double>::infinity();
  if (skip.empty() && !ranked) [[likely]] {
    // The budget's check before every eviction: the running counts (I9), one
    // read per shard, whatever the number of resident records.
    for (size_t i = 0; i <= shard_mask_; ++i) {
      bytes += shards_[i].evictable_bytes.load(std::memory_order_relaxed);
    }
    return bytes;
  }
  // A reservation whose victims' unloaders failed (`skip`), or one that may
  // evict only what ranks below it (a keep-alive prewarm): rare, and each
  // record must be looked at.
  const double now_seconds = policy_time_dependent_ ? NowSeconds() : 0;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    for (const auto& [key, slot] : shard.map) {
      const Record* r = slot.record.get();
      if (r == nullptr || !Evictable(*r) || skip.count(r->id) != 0) continue;
      if (ranked) {
        // Ranked as BestVictim ranks it.
        const double priority =
            policy_time_dependent_
                ? policy_->Priority(AccessInfoLocked(shard, *r, 0, now_seconds),
                                    budget_->policy_clock())
                : r->priority;
        if (!(priority < evict_below)) continue;
      }
      bytes += r->bytes;
    }
  });
  return bytes;
}

}  // namespace modelcache::detail
