#include "engine.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>

namespace modelcache::replay {
namespace {

// The cache's clock ticks in nanoseconds and expires what has been idle
// longer than the TTL: a TTL check runs one tick after the TTL.
constexpr double kNanosecondMs = 1e-6;

}  // namespace

double TraceStart(const Trace& trace) {
  return trace.requests.empty()
             ? 0
             : static_cast<double>(trace.requests.front().t_ms);
}

double TraceEnd(const Trace& trace) {
  return trace.requests.empty()
             ? 0
             : static_cast<double>(trace.requests.back().t_ms);
}

double HoldMsOf(const Trace& trace, const SimulateOptions& options, size_t i) {
  return trace.hold_ms.empty() ? options.hold_ms
                               : static_cast<double>(trace.hold_ms[i]);
}

Node::Node(const TraceHeader& trace, const NamedPolicy& spec, uint64_t capacity,
           const SimulateOptions& options, bool timed, double t_first,
           double t_last, NodeListener* listener)
    : trace_(trace),
      spec_(spec),
      ttl_ms_(static_cast<double>(spec.idle_ttl.count()) / 1e6),
      prewarm_evicts_lower_ranked_(
          spec.keep_alive && spec.keep_alive->prewarm_evicts_lower_ranked()),
      options_(options),
      timed_(timed),
      time_(timed ? options.time : TimeModel{kInf, 0, /*slots=*/0}),
      capacity_(capacity),
      listener_(listener),
      models_(trace.models.size()),
      t_first_(t_first),
      t_last_(t_last),
      books_(trace, t_first_, t_last_, options.max_exact_waits),
      link_(time_.bandwidth_bytes_per_second, /*ticks_per_second=*/1000) {
  for (uint32_t m = 0; m < trace.models.size(); ++m)
    index_.emplace(trace.models[m], m);
  NewCache();
}

void Node::NewCache() {
  CacheOptions cache_options;
  cache_options.name = "replay";
  cache_options.capacity_bytes = capacity_;
  cache_options.policy = spec_.eviction;
  cache_options.shard_bits = 0;
  cache_options.now = [this] { return ClockAt(now_); };
  cache_options.idle_ttl = spec_.idle_ttl;
  cache_options.on_event = [this](const CacheEvent& e) { OnEvent(e); };
  cache_.emplace(std::move(cache_options));
}

Node::~Node() {
  // Leases before the cache.
  holds_.Clear();
  for (auto& m : models_) m.load_lease.Release();
}

// ---- time ----

void Node::AdvanceTo(double t) {
  if (t <= now_) return;
  books_.Advance(
      now_, t,
      Books::State{idle_bytes_, demand_in_flight_ + prewarm_in_flight_ > 0,
                   static_cast<uint32_t>(demand_queue_.size()),
                   cache_ ? cache_->budget().used() : 0});
  // Transfers progress at their share of the bandwidth.
  link_.AdvanceTo(t);
  now_ = t;
}

void Node::FinishTransfers() {
  std::vector<uint32_t> done;
  for (const uint64_t m : link_.TakeDone()) {
    done.push_back(static_cast<uint32_t>(m));
  }
  // Loads that end at the same instant complete in the order of their
  // requests: the load whose earliest waiting request came first completes
  // (and so becomes "recent") first. A load nobody waits for (a prewarm, or
  // one whose every requester left) comes after them, by model. Never the
  // order in which the models first appeared in the trace, nor the order of
  // the transfer list, so the result does not depend on either.
  constexpr size_t kNoRequest = std::numeric_limits<size_t>::max();
  auto first_request = [&](uint32_t m) {
    const std::vector<Waiter>& waiters = models_[m].waiters;
    return waiters.empty() ? kNoRequest : waiters.front().request.id;
  };
  std::sort(done.begin(), done.end(), [&](uint32_t a, uint32_t b) {
    const size_t ra = first_request(a), rb = first_request(b);
    return ra != rb ? ra < rb : a < b;
  });
  for (uint32_t m : done) CompleteLoad(m);
}

double Node::NextTime() const {
  const double next_event = events_.empty() ? kInf : events_.top().t;
  return std::min(next_event, link_.NextEnd());
}

void Node::Step() {
  const double next_event = events_.empty() ? kInf : events_.top().t;
  const double next_transfer = link_.NextEnd();
  const double next = std::min(next_event, next_transfer);
  assert(next != kInf);
  AdvanceTo(next);
  if (next_transfer <= next_event) {
    FinishTransfers();
  } else {
    const Event e = events_.top();
    events_.pop();
    HandleEvent(e);
  }
  StartLoads();
}

void Node::HandleEvent(const Event& e) {
  ModelState& s = models_[e.model];
  // After the trace, only what finishes its requests matters.
  const bool after_trace = now_ > t_last_;
  switch (e.type) {
    case EventKind::kHoldEnd:
      holds_.Release(e.arg);
      DropLease(e.model, /*request_ended=*/true);
      if (listener_) {
        listener_->Ended(hold_request_[e.arg], NodeListener::Outcome::kServed,
                         now_);
      }
      break;
    case EventKind::kLatencyEnd:
      if (e.arg == s.load_id) EnterTransfer(e.model);
      break;
    case EventKind::kTtlCheck:
      s.ttl_check_pending = false;
      if (after_trace || s.state != State::kResident || s.leases > 0) break;
      if (now_ > s.idle_since + ttl_ms_) {
        cache_->EvictExpired();
      } else {
        s.ttl_check_pending = true;
        Schedule(s.idle_since + ttl_ms_ + kNanosecondMs, EventKind::kTtlCheck,
                 e.model, 0);
      }
      break;
    case EventKind::kKeepAliveEnd:
      if (e.t != s.keep_alive_event) break;  // superseded
      s.keep_alive_event = kInf;
      if (after_trace) break;
      if (now_ < s.keep_until) {
        s.keep_alive_event = s.keep_until;
        Schedule(s.keep_until, EventKind::kKeepAliveEnd, e.model, 0);
      } else if (s.state == State::kResident && s.leases == 0 && !s.draining) {
        // (A draining model's bytes are its waiter's.)
        cache_->Remove(trace_.models[e.model]);
      }
      break;
    case EventKind::kPrewarm:
      if (after_trace) break;
      if (e.arg != s.generation && e.arg != ~uint64_t{0}) break;
      Prewarm(e.model);
      break;
    case EventKind::kDeadline: {
      auto by_id = [&](const Waiter& w) { return w.id == e.arg; };
      auto parked = std::find_if(s.parked.begin(), s.parked.end(), by_id);
      if (parked != s.parked.end()) {
        // It left while queued behind a drain: counted at its arrival now.
        const size_t request = parked->request.id;
        s.parked.erase(parked);
        books_.ColdStart(e.model);
        books_.Rejected();
        if (listener_) {
          listener_->Ended(request, NodeListener::Outcome::kRejected, now_);
        }
        break;
      }
      auto it = std::find_if(s.waiters.begin(), s.waiters.end(), by_id);
      if (it == s.waiters.end()) break;
      const size_t request = it->request.id;
      s.waiters.erase(it);
      books_.Rejected();
      if (listener_) {
        listener_->Ended(request, NodeListener::Outcome::kRejected, now_);
      }
      if (s.state == State::kQueued && s.waiters.empty()) {
        // Nobody wants it any more: it never loads.
        demand_queue_.erase(
            std::find(demand_queue_.begin(), demand_queue_.end(), e.model));
        s.state = State::kAbsent;
        room_changed_ = true;
        // A drain ends with its waiter.
        if (drain_.active && drain_.waiter == e.model) EndDrain();
      }
      break;
    }
    case EventKind::kDrainCheck:
      if (e.t != next_drain_check_) break;  // superseded
      next_drain_check_ = kInf;
      MaybeStartDrain();
      break;
  }
}

// ---- requests and leases ----

void Node::AddLease(uint32_t m) {
  ModelState& s = models_[m];
  if (s.leases++ == 0 && s.state == State::kResident) idle_bytes_ -= Size(m);
  ++s.generation;  // cancels a planned prewarm
}

void Node::DropLease(uint32_t m, bool request_ended) {
  ModelState& s = models_[m];
  assert(s.leases > 0);
  if (--s.leases == 0 && s.state == State::kResident) {
    BecameIdle(m, request_ended);
  }
}

void Node::BecameIdle(uint32_t m, bool request_ended) {
  ModelState& s = models_[m];
  idle_bytes_ += Size(m);
  s.idle_since = now_;
  room_changed_ = true;
  // A prewarm that ends is not a request that ends: the keep-alive planned
  // when the last request ended still holds.
  if (!request_ended) return;
  s.last_end = now_;
  if (ttl_ms_ > 0 && !s.ttl_check_pending) {
    s.ttl_check_pending = true;
    Schedule(now_ + ttl_ms_ + kNanosecondMs, EventKind::kTtlCheck, m, 0);
  }
  if (spec_.keep_alive && !s.draining) PlanKeepAlive(m);
}

// The model left the cache (evicted, expired or removed).
void Node::Gone(uint32_t m) {
  ModelState& s = models_[m];
  if (s.state != State::kResident) return;
  assert(s.leases == 0);
  idle_bytes_ -= Size(m);
  s.state = State::kAbsent;
  room_changed_ = true;
}

void Node::OnEvent(const CacheEvent& e) {
  if (killing_) return;
  if (options_.on_event) options_.on_event(now_, e);
  switch (e.type) {
    case modelcache::EventType::kEvicted:
    case modelcache::EventType::kExpired:
    case modelcache::EventType::kRemoved:
      Gone(index_.at(e.key));
      break;
    default:
      break;
  }
}

// A request for a resident model takes its lease for its service time: a hit
// at its arrival, or a waiter when its load ends. The first waiter's Acquire
// is the cache's miss: it makes the record resident (into the room the
// load's reservation kept) and stamps it, so a load is stamped once, at its
// end, whoever joined it. Each request is noted at its arrival.
void Node::TakeLease(uint32_t m, const NodeRequest& request, double arrival,
                     bool hit) {
  const Loader loader = [&]() -> Loaded {
    return Loaded{nullptr, Size(m), {}};
  };
  AcquireOptions acquire;
  acquire.policy_hint = request.hint;
  acquire.arrival = ClockAt(arrival);
  Lease lease = cache_->Acquire(trace_.models[m], Size(m), loader, acquire);
  const double hold = request.hold_ms;
  AddLease(m);
  models_[m].last_access = ++access_seq_;
  if (listener_) listener_->Started(request.id, hit, now_);
  if (hold <= 0) {  // taken and given back at once
    lease.Release();
    DropLease(m, /*request_ended=*/true);
    if (listener_) {
      listener_->Ended(request.id, NodeListener::Outcome::kServed, now_);
    }
    return;
  }
  const size_t slot = holds_.Hold(std::move(lease));
  if (slot >= hold_request_.size()) hold_request_.resize(slot + 1);
  hold_request_[slot] = request.id;
  Schedule(now_ + hold, EventKind::kHoldEnd, m, slot);
}

uint64_t Node::Obtainable() const {
  // The free bytes and the idle models' (evictable), and the prewarms' in
  // flight (a demand load cancels them).
  const uint64_t used = cache_->budget().used();
  uint64_t obtainable = (capacity_ > used ? capacity_ - used : 0) + idle_bytes_;
  for (uint32_t q = 0; q < models_.size(); ++q) {
    const ModelState& s = models_[q];
    if (s.prewarm_class &&
        (s.state == State::kLatency || s.state == State::kTransfer)) {
      obtainable += Size(q);
    }
  }
  return obtainable;
}

bool Node::CouldAdmit(uint32_t m) const {
  return UnowedObtainable() >= Size(m);
}

Node::Admission Node::Arrive(const NodeRequest& r, bool refuse_if_full) {
  const size_t i = r.id;
  const uint32_t m = r.model;
  ModelState& s = models_[m];
  if (refuse_if_full && s.state == State::kAbsent && Size(m) <= capacity_ &&
      !CouldAdmit(m)) {
    return Admission::kRefused;
  }
  s.last_hint = r.hint;
  if (Size(m) > capacity_) {
    books_.TooLarge(m);
    if (listener_) {
      listener_->Ended(i, NodeListener::Outcome::kTooLarge, now_);
    }
    return Admission::kTooLarge;
  }
  const bool loading =
      s.state == State::kLatency || s.state == State::kTransfer;
  if (spec_.keep_alive && s.waiters.empty() && s.leases == (loading ? 1 : 0) &&
      std::isfinite(s.last_end)) {
    s.idle.Record(now_ - s.last_end);
  }
  const uint64_t id = next_waiter_id_++;
  if (s.draining) {
    // It takes no lease: it queues behind the drain, and is counted when
    // the drain ends (or when it leaves).
    s.parked.push_back(Waiter{r, now_, id});
    ++drain_queued_;
    if (std::isfinite(options_.max_wait_ms)) {
      Schedule(now_ + options_.max_wait_ms, EventKind::kDeadline, m, id);
    }
    return Admission::kCold;
  }
  if (s.state == State::kResident) {
    books_.Hit(m);
    books_.Waited(0);
    TakeLease(m, r, now_, /*hit=*/true);
    return Admission::kHit;
  }
  books_.ColdStart(m);
  if (std::isfinite(options_.max_wait_ms)) {
    Schedule(now_ + options_.max_wait_ms, EventKind::kDeadline, m, id);
  }
  WaitForLoad(m, Waiter{r, now_, id});
  return Admission::kCold;
}

void Node::WaitForLoad(uint32_t m, const Waiter& w) {
  ModelState& s = models_[m];
  s.waiters.push_back(w);
  ++s.generation;  // no planned prewarm applies now
  switch (s.state) {
    case State::kAbsent:
      Enqueue(m, w.arrival);
      break;
    case State::kQueued:
      break;
    case State::kLatency:
    case State::kTransfer:
      if (s.prewarm_class) {
        // Someone waits for it now: it is a demand load.
        s.prewarm_class = false;
        --prewarm_in_flight_;
        ++demand_in_flight_;
        link_.Promote(m);  // a transfer now, or when it enters one
      }
      break;
    case State::kResident:
      break;
  }
}

// ---- loads ----

void Node::Enqueue(uint32_t m, double at) {
  ModelState& s = models_[m];
  s.state = State::kQueued;
  s.queued_at = at;
  // After every load queued at or before `at`: arrival order, ties in the
  // order queued. (Only a request admitted at the end of a drain queues
  // with an arrival before now.)
  auto it = std::upper_bound(
      demand_queue_.begin(), demand_queue_.end(), at,
      [&](double t, uint32_t q) { return t < models_[q].queued_at; });
  demand_queue_.insert(it, m);
  room_changed_ = true;  // it may fit now
}

void Node::StartLoads() {
  StartQueuedLoads();
  NoteQueue();
}

void Node::NoteQueue() {
  const uint32_t queued = static_cast<uint32_t>(demand_queue_.size());
  books_.NoteQueue(queued);
}

bool Node::CancelOnePrewarm() {
  for (uint32_t m = 0; m < models_.size(); ++m) {
    ModelState& s = models_[m];
    if (!s.prewarm_class ||
        (s.state != State::kLatency && s.state != State::kTransfer)) {
      continue;
    }
    link_.Remove(m);  // on the link only in its transfer
    // A latency-end event may still come: the load id makes it a no-op.
    --prewarm_in_flight_;
    s.prewarm_class = false;
    s.state = State::kAbsent;
    s.leases = 0;
    s.load_lease.Release();
    cache_->Remove(trace_.models[m]);
    room_changed_ = true;
    return true;
  }
  return false;
}

bool Node::StartLoad(uint32_t m, bool prewarm) {
  ModelState& s = models_[m];
  for (;;) {
    try {
      if (prewarm) {
        // A prewarm is the cache's Prefetch: not a request, and (ours) room
        // only in place of models ranked below it.
        const Loader loader = [&]() -> Loaded {
          return Loaded{nullptr, Size(m), {}};
        };
        AcquireOptions acquire;
        acquire.policy_hint = s.last_hint;
        acquire.request = false;
        acquire.evict_only_lower_ranked = prewarm_evicts_lower_ranked_;
        s.load_lease =
            cache_->Acquire(trace_.models[m], Size(m), loader, acquire);
      } else {
        // A demand load reserves its bytes now, as the cache's miss does
        // (idle models past the TTL go first; then eviction, only if it
        // makes the room), and hands them to the cache's record when it
        // ends (CompleteLoad): the record's first use is the load's end.
        if (ttl_ms_ > 0) cache_->EvictExpired();
        cache_->budget().Reserve(Size(m));
      }
      break;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kCapacity) throw;
      if (prewarm || !CancelOnePrewarm()) return false;
    }
  }
  s.state = State::kLatency;
  s.prewarm_class = prewarm;
  ++s.load_id;
  s.leases = 1;
  s.load_start = now_;
  (prewarm ? prewarm_in_flight_ : demand_in_flight_)++;
  books_.LoadStarted(m);
  if (listener_) listener_->LoadStarted(m, now_);
  if (time_.latency_ms > 0) {
    Schedule(now_ + time_.latency_ms, EventKind::kLatencyEnd, m, s.load_id);
  } else {
    EnterTransfer(m);
  }
  return true;
}

