// The books of Daemon::Impl (daemon_internal.h) that outlive a daemon: the
// record of the copies it made (daemon_record.cc), a predecessor's copies
// and their reclaims (daemon_reclaim.cc, daemon_orphans.cc), systemd's fd
// store, and the takeover's state (daemon_handover.cc). Daemon::Impl
// inherits them; what guards what: the design note in daemon_internal.h.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_RECLAIM_BOOKS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_RECLAIM_BOOKS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "copy.h"
#include "daemon_entries.h"
#include "handover.h"
#include "lock_ranks.h"
#include "modelcache/base/mutex.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/core/cache.h"
#include "systemd.h"

namespace modelcache::serve::detail {

struct ReclaimBooks {
  using Clock = modelcache::Clock;

  // Loop-only: the predecessor's copies (by index) whose adoption is in
  // flight, each with the reclaims of it that wait; how many are in flight,
  // and whether an orphan booking waits for the last to end.
  std::map<size_t, std::vector<detail::DeferredReclaim>> adopting_;
  int adoptions_in_flight_ = 0;
  bool rebook_after_adoptions_ = false;

  // Set (with DaemonOptions::systemd, under systemd) in the constructor.
  std::optional<detail::SystemdNotifier> notifier_;
  std::vector<detail::ListenedFd> stored_;
  // Set once shutting down (or handed over): frees no longer change the
  // record or the fd store.
  std::atomic<bool> keep_record_{false};
  std::atomic<bool> fd_store_error_logged_{false};
  mutable base::Mutex record_mu_{
      base::LockRank{detail::kLeafLockRank, "record_mu_"}};
  // The copies whose memfds systemd's store holds, by first header memfd.
  std::set<detail::MemfdId> in_fd_store_ MC_GUARDED_BY(record_mu_);
  // This daemon's copies, by their first header memfd.
  struct RecordEntry {
    detail::RecordedCopy copy;
    const char* origin = "loaded";  // ModelCopy::origin
    uint64_t bytes = 0;
  };
  std::map<detail::MemfdId, RecordEntry> record_ MC_GUARDED_BY(record_mu_);
  // Adoptions go through the store's loader: not loads to count.
  std::atomic<uint64_t> adoptions_{0};
  std::atomic<uint64_t> adopted_bytes_{0};
  std::atomic<bool> record_error_logged_{false};
  // Record writes that failed (modelcache_record_write_failures_total):
  // each leaves a successor without the copies made since.
  std::atomic<uint64_t> record_write_failures_{0};
  // Held across a record write, from the snapshot to the rename: one writer
  // at a time, so writers on the pool's threads and the background thread
  // never share the temporary file, and the file ends with the newest
  // snapshot. Never taken on the loop (its writes go through Later).
  // Order: record_write_mu_ -> record_mu_.
  base::Mutex record_write_mu_ MC_ACQUIRED_BEFORE(record_mu_){
      base::LockRank{detail::kOuterLockRank, "record_write_mu_"}};
  std::atomic<bool> record_writes_{true};
  // Loop-only after start: the predecessor's copies, by each data memfd
  // (copy, file index); the models awaiting a reclaim and until when.
  std::vector<detail::RecordedCopy> predecessor_;
  std::map<detail::MemfdId, std::pair<size_t, size_t>> predecessor_by_data_;
  std::set<std::string> reclaimable_;
  Clock::time_point grace_end_ = Clock::time_point::max();
  std::atomic<int> reclaiming_{0};  // reclaimable_.size(), for /readyz
  // Lease ids below this were handed out by a predecessor.
  uint64_t first_lease_ = 0;
  std::atomic<uint64_t> reclaims_accepted_{0};
  std::atomic<uint64_t> reclaims_refused_{0};
  std::atomic<uint64_t> bytes_reclaimed_{0};
  std::atomic<uint64_t> bytes_refused_{0};
  std::atomic<uint64_t> bytes_taken_over_{0};
  std::atomic<double> takeover_seconds_{0};
  std::atomic<bool> handed_over_{false};
  // ---- takeover (daemon_handover.cc) ----
  base::Mutex handover_mu_{
      base::LockRank{detail::kOuterLockRank, "handover_mu_"}};
  std::vector<std::pair<std::string, int>> handover_listeners_
      MC_GUARDED_BY(handover_mu_);
  std::function<void()> disown_listeners_ MC_GUARDED_BY(handover_mu_);
  std::map<std::string, base::UniqueFd> taken_listeners_
      MC_GUARDED_BY(handover_mu_);
  // The old daemon's side of a takeover (Impl::ContinueHandover): the
  // connection that asked (0: none), its request, whether the handover
  // went out, and until when the old daemon waits for the commit.
  uint64_t handover_conn_ = 0;
  uint64_t handover_request_ = 0;
  bool handover_sent_ = false;
  Clock::time_point handover_deadline_ = Clock::time_point::max();
  // Store leases on the copies handed over: none is evicted meanwhile.
  std::vector<Lease> handover_leases_;
};

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_RECLAIM_BOOKS_H_
