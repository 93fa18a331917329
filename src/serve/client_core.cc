// The client's multiplexer: one connection, requests matched to replies by
// id, one reader at a time, releases never lost (design note:
// client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

std::shared_ptr<Connection> ClientCore::Dial(Clock::time_point deadline) {
  sockaddr_un address{};
  if (path_.empty() || path_.size() >= sizeof(address.sun_path)) {
    throw DaemonUnavailableError("socket path '" + path_ +
                                 "' is empty or too long");
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path_.c_str(), path_.size() + 1);
  auto c = std::make_shared<Connection>();
  c->generation = generation_;
  c->fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!c->fd) {
    const int e = errno;
    throw DaemonUnavailableError("cannot make a socket: " + base::ErrnoText(e));
  }
  // A full backlog makes connect wait; bound that wait.
  timeval tv{};
  tv.tv_sec = 1;
  ::setsockopt(c->fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int r;
  do {
    r = ::connect(c->fd.get(), reinterpret_cast<sockaddr*>(&address),
                  sizeof(address));
  } while (r != 0 && errno == EINTR);
  if (r != 0) {
    const int e = errno;
    throw DaemonUnavailableError("cannot reach the daemon at " + path_ + ": " +
                                 base::ErrnoText(e));
  }
  ::fcntl(c->fd.get(), F_SETFL, ::fcntl(c->fd.get(), F_GETFL) | O_NONBLOCK);
  InstallForkHandler();
  c->slot = RegisterSocket(c->fd.get());

  // hello, on a socket nobody else uses yet. A daemon that refuses the
  // connection (too many clients) has already queued its reason: read it
  // even when the send fails.
  const Clock::time_point hello_deadline =
      std::max(deadline, Clock::now() + std::chrono::seconds(5));
  const bool sent = SendOn(*c, protocol::EncodeHello(1), hello_deadline);
  Datagram datagram;
  for (;;) {
    const int got = ReceiveDatagram(c->fd.get(), protocol::kMaxMessageBytes, 0,
                                    MSG_DONTWAIT, &datagram);
    if (got == 0) {
      throw DaemonUnavailableError("the daemon at " + path_ +
                                   " closed the connection");
    }
    if (got > 0) {
      const protocol::ParsedReply parsed = protocol::ParseReply(datagram.bytes);
      if (!parsed.reply) {
        throw ServeError(ServeCode::kInvalid,
                         "malformed reply to hello: " + parsed.error);
      }
      if (!parsed.reply->ok) ThrowErrorOf(*parsed.reply);
      if (parsed.reply->id != 1) continue;
      c->info.server = parsed.reply->server;
      c->info.version = parsed.reply->version;
      c->info.limits = parsed.reply->limits;
      c->delegation = c->info.limits.count("recall_timeout_ms") != 0;
      if (const auto it = c->info.limits.find("reclaim");
          it != c->info.limits.end()) {
        c->reclaim = it->second != 0;
      }
      if (const auto it = c->info.limits.find("max_queued_replies");
          it != c->info.limits.end()) {
        c->window =
            static_cast<size_t>(std::clamp<uint64_t>(it->second / 2, 1, 1024));
      }
      return c;
    }
    // A peer that closed with our hello unread reports ECONNRESET once,
    // before the messages it queued: read on.
    if (errno == ECONNRESET) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      const int e = errno;
      throw DaemonUnavailableError("lost the daemon at " + path_ + ": " +
                                   base::ErrnoText(e));
    }
    if (!sent) {
      throw DaemonUnavailableError("the daemon at " + path_ +
                                   " closed the connection");
    }
    if (Clock::now() >= hello_deadline) {
      throw DaemonUnavailableError("the daemon at " + path_ +
                                   " did not answer hello");
    }
    pollfd p{c->fd.get(), POLLIN, 0};
    ::poll(&p, 1, MillisUntil(hello_deadline));
  }
}

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

