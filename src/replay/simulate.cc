// Replay in trace time: a discrete-event simulation of the load path around
// the real cache.
//
// Design note.
//
// One thread drives a ModelCache (one shard, so the eviction order is exact)
// whose clock (CacheOptions::now) is the simulation's clock. The cache owns
// residency, the budget and the eviction order; the simulation owns time:
// when a load may start, how long it takes, how long each request waits.
//
// Model states (the simulation's view; the cache's in brackets):
//   absent   [no record]            nothing resident, no load queued
//   queued   [no record]            a demand load waits in the FIFO queue for
//                                   a slot, or at its head for room
//   latency  [no record; bytes      started: a demand load reserved its
//             reserved]             bytes in the budget (Budget::Reserve, as
//                                   the cache's miss does); a prewarm's
//            [resident, 1 lease]    Prefetch-like Acquire holds a load lease
//                                   that keeps it from eviction meanwhile
//   transfer [as in latency]        moving bytes at its share of the bandwidth
//   resident [resident]             loaded; idle when no request holds it
//
// Events, in time order (ties: first scheduled first), all before an arrival
// at the same time:
//   hold end       a request's lease ends (its service time is over)
//   latency end    a load starts moving bytes
//   transfer end   computed, not queued: demand transfers share the bandwidth
//                  equally (processor sharing), prewarm transfers share it
//                  only while no demand transfer runs; the earliest to finish
//                  ends next
//   ttl check      for ttl-* policies, EvictExpired at the first instant a
//                  model has been idle longer than the TTL
//   keep-alive end for histogram policies, Remove of a model still idle
//   prewarm        for histogram policies, a load in the prewarm class
//   deadline       with --max-wait, a request still waiting leaves
//
// Arrivals: a resident model is a hit (wait 0). Otherwise the request waits
// for the model's load, joining one queued or in flight (single flight), or
// queueing a new one. When the load ends every waiter takes its lease and
// holds it for its service time: the first waiter's Acquire is the cache's
// miss, which makes the record resident in the bytes the load reserved, and
// the others' are hits. So a load's first use is its end, whoever joined it,
// and the cache counts one access per request. Each Acquire passes its
// request's arrival (AcquireOptions::arrival), so a policy that learns from
// request times (next-use) sees arrivals, not load ends.
//
// Slots and classes: demand loads start in FIFO order while fewer than
// `slots` demand loads are in flight and the head fits (a reservation with
// WhenFull::kFail, which evicts nothing unless evicting makes the room; on
// kCapacity, in-flight prewarms are cancelled first, then the head waits
// until a lease ends, and the idle models it could not use stay). Prewarm loads
// start only when no demand load is queued, only into free bytes
// (next-use-prewarm: or in place of idle models the policy expects later,
// AcquireOptions:: evict_only_lower_ranked), and only on slots demand loads
// leave unused; a demand request for a model being prewarmed promotes that
// load. So a prewarm never delays a demand load. A prewarm's Acquire is not a
// request (AcquireOptions::request): next-use learns only from requests.
//
// Books: idle bytes (resident, no lease, not loading) and loads in flight are
// integrated over the trace's span, [first request, last request]: a trace is
// a window of continuing traffic, so what drains after its last request
// belongs to the next window. The cache's on_event tells the simulation of
// every eviction, expiry and removal.
#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <queue>
#include <unordered_map>

#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"
#include "replay_internal.h"

