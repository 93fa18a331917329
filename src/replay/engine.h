// The engine of the replay in trace time: a discrete-event simulation of the
// load path around the real cache. A Node is one node (its cache, its load
// path, its queues, its events, its books); the Engine feeds one Node the
// trace's requests. The multi-node replay (cluster.cc) drives several Nodes
// from one event loop, with a router in front of them.
//
// Design note.
//
// One thread drives a node's ModelCache (one shard, so the eviction order is
// exact) whose clock (CacheOptions::now) is the simulation's clock. The cache
// owns residency, the budget and the eviction order; the simulation owns time:
// when a load may start, how long it takes, how long each request waits.
//
// Model states (the simulation's view; the cache's in brackets):
//   absent   [no record]            nothing resident, no load queued
//   queued   [no record]            a demand load waits in the queue for a
//                                   slot or for room
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
//   transfer end   computed, not queued (LoadLink, core/load_link.h): demand
//                  transfers share the bandwidth equally (processor
//                  sharing), prewarm transfers share it only while no
//                  demand transfer runs; the earliest to finish
//                  ends next, and loads that finish at the same instant
//                  complete in request order (the load whose earliest
//                  waiting request came first completes first; then those
//                  nobody waits for, by model)
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
// Slots and classes: demand loads queue in arrival order. A scan of the
// queue in that order starts each load that can get its room now (a
// reservation with WhenFull::kFail, which evicts nothing unless evicting
// makes the room; in-flight prewarms are cancelled first) while fewer than
// `slots` demand loads are in flight. A load that cannot get its room waits
// for it (until a lease ends) without holding back the loads behind it: the
// cache's miss has no queue either (Budget::Reserve), so a miss whose model
// fits loads at once, whatever waits for room. Prewarm loads
// start only when no demand load is queued, only into free bytes
// (next-use-prewarm: or in place of idle models the policy expects later,
// AcquireOptions:: evict_only_lower_ranked), and only on slots demand loads
// leave unused; a demand request for a model being prewarmed promotes that
// load. So a prewarm never delays a demand load. A prewarm's Acquire is not a
// request (AcquireOptions::request): next-use learns only from requests.
//
// The drain (SimulateOptions::drain_after_ms; the rule is the core
// Budget's, and this models it). Every wait for room has an arrival: the
// time its load was queued. States of the node:
//   no drain   hits overtake the waits for room (they are admitted at once)
//   draining   one drain, for the oldest wait for room, once it has waited
//              drain_after (a kDrainCheck event fires then, or a scan finds
//              it). Its set: resident models, least recently used first,
//              until with the free bytes they cover the waiter (topped up by
//              loads that complete while they do not). The set's models are
//              pinned in the cache (so that no other load evicts them) and
//              take no lease: a request for one is parked, in arrival order
//              (ModelState::parked). Other loads may use only the bytes the
//              waiter is not owed (UnowedObtainable).
// Transitions out of draining, both ending the drain (EndDrain): the waiter
// gets its room (as in the budget: the free bytes and the idle models
// outside its set cover it, and its load evicts those with its set still
// pinned; or they cover it with the set's idle members, typically when the
// set's last lease ends, and the set is unpinned and its load starts, its
// reservation evicting idle models: DrainWaiterRoom); or
// every request for the waiter left (--max-wait) with nothing evicted. Then
// the parked requests are admitted in arrival order with their arrival
// times: a hit on a model still resident, else a wait for its load, queued
// at its arrival (so it may be the oldest wait for room, and drain in its
// turn).
//
// Books (books.h): the engine reports each request's outcome, and before each
// step of time the state it held (idle bytes, loads in flight, the queue,
// resident bytes), which the books integrate over the trace's span. The
// cache's on_event tells the engine of every eviction, expiry and removal.
//
// Keep-alive (keep_alive.h): the policy plans, the engine carries the plan
// out in trace time, with the events above. The same planner runs in a
// ModelCache on a real clock.
//
// Many nodes (cluster.cc). A Node knows nothing of the trace's order: it is
// given NodeRequests (a model, a service time, a policy hint), and tells a
// NodeListener, when it has one, what became of each (served, left, too
// large) and of each load it started, so that a router can count requests in
// flight per node. Its step is the single-node loop's: advance to the next
// event or transfer end, handle it, start what loads can start. Kill() is
// the node's process dying: every request on it is handed back (to be
// retried elsewhere), the cache and the load path start again empty, and the
// books keep integrating (an empty node). The one-node replay is the special
// case with one Node, no listener and no router.
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
#include "modelcache/core/load_link.h"
#include "modelcache/replay/replay.h"
#include "replay_internal.h"

