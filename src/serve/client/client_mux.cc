// The client's multiplexer: one connection, requests matched to replies by
// id, one reader at a time, releases never lost (design note:
// client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

bool ClientCore::SendOn(Connection& c, std::string_view message,
                        Clock::time_point deadline) {
  for (;;) {
    {
      base::MutexLock lock(&mu_);
      if (!FlushUnsent(c)) return false;
      if (!c.unsent.empty()) {
        // Behind the releases: the flusher sends them and says when.
        if (c.broken) return false;
        StartFlusher();
        if (!cv_.WaitUntil(&mu_, deadline) && Clock::now() >= deadline) {
          return false;
        }
        continue;
      }
      if (SendDatagram(c.fd.get(), message, {}, MSG_DONTWAIT) == 0) {
        return true;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    }
    if (Clock::now() >= deadline) return false;
    pollfd p{c.fd.get(), POLLOUT, 0};
    ::poll(&p, 1, MillisUntil(deadline));
  }
}

void ClientCore::ReadAndFile(const std::shared_ptr<Connection>& c,
                             int wait_ms) {
  std::vector<Datagram> got;
  bool broken = false;
  std::string why;
  if (wait_ms > 0) {
    pollfd p{c->fd.get(), POLLIN, 0};
    ::poll(&p, 1, wait_ms);
  }
  for (int i = 0; i < 64; ++i) {
    Datagram d;
    const int r =
        ReceiveDatagram(c->fd.get(), protocol::kMaxMessageBytes,
                        2 * protocol::kMaxFilesPerModel, MSG_DONTWAIT, &d);
    if (r > 0) {
      got.push_back(std::move(d));
      continue;
    }
    if (r == 0) {
      broken = true;
      why = "the daemon closed the connection";
    } else if (errno == ECONNRESET) {
      // Reported once, before what the daemon queued: read on.
      broken = true;
      why = "the daemon closed the connection";
      continue;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      broken = true;
      why = "the connection failed: " + base::ErrnoText(errno);
    }
    break;
  }
  std::vector<uint64_t> stray_leases;
  std::vector<protocol::Recall> recalls;
  {
    base::MutexLock lock(&mu_);
    for (Datagram& d : got) {
      protocol::ParsedReply parsed = protocol::ParseReply(d.bytes);
      if (!parsed.reply) {
        broken = true;
        why = "the daemon sent a malformed reply: " + parsed.error;
        break;
      }
      protocol::Reply& reply = *parsed.reply;
      if (reply.id == 0) {  // the daemon's own: news, not the end
        if (reply.ok && reply.recall != 0) {
          recalls.push_back({reply.recall, reply.retired, reply.drain});
        } else {
          c->note = reply.message;
        }
        continue;
      }
      if (c->unanswered.erase(reply.id) != 0) continue;  // a release's
      const auto it = pending_.find(reply.id);
      if (it != pending_.end() && it->second.serial == c->serial &&
          !it->second.done) {
        it->second.done = true;
        it->second.reply = std::move(reply);
        it->second.fds = std::move(d.fds);
      } else if (reply.ok && reply.lease != 0) {
        stray_leases.push_back(reply.lease);  // its caller gave up
      }
    }
    if (broken) {
      last_break_ = c->note.empty() ? why : why + ": " + c->note;
      Broke(c);
    }
    for (const uint64_t lease : stray_leases) SendRelease(c, lease);
    cv_.NotifyAll();
  }
  if (!recalls.empty()) AnswerRecalls(c, recalls);
}

uint64_t ClientCore::SendRelease(const std::shared_ptr<Connection>& c,
                                 uint64_t lease) {
  if (c->broken) return 0;  // the lease died with the connection
  const uint64_t id = next_id_++;
  return QueueAndFlush(c, id, protocol::EncodeRelease(id, lease));
}

uint64_t ClientCore::QueueAndFlush(const std::shared_ptr<Connection>& c,
                                   uint64_t id, std::string datagram) {
  c->unsent.emplace_back(id, std::move(datagram));
  if (!FlushUnsent(*c)) {
    last_break_ = "the connection failed: " + base::ErrnoText(errno);
    Broke(c);
    return 0;
  }
  if (!c->unsent.empty()) StartFlusherToSend();
  return id;
}

void ClientCore::AwaitSent(const std::shared_ptr<Connection>& c, uint64_t id) {
  const auto queued = [&] {
    return std::any_of(c->unsent.begin(), c->unsent.end(),
                       [id](const auto& m) { return m.first == id; });
  };
  while (id != 0 && !c->broken && !stop_ && queued()) {
    if (!FlushUnsent(*c)) {
      last_break_ = "the connection failed: " + base::ErrnoText(errno);
      Broke(c);
      return;
    }
    if (!queued()) return;
    // The flusher sends it as the socket takes it (and reads the answers
    // that hold back the window); every send it makes wakes us. The slice
    // only bounds a wake missed on a break.
    StartFlusherToSend();
    cv_.WaitUntil(&mu_, Clock::now() + kUseNoticeLag);
  }
}

bool ClientCore::FlushUnsent(Connection& c) {
  bool sent = false;
  while (!c.unsent.empty() && c.unanswered.size() < c.window) {
    if (SendDatagram(c.fd.get(), c.unsent.front().second, {}, MSG_DONTWAIT) !=
        0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      break;
    }
    c.unanswered.insert(c.unsent.front().first);
    c.unsent.pop_front();
    sent = true;
  }
  if (sent) cv_.NotifyAll();  // for SendOn and AwaitSent
  return true;
}

ClientCore::~ClientCore() {
  std::thread flusher;
  {
    base::MutexLock lock(&mu_);
    stop_ = true;
    cv_.NotifyAll();
    if (wake_fd_) {
      const uint64_t one = 1;
      [[maybe_unused]] const ssize_t n =
          ::write(wake_fd_.get(), &one, sizeof(one));
    }
    flusher.swap(flusher_);
  }
  if (flusher.joinable()) flusher.join();
}

ClientCore::Exchanged ClientCore::Exchange(
    const std::function<std::string(uint64_t)>& encode,
    Clock::time_point deadline, const WaitInterrupt* interrupt) {
  for (;;) {
    std::shared_ptr<Connection> c = Connected(deadline, interrupt);
    uint64_t id;
    {
      base::MutexLock lock(&mu_);
      id = next_id_++;
      pending_[id].serial = c->serial;
    }
    if (!SendOn(*c, encode(id), deadline)) {
      base::MutexLock lock(&mu_);
      pending_.erase(id);
      if (Clock::now() >= deadline) {
        throw ServeError(ServeCode::kTimeout, "the daemon at " + path_ +
                                                  " did not take the request "
                                                  "in time");
      }
      last_break_ = "the connection failed";
      Broke(c);
      continue;  // again on a new connection
    }
    mu_.Lock();
    for (;;) {
      Slot& slot = pending_[id];
      if (slot.done) {
        Exchanged out{std::move(slot.reply), std::move(slot.fds), c};
        pending_.erase(id);
        mu_.Unlock();
        return out;
      }
      if (c->broken) {
        pending_.erase(id);
        break;  // retried below
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        pending_.erase(id);
        mu_.Unlock();
        throw ServeError(ServeCode::kTimeout,
                         "no reply from the daemon at " + path_ + " in time");
      }
      Clock::time_point slice_end = deadline;
      if (interrupt && interrupt->check) {
        slice_end = std::min(slice_end, now + interrupt->every);
      }
      if (!reading_) {
        reading_ = true;
        mu_.Unlock();
        ReadAndFile(c, std::max(1, MillisUntil(slice_end)));
        mu_.Lock();
        reading_ = false;
        cv_.NotifyAll();
      } else {
        cv_.WaitUntil(&mu_, slice_end);
      }
      if (interrupt && interrupt->check) {
        mu_.Unlock();
        try {
          interrupt->check();
        } catch (...) {
          base::MutexLock lock(&mu_);
          pending_.erase(id);  // a lease it brings is released on arrival
          throw;
        }
        mu_.Lock();
      }
    }
    mu_.Unlock();
  }
}

void ClientCore::Ping(std::chrono::milliseconds timeout) {
  Exchanged ex = Exchange([](uint64_t id) { return protocol::EncodePing(id); },
                          After(timeout), nullptr);
  if (!ex.reply.ok) ThrowErrorOf(ex.reply);
}

void ClientCore::Close() {
  // The idle leases end first, as a recall ends them: unmapped, then
  // released. The daemon books a lease still held when the connection ends
  // as orphaned until it sees the copy unmapped (at its next rescan of this
  // process's maps), so releasing them closes with nothing orphaned.
  std::vector<std::shared_ptr<MappedCopy>> idle;
  std::vector<uint64_t> release;
  std::shared_ptr<Connection> c;
  {
    base::MutexLock lock(&mu_);
    c = conn_;
    if (c && !c->broken) {
      for (const auto& [lease, held] : held_) {
        if (held.refs == 0 && !held.reclaim && held.copy->serial == c->serial) {
          release.push_back(lease);
        }
      }
      for (const uint64_t lease : release) idle.push_back(Forget(lease));
    }
  }
  idle.clear();  // unmapped before the releases
  std::vector<std::shared_ptr<MappedCopy>> drop;
  base::MutexLock lock(&mu_);
  // A release the socket cannot take now is lost with the connection: that
  // lease is orphaned until the rescan, as before.
  for (const uint64_t lease : release) SendRelease(c, lease);
  if (conn_) {
    last_break_ = "closed by the client";
    Broke(conn_, /*keep_leases=*/false);  // the daemon ends them
  }
  // Those of an earlier connection are not reclaimed either: unbacked.
  uint64_t given_up = 0;
  drop = GiveUpReclaims(&given_up);
}

void ClientCore::Release(uint64_t serial, uint64_t lease) noexcept {
  std::shared_ptr<Connection> c;
  bool read;
  {
    base::MutexLock lock(&mu_);
    if (!conn_ || conn_->broken || conn_->serial != serial) return;
    c = conn_;
    // Returns once the release is on the socket (or the connection is
    // gone, and the lease with it): an acquire another process makes after
    // this call returns is read after it (protocol.h).
    AwaitSent(c, SendRelease(c, lease));
    read = !reading_ && !c->broken;
    if (read) reading_ = true;
  }
  if (read) {
    // Drain what is waiting, without blocking, so that replies to releases
    // never pile up in a client that only releases.
    ReadAndFile(c, 0);
    base::MutexLock lock(&mu_);
    reading_ = false;
    cv_.NotifyAll();
  }
}

}  // namespace modelcache::serve::detail