namespace modelcache::replay {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kGiB = 1073741824.0;
// The cache's clock ticks in nanoseconds and expires what has been idle
// longer than the TTL: a TTL check runs one tick after the TTL.
constexpr double kNanosecondMs = 1e-6;

NamedPolicy ParsePolicy(const std::string& name, const TimeModel& time) {
  return PolicyByName(name, LoadCostModel{time.latency_ms / 1000,
                                          time.bandwidth_bytes_per_second});
}

enum class State : uint8_t { kAbsent, kQueued, kLatency, kTransfer, kResident };
enum class EventType : uint8_t {
  kHoldEnd,
  kLatencyEnd,
  kTtlCheck,
  kKeepAliveEnd,
  kPrewarm,
  kDeadline,
};

struct Event {
  double t;
  uint64_t seq;
  EventType type;
  uint32_t model;
  uint64_t arg;  // hold slot, generation or waiter id
  bool operator>(const Event& o) const {
    return t != o.t ? t > o.t : seq > o.seq;
  }
};

struct Waiter {
  size_t request;
  double arrival;
  uint64_t id;  // for deadlines
};

struct ModelState {
  State state = State::kAbsent;
  bool prewarm_class = false;
  uint64_t load_id = 0;  // stale latency-end events
  int leases = 0;        // load lease + request leases the simulation holds
  double remaining = 0;  // bytes left to transfer
  double load_start = 0;
  Lease load_lease;
  std::vector<Waiter> waiters;
  uint64_t generation = 0;  // stale prewarm events
  bool ttl_check_pending = false;
  double idle_since = -kInf;  // when its last lease ended
  double last_end = -kInf;    // ditto, kept across unloads
  size_t last_request = 0;
  uint64_t requests = 0, cold_starts = 0;
  IdleHistory idle;  // for a keep-alive policy
  // One live keep-alive event, at keep_alive_event: when it fires before
  // keep_until (a later request moved it on), it files itself again; a plan
  // with an earlier end files a new one and leaves the old one stale.
  double keep_until = kInf;
  double keep_alive_event = kInf;
};

class Simulation {
 public:
  Simulation(const Trace& trace, const NamedPolicy& spec, uint64_t capacity,
             const ReplayOptions& options, RunResult* result)
      : trace_(trace),
        spec_(spec),
        ttl_ms_(static_cast<double>(spec.idle_ttl.count()) / 1e6),
        prewarm_evicts_lower_ranked_(
            spec.keep_alive && spec.keep_alive->prewarm_evicts_lower_ranked()),
        options_(options),
        time_(options.timed ? options.time : TimeModel{kInf, 0, /*slots=*/0}),
        capacity_(capacity),
        result_(*result),
        models_(trace.models.size()) {
    for (uint32_t m = 0; m < trace.models.size(); ++m)
      index_.emplace(trace.models[m], m);
    CacheOptions cache_options;
    cache_options.name = "replay";
    cache_options.capacity_bytes = capacity;
    cache_options.policy = spec.eviction;
    cache_options.shard_bits = 0;
    cache_options.now = [this] { return ClockAt(now_); };
    cache_options.idle_ttl = spec.idle_ttl;
    cache_options.on_event = [this](const CacheEvent& e) { OnEvent(e); };
    cache_.emplace(std::move(cache_options));
    belady_ = !spec.eviction->monotone();
    if (belady_) {
      const size_t n = trace.requests.size();
      next_use_.assign(n, kInf);
      std::vector<double> seen(trace.models.size(), kInf);
      for (size_t i = n; i-- > 0;) {
        next_use_[i] = seen[trace.requests[i].model];
        seen[trace.requests[i].model] = static_cast<double>(i);
      }
    }
  }

  ~Simulation() {
    // Leases before the cache.
    holds_.Clear();
    for (auto& m : models_) m.load_lease.Release();
  }

  void Run();

  // Everything below is the simulation's own; Replay reads the books.
  static Clock::time_point ClockAt(double t_ms) {
    return Clock::time_point(std::chrono::nanoseconds(
        static_cast<int64_t>(std::llround(t_ms * 1e6))));
  }

  double Hint(size_t request) const {
    return belady_ ? next_use_[request] : 0.0;
  }
  double HoldMs(size_t request) const {
    return trace_.hold_ms.empty()
               ? options_.hold_ms
               : static_cast<double>(trace_.hold_ms[request]);
  }
  uint64_t Size(uint32_t m) const { return trace_.sizes[m]; }

  void Schedule(double t, EventType type, uint32_t model, uint64_t arg) {
    events_.push(Event{t, seq_++, type, model, arg});
  }

  // ---- time ----
  void AdvanceTo(double t);
  void RunUntil(double t);
  double NextTransferEnd() const;
  void FinishTransfers();
  void HandleEvent(const Event& e);

  // ---- requests and leases ----
  void Arrive(size_t i);
  // A hit, or a waiter whose load ended: its lease for its service time.
  void TakeLease(uint32_t m, size_t request, double arrival);
  void AddLease(uint32_t m);
  void DropLease(uint32_t m, bool request_ended);
  void BecameIdle(uint32_t m, bool request_ended);
  void Gone(uint32_t m);
  void OnEvent(const CacheEvent& e);

