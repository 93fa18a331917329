// Record: one model's entry in a cache, and the states it moves through.
// The state machine itself is described in cache_internal.h.
#ifndef MODELCACHE_SRC_CORE_RECORD_H_
#define MODELCACHE_SRC_CORE_RECORD_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "modelcache/core/cache.h"

namespace modelcache::detail {

enum class RecordState { kLoading, kResident, kUnloading, kGone, kFailed };

// Fields are guarded by the mutex of shard `shard` (one mutex per shard; the
// analysis cannot name it from here, so the rule is checked by review and by
// CheckInvariants). `key`, `id`, `shard` are immutable. `value`, `bytes` are
// not modified while a lease exists, which is what lets Lease read them
// without a lock.
//
// Layout: a hit reads and writes only the first cache line (state, flags,
// lease count, the policy's inputs, priority and sequence), and records are
// cache-line aligned so that no other allocation shares that line. Two
// threads hitting different models then never contend for a line, and a
// thread hitting a model last touched by another core moves one line, not
// three.
struct alignas(64) Record {
  Record(std::string k, uint64_t i, uint32_t s)
      : key(std::move(k)), id(i), shard(s) {}

  // ---- hot: read and written by every hit and lease release ----
  RecordState state = RecordState::kLoading;
  bool retired = false;
  bool pinned = false;
  bool stale = false;          // invalidated while loading
  bool unload_failed = false;  // retired record whose unloader threw
  bool in_order = false;
  // Its bytes are in its shard's running count of evictable bytes
  // (Shard::evictable_bytes): kept equal to Evictable() by
  // CacheCore::RecountLocked after every change of state, leases, pin or
  // retirement.
  bool counted_evictable = false;
  // In a drain set (budget_drain.cc): takes no new lease until the drain
  // ends or evicts it. Read by every hit, so it lives here.
  bool draining = false;
  int leases = 0;
  uint64_t bytes = 0;  // reserved while loading, resident size after
  uint64_t accesses = 0;
  double load_seconds = 0;
  double priority = 0;  // current order key
  uint64_t seq = 0;
  Clock::time_point last_use{};

  // ---- cold ----
  double order_priority = 0;  // key of its entry in the order set
  uint64_t order_seq = 0;
  const std::string key;
  const uint64_t id;
  const uint32_t shard;
  int waiters = 0;  // acquires waiting for this record's load
  // While draining: the request the drain is for, as a timeout names it.
  std::string drain_for;
  // Acquires queued behind this record's drain.
  int drain_waiters = 0;
  // While loading: what its key's last load took, on the budget's clock
  // (Shard::load_times; zero when never measured), as its reservation's
  // ReserveOptions::expected_load.
  std::chrono::nanoseconds expected_load{0};
  // Its load was started by a request (the owner's AcquireOptions::request),
  // not a Prefetch: a demand load.
  bool for_request = false;
  // A request's lease ended while another lease (a Prefetch's own) was
  // still out: the keep-alive plans when that one ends.
  bool request_ended = false;
  // Callers waiting for this record to leave a busy state: an acquire or a
  // removal waiting for its unload, an acquire waiting for a stale
  // (invalidated) load, a removal waiting for its load.
  int unload_waiters = 0;
  // The thread running this record's loader (kLoading) or unloader
  // (kUnloading); meaningless in other states. A call from that thread that
  // would wait for this record would wait for itself: it fails instead.
  std::thread::id owner;
  std::shared_ptr<void> value;
  std::function<void()> unload;
  // The load's outcome, for its waiters: `error` (null on success) is set
  // before Complete() and never changes after it.
  std::exception_ptr error;
  std::atomic<bool> completed{false};
  // Made by the first waiter only (most loads have none); completed by the
  // load, which reads it after the state change that stops new waiters.
  std::shared_ptr<std::promise<void>> done_promise;
  std::shared_future<void> done;
  void Complete(const std::shared_ptr<std::promise<void>>& promise) {
    completed.store(true, std::memory_order_release);
    if (promise) promise->set_value();
  }
};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(Record, last_use) + sizeof(Clock::time_point) <= 64,
              "a hit must touch only the record's first cache line");
#pragma GCC diagnostic pop

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_RECORD_H_
