// The client's reconnection and reclaim: a broken connection's leases kept
// for a successor, reclaimed on the next connection before it is published,
// and the keeper's reconnection while some wait (design note:
// client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

void ClientCore::ReclaimAndPublish(const std::shared_ptr<Connection>& c,
                                   Clock::time_point deadline,
                                   std::vector<protocol::Recall>* recalls) {
  struct Ask {
    uint64_t id = 0;
    uint64_t lease = 0;
    bool idle = false;
    std::shared_ptr<MappedCopy> copy;
    bool answered = false;
    bool ok = false;
  };
  const Clock::time_point until =
      std::max(deadline, Clock::now() + std::chrono::seconds(5));
  // Adopted leases forgotten while their reclaim was in flight: released
  // once `c` is published; and those reclaimed as idle but revived since:
  // told "use" then.
  std::vector<uint64_t> release;
  std::vector<uint64_t> use;
  for (;;) {
    std::vector<Ask> asks;
    std::vector<std::shared_ptr<MappedCopy>> drop;
    {
      base::MutexLock lock(&mu_);
      if (c->serial == 0) c->serial = next_serial_++;
      if (reclaiming_ != 0 && !c->reclaim) {
        drop = GiveUpReclaims(&reclaim_stats_.reclaim_unsupported);
      }
      for (const auto& [lease, held] : held_) {
        if (!held.reclaim) continue;
        Ask& ask = asks.emplace_back();
        ask.id = next_id_++;
        ask.lease = lease;
        ask.idle = held.refs == 0;
        ask.copy = held.copy;
      }
      if (asks.empty()) {
        // The last look and the publication are one: a lease marked later
        // is marked against a published connection, so it is not kept.
        conn_ = c;
        connecting_ = false;
        for (const uint64_t lease : use) {
          SendNotice(c, protocol::Op::kUse, lease);
        }
        for (const uint64_t lease : release) SendRelease(c, lease);
        if (idle_ != 0) StartFlusher();  // notices due, keep_idle
        cv_.NotifyAll();
        return;  // `drop` is unmapped after the lock is let go
      }
    }
    drop.clear();

    // Sent in order, at most `window` unanswered (as releases are), so that
    // the daemon's queue of replies never overflows.
    std::unordered_map<uint64_t, size_t> by_id;
    std::vector<std::string> messages;
    for (size_t i = 0; i < asks.size(); ++i) {
      by_id.emplace(asks[i].id, i);
      messages.push_back(protocol::EncodeReclaim(
          asks[i].id, asks[i].lease, asks[i].copy->model, asks[i].idle));
    }
    size_t next = 0;
    size_t unanswered = 0;
    size_t answered = 0;
    while (answered < asks.size()) {
      while (next < asks.size() && unanswered < c->window) {
        // The descriptors are set before a copy is filed, never changed.
        std::vector<int> fds;
        for (const base::UniqueFd& fd : asks[next].copy->fds) {
          fds.push_back(fd.get());
        }
        if (SendDatagram(c->fd.get(), messages[next], fds, MSG_DONTWAIT) != 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          const int e = errno;
          throw DaemonUnavailableError(
              "lost the daemon at " + path_ +
              " while reclaiming: " + base::ErrnoText(e));
        }
        ++next;
        ++unanswered;
      }
      Datagram d;
      const int got =
          ReceiveDatagram(c->fd.get(), protocol::kMaxMessageBytes,
                          2 * protocol::kMaxFilesPerModel, MSG_DONTWAIT, &d);
      if (got == 0) {
        throw DaemonUnavailableError("the daemon at " + path_ +
                                     " closed the connection while reclaiming");
      }
      if (got > 0) {
        const protocol::ParsedReply parsed = protocol::ParseReply(d.bytes);
        if (!parsed.reply) {
          throw ServeError(ServeCode::kInvalid,
                           "malformed reply to a reclaim: " + parsed.error);
        }
        const protocol::Reply& reply = *parsed.reply;
        if (reply.id == 0) {  // the daemon's own: news
          base::MutexLock lock(&mu_);
          if (reply.ok && reply.recall != 0) {
            recalls->push_back({reply.recall, reply.retired, reply.drain});
          } else {
            c->note = reply.message;
          }
          continue;
        }
        const auto it = by_id.find(reply.id);
        if (it != by_id.end() && !asks[it->second].answered) {
          asks[it->second].answered = true;
          asks[it->second].ok = reply.ok;
          --unanswered;
          ++answered;
        } else {
          base::MutexLock lock(&mu_);
          c->unanswered.erase(reply.id);  // a release's, of an earlier pass
        }
        continue;
      }
      // A peer that closed with our datagrams unread reports ECONNRESET
      // once, before the messages it queued: read on.
      if (errno == ECONNRESET) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        const int e = errno;
        throw DaemonUnavailableError(
            "lost the daemon at " + path_ +
            " while reclaiming: " + base::ErrnoText(e));
      }
      if (Clock::now() >= until) {
        throw DaemonUnavailableError("the daemon at " + path_ +
                                     " did not answer the reclaims");
      }
      const bool more = next < asks.size() && unanswered < c->window;
      pollfd p{c->fd.get(), static_cast<short>(POLLIN | (more ? POLLOUT : 0)),
               0};
      ::poll(&p, 1, MillisUntil(until));
    }

    base::MutexLock lock(&mu_);
    for (const Ask& ask : asks) {
      const auto it = held_.find(ask.lease);
      const bool ours = it != held_.end() && it->second.copy == ask.copy &&
                        it->second.reclaim;
      if (!ask.ok) {
        ++reclaim_stats_.reclaim_refused;
        if (ours) drop.push_back(Forget(ask.lease));  // unbacked
        continue;
      }
      ++reclaim_stats_.reclaimed;
      if (!ours) {
        release.push_back(ask.lease);  // its last reference ended meanwhile
        continue;
      }
      Held& held = it->second;
      held.reclaim = false;
      --reclaiming_;
      ask.copy->serial = c->serial;
      // The daemon's word is what the reclaim said. A lease revived during
      // the pass is told "use" once `c` is published; one whose last
      // reference ended during it is told idle by the keeper.
      held.told_idle = ask.idle;
      if (ask.idle && held.refs != 0) {
        held.told_idle = false;
        use.push_back(ask.lease);
      }
      if (held.refs == 0 && !c->delegation) {
        drop.push_back(Forget(ask.lease));  // this daemon would not recall
        release.push_back(ask.lease);
      }
    }
    // `drop` unmaps after the lock goes (a lease released on `c` is unmapped
    // well before its release is sent, at publication).
  }
}

