// Leases and orphan groups: granted, released, orphaned when a live
// process closes its connection (design note: daemon_internal.h).
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
using detail::Use;

void Daemon::Impl::ScheduleRescan() {
  next_rescan_ = std::min(next_rescan_, Clock::now() + options_.orphan_rescan);
}

void Daemon::Impl::CheckOrphanGroups(
    const std::vector<detail::PidMemfds>& found) {
  std::map<pid_t, const detail::PidMemfds*> by_pid;
  for (const detail::PidMemfds& f : found) {
    if (f.known) by_pid[f.pid] = &f;
  }
  std::vector<uint64_t> emptied;
  for (auto& [id, group] : orphan_groups_) {
    const auto f = by_pid.find(group.pid);
    if (f == by_pid.end()) continue;  // not read: nothing is known
    const std::set<std::pair<uint64_t, uint64_t>>& set = f->second->held;
    std::vector<uint64_t> keep;
    std::vector<uint64_t> release;
    {
      base::MutexLock lock(&leases_mu_);
      for (const uint64_t lease : group.leases) {
        const auto it = leases_.find(lease);
        if (it == leases_.end()) continue;
        bool used = false;
        for (const detail::MemfdId& m : it->second.memfds) {
          used = used || set.count({m.dev, m.inode}) != 0;
        }
        (used ? keep : release).push_back(lease);
      }
    }
    if (release.empty()) continue;
    Log("pid " + std::to_string(group.pid) + " no longer maps " +
        std::to_string(release.size()) + " orphaned leases: released");
    orphaned_leases_ -= static_cast<int>(group.leases.size() - keep.size());
    group.leases = std::move(keep);
    for (const uint64_t lease : release) ReleaseLease(lease);
    if (group.leases.empty()) emptied.push_back(id);
  }
  for (const uint64_t id : emptied) {
    EpollDel(epoll_fd_.get(), orphan_groups_.at(id).pidfd.get());
    orphan_groups_.erase(id);
  }
}

void Daemon::Impl::ReleaseOrphanGroup(uint64_t group) {
  const auto it = orphan_groups_.find(group);
  if (it == orphan_groups_.end()) return;
  detail::OrphanGroup g = std::move(it->second);
  orphan_groups_.erase(it);
  EpollDel(epoll_fd_.get(), g.pidfd.get());
  orphaned_leases_ -= static_cast<int>(g.leases.size());
  for (const uint64_t lease : g.leases) ReleaseLease(lease);
}

void Daemon::Impl::Grant(Connection& c, uint64_t request_id,
                         const std::string& model, Lease lease, Result result,
                         const char* load, Clock::time_point start) {
  auto* copy = lease.get<detail::ModelCopy>();
  std::shared_ptr<const detail::ModelCopy> keep = copy->shared_from_this();
  const uint64_t id = ++next_lease_;
  detail::LeaseEntry entry;
  entry.connection = c.id;
  entry.model = model;
  entry.pid = c.pid;
  entry.uid = c.uid;
  entry.bytes = lease.bytes();
  entry.copy = copy;
  entry.lease = std::move(lease);
  for (const detail::FileCopy& f : keep->files()) {
    entry.memfds.push_back(f.data_id);
    entry.memfds.push_back(f.header_id);
  }
  {
    base::MutexLock lock(&leases_mu_);
    leases_.emplace(id, std::move(entry));
  }
  c.leases.insert(id);
  std::vector<protocol::FileReply> files;
  std::vector<int> fds;
  files.reserve(keep->files().size());
  for (const detail::FileCopy& f : keep->files()) {
    files.push_back({f.name, f.data_bytes, f.header_bytes});
    fds.push_back(f.header.get());
    fds.push_back(f.data_fd());
  }
  ++acquires_[static_cast<size_t>(result)];
  acquire_wait_seconds_.Observe(
      std::chrono::duration<double>(Clock::now() - start).count());
  Send(c, {protocol::EncodeAcquireReply(request_id, id, model, load, files),
           std::move(fds), std::move(keep), id});
}