void Node::EnterTransfer(uint32_t m) {
  ModelState& s = models_[m];
  if (s.state != State::kLatency) return;  // cancelled meanwhile
  s.state = State::kTransfer;
  const LoadLink::Class c = s.prewarm_class ? LoadLink::Class::kBackground
                                            : LoadLink::Class::kForeground;
  // Nothing to move, or no bandwidth limit: done at once.
  if (!link_.Add(m, Size(m), c)) CompleteLoad(m);
}

void Node::CompleteLoad(uint32_t m) {
  ModelState& s = models_[m];
  (s.prewarm_class ? prewarm_in_flight_ : demand_in_flight_)--;
  room_changed_ = true;  // a slot is free
  books_.LoadEnded(now_ - s.load_start, s.prewarm_class);
  s.last_load_ms = now_ - s.load_start;
  s.prewarm_class = false;
  s.state = State::kResident;
  std::vector<Waiter> waiters;
  waiters.swap(s.waiters);
  // A prewarm's record is resident since it started, under its load lease.
  // A demand load's bytes were a bare reservation: they go back to the
  // budget, and the first waiter's Acquire reserves them again for the
  // record (nothing else runs in between, so it never evicts).
  Lease load_lease = std::move(s.load_lease);
  if (!load_lease) {
    cache_->budget().Release(Size(m));
    if (waiters.empty()) {
      // Every waiter left (--max-wait): the load still completes, as a
      // load ahead of demand.
      AcquireOptions acquire;
      acquire.request = false;
      load_lease = cache_->Acquire(
          trace_.models[m], Size(m),
          [&]() -> Loaded {
            return Loaded{nullptr, Size(m), {}};
          },
          acquire);
    }
  }
  for (const Waiter& w : waiters) {
    books_.Waited(now_ - w.arrival);
    TakeLease(m, w.request, w.arrival, /*hit=*/false);
  }
  // A drain whose set could not cover its waiter (bytes held by loads in
  // flight) takes in what they load, after their requesters' leases.
  if (drain_.active && drain_.covered < Size(drain_.waiter) &&
      s.state == State::kResident) {
    AddToDrain(m);
    drain_.covered += Size(m);
  }
  load_lease.Release();
  DropLease(m, /*request_ended=*/!waiters.empty());
}