  // ---- loads ----
  void Enqueue(uint32_t m);
  void StartLoads();
  // Counts the queue's length once the loads that could start have started:
  // a load that starts at once never waited in the queue.
  void NoteQueue();
  bool StartLoad(uint32_t m, bool prewarm);
  void EnterTransfer(uint32_t m);
  void CompleteLoad(uint32_t m);
  bool CancelOnePrewarm();
  void Prewarm(uint32_t m);

  // ---- histogram policies ----
  void PlanKeepAlive(uint32_t m);
  double ExpectedLoadMs(uint32_t m) const;

  const Trace& trace_;
  const NamedPolicy& spec_;
  // The idle TTL in ms (0: none), and whether prewarms may evict idle models
  // ranked below them.
  const double ttl_ms_;
  const bool prewarm_evicts_lower_ranked_;
  const ReplayOptions& options_;
  const TimeModel time_;
  const uint64_t capacity_;
  RunResult& result_;
  std::vector<ModelState> models_;
  std::unordered_map<std::string, uint32_t> index_;
  std::optional<ModelCache> cache_;
  bool belady_ = false;
  std::vector<double> next_use_;

  double now_ = 0;
  double t_first_ = 0, t_last_ = 0;
  uint64_t seq_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  LeasePool holds_;

  std::deque<uint32_t> demand_queue_;
  std::deque<uint32_t> prewarm_queue_;
  uint32_t demand_in_flight_ = 0, prewarm_in_flight_ = 0;
  std::vector<uint32_t> demand_transfers_, prewarm_transfers_;
  bool room_changed_ = true;  // worth retrying a head blocked on room
  uint64_t next_waiter_id_ = 0;
  uint64_t missed_bytes_ = 0;

