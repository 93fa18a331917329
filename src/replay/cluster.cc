// The replay in trace time of several nodes behind HAProxy (cluster.h).
//
// Design note.
//
// N Nodes (engine.h), each its own cache, load path, events and books, and a
// Router in front of them, driven by one event loop on one thread. The loop
// takes, at each step, the earliest of
//   - a node's next event (its own: a lease ending, a load's latency or
//     transfer ending, keep-alive, a deadline), the lowest index first on a
//     tie, then
//   - a cluster event: a node dying, HAProxy noticing it, a node joining, a
//     retry, a client slot freed (on a tie, in the order they were filed),
//     then
//   - the trace's next request.
// So at any instant every node's own events come before the requests and
// retries that arrive then, as in the one-node replay, and with one node, no
// events, no spill and no client limit the calls a Node receives are the
// one-node replay's, in the same order (ClusterReplay.OneNodeIsTheSingle-
// NodeReplay checks every field).
//
// A request's life: sent (at its trace time, or when a client slot frees),
// then tried: the router picks a node; a node that is dead refuses the
// connection and the request is tried again after the turn-around delay; a
// node that is alive takes it (Router::Took) and either serves it or, with
// spill_on_full, refuses it at once (a 503, tried again at once); a node
// that dies hands its requests back, tried again at once. Every retry avoids
// the node that failed. Nodes speak through NodeListener: a request that
// takes its lease, one that ends (served, rejected, too large: it leaves its
// node, Router::Released, and its outcome is booked), a load that starts.
// Nothing calls back into a node from inside one: retries and freed client
// slots go through the cluster's event queue.
//
// Books. Each request is booked once, when it ends: hit or cold start by
// its last try, its wait from when it was sent to when it took its lease.
// Memory, loads and the load path come from the nodes' own books, summed.
#include "modelcache/replay/cluster.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <deque>
#include <functional>
#include <memory>
#include <numeric>
#include <queue>
#include <unordered_map>

#include "engine.h"
#include "modelcache/base/errors.h"
#include "modelcache/core/policy.h"
#include "parallel.h"

namespace modelcache::replay {
namespace {

constexpr size_t kNone = Router::kNone;
constexpr double kInf = std::numeric_limits<double>::infinity();

WaitSummary Summarize(std::vector<double>* waits) {
  std::sort(waits->begin(), waits->end());
  return WaitSummary{Percentile(*waits, 0.5), Percentile(*waits, 0.95),
                     Percentile(*waits, 0.99), Percentile(*waits, 0.999),
                     waits->empty() ? 0 : waits->back()};
}

class ClusterRun;

// A node's listener: says which node spoke.
class NodeEars final : public NodeListener {
 public:
  NodeEars(ClusterRun* run, size_t node) : run_(run), node_(node) {}
  void Started(size_t id, bool hit, double now) override;
  void Ended(size_t id, Outcome outcome, double now) override;
  void LoadStarted(uint32_t model, double now) override;

 private:
  ClusterRun* const run_;
  const size_t node_;
};

class ClusterRun {
 public:
  ClusterRun(const Trace& trace, const std::string& policy_name,
             const NamedPolicy& policy, uint64_t capacity,
             const ClusterOptions& options, const SimulateOptions& simulate);
  ClusterRun(const ClusterRun&) = delete;
  ClusterRun& operator=(const ClusterRun&) = delete;

  ClusterResult Run() &&;

  // From the nodes.
  void Started(size_t node, size_t id, bool hit, double now);
  void Ended(size_t node, size_t id, NodeListener::Outcome outcome, double now);
  void LoadStarted(size_t node, uint32_t model, double now);

 private:
  enum class Kind : uint8_t { kKill, kDetect, kJoin, kRetry, kDrain };
  struct Event {
    double t;
    uint64_t seq;
    Kind kind;
    size_t arg;      // node, or request
    uint64_t extra;  // kDetect: the node's life it applies to; kKill and
                     // kJoin: the event's index
    bool operator>(const Event& o) const {
      return t != o.t ? t > o.t : seq > o.seq;
    }
  };
  struct Flight {
    NodeRequest request;
    size_t node = kNone;   // where it is now; kNone between tries
    size_t avoid = kNone;  // the node to avoid at its next try
    uint32_t failures = 0;
    bool cold = true;
    double lease_at = 0;
  };