void Node::StartQueuedLoads() {
  const uint32_t slots =
      time_.slots == 0 ? std::numeric_limits<uint32_t>::max() : time_.slots;
  // In arrival order, each queued load that can get its room now starts
  // while a slot is free; one that cannot waits for room without holding
  // back those behind it, as a miss in the cache does (Budget::Reserve has
  // no queue): a load that fits never waits behind one that does not.
  // While a drain runs, its waiter may use the room its set gives (pinned
  // until then) and the bytes it is owed; every other load only the rest.
  if (room_changed_) {
    room_changed_ = false;
    for (size_t i = 0; i < demand_queue_.size() && demand_in_flight_ < slots;) {
      const uint32_t m = demand_queue_[i];
      const bool drain_waiter = drain_.active && drain_.waiter == m;
      bool started = false;
      if (drain_waiter) {
        // The free bytes and idle models outside its set, or with its
        // set's idle members (DrainWaiterRoom).
        const DrainRoom room = DrainWaiterRoom();
        if (room == DrainRoom::kOutsideTheSet) {
          // Its set stays pinned: the load evicts only outside it.
          started = StartLoad(m, /*prewarm=*/false);
        } else if (room == DrainRoom::kWithTheSet) {
          for (uint32_t q : drain_.set) {
            ModelState& d = models_[q];
            if (d.drain_pinned) {
              d.drain_pinned = false;
              cache_->Unpin(trace_.models[q]);
            }
          }
          started = StartLoad(m, /*prewarm=*/false);
          if (!started) {
            // (Not expected: what is obtainable is evictable.) The set
            // stays the waiter's.
            for (uint32_t q : drain_.set) {
              ModelState& d = models_[q];
              if (d.state == State::kResident && !d.drain_pinned) {
                d.drain_pinned = true;
                cache_->Pin(trace_.models[q]);
              }
            }
          }
        }
      } else {
        started =
            UnowedObtainable() >= Size(m) && StartLoad(m, /*prewarm=*/false);
      }
      if (!started) {
        ++i;  // waits for room
        continue;
      }
      demand_queue_.erase(demand_queue_.begin() + static_cast<ptrdiff_t>(i));
      if (drain_waiter) {
        // The requests queued behind it may queue loads before this point:
        // scan again from the oldest.
        EndDrain();
        i = 0;
      }
    }
    MaybeStartDrain();
  }
  while (demand_queue_.empty() && !prewarm_queue_.empty() &&
         demand_in_flight_ + prewarm_in_flight_ < slots) {
    const uint32_t m = prewarm_queue_.front();
    prewarm_queue_.pop_front();
    ModelState& s = models_[m];
    if (s.state != State::kAbsent) continue;
    // Only into free bytes, or (ours) in place of idle models expected
    // later; a prewarm that finds no such room is dropped.
    if (!prewarm_evicts_lower_ranked_ &&
        cache_->budget().used() + Size(m) > capacity_) {
      continue;
    }
    StartLoad(m, /*prewarm=*/true);
  }
}

