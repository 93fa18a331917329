// The record lifecycle: every transition of the state machine described in
// cache_internal.h, in one file, so that the whole of it can be read (and
// checked against the invariants) in one place: acquire, join, load, fail,
// release, retire, remove, evict, expire, prune, aliases, shutdown.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <future>
#include <limits>
#include <thread>
#include <utility>

#include "cache_internal.h"
#include "format.h"
#include "test_hooks.h"

namespace modelcache::detail {
namespace {

std::atomic<uint64_t> next_record_id{1};

}  // namespace

CacheCore::CacheCore(CacheOptions options)
    : options_(std::move(options)),
      budget_(options_.budget ? options_.budget
                              : std::make_shared<Budget>(
                                    options_.capacity_bytes, options_.name)),
      policy_(options_.policy ? options_.policy : NewLruPolicy()),
      policy_monotone_(policy_->monotone()),
      history_length_(policy_->history_length()),
      policy_time_dependent_(policy_->time_dependent()),
      shard_mask_(
          (size_t{1} << std::clamp(options_.shard_bits, 0, kMaxShardBits)) - 1),
      shards_(new Shard[shard_mask_ + 1]) {
  if (options_.keep_alive) {
    // Last: its thread may call in as soon as it starts.
    keep_alive_ = std::make_unique<KeepAliveDriver>(
        this, options_.keep_alive, options_.max_prewarms,
        /*own_thread=*/!options_.now);
  }
}

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
  // A time-dependent policy ranks at eviction time; the order only keeps
  // the access sequence (a constant priority never decreases).
  if (!policy_time_dependent_) [[likely]] {
    AccessInfo info{r->bytes, r->accesses, r->load_seconds, hint};
    if (history_length_ > 0) [[unlikely]] {
      info = AccessInfoLocked(shard, *r, hint, 0);
    }
    r->priority = policy_->Priority(info, budget_->policy_clock());
  }
  r->seq = ++shard.seq;
  if (!policy_monotone_ && r->in_order) {
    // The new key may be smaller than the filed one: re-file it now.
    shard.order.Refile(r);
  }
}

AccessInfo CacheCore::AccessInfoLocked(Shard& shard, const Record& r,
                                       double hint, double now_seconds) {
  AccessInfo info{r.bytes, r.accesses, r.load_seconds, hint};
  info.now_seconds = now_seconds;
  if (history_length_ > 0) {
    auto it = shard.history.find(std::string_view(r.key));
    if (it != shard.history.end()) info.history = &it->second;
  }
  return info;
}

void CacheCore::RecordRequestLocked(Shard& shard, std::string_view key,
                                    double seconds) {
  auto it = shard.history.find(key);
  if (it == shard.history.end()) {
    if (shard.history.size() >= kHistoryKeysPerShard) {
      // Forget the half least recently requested: amortised O(1) a key.
      std::vector<double> lasts;
      lasts.reserve(shard.history.size());
      for (const auto& [name, history] : shard.history) {
        lasts.push_back(history.last_request_seconds());
      }
      auto median = lasts.begin() + static_cast<ptrdiff_t>(lasts.size() / 2);
      std::nth_element(lasts.begin(), median, lasts.end());
      const double cutoff = *median;
      absl::erase_if(shard.history, [&](const auto& entry) {
        return entry.second.last_request_seconds() <= cutoff;
      });
    }
    it =
        shard.history.emplace(std::string(key), RequestHistory(history_length_))
            .first;
  }
  it->second.Record(seconds);
}

