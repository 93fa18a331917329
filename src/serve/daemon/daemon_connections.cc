// Connections on the event loop: accept (credentials, pidfd), read, write,
// doom and close (design note: daemon_internal.h).
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
#include "modelcache/base/text.h"
#include "modelcache/core/policy.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"
#include "proc_maps.h"
#include "socket.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77  // Linux 6.5
#endif

namespace modelcache::serve {

using detail::Connection;
using detail::Disconnect;
using detail::Result;
using detail::Task;

void Daemon::Impl::Accept() {
  for (int i = 0; i < kAcceptsPerWakeup && !stopping_; ++i) {
    base::UniqueFd fd(::accept4(listen_fd_.get(), nullptr, nullptr,
                                SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      const int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) return;
      if (e == EMFILE || e == ENFILE) {
        Log("accept: " + base::ErrnoText(e) + "; a connection waits");
        return;
      }
      continue;  // ECONNABORTED and the like: that peer is gone
    }
    ucred cred{};
    socklen_t length = sizeof(cred);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
      ++disconnects_[static_cast<size_t>(Disconnect::kRefused)];
      continue;
    }
    const auto refuse = [&](ServeCode code, const std::string& why) {
      // Counted before the peer can read why (and then ask /metrics).
      ++disconnects_[static_cast<size_t>(Disconnect::kRefused)];
      const std::string message = protocol::EncodeError(0, code, why);
      detail::SendDatagram(fd.get(), message, {}, MSG_DONTWAIT);
      // Closing a socket with unread data makes the peer's next read fail
      // (ECONNRESET) before it reads why: drop what it sent so far.
      detail::Datagram ignored;
      while (detail::ReceiveDatagram(fd.get(), 0, 0, MSG_DONTWAIT, &ignored) >
             0) {
      }
    };
    if (!options_.allow_uids.empty() || !options_.allow_gids.empty()) {
      const bool allowed =
          cred.uid == ::geteuid() ||
          std::find(options_.allow_uids.begin(), options_.allow_uids.end(),
                    cred.uid) != options_.allow_uids.end() ||
          std::find(options_.allow_gids.begin(), options_.allow_gids.end(),
                    cred.gid) != options_.allow_gids.end();
      if (!allowed) {
        Log("refused pid " + std::to_string(cred.pid) + ": uid " +
            std::to_string(cred.uid) + " and gid " + std::to_string(cred.gid) +
            " are not allowed");
        refuse(ServeCode::kInvalid, "uid " + std::to_string(cred.uid) +
                                        " is not allowed to connect");
        continue;
      }
    }
    if (static_cast<int>(conns_.size()) >= options_.limits.max_clients) {
      refuse(ServeCode::kBusy, "too many clients (the limit is " +
                                   std::to_string(options_.limits.max_clients) +
                                   ")");
      continue;
    }
    // The pidfd says when the process exits. SO_PEERPIDFD names the very
    // process that connected; pidfd_open of its pid is the fallback on
    // kernels before 6.5.
    int pidfd = -1;
    socklen_t pidfd_length = sizeof(pidfd);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERPIDFD, &pidfd,
                     &pidfd_length) != 0) {
      pidfd = PidfdOpen(cred.pid);
    }
    if (pidfd < 0) {
      ++disconnects_[static_cast<size_t>(Disconnect::kProcessExit)];
      continue;  // the process is already gone
    }
    auto c = std::make_unique<Connection>();
    c->id = next_connection_++;
    c->fd = std::move(fd);
    c->pidfd.reset(pidfd);
    ::fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    c->pid = cred.pid;
    c->uid = cred.uid;
    c->gid = cred.gid;
    EpollAdd(epoll_fd_.get(), c->fd.get(), ConnectionEvents(*c),
             Tagged(kConnTag, c->id));
    EpollAdd(epoll_fd_.get(), c->pidfd.get(), EPOLLIN,
             Tagged(kConnPidTag, c->id));
    conns_.emplace(c->id, std::move(c));
    ++clients_;
  }
}