void Node::Prewarm(uint32_t m) {
  if (models_[m].state != State::kAbsent || Size(m) > capacity_) return;
  prewarm_queue_.push_back(m);
}

// ---- the drain ----

double Node::DrainAfterMs(uint32_t m) const {
  if (!timed_) return kInf;  // loads take no time: nothing to bound
  if (options_.drain_after_ms) return *options_.drain_after_ms;
  // As a cache does: the key's latest load as it took, the floor for a key
  // never loaded.
  return DefaultDrainAfterMs(models_[m].last_load_ms, recent_drain_ms_);
}

uint64_t Node::DrainIdleBytes() const {
  uint64_t bytes = 0;
  for (uint32_t q : drain_.set) {
    const ModelState& d = models_[q];
    if (d.state == State::kResident && d.leases == 0) bytes += Size(q);
  }
  return bytes;
}

Node::DrainRoom Node::DrainWaiterRoom() const {
  // As the budget's drain waiter (Budget::Reserve, DrainStep): the free
  // bytes (and the prewarms in flight, which its load cancels) with the idle
  // models outside its set, evicted as any reservation evicts; else with the
  // idle members of its set too (all of it, once no lease of it is out).
  const uint64_t waiter = Size(drain_.waiter);
  const uint64_t set_idle = DrainIdleBytes();
  const uint64_t outside = Obtainable() - set_idle;
  if (outside >= waiter) return DrainRoom::kOutsideTheSet;
  return outside + set_idle >= waiter ? DrainRoom::kWithTheSet
                                      : DrainRoom::kNone;
}