namespace modelcache::replay {

// One request as a node sees it; where it comes from is the feed's business.
struct NodeRequest {
  size_t id = 0;         // the feed's number for it (its index in the trace)
  uint32_t model = 0;    // index into TraceHeader::models
  double hold_ms = 0;    // its service time
  double hint = 0;       // AcquireOptions::policy_hint (Belady's next use)
  double wait_from = 0;  // when its wait began, for the listener (NodeWaits)
};

// What a node tells the router in front of it (the multi-node replay). Calls
// come from inside the node's own calls, at its current time; a listener
// must not call back into that node.
class NodeListener {
 public:
  enum class Outcome : uint8_t { kServed, kRejected, kTooLarge };
  virtual ~NodeListener() = default;
  // The request took its lease: a hit (at its arrival, or when the drain it
  // queued behind ended with its model resident) or a cold start (when its
  // load ended).
  virtual void Started(size_t id, bool hit, double now) = 0;
  // The request is over on this node: its lease ended (kServed), it left
  // after SimulateOptions::max_wait_ms (kRejected), or it was too large for
  // the capacity (kTooLarge, at its arrival).
  virtual void Ended(size_t id, Outcome outcome, double now) = 0;
  // A load of `model` started (a demand load or a prewarm).
  virtual void LoadStarted(uint32_t model, double now) = 0;
};

class Node {
 public:
  static constexpr double kInf = std::numeric_limits<double>::infinity();

  // A cache of `capacity` bytes run by `policy`, for the models of `trace`
  // (only their names and sizes are read). The books integrate over
  // [t_first, t_last] (their waits exact as SimulateOptions::max_exact_waits
  // says); after t_last the node only finishes its requests (no expiry,
  // keep-alive or prewarm). `timed`: false runs an infinitely fast load path
  // (loads take no time).
  // REQUIRES: every argument outlives the node.
  Node(const TraceHeader& trace, const NamedPolicy& policy, uint64_t capacity,
       const SimulateOptions& options, bool timed, double t_first,
       double t_last, NodeListener* listener = nullptr);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // The time of its next event or transfer end; infinity when it has none.
  double NextTime() const;
  // Handles that next event, then starts the loads that can start.
  // REQUIRES: NextTime() is finite.
  void Step();
  // Moves its clock to `t`, integrating the books. REQUIRES: NextTime() >= t.
  void AdvanceTo(double t);

  enum class Admission : uint8_t {
    kHit,       // resident: served at once
    kCold,      // waits for a load (started, joined or queued)
    kTooLarge,  // larger than the capacity: refused, and over
    kRefused,   // refuse_if_full: it would have to wait for room
  };
  // A request arrives now (call AdvanceTo first, then StartLoads once the
  // arrivals of this instant are in). With `refuse_if_full`, a request for a
  // model neither resident nor loading nor queued is refused, changing
  // nothing, when the node cannot make room for it without waiting for a
  // lease to end (a daemon answering 503 rather than waiting).
  Admission Arrive(const NodeRequest& request, bool refuse_if_full = false);
  // Starts the demand loads and prewarms that can start, and notes the
  // queue's length.
  void StartLoads();
  // A prewarm of `model` at trace time `t` (SimulateOptions::prewarms).
  void SchedulePrewarm(double t, uint32_t model);