void Daemon::Impl::Readable(Connection& c) {
  detail::Datagram datagram;
  bool reset = false;
  // A request may pause this connection's reads (a reclaim that adopts):
  // the next is read once they resume, after its answer.
  for (int i = 0; i < kReadsPerWakeup && !c.doomed && !ReadsPaused(c); ++i) {
    const int r = detail::ReceiveDatagram(
        c.fd.get(), protocol::kMaxMessageBytes, 2 * protocol::kMaxFilesPerModel,
        MSG_DONTWAIT, &datagram);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // A peer that closes with replies of ours unread makes the kernel
      // report ECONNRESET once, ahead of the datagrams it sent last: a
      // client's final releases (Client::Close sends them just before it
      // closes). Read those, then the end, rather than orphan the leases
      // they release.
      if (errno == ECONNRESET && !reset) {
        reset = true;
        --i;
        continue;
      }
      Doom(c, Disconnect::kError);
      return;
    }
    if (r == 0) {
      Doom(c, Disconnect::kClosed);
      return;
    }
    if (datagram.fds_truncated) {
      // The kernel closed those that did not fit: the request cannot be
      // whole.
      datagram.fds.clear();
      ++protocol_errors_;
      SendError(c, 0, ServeCode::kInvalid,
                "more than " + std::to_string(2 * protocol::kMaxFilesPerModel) +
                    " descriptors in one message (closed them, dropped the "
                    "request)");
      continue;
    }
    HandleDatagram(c, datagram.bytes, datagram.truncated, datagram.real_bytes,
                   std::move(datagram.fds));
  }
  // Left datagrams unread (fairness): this iteration is no full pass.
  if (!c.doomed) capped_read_ = true;
}

void Daemon::Impl::HandleDatagram(Connection& c, std::string_view bytes,
                                  bool truncated, size_t real_bytes,
                                  std::vector<base::UniqueFd> fds) {
  if (truncated) {
    ++protocol_errors_;
    SendError(c, 0, ServeCode::kInvalid,
              "message of " + std::to_string(real_bytes) +
                  " bytes exceeds the limit of " +
                  std::to_string(protocol::kMaxMessageBytes) + " (dropped)");
    return;
  }
  const protocol::ParsedRequest parsed = protocol::ParseRequest(bytes);
  // Only a reclaim carries descriptors; any other request's are closed.
  const bool takes_fds =
      parsed.request && parsed.request->op == protocol::Op::kReclaim;
  if (!fds.empty() && !takes_fds) {
    ++protocol_errors_;
    SendError(c, parsed.id, ServeCode::kInvalid,
              "only a reclaim carries file descriptors (closed them, "
              "dropped the request)");
    return;
  }
  if (!parsed.request) {
    ++protocol_errors_;
    ++acquires_[static_cast<size_t>(Result::kInvalid)];
    SendError(c, parsed.id, ServeCode::kInvalid, parsed.error);
    return;
  }
  const protocol::Request& r = *parsed.request;
  switch (r.op) {
    case protocol::Op::kHello: {
      if (r.version != protocol::kVersion) {
        ++protocol_errors_;
        SendError(c, r.id, ServeCode::kInvalid,
                  "protocol version " + std::to_string(r.version) +
                      " is not supported (this daemon speaks " +
                      std::to_string(protocol::kVersion) + ")");
        return;
      }
      const Limits& l = options_.limits;
      const std::map<std::string, uint64_t> limits = {
          {"max_requests_in_flight",
           static_cast<uint64_t>(l.max_requests_per_client)},
          {"max_leases", static_cast<uint64_t>(l.max_leases_per_client)},
          {"max_queued_replies", static_cast<uint64_t>(l.max_queued_replies)},
          {"max_message_bytes", protocol::kMaxMessageBytes},
          // Says that this daemon takes idle delegations and recalls them.
          {"recall_timeout_ms",
           static_cast<uint64_t>(options_.recall_timeout.count())},
          // Says that this daemon adopts copies a predecessor made.
          {"reclaim", 1},
          // Says that this daemon takes "delegate" and then recalls leases
          // in use too, for an acquire that needs their room (protocol.h).
          {"recall_in_use", 1},
          // Says that this daemon takes "drain" and then recalls the leases
          // of a draining copy, so that their local reuse stops.
          {"drain", 1},
      };
      Send(c, {protocol::EncodeHelloReply(
                   r.id, "modelcache " MODELCACHE_VERSION, limits),
               {},
               nullptr,
               0});
      return;
    }
    case protocol::Op::kPing:
      Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      return;
    case protocol::Op::kRelease:
    case protocol::Op::kIdle:
    case protocol::Op::kUse:
      if (c.leases.count(r.lease) == 0) {
        SendError(c, r.id, ServeCode::kNotFound,
                  "lease " + std::to_string(r.lease) +
                      " is not held by this connection");
        return;
      }
      if (r.op == protocol::Op::kIdle) {
        HandleIdle(c, r);
      } else if (r.op == protocol::Op::kUse) {
        HandleUse(c, r);
      } else {
        c.leases.erase(r.lease);
        ReleaseLease(r.lease, /*answer=*/true);
        Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      }
      return;
    case protocol::Op::kAcquire:
      HandleAcquire(c, r);
      return;
    case protocol::Op::kReclaim:
      HandleReclaim(c, r, std::move(fds));
      return;
    case protocol::Op::kTakeover:
      HandleTakeover(c, r);
      return;
    case protocol::Op::kCommit:
      HandleCommit(c, r);
      return;
    case protocol::Op::kDelegate: {
      {
        // Its leases may be recalled in use (RecallInUse).
        base::MutexLock lock(&leases_mu_);
        delegating_.insert(c.id);
      }
      Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      return;
    }
    case protocol::Op::kDrain: {
      {
        // Its leases are recalled when their copy drains (RecallDraining).
        base::MutexLock lock(&leases_mu_);
        heeding_drains_.insert(c.id);
      }
      Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      return;
    }
  }
}