uint64_t Node::UnowedObtainable() const {
  const uint64_t obtainable = Obtainable();
  if (!drain_.active) return obtainable;
  // As the budget's owed_: every other load must fit with the waiter's
  // bytes set aside, beside the set (pinned, its idle bytes the waiter's).
  // So it takes only what idle models outside the set and the free bytes
  // beyond the waiter's give.
  const uint64_t owed = DrainIdleBytes() + Size(drain_.waiter);
  return obtainable > owed ? obtainable - owed : 0;
}

void Node::MaybeStartDrain() {
  if (drain_.active || demand_queue_.empty()) return;
  // The oldest wait for room: the first queued load (arrival order) that
  // cannot get its room now. (A load that can waits only for a slot.)
  const uint64_t obtainable = Obtainable();
  for (const uint32_t m : demand_queue_) {
    if (obtainable >= Size(m)) continue;
    const double at = models_[m].queued_at + DrainAfterMs(m);
    if (at <= now_) {
      StartDrain(m);
    } else if (at < next_drain_check_) {
      next_drain_check_ = at;
      Schedule(at, EventKind::kDrainCheck, m, 0);
    }
    return;
  }
}

void Node::StartDrain(uint32_t waiter) {
  drain_.active = true;
  drain_.waiter = waiter;
  drain_.set.clear();
  drain_.set_bytes = 0;
  drain_.started_ms = now_;
  ++drains_;
  // The set: resident models, idle and leased alike, least recently used
  // first, until they and the free bytes cover the waiter.
  std::vector<uint32_t> resident;
  for (uint32_t q = 0; q < models_.size(); ++q) {
    if (models_[q].state == State::kResident) resident.push_back(q);
  }
  std::sort(resident.begin(), resident.end(), [&](uint32_t a, uint32_t b) {
    return models_[a].last_access < models_[b].last_access;
  });
  const uint64_t used = cache_->budget().used();
  uint64_t covered = capacity_ > used ? capacity_ - used : 0;
  for (uint32_t q = 0; q < models_.size(); ++q) {
    const ModelState& p = models_[q];
    if (p.prewarm_class &&
        (p.state == State::kLatency || p.state == State::kTransfer)) {
      covered += Size(q);  // cancelled for the waiter
    }
  }
  for (const uint32_t q : resident) {
    if (covered >= Size(waiter)) break;
    AddToDrain(q);
    covered += Size(q);
  }
  drain_.covered = covered;
  room_changed_ = true;
}

