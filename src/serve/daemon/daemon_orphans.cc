// A predecessor's copies (restart orphans) and the store's capacity: the
// whole machine scanned once at start, then each holder watched by its pid;
// and the leases held for the other processes that map a reclaimed copy
// until they reclaim their own (design note: daemon_internal.h).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <utility>

#include "daemon_internal.h"
#include "event_loop.h"
#include "files.h"
#include "modelcache/base/bytes.h"
#include "modelcache/core/policy.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"
#include "proc_maps.h"
#include "socket.h"

namespace modelcache::serve {

using detail::Connection;
using detail::Disconnect;
using detail::Result;
using detail::Task;

void Daemon::Impl::RescanOrphans() {
  int unreadable = 0;
  const std::vector<detail::MemfdMapping> maps =
      detail::ScanMemfdMappings(memfd_prefix_, ::getpid(), &unreadable);
  std::map<detail::MemfdId, detail::RestartOrphan> found;
  {
    base::MutexLock lock(&live_mu_);
    for (const detail::MemfdMapping& m : maps) {
      const detail::MemfdId id{
          static_cast<uint64_t>(makedev(m.dev_major, m.dev_minor)), m.inode};
      if (live_.count(id) != 0) continue;
      detail::RestartOrphan& o = found[id];
      o.bytes = std::max(o.bytes, weights::PageRoundedBytes(m.reach()));
      o.name = m.name;
      o.pids.insert(m.pid);
    }
  }
  BookRestartOrphans(std::move(found), unreadable, /*now=*/true);
}

void Daemon::Impl::BookRestartOrphans(
    std::map<detail::MemfdId, detail::RestartOrphan> found, int unreadable,
    bool now) {
  uint64_t total = 0;
  std::set<pid_t> pids;
  for (const auto& [id, o] : found) {
    total += o.bytes;
    pids.insert(o.pids.begin(), o.pids.end());
  }
  for (auto it = restart_pids_.begin(); it != restart_pids_.end();) {
    if (pids.count(it->first) == 0) {
      EpollDel(epoll_fd_.get(), it->second.get());
      it = restart_pids_.erase(it);
    } else {
      ++it;
    }
  }
  for (const pid_t pid : pids) WatchPid(pid);
  const uint64_t before = booked_orphaned_;
  booked_orphaned_ = total;
  if (before != total || (!now && rebook_after_adoptions_)) {
    if (now) {
      {
        base::MutexLock lock(&capacity_mu_);
        ApplyCapacity(total);
      }
      store_->budget().EvictOverCapacity();  // only at start can it shrink
    } else if (adoptions_in_flight_ > 0) {
      // An adoption in flight moves some orphaned bytes into the store on
      // the background thread: a capacity computed from these orphans,
      // which still hold them, would take them off the capacity a second
      // time. The last adoption to end books again (FinishReclaim).
      rebook_after_adoptions_ = true;
    } else {
      rebook_after_adoptions_ = false;
      // Off the loop. The orphaned bytes only shrink after start, and
      // /v1/budget shows the new figure only once the store's capacity has
      // grown by it, so used + orphaned stays within the capacity, and room
      // the books show is room an acquire finds.
      Later([this, total] {
        {
          base::MutexLock lock(&capacity_mu_);
          ApplyCapacity(total);
        }
        store_->budget().EvictOverCapacity();
        capacity_applied_ = true;  // the loop retries what orphans held up
        Wake();
      });
    }
  }
  if (total < before && now) RetryBlockedByOrphans();
  if (before != total) {
    Log("orphaned copies of a predecessor: " + FormatBytes(total) + " in " +
        std::to_string(found.size()) + " memfds mapped by " +
        std::to_string(pids.size()) + " processes");
  }
  {
    base::MutexLock lock(&orphans_mu_);
    restart_orphans_ = std::move(found);
    unreadable_maps_ = unreadable;
  }
  if (total > 0) ScheduleRescan();
}

void Daemon::Impl::RetryBlockedByOrphans() {
  // Room came back: loads held up by orphans try again.
  std::vector<std::string> blocked;
  for (auto& [model, q] : queues_) {
    if (q.blocked_by_orphans) {
      q.blocked_by_orphans = false;
      if (!q.waiters.empty()) blocked.push_back(model);
    }
  }
  for (const std::string& model : blocked) Dispatch(model);
}

void Daemon::Impl::RestartPidExited(pid_t pid) {
  std::map<detail::MemfdId, detail::RestartOrphan> orphans;
  int unreadable;
  {
    base::MutexLock lock(&orphans_mu_);
    orphans = restart_orphans_;
    unreadable = unreadable_maps_;
  }
  for (auto it = orphans.begin(); it != orphans.end();) {
    it->second.pids.erase(pid);
    it = it->second.pids.empty() ? orphans.erase(it) : std::next(it);
  }
  BookRestartOrphans(std::move(orphans), unreadable, /*now=*/false);
}

void Daemon::Impl::StartRecheck() {
  if (recheck_in_flight_) return;  // ApplyRecheck schedules the next
  std::set<pid_t> pids;
  for (const auto& [id, group] : orphan_groups_) pids.insert(group.pid);
  {
    base::MutexLock lock(&orphans_mu_);
    for (const auto& [id, o] : restart_orphans_) {
      pids.insert(o.pids.begin(), o.pids.end());
    }
  }
  if (pids.empty()) return;
  recheck_in_flight_ = true;
  Later([this, pids] {
    std::vector<detail::PidMemfds> found;
    for (const pid_t pid : pids) {
      std::vector<std::pair<uint64_t, uint64_t>> held;
      detail::PidMemfds f;
      f.pid = pid;
      f.known = detail::ProcessMemfds(pid, memfd_prefix_, &held);
      f.held.insert(held.begin(), held.end());
      found.push_back(std::move(f));
    }
    {
      base::MutexLock lock(&inbox_mu_);
      rechecked_.push_back(std::move(found));
    }
    Wake();
  });
}

void Daemon::Impl::ApplyRecheck(const std::vector<detail::PidMemfds>& found) {
  recheck_in_flight_ = false;
  CheckOrphanGroups(found);
  std::map<pid_t, const detail::PidMemfds*> by_pid;
  for (const detail::PidMemfds& f : found) {
    if (f.known) by_pid[f.pid] = &f;
  }
  std::map<detail::MemfdId, detail::RestartOrphan> orphans;
  int unreadable;
  {
    base::MutexLock lock(&orphans_mu_);
    orphans = restart_orphans_;
    unreadable = unreadable_maps_;
  }
  bool changed = false;
  for (auto it = orphans.begin(); it != orphans.end();) {
    for (auto p = it->second.pids.begin(); p != it->second.pids.end();) {
      const auto f = by_pid.find(*p);
      if (f != by_pid.end() &&
          f->second->held.count({it->first.dev, it->first.inode}) == 0) {
        p = it->second.pids.erase(p);  // it maps that copy no more
        changed = true;
      } else {
        ++p;
      }
    }
    it = it->second.pids.empty() ? orphans.erase(it) : std::next(it);
  }
  if (changed) {
    BookRestartOrphans(std::move(orphans), unreadable, /*now=*/false);
  } else if (!orphans.empty()) {
    ScheduleRescan();
  }
  if (!orphan_groups_.empty()) ScheduleRescan();
}

void Daemon::Impl::WatchPid(pid_t pid) {
  if (restart_pids_.count(pid) != 0) return;
  base::UniqueFd fd(PidfdOpen(pid));
  if (!fd) return;  // gone already: the next rescan sees it
  ::fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
  EpollAdd(epoll_fd_.get(), fd.get(), EPOLLIN,
           Tagged(kRestartPidTag, static_cast<uint64_t>(pid)));
  restart_pids_.emplace(pid, std::move(fd));
}

void Daemon::Impl::ApplyCapacity(uint64_t orphaned) {
  const uint64_t configured = configured_.load();
  const uint64_t capacity = configured > orphaned ? configured - orphaned : 0;
  // Evicts nothing: its callers evict (Budget::EvictOverCapacity) once they
  // let go of capacity_mu_, so that no thread holds it across evictions.
  if (store_->budget().capacity() != capacity) {
    store_->budget().Resize(capacity);
  }
  orphaned_ = orphaned;
}

bool Daemon::Impl::TooLargeForOrphansOnly(uint64_t bytes) const {
  return orphaned_.load() > 0 && bytes <= configured_.load();
}

std::string Daemon::Impl::OrphanNote() const {
  const uint64_t orphaned = orphaned_.load();
  if (orphaned == 0) return "";
  return "; " + FormatBytes(orphaned) +
         " more are held by copies of a previous daemon that processes still "
         "map (orphaned)";
}

// ---- processes that map a reclaimed copy ----

void Daemon::Impl::HoldForMappers(const detail::ModelCopy& copy,
                                  const std::string& model, bool retired,
                                  const std::set<pid_t>& pids) {
  if (pids.empty()) return;
  std::vector<detail::MemfdId> memfds;
  for (const detail::FileCopy& f : copy.files()) {
    memfds.push_back(f.data_id);
    memfds.push_back(f.header_id);
  }
  for (const pid_t pid : pids) {
    base::UniqueFd pidfd(PidfdOpen(pid));
    if (!pidfd) continue;  // exited: it maps nothing any more
    ::fcntl(pidfd.get(), F_SETFD, FD_CLOEXEC);
    const uint64_t id = ++next_lease_;
    detail::LeaseEntry entry;
    entry.connection = 0;
    entry.orphaned = true;
    entry.held_for_mapper = true;
    entry.delivered = true;
    entry.model = model;
    entry.pid = pid;
    entry.bytes = copy.bytes();
    entry.copy = &copy;
    entry.memfds = memfds;
    entry.retired = retired;
    {
      // No store lease yet: uncovered, so its copy's unloader refuses until
      // CoverUncovered gives it one (a retired copy's stays refused until
      // a released holder's store lease passes to it, ReleaseLease).
      base::MutexLock lock(&leases_mu_);
      auto [it, inserted] = leases_.emplace(id, std::move(entry));
      IndexCoverage(id, it->second);
    }
    const uint64_t group = next_group_++;
    detail::OrphanGroup g;
    g.pidfd = std::move(pidfd);
    g.pid = pid;
    g.leases = {id};
    ++orphaned_leases_;
    EpollAdd(epoll_fd_.get(), g.pidfd.get(), EPOLLIN,
             Tagged(kOrphanPidTag, group));
    orphan_groups_.emplace(group, std::move(g));
    Log("pid " + std::to_string(pid) + " maps the reclaimed copy of '" + model +
        "' too: held in use for it until it reclaims its lease, lets go "
        "or exits");
  }
  CoverUncovered();
  ScheduleRescan();
}

void Daemon::Impl::DropMapperHolds(pid_t pid, const void* copy) {
  std::vector<uint64_t> drop;
  {
    base::MutexLock lock(&leases_mu_);
    for (const auto& [group_id, g] : orphan_groups_) {
      if (g.pid != pid) continue;
      for (const uint64_t id : g.leases) {
        const auto it = leases_.find(id);
        if (it != leases_.end() && it->second.held_for_mapper &&
            it->second.copy == copy) {
          drop.push_back(id);
        }
      }
    }
  }
  if (drop.empty()) return;
  for (auto g = orphan_groups_.begin(); g != orphan_groups_.end();) {
    auto& ids = g->second.leases;
    const size_t before = ids.size();
    std::erase_if(ids, [&](uint64_t id) {
      return std::find(drop.begin(), drop.end(), id) != drop.end();
    });
    orphaned_leases_ -= static_cast<int>(before - ids.size());
    if (ids.empty()) {
      EpollDel(epoll_fd_.get(), g->second.pidfd.get());
      g = orphan_groups_.erase(g);
    } else {
      ++g;
    }
  }
  // After the reclaimed lease took its store lease: the copy never looks
  // unleased in between.
  for (const uint64_t id : drop) ReleaseLease(id);
}

bool Daemon::Impl::ReclaimHeldCopy(detail::Connection& c,
                                   const protocol::Request& r,
                                   const std::vector<detail::MemfdId>& memfds) {
  const void* copy = nullptr;
  bool retired = false;
  {
    base::MutexLock lock(&leases_mu_);
    const auto held =
        std::find_if(leases_.begin(), leases_.end(), [&](const auto& l) {
          return l.second.model == r.model && l.second.memfds == memfds;
        });
    if (held == leases_.end()) return false;
    // Filed in the same step as the lease found is seen: that one keeps
    // the copy (its store lease, or uncovered, its unloader refusing) until
    // this one does. Uncovered: a retired copy is not the store's to lease
    // (its unloader refuses while this lease is uncovered, and a released
    // holder's store lease passes to it); one that is not retired takes
    // its store lease again (CoverUncovered).
    detail::LeaseEntry entry;
    entry.connection = c.id;
    entry.model = r.model;
    entry.pid = c.pid;
    entry.uid = c.uid;
    entry.bytes = held->second.bytes;
    entry.copy = copy = held->second.copy;
    entry.delivered = true;
    entry.memfds = memfds;
    entry.retired = retired = held->second.retired;
    auto [it, inserted] = leases_.emplace(r.lease, std::move(entry));
    IndexCoverage(r.lease, it->second);
  }
  c.leases.insert(r.lease);
  ++reclaims_accepted_;
  Log("pid " + std::to_string(c.pid) + " reclaims a lease on the " +
      (retired ? "retired " : "") + "copy of '" + r.model +
      "' adopted already");
  // This process's hold, if it has one, gives way to the lease it reclaims.
  DropMapperHolds(c.pid, copy);
  if (!retired) CoverUncovered();
  if (r.idle) {
    protocol::Request idle = r;
    idle.op = protocol::Op::kIdle;
    HandleIdle(c, idle);
  } else {
    Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
  }
  EndGrace(&r.model);
  return true;
}

}  // namespace modelcache::serve