  // Integrals over [t_first_, t_last_].
  uint64_t idle_bytes_ = 0;
  double idle_byte_ms_ = 0, busy_ms_ = 0, queue_ms_ = 0;
  std::vector<double> waits_;
  // Bins of trace time.
  size_t bin_ = 0;
  double bin_width_ = 0;
  double bin_min_ = kInf, bin_max_ = 0, bin_area_ = 0;
  uint32_t bin_queue_max_ = 0;
};

// ---- time ----

void Simulation::AdvanceTo(double t) {
  if (t <= now_) return;
  // Integrate the piecewise-constant books over [now_, t] within the trace.
  const double from = std::max(now_, t_first_), to = std::min(t, t_last_);
  if (to > from) {
    const double dt = to - from;
    idle_byte_ms_ += static_cast<double>(idle_bytes_) * dt;
    if (demand_in_flight_ + prewarm_in_flight_ > 0) busy_ms_ += dt;
    queue_ms_ += static_cast<double>(demand_queue_.size()) * dt;
    const double resident = static_cast<double>(cache_->budget().used());
    double at = from;
    while (at < to && bin_ < result_.bins.size()) {
      const double bin_end =
          t_first_ + bin_width_ * static_cast<double>(bin_ + 1);
      const double step = std::min(to, bin_end) - at;
      bin_area_ += resident * step;
      bin_min_ = std::min(bin_min_, resident);
      bin_max_ = std::max(bin_max_, resident);
      at += step;
      if (at >= bin_end) {
        auto& b = result_.bins[bin_];
        b.t_ms = static_cast<int64_t>(bin_end);
        b.min_bytes = bin_min_;
        b.max_bytes = bin_max_;
        b.mean_bytes = bin_area_ / bin_width_;
        b.queue = std::max(bin_queue_max_,
                           static_cast<uint32_t>(demand_queue_.size()));
        bin_queue_max_ = static_cast<uint32_t>(demand_queue_.size());
        ++bin_;
        bin_min_ = kInf, bin_max_ = 0, bin_area_ = 0;
      }
    }
  }
  // Transfers progress at their share of the bandwidth.
  const auto& served =
      demand_transfers_.empty() ? prewarm_transfers_ : demand_transfers_;
  if (!served.empty() && std::isfinite(time_.bandwidth_bytes_per_second)) {
    const double moved = (t - now_) * time_.bandwidth_bytes_per_second /
                         1000.0 / static_cast<double>(served.size());
    for (uint32_t m : served) models_[m].remaining -= moved;
  }
  now_ = t;
}

double Simulation::NextTransferEnd() const {
  const auto& served =
      demand_transfers_.empty() ? prewarm_transfers_ : demand_transfers_;
  if (served.empty()) return kInf;
  double least = kInf;
  for (uint32_t m : served) least = std::min(least, models_[m].remaining);
  if (least <= 0.5) return now_;
  return now_ + least * static_cast<double>(served.size()) * 1000.0 /
                    time_.bandwidth_bytes_per_second;
}

void Simulation::FinishTransfers() {
  auto& served =
      demand_transfers_.empty() ? prewarm_transfers_ : demand_transfers_;
  // Less than half a byte left is rounding: done.
  std::vector<uint32_t> done;
  for (size_t k = 0; k < served.size();) {
    if (models_[served[k]].remaining <= 0.5) {
      done.push_back(served[k]);
      served[k] = served.back();
      served.pop_back();
    } else {
      ++k;
    }
  }
  std::sort(done.begin(), done.end());
  for (uint32_t m : done) CompleteLoad(m);
}

void Simulation::RunUntil(double t) {
  for (;;) {
    const double next_event = events_.empty() ? kInf : events_.top().t;
    const double next_transfer = NextTransferEnd();
    const double next = std::min(next_event, next_transfer);
    if (next > t || next == kInf) {
      if (std::isfinite(t)) AdvanceTo(t);
      return;
    }
    AdvanceTo(next);
    if (next_transfer <= next_event) {
      FinishTransfers();
    } else {
      const Event e = events_.top();
      events_.pop();
      HandleEvent(e);
    }
    StartLoads();
    NoteQueue();
  }
}

void Simulation::HandleEvent(const Event& e) {
  ModelState& s = models_[e.model];
  // After the trace, only what finishes its requests matters.
  const bool after_trace = now_ > t_last_;
  switch (e.type) {
    case EventType::kHoldEnd:
      holds_.Release(e.arg);
      DropLease(e.model, /*request_ended=*/true);
      break;
    case EventType::kLatencyEnd:
      if (e.arg == s.load_id) EnterTransfer(e.model);
      break;
    case EventType::kTtlCheck:
      s.ttl_check_pending = false;
      if (after_trace || s.state != State::kResident || s.leases > 0) break;
      if (now_ > s.idle_since + ttl_ms_) {
        cache_->EvictExpired();
      } else {
        s.ttl_check_pending = true;
        Schedule(s.idle_since + ttl_ms_ + kNanosecondMs, EventType::kTtlCheck,
                 e.model, 0);
      }
      break;
    case EventType::kKeepAliveEnd:
      if (e.t != s.keep_alive_event) break;  // superseded
      s.keep_alive_event = kInf;
      if (after_trace) break;
      if (now_ < s.keep_until) {
        s.keep_alive_event = s.keep_until;
        Schedule(s.keep_until, EventType::kKeepAliveEnd, e.model, 0);
      } else if (s.state == State::kResident && s.leases == 0) {
        cache_->Remove(trace_.models[e.model]);
      }
      break;
    case EventType::kPrewarm:
      if (after_trace) break;
      if (e.arg != s.generation && e.arg != ~uint64_t{0}) break;
      Prewarm(e.model);
      break;
    case EventType::kDeadline: {
      auto it = std::find_if(s.waiters.begin(), s.waiters.end(),
                             [&](const Waiter& w) { return w.id == e.arg; });
      if (it == s.waiters.end()) break;
      s.waiters.erase(it);
      ++result_.rejected;
      if (s.state == State::kQueued && s.waiters.empty()) {
        // Nobody wants it any more: it never loads.
        demand_queue_.erase(
            std::find(demand_queue_.begin(), demand_queue_.end(), e.model));
        s.state = State::kAbsent;
        room_changed_ = true;
      }
      break;
    }
  }
}

// ---- requests and leases ----

void Simulation::AddLease(uint32_t m) {
  ModelState& s = models_[m];
  if (s.leases++ == 0 && s.state == State::kResident) idle_bytes_ -= Size(m);
  ++s.generation;  // cancels a planned prewarm
}

void Simulation::DropLease(uint32_t m, bool request_ended) {
  ModelState& s = models_[m];
  assert(s.leases > 0);
  if (--s.leases == 0 && s.state == State::kResident) {
    BecameIdle(m, request_ended);
  }
}

void Simulation::BecameIdle(uint32_t m, bool request_ended) {
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
    Schedule(now_ + ttl_ms_ + kNanosecondMs, EventType::kTtlCheck, m, 0);
  }
  if (spec_.keep_alive) PlanKeepAlive(m);
}