void Daemon::Impl::ReleaseLease(uint64_t lease, bool answer) {
  Lease core;
  bool uncovered = false;
  bool recalled = false;
  {
    base::MutexLock lock(&leases_mu_);
    const auto it = leases_.find(lease);
    if (it == leases_.end()) return;
    detail::LeaseEntry& e = it->second;
    recalled = e.use == Use::kRecalled;
    if (recalled) --recalls_outstanding_;
    if (recalled && answer) ++recalls_released_;
    core = std::move(e.lease);
    uncovered = !core;
    if (uncovered) {
      const auto u = uncovered_.find(e.copy);
      if (u != uncovered_.end()) {
        u->second.erase(lease);
        if (u->second.empty()) uncovered_.erase(u);
      }
    } else if (e.retired) {
      // A retired copy is not the store's to lease again: its store lease
      // passes to a holder still uncovered (a mapper's hold, a reclaim of
      // it), so that the last holder's release frees it. (Released here,
      // the unloader would refuse, and the copy stay counted.)
      if (const auto u = uncovered_.find(e.copy); u != uncovered_.end()) {
        const uint64_t heir = *u->second.begin();
        detail::LeaseEntry& h = leases_.at(heir);
        h.lease = std::move(core);
        IndexCoverage(heir, h);
      }
    }
    leases_.erase(it);
  }
  core.Release();  // outside the lock: may free a retired copy
  // An uncovered lease held no store lease: its copy's unloader may pass
  // now, which no store event says.
  if (recalled || uncovered) RecallEnded();
}

// ---- delegation ----

void Daemon::Impl::IndexCoverage(uint64_t id, detail::LeaseEntry& e) {
  if (!e.lease) {
    uncovered_[e.copy].insert(id);
    return;
  }
  const auto u = uncovered_.find(e.copy);
  if (u == uncovered_.end()) return;
  u->second.erase(id);
  if (u->second.empty()) uncovered_.erase(u);
}

void Daemon::Impl::SetUse(detail::LeaseEntry& e, Use use) {
  if (e.use == Use::kRecalled) --recalls_outstanding_;
  if (use == Use::kRecalled && e.use != Use::kRecalled) {
    ++recalls_outstanding_;
    ++recalls_started_;
  }
  e.use = use;
}

void Daemon::Impl::SendRecall(Connection& c, uint64_t lease, bool retired,
                              bool draining) {
  Send(c, {protocol::EncodeRecall(lease, retired, draining), {}, nullptr, 0});
  ++recalls_sent_;
  recall_deadlines_.emplace(Clock::now() + options_.recall_timeout, lease);
}

void Daemon::Impl::RecallInUseRetired(Connection& c, uint64_t lease) {
  {
    base::MutexLock lock(&leases_mu_);
    SetUse(leases_.at(lease), Use::kRecalled);
  }
  SendRecall(c, lease, /*retired=*/true);
}

void Daemon::Impl::HandleIdle(Connection& c, const protocol::Request& r) {
  Lease core;
  bool recall = false;
  {
    base::MutexLock lock(&leases_mu_);
    const auto it = leases_.find(r.lease);
    detail::LeaseEntry& e = it->second;
    if (e.use == Use::kInUse) {
      if (e.retired) {
        // No one new gets a retired copy: it goes once its holders let go.
        SetUse(e, Use::kRecalled);
        recall = true;
      } else {
        SetUse(e, Use::kIdle);
        core = std::move(e.lease);
        IndexCoverage(r.lease, e);
      }
    }
  }
  Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
  if (recall) SendRecall(c, r.lease, /*retired=*/true);
  core.Release();  // the store may evict the copy now (after a recall)
}

void Daemon::Impl::HandleUse(Connection& c, const protocol::Request& r) {
  bool recalled = false;
  bool uncovered = false;
  {
    base::MutexLock lock(&leases_mu_);
    detail::LeaseEntry& e = leases_.find(r.lease)->second;
    recalled = e.use == Use::kRecalled;
    if (recalled) e.busy_since = Clock::now();
    SetUse(e, Use::kInUse);
    uncovered = !e.lease;
  }
  Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
  if (recalled) {
    ++recalls_busy_;
    RecallEnded();
  }
  if (uncovered) CoverUncovered();
}

