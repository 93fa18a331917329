// Many nodes behind HAProxy 2.6: the replay in trace time of N real caches
// (one ModelCache each, each with its own capacity and its own load path)
// with HAProxy's choice of server in front of them, so that an operator can
// predict, before deploying, what a routing does to loads, copies and waits.
//
// The router (Router) is HAProxy 2.6's, per `balance` algorithm, as read in
// its src/lb_fwrr.c, src/lb_fwlc.c, src/lb_chash.c, src/lb_map.c and
// src/backend.c:
//
//   route        HAProxy backend                          what it does
//   roundrobin   balance roundrobin                       fwrr: weighted round
//                                                         robin (its trees and
//                                                         positions)
//   random       balance random(1)                        one random point of
//                                                         the consistent ring
//   p2c          balance random (its default, 2 draws)    two random points;
//                                                         the server with
//                                                         fewer requests in
//                                                         flight per weight,
//                                                         the later on a tie
//   leastconn    balance leastconn                        fwlc: fewest (in
//                                                         flight + 1) / weight;
//                                                         idle servers first,
//                                                         ties in the order
//                                                         they became so
//   chash        balance hash path,field(4,/)             ring.h's ring
//                hash-type consistent
//   chash-bl:F   ... hash-balance-factor F                bounded load: ring.h
//   chash-map    ... hash-type map-based                  ring.h's map
//
// `random` and `p2c` draw from a seeded generator, not HAProxy's, so they
// agree with HAProxy in distribution only; every other route agrees request
// by request given the same requests in flight.
//
// Requests in flight. A request is in flight on its node from the moment
// HAProxy hands it over until its response ends: while it waits for its
// model's load, and for its service time after (HAProxy's `served`). So a
// cold load that makes requests wait raises its node's count, and under
// bounded load the next requests for that model go on around the ring to a
// node that loads the model too: the replay counts those duplicate loads.
//
// Failures, as HAProxy 2.6 handles them with
//   retries R, option redispatch 1, retry-on conn-failure empty-response 503
// (each retry goes to another server, the failed one avoided):
//   - kill:NODE@T: the node's process dies at T. Its requests in flight
//     (waiting or being served) fail and are retried at once elsewhere (L7
//     retries). Until HAProxy's health checks notice (detect_ms after T,
//     `inter` x `fall`), the node stays in the ring: a request sent there is
//     refused (a connection failure) and retried elsewhere, after
//     retry_delay_ms (HAProxy's turn-around, min(timeout connect, 1 s)),
//     except for roundrobin, random and p2c, which HAProxy redispatches at
//     once while another server is up. Then the node leaves the ring. Under
//     bounded load the shares stay stale (ring.h).
//   - join:NODE@T: the node is up at T, with an empty cache. A node whose
//     first event is a join is down from the start (HAProxy's `disabled`:
//     its share of bounded load stays 0).
//   - spill_on_full: a node that cannot make room for a model without
//     waiting for a request to end answers 503 at once (the daemon's
//     when-full "fail"), and HAProxy retries the request on another server.
//   - A request that fails R + 1 times, or finds no server up, gets an error
//     (counted as refused).
//
// Closed-loop clients: with `concurrency` C, at most C requests are out at
// once; a request of the trace whose time comes while C are out waits for
// one to end and is sent then. Waits are counted from when a request is
// sent (they include its retries), not from its time in the trace.
#ifndef MODELCACHE_REPLAY_CLUSTER_H_
#define MODELCACHE_REPLAY_CLUSTER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "modelcache/replay/replay.h"
#include "modelcache/replay/ring.h"

namespace modelcache::replay {

// ---- routes ----

enum class RouteKind : uint8_t {
  kRoundRobin,
  kRandom,
  kP2c,
  kLeastConn,
  kChash,
  kChashBoundedLoad,
  kChashMap,
};

struct Route {
  RouteKind kind = RouteKind::kChash;
  int64_t balance_factor = 0;  // kChashBoundedLoad: HAProxy's F (> 100)
  // "roundrobin", ..., "chash-bl:150".
  std::string name() const;
  // The route hashes the model id (chash, chash-bl, chash-map): a model has
  // an owner.
  bool hashed() const;
};

// "roundrobin", "random", "p2c", "leastconn", "chash", "chash-bl:F" (F a
// whole number above 100, as HAProxy's hash-balance-factor; 125 is a usual
// value), "chash-map". Throws Error kInvalidArgument naming the routes.
Route ParseRoute(std::string_view text);

// HAProxy's choice of server for each request of one backend (see the top of
// this file): the servers' states, each one's requests in flight, and the
// algorithm's own state (round robin's positions, leastconn's order, the
// random draws). Servers are referred to by their index in the vector given
// at construction (the order of the `server` lines). Not thread-safe.
class Router {
 public:
  static constexpr size_t kNone = ConsistentHashRing::kNone;

  // Throws as ValidateRingServers and ParseRoute do. `seed`: random, p2c.
  Router(std::vector<RingServer> servers, Route route, uint64_t seed = 42);

