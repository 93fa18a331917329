// KeepAliveDriver: carries out a KeepAlivePolicy's plans for one cache, on
// the cache's clock. Not part of the public API (CacheOptions::keep_alive is).
//
// Design note
// -----------
// Per key (canonical), the driver keeps the model's IdleHistory, when its
// last request ended, the expected load time (its last load's), and a
// generation that every request arrival advances. The cache calls it at two
// moments, under the key's shard mutex (the driver's mutex is a leaf):
//   OnRequest  a request for the key arrived: its generation moves on, which
//              cancels every action planned before; if no other request was
//              in progress, the time since the last one ended is an idle time.
//   OnIdle     the key's last request ended (its last lease, not a
//              Prefetch's): the policy plans, and the plan's actions are
//              queued with the current generation.
// Actions, run by RunDue at or after their time:
//   unload     evicts the key if it is still idle, unpinned and its generation
//              unchanged (counted as an expiration, EventType::kExpired);
//   prewarm    Prefetch of the key through CacheOptions::prewarm_source, if
//              its generation is unchanged and it is absent.
// A prewarm never delays a demand load: it starts only while no demand load
// is in flight in the cache and fewer than max_prewarms prewarms are; it
// never waits for room (WhenFull::kFail) and evicts nothing, or (for a policy
// that says so) only idle models ranked below it. A prewarm that comes due
// while a demand load runs waits in `deferred_` until none does.
//
// Who calls RunDue: with the real clock, a thread of the driver's own, which
// sleeps until the next action is due or a demand load ends; with an
// injected clock, whoever moves that clock (ModelCache::RunKeepAlive). The
// thread never holds the driver's mutex while it calls into the cache, and
// Stop() joins it before the cache unloads anything.
#ifndef MODELCACHE_SRC_CORE_KEEP_ALIVE_DRIVER_H_
#define MODELCACHE_SRC_CORE_KEEP_ALIVE_DRIVER_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <queue>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "modelcache/base/mutex.h"
#include "modelcache/core/cache.h"
#include "modelcache/core/keep_alive.h"

namespace modelcache::detail {

class CacheCore;

class KeepAliveDriver {
 public:
  // `core` outlives the driver. With `own_thread`, a thread runs the actions
  // as they come due on the real (steady) clock.
  KeepAliveDriver(CacheCore* core,
                  std::shared_ptr<const KeepAlivePolicy> policy,
                  int max_prewarms, bool own_thread);
  ~KeepAliveDriver();
  KeepAliveDriver(const KeepAliveDriver&) = delete;
  KeepAliveDriver& operator=(const KeepAliveDriver&) = delete;

  // Stops and joins the thread; no action runs after it returns.
  void Stop() MC_EXCLUDES(mu_);

  // See the design note. Called under the key's shard mutex.
  void OnRequest(std::string_view key, bool request_in_progress, double now_ms)
      MC_EXCLUDES(mu_);
  void OnIdle(std::string_view key, double now_ms) MC_EXCLUDES(mu_);
  // A load of `key` completed, taking `load_ms`.
  void OnLoaded(std::string_view key, double load_ms) MC_EXCLUDES(mu_);
  // The cache's demand loads in flight fell to zero: deferred prewarms may
  // start.
  void OnNoDemandLoads() MC_EXCLUDES(mu_);

  // Runs every action due at `now_ms` (and deferred prewarms that may start
  // now); returns how many did something (an unload or a prewarm).
  // REQUIRES: no lock of the cache is held.
  size_t RunDue(double now_ms) MC_EXCLUDES(mu_);

 private:
  struct KeyState {
    IdleHistory idle;
    double last_end_ms = -std::numeric_limits<double>::infinity();
    double last_request_ms = 0;
    double load_ms = 0;
    uint64_t generation = 0;
  };
  enum class ActionKind { kUnload, kPrewarm };
  struct Action {
    double at_ms;
    uint64_t seq;
    ActionKind kind;
    std::string key;
    uint64_t generation;
    bool operator>(const Action& o) const {
      return at_ms != o.at_ms ? at_ms > o.at_ms : seq > o.seq;
    }
  };

  KeyState& StateLocked(std::string_view key, double now_ms) MC_REQUIRES(mu_);
  void QueueLocked(double at_ms, ActionKind kind, std::string_view key,
                   uint64_t generation) MC_REQUIRES(mu_);
  bool CurrentLocked(const Action& action) MC_REQUIRES(mu_);
  // Runs one action outside the lock; true when it did something.
  bool Run(const Action& action) MC_EXCLUDES(mu_);
  void ThreadMain() MC_EXCLUDES(mu_);

  CacheCore* const core_;
  const std::shared_ptr<const KeepAlivePolicy> policy_;
  const int max_prewarms_;

  base::Mutex mu_;
  base::CondVar wake_;
  bool stop_ MC_GUARDED_BY(mu_) = false;
  uint64_t seq_ MC_GUARDED_BY(mu_) = 0;
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const {
      return std::hash<std::string_view>{}(s);
    }
  };
  struct NameEq {
    using is_transparent = void;
    bool operator()(std::string_view a, std::string_view b) const {
      return a == b;
    }
  };
  absl::flat_hash_map<std::string, KeyState, NameHash, NameEq> keys_
      MC_GUARDED_BY(mu_);
  std::priority_queue<Action, std::vector<Action>, std::greater<>> actions_
      MC_GUARDED_BY(mu_);
  std::vector<Action> deferred_ MC_GUARDED_BY(mu_);
  int prewarms_in_flight_ MC_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_KEEP_ALIVE_DRIVER_H_
