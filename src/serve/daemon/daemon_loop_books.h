// The loop's books of Daemon::Impl (daemon_internal.h): its connections,
// waiters and load queue (daemon_connections.cc, daemon_waiters.cc); what
// other threads hand it (daemon.cc); and the threads beside it, the pool,
// the expiry thread and the background thread (daemon_threads.cc).
// Daemon::Impl inherits them; what guards what: the design note in
// daemon_internal.h.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_LOOP_BOOKS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_LOOP_BOOKS_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "daemon_entries.h"
#include "lock_ranks.h"
#include "modelcache/base/mutex.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/core/cache.h"

namespace modelcache::serve::detail {

// Loop-only.
struct LoopState {
  using Clock = modelcache::Clock;

  std::unordered_map<uint64_t, std::unique_ptr<detail::Connection>> conns_;
  uint64_t next_connection_ = 1;
  std::vector<uint64_t> doomed_;
  std::unordered_map<uint64_t, detail::Waiter> waiters_;
  std::multimap<Clock::time_point, uint64_t> deadlines_;
  uint64_t next_waiter_ = 1;
  std::unordered_map<std::string, detail::ModelQueue> queues_;
  // (-priority, order) -> model, or a prefetch task, with when it came
  // (its oldest waiter's arrival): one queued past drain_after goes first
  // (NextQueued).
  struct Queued {
    std::string model;
    std::shared_ptr<detail::Task> prefetch;
    Clock::time_point arrival{};
  };
  std::map<std::pair<int, uint64_t>, Queued> slot_queue_;
  uint64_t next_order_ = 0;
  int running_ = 0;
  uint64_t next_task_ = 1;
  std::unordered_map<uint64_t, detail::OrphanGroup> orphan_groups_;
  uint64_t next_group_ = 1;
  std::map<pid_t, base::UniqueFd> restart_pids_;
  Clock::time_point next_rescan_ = Clock::time_point::max();
  bool stopping_ = false;      // shutdown begun on the loop
  bool reads_paused_ = false;  // DaemonOptions::test_pause_reads_fd
};

// What other threads hand the loop.
struct LoopInbox {
  // Cross-thread requests to the loop, woken through event_fd_.
  std::atomic<bool> shutdown_requested_{false};
  std::atomic<bool> reload_requested_{false};
  std::atomic<bool> shutting_down_{false};  // read by tasks' checks
  base::Mutex inbox_mu_{base::LockRank{detail::kLeafLockRank, "inbox_mu_"}};
  std::vector<std::shared_ptr<detail::Task>> completed_
      MC_GUARDED_BY(inbox_mu_);
  struct Command {
    std::string model;
    bool pin = false;
    std::shared_ptr<std::promise<detail::PrefetchResult>> done;
  };
  std::vector<Command> commands_ MC_GUARDED_BY(inbox_mu_);
  std::vector<std::vector<detail::PidMemfds>> rechecked_
      MC_GUARDED_BY(inbox_mu_);
  bool recheck_in_flight_ = false;  // loop-only
  uint64_t booked_orphaned_ = 0;    // loop-only: orphaned_ once applied
  std::vector<detail::Reloaded> reloaded_ MC_GUARDED_BY(inbox_mu_);
  // Adoptions done on the background thread, and those queued and not yet
  // done (the destructor waits for them before it drops the store).
  std::vector<detail::Adoption> adopted_ MC_GUARDED_BY(inbox_mu_);
  int adoptions_queued_ MC_GUARDED_BY(inbox_mu_) = 0;
  base::CondVar adoptions_cv_;
  bool reload_in_flight_ = false;  // loop-only
  bool reload_again_ = false;      // loop-only
  // The background thread applied a capacity that grew.
  std::atomic<bool> capacity_applied_{false};
  // Set when Run() has returned: commands are refused from then on.
  bool loop_done_ MC_GUARDED_BY(inbox_mu_) = false;
  uint64_t health_asked_ MC_GUARDED_BY(inbox_mu_) = 0;
  uint64_t health_answered_ MC_GUARDED_BY(inbox_mu_) = 0;
  base::CondVar health_cv_;
  // AwaitLoopPass: passes asked for, and the last one the loop finished
  // (health_cv_ wakes the askers). pass_serving_: what was asked when the
  // current iteration's epoll_wait began (loop-only).
  // (Written under inbox_mu_, read anywhere.)
  std::atomic<uint64_t> passes_asked_{0};
  std::atomic<uint64_t> passes_done_{0};
  uint64_t pass_serving_ = 0;
  // Loop-only: a read this iteration stopped at kReadsPerWakeup, leaving
  // datagrams in a socket; such an iteration answers no pass.
  bool capped_read_ = false;
};

// The threads beside the loop.
struct Workers {
  // The pool.
  base::Mutex pool_mu_{base::LockRank{detail::kLeafLockRank, "pool_mu_"}};
  base::CondVar pool_cv_;
  std::deque<std::shared_ptr<detail::Task>> pool_queue_ MC_GUARDED_BY(pool_mu_);
  bool pool_stop_ MC_GUARDED_BY(pool_mu_) = false;
  std::vector<std::thread> pool_;

  // An idle TTL (a ttl-<N> policy) unloads a model idle for N: the store
  // expires records only when asked (ModelCache::EvictExpired), so a thread
  // asks every expiry_period_, off the loop (an unload frees a copy's pages).
  std::chrono::nanoseconds expiry_period_{0};  // 0: no TTL, no thread
  base::Mutex expiry_mu_{base::LockRank{detail::kLeafLockRank, "expiry_mu_"}};
  base::CondVar expiry_cv_;
  bool expiry_stop_ MC_GUARDED_BY(expiry_mu_) = false;
  std::thread expiry_;

  // The background thread (Redis's lazyfree): frees copies' files and runs
  // other chores the loop must not wait for, in order. Started last in the
  // constructor; drained and stopped last in the destructor.
  base::Mutex background_mu_{
      base::LockRank{detail::kLeafLockRank, "background_mu_"}};
  base::CondVar background_cv_;
  std::deque<std::function<void()>> chores_ MC_GUARDED_BY(background_mu_);
  bool background_running_ MC_GUARDED_BY(background_mu_) = false;
  bool background_stop_ MC_GUARDED_BY(background_mu_) = false;
  std::thread background_;
};

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_LOOP_BOOKS_H_