  // Its process dies now: returns the ids of the requests on it (waiting or
  // served), in increasing order, without telling the listener; empties the
  // cache, the load path and every plan. The node stays down until
  // Restart(), which brings it back cold.
  std::vector<size_t> Kill();
  void Restart();
  bool alive() const { return alive_; }

  uint64_t capacity() const { return capacity_; }

  // Its books, with the cache's counters (over every life of the node).
  RunResult Finish() &&;

 private:
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
    kDrainCheck,
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
    NodeRequest request;
    double arrival;
    uint64_t id;  // for deadlines
  };

  struct ModelState {
    State state = State::kAbsent;
    bool prewarm_class = false;
    uint64_t load_id = 0;  // stale latency-end events
    int leases = 0;        // load lease + request leases the simulation holds
    double load_start = 0;
    // How long its latest load took (0: never loaded), kept across unloads:
    // what a cache passes as a wait's expected load (lifecycle.cc).
    double last_load_ms = 0;
    Lease load_lease;
    std::vector<Waiter> waiters;
    uint64_t generation = 0;  // stale prewarm events
    // When its demand load was queued: the arrival of the wait for room.
    double queued_at = 0;
    // The order of its latest lease taken (the drain set's ranking).
    uint64_t last_access = 0;
    // In the drain set: takes no lease, and is pinned in the cache while
    // resident so that no other load evicts it.
    bool draining = false;
    bool drain_pinned = false;
    // Requests that arrived while it drained, in arrival order.
    std::vector<Waiter> parked;
    bool ttl_check_pending = false;
    double idle_since = -kInf;  // when its last lease ended
    double last_end = -kInf;    // ditto, kept across unloads
    double last_hint = 0;       // its latest request's policy hint
    IdleHistory idle;           // for a keep-alive policy
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

  uint64_t Size(uint32_t m) const { return trace_.sizes[m]; }

  void Schedule(double t, EventKind type, uint32_t model, uint64_t arg) {
    events_.push(Event{t, seq_++, type, model, arg});
  }

  void NewCache();

  // ---- time ----
  // Completes the transfers that are done now; loads that end together
  // complete in the order of their earliest waiting request.
  void FinishTransfers();
  void HandleEvent(const Event& e);

  // ---- requests and leases ----
  // The bytes a demand load could get now without waiting for a lease to
  // end: free, idle (evictable) and held by prewarms in flight.
  uint64_t Obtainable() const;
  // Whether a load of `m` could get its room now without waiting for a
  // lease to end (or for a drain: only the bytes no one is owed).
  bool CouldAdmit(uint32_t m) const;
  // A hit, or a waiter whose load ended: its lease for its service time.
  void TakeLease(uint32_t m, const NodeRequest& request, double arrival,
                 bool hit);
  void AddLease(uint32_t m);
  void DropLease(uint32_t m, bool request_ended);
  void BecameIdle(uint32_t m, bool request_ended);
  void Gone(uint32_t m);
  void OnEvent(const CacheEvent& e);

  // ---- loads ----
  // Queues a demand load of `m` whose wait began at `at`, in arrival order.
  void Enqueue(uint32_t m, double at);
  void StartQueuedLoads();
  // Counts the queue's length once the loads that could start have started:
  // a load that starts at once never waited in the queue.
  void NoteQueue();
  bool StartLoad(uint32_t m, bool prewarm);
  void EnterTransfer(uint32_t m);
  void CompleteLoad(uint32_t m);
  bool CancelOnePrewarm();
  void Prewarm(uint32_t m);