void Node::AddToDrain(uint32_t m) {
  ModelState& s = models_[m];
  s.draining = true;
  drain_.set.push_back(m);
  drain_.set_bytes += Size(m);
  if (!s.drain_pinned) {
    s.drain_pinned = true;
    cache_->Pin(trace_.models[m]);
  }
}

void Node::EndDrain() {
  assert(drain_.active);
  recent_drain_ms_ =
      NextRecentDrainMs(recent_drain_ms_, now_ - drain_.started_ms);
  std::vector<std::pair<uint32_t, Waiter>> parked;
  for (const uint32_t q : drain_.set) {
    ModelState& d = models_[q];
    d.draining = false;
    if (d.drain_pinned) {
      d.drain_pinned = false;
      if (d.state == State::kResident) cache_->Unpin(trace_.models[q]);
    }
    for (Waiter& w : d.parked) parked.emplace_back(q, std::move(w));
    d.parked.clear();
  }
  drain_ = Drain{};
  room_changed_ = true;
  // In arrival order, with their arrival times: a hit on what stayed, a
  // wait for the load of what went.
  std::sort(parked.begin(), parked.end(), [](const auto& a, const auto& b) {
    return a.second.arrival != b.second.arrival
               ? a.second.arrival < b.second.arrival
               : a.second.request.id < b.second.request.id;
  });
  for (const auto& [m, w] : parked) {
    if (models_[m].state == State::kResident) {
      books_.Hit(m);
      books_.Waited(now_ - w.arrival);
      TakeLease(m, w.request, w.arrival, /*hit=*/true);
    } else {
      books_.ColdStart(m);
      WaitForLoad(m, w);
    }
  }
}