  size_t size() const { return servers_.size(); }
  const RingServer& server(size_t index) const { return servers_[index]; }
  // The index of the server named `name`, or kNone.
  size_t IndexOf(std::string_view name) const;
  const Route& route() const { return route_; }

  // The key HAProxy hashes `model` (its id, the `{id}` of the request's
  // path) to under this route: full_hash(sdbm(id)) on the consistent ring,
  // sdbm(id) for the map. Unused by the other routes.
  uint32_t Key(std::string_view model) const;

  // The server for a request with `key`, avoiding `avoid` as a redispatch
  // does (kNone: nothing to avoid); kNone when no server is up. May change
  // the algorithm's state (round robin moves on, random draws).
  size_t Pick(uint32_t key, size_t avoid = kNone);

  // The server took a request / one of its requests ended (HAProxy's
  // `served`, and leastconn's reordering). REQUIRES: Took before Released.
  void Took(size_t index);
  void Released(size_t index);
  uint32_t in_flight(size_t index) const { return in_flight_[index]; }
  uint64_t total_in_flight() const;

  // Health checks: the server leaves or rejoins the algorithm. Idempotent.
  void SetDown(size_t index);
  void SetUp(size_t index);
  bool is_up(size_t index) const { return up_[index]; }
  size_t up_count() const;

  // The server a hashed route sends `key` to with nothing in flight and
  // nothing avoided; kNone for the other routes or when none is up.
  size_t Owner(uint32_t key) const;

 private:
  // fwrr (lb_fwrr.c) and fwlc (lb_fwlc.c) keep servers in eb32 trees whose
  // equal keys come out in insertion order: (key, insertion number).
  using Tree = std::set<std::tuple<uint32_t, uint64_t, uint32_t>>;
  struct TreeNode {
    int tree = -1;  // -1: in no tree
    uint32_t key = 0;
    uint64_t order = 0;
  };
  void Insert(int tree, uint32_t server, uint32_t key);
  void Remove(uint32_t server);
  Tree& TreeAt(int tree) { return trees_[static_cast<size_t>(tree)]; }
  std::optional<uint32_t> First(int tree) const;
  uint32_t Eweight(size_t index) const;

  // fwrr.
  struct FwrrServer {
    uint32_t npos = 0, lpos = 0, rweight = 0;
  };
  void FwrrInit();
  void FwrrQueueByWeight(int tree, uint32_t s);
  void FwrrQueue(uint32_t s);
  void FwrrGetSrv(uint32_t s);
  void FwrrSwitchTrees();
  std::optional<uint32_t> FwrrFromGroup();
  void FwrrUpdatePosition(uint32_t s);
  size_t FwrrNext(size_t avoid);
  void FwrrDown(uint32_t s);
  void FwrrUp(uint32_t s);
  // fwlc.
  uint32_t FwlcKey(uint32_t s) const;
  void FwlcReposition(uint32_t s);
  size_t FwlcNext(size_t avoid);
  // random, p2c.
  size_t RandomNext(size_t avoid, int draws);