  // ---- the drain (SimulateOptions::drain_after_ms) ----
  // How long `m`'s wait for room lets requests overtake it.
  double DrainAfterMs(uint32_t m) const;
  // Bytes of the drain set resident and idle (pinned, so not Obtainable()
  // to anyone but its waiter).
  uint64_t DrainIdleBytes() const;
  // Where the drain's waiter may find its room now: the free bytes and the
  // idle models outside its set cover it (its set stays pinned), or they do
  // with its set's idle members (the set is unpinned), or neither.
  enum class DrainRoom { kNone, kOutsideTheSet, kWithTheSet };
  DrainRoom DrainWaiterRoom() const;
  // Of the bytes free or evictable now, those another load than the
  // drain's waiter may use: all of them when no drain runs.
  uint64_t UnowedObtainable() const;
  // Starts the drain of the oldest wait for room once it has lasted
  // drain_after, or schedules a check for when it will have.
  void MaybeStartDrain();
  void StartDrain(uint32_t waiter);
  void AddToDrain(uint32_t m);
  // The drain's waiter loads or left: the set takes leases again and the
  // requests queued behind it are admitted in arrival order.
  void EndDrain();
  // A request that waits for `m`'s load (queued, started or joined).
  void WaitForLoad(uint32_t m, const Waiter& w);

  // ---- histogram policies ----
  void PlanKeepAlive(uint32_t m);
  double ExpectedLoadMs(uint32_t m) const;

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
  NodeListener* const listener_;
  std::vector<ModelState> models_;
  std::unordered_map<std::string, uint32_t> index_;
  std::optional<ModelCache> cache_;
  bool alive_ = true;
  bool killing_ = false;   // the cache's events during Kill() are not news
  CacheStats past_lives_;  // counters of the caches Kill() ended

  double now_ = 0;
  // The trace's span; the books integrate over it.
  const double t_first_, t_last_;
  Books books_;
  uint64_t seq_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  LeasePool holds_;
  // Per hold slot, the request that holds it (for Kill()).
  std::vector<size_t> hold_request_;

  std::deque<uint32_t> demand_queue_;
  std::deque<uint32_t> prewarm_queue_;
  uint32_t demand_in_flight_ = 0, prewarm_in_flight_ = 0;
  // The transfers, by model: demand loads in the foreground, prewarms in
  // the background (they move only while no demand transfer does).
  LoadLink link_;
  // Worth scanning the demand queue again: room, a slot or the queue
  // changed since the last scan.
  bool room_changed_ = true;
  uint64_t next_waiter_id_ = 0;
  uint64_t idle_bytes_ = 0;  // resident, no lease, not loading

  // The drain under way, if any: its waiter and its set.
  struct Drain {
    bool active = false;
    uint32_t waiter = 0;
    std::vector<uint32_t> set;
    uint64_t set_bytes = 0;
    // The free bytes when it began and the set's: while less than the
    // waiter needs (bytes held by loads in flight), what those loads bring
    // joins the set.
    uint64_t covered = 0;
    double started_ms = 0;
  };
  Drain drain_;
  // How long drains last (NextRecentDrainMs), for the default drain_after.
  double recent_drain_ms_ = 0;
  uint64_t drains_ = 0, drain_queued_ = 0;
  double next_drain_check_ = kInf;
  uint64_t access_seq_ = 0;
};

// The replay in trace time of one node: the trace's requests, in order,
// read from its source a chunk at a time, fed to one Node. (Where requests
// come from lives here; what a node does with them lives in Node.) An
// offline policy's hints come from a NextUseIndex, built in a pass over the
// source before the replay's pass.
class Engine {
 public:
  // REQUIRES: every argument outlives the engine. `timed`: false runs an
  // infinitely fast load path (loads take no time).
  Engine(const TraceSource& source, const NamedPolicy& policy,
         uint64_t capacity, const SimulateOptions& options, bool timed);

  // Runs the whole trace, once; then its books with the cache's counters.
  RunResult Run() &&;

 private:
  const TraceSource& source_;
  const TraceHeader& trace_;
  const SimulateOptions& options_;
  std::optional<NextUseIndex> next_use_;  // an offline policy's
  Node node_;
};

// The span of a trace, [first request, last request] (0 and 0 when empty).
double TraceStart(const Trace& trace);
double TraceEnd(const Trace& trace);
// The service time of request `i`: its own, else options.hold_ms.
double HoldMsOf(const Trace& trace, const SimulateOptions& options, size_t i);

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_ENGINE_H_