// The model left the cache (evicted, expired or removed).
void Simulation::Gone(uint32_t m) {
  ModelState& s = models_[m];
  if (s.state != State::kResident) return;
  assert(s.leases == 0);
  idle_bytes_ -= Size(m);
  s.state = State::kAbsent;
  room_changed_ = true;
}

void Simulation::OnEvent(const CacheEvent& e) {
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
void Simulation::TakeLease(uint32_t m, size_t request, double arrival) {
  const Loader loader = [&]() -> Loaded {
    return Loaded{nullptr, Size(m), {}};
  };
  AcquireOptions acquire;
  acquire.policy_hint = Hint(request);
  acquire.arrival = ClockAt(arrival);
  Lease lease = cache_->Acquire(trace_.models[m], Size(m), loader, acquire);
  const double hold = HoldMs(request);
  AddLease(m);
  if (hold <= 0) {  // taken and given back at once
    lease.Release();
    DropLease(m, /*request_ended=*/true);
    return;
  }
  Schedule(now_ + hold, EventType::kHoldEnd, m, holds_.Hold(std::move(lease)));
}

void Simulation::Arrive(size_t i) {
  const Request& r = trace_.requests[i];
  const uint32_t m = r.model;
  ModelState& s = models_[m];
  ++s.requests;
  s.last_request = i;
  if (Size(m) > capacity_) {
    ++result_.misses;
    ++result_.too_large;
    missed_bytes_ += Size(m);
    return;
  }
  const bool loading =
      s.state == State::kLatency || s.state == State::kTransfer;
  if (spec_.keep_alive && s.waiters.empty() && s.leases == (loading ? 1 : 0) &&
      std::isfinite(s.last_end)) {
    s.idle.Record(now_ - s.last_end);
  }
  if (s.state == State::kResident) {
    ++result_.hits;
    waits_.push_back(0);
    TakeLease(m, i, now_);
    return;
  }
  ++result_.misses;
  missed_bytes_ += Size(m);
  ++result_.cold_starts;
  ++s.cold_starts;
  const uint64_t id = next_waiter_id_++;
  s.waiters.push_back(Waiter{i, now_, id});
  ++s.generation;  // no planned prewarm applies now
  if (std::isfinite(options_.max_wait_ms)) {
    Schedule(now_ + options_.max_wait_ms, EventType::kDeadline, m, id);
  }
  switch (s.state) {
    case State::kAbsent:
      Enqueue(m);
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
        if (s.state == State::kTransfer) {
          prewarm_transfers_.erase(std::find(prewarm_transfers_.begin(),
                                             prewarm_transfers_.end(), m));
          demand_transfers_.push_back(m);
        }
      }
      break;
    case State::kResident:
      break;
  }
}

// ---- loads ----

void Simulation::Enqueue(uint32_t m) {
  models_[m].state = State::kQueued;
  demand_queue_.push_back(m);
}

void Simulation::NoteQueue() {
  const uint32_t queued = static_cast<uint32_t>(demand_queue_.size());
  bin_queue_max_ = std::max(bin_queue_max_, queued);
  result_.load_queue_peak = std::max<uint64_t>(result_.load_queue_peak, queued);
}

