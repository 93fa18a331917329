// The client's dialling: connecting to the daemon's socket with backoff, one
// thread at a time, and the hello that opens a connection (design note:
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
      // A process that keeps leases past their last reference says so,
      // before any other request, so that the daemon may recall them while
      // it counts them in use: a lease whose reference ended before its
      // idle notice went is then still found by the next acquire that
      // needs its room (protocol.h). Its answer is awaited by no one.
      if (c->delegation && c->info.limits.count("recall_in_use") != 0 &&
          options_.local_reuse && options_.keep_idle.count() > 0) {
        uint64_t id;
        {
          base::MutexLock lock(&mu_);
          id = next_id_++;
          c->unanswered.insert(id);
        }
        if (!SendOn(*c, protocol::EncodeDelegate(id), hello_deadline)) {
          throw DaemonUnavailableError("the daemon at " + path_ +
                                       " closed the connection");
        }
        c->delegates = true;
      }
      // A process that reuses leases locally stops doing so for a copy
      // that drains, when the daemon says so (protocol.h, "Drains").
      if (c->info.limits.count("drain") != 0 && options_.local_reuse) {
        uint64_t id;
        {
          base::MutexLock lock(&mu_);
          id = next_id_++;
          c->unanswered.insert(id);
        }
        if (!SendOn(*c, protocol::EncodeDrain(id), hello_deadline)) {
          throw DaemonUnavailableError("the daemon at " + path_ +
                                       " closed the connection");
        }
        c->heeds_drains = true;
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
      std::vector<protocol::Recall> recalls;
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

}  // namespace modelcache::serve::detail
