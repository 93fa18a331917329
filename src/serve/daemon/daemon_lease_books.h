// The lease books of Daemon::Impl (daemon_internal.h): every lease the
// daemon handed out, delegations and their recalls. Daemon::Impl inherits
// them; the code that keeps them is daemon_leases.cc (and GateUnload,
// CoverUncovered, the recalls), and the lease states are in
// daemon_entries.h. What guards what: the design note in daemon_internal.h.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_LEASE_BOOKS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_LEASE_BOOKS_H_

#include <cstdint>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "daemon_entries.h"
#include "lock_ranks.h"
#include "modelcache/base/mutex.h"
#include "modelcache/core/cache.h"

namespace modelcache::serve::detail {

struct LeaseBooks {
  using Clock = modelcache::Clock;

  mutable base::Mutex leases_mu_{
      base::LockRank{detail::kLeafLockRank, "leases_mu_"}};
  std::map<uint64_t, detail::LeaseEntry> leases_ MC_GUARDED_BY(leases_mu_);
  // Uncovered leases by copy (LeaseEntry::lease), the recalls GateUnload
  // asked the loop to send, and whether some uncovered lease in use needs
  // its store lease again.
  std::unordered_map<const void*, std::set<uint64_t>> uncovered_
      MC_GUARDED_BY(leases_mu_);
  std::vector<uint64_t> to_recall_ MC_GUARDED_BY(leases_mu_);
  bool cover_again_ MC_GUARDED_BY(leases_mu_) = false;
  int recalls_outstanding_ MC_GUARDED_BY(leases_mu_) = 0;
  // Connections that said "delegate": their leases in use may be recalled.
  std::unordered_set<uint64_t> delegating_ MC_GUARDED_BY(leases_mu_);
  // Connections that said "drain": they stop local reuse of a draining copy
  // when told (RecallDraining).
  std::unordered_set<uint64_t> heeding_drains_ MC_GUARDED_BY(leases_mu_);
  uint64_t recalls_started_ MC_GUARDED_BY(leases_mu_) = 0;
  base::CondVar recalls_cv_;
  // Loop-only: recalls sent, by deadline.
  std::multimap<Clock::time_point, uint64_t> recall_deadlines_;
  // Loop-only: when CoverUncovered runs again (a copy was being unloaded).
  Clock::time_point next_cover_ = Clock::time_point::max();
  // Lease ids start from the wall clock in microseconds, so that a
  // restarted daemon never hands out an id its predecessor did.
  uint64_t next_lease_ = 0;
};

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_LEASE_BOOKS_H_
