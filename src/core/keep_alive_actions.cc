// The cache's side of keep-alive: the actions the KeepAliveDriver
// (keep_alive_driver.h) carries out on a policy's plans, and the call that
// runs those that are due on an injected clock (ModelCache::RunKeepAlive).
// An unload is an eviction counted as an expiry (EvictIfEvictable), a
// prewarm a Prefetch through CacheOptions::prewarm_source: neither changes a
// record's state itself. What the driver hears from the cache (a request, a
// last lease ending, a load ending) is sent by the lifecycle
// (NoteRequestLocked, ReleaseLease, LoadEnded).
#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "cache_internal.h"

namespace modelcache::detail {

size_t CacheCore::RunKeepAlive() {
  return keep_alive_ ? keep_alive_->RunDue(NowMs()) : 0;
}

bool CacheCore::KeepAliveUnload(const std::string& key) {
  Shard& shard = ShardFor(key);
  std::shared_ptr<Record> rec;
  {
    base::MutexLock lock(&shard.mu);
    auto it = shard.map.find(key);
    if (it == shard.map.end() || !it->second.record ||
        !Evictable(*it->second.record)) {
      return false;
    }
    rec = it->second.record;
  }
  return EvictIfEvictable(rec, EventType::kExpired, Clock::time_point::max()) ==
         EvictOutcome::kEvicted;
}

bool CacheCore::KeepAlivePrewarm(const std::string& key,
                                 bool evict_lower_ranked) {
  if (!options_.prewarm_source || shut_down_.load()) return false;
  {
    Shard& shard = ShardFor(key);
    base::MutexLock lock(&shard.mu);
    if (shard.map.find(key) != shard.map.end()) return false;  // not absent
  }
  std::optional<PrewarmSource> source;
  try {
    source = options_.prewarm_source(key);
  } catch (...) {
    // User code, like an event callback: caught and counted, and the
    // prewarm is dropped; the request, when it comes, loads.
    callback_errors_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  if (!source || !source->loader) return false;
  try {
    AcquireOptions options;
    options.when_full = WhenFull::kFail;
    options.evict = evict_lower_ranked;
    options.evict_only_lower_ranked = evict_lower_ranked;
    Prefetch(key, source->expected_bytes, source->loader, options);
  } catch (...) {
    // No room (the prewarm never waits for it, by design), or a failing
    // loader, counted as a load failure and reported as kLoadFailed: the
    // prewarm is dropped; the request, when it comes, loads.
    return false;
  }
  prewarms_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace modelcache::detail