  void Schedule(double t, Kind kind, size_t arg, uint64_t extra = 0) {
    events_.push(Event{t, seq_++, kind, arg, extra});
  }
  void HandleEvent(const Event& e);
  void Arrival(size_t i);
  void Send(size_t i);
  void Try(size_t id);
  void Retry(size_t id, size_t failed, double delay_ms);
  void Fail(size_t id);
  void Over();
  void Drain();
  void Kill(size_t node, size_t event);
  void Join(size_t node, size_t event);
  std::vector<uint32_t> Moved(size_t node, bool down) const;
  // The delay before a refused connection is tried again: HAProxy's
  // turn-around, except where it redispatches at once (round robin and
  // random, with another server up).
  double ConnectRetryDelay() const;
  ClusterResult Finish();

  const Trace& trace_;
  const TraceHeader header_;  // the nodes' view of the trace
  const std::string& policy_name_;
  const uint64_t capacity_;
  const ClusterOptions& options_;
  const SimulateOptions& simulate_;
  const double t_first_, t_last_;
  Router router_;
  std::vector<uint32_t> keys_;  // per model
  std::vector<std::unique_ptr<NodeEars>> ears_;
  std::vector<std::unique_ptr<Node>> nodes_;

  double now_ = 0;
  uint64_t seq_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  std::unordered_map<size_t, Flight> flights_;
  std::deque<size_t> client_queue_;
  bool drain_filed_ = false;
  uint64_t outstanding_ = 0;
  std::vector<uint64_t> generation_;  // per node: its lives