// ---- histogram policies ----

double Node::ExpectedLoadMs(uint32_t m) const {
  if (!std::isfinite(time_.bandwidth_bytes_per_second)) return time_.latency_ms;
  // Its own transfer at the share it would get now, behind the queue.
  double queued = 0;
  for (uint32_t q : demand_queue_) queued += static_cast<double>(Size(q));
  const double share =
      time_.bandwidth_bytes_per_second / 1000.0 /
      static_cast<double>(1 + link_.moving(LoadLink::Class::kForeground));
  return time_.latency_ms + (static_cast<double>(Size(m)) + queued) / share;
}

// The policy plans when a request ends (keep_alive.h, the same code a
// ModelCache runs); the simulation carries the plan out in trace time.
void Node::PlanKeepAlive(uint32_t m) {
  ModelState& s = models_[m];
  const KeepAlivePlan plan =
      spec_.keep_alive->Plan(s.idle, now_, ExpectedLoadMs(m));
  if (plan.unload_now) {
    // Unload now and load again just before the next request is due.
    cache_->Remove(trace_.models[m]);
    Schedule(plan.prewarm_at, EventKind::kPrewarm, m, s.generation);
  }
  s.keep_until = plan.keep_until;
  if (s.keep_until < s.keep_alive_event) {
    s.keep_alive_event = s.keep_until;
    Schedule(s.keep_until, EventKind::kKeepAliveEnd, m, 0);
  }
}

void Node::SchedulePrewarm(double t, uint32_t model) {
  Schedule(t, EventKind::kPrewarm, model, ~uint64_t{0});
}