std::shared_ptr<Connection> ClientCore::Connected(
    Clock::time_point deadline, const WaitInterrupt* interrupt) {
  mu_.Lock();
  for (;;) {
    if (conn_ && !conn_->broken) {
      std::shared_ptr<Connection> c = conn_;
      mu_.Unlock();
      return c;
    }
    if (!connecting_) break;
    if (!cv_.WaitUntil(&mu_, deadline) && Clock::now() >= deadline) {
      mu_.Unlock();
      throw DaemonUnavailableError("timed out waiting to reconnect to " +
                                   path_);
    }
  }
  connecting_ = true;
  mu_.Unlock();

  const auto done = [this](std::nullptr_t) {
    base::MutexLock lock(&mu_);
    connecting_ = false;
    cv_.NotifyAll();
  };
  auto backoff = options_.backoff_initial;
  for (;;) {
    try {
      std::shared_ptr<Connection> c = Dial(deadline);
      // The reclaims first; then the connection is everyone's.
      std::vector<uint64_t> recalls;
      ReclaimAndPublish(c, deadline, &recalls);
      if (!recalls.empty()) AnswerRecalls(c, recalls);
      return c;
    } catch (const ServeError& e) {
      const bool retry = e.serve_code() == ServeCode::kUnavailable ||
                         e.serve_code() == ServeCode::kBusy;
      if (!retry || Clock::now() + backoff >= deadline) {
        done(nullptr);
        throw;
      }
    } catch (...) {
      done(nullptr);
      throw;
    }
    // Back off, in slices so that an interrupt is seen.
    const Clock::time_point until = Clock::now() + backoff;
    while (Clock::now() < until) {
      const auto slice = interrupt && interrupt->check
                             ? std::min<Clock::duration>(interrupt->every,
                                                         until - Clock::now())
                             : until - Clock::now();
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(slice);
      ::poll(nullptr, 0, static_cast<int>(std::max<int64_t>(ms.count(), 0)));
      if (interrupt && interrupt->check) {
        try {
          interrupt->check();
        } catch (...) {
          done(nullptr);
          throw;
        }
      }
    }
    std::chrono::milliseconds most = options_.backoff_max;
    {
      // Leases waiting to be reclaimed: the successor's grace is short.
      base::MutexLock lock(&mu_);
      if (reclaiming_ != 0) most = std::min(most, kReclaimBackoffMax);
    }
    backoff = std::min(backoff * 2, most);
  }
}

