// What a cache can say about itself: counters, entries, the holders named in
// a capacity error, the bytes no eviction could free, and the invariant
// check. (What evicting could free is the victim search's: victims.cc.)
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cache_internal.h"
#include "format.h"

namespace modelcache::detail {

void InvariantFailed(const char* what, const std::string& key) {
  std::fprintf(stderr, "modelcache: invariant violated: %s (key '%s')\n", what,
               key.c_str());
  std::abort();
}

CacheStats CacheCore::Stats() {
  CacheStats stats;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
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
  });
  stats.capacity_bytes = budget_->capacity();
  stats.budget_used_bytes = budget_->used();
  stats.high_water_bytes = budget_->high_water();
  stats.wasted_evictions = budget_->wasted_evictions();
  stats.prewarms = prewarms_.load(std::memory_order_relaxed);
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
  return EntryInfo{r.key,
                   state,
                   r.bytes,
                   r.leases,
                   r.waiters + r.unload_waiters + r.drain_waiters,
                   r.pinned,
                   r.accesses,
                   r.last_use,
                   r.draining,
                   r.draining ? r.drain_for : std::string()};
}
}  // namespace

std::vector<EntryInfo> CacheCore::Entries() {
  std::vector<EntryInfo> entries;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    for (const auto& [key, slot] : shard.map) {
      if (slot.record) entries.push_back(InfoOf(*slot.record));
    }
    for (const auto& [ptr, rec] : shard.retired) {
      entries.push_back(InfoOf(*rec));
    }
  });
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
    MC_INVARIANT(!alias_target_.contains(target), "alias of an alias", alias);
    MC_INVARIANT(!aliases_of_.contains(alias), "an alias is a target", alias);
  }
  ForEachShard([&](Shard& shard, size_t index) {
    shard.mu.AssertHeld();
    alias_mu_.AssertHeld();  // taken above, for the whole walk
    size_t ordered_records = 0;
    uint64_t evictable_bytes = 0;  // I9, counted afresh
    for (const auto& [key, slot] : shard.map) {
      if (!slot.record) {
        auto target = alias_target_.find(key);
        MC_INVARIANT(
            target != alias_target_.end() && target->second == slot.alias_of,
            "alias slot out of step with the alias table", key);
        ++alias_slots;
        continue;
      }
      const Record& r = *slot.record;
      MC_INVARIANT(r.key == key, "record filed under another key", key);  // I1
      MC_INVARIANT(r.shard == index, "record in the wrong shard", key);
      MC_INVARIANT(!r.retired, "retired record still in the map", key);
      MC_INVARIANT(r.state == RecordState::kLoading ||
                       r.state == RecordState::kResident ||
                       r.state == RecordState::kUnloading,
                   "record in the map in a final state", key);
      MC_INVARIANT(r.leases >= 0 && r.waiters >= 0, "negative count", key);
      // I2: filed in the order iff resident or unloading.
      const char* order_error =
          shard.order.Check(r, r.state != RecordState::kLoading);
      MC_INVARIANT(order_error == nullptr, order_error, key);
      if (r.in_order) ++ordered_records;
      if (r.state == RecordState::kLoading) {
        MC_INVARIANT(r.leases == 0, "lease on a record still loading", key);
      }
      if (r.state == RecordState::kUnloading) {  // I5, as of now
        MC_INVARIANT(r.leases == 0, "lease on a record being unloaded", key);
      }
      // I10: only a resident record drains (the eviction for its drain
      // clears the flag as it starts the unload).
      MC_INVARIANT(!r.draining || r.state == RecordState::kResident,
                   "a record drains while not resident", key);
      accounted += r.bytes;  // I4 (a loading record's bytes = reservation)
      MC_INVARIANT(r.counted_evictable == Evictable(r),
                   "record's evictability miscounted", key);  // I9
      if (Evictable(r)) evictable_bytes += r.bytes;
    }
    MC_INVARIANT(shard.evictable_bytes.load(std::memory_order_relaxed) ==
                     evictable_bytes,
                 "running count of evictable bytes out of step", "");  // I9
    MC_INVARIANT(shard.order.size() == ordered_records,
                 "order has entries for records not in the map", "");
    MC_INVARIANT(shard.history.size() <= kHistoryKeysPerShard &&
                     (history_length_ > 0 || shard.history.empty()),
                 "request histories past their bound", "");  // I8
    for (const auto& [ptr, rec] : shard.retired) {           // I3
      MC_INVARIANT(rec->retired && !rec->in_order, "retired record misfiled",
                   rec->key);
      MC_INVARIANT(!rec->counted_evictable,
                   "retired record counted as evictable", rec->key);  // I9
      MC_INVARIANT(rec->state != RecordState::kUnloading || rec->leases == 0,
                   "lease on a retired record being unloaded", rec->key);  // I5
      MC_INVARIANT(rec->leases > 0 || rec->unload_failed ||
                       rec->state == RecordState::kUnloading,
                   "retired record without leases not freed", rec->key);
      accounted += rec->bytes;
    }
  });
  MC_INVARIANT(alias_slots == alias_target_.size(), "alias without a slot", "");
  return accounted;
}

void CacheCore::DescribeHolders(std::vector<std::string>* out,
                                uint64_t exclude) {
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    auto describe = [&](const Record& r) {
      // Only what holds memory: not a reservation still looking for room,
      // and never the refused request itself.
      if (r.bytes == 0 || r.id == exclude) return;
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
      if (r.draining) {
        why += (why.empty() ? "" : ", ") + std::string("draining for ") +
               r.drain_for;
      }
      if (why.empty()) why = "evictable";
      out->push_back("'" + r.key + "' (" + FormatBytes(r.bytes) + ", " + why +
                     ")");
    };
    for (const auto& [key, slot] : shard.map) {
      if (slot.record) describe(*slot.record);
    }
    for (const auto& [ptr, rec] : shard.retired) describe(*rec);
  });
}

uint64_t CacheCore::UnevictableBytes() {
  uint64_t bytes = 0;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    for (const auto& [key, slot] : shard.map) {
      if (slot.record && !Evictable(*slot.record)) bytes += slot.record->bytes;
    }
    for (const auto& [ptr, rec] : shard.retired) bytes += rec->bytes;
  });
  return bytes;
}

}  // namespace modelcache::detail