  // Books.
  ClusterResult result_;
  uint64_t hits_ = 0, misses_ = 0, too_large_ = 0, cold_starts_ = 0,
           rejected_ = 0;
  uint64_t requested_bytes_ = 0, missed_bytes_ = 0;
  std::vector<uint64_t> model_requests_, model_cold_;
  std::vector<double> waits_, client_waits_;
  std::vector<std::vector<double>> node_waits_;
  std::vector<uint64_t> node_served_, node_loads_, node_refused_, node_peak_;
  std::vector<uint8_t> loaded_;  // model x node: loaded there at least once
  // Per event: its time, and the models loaded in its window.
  std::vector<double> event_t_;
  std::vector<std::vector<bool>> event_models_;
};

void NodeEars::Started(size_t id, bool hit, double now) {
  run_->Started(node_, id, hit, now);
}
void NodeEars::Ended(size_t id, Outcome outcome, double now) {
  run_->Ended(node_, id, outcome, now);
}
void NodeEars::LoadStarted(uint32_t model, double now) {
  run_->LoadStarted(node_, model, now);
}

ClusterRun::ClusterRun(const Trace& trace, const std::string& policy_name,
                       const NamedPolicy& policy, uint64_t capacity,
                       const ClusterOptions& options,
                       const SimulateOptions& simulate)
    : trace_(trace),
      header_(HeaderOf(trace)),
      policy_name_(policy_name),
      capacity_(capacity),
      options_(options),
      simulate_(simulate),
      t_first_(TraceStart(trace)),
      t_last_(TraceEnd(trace)),
      router_(options.nodes, options.route, options.seed) {
  const size_t n = options.nodes.size();
  const size_t models = trace.models.size();
  for (const std::string& name : trace.models) {
    keys_.push_back(router_.Key(name));
  }
  for (size_t k = 0; k < n; ++k) {
    ears_.push_back(std::make_unique<NodeEars>(this, k));
    nodes_.push_back(std::make_unique<Node>(header_, policy, capacity, simulate,
                                            /*timed=*/true, t_first_, t_last_,
                                            ears_.back().get()));
  }
  generation_.assign(n, 0);
  model_requests_.assign(models, 0);
  model_cold_.assign(models, 0);
  node_waits_.resize(n);
  node_served_.assign(n, 0);
  node_loads_.assign(n, 0);
  node_refused_.assign(n, 0);
  node_peak_.assign(n, 0);
  loaded_.assign(models * n, 0);
  waits_.reserve(trace.requests.size());
}

ClusterResult ClusterRun::Run() && {
  const auto& requests = trace_.requests;
  const size_t n = requests.size();
  now_ = t_first_;
  result_.route = options_.route;
  if (options_.route.hashed()) {
    for (const uint32_t key : keys_)
      result_.owners.push_back(router_.Owner(key));
  }
  for (size_t k = 0; k < nodes_.size(); ++k) {
    nodes_[k]->AdvanceTo(t_first_);
    if (options_.nodes[k].down_at_start) nodes_[k]->Kill();
  }
  for (size_t e = 0; e < options_.events.size(); ++e) {
    const ClusterEvent& event = options_.events[e];
    const size_t node = router_.IndexOf(event.node);
    event_t_.push_back(t_first_ + event.at_ms);
    event_models_.emplace_back(trace_.models.size(), false);
    result_.events.push_back(ClusterEventResult{event, {}, 0, 0, 0});
    Schedule(
        t_first_ + event.at_ms,
        event.kind == ClusterEvent::Kind::kKill ? Kind::kKill : Kind::kJoin,
        node, e);
  }
  size_t next = 0;
  for (;;) {
    size_t k = kNone;
    double t_node = kInf;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const double t = nodes_[i]->NextTime();
      if (t < t_node) {
        t_node = t;
        k = i;
      }
    }
    const double t_event = events_.empty() ? kInf : events_.top().t;
    const double t_request =
        next < n ? static_cast<double>(requests[next].t_ms) : kInf;
    const double t_cluster = std::min(t_event, t_request);
    if (t_node == kInf && t_cluster == kInf) break;
    if (t_node <= t_cluster) {
      nodes_[k]->Step();
      continue;
    }
    now_ = t_cluster;
    if (t_event <= t_request) {
      const Event e = events_.top();
      events_.pop();
      HandleEvent(e);
    } else {
      Arrival(next++);
    }
  }
  return Finish();
}

void ClusterRun::HandleEvent(const Event& e) {
  switch (e.kind) {
    case Kind::kKill:
      Kill(e.arg, e.extra);
      break;
    case Kind::kDetect:
      if (e.extra == generation_[e.arg] && !nodes_[e.arg]->alive()) {
        router_.SetDown(e.arg);
      }
      break;
    case Kind::kJoin:
      Join(e.arg, e.extra);
      break;
    case Kind::kRetry:
      Try(e.arg);
      break;
    case Kind::kDrain:
      drain_filed_ = false;
      Drain();
      break;
  }
}

void ClusterRun::Arrival(size_t i) {
  if (options_.concurrency > 0 &&
      (outstanding_ >= options_.concurrency || !client_queue_.empty())) {
    client_queue_.push_back(i);
    return;
  }
  Send(i);
}

void ClusterRun::Drain() {
  while (!client_queue_.empty() && outstanding_ < options_.concurrency) {
    const size_t i = client_queue_.front();
    client_queue_.pop_front();
    Send(i);
  }
}

void ClusterRun::Send(size_t i) {
  ++outstanding_;
  result_.peak_in_flight = std::max(result_.peak_in_flight, outstanding_);
  const double client_wait =
      now_ - static_cast<double>(trace_.requests[i].t_ms);
  if (options_.concurrency > 0) {
    client_waits_.push_back(client_wait);
    if (client_wait > 0) ++result_.client_waited;
  }
  Flight flight;
  flight.request.id = i;
  flight.request.model = trace_.requests[i].model;
  flight.request.hold_ms = HoldMsOf(trace_, simulate_, i);
  flight.request.wait_from = now_;
  flights_.emplace(i, flight);
  Try(i);
}

double ClusterRun::ConnectRetryDelay() const {
  const RouteKind kind = options_.route.kind;
  const bool round_robin_kind = kind == RouteKind::kRoundRobin ||
                                kind == RouteKind::kRandom ||
                                kind == RouteKind::kP2c;
  return round_robin_kind && router_.up_count() > 1 ? 0
                                                    : options_.retry_delay_ms;
}

void ClusterRun::Try(size_t id) {
  Flight& f = flights_.at(id);
  const size_t k = router_.Pick(keys_[f.request.model], f.avoid);
  if (k == kNone) {  // no server up: HAProxy answers 503
    Fail(id);
    return;
  }
  Node& node = *nodes_[k];
  if (!node.alive()) {
    // The connection is refused: HAProxy had counted the request on the
    // server (leastconn reorders on each change) and takes it back.
    router_.Took(k);
    router_.Released(k);
    Retry(id, k, ConnectRetryDelay());
    return;
  }
  router_.Took(k);
  node_peak_[k] = std::max<uint64_t>(node_peak_[k], router_.in_flight(k));
  f.node = k;
  f.cold = true;
  node.AdvanceTo(now_);
  const Node::Admission admission =
      node.Arrive(f.request, options_.spill_on_full);
  if (admission == Node::Admission::kRefused) {
    // A 503 at once: tried again at once elsewhere (retry-on 503).
    router_.Released(k);
    ++result_.spills;
    ++node_refused_[k];
    Retry(id, k, 0);
    return;
  }
  node.StartLoads();
}

void ClusterRun::Retry(size_t id, size_t failed, double delay_ms) {
  Flight& f = flights_.at(id);
  f.node = kNone;
  f.avoid = failed;
  if (++f.failures > options_.retries) {
    Fail(id);
    return;
  }
  ++result_.retries;
  Schedule(now_ + delay_ms, Kind::kRetry, id);
}

void ClusterRun::Fail(size_t id) {
  const Flight& f = flights_.at(id);
  const uint64_t size = trace_.sizes[f.request.model];
  ++result_.refused;
  ++misses_;
  ++model_requests_[f.request.model];
  requested_bytes_ += size;
  missed_bytes_ += size;
  flights_.erase(id);
  Over();
}

void ClusterRun::Over() {
  --outstanding_;
  if (!client_queue_.empty() && !drain_filed_) {
    drain_filed_ = true;
    Schedule(now_, Kind::kDrain, 0);
  }
}

void ClusterRun::Started(size_t node, size_t id, bool hit, double now) {
  (void)node;
  Flight& f = flights_.at(id);
  f.lease_at = now;
  // The node's books decide: a request queued behind a drain that ended
  // with its model resident is a hit, though it took its lease after its
  // arrival.
  f.cold = !hit;
}

void ClusterRun::Ended(size_t node, size_t id, NodeListener::Outcome outcome,
                       double now) {
  now_ = now;
  router_.Released(node);
  const Flight& f = flights_.at(id);
  const uint32_t m = f.request.model;
  const uint64_t size = trace_.sizes[m];
  ++model_requests_[m];
  requested_bytes_ += size;
  switch (outcome) {
    case NodeListener::Outcome::kServed: {
      if (f.cold) {
        ++cold_starts_;
        ++misses_;
        ++model_cold_[m];
        missed_bytes_ += size;
      } else {
        ++hits_;
      }
      const double wait = f.lease_at - f.request.wait_from;
      waits_.push_back(wait);
      node_waits_[node].push_back(wait);
      ++node_served_[node];
      break;
    }
    case NodeListener::Outcome::kRejected:
      ++cold_starts_;
      ++misses_;
      ++model_cold_[m];
      ++rejected_;
      missed_bytes_ += size;
      break;
    case NodeListener::Outcome::kTooLarge:
      ++misses_;
      ++too_large_;
      missed_bytes_ += size;
      break;
  }
  flights_.erase(id);
  Over();
}

void ClusterRun::LoadStarted(size_t node, uint32_t model, double now) {
  ++node_loads_[node];
  loaded_[model * nodes_.size() + node] = 1;
  for (size_t e = 0; e < event_t_.size(); ++e) {
    if (now >= event_t_[e] && now < event_t_[e] + kEventWindowMs) {
      ++result_.events[e].loads_after;
      event_models_[e][model] = true;
    }
  }
}

std::vector<uint32_t> ClusterRun::Moved(size_t node, bool down) const {
  std::vector<uint32_t> moved;
  if (!options_.route.hashed()) return moved;
  Router after = router_;
  if (down) {
    after.SetDown(node);
  } else {
    after.SetUp(node);
  }
  for (uint32_t m = 0; m < keys_.size(); ++m) {
    if (router_.Owner(keys_[m]) != after.Owner(keys_[m])) moved.push_back(m);
  }
  return moved;
}

void ClusterRun::Kill(size_t node, size_t event) {
  ClusterEventResult& record = result_.events[event];
  record.moved = Moved(node, /*down=*/true);
  nodes_[node]->AdvanceTo(now_);
  const std::vector<size_t> requests = nodes_[node]->Kill();
  record.requests_retried = requests.size();
  // Each fails (the connection resets) and is retried at once, elsewhere.
  for (const size_t id : requests) {
    router_.Released(node);
    Retry(id, node, 0);
  }
  Schedule(now_ + options_.detect_ms, Kind::kDetect, node, ++generation_[node]);
}

void ClusterRun::Join(size_t node, size_t event) {
  // The moved set against the ring HAProxy has now (the node may not have
  // been noticed down yet: then nothing moves).
  result_.events[event].moved = Moved(node, /*down=*/false);
  nodes_[node]->AdvanceTo(now_);
  nodes_[node]->Restart();
  ++generation_[node];
  router_.SetUp(node);
}

ClusterResult ClusterRun::Finish() {
  const size_t n = nodes_.size();
  const size_t models = trace_.models.size();
  ClusterResult result = std::move(result_);
  RunResult& total = result.total;
  total.policy = policy_name_;
  total.capacity_bytes = capacity_;
  total.timed = true;
  total.drain_after_ms = simulate_.drain_after_ms;
  total.requests = trace_.requests.size();
  total.hits = hits_;
  total.misses = misses_;
  total.too_large = too_large_;
  total.cold_starts = cold_starts_;
  total.rejected = rejected_;
  total.loads_per_model.assign(models, 0);
  uint64_t served = 0;
  for (const uint64_t s : node_served_) served += s;
  for (size_t k = 0; k < n; ++k) {
    nodes_[k]->AdvanceTo(std::max(t_last_, 0.0));
    NodeResult node;
    node.name = options_.nodes[k].name;
    node.requests = node_served_[k];
    node.request_share = served ? static_cast<double>(node_served_[k]) /
                                      static_cast<double>(served)
                                : 0;
    node.loads = node_loads_[k];
    node.refused = node_refused_[k];
    node.wait_ms = Summarize(&node_waits_[k]);
    node.peak_in_flight = node_peak_[k];
    node.detail = std::move(*nodes_[k]).Finish();
    node.detail.policy = policy_name_;
    node.detail.capacity_bytes = capacity_;
    const RunResult& d = node.detail;
    node.bytes_loaded = d.bytes_loaded;
    total.bytes_loaded += d.bytes_loaded;
    total.evictions += d.evictions;
    total.prewarms += d.prewarms;
    total.drains += d.drains;
    total.drain_queued += d.drain_queued;
    total.load_seconds += d.load_seconds;
    total.idle_gib_hours += d.idle_gib_hours;
    total.load_queue_mean += d.load_queue_mean;
    total.load_queue_peak = std::max(total.load_queue_peak, d.load_queue_peak);
    total.disk_busy_ratio += d.disk_busy_ratio / static_cast<double>(n);
    total.overloaded = total.overloaded || d.overloaded;
    total.peak_resident_bytes += d.peak_resident_bytes;
    for (size_t m = 0; m < models; ++m) {
      total.loads_per_model[m] += d.loads_per_model[m];
    }
    if (k == 0) {
      total.bins = d.bins;
    } else {
      for (size_t b = 0; b < total.bins.size() && b < d.bins.size(); ++b) {
        total.bins[b].min_bytes += d.bins[b].min_bytes;
        total.bins[b].mean_bytes += d.bins[b].mean_bytes;
        total.bins[b].max_bytes += d.bins[b].max_bytes;
        total.bins[b].queue += d.bins[b].queue;
      }
    }
    result.loads += node.loads;
    result.nodes.push_back(std::move(node));
  }
  for (const auto& b : total.bins) {
    total.resident_over_time.emplace_back(b.t_ms,
                                          static_cast<uint64_t>(b.mean_bytes));
  }
  total.wait_ms = Summarize(&waits_);
  if (!waits_.empty()) {
    for (int q = 1; q <= 1000; ++q) {
      total.wait_quantiles.push_back(Percentile(waits_, q / 1000.0));
    }
  }
  std::vector<double> model_ratios;
  for (size_t m = 0; m < models; ++m) {
    if (model_requests_[m] > 0) {
      model_ratios.push_back(static_cast<double>(model_cold_[m]) /
                             static_cast<double>(model_requests_[m]));
    }
  }
  std::sort(model_ratios.begin(), model_ratios.end());
  total.p75_model_cold_start_ratio = Percentile(model_ratios, 0.75);
  const double requests = static_cast<double>(total.requests);
  total.hit_ratio = requests > 0 ? static_cast<double>(hits_) / requests : 0;
  total.cold_start_ratio =
      requests > 0 ? static_cast<double>(cold_starts_) / requests : 0;
  total.byte_miss_ratio = requested_bytes_
                              ? static_cast<double>(missed_bytes_) /
                                    static_cast<double>(requested_bytes_)
                              : 0;

  // Copies: over the models requested, ranked by requests.
  result.copies.assign(models, 0);
  std::vector<uint32_t> ranked;
  for (uint32_t m = 0; m < models; ++m) {
    for (size_t k = 0; k < n; ++k) result.copies[m] += loaded_[m * n + k];
    if (model_requests_[m] > 0) ranked.push_back(m);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [&](uint32_t a, uint32_t b) {
    return model_requests_[a] > model_requests_[b];
  });
  if (!ranked.empty()) {
    double sum = 0;
    for (const uint32_t m : ranked) sum += result.copies[m];
    result.copies_mean = sum / static_cast<double>(ranked.size());
    result.hottest_model = ranked.front();
    result.median_model = ranked[(ranked.size() - 1) / 2];
    result.copies_hottest = result.copies[result.hottest_model];
    result.copies_median = result.copies[result.median_model];
  }
  for (size_t e = 0; e < result.events.size(); ++e) {
    result.events[e].models_loaded_after = static_cast<uint64_t>(
        std::count(event_models_[e].begin(), event_models_[e].end(), true));
  }
  result.client_wait_ms = Summarize(&client_waits_);
  return result;
}

NamedPolicy ClusterPolicy(const std::string& name, const TimeModel& time) {
  NamedPolicy policy = PolicyByName(
      name,
      LoadCostModel{time.latency_ms / 1000, time.bandwidth_bytes_per_second});
  if (policy.offline) {
    throw Error(ErrorCode::kInvalidArgument,
                "policy '" + name +
                    "' needs each node's future requests, which the routing "
                    "decides: it cannot run with several nodes");
  }
  return policy;
}

}  // namespace

