// The replay of several nodes behind HAProxy (modelcache/replay/cluster.h):
// the routes' choices, computed by hand from HAProxy's algorithms; tiny
// traces whose loads, waits, retries and spills are computed by hand (two
// nodes under round robin and consistent hashing, a node killed with
// requests on it, a 503 spill, the duplicate load of bounded load, a node
// that joins, closed-loop clients); one node is the one-node replay, field
// by field; bad input; and the command line.
#include "modelcache/replay/cluster.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/base/errors.h"
#include "modelcache/replay/replay.h"
#include "nlohmann/json.hpp"
#include "replay_test_util.h"

namespace modelcache::replay {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr size_t kNone = Router::kNone;

// 100 ms + bytes at 1 GB/s per load: a 1e8-byte model loads in 200 ms.
SimulateOptions Timed() {
  SimulateOptions options;
  options.time = TimeModel{1e9, 100, 4};
  return options;
}

std::vector<RingServer> TwoNodes() {
  return {{"n1", 1, 1, false}, {"n2", 2, 1, false}};
}

// A model name that the consistent ring of `servers` (no load) gives to
// node `owner`, the `skip`-th such name of m0, m1, ...
std::string OwnedBy(const std::vector<RingServer>& servers, size_t owner,
                    int skip = 0) {
  const Router router(servers, ParseRoute("chash"));
  for (int i = 0;; ++i) {
    const std::string name = "m" + std::to_string(i);
    if (router.Owner(router.Key(name)) == owner && skip-- == 0) return name;
  }
}

struct Req {
  int64_t t_ms;
  uint32_t model;
  float hold_ms = 0;
};

Trace MakeTrace(std::vector<std::string> names, std::vector<uint64_t> sizes,
                std::vector<Req> requests) {
  Trace trace;
  trace.models = std::move(names);
  trace.sizes = std::move(sizes);
  bool holds = false;
  for (const Req& r : requests) {
    trace.requests.push_back(Request{r.t_ms, r.model});
    trace.hold_ms.push_back(r.hold_ms);
    holds = holds || r.hold_ms > 0;
  }
  if (!holds) trace.hold_ms.clear();
  return trace;
}

ClusterOptions Cluster(const std::string& route,
                       std::vector<RingServer> nodes = TwoNodes()) {
  ClusterOptions options;
  options.nodes = std::move(nodes);
  options.route = ParseRoute(route);
  return options;
}

std::vector<uint64_t> Loads(const ClusterResult& r) {
  std::vector<uint64_t> loads;
  for (const NodeResult& n : r.nodes) loads.push_back(n.loads);
  return loads;
}

// ---- routes ----

std::vector<std::string> Picks(Router& router, int n, bool hold = false) {
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) {
    const size_t s = router.Pick(0);
    names.push_back(router.server(s).name);
    if (hold) router.Took(s);
  }
  return names;
}