std::vector<std::shared_ptr<MappedCopy>> ClientCore::GiveUpReclaims(
    uint64_t* count) {
  std::vector<uint64_t> leases;
  for (const auto& [lease, held] : held_) {
    if (held.reclaim) leases.push_back(lease);
  }
  std::vector<std::shared_ptr<MappedCopy>> copies;
  for (const uint64_t lease : leases) {
    copies.push_back(Forget(lease));
    ++*count;
  }
  return copies;
}

bool ClientCore::ReconnectForReclaims(Clock::time_point* retry_at,
                                      std::chrono::milliseconds* backoff) {
  const Clock::time_point now = Clock::now();
  // An idle lease waiting to be reclaimed stays mapped past keep_idle: the
  // successor books it as orphaned either way, and adopts it, loading
  // nothing; keep_idle bounds it again once it is reclaimed.
  if (reclaiming_ == 0) return false;
  if (connecting_ || now < *retry_at) {
    // Another thread connects (and reclaims), or we back off.
    cv_.WaitUntil(&mu_, connecting_ ? now + kReclaimBackoffMax : *retry_at);
    return true;
  }
  mu_.Unlock();
  bool connected = false;
  try {
    Connected(Clock::now(), nullptr);  // one attempt
    connected = true;
  } catch (...) {
    // Quiet: tried again after the backoff.
  }
  mu_.Lock();
  if (connected) {
    *backoff = options_.backoff_initial;
    *retry_at = Clock::time_point::min();
  } else {
    *retry_at = After(*backoff);
    *backoff = std::min(*backoff * 2,
                        std::min(options_.backoff_max, kReclaimBackoffMax));
  }
  return true;
}

void ClientCore::Broke(std::shared_ptr<Connection> c, bool keep_leases) {
  if (c->broken) return;
  c->broken = true;
  // Wakes a reader elsewhere and tells the daemon at once.
  ::shutdown(c->fd.get(), SHUT_RDWR);
  if (conn_ == c) conn_.reset();
  // A successor may adopt its leases: they wait for the next connection's
  // reclaims, which the keeper makes soon. Otherwise they died with it:
  // idle ones are unmapped now; references in use keep their mapping, and
  // their end releases nothing.
  c->kept = keep_leases && c->reclaim && options_.reclaim && !stop_;
  std::vector<uint64_t> gone;
  for (auto& [lease, held] : held_) {
    if (held.copy->serial != c->serial || held.reclaim) continue;
    if (c->kept) {
      held.reclaim = true;
      ++reclaiming_;
    } else {
      gone.push_back(lease);
    }
  }
  for (const uint64_t lease : gone) Forget(lease);
  if (reclaiming_ != 0) StartFlusher();
  cv_.NotifyAll();
}

}  // namespace modelcache::serve::detail