ClusterResult SimulateCluster(const Trace& trace, const std::string& policy,
                              uint64_t capacity_bytes,
                              const ClusterOptions& options,
                              const SimulateOptions& simulate) {
  const NamedPolicy named = ClusterPolicy(policy, simulate.time);
  ValidateClusterOptions(options, TraceEnd(trace) - TraceStart(trace));
  // A node whose first event is a join is down from the start.
  ClusterOptions run = options;
  std::stable_sort(run.events.begin(), run.events.end(),
                   [](const ClusterEvent& a, const ClusterEvent& b) {
                     return a.at_ms < b.at_ms;
                   });
  for (RingServer& node : run.nodes) {
    for (const ClusterEvent& e : run.events) {
      if (e.node != node.name) continue;
      if (e.kind == ClusterEvent::Kind::kJoin) node.down_at_start = true;
      break;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  ClusterResult result =
      ClusterRun(trace, policy, named, capacity_bytes, run, simulate).Run();
  result.total.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  result.total.requests_per_second =
      result.total.seconds > 0
          ? static_cast<double>(result.total.requests) / result.total.seconds
          : 0;
  return result;
}

std::vector<ClusterResult> ReplayClusterAll(
    const Trace& trace, const std::vector<Route>& routes,
    const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, const ClusterOptions& options,
    const SimulateOptions& simulate, unsigned threads,
    const std::function<void(size_t, size_t)>& progress) {
  for (const std::string& p : policies) ClusterPolicy(p, simulate.time);
  ValidateClusterOptions(options, TraceEnd(trace) - TraceStart(trace));
  for (const Route& r : routes) ValidateBalanceFactor(r.balance_factor);
  const size_t per_route = policies.size() * capacities.size();
  const size_t total = routes.size() * per_route;
  std::vector<ClusterResult> results(total);
  RunParallel(
      total, threads,
      [&](size_t task) {
        ClusterOptions run = options;
        run.route = routes[task / per_route];
        const size_t rest = task % per_route;
        results[task] = SimulateCluster(
            trace, policies[rest / capacities.size()],
            capacities[rest % capacities.size()], run, simulate);
      },
      progress ? [&](size_t done) { progress(done, total); }
               : std::function<void(size_t)>());
  return results;
}

}  // namespace modelcache::replay