void CacheCore::RetireLocked(Shard& shard, const std::shared_ptr<Record>& r) {
  shard.order.Erase(r.get());
  auto it = shard.map.find(r->key);
  assert(it != shard.map.end() && it->second.record == r);
  shard.map.erase(it);
  r->retired = true;
  RecountLocked(shard, r.get());
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
    // A record waited on while busy. Declared before the lock so that, if
    // this is its last reference, it is dropped after the lock is released.
    std::shared_ptr<Record> busy;
    {
      base::MutexLock lock(&shard.mu);
      auto it = shard.map.find(hashed);
      if (it == shard.map.end()) {
        owned = std::make_shared<Record>(
            std::string(key), next_record_id++,
            static_cast<uint32_t>(&shard - shards_.get()));
        owned->owner = std::this_thread::get_id();
        owned->for_request = options.request;
        if (options.request) demand_loads_.fetch_add(1);
        shard.map.emplace(owned->key, Slot{owned, {}});
        ++shard.counters.misses;
        NoteRequestLocked(shard, key, options.request, options.arrival,
                          /*in_progress=*/false);
      } else if (!it->second.record) {
        alias_target = it->second.alias_of;
      } else {
        Record* r = it->second.record.get();
        switch (r->state) {
          case RecordState::kResident:
            NoteRequestLocked(shard, key, options.request, options.arrival,
                              /*in_progress=*/r->leases > 0);
            TouchLocked(shard, r, options.policy_hint);
            ++r->leases;
            RecountLocked(shard, r);
            ++shard.hits;
            return MakeLease(r);
          case RecordState::kLoading:
            CheckNotOwnThread(*r, "acquired");
            if (r->stale) {
              // Invalidated while loading: this acquire came after the
              // invalidation, so it must not receive the stale model. Wait
              // for that load to end (it is then retired), then load afresh.
              busy = it->second.record;
              WaitWhileBusy(shard, busy, options, "the invalidated load of");
              continue;
            }
            // Join the load in flight; its completion grants us a lease.
            joined = it->second.record;
            if (!joined->done_promise) {
              joined->done_promise = std::make_shared<std::promise<void>>();
              joined->done = joined->done_promise->get_future().share();
            }
            done = joined->done;
            NoteRequestLocked(
                shard, key, options.request, options.arrival,
                /*in_progress=*/joined->waiters > 0 || joined->for_request);
            ++joined->waiters;
            ++shard.counters.misses;
            break;
          case RecordState::kUnloading:
            // An eviction or removal is running its unloader: wait for the
            // outcome, then look again.
            CheckNotOwnThread(*r, "acquired");
            busy = it->second.record;
            WaitWhileBusy(shard, busy, options, "the unload of");
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
    if (joined) return JoinLoad(shard, joined, done, options);
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

namespace {

// When an interruptible wait should next wake: every `every`, so that the
// check runs, and at the deadline.
Clock::time_point NextWake(const AcquireOptions& options) {
  if (!options.interrupt.check) return options.deadline;
  return std::min(options.deadline, Clock::now() + options.interrupt.every);
}

}  // namespace

void CacheCore::WaitWhileBusy(Shard& shard, const std::shared_ptr<Record>& rec,
                              const AcquireOptions& options, const char* what) {
  const RecordState busy = rec->state;
  ++rec->unload_waiters;
  while (rec->state == busy) {
    const Clock::time_point wake = NextWake(options);
    if (!shard.changed.WaitUntil(&shard.mu, wake) && rec->state == busy) {
      if (wake < options.deadline) {
        // The interrupt check runs without the shard lock; the state is
        // looked at afresh after it, as after any wake-up.
        shard.mu.Unlock();
        try {
          options.interrupt.check();
        } catch (...) {
          shard.mu.Lock();
          --rec->unload_waiters;
          throw;
        }
        shard.mu.Lock();
        continue;
      }
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
                          const AcquireOptions& options) {
  // Waits without the shard lock, so that when a load completes its waiters
  // wake in parallel rather than queueing on the mutex one by one.
  std::exception_ptr interrupted;
  bool ready = false;
  for (;;) {
    const Clock::time_point wake = NextWake(options);
    ready = wake == Clock::time_point::max()
                ? (done.wait(), true)
                : done.wait_until(wake) == std::future_status::ready;
    if (ready || wake >= options.deadline) break;
    try {
      options.interrupt.check();
    } catch (...) {
      interrupted = std::current_exception();
      break;
    }
  }
  if (!ready) {
    {
      base::MutexLock lock(&shard.mu);
      if (rec->state == RecordState::kLoading) {
        --rec->waiters;
        if (interrupted) std::rethrow_exception(interrupted);
        throw Error(ErrorCode::kTimeout,
                    "timed out waiting for the load of '" + rec->key + "'");
      }
    }
    // It completed as the wait ended (Complete() may not have run yet, but
    // the outcome is visible under the lock): the lease granted to us
    // stands, or the load's error is ours too. An interrupted caller gives
    // the granted lease straight back.
    if (rec->error) {
      if (interrupted) std::rethrow_exception(interrupted);
      std::rethrow_exception(rec->error);
    }
    Lease lease = MakeLease(rec.get());
    if (interrupted) std::rethrow_exception(interrupted);
    return lease;
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
  double evict_below = std::numeric_limits<double>::infinity();
  if (!options.evict) {
    evict_below = -std::numeric_limits<double>::infinity();
  } else if (options.evict_only_lower_ranked) {
    base::MutexLock lock(&shard.mu);
    AccessInfo own =
        AccessInfoLocked(shard, *rec, options.policy_hint,
                         policy_time_dependent_ ? NowSeconds() : 0);
    own.bytes = expected_bytes;
    own.accesses = 1;
    evict_below = policy_->Priority(own, budget_->policy_clock());
  }
  try {
    budget_->Reserve(expected_bytes,
                     ReserveOptions{.when_full = options.when_full,
                                    .deadline = options.deadline,
                                    .interrupt = &options.interrupt,
                                    .evict_below = evict_below,
                                    .for_record = rec->id,
                                    .grow_capacity = options.grow_capacity});
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
    std::exception_ptr refused;
    try {
      budget_->Reserve(loaded.bytes - expected_bytes,
                       ReserveOptions{.when_full = options.when_full,
                                      .deadline = options.deadline,
                                      .already_reserved = expected_bytes,
                                      .interrupt = &options.interrupt,
                                      .evict_below = evict_below,
                                      .for_record = rec->id});
    } catch (const Error& e) {
      refused = e.code() != ErrorCode::kTooLarge
                    ? std::current_exception()
                    : std::make_exception_ptr(Error(
                          ErrorCode::kTooLarge,
                          "'" + rec->key + "' loaded at " +
                              FormatBytes(loaded.bytes) + " (expected " +
                              FormatBytes(expected_bytes) +
                              "), more than the whole budget: " + e.what()));
    } catch (...) {
      refused = std::current_exception();
    }
    if (refused) {
      // The load is refused either way; its own cleanup error is secondary.
      CallUnloader(loaded.unload);
      loaded.value.reset();
      FailLoad(shard, rec, refused, expected_bytes, false);
      std::rethrow_exception(refused);
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
      shard.order.Insert(rec.get());
    }
  }
  if (auto hook = after_load_published.load(std::memory_order_acquire)) {
    hook(rec->key);
  }
  rec->Complete(waiters_promise);
  shard.changed.NotifyAll();
  Lease lease = MakeLease(rec.get());
  LoadEnded(*rec, seconds);
  if (Observed()) {
    Emit({EventType::kLoaded, rec->key, rec->bytes, seconds, {}});
    if (retired_now) Emit({EventType::kRetired, rec->key, rec->bytes, 0, {}});
  }
  return lease;
}

void CacheCore::LoadEnded(const Record& rec, double seconds) {
  if (keep_alive_ && seconds >= 0)
    keep_alive_->OnLoaded(rec.key, seconds * 1e3);
  if (rec.for_request && demand_loads_.fetch_sub(1) == 1 && keep_alive_) {
    keep_alive_->OnNoDemandLoads();
  }
}

void CacheCore::Prefetch(std::string_view key, uint64_t expected_bytes,
                         const Loader& loader, const AcquireOptions& options) {
  AcquireOptions prefetch = options;
  prefetch.request = false;  // a load ahead of demand, not a request
  Lease lease = Acquire(key, expected_bytes, loader, prefetch);
  Record* r = lease.record_;
  lease.core_ = nullptr;
  lease.record_ = nullptr;
  ReleaseLease(r, /*request_end=*/false);
}

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
  LoadEnded(*rec, -1);
  if (Observed() && loader_threw) {
    Emit({EventType::kLoadFailed, rec->key, 0, 0, std::move(message), error});
  }
}

std::optional<Lease> CacheCore::Lookup(std::string_view key, bool count_miss,
                                       double policy_hint) {
  std::string storage;
  key = Canonical(key, &storage);
  Shard& shard = ShardFor(key);
  base::MutexLock lock(&shard.mu);
  auto it = shard.map.find(key);
  if (it == shard.map.end() || !it->second.record ||
      it->second.record->state != RecordState::kResident) {
    if (count_miss) ++shard.counters.misses;
    return std::nullopt;
  }
  Record* r = it->second.record.get();
  NoteRequestLocked(shard, key, /*request=*/true, /*arrival=*/std::nullopt,
                    /*in_progress=*/r->leases > 0);
  TouchLocked(shard, r, policy_hint);
  ++r->leases;
  RecountLocked(shard, r);
  ++shard.hits;
  return MakeLease(r);
}

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

bool CacheCore::BestVictim(const std::unordered_set<uint64_t>& skip,
                           VictimCandidate* out) {
  bool found = false;
  const double now_seconds = policy_time_dependent_ ? NowSeconds() : 0;
  ForEachShard([&](Shard& shard, size_t) {
    shard.mu.AssertHeld();
    auto usable = [&](const Record& candidate) {
      return Evictable(candidate) && skip.count(candidate.id) == 0;
    };
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
      out->handle = std::shared_ptr<void>(owner, owner.get());
      found = true;
    }
  });
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
    RecountLocked(shard, r);
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