  std::vector<RingServer> servers_;
  Route route_;
  std::vector<bool> up_;
  std::vector<uint32_t> in_flight_;
  std::optional<ConsistentHashRing> ring_;  // chash, chash-bl, random, p2c
  std::optional<MapBasedHash> map_;         // chash-map
  std::mt19937_64 random_;
  // The trees: fwrr's t0, t1 and curr (kCurr), fwlc's one (0).
  static constexpr int kCurr = 2;
  Tree trees_[3];
  std::vector<TreeNode> nodes_;
  uint64_t inserted_ = 0;
  std::vector<FwrrServer> fwrr_;
  int fwrr_init_ = 0, fwrr_next_ = 1;  // which of t0, t1
  int32_t curr_pos_ = 0, curr_weight_ = 0, next_weight_ = 0;
};

// ---- the replay of several nodes ----

// A node's process dies (kKill) or comes up (kJoin) at `at_ms` after the
// trace's first request.
struct ClusterEvent {
  enum class Kind : uint8_t { kKill, kJoin };
  Kind kind = Kind::kKill;
  std::string node;  // its name in ClusterOptions::nodes
  double at_ms = 0;
};

// "kill:n2@30m", "join:n2@50m" (a duration as ParseDurationMs reads it).
// Throws Error kInvalidArgument.
ClusterEvent ParseClusterEvent(std::string_view text);

struct ClusterOptions {
  // HAProxy's `server` lines, in order (name, id, weight).
  std::vector<RingServer> nodes;
  Route route;
  // Requests out at once at most (closed-loop clients); 0: none (open loop).
  uint32_t concurrency = 0;
  std::vector<ClusterEvent> events;
  // From a node's death to HAProxy marking it down (inter x fall).
  double detect_ms = 6000;
  // Before retrying a refused connection (min(timeout connect, 1 s)).
  double retry_delay_ms = 1000;
  // HAProxy's `retries`: a request is tried at most retries + 1 times.
  uint32_t retries = 3;
  bool spill_on_full = false;
  uint64_t seed = 42;  // random, p2c
};

// "n1..nN": N servers named n1.. with ids 1.. and weight 1 (HAProxy's
// default weight).
std::vector<RingServer> NumberedNodes(uint32_t count);

// Throws Error kInvalidArgument naming the problem: no nodes, bad servers
// (ValidateRingServers), an event for a node not in `nodes`, outside
// [0, span_ms] (the trace's span), a kill of a node already down or a join
// of one up, a negative or non-finite delay.
void ValidateClusterOptions(const ClusterOptions& options, double span_ms);

struct NodeResult {
  std::string name;
  uint64_t requests = 0;     // served here (the node that answered)
  double request_share = 0;  // of the requests served
  uint64_t loads = 0;        // loads started here (demand and prewarm)
  uint64_t bytes_loaded = 0;
  uint64_t refused = 0;  // 503s answered (spill_on_full)
  WaitSummary wait_ms;   // over the requests served here
  uint64_t peak_in_flight = 0;
  // The node's own books: its cache's counters, idle memory, load path
  // (its requests and waits are those it saw, retried ones included).
  RunResult detail;
};

struct ClusterEventResult {
  ClusterEvent event;
  // Hashed routes: the models of the trace whose owner (no load) changes
  // with this event, by index, in index order (`modelcache ring --kill`'s
  // moved set). Empty for the other routes.
  std::vector<uint32_t> moved;
  // In the 10 minutes from the event: loads started on every node, and the
  // distinct models they loaded.
  uint64_t loads_after = 0;
  uint64_t models_loaded_after = 0;
  // A kill: the requests on the node when it died (retried elsewhere).
  uint64_t requests_retried = 0;
};

inline constexpr double kEventWindowMs = 10 * 60 * 1000;

struct ClusterResult {
  Route route;
  // Over the whole cluster: the policy, the capacity of each node and the
  // usual metrics. Each request counts once, as it ended (its last try);
  // memory, loads and the load path are summed over the nodes, disk busy is
  // their mean, the load queue's peak their largest.
  RunResult total;
  std::vector<NodeResult> nodes;
  uint64_t loads = 0;
  // Per model (requested at least once): the nodes that loaded it at least
  // once. The mean over models, and the hottest and the median model's
  // (models ranked by requests, ties by index; the median is at rank
  // (n - 1) / 2).
  double copies_mean = 0;
  uint32_t hottest_model = 0, median_model = 0;
  uint32_t copies_hottest = 0, copies_median = 0;
  std::vector<uint32_t> copies;  // per model
  uint64_t spills = 0;   // 503s from full nodes, each retried or refused
  uint64_t retries = 0;  // tries that failed and were tried again
  uint64_t refused = 0;  // requests that got an error in the end
  uint64_t peak_in_flight = 0;
  // Time requests of the trace waited for a client (concurrency).
  WaitSummary client_wait_ms;
  uint64_t client_waited = 0;
  std::vector<ClusterEventResult> events;
  // Hashed routes: each model's owner at the start (node index; kNone when
  // none is up), as `modelcache ring` prints it.
  std::vector<size_t> owners;
};

// The replay in trace time of `options.nodes`, each a cache of
// `capacity_bytes` run by `policy` with `simulate`'s load path, behind
// `options.route`. Throws Error kInvalidArgument for an unknown policy, an
// offline one (Belady's needs each node's future, which the routing
// decides), or bad options (ValidateClusterOptions).
// simulate.prewarms are not used.
ClusterResult SimulateCluster(const Trace& trace, const std::string& policy,
                              uint64_t capacity_bytes,
                              const ClusterOptions& options,
                              const SimulateOptions& simulate = {});

// Every (route, policy, capacity) through SimulateCluster on up to `threads`
// threads; results in route-major, then policy, then capacity order.
// Checks every route's and policy's name before running anything.
std::vector<ClusterResult> ReplayClusterAll(
    const Trace& trace, const std::vector<Route>& routes,
    const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, const ClusterOptions& options,
    const SimulateOptions& simulate, unsigned threads,
    const std::function<void(size_t done, size_t total)>& progress = {});

// How the cluster's table, JSON and report describe the run.
struct ClusterInfo {
  TimeModel time;
  ClusterOptions options;  // nodes, events, ...; route unused
};

std::string ClusterTable(const Trace& trace,
                         const std::vector<ClusterResult>& results,
                         const ClusterInfo& info);
std::string ClusterJson(const Trace& trace,
                        const std::vector<ClusterResult>& results,
                        const ClusterInfo& info);
// One self-contained HTML page: the tables, and charts of loads and p99 wait
// per route, and of each node's share of requests and loads.
std::string ClusterHtmlReport(const Trace& trace, const std::string& title,
                              const std::vector<ClusterResult>& results,
                              const ClusterInfo& info);

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_CLUSTER_H_