bool Simulation::CancelOnePrewarm() {
  for (uint32_t m = 0; m < models_.size(); ++m) {
    ModelState& s = models_[m];
    if (!s.prewarm_class ||
        (s.state != State::kLatency && s.state != State::kTransfer)) {
      continue;
    }
    if (s.state == State::kTransfer) {
      prewarm_transfers_.erase(
          std::find(prewarm_transfers_.begin(), prewarm_transfers_.end(), m));
    }
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

bool Simulation::StartLoad(uint32_t m, bool prewarm) {
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
        acquire.policy_hint = Hint(s.last_request);
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
  s.remaining = static_cast<double>(Size(m));
  (prewarm ? prewarm_in_flight_ : demand_in_flight_)++;
  ++result_.loads_per_model[m];
  if (time_.latency_ms > 0) {
    Schedule(now_ + time_.latency_ms, EventType::kLatencyEnd, m, s.load_id);
  } else {
    EnterTransfer(m);
  }
  return true;
}

void Simulation::EnterTransfer(uint32_t m) {
  ModelState& s = models_[m];
  if (s.state != State::kLatency) return;  // cancelled meanwhile
  s.state = State::kTransfer;
  if (!std::isfinite(time_.bandwidth_bytes_per_second) || s.remaining <= 0.5) {
    CompleteLoad(m);
    return;
  }
  (s.prewarm_class ? prewarm_transfers_ : demand_transfers_).push_back(m);
}

void Simulation::CompleteLoad(uint32_t m) {
  ModelState& s = models_[m];
  (s.prewarm_class ? prewarm_in_flight_ : demand_in_flight_)--;
  if (s.prewarm_class) ++result_.prewarms;
  s.prewarm_class = false;
  s.state = State::kResident;
  result_.load_seconds += (now_ - s.load_start) / 1000.0;
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
    waits_.push_back(now_ - w.arrival);
    TakeLease(m, w.request, w.arrival);
  }
  load_lease.Release();
  DropLease(m, /*request_ended=*/!waiters.empty());
}

void Simulation::StartLoads() {
  const uint32_t slots =
      time_.slots == 0 ? std::numeric_limits<uint32_t>::max() : time_.slots;
  while (!demand_queue_.empty() && demand_in_flight_ < slots) {
    const uint32_t m = demand_queue_.front();
    if (!room_changed_) return;
    if (!StartLoad(m, /*prewarm=*/false)) {
      room_changed_ = false;  // wait until something becomes evictable
      return;
    }
    demand_queue_.pop_front();
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

void Simulation::Prewarm(uint32_t m) {
  if (models_[m].state != State::kAbsent || Size(m) > capacity_) return;
  prewarm_queue_.push_back(m);
}

// ---- histogram policies ----

double Simulation::ExpectedLoadMs(uint32_t m) const {
  if (!std::isfinite(time_.bandwidth_bytes_per_second)) return time_.latency_ms;
  // Its own transfer at the share it would get now, behind the queue.
  double queued = 0;
  for (uint32_t q : demand_queue_) queued += static_cast<double>(Size(q));
  const double share = time_.bandwidth_bytes_per_second / 1000.0 /
                       static_cast<double>(1 + demand_transfers_.size());
  return time_.latency_ms + (static_cast<double>(Size(m)) + queued) / share;
}

// The policy plans when a request ends (keep_alive.h, the same code a
// ModelCache runs); the simulation carries the plan out in trace time.
void Simulation::PlanKeepAlive(uint32_t m) {
  ModelState& s = models_[m];
  const KeepAlivePlan plan =
      spec_.keep_alive->Plan(s.idle, now_, ExpectedLoadMs(m));
  if (plan.unload_now) {
    // Unload now and load again just before the next request is due.
    cache_->Remove(trace_.models[m]);
    Schedule(plan.prewarm_at, EventType::kPrewarm, m, s.generation);
  }
  s.keep_until = plan.keep_until;
  if (s.keep_until < s.keep_alive_event) {
    s.keep_alive_event = s.keep_until;
    Schedule(s.keep_until, EventType::kKeepAliveEnd, m, 0);
  }
}

void Simulation::Run() {
  const auto& requests = trace_.requests;
  const size_t n = requests.size();
  if (n == 0) return;
  t_first_ = static_cast<double>(requests.front().t_ms);
  t_last_ = static_cast<double>(requests.back().t_ms);
  now_ = t_first_;
  constexpr size_t kBins = 240;
  if (t_last_ > t_first_) {
    result_.bins.resize(kBins);
    bin_width_ = (t_last_ - t_first_) / kBins;
  }
  for (const Request& p : options_.prewarms) {
    Schedule(static_cast<double>(p.t_ms), EventType::kPrewarm, p.model,
             ~uint64_t{0});
  }
  waits_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    RunUntil(static_cast<double>(requests[i].t_ms));
    Arrive(i);
    StartLoads();
    NoteQueue();
  }
  RunUntil(kInf);
  result_.bins.resize(bin_);
}

}  // namespace

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p * static_cast<double>(sorted.size()));
  const size_t index = static_cast<size_t>(std::clamp(
                           rank, 1.0, static_cast<double>(sorted.size()))) -
                       1;
  return sorted[index];
}

