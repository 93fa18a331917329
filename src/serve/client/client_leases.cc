// The client's lease keeping: the table of held leases, local acquires and
// their ends, the notices to the daemon and the answers to its recalls
// (design note: client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

std::shared_ptr<MappedCopy> ClientCore::Forget(uint64_t lease) {
  const auto it = held_.find(lease);
  if (it == held_.end()) return nullptr;
  Held& held = it->second;
  std::shared_ptr<MappedCopy> copy = std::move(held.copy);
  if (held.refs == 0) --idle_;
  if (held.reclaim) --reclaiming_;
  Unname(lease);
  held_.erase(it);
  return copy;
}

void ClientCore::Unname(uint64_t lease) {
  Held& held = held_.at(lease);
  for (const std::string& name : held.names) {
    const auto n = by_name_.find(name);
    if (n != by_name_.end() && n->second == lease) by_name_.erase(n);
  }
  held.names.clear();
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
    } else if (reclaimable || from.delegates || from.heeds_drains) {
      // The keeper watches the connection while leases are held, so that
      // a daemon's end is noticed (and the leases reclaimed within the
      // successor's grace period) without waiting for a call, and reads it
      // when the daemon may recall a lease in use (it said "delegate" or
      // "drain").
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
    // The idle notice sent now (idle_notice_delay 0), and its connection:
    // the reference's end returns once it is on the socket.
    uint64_t notice = 0;
    std::shared_ptr<Connection> noticed_on;
    serial = copy->serial;  // a reclaim changes it
    const auto it = held_.find(lease);
    if (it == held_.end() || it->second.copy != copy) {
      // Not kept: its connection is gone (or it is unbacked), say; then
      // the release finds no connection of `serial` and sends nothing.
      drop = std::move(copy);
      release = true;
    } else if (--it->second.refs == 0) {
      Held& held = it->second;
      // A lease waiting to be reclaimed is kept idle too, whatever
      // keep_idle says: while the daemon is away nothing could free its
      // copy anyway, the successor books the mapping as orphaned either
      // way, and the reclaim adopts it (then keep_idle applies, counted
      // from this release).
      const bool keep =
          Reachable(lease) && !stop_ &&
          (held.reclaim ||
           (options_.keep_idle.count() > 0 && conn_ && !conn_->broken &&
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
          noticed_on = conn_;
          notice = SendNotice(noticed_on, protocol::Op::kIdle, lease);
        }
        const bool running = flushing_;
        StartFlusher();
        if (running && (keeper_wakes_ > due || keeper_watching_)) WakeKeeper();
      } else if (!keep) {
        drop = Forget(lease);
        release = true;
      }
    }
    // Last: it may let go of mu_ (`held` is not used past here).
    if (notice != 0) AwaitSent(noticed_on, notice);
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

uint64_t ClientCore::SendNotice(const std::shared_ptr<Connection>& c,
                                protocol::Op op, uint64_t lease) {
  if (c->broken) return 0;
  const uint64_t id = next_id_++;
  return QueueAndFlush(c, id,
                       op == protocol::Op::kIdle
                           ? protocol::EncodeIdle(id, lease)
                           : protocol::EncodeUse(id, lease));
}

void ClientCore::AnswerRecalls(const std::shared_ptr<Connection>& c,
                               const std::vector<protocol::Recall>& recalls) {
  if (options_.test_on_recall) {
    for (const protocol::Recall& r : recalls) options_.test_on_recall(r.lease);
  }
  std::vector<std::shared_ptr<MappedCopy>> drop;
  std::vector<uint64_t> release;
  {
    base::MutexLock lock(&mu_);
    for (const protocol::Recall& r : recalls) {
      const auto it = held_.find(r.lease);
      // Unknown: released already (its release is on its way).
      if (it == held_.end() || it->second.copy->serial != c->serial) continue;
      if (it->second.refs == 0) {
        drop.push_back(Forget(r.lease));
        release.push_back(r.lease);
      } else {
        if (r.retired || r.drain) {
          // Its model was retired, or its copy drains for an older request
          // for room: the references in use keep the copy, but no acquire
          // may take a new one (not even while the daemon is away; a new
          // acquire asks the daemon, where it queues behind the drain), and
          // the last one's end releases it (Unref: it is not reachable by
          // any name).
          Unname(r.lease);
        }
        it->second.told_idle = false;
        SendNotice(c, protocol::Op::kUse, r.lease);  // busy
      }
    }
  }
  drop.clear();  // unmapped before the releases
  if (release.empty()) return;
  base::MutexLock lock(&mu_);
  for (const uint64_t lease : release) SendRelease(c, lease);
}

}  // namespace modelcache::serve::detail