void Daemon::Impl::GateUnload(const void* copy) {
  size_t held = 0;
  {
    base::MutexLock lock(&leases_mu_);
    const auto u = uncovered_.find(copy);
    if (u == uncovered_.end()) return;
    for (const uint64_t id : u->second) {
      detail::LeaseEntry& e = leases_.at(id);
      if (e.use == Use::kIdle && e.connection != 0) {
        SetUse(e, Use::kRecalled);
        to_recall_.push_back(id);
      }
    }
    // One in use that is still uncovered takes its store lease once the
    // store has the copy back.
    cover_again_ = true;
    held = u->second.size();
  }
  ++refused_unloads_;
  Wake();
  throw Error(ErrorCode::kFailedPrecondition,
              "its copy is mapped by " + std::to_string(held) +
                  " delegated leases: recalled");
}

void Daemon::Impl::ProcessRecalls() {
  std::vector<uint64_t> recall;
  bool cover;
  {
    base::MutexLock lock(&leases_mu_);
    recall.swap(to_recall_);
    cover = cover_again_;
    cover_again_ = false;
  }
  for (const uint64_t id : recall) {
    uint64_t connection = 0;
    bool retired = false;
    bool draining = false;
    {
      base::MutexLock lock(&leases_mu_);
      const auto it = leases_.find(id);
      if (it == leases_.end() || it->second.use != Use::kRecalled) continue;
      connection = it->second.connection;
      retired = it->second.retired;
      draining = it->second.draining;
    }
    const auto c = conns_.find(connection);
    if (c != conns_.end()) SendRecall(*c->second, id, retired, draining);
  }
  if (cover) CoverUncovered();
}

void Daemon::Impl::CoverUncovered() {
  if (CoverOnce()) next_cover_ = Clock::now() + std::chrono::milliseconds(1);
}

bool Daemon::Impl::CoverOnce() {
  // The uncovered leases that are in use, orphaned (no one to recall) or
  // retired (their copy must be retired, not unloaded).
  std::vector<std::pair<uint64_t, std::string>> wanted;
  {
    base::MutexLock lock(&leases_mu_);
    for (const auto& [copy, ids] : uncovered_) {
      for (const uint64_t id : ids) {
        const detail::LeaseEntry& e = leases_.at(id);
        if (e.use == Use::kInUse || e.connection == 0 || e.retired) {
          wanted.emplace_back(id, e.model);
        }
      }
    }
  }
  bool missed = false;
  for (const auto& [id, model] : wanted) {
    // Never waits: a copy being unloaded now (its unloader is refusing)
    // is not resident for a moment; the next pass covers it.
    std::optional<Lease> hit = store_->TryAcquire(model);
    base::MutexLock lock(&leases_mu_);
    const auto it = leases_.find(id);
    if (it == leases_.end() || it->second.lease) continue;  // hit released
    if (hit && hit->get<detail::ModelCopy>() == it->second.copy) {
      it->second.lease = std::move(*hit);
      IndexCoverage(id, it->second);
    } else if (!it->second.retired) {
      // Its copy is being unloaded (the unloader refusing) at this moment.
      // (A retired copy is not the store's to lease any more: it stays
      // uncovered, and its unloader refuses until the lease ends.)
      missed = true;
    }
  }
  return missed;
}

void Daemon::Impl::ExpireRecalls(Clock::time_point now) {
  bool any = false;
  while (!recall_deadlines_.empty() &&
         recall_deadlines_.begin()->first <= now) {
    const uint64_t id = recall_deadlines_.begin()->second;
    recall_deadlines_.erase(recall_deadlines_.begin());
    base::MutexLock lock(&leases_mu_);
    const auto it = leases_.find(id);
    if (it == leases_.end() || it->second.use != Use::kRecalled) continue;
    // Taken as "use": the daemon waits on no client.
    SetUse(it->second, Use::kInUse);
    it->second.busy_since = now;
    ++recalls_unanswered_;
    any = true;
  }
  if (any) {
    RecallEnded();
    CoverUncovered();
  }
}

void Daemon::Impl::RecallEnded() { room_changed_ = true; }

void Daemon::Impl::FlushRoomChanged() {
  // Once per loop iteration, however many answers it read: each wakes every
  // reservation waiting for room, which then looks at every victim again.
  if (!room_changed_) return;
  room_changed_ = false;
  {
    base::MutexLock lock(&leases_mu_);
    recalls_cv_.NotifyAll();
  }
  store_->budget().NotifyEvictable();
}

uint64_t Daemon::Impl::RecallsStarted() const {
  base::MutexLock lock(&leases_mu_);
  return recalls_started_;
}