void Daemon::Impl::HandleAcquire(Connection& c, const protocol::Request& r) {
  const auto refuse = [&](ServeCode code, const std::string& message) {
    ++acquires_[static_cast<size_t>(detail::ResultOf(code))];
    SendError(c, r.id, code, message);
  };
  if (stopping_) {
    refuse(ServeCode::kUnavailable, "the daemon is shutting down");
    return;
  }
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* model = cat->Find(r.model);
  if (model == nullptr) {
    refuse(ServeCode::kNotFound, "no model '" + r.model + "' in the catalog");
    return;
  }
  const Limits& limits = options_.limits;
  if (c.leases.size() + c.waiters.size() >=
      static_cast<size_t>(limits.max_leases_per_client)) {
    refuse(ServeCode::kBusy,
           "this connection holds " + std::to_string(c.leases.size()) +
               " leases and waits for " + std::to_string(c.waiters.size()) +
               " (the limit is " +
               std::to_string(limits.max_leases_per_client) + ")");
    return;
  }
  const Clock::time_point start = Clock::now();
  if (std::optional<Lease> hit = store_->TryAcquire(model->id)) {
    Grant(c, r.id, model->id, std::move(*hit), Result::kHit, "hit", start);
    return;
  }
  // Its files failed the checks and its back-off has not passed: no load,
  // no wait. (In the grace period it waits for a reclaim as any other: the
  // copy that comes back needs no file.)
  if (!AwaitsReclaim(model->id)) {
    std::string message;
    std::string cause;
    if (RefuseUnavailable(model->id, &message, &cause)) {
      ++acquires_[static_cast<size_t>(Result::kUnavailable)];
      SendError(c, r.id, ServeCode::kUnavailable, message, cause);
      return;
    }
  }
  if (c.waiters.size() >= static_cast<size_t>(limits.max_requests_per_client)) {
    refuse(ServeCode::kBusy,
           "this connection has " + std::to_string(c.waiters.size()) +
               " acquires waiting (the limit is " +
               std::to_string(limits.max_requests_per_client) + ")");
    return;
  }
  if (waiters_.size() >= static_cast<size_t>(limits.max_waiters)) {
    refuse(ServeCode::kBusy, std::to_string(waiters_.size()) +
                                 " acquires are waiting (the limit is " +
                                 std::to_string(limits.max_waiters) + ")");
    return;
  }
  AddWaiter(c, r, *model);
}

void Daemon::Impl::Send(Connection& c, detail::Outgoing message) {
  if (c.doomed) return;
  if (c.out.empty()) {
    if (detail::SendDatagram(c.fd.get(), message.bytes, message.fds,
                             MSG_DONTWAIT) == 0) {
      if (message.lease != 0) {
        base::MutexLock lock(&leases_mu_);
        const auto it = leases_.find(message.lease);
        if (it != leases_.end()) it->second.delivered = true;
      }
      return;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      Doom(c, Disconnect::kError);
      return;
    }
  }
  c.out.push_back(std::move(message));
  if (c.out.size() > static_cast<size_t>(options_.limits.max_queued_replies)) {
    Log("pid " + std::to_string(c.pid) + " left " +
        std::to_string(c.out.size()) + " replies unread: disconnected");
    Doom(c, Disconnect::kSlowReader);
    return;
  }
  if (!c.writing) {
    c.writing = true;
    EpollMod(epoll_fd_.get(), c.fd.get(), ConnectionEvents(c),
             Tagged(kConnTag, c.id));
  }
}

void Daemon::Impl::Writable(Connection& c) {
  while (!c.out.empty() && !c.doomed) {
    detail::Outgoing& m = c.out.front();
    if (detail::SendDatagram(c.fd.get(), m.bytes, m.fds, MSG_DONTWAIT) != 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      Doom(c, Disconnect::kError);
      return;
    }
    if (m.lease != 0) {
      base::MutexLock lock(&leases_mu_);
      const auto it = leases_.find(m.lease);
      if (it != leases_.end()) it->second.delivered = true;
    }
    c.out.pop_front();
  }
  if (c.out.empty() && c.writing) {
    c.writing = false;
    EpollMod(epoll_fd_.get(), c.fd.get(), ConnectionEvents(c),
             Tagged(kConnTag, c.id));
  }
}