void ClientCore::ReclaimAndPublish(const std::shared_ptr<Connection>& c,
                                   Clock::time_point deadline,
                                   std::vector<uint64_t>* recalls) {
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
            recalls->push_back(reply.recall);
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
  // keep_idle still bounds an idle lease while the daemon is away: one
  // past it is given up (unmapped; nothing to release it to).
  std::vector<uint64_t> expired;
  for (const auto& [lease, held] : held_) {
    if (held.reclaim && held.refs == 0 &&
        now - held.idle_since >= options_.keep_idle) {
      expired.push_back(lease);
    }
  }
  if (!expired.empty()) {
    std::vector<std::shared_ptr<MappedCopy>> drop;
    for (const uint64_t lease : expired) drop.push_back(Forget(lease));
    mu_.Unlock();
    drop.clear();  // unmapped outside mu_
    mu_.Lock();
    return true;  // look again
  }
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

std::shared_ptr<MappedCopy> ClientCore::Forget(uint64_t lease) {
  const auto it = held_.find(lease);
  if (it == held_.end()) return nullptr;
  Held& held = it->second;
  std::shared_ptr<MappedCopy> copy = std::move(held.copy);
  if (held.refs == 0) --idle_;
  if (held.reclaim) --reclaiming_;
  for (const std::string& name : held.names) {
    const auto n = by_name_.find(name);
    if (n != by_name_.end() && n->second == lease) by_name_.erase(n);
  }
  held_.erase(it);
  return copy;
}

bool ClientCore::Reachable(uint64_t lease) const {
  const auto it = held_.find(lease);
  if (it == held_.end()) return false;
  for (const std::string& name : it->second.names) {
    const auto n = by_name_.find(name);
    if (n != by_name_.end() && n->second == lease) return true;
  }
  return false;
}

std::shared_ptr<Grant> ClientCore::LocalAcquire(const std::string& name) {
  if (!options_.local_reuse) return nullptr;
  base::MutexLock lock(&mu_);
  const auto n = by_name_.find(name);
  if (n == by_name_.end()) return nullptr;
  Held& held = held_.at(n->second);
  // A lease waiting to be reclaimed is used too: its mapping is as valid
  // as ever, and the reclaim will say how it is used (or it is unbacked,
  // and so is this reference).
  if (!held.reclaim &&
      (!conn_ || conn_->broken || held.copy->serial != conn_->serial)) {
    return nullptr;
  }
  std::shared_ptr<MappedCopy> copy = held.copy;
  if (held.refs++ == 0) {
    --idle_;
    // The daemon counts it as evictable. Nothing is sent here, and the
    // keeper is not woken: a recall that comes meanwhile meets this
    // reference under mu_ and is answered "use" (AnswerRecalls), so no
    // copy this process maps can be freed. The keeper, which looks at
    // least every kUseNoticeLag while a lease is told idle, says "use"
    // once the lease has been used for idle_notice_delay; a lease revived
    // and released between its looks sends nothing at all.
    if (held.told_idle && !held.reclaim) {
      held.used_since = Clock::now();
      StartFlusher();  // running already: it keeps the idle lease
    }
  }
  auto grant = std::make_shared<Grant>();
  grant->core = shared_from_this();
  grant->copy = std::move(copy);
  grant->load = "local";
  grant->generation = generation_;
  return grant;
}

void ClientCore::Keep(const std::shared_ptr<MappedCopy>& copy,
                      const std::vector<std::string>& names,
                      const Connection& from) {
  std::vector<std::shared_ptr<MappedCopy>> replaced;
  std::vector<std::pair<uint64_t, uint64_t>> release;  // (serial, lease)
  // Without local reuse a lease is kept only to be reclaimed after a lost
  // connection: under no name, so no other acquire finds it, and forgotten
  // at its reference's end (~Grant releases it).
  const bool reclaimable = options_.reclaim && from.reclaim;
  if (!options_.local_reuse && !reclaimable) return;
  {
    base::MutexLock lock(&mu_);
    const bool current =
        conn_ && !conn_->broken && conn_->serial == copy->serial;
    // Granted on a connection that broke since, keeping its leases for the
    // next one, not published yet (it publishes after its last look): this
    // one waits with them. Once published, it is too late: unbacked.
    const bool waits = !current && from.broken && from.kept &&
                       (!conn_ || conn_->broken) && !stop_;
    if (!current && !waits) return;
    Held& held = held_[copy->lease];
    held.copy = copy;
    held.refs = 1;
    if (waits) {
      held.reclaim = true;
      ++reclaiming_;
      StartFlusher();
    } else if (reclaimable) {
      // The keeper watches the connection while leases are held, so that
      // a daemon's end is noticed (and the leases reclaimed within the
      // successor's grace period) without waiting for a call.
      StartFlusher();
    }
    if (!options_.local_reuse) return;
    for (const std::string& name : names) {
      const auto n = by_name_.find(name);
      if (n != by_name_.end() && n->second != copy->lease) {
        // Two acquires of one name raced: the older lease stays reachable
        // by its references only, and goes when they end (or now, idle).
        const uint64_t older = n->second;
        by_name_.erase(n);
        if (!Reachable(older) && held_.at(older).refs == 0) {
          release.emplace_back(held_.at(older).copy->serial, older);
          replaced.push_back(Forget(older));
        }
      }
      by_name_[name] = copy->lease;
      held.names.push_back(name);
    }
  }
  replaced.clear();  // unmapped before the releases
  for (const auto& [serial, lease] : release) Release(serial, lease);
}

void ClientCore::Unref(std::shared_ptr<MappedCopy> copy) noexcept {
  const uint64_t lease = copy->lease;
  uint64_t serial = 0;
  std::shared_ptr<MappedCopy> drop;
  bool release = false;
  {
    base::MutexLock lock(&mu_);
    serial = copy->serial;  // a reclaim changes it
    const auto it = held_.find(lease);
    if (it == held_.end() || it->second.copy != copy) {
      // Not kept: its connection is gone (or it is unbacked), say; then
      // the release finds no connection of `serial` and sends nothing.
      drop = std::move(copy);
      release = true;
    } else if (--it->second.refs == 0) {
      Held& held = it->second;
      // A lease waiting to be reclaimed is kept idle too: its reclaim will
      // say so.
      const bool keep =
          options_.keep_idle.count() > 0 && Reachable(lease) && !stop_ &&
          (held.reclaim || (conn_ && !conn_->broken &&
                            conn_->serial == serial && conn_->delegation));
      ++idle_;
      if (keep) held.idle_since = Clock::now();
      if (keep && held.told_idle && !held.reclaim) {
        // Revived and released before the keeper said "use": the daemon
        // still counts it idle, which it is again. A keeper polling for
        // the connection's end only (no lease was idle) is woken to read
        // the recalls this one may get.
        if (keeper_watching_) WakeKeeper();
      } else if (keep && !held.reclaim) {
        // The keeper sends the notice: woken only when it would sleep past
        // the notice's time by more than the delay itself (a late notice
        // errs on the safe side: the daemon counts the lease as in use).
        // Without a delay the notice goes now, and the keeper need only
        // look at the told lease within kUseNoticeLag (for "use"): one
        // already due to look by then is not woken, so that a release costs
        // no thread's wake.
        Clock::time_point due =
            held.idle_since + 2 * options_.idle_notice_delay;
        if (options_.idle_notice_delay.count() <= 0) {
          due = held.idle_since + kUseNoticeLag;
          held.told_idle = true;
          // A failed send breaks the connection, which forgets or marks
          // `held` (erasing nothing from held_ while marking).
          const std::shared_ptr<Connection> c = conn_;
          SendNotice(c, protocol::Op::kIdle, lease);
        }
        const bool running = flushing_;
        StartFlusher();
        if (running && (keeper_wakes_ > due || keeper_watching_)) WakeKeeper();
      } else if (!keep) {
        drop = Forget(lease);
        release = true;
      }
    }
  }
  copy.reset();
  drop.reset();  // unmapped before the release
  if (release) Release(serial, lease);
}

size_t ClientCore::IdleLeases() const {
  base::MutexLock lock(&mu_);
  return idle_;
}

ReclaimStats ClientCore::Reclaims() const {
  base::MutexLock lock(&mu_);
  ReclaimStats stats = reclaim_stats_;
  stats.pending = reclaiming_;
  return stats;
}

void ClientCore::SendNotice(const std::shared_ptr<Connection>& c,
                            protocol::Op op, uint64_t lease) {
  if (c->broken) return;
  const uint64_t id = next_id_++;
  c->unsent.emplace_back(id, op == protocol::Op::kIdle
                                 ? protocol::EncodeIdle(id, lease)
                                 : protocol::EncodeUse(id, lease));
  if (!FlushUnsent(*c)) {
    last_break_ = "the connection failed: " + base::ErrnoText(errno);
    Broke(c);
    return;
  }
  if (!c->unsent.empty()) StartFlusherToSend();
}

void ClientCore::StartFlusherToSend() {
  const bool watching = keeper_watching_;
  StartFlusher();
  if (watching) WakeKeeper();
}

void ClientCore::WakeKeeper() {
  cv_.NotifyAll();
  if (!wake_fd_) return;
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
}

Clock::time_point ClientCore::IdleChores(
    const std::shared_ptr<Connection>& c,
    std::vector<std::shared_ptr<MappedCopy>>* expired) {
  Clock::time_point next = Clock::time_point::max();
  if (held_.empty()) return next;
  const Clock::time_point now = Clock::now();
  std::vector<uint64_t> ended;
  for (auto& [lease, held] : held_) {
    if (held.copy->serial != c->serial) continue;
    if (held.refs != 0) {
      // Revived while the daemon counted it idle (LocalAcquire).
      if (!held.told_idle || held.reclaim) continue;
      const Clock::time_point due =
          held.used_since + options_.idle_notice_delay;
      if (now < due) {
        next = std::min(next, due);
        continue;
      }
      held.told_idle = false;
      SendNotice(c, protocol::Op::kUse, lease);
      if (c->broken) return Clock::time_point::max();  // as below
      continue;
    }
    if (!held.told_idle) {
      const Clock::time_point due =
          held.idle_since + options_.idle_notice_delay;
      if (now >= due) {
        held.told_idle = true;
        SendNotice(c, protocol::Op::kIdle, lease);
        // A failed send broke `c`, which forgot its leases (erasing from
        // held_, which this loop walks) or marked them to be reclaimed:
        // nothing is left to do on it.
        if (c->broken) return Clock::time_point::max();
      } else {
        next = std::min(next, due);
      }
    }
    // A told lease may be revived without a word (LocalAcquire): looked
    // at again soon enough to say "use".
    if (held.told_idle) next = std::min(next, now + kUseNoticeLag);
    const Clock::time_point end = held.idle_since + options_.keep_idle;
    if (now >= end) {
      ended.push_back(lease);
    } else {
      next = std::min(next, end);
    }
  }
  for (const uint64_t lease : ended) expired->push_back(Forget(lease));
  return next;
}

void ClientCore::AnswerRecalls(const std::shared_ptr<Connection>& c,
                               const std::vector<uint64_t>& recalls) {
  if (options_.test_on_recall) {
    for (const uint64_t lease : recalls) options_.test_on_recall(lease);
  }
  std::vector<std::shared_ptr<MappedCopy>> drop;
  std::vector<uint64_t> release;
  {
    base::MutexLock lock(&mu_);
    for (const uint64_t lease : recalls) {
      const auto it = held_.find(lease);
      // Unknown: released already (its release is on its way).
      if (it == held_.end() || it->second.copy->serial != c->serial) continue;
      if (it->second.refs == 0) {
        drop.push_back(Forget(lease));
        release.push_back(lease);
      } else {
        it->second.told_idle = false;
        SendNotice(c, protocol::Op::kUse, lease);  // busy
      }
    }
  }
  drop.clear();  // unmapped before the releases
  if (release.empty()) return;
  base::MutexLock lock(&mu_);
  for (const uint64_t lease : release) SendRelease(c, lease);
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
  std::vector<uint64_t> recalls;
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
          recalls.push_back(reply.recall);
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

void ClientCore::SendRelease(const std::shared_ptr<Connection>& c,
                             uint64_t lease) {
  if (c->broken) return;  // the lease died with the connection
  const uint64_t id = next_id_++;
  c->unsent.emplace_back(id, protocol::EncodeRelease(id, lease));
  if (!FlushUnsent(*c)) {
    last_break_ = "the connection failed: " + base::ErrnoText(errno);
    Broke(c);
    return;
  }
  if (!c->unsent.empty()) StartFlusherToSend();
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
  if (sent && c.unsent.empty()) cv_.NotifyAll();  // for SendOn
  return true;
}

void ClientCore::StartFlusher() {
  if (flushing_ || stop_) return;
  if (!wake_fd_) {
    wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_fd_) return;  // the next release or request sends the queue
  }
  if (flusher_.joinable()) flusher_.join();  // it has let go of mu_
  try {
    flusher_ = std::thread([this] { Flusher(); });
    flushing_ = true;
  } catch (const std::system_error&) {
    // No thread now: the next release or request sends the queue.
  }
}

void ClientCore::Flusher() {
  mu_.Lock();
  Clock::time_point retry_at = Clock::time_point::min();
  std::chrono::milliseconds backoff = options_.backoff_initial;
  bool hung_up = false;  // the last poll saw the connection end
  for (;;) {
    const std::shared_ptr<Connection> c = conn_;
    if (stop_) break;
    if (!c || c->broken) {
      // Leases wait to be reclaimed: connect again (which reclaims them)
      // even when no call does.
      if (ReconnectForReclaims(&retry_at, &backoff)) continue;
      break;
    }
    // A connection whose leases a successor could adopt keeps it watching
    // `c` for its life, so that no acquire starts a thread and a daemon's
    // end is noticed at once while a lease is held.
    const bool watch = c->reclaim && options_.reclaim;
    std::vector<std::shared_ptr<MappedCopy>> expired;
    const Clock::time_point next = IdleChores(c, &expired);
    if (c->broken) continue;
    if (c->unsent.empty() && c->unanswered.empty() && idle_ == 0 && !watch &&
        next == Clock::time_point::max() && expired.empty()) {
      break;
    }
    if (!expired.empty()) {
      std::vector<uint64_t> leases;
      for (const auto& copy : expired) leases.push_back(copy->lease);
      mu_.Unlock();
      expired.clear();  // unmapped before the releases
      mu_.Lock();
      for (const uint64_t lease : leases) SendRelease(c, lease);
      continue;
    }
    if (!FlushUnsent(*c)) {
      last_break_ = "the connection failed: " + base::ErrnoText(errno);
      Broke(c);
      continue;
    }
    const bool want_out =
        !c->unsent.empty() && c->unanswered.size() < c->window;
    // Something to read: recalls (for idle leases), answers that hold back
    // queued messages (or, when it does not watch, that it waits for before
    // it ends), or the end of the connection seen by the last poll.
    // Otherwise the socket is polled for its end only (POLLHUP), and a
    // caller reads its own reply with no hop through this thread (the
    // answers to releases are drained by the next call).
    const bool need_read = idle_ != 0 || !c->unsent.empty() || hung_up ||
                           (!watch && !c->unanswered.empty());
    const bool read = !reading_ && need_read;
    const bool hangup_only = !reading_ && !need_read && watch;
    hung_up = false;
    const Clock::time_point until =
        std::min(next, Clock::now() + std::chrono::seconds(1));
    keeper_wakes_ = until;
    if (!want_out && !read && !hangup_only) {
      // Another thread reads: it files the answers (and recalls) and wakes
      // us.
      cv_.WaitUntil(&mu_, until);
      continue;
    }
    if (read) reading_ = true;
    keeper_watching_ = hangup_only;
    const int wake = wake_fd_.get();
    mu_.Unlock();
    pollfd p[2] = {
        {c->fd.get(),
         static_cast<short>((want_out ? POLLOUT : 0) | (read ? POLLIN : 0)), 0},
        {wake, POLLIN, 0}};
    ::poll(p, 2, MillisUntil(until));
    if ((p[1].revents & POLLIN) != 0) {
      uint64_t count;
      [[maybe_unused]] const ssize_t n = ::read(wake, &count, sizeof(count));
    }
    if (read) ReadAndFile(c, 0);
    hung_up = !read && (p[0].revents & (POLLHUP | POLLERR)) != 0;
    mu_.Lock();
    keeper_watching_ = false;
    if (read) {
      reading_ = false;
      cv_.NotifyAll();
    }
  }
  flushing_ = false;
  mu_.Unlock();
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
    SendRelease(c, lease);  // sent, or queued for the flusher
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