TEST(Routes, ParseEveryRouteAndRefuseTheRest) {
  for (const std::string name : {"roundrobin", "random", "p2c", "leastconn",
                                 "chash", "chash-bl:125", "chash-map"}) {
    EXPECT_EQ(ParseRoute(name).name(), name);
  }
  EXPECT_EQ(ParseRoute("chash-bl:150").balance_factor, 150);
  EXPECT_TRUE(ParseRoute("chash-map").hashed());
  EXPECT_FALSE(ParseRoute("leastconn").hashed());
  for (const std::string bad :
       {"", "rr", "chash-bl", "chash-bl:", "chash-bl:x", "chash-bl:100",
        "chash-bl:99", "chash-bl:-5", "chash-bl:1.5", "chash-bl:99999999999"}) {
    try {
      ParseRoute(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_THAT(e.what(), HasSubstr("route '" + bad + "'"));
    }
  }
}

TEST(Routes, RoundRobinWithEqualWeightsTakesTheServersInTurn) {
  // fwrr with three weight-1 servers (effective weight 16, 48 in all): each
  // is taken from the init tree in declaration order with npos = curr_pos +
  // 48/16, then each comes up again exactly when curr_pos reaches its npos.
  Router router({{"a", 1, 1, false}, {"b", 2, 1, false}, {"c", 3, 1, false}},
                ParseRoute("roundrobin"));
  const std::vector<std::string> picks = Picks(router, 300);
  for (size_t i = 0; i < picks.size(); ++i) {
    EXPECT_EQ(picks[i], std::string(1, static_cast<char>('a' + i % 3))) << i;
  }
}

TEST(Routes, RoundRobinFollowsTheWeights) {
  // a weight 2 (32), b weight 1 (16), 48 in all. a: npos 48 + 48/32 = 49
  // with rweight 16, so it is due again at once (49 <= curr_pos 49), its
  // remainder carries it to 51; b: 50 + 3 = 53. Then a at 51 (52, r 16), a
  // at 52 (54), b at 53 (56): a a b, a a b, ...
  Router router({{"a", 1, 2, false}, {"b", 2, 1, false}},
                ParseRoute("roundrobin"));
  const std::vector<std::string> picks = Picks(router, 300);
  EXPECT_THAT(std::vector<std::string>(picks.begin(), picks.begin() + 6),
              ElementsAre("a", "a", "b", "a", "a", "b"));
  EXPECT_EQ(std::count(picks.begin(), picks.end(), "a"), 200);
}

TEST(Routes, RoundRobinRedispatchSkipsTheAvoidedServer) {
  Router router({{"a", 1, 1, false}, {"b", 2, 1, false}, {"c", 3, 1, false}},
                ParseRoute("roundrobin"));
  // a is taken out (npos 51), skipped, and put back; b gets 52.
  EXPECT_EQ(router.server(router.Pick(0, /*avoid=*/0)).name, "b");
  // curr_pos is 50: a (51) is not due yet, c comes from the init tree (53);
  // then a (51 <= 51).
  EXPECT_THAT(Picks(router, 2), ElementsAre("c", "a"));
  // Without c (48 - 16 = 32 per round, steps of 2): b (52), then a, which
  // is first in the current tree and nothing waits in the init tree.
  router.SetDown(2);
  EXPECT_THAT(Picks(router, 4), ElementsAre("b", "a", "b", "a"));
}

TEST(Routes, LeastConnTakesTheIdleServersInTheOrderTheyBecameIdle) {
  // fwlc keys: 0 for an idle server, else (in flight + 1) * 4096 / 16; equal
  // keys in the order they were (re)inserted.
  Router router({{"a", 1, 1, false}, {"b", 2, 1, false}, {"c", 3, 1, false}},
                ParseRoute("leastconn"));
  EXPECT_THAT(Picks(router, 2, /*hold=*/true), ElementsAre("a", "b"));
  router.Released(0);  // a: key 0 again, behind c
  EXPECT_THAT(Picks(router, 2, /*hold=*/true), ElementsAre("c", "a"));
  // Everyone has one: a (2 * 256) was reinserted last, so b comes first.
  EXPECT_THAT(Picks(router, 1, /*hold=*/true), ElementsAre("b"));
  EXPECT_EQ(router.in_flight(1), 2u);
  // Fewest in flight wins: a and c have 1, b 2.
  EXPECT_THAT(Picks(router, 1, /*hold=*/true), ElementsAre("c"));
  // Weights: a weight-3 server with 2 in flight has the key
  // (2 + 1) * 4096 / 48 = 256, a weight-1 server with 1 has 2 * 4096 / 16 =
  // 512: the heavier one goes first.
  Router weighted({{"h", 1, 3, false}, {"l", 2, 1, false}},
                  ParseRoute("leastconn"));
  weighted.Took(0);
  weighted.Took(0);
  weighted.Took(1);
  EXPECT_EQ(weighted.server(weighted.Pick(0)).name, "h");
}

TEST(Routes, MapBasedRetriesGoToTheSameServer) {
  // map_get_server_hash takes no server to avoid.
  Router router(TwoNodes(), ParseRoute("chash-map"));
  const uint32_t key = router.Key("m0");
  const size_t owner = router.Owner(key);
  EXPECT_EQ(router.Pick(key, owner), owner);
  // The consistent ring walks on.
  Router ring(TwoNodes(), ParseRoute("chash"));
  const uint32_t k = ring.Key("m0");
  EXPECT_NE(ring.Pick(k, ring.Owner(k)), ring.Owner(k));
}

TEST(Routes, TwoChoicesPickTheBusyServerOnlyWhenBothDrawsDo) {
  // n1 has 10 requests in flight, n2 none. One draw lands on n1 with
  // probability s (its share of the ring's arcs); p2c keeps n1 only when
  // both draws land on it: s squared.
  std::map<std::string, int> random_count, p2c_count;
  Router random(TwoNodes(), ParseRoute("random"), 7);
  Router p2c(TwoNodes(), ParseRoute("p2c"), 7);
  for (Router* r : {&random, &p2c}) {
    for (int i = 0; i < 10; ++i) r->Took(0);
  }
  for (int i = 0; i < 2000; ++i) {
    ++random_count[random.server(random.Pick(0)).name];
    ++p2c_count[p2c.server(p2c.Pick(0)).name];
  }
  const double s = random_count["n1"] / 2000.0;
  EXPECT_GT(s, 0.05);
  EXPECT_NEAR(p2c_count["n1"] / 2000.0, s * s, 0.04);
}

TEST(Routes, NoServerUpIsNoServer) {
  for (const std::string route : {"roundrobin", "random", "p2c", "leastconn",
                                  "chash", "chash-bl:150", "chash-map"}) {
    Router router(TwoNodes(), ParseRoute(route));
    router.SetDown(0);
    router.SetDown(1);
    EXPECT_EQ(router.Pick(router.Key("m0")), kNone) << route;
    router.SetUp(1);
    EXPECT_EQ(router.Pick(router.Key("m0")), 1u) << route;
  }
}

// ---- the replay ----

TEST(ClusterReplay, RoundRobinLoadsEveryModelOnEveryNodeAndChashOnce) {
  const std::string a = OwnedBy(TwoNodes(), 0), b = OwnedBy(TwoNodes(), 1);
  // a, a, b, b, a second apart: round robin sends them to n1, n2, n1, n2,
  // so each node loads both; chash sends a to n1 and b to n2, once each.
  Trace trace = MakeTrace({a, b}, {100'000'000, 100'000'000},
                          {{0, 0}, {1000, 0}, {2000, 1}, {3000, 1}});
  ClusterResult rr =
      SimulateCluster(trace, "lru", kGiB, Cluster("roundrobin"), Timed());
  EXPECT_EQ(rr.loads, 4u);
  EXPECT_THAT(Loads(rr), ElementsAre(2u, 2u));
  EXPECT_EQ(rr.total.cold_starts, 4u);
  EXPECT_EQ(rr.total.wait_ms.max, 200);
  EXPECT_EQ(rr.copies_mean, 2);
  EXPECT_EQ(rr.copies_hottest, 2u);
  EXPECT_TRUE(rr.owners.empty());

  ClusterResult ch =
      SimulateCluster(trace, "lru", kGiB, Cluster("chash"), Timed());
  EXPECT_EQ(ch.loads, 2u);
  EXPECT_THAT(Loads(ch), ElementsAre(1u, 1u));
  EXPECT_EQ(ch.total.cold_starts, 2u);
  EXPECT_EQ(ch.total.hits, 2u);
  EXPECT_EQ(ch.copies_mean, 1);
  EXPECT_THAT(ch.owners, ElementsAre(0u, 1u));
  for (const ClusterResult* r : {&rr, &ch}) {
    EXPECT_EQ(r->nodes[0].request_share, 0.5);
    EXPECT_EQ(r->nodes[1].requests, 2u);
    EXPECT_EQ(r->total.bytes_loaded, r->loads * 100'000'000);
  }
}

TEST(ClusterReplay, AKilledNodesRequestsAreRetriedOnTheRingSuccessor) {
  const std::string a = OwnedBy(TwoNodes(), 0);
  // a@0 is served by n1 (load 0..200) for 5 s. n1 dies at 1000: the request
  // is retried at once on n2, which loads a (1000..1200): its wait is 1200
  // from when it was sent. a@3000 still goes to n1 (HAProxy notices at
  // 1000 + 6000): the connection is refused and retried after 1 s on n2, a
  // hit at 4000: wait 1000. At 7000 n1 leaves the ring; a@8000 goes to n2.
  Trace trace =
      MakeTrace({a}, {100'000'000}, {{0, 0, 5000}, {3000, 0}, {8000, 0}});
  ClusterOptions options = Cluster("chash");
  options.events = {ParseClusterEvent("kill:n1@1s")};
  options.detect_ms = 6000;
  options.retry_delay_ms = 1000;
  ClusterResult r = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_THAT(Loads(r), ElementsAre(1u, 1u));
  EXPECT_EQ(r.retries, 2u);
  EXPECT_EQ(r.refused, 0u);
  EXPECT_EQ(r.total.wait_ms.max, 1200);
  EXPECT_EQ(r.total.wait_ms.p50, 1000);
  EXPECT_EQ(r.total.cold_starts, 1u);
  EXPECT_EQ(r.total.hits, 2u);
  EXPECT_EQ(r.nodes[1].requests, 3u);
  EXPECT_EQ(r.nodes[1].request_share, 1);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].requests_retried, 1u);
  EXPECT_THAT(r.events[0].moved, ElementsAre(0u));
  EXPECT_EQ(r.events[0].loads_after, 1u);
  EXPECT_EQ(r.events[0].models_loaded_after, 1u);

  // Noticed at once: a@3000 goes straight to n2, a hit.
  options.detect_ms = 0;
  ClusterResult quick = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_EQ(quick.retries, 1u);
  EXPECT_EQ(quick.total.wait_ms.p50, 0);
  // Round robin redispatches a refused connection at once.
  options.route = ParseRoute("roundrobin");
  options.detect_ms = 6000;
  ClusterResult rr = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_LE(rr.total.wait_ms.p50, 200);
}