uint32_t Daemon::Impl::ConnectionEvents(const Connection& c) const {
  return (ReadsPaused(c) ? 0u : static_cast<uint32_t>(EPOLLIN | EPOLLRDHUP)) |
         (c.writing ? static_cast<uint32_t>(EPOLLOUT) : 0u);
}

void Daemon::Impl::PauseHook() {
  const int fd = options_.test_pause_reads_fd;
  char command = 0;
  const ssize_t n = ::read(fd, &command, 1);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  const bool paused = n == 1 && command == 'p';
  if (n != 1) EpollDel(epoll_fd_.get(), fd);  // gone: read on for good
  if (paused != reads_paused_) {
    reads_paused_ = paused;
    for (const auto& [id, c] : conns_) {
      EpollMod(epoll_fd_.get(), c->fd.get(), ConnectionEvents(*c),
               Tagged(kConnTag, id));
    }
  }
  if (n == 1) {
    [[maybe_unused]] const ssize_t w = ::write(fd, &command, 1);
  }
}

void Daemon::Impl::CapacityHoldHook() {
  const int fd = options_.test_capacity_hold_fd;
  if (fd < 0) return;
  const char held = 'h';
  if (::write(fd, &held, 1) != 1) return;
  char go;
  while (::read(fd, &go, 1) < 0 && errno == EINTR) {
  }
}

void Daemon::Impl::SendError(Connection& c, uint64_t id, ServeCode code,
                             const std::string& message,
                             const std::string& cause) {
  Send(c, {protocol::EncodeError(id, code, message, cause), {}, nullptr, 0});
}

void Daemon::Impl::Doom(Connection& c, Disconnect reason) {
  if (c.doomed) return;
  c.doomed = true;
  c.doom_reason = reason;
  doomed_.push_back(c.id);
}

void Daemon::Impl::CloseDoomed() {
  while (!doomed_.empty()) {
    const uint64_t id = doomed_.back();
    doomed_.pop_back();
    const auto it = conns_.find(id);
    if (it != conns_.end()) Close(id, it->second->doom_reason);
  }
}

void Daemon::Impl::Close(uint64_t id, Disconnect reason) {
  const auto it = conns_.find(id);
  if (it == conns_.end()) return;
  std::unique_ptr<Connection> c = std::move(it->second);
  conns_.erase(it);
  --clients_;
  if (id == handover_conn_) AbandonHandover("the new daemon went away");
  ++disconnects_[static_cast<size_t>(reason)];
  EpollDel(epoll_fd_.get(), c->fd.get());
  EpollDel(epoll_fd_.get(), c->pidfd.get());
  c->fd.reset();
  c->out.clear();
  for (const uint64_t seq :
       std::vector<uint64_t>(c->waiters.begin(), c->waiters.end())) {
    RemoveWaiter(seq);
  }
  // Leases: released unless a live process may map them.
  const bool dead = reason == Disconnect::kProcessExit ||
                    reason == Disconnect::kShutdown || PeerGone(c->pidfd.get());
  std::vector<uint64_t> release;
  std::vector<uint64_t> orphan;
  bool recalled = false;
  {
    base::MutexLock lock(&leases_mu_);
    delegating_.erase(id);
    heeding_drains_.erase(id);
    for (const uint64_t lease : c->leases) {
      const auto l = leases_.find(lease);
      if (l == leases_.end()) continue;
      if (dead || !l->second.delivered) {
        release.push_back(lease);
      } else {
        l->second.connection = 0;
        l->second.orphaned = true;
        // No one is left to recall: an orphan is in use until its process
        // lets go, and takes its store lease again (CoverUncovered).
        if (l->second.use != detail::Use::kInUse) {
          SetUse(l->second, detail::Use::kInUse);
          recalled = true;
        }
        orphan.push_back(lease);
      }
    }
  }
  if (recalled) RecallEnded();
  for (const uint64_t lease : release) ReleaseLease(lease);
  if (!orphan.empty()) CoverUncovered();
  if (!orphan.empty()) {
    const uint64_t group = next_group_++;
    detail::OrphanGroup g;
    g.pidfd = std::move(c->pidfd);
    g.pid = c->pid;
    g.leases = orphan;
    orphaned_leases_ += static_cast<int>(orphan.size());
    EpollAdd(epoll_fd_.get(), g.pidfd.get(), EPOLLIN,
             Tagged(kOrphanPidTag, group));
    Log("pid " + std::to_string(c->pid) + " closed its connection holding " +
        std::to_string(orphan.size()) +
        " leases: orphaned until the process exits");
    orphan_groups_.emplace(group, std::move(g));
    ScheduleRescan();
  }
}

}  // namespace modelcache::serve
