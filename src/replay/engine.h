// The engine of the replay in trace time: a discrete-event simulation of the
// load path around the real cache, for one node.
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
// Books (books.h): the engine reports each request's outcome, and before each
// step of time the state it held (idle bytes, loads in flight, the queue,
// resident bytes), which the books integrate over the trace's span. The
// cache's on_event tells the engine of every eviction, expiry and removal.
//
// Keep-alive (keep_alive.h): the policy plans, the engine carries the plan
// out in trace time, with the events above. The same planner runs in a
// ModelCache on a real clock.
#ifndef MODELCACHE_SRC_REPLAY_ENGINE_H_
#define MODELCACHE_SRC_REPLAY_ENGINE_H_

#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "books.h"
#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"
#include "replay_internal.h"

namespace modelcache::replay {

class Engine {
 public:
  // One node: a cache of `capacity` bytes run by `policy` over the trace
  // `source` gives, read a chunk at a time (an offline policy's next-use
  // index reads it once before). REQUIRES: every argument outlives the
  // engine. `timed`: false runs an infinitely fast load path (loads take no
  // time).
  Engine(const TraceSource& source, const NamedPolicy& policy,
         uint64_t capacity, const SimulateOptions& options, bool timed);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Runs the whole trace, once; then its books with the cache's counters.
  RunResult Run() &&;

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();

  enum class State : uint8_t {
    kAbsent,
    kQueued,
    kLatency,
    kTransfer,
    kResident
  };
  enum class EventKind : uint8_t {
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
    EventKind type;
    uint32_t model;
    uint64_t arg;  // hold slot, generation or waiter id
    bool operator>(const Event& o) const {
      return t != o.t ? t > o.t : seq > o.seq;
    }
  };

  struct Waiter {
    uint64_t request;  // its position in the trace
    float hold_ms;     // its service time, when the trace gives them
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
    uint64_t last_request = 0;
    IdleHistory idle;  // for a keep-alive policy
    // One live keep-alive event, at keep_alive_event: when it fires before
    // keep_until (a later request moved it on), it files itself again; a plan
    // with an earlier end files a new one and leaves the old one stale.
    double keep_until = kInf;
    double keep_alive_event = kInf;
  };

  static Clock::time_point ClockAt(double t_ms) {
    return Clock::time_point(std::chrono::nanoseconds(
        static_cast<int64_t>(std::llround(t_ms * 1e6))));
  }

  double Hint(uint64_t request) const {
    return next_use_ ? next_use_->At(request) : 0.0;
  }
  double HoldMs(float trace_hold_ms) const {
    return trace_.service_times ? static_cast<double>(trace_hold_ms)
                                : options_.hold_ms;
  }
  uint64_t Size(uint32_t m) const { return trace_.sizes[m]; }

  void Schedule(double t, EventKind type, uint32_t model, uint64_t arg) {
    events_.push(Event{t, seq_++, type, model, arg});
  }

  // ---- time ----
  void AdvanceTo(double t);
  void RunUntil(double t);
  double NextTransferEnd() const;
  void FinishTransfers();
  void HandleEvent(const Event& e);

  // ---- requests and leases ----
  // Request `i` of the trace, `r`, with its service time (when the trace
  // gives them).
  void Arrive(uint64_t i, const Request& r, float hold_ms);
  // A hit, or a waiter whose load ended: its lease for its service time.
  void TakeLease(uint32_t m, uint64_t request, float hold_ms, double arrival);
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

  const TraceSource& source_;
  const TraceHeader& trace_;
  const NamedPolicy& spec_;
  // The idle TTL in ms (0: none), and whether prewarms may evict idle models
  // ranked below them.
  const double ttl_ms_;
  const bool prewarm_evicts_lower_ranked_;
  const SimulateOptions& options_;
  const bool timed_;
  const TimeModel time_;
  const uint64_t capacity_;
  std::vector<ModelState> models_;
  std::unordered_map<std::string, uint32_t> index_;
  std::optional<ModelCache> cache_;
  std::optional<NextUseIndex> next_use_;  // an offline policy's

  double now_ = 0;
  // The trace's span; the books integrate over it.
  const double t_first_, t_last_;
  Books books_;
  uint64_t seq_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  LeasePool holds_;

  std::deque<uint32_t> demand_queue_;
  std::deque<uint32_t> prewarm_queue_;
  uint32_t demand_in_flight_ = 0, prewarm_in_flight_ = 0;
  std::vector<uint32_t> demand_transfers_, prewarm_transfers_;
  bool room_changed_ = true;  // worth retrying a head blocked on room
  uint64_t next_waiter_id_ = 0;
  uint64_t idle_bytes_ = 0;  // resident, no lease, not loading
};

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_ENGINE_H_