bool Daemon::Impl::WaitForRecalls(uint64_t since, Clock::time_point deadline) {
  base::MutexLock lock(&leases_mu_);
  // None started since: waiting would change nothing. (Those that did may
  // all be answered already.)
  if (recalls_started_ == since) return false;
  while (recalls_outstanding_ > 0) {
    if (!recalls_cv_.WaitUntil(&leases_mu_, deadline) &&
        Clock::now() >= deadline) {
      break;
    }
  }
  return true;
}

bool Daemon::Impl::RecallInUse(const std::string& model, uint64_t needed,
                               Clock::time_point since) {
  const Budget& budget = store_->budget();
  const uint64_t capacity = budget.capacity();
  const uint64_t used = budget.used();
  uint64_t room = capacity > used ? capacity - used : 0;
  const std::vector<EntryInfo> entries = store_->Entries();
  base::MutexLock lock(&leases_mu_);
  // The leases whose holders would let go at a recall: in use as the
  // daemon knows, with a store lease, of a live delegating connection.
  std::map<std::string, std::vector<uint64_t>> recallable;
  for (const auto& [id, e] : leases_) {
    if (e.use != Use::kInUse || !e.lease || e.retired || e.orphaned ||
        e.held_for_mapper || e.connection == 0 ||
        delegating_.count(e.connection) == 0 || e.busy_since >= since) {
      continue;
    }
    recallable[e.model].push_back(id);
  }
  struct Candidate {
    Clock::time_point last_use;
    uint64_t bytes;
    const std::vector<uint64_t>* leases;
  };
  std::vector<Candidate> candidates;
  for (const EntryInfo& info : entries) {
    if (info.state != EntryState::kResident || info.pinned ||
        info.key == model) {
      continue;
    }
    if (info.leases == 0) {
      room += info.bytes;  // evictable (after the recalls of idle leases)
      continue;
    }
    // Only when every store lease on it is one that a recall may end.
    const auto r = recallable.find(info.key);
    if (r == recallable.end() ||
        r->second.size() != static_cast<size_t>(info.leases)) {
      continue;
    }
    candidates.push_back({info.last_use, info.bytes, &r->second});
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) {
              return a.last_use < b.last_use;
            });
  size_t take = 0;
  while (room < needed && take < candidates.size()) {
    room += candidates[take++].bytes;
  }
  // An acquire refused anyway costs no one a warm lease.
  if (room < needed || take == 0) return false;
  for (size_t i = 0; i < take; ++i) {
    for (const uint64_t id : *candidates[i].leases) {
      // It keeps its store lease: its bytes count as in use until its
      // holder's "release" arrives.
      SetUse(leases_.at(id), Use::kRecalled);
      to_recall_.push_back(id);
    }
  }
  Wake();  // the loop sends them (ProcessRecalls)
  return true;
}

void Daemon::Impl::RecallRetired(const std::string& model) {
  {
    base::MutexLock lock(&leases_mu_);
    for (auto& [id, e] : leases_) {
      if (e.model != model) continue;
      e.retired = true;
      // The holders of leases in use are told too ("retired"), so that
      // they take no new local reference to the copy: they answer "use"
      // while a reference lives, and release it at the last one's end.
      if (e.use != Use::kRecalled && e.connection != 0) {
        SetUse(e, Use::kRecalled);
        to_recall_.push_back(id);
      }
    }
  }
  // They keep the retired copy with store leases: its unload then waits
  // for their release, not for an unloader that refuses.
  if (CoverOnce()) {
    base::MutexLock lock(&leases_mu_);
    cover_again_ = true;
  }
  Wake();  // the loop sends the recalls
}

void Daemon::Impl::RecallDraining(const std::string& model) {
  {
    base::MutexLock lock(&leases_mu_);
    for (auto& [id, e] : leases_) {
      // A retired lease is not of the store's copy, and is recalled
      // already; a connection that did not say "drain" reuses as before.
      if (e.model != model || e.retired || e.connection == 0 ||
          e.use == Use::kRecalled || heeding_drains_.count(e.connection) == 0) {
        continue;
      }
      // In use: its holder takes no new local reference and releases it at
      // the last one's end, so the drain waits only for the requests under
      // way. Idle: released at once, so no local acquire revives it.
      e.draining = true;
      SetUse(e, Use::kRecalled);
      to_recall_.push_back(id);
    }
  }
  Wake();  // the loop sends the recalls
}

}  // namespace modelcache::serve