TEST(ClusterReplay, ARequestThatFailsMoreThanRetriesTimesIsRefused) {
  // Both nodes dead and not yet noticed: every try is refused.
  Trace trace = MakeTrace({"m0"}, {100'000'000}, {{0, 0}, {10, 0}});
  ClusterOptions options = Cluster("chash");
  options.events = {ParseClusterEvent("kill:n1@0ms"),
                    ParseClusterEvent("kill:n2@0ms")};
  options.retries = 2;
  options.retry_delay_ms = 1;
  ClusterResult r = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_EQ(r.refused, 2u);
  EXPECT_EQ(r.retries, 4u);
  EXPECT_EQ(r.loads, 0u);
  EXPECT_EQ(r.total.misses, 2u);
  // Once noticed, no server is up: refused at once.
  options.detect_ms = 0;
  ClusterResult noticed = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_EQ(noticed.refused, 2u);
  EXPECT_EQ(noticed.retries, 0u);
}

TEST(ClusterReplay, AFullNodeSpillsToTheNextNodeOnTheRing) {
  const std::string a = OwnedBy(TwoNodes(), 0), b = OwnedBy(TwoNodes(), 0, 1);
  // Room for one model per node; both are n1's. a@0 holds n1's room until
  // 5200; b@1000 cannot get room on n1 without waiting.
  Trace trace =
      MakeTrace({a, b}, {100'000'000, 100'000'000}, {{0, 0, 5000}, {1000, 1}});
  ClusterOptions options = Cluster("chash");
  ClusterResult waits =
      SimulateCluster(trace, "lru", 150'000'000, options, Timed());
  // It waits on n1 for a's lease, then loads: 5200..5400.
  EXPECT_THAT(Loads(waits), ElementsAre(2u, 0u));
  EXPECT_EQ(waits.total.wait_ms.max, 4400);
  EXPECT_EQ(waits.spills, 0u);

  options.spill_on_full = true;
  ClusterResult spills =
      SimulateCluster(trace, "lru", 150'000'000, options, Timed());
  // n1 answers 503 at once; the retry avoids n1 and n2 loads b at 1000.
  EXPECT_THAT(Loads(spills), ElementsAre(1u, 1u));
  EXPECT_EQ(spills.spills, 1u);
  EXPECT_EQ(spills.retries, 1u);
  EXPECT_EQ(spills.nodes[0].refused, 1u);
  EXPECT_EQ(spills.total.wait_ms.max, 200);
  EXPECT_EQ(spills.total.evictions, 0u);
}