std::vector<size_t> Node::Kill() {
  assert(alive_);
  std::vector<size_t> requests;
  for (uint32_t m = 0; m < models_.size(); ++m) {
    ModelState& s = models_[m];
    for (const Waiter& w : s.waiters) requests.push_back(w.request.id);
    for (const Waiter& w : s.parked) requests.push_back(w.request.id);
    // A demand load's bytes are a bare reservation: back to the budget.
    if (!s.prewarm_class &&
        (s.state == State::kLatency || s.state == State::kTransfer)) {
      cache_->budget().Release(Size(m));
    }
  }
  // Every live hold has a pending hold-end event.
  while (!events_.empty()) {
    const Event& e = events_.top();
    if (e.type == EventKind::kHoldEnd) {
      requests.push_back(hold_request_[e.arg]);
    }
    events_.pop();
  }
  std::sort(requests.begin(), requests.end());
  killing_ = true;
  holds_.Clear();
  for (auto& m : models_) m.load_lease.Release();
  const CacheStats stats = cache_->Stats();
  past_lives_.bytes_loaded += stats.bytes_loaded;
  past_lives_.evictions += stats.evictions;
  past_lives_.high_water_bytes =
      std::max(past_lives_.high_water_bytes, stats.high_water_bytes);
  cache_.reset();
  killing_ = false;
  const size_t models = models_.size();
  models_.clear();
  models_.resize(models);
  demand_queue_.clear();
  prewarm_queue_.clear();
  demand_in_flight_ = prewarm_in_flight_ = 0;
  link_.Clear();
  room_changed_ = true;
  idle_bytes_ = 0;
  drain_ = Drain{};
  recent_drain_ms_ = 0;
  next_drain_check_ = kInf;
  alive_ = false;
  return requests;
}

void Node::Restart() {
  assert(!alive_);
  NewCache();
  alive_ = true;
}

RunResult Node::Finish() && {
  CacheStats stats = cache_ ? cache_->Stats() : CacheStats{};
  stats.bytes_loaded += past_lives_.bytes_loaded;
  stats.evictions += past_lives_.evictions;
  stats.high_water_bytes =
      std::max(stats.high_water_bytes, past_lives_.high_water_bytes);
  RunResult result = std::move(books_).Finish(stats, options_.time, timed_);
  result.drains = drains_;
  result.drain_queued = drain_queued_;
  // Requests still waiting when no event is left would wait for ever: none
  // should, but if one does it is counted (blocked), never dropped.
  uint64_t stranded = 0;
  for (const ModelState& s : models_) {
    stranded += s.waiters.size() + s.parked.size();
  }
  result.requests += stranded;
  result.blocked += stranded;
  result.misses += stranded;
  return result;
}

// ---- Engine: one node, fed the trace ----

Engine::Engine(const TraceSource& source, const NamedPolicy& policy,
               uint64_t capacity, const SimulateOptions& options, bool timed)
    : source_(source),
      trace_(source.header()),
      options_(options),
      node_(trace_, policy, capacity, options, timed,
            static_cast<double>(trace_.t_first_ms),
            static_cast<double>(trace_.t_last_ms)) {
  if (!policy.eviction->monotone()) {
    next_use_.emplace(source, policy.eviction->name(),
                      options.max_next_use_index_bytes);
  }
}

RunResult Engine::Run() && {
  node_.AdvanceTo(static_cast<double>(trace_.t_first_ms));
  for (const Request& p : options_.prewarms) {
    node_.SchedulePrewarm(static_cast<double>(p.t_ms), p.model);
  }
  std::unique_ptr<RequestReader> reader = source_.Read();
  std::vector<Request> chunk(kReadChunk);
  std::vector<float> hold(kReadChunk, 0.0f);
  uint64_t i = 0;
  for (size_t got;
       (got = reader->Read(chunk.data(), hold.data(), kReadChunk)) > 0;) {
    for (size_t k = 0; k < got; ++k, ++i) {
      const double t = static_cast<double>(chunk[k].t_ms);
      while (node_.NextTime() <= t) node_.Step();
      node_.AdvanceTo(t);
      NodeRequest request;
      request.id = i;
      request.model = chunk[k].model;
      request.hold_ms = trace_.service_times ? static_cast<double>(hold[k])
                                             : options_.hold_ms;
      request.hint = next_use_ ? next_use_->At(i) : 0.0;
      request.wait_from = t;
      node_.Arrive(request);
      node_.StartLoads();
    }
    if (options_.requests_done) {
      options_.requests_done->fetch_add(got, std::memory_order_relaxed);
    }
  }
  if (i > 0) {
    while (node_.NextTime() != Node::kInf) node_.Step();
  }
  return std::move(node_).Finish();
}

}  // namespace modelcache::replay
