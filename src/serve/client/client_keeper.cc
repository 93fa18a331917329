// The client's keeper (the flusher thread): sends the queued releases and
// the idle and use notices due, ends leases idle past keep_idle, and reads the
// socket when no caller does (design note: client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

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
    const bool in_use_recallable =
        (c->delegates || c->heeds_drains) && held_.size() > idle_;
    if (c->unsent.empty() && c->unanswered.empty() && idle_ == 0 && !watch &&
        !in_use_recallable && next == Clock::time_point::max() &&
        expired.empty()) {
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
    // A connection that said "delegate" or "drain" may be recalled a lease
    // in use (answered "use" at once, rather than at the daemon's recall
    // timeout while its "fail" acquire waits, and lent no more once its
    // copy drains): read while one is held.
    const bool need_read = idle_ != 0 || !c->unsent.empty() || hung_up ||
                           (!watch && !c->unanswered.empty()) ||
                           in_use_recallable;
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

}  // namespace modelcache::serve::detail