RunResult Replay(const Trace& trace, const std::string& policy_name,
                 uint64_t capacity_bytes, const ReplayOptions& options) {
  const NamedPolicy spec = ParsePolicy(policy_name, options.time);
  const bool plain = spec.idle_ttl.count() == 0 && !spec.keep_alive;
  if (!options.timed && plain && options.prewarms.empty() &&
      trace.hold_ms.empty()) {
    return ReplayUntimed(trace, spec.eviction, capacity_bytes, options.hold_ms);
  }
  RunResult result;
  result.policy = policy_name;
  result.offline = !spec.eviction->monotone();
  result.capacity_bytes = capacity_bytes;
  result.requests = trace.requests.size();
  result.loads_per_model.assign(trace.models.size(), 0);
  result.timed = options.timed;
  const auto start = std::chrono::steady_clock::now();
  uint64_t requested_bytes = 0, missed_bytes = 0;
  std::vector<double> waits;
  std::vector<double> model_ratios;
  {
    Simulation sim(trace, spec, capacity_bytes, options, &result);
    sim.Run();
    // (The simulation's books are read through its friends below.)
    waits = std::move(sim.waits_);
    const double span = sim.t_last_ - sim.t_first_;
    result.idle_gib_hours = sim.idle_byte_ms_ / kGiB / 3600000.0;
    result.disk_busy_ratio = span > 0 ? sim.busy_ms_ / span : 0;
    result.load_queue_mean = span > 0 ? sim.queue_ms_ / span : 0;
    for (const ModelState& s : sim.models_) {
      if (s.requests > 0) {
        model_ratios.push_back(static_cast<double>(s.cold_starts) /
                               static_cast<double>(s.requests));
      }
    }
    const CacheStats stats = sim.cache_->Stats();
    result.evictions = stats.evictions;
    result.peak_resident_bytes = stats.high_water_bytes;
    result.bytes_loaded = stats.bytes_loaded;
    missed_bytes = sim.missed_bytes_;
    if (span > 0 && std::isfinite(options.time.bandwidth_bytes_per_second) &&
        options.timed) {
      const double link_ms = static_cast<double>(result.bytes_loaded) /
                             options.time.bandwidth_bytes_per_second * 1000.0;
      result.overloaded = link_ms >= 0.9 * span;
    }
    for (const auto& b : result.bins)
      result.resident_over_time.emplace_back(
          b.t_ms, static_cast<uint64_t>(b.mean_bytes));
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  for (const Request& r : trace.requests)
    requested_bytes += trace.sizes[r.model];
  std::sort(waits.begin(), waits.end());
  result.wait_ms = WaitSummary{
      Percentile(waits, 0.5), Percentile(waits, 0.95), Percentile(waits, 0.99),
      Percentile(waits, 0.999), waits.empty() ? 0 : waits.back()};
  if (!waits.empty()) {
    for (int q = 1; q <= 1000; ++q)
      result.wait_quantiles.push_back(Percentile(waits, q / 1000.0));
  }
  std::sort(model_ratios.begin(), model_ratios.end());
  result.p75_model_cold_start_ratio = Percentile(model_ratios, 0.75);
  const double n = static_cast<double>(result.requests);
  result.hit_ratio = n > 0 ? static_cast<double>(result.hits) / n : 0;
  result.cold_start_ratio =
      n > 0 ? static_cast<double>(result.cold_starts) / n : 0;
  result.byte_miss_ratio = requested_bytes
                               ? static_cast<double>(missed_bytes) /
                                     static_cast<double>(requested_bytes)
                               : 0;
  result.requests_per_second = result.seconds > 0 ? n / result.seconds : 0;
  return result;
}

}  // namespace modelcache::replay
