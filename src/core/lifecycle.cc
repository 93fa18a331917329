// The record lifecycle, its way in: a record enters the map, loads and
// becomes resident, and is found again (acquire, wait, join, load, fail,
// lookup, prefetch), with the helpers that every transition uses (the policy
// inputs a touch updates, retirement, the check that a thread never waits
// for itself). Its way out (release, retire, unload, evict, remove, pin,
// expire, prune, shutdown) is lifecycle_unload.cc: the two files together
// are every transition of the state machine described in cache_internal.h,
// and can be checked against the invariants there side by side. The
// transitions that other files start (the budget's evictions, victims.cc;
// the keep-alive's unloads and prewarms, keep_alive_actions.cc) go through
// EvictIfEvictable and Prefetch: no record changes state anywhere else.
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
      budget_(options_.budget
                  ? options_.budget
                  : std::make_shared<Budget>(
                        options_.capacity_bytes, options_.name,
                        BudgetOptions{.drain_after = options_.drain_after,
                                      .now = options_.now})),
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
  // When this request came: the caller's, or stamped when it first queues
  // behind a drain, so that it keeps its place when it goes on to load.
  std::optional<Clock::time_point> arrival = options.arrival;
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
        if (auto load = shard.load_times.find(hashed);
            load != shard.load_times.end()) {
          owned->expected_load = load->second;
        }
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
            if (r->draining) [[unlikely]] {
              // Its room is owed to an older request: queue, no lease.
              busy = it->second.record;
              WaitWhileDraining(shard, busy, options, &arrival);
              continue;
            }
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
      return LoadAsOwner(shard, owned, expected_bytes, loader, options,
                         arrival);
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
    if (!WaitForChange(shard, options, &rec->unload_waiters, [&] {
          shard.mu.AssertHeld();
          return rec->state == busy;
        })) {
      --rec->unload_waiters;
      throw Error(
          ErrorCode::kTimeout,
          "timed out waiting for " + std::string(what) + " '" + rec->key + "'");
    }
  }
  --rec->unload_waiters;
}

bool CacheCore::WaitForChange(Shard& shard, const AcquireOptions& options,
                              int* waiters,
                              const std::function<bool()>& still_waiting) {
  const Clock::time_point wake = NextWake(options);
  if (shard.changed.WaitUntil(&shard.mu, wake) || !still_waiting()) {
    return true;
  }
  if (wake >= options.deadline) return false;
  // The interrupt check runs without the shard lock; the caller looks at
  // the state afresh after it, as after any wake-up.
  shard.mu.Unlock();
  try {
    options.interrupt.check();
  } catch (...) {
    shard.mu.Lock();
    --*waiters;
    throw;
  }
  shard.mu.Lock();
  return true;
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
                             const AcquireOptions& options,
                             const std::optional<Clock::time_point>& arrival) {
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
  const std::string for_what =
      "'" + rec->key + "' in cache '" + options_.name + "'";
  try {
    budget_->Reserve(expected_bytes,
                     ReserveOptions{.when_full = options.when_full,
                                    .deadline = options.deadline,
                                    .interrupt = &options.interrupt,
                                    .evict_below = evict_below,
                                    .for_record = rec->id,
                                    .grow_capacity = options.grow_capacity,
                                    .arrival = arrival,
                                    .holds = options.holds,
                                    .for_what = for_what,
                                    .expected_load = rec->expected_load});
  } catch (...) {
    FailLoad(shard, rec, std::current_exception(), 0, false);
    throw;
  }
  {
    base::MutexLock lock(&shard.mu);
    rec->bytes = expected_bytes;
  }

  const auto start = Clock::now();
  const auto budget_start = budget_->Now();
  Loaded loaded;
  try {
    loaded = loader();
  } catch (...) {
    FailLoad(shard, rec, std::current_exception(), expected_bytes, true);
    throw;
  }
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  const std::chrono::nanoseconds budget_seconds = budget_->Now() - budget_start;

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
                                      .for_record = rec->id,
                                      .arrival = arrival,
                                      .holds = options.holds,
                                      .for_what = for_what,
                                      .expected_load = rec->expected_load});
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
    if (shard.load_times.size() >= kHistoryKeysPerShard &&
        !shard.load_times.contains(rec->key)) {
      shard.load_times.clear();
    }
    shard.load_times[rec->key] = budget_seconds;
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
  // Leased, not evictable, but a drain may take it now: a waiter no drain
  // could serve while it loaded looks again.
  if (!retired_now) budget_->NotifyDrainable();
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
      it->second.record->state != RecordState::kResident ||
      it->second.record->draining) {
    // A draining model is not leased: it is owed to an older request.
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

}  // namespace modelcache::detail
