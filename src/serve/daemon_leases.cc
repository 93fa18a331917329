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
    files.push_back({f.name, f.weights.data_bytes(), f.header_bytes});
    fds.push_back(f.header.get());
    fds.push_back(f.data_fd());
  }
  ++acquires_[static_cast<size_t>(result)];
  acquire_wait_seconds_.Observe(
      std::chrono::duration<double>(Clock::now() - start).count());
  Send(c, {protocol::EncodeAcquireReply(request_id, id, model, load, files),
           std::move(fds), std::move(keep), id});
}

void Daemon::Impl::ReleaseLease(uint64_t lease) {
  Lease core;
  {
    base::MutexLock lock(&leases_mu_);
    const auto it = leases_.find(lease);
    if (it == leases_.end()) return;
    core = std::move(it->second.lease);
    leases_.erase(it);
  }
  core.Release();  // outside the lock: may free a retired copy
}

}  // namespace modelcache::serve