TEST(ClusterReplay, BoundedLoadMakesASecondNodeLoadAModelWhoseLoadIsSlow) {
  const std::string a = OwnedBy(TwoNodes(), 0);
  // A 1e9-byte model: a load takes 100 + 1000 ms. Three requests at 0, 10,
  // 20 ms, all cold. With hash-balance-factor 150 (n1: c = 0, e = 16; n2:
  // c = 16; T = 32):
  //   P = 0: tot = (1 * 150 + 99) / 100 = 2, n1 has 16*2/32 = 1 slot: n1.
  //   P = 1: tot = 3, n1 has 16*3/32 = 1 slot and 1 in flight: the walk
  //          goes on to n2 (3 - 1 = 2 slots), which loads a too.
  //   P = 2: tot = 5, n1 has 16*5/32 = 2 slots: n1, joining its load.
  Trace trace = MakeTrace({a}, {1'000'000'000}, {{0, 0}, {10, 0}, {20, 0}});
  ClusterResult bl =
      SimulateCluster(trace, "lru", 2 * kGiB, Cluster("chash-bl:150"), Timed());
  EXPECT_THAT(Loads(bl), ElementsAre(1u, 1u));
  EXPECT_EQ(bl.copies[0], 2u);
  EXPECT_EQ(bl.nodes[0].requests, 2u);
  EXPECT_EQ(bl.nodes[0].peak_in_flight, 2u);
  // Waits 1100 (n1's load), 1100 (n2's, from 10), 1080 (joined n1's).
  EXPECT_EQ(bl.total.wait_ms.max, 1100);
  EXPECT_EQ(bl.total.wait_ms.p50, 1100);

  ClusterResult plain =
      SimulateCluster(trace, "lru", 2 * kGiB, Cluster("chash"), Timed());
  EXPECT_THAT(Loads(plain), ElementsAre(1u, 0u));
  EXPECT_EQ(plain.copies[0], 1u);
  EXPECT_EQ(plain.total.wait_ms.p50, 1090);
}

TEST(ClusterReplay, ANodeThatJoinsIsColdAndTakesItsModelsBack) {
  const std::string a = OwnedBy(TwoNodes(), 0), b = OwnedBy(TwoNodes(), 1);
  // n2 is down until 1000 (its first event is a join): b@0 goes to n1.
  // After the join b is n2's again, and n2 loads it.
  Trace trace = MakeTrace({a, b}, {100'000'000, 100'000'000},
                          {{0, 1}, {500, 0}, {2000, 1}, {3000, 0}});
  ClusterOptions options = Cluster("chash");
  options.events = {ParseClusterEvent("join:n2@1s")};
  ClusterResult r = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_THAT(Loads(r), ElementsAre(2u, 1u));
  EXPECT_EQ(r.copies[1], 2u);
  EXPECT_EQ(r.copies[0], 1u);
  // The owners at the start: n2 was down.
  EXPECT_THAT(r.owners, ElementsAre(0u, 0u));
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_THAT(r.events[0].moved, ElementsAre(1u));
  EXPECT_EQ(r.events[0].loads_after, 1u);
  EXPECT_EQ(r.nodes[1].requests, 1u);
}

TEST(ClusterReplay, ClosedLoopClientsWaitForASlot) {
  // One client: a@0 loads (0..200) and is served 1 s; the next two, due at
  // 0, are sent at 1200 and 2200.
  Trace trace = MakeTrace({"m0"}, {100'000'000},
                          {{0, 0, 1000}, {0, 0, 1000}, {0, 0, 1000}});
  ClusterOptions options = Cluster("roundrobin", {{"n1", 1, 1, false}});
  options.concurrency = 1;
  ClusterResult r = SimulateCluster(trace, "lru", kGiB, options, Timed());
  EXPECT_EQ(r.client_waited, 2u);
  EXPECT_EQ(r.client_wait_ms.max, 2200);
  EXPECT_EQ(r.client_wait_ms.p50, 1200);
  EXPECT_EQ(r.total.wait_ms.max, 200);
  EXPECT_EQ(r.total.hits, 2u);
  EXPECT_EQ(r.peak_in_flight, 1u);
}

// Every `step`-th request of the trace's first `step` x `n`: hours of the
// trace (keep-alive's unloads and prewarms happen) in few requests.
Trace Thin(const Trace& trace, size_t step, size_t n) {
  Trace thin = trace;
  thin.requests.clear();
  thin.hold_ms.clear();
  for (size_t i = 0; i < trace.requests.size() && thin.requests.size() < n;
       i += step) {
    thin.requests.push_back(trace.requests[i]);
    if (!trace.hold_ms.empty()) thin.hold_ms.push_back(trace.hold_ms[i]);
  }
  return thin;
}

TEST(ClusterReplay, OneNodeIsTheSingleNodeReplay) {
  const std::string azure = std::string(MODELCACHE_SHARED_DATA) +
                            "/traces/azure-functions-2019-100fn.csv";
  AzureOptions with_durations;
  with_durations.durations_path =
      std::string(MODELCACHE_SHARED_DATA) +
      "/traces/azure-functions-2019-100fn-durations.csv";
  const std::vector<std::pair<Trace, uint64_t>> workloads = {
      {Thin(GenerateDefaultTrace(42), 8, 6'000), 24 * kGiB},
      {Thin(ReadAzureFunctionsTrace(azure, with_durations), 8, 6'000),
       32 * kGiB}};
  for (const auto& [trace, capacity] : workloads) {
    for (const std::string policy :
         {"lru", "gdsf", "faascache", "ttl-10m", "next-use", "hybrid-histogram",
          "next-use-prewarm"}) {
      for (const double max_wait :
           {std::numeric_limits<double>::infinity(), 2000.0}) {
        SimulateOptions options = Timed();
        options.time = TimeModel{};  // the default load path
        options.max_wait_ms = max_wait;
        const RunResult one = Simulate(trace, policy, capacity, options);
        // Short enough for the sanitizers, long enough that every policy
        // evicts, requests wait, some give up under the limit, and the
        // keep-alive policies prewarm.
        EXPECT_GT(one.evictions, 0u) << policy;
        EXPECT_GT(one.wait_ms.p99, 0) << policy;
        if (max_wait < 1e9) {
          EXPECT_GT(one.rejected, 0u) << policy;
        }
        if (policy.find("prewarm") != std::string::npos ||
            policy == "hybrid-histogram") {
          EXPECT_GT(one.prewarms, 0u) << policy;
        }
        for (const std::string route : {"chash-bl:150", "leastconn"}) {
          SCOPED_TRACE(policy + " " + route + " " + std::to_string(max_wait));
          ClusterOptions cluster = Cluster(route, {{"solo", 7, 100, false}});
          const ClusterResult r =
              SimulateCluster(trace, policy, capacity, cluster, options);
          ExpectSameResult(r.total, one);
          ExpectSameResult(r.nodes[0].detail, one);
          EXPECT_EQ(r.nodes[0].request_share, 1);
        }
      }
    }
  }
}

// ---- bad input ----

TEST(ClusterReplay, BadOptionsAreClearErrors) {
  Trace trace = MakeTrace({"m0"}, {100}, {{0, 0}, {60'000, 0}});
  const auto error = [&](ClusterOptions options,
                         const std::string& policy = "lru") {
    try {
      SimulateCluster(trace, policy, kGiB, options, Timed());
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ClusterOptions options = Cluster("chash");
  EXPECT_THAT(error(options, "belady"), HasSubstr("'belady'"));
  options.events = {ParseClusterEvent("kill:n3@1s")};
  EXPECT_THAT(error(options), HasSubstr("no node named 'n3'"));
  options.events = {ParseClusterEvent("kill:n2@2m")};
  EXPECT_THAT(error(options), HasSubstr("outside the trace"));
  options.events = {ParseClusterEvent("kill:n2@1m")};  // its last request
  EXPECT_EQ(error(options), "no error");
  options.events = {ParseClusterEvent("kill:n2@10s"),
                    ParseClusterEvent("kill:n2@20s")};
  EXPECT_THAT(error(options), HasSubstr("already down"));
  options.events = {ParseClusterEvent("kill:n2@10s"),
                    ParseClusterEvent("join:n2@20s"),
                    ParseClusterEvent("join:n2@30s")};
  EXPECT_THAT(error(options), HasSubstr("already up"));
  options = Cluster("chash", {{"n1", 1, 1, false}, {"n1", 2, 1, false}});
  EXPECT_THAT(error(options), HasSubstr("'n1' is used twice"));
  options = Cluster("chash", {{"n1", 1, 1, false}, {"n2", 1, 1, false}});
  EXPECT_THAT(error(options), HasSubstr("server id 1"));
  options = Cluster("chash", {{"n1", 1, 257, false}});
  EXPECT_THAT(error(options), HasSubstr("weight 257"));
  for (const std::string bad :
       {"kill:n1", "stop:n1@1s", "kill:@1s", "kill:n1@soon", "n1@1s"}) {
    EXPECT_THROW(ParseClusterEvent(bad), Error) << bad;
  }
  const ClusterEvent e = ParseClusterEvent("join:n-2@1.5h");
  EXPECT_EQ(e.kind, ClusterEvent::Kind::kJoin);
  EXPECT_EQ(e.node, "n-2");
  EXPECT_EQ(e.at_ms, 5'400'000);
}

// ---- the command line ----

using Command = ::modelcache::testing::CommandResult;

Command RunCli(const std::string& args) {
  return ::modelcache::testing::RunShell(std::string(MODELCACHE_CLI) + " " +
                                         args);
}

using TraceFile = ::modelcache::testing::TempFile;

TEST(ClusterCli, BadInputExitsOneWithOneErrorLine) {
  TraceFile trace("t_ms,model,size_bytes\n0,a,100\n60000,b,100\n");
  const std::string run = "replay " + trace.path() + " --capacity 1KiB ";
  for (const auto& [flags, message] :
       std::vector<std::pair<std::string, std::string>>{
           {"--nodes n1:1:1,n1:2:1", "'n1' is used twice"},
           {"--nodes n1:1:1,n2:1:1", "server id 1"},
           {"--nodes n1:1:0", "weight 0"},
           {"--nodes n1:1:300", "weight 300"},
           {"--nodes 0", "--nodes"},
           {"--nodes 2 --route fastest", "unknown route"},
           {"--nodes 2 --route chash-bl:1x0", "not a whole number"},
           {"--nodes 2 --route chash-bl:50", "hash-balance-factor 50"},
           {"--nodes 2 --event kill:n3@1s", "no node named 'n3'"},
           {"--nodes 2 --event kill:n2@2m", "outside the trace"},
           {"--nodes 2 --event crash:n2@1s", "unknown kind"},
           {"--nodes 2 --no-time", "trace time"},
           {"--nodes 2 --stream", "reads the trace into memory"},
           {"--nodes 2 --policy belady", "'belady'"},
           {"--route chash", "need --nodes"}}) {
    const Command c = RunCli(run + flags);
    EXPECT_EQ(c.status, 1) << flags;
    EXPECT_EQ(c.out, "") << flags;
    EXPECT_THAT(c.err, StartsWith("error: ")) << flags;
    EXPECT_THAT(c.err, HasSubstr(message)) << flags;
    EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << c.err;
  }
}

TEST(ClusterCli, JsonCarriesWhatALiveClusterIsComparedWith) {
  TraceFile trace(
      "t_ms,model,size_bytes\n0,a,100\n10,b,100\n20,a,100\n30000,c,100\n"
      "60000,a,100\n");
  const Command c =
      RunCli("replay " + trace.path() +
             " --capacity 1KiB --nodes n1:1:100,n2:2:100 --route "
             "roundrobin,chash-bl:125 --event kill:n1@30s --json");
  ASSERT_EQ(c.status, 0) << c.err;
  const auto doc = nlohmann::json::parse(c.out);
  EXPECT_EQ(doc["cluster"]["nodes"].size(), 2u);
  ASSERT_EQ(doc["results"].size(), 2u);
  for (const auto& r : doc["results"]) {
    EXPECT_EQ(r["policy"], "next-use");
    EXPECT_EQ(r["requests"], 5);
    double share = 0;
    uint64_t loads = 0;
    for (const auto& n : r["nodes"]) {
      share += n["request_share"].get<double>();
      loads += n["loads"].get<uint64_t>();
    }
    EXPECT_DOUBLE_EQ(share, 1);
    EXPECT_EQ(loads, r["loads"].get<uint64_t>());
    EXPECT_TRUE(r["wait_ms"].contains("p99"));
    EXPECT_TRUE(r["copies"].contains("hottest"));
    EXPECT_EQ(r["copies"]["hottest"]["model"], "a");
    ASSERT_EQ(r["events"].size(), 1u);
    EXPECT_EQ(r["events"][0]["kind"], "kill");
  }
  EXPECT_TRUE(doc["results"][0]["owners"].is_null());
  const auto& owners = doc["results"][1]["owners"];
  EXPECT_EQ(owners.size(), 3u);
  EXPECT_TRUE(owners["a"] == "n1" || owners["a"] == "n2");
  // The moved set of the kill is n1's models.
  for (const auto& m : doc["results"][1]["events"][0]["moved"]) {
    EXPECT_EQ(owners[m.get<std::string>()], "n1");
  }
}

// A request too large for a node is unserved: the row says so in its
// `unserved` column and its flag, and the JSON keeps the count, so a cluster
// row never reads as a perfect result while it served nothing.
TEST(ClusterCli, ARequestNoNodeCanServeIsFlaggedUnserved) {
  TraceFile trace("t_ms,model,size_bytes\n0,big,5000\n10,a,100\n");
  const std::string run =
      "replay " + trace.path() + " --capacity 1KiB --nodes 2 --route chash";
  const Command table = RunCli(run);
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("unserved"));
  EXPECT_THAT(table.out, HasSubstr("waits are over the requests served"));
  EXPECT_THAT(table.out, HasSubstr("50.00%"));
  EXPECT_THAT(table.out, HasSubstr("  UNSERVED"));
  const Command json = RunCli(run + " --json");
  ASSERT_EQ(json.status, 0) << json.err;
  const auto doc = nlohmann::json::parse(json.out);
  ASSERT_EQ(doc["results"].size(), 1u);
  EXPECT_EQ(doc["results"][0]["too_large"], 1);
  EXPECT_EQ(doc["results"][0]["unserved"], 1);
  EXPECT_DOUBLE_EQ(doc["results"][0]["unserved_ratio"].get<double>(), 0.5);
}

TEST(ClusterCli, TableAndReportShowEveryRoute) {
  TraceFile trace("t_ms,model,size_bytes\n0,a,100\n10,b,100\n20,a,100\n");
  const std::string report = ::testing::TempDir() + "/cluster_report." +
                             std::to_string(getpid()) + ".html";
  const Command c = RunCli("replay " + trace.path() +
                           " --capacity 1KiB --nodes 3 --report " + report);
  ASSERT_EQ(c.status, 0) << c.err;
  std::ifstream in(report);
  const std::string html((std::istreambuf_iterator<char>(in)), {});
  std::remove(report.c_str());
  for (const std::string route : {"roundrobin", "random", "p2c", "leastconn",
                                  "chash", "chash-bl:150", "chash-map"}) {
    EXPECT_THAT(c.out, HasSubstr(route + " ")) << route;
    EXPECT_THAT(html, HasSubstr(">" + route + "<")) << route;
  }
  EXPECT_THAT(html, HasSubstr("Loads per route"));
  EXPECT_THAT(html, HasSubstr("p99 wait per route"));
  EXPECT_EQ(html.find("<script"), std::string::npos);
  // The heading is the command; the trace's path goes below it.
  EXPECT_THAT(html, HasSubstr("<h1>modelcache replay --nodes</h1>\n"
                              "<p class=\"trace\">" +
                              trace.path() + "</p>"));
  // Charts take the page's width: sized by their viewBox alone.
  EXPECT_THAT(html, HasSubstr("<svg xmlns=\"http://www.w3.org/2000/svg\" "
                              "viewBox=\"0 0 1080 "));
  EXPECT_EQ(html.find("<svg xmlns=\"http://www.w3.org/2000/svg\" width="),
            std::string::npos);
}

// The bar chart's y axis ends on a round tick, with round steps.
TEST(ClusterCli, ReportTicksAreRound) {
  std::string csv = "t_ms,model,size_bytes\n";
  // 2187 loads, as a number whose quarters are not round.
  for (int i = 0; i < 2187; ++i) {
    csv += std::to_string(i * 10) + ",m" + std::to_string(i) + ",100\n";
  }
  TraceFile trace(csv);
  const std::string report = ::testing::TempDir() + "/cluster_ticks." +
                             std::to_string(getpid()) + ".html";
  const Command c = RunCli("replay " + trace.path() +
                           " --capacity 1KiB --nodes 3 --route roundrobin "
                           "--report " +
                           report);
  ASSERT_EQ(c.status, 0) << c.err;
  std::ifstream in(report);
  const std::string html((std::istreambuf_iterator<char>(in)), {});
  std::remove(report.c_str());
  const size_t loads = html.find("Loads per route");
  ASSERT_NE(loads, std::string::npos);
  const std::string chart =
      html.substr(loads, html.find("</svg>", loads) - loads);
  std::vector<int> values;
  const std::string tick = "text-anchor=\"end\" class=\"tick\">";
  for (size_t at = chart.find(tick); at != std::string::npos;
       at = chart.find(tick, at + 1)) {
    const size_t begin = at + tick.size();
    values.push_back(
        std::stoi(chart.substr(begin, chart.find('<', begin) - begin)));
  }
  // 0, 500, 1000, 1500, 2000, 2500: not 546.75, 1093.5, ...
  EXPECT_THAT(values, ::testing::ElementsAre(0, 500, 1000, 1500, 2000, 2500));
}

}  // namespace
}  // namespace modelcache::replay
