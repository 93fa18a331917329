// Delegated leases, tested with a real daemon and real client processes
// (serve_test_worker): a process maps a copy once and reuses it locally; a
// lease no reference uses is kept idle and told to the daemon, which counts
// its copy as evictable and recalls it when the store picks it as a victim;
// the recall meets a local revival either way round; a client that ignores
// recalls is waited on for the recall timeout only; kills, forks and
// restarts drop delegations. Every wait is on a reply, a pipe or the daemon's
// books (Eventually), never a sleep.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/serve/client.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

using ::testing::HasSubstr;

// A worker that keeps idle leases and tells the daemon at once.
constexpr const char* kDelegating = " reuse=1 keep_idle_ms=600000 notice_us=0";

class DelegationTest : public ServeTest {
 protected:
  double Idle() {
    return daemon_->Metric("modelcache_delegated_leases{use=\"idle\"}");
  }
  double InUse() {
    return daemon_->Metric("modelcache_delegated_leases{use=\"in_use\"}");
  }
  double Recalls(const std::string& answer) {
    return daemon_->Metric("modelcache_recalls_total{answer=\"" + answer +
                           "\"}");
  }
  // Makes `worker` hold an idle delegation of `model`, the daemon told;
  // returns its lease.
  std::string HoldIdle(Worker& worker, const std::string& model) {
    const std::string lease = worker.Ok("acquire " + model)[0];
    leases_.Add(lease);
    worker.Ok("release " + model);
    Eventually([&] { return Idle() >= 1; }, "an idle delegation");
    return lease;
  }
  // A worker connected with `settings` (serve_test_worker's connect).
  std::unique_ptr<Worker> Connected(const std::string& settings = kDelegating) {
    auto worker = std::make_unique<Worker>();
    const std::string r = worker->Do("connect " + daemon_->socket() + settings);
    EXPECT_EQ(r, "ok");
    return worker;
  }
};

TEST_F(DelegationTest, AProcessMapsACopyOnceAndReusesItLocally) {
  AddModel("m", 256 * kKiB, 1);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::vector<std::string> first = worker->Ok("acquire m");
  const std::vector<std::string> second = worker->Ok("acquire m");
  leases_.Add(first[0]);
  EXPECT_EQ(second[0], first[0]) << "the same lease: one per process";
  EXPECT_EQ(second[1], std::to_string(checksums_["m"]));
  EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
            std::vector<std::string>{"1"})
      << "mapped once";
  EXPECT_EQ(d.Model("m")["leases"].size(), 1u);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"loaded\"}") +
                d.Metric("modelcache_acquires_total{result=\"hit\"}"),
            1)
      << "the second acquire never reached the daemon";
}

TEST_F(DelegationTest, AnIdleLeaseIsToldToTheDaemonAndRevivedLocally) {
  AddModel("m", 256 * kKiB, 2);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::string lease = worker->Ok("acquire m")[0];
  leases_.Add(lease);
  worker->Ok("release m");
  EXPECT_EQ(worker->Ok("idle"), std::vector<std::string>{"1"});
  Eventually([&] { return Idle() == 1; }, "the daemon hears the lease is idle");
  EXPECT_EQ(d.Model("m")["leases"][0]["use"], "idle");
  EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
            std::vector<std::string>{"1"})
      << "an idle lease stays mapped";
  const std::vector<std::string> again = worker->Ok("acquire m");
  EXPECT_EQ(again[0], lease) << "revived, not acquired again";
  EXPECT_EQ(again[1], std::to_string(checksums_["m"]));
  Eventually([&] { return InUse() == 1 && Idle() == 0; },
             "the daemon hears it is in use again");
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 0);
}

// Three processes each keep a model idle; a fourth model needs the room of
// all three: the daemon recalls each, each unmaps and releases, and the load
// goes on.
TEST_F(DelegationTest, AFullBudgetIsMadeGoodByRecallingFromThreeClients) {
  for (const char* id : {"a", "b", "c"}) {
    AddModel(id, 1 * kMiB, static_cast<uint64_t>(id[0]));
  }
  AddModel("big", 3 * kMiB, 9);
  Daemon& d = StartDaemon("3600KiB");
  std::vector<std::unique_ptr<Worker>> workers;
  for (const char* id : {"a", "b", "c"}) {
    workers.push_back(Connected());
    leases_.Add(workers.back()->Ok(std::string("acquire ") + id)[0]);
    workers.back()->Ok(std::string("release ") + id);
  }
  Eventually([&] { return Idle() == 3; }, "three idle delegations");
  Client client = Client::Connect(d.socket());
  RemoteWeights big = client.Acquire("big", std::chrono::seconds(60));
  leases_.Add(std::to_string(big.lease()));
  EXPECT_EQ(Checksum(big.files()[0].data()), checksums_["big"]);
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 3);
  EXPECT_EQ(Recalls("release"), 3);
  EXPECT_EQ(Recalls("busy") + Recalls("unanswered"), 0);
  for (auto& worker : workers) {
    EXPECT_EQ(worker->Ok("idle"), std::vector<std::string>{"0"});
    EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
              std::vector<std::string>{"0"})
        << "a recalled copy is unmapped before its release";
  }
  ExpectWithinBudget(d);
  ExpectBooksCoverMaps(d);
}

// A request under when_full "fail" that only a recall can serve waits for
// the recall's answer rather than failing at once.
TEST_F(DelegationTest, AFailAtOnceRequestIsServedByARecall) {
  AddModel("m", 1 * kMiB, 3);
  AddModel("n", 1 * kMiB, 4);
  Daemon& d = StartDaemon("1500KiB");
  auto worker = Connected();
  HoldIdle(*worker, "m");
  Client client = Client::Connect(d.socket());
  RemoteAcquireOptions fail;
  fail.when_full = WhenFull::kFail;
  RemoteWeights n = client.Acquire("n", fail);
  leases_.Add(std::to_string(n.lease()));
  EXPECT_EQ(Checksum(n.files()[0].data()), checksums_["n"]);
  EXPECT_EQ(Recalls("release"), 1);
}

// The recall reaches the worker, which revives the lease before it handles
// the recall: it answers "busy", its copy stays, and the request that wanted
// the room fails naming it.
TEST_F(DelegationTest, ARecallThatMeetsALocalRevivalIsAnsweredBusy) {
  AddModel("m", 1 * kMiB, 5);
  AddModel("n", 1 * kMiB, 6);
  // A long recall timeout: the order of events, not the clock, decides.
  Daemon& d = StartDaemon("1500KiB", {"--recall-timeout", "120s"});
  auto worker = Connected(std::string(kDelegating) + " recall_gate=1");
  const std::string lease = HoldIdle(*worker, "m");
  Client client = Client::Connect(d.socket());
  auto wanted = std::async(std::launch::async, [&] {
    RemoteAcquireOptions fail;
    fail.when_full = WhenFull::kFail;
    try {
      client.Acquire("n", fail);
      return std::string("served");
    } catch (const ServeError& e) {
      return std::string(ServeCodeName(e.serve_code())) + ": " + e.what();
    }
  });
  EXPECT_EQ(worker->Ok("recall-wait"), std::vector<std::string>{lease});
  const std::vector<std::string> revived = worker->Ok("acquire m");
  EXPECT_EQ(revived[0], lease);
  worker->Ok("recall-go");
  const std::string outcome = wanted.get();
  EXPECT_THAT(outcome, HasSubstr("CAPACITY"));
  EXPECT_THAT(outcome, HasSubstr("'m'"));
  EXPECT_EQ(Recalls("busy"), 1);
  EXPECT_EQ(Recalls("release"), 0);
  EXPECT_EQ(worker->Ok("checksum"),
            std::vector<std::string>{std::to_string(checksums_["m"])});
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1) << "'m' was never evicted";
}

// The other order: the worker handles the recall first (no reference: it
// unmaps and releases), and its next acquire is a round trip for a new lease.
TEST_F(DelegationTest,
       ARecallHandledBeforeTheRevivalReleasesAndTheRevivalAcquiresAfresh) {
  AddModel("m", 1 * kMiB, 7);
  AddModel("n", 1 * kMiB, 8);
  Daemon& d = StartDaemon("1500KiB", {"--recall-timeout", "120s"});
  auto worker = Connected(std::string(kDelegating) + " recall_gate=1");
  const std::string lease = HoldIdle(*worker, "m");
  Client client = Client::Connect(d.socket());
  auto wanted = std::async(std::launch::async, [&] {
    return client.Acquire("n", std::chrono::seconds(60));
  });
  EXPECT_EQ(worker->Ok("recall-wait"), std::vector<std::string>{lease});
  worker->Ok("recall-go");
  RemoteWeights n = wanted.get();
  leases_.Add(std::to_string(n.lease()));
  EXPECT_EQ(Recalls("release"), 1);
  EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
            std::vector<std::string>{"0"});
  n.Release();
  const std::vector<std::string> fresh = worker->Ok("acquire m");
  EXPECT_NE(fresh[0], lease) << "a new lease";
  leases_.Add(fresh[0]);
  EXPECT_EQ(fresh[1], std::to_string(checksums_["m"]));
}

// A raw client that says "idle" and never answers the recall: the daemon
// takes it as in use after the recall timeout and serves the others.
TEST_F(DelegationTest, AClientThatIgnoresRecallsIsTakenToUseItsLease) {
  AddModel("m", 1 * kMiB, 10);
  AddModel("n", 1 * kMiB, 11);
  Daemon& d = StartDaemon("1500KiB", {"--recall-timeout", "50ms"});
  Raw raw(d.socket());
  ASSERT_TRUE(raw.Send(protocol::EncodeHello(1)));
  ASSERT_TRUE(raw.Receive());
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(2, "m", 60000, false)));
  std::optional<detail::Datagram> granted = raw.Receive();
  ASSERT_TRUE(granted);
  const protocol::ParsedReply reply = protocol::ParseReply(granted->bytes);
  ASSERT_TRUE(reply.reply && reply.reply->ok) << granted->bytes;
  const uint64_t lease = reply.reply->lease;
  leases_.Add(std::to_string(lease));
  ASSERT_TRUE(raw.Send(protocol::EncodeIdle(3, lease)));
  ASSERT_TRUE(raw.Receive());  // ok
  Client client = Client::Connect(d.socket());
  RemoteAcquireOptions fail;
  fail.when_full = WhenFull::kFail;
  try {
    client.Acquire("n", fail);
    ADD_FAILURE()
        << "served while 'm' is held by a client that ignores recalls";
  } catch (const ServeError& e) {
    EXPECT_EQ(e.serve_code(), ServeCode::kCapacity) << e.what();
  }
  std::optional<detail::Datagram> recall = raw.Receive();
  ASSERT_TRUE(recall);
  const protocol::ParsedReply parsed = protocol::ParseReply(recall->bytes);
  ASSERT_TRUE(parsed.reply);
  EXPECT_EQ(parsed.reply->recall, lease);
  EXPECT_EQ(Recalls("unanswered"), 1);
  EXPECT_EQ(d.Model("m")["leases"][0]["use"], "in_use");
  // Its answer comes late: the release still ends the lease.
  ASSERT_TRUE(raw.Send(protocol::EncodeRelease(4, lease)));
  ASSERT_TRUE(raw.Receive());
  EXPECT_EQ(d.Metric("modelcache_leases"), 0);
}

TEST_F(DelegationTest, ASigkilledClientsDelegationsAreFreedAtOnce) {
  AddModel("m", 1 * kMiB, 12);
  AddModel("n", 1 * kMiB, 13);
  Daemon& d = StartDaemon("1500KiB");
  auto worker = Connected();
  HoldIdle(*worker, "m");
  worker->process().Signal(SIGKILL);
  worker->process().Wait();
  Eventually([&] { return d.Metric("modelcache_leases") == 0; },
             "the dead client's delegation is freed");
  Client client = Client::Connect(d.socket());
  RemoteAcquireOptions fail;
  fail.when_full = WhenFull::kFail;
  RemoteWeights n = client.Acquire("n", fail);
  leases_.Add(std::to_string(n.lease()));
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 0);
}

// Close unmaps the idle leases before the daemon hears the connection end:
// the daemon reads the process's maps at that end, and would book a copy
// still mapped as orphaned until its next rescan (here an hour away, so
// that only the order can make this pass).
TEST_F(DelegationTest, CloseUnmapsIdleLeasesBeforeTheDaemonHearsTheEnd) {
  AddModel("m", 256 * kKiB, 14);
  Daemon& d = StartDaemon("1GiB", {"--orphan-rescan", "1h"});
  auto worker = Connected();
  HoldIdle(*worker, "m");
  worker->Ok("close");
  EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
            std::vector<std::string>{"0"});
  Eventually([&] { return d.Metric("modelcache_leases") == 0; },
             "the daemon ends the idle lease, with nothing orphaned");
  EXPECT_EQ(d.Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(d.Metric("modelcache_orphaned_leases"), 0);
}

// ThreadSanitizer cannot follow a child forked by a process with threads
// (the parent's keeper thread runs while it holds an idle lease): it stops
// the child when that starts one. The other builds run it.
#if defined(__SANITIZE_THREAD__)
#define MODELCACHE_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MODELCACHE_UNDER_TSAN 1
#endif
#endif

TEST_F(DelegationTest, AForkedChildGetsNoDelegation) {
#ifdef MODELCACHE_UNDER_TSAN
  GTEST_SKIP() << "ThreadSanitizer stops a child forked by a threaded parent";
#endif
  AddModel("m", 256 * kKiB, 14);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::string lease = worker->Ok("acquire m")[0];
  leases_.Add(lease);
  worker->Ok("release m");
  // fork PREFIX MODEL -> CHILD_MAPS CHILD_LEASE CHILD_SUM | parent sums
  const std::vector<std::string> forked =
      worker->Ok("fork " + d.memfd_prefix() + " m");
  ASSERT_GE(forked.size(), 3u);
  EXPECT_EQ(forked[0], "0") << "the child maps nothing of its parent's";
  EXPECT_NE(forked[1], lease) << "the child's acquire is a lease of its own";
  leases_.Add(forked[1]);
  EXPECT_EQ(forked[2], std::to_string(checksums_["m"]));
  const std::vector<std::string> parent = worker->Ok("acquire m");
  EXPECT_EQ(parent[0], lease) << "the parent's delegation is untouched";
}

TEST_F(DelegationTest,
       ADaemonRestartKeepsOrReplacesTheDelegationAndTheBytesStayRight) {
  AddModel("m", 256 * kKiB, 15);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::string lease = HoldIdle(*worker, "m");
  d.process().Signal(SIGTERM);
  d.process().Wait();
  // The daemon lists "reclaim": the client keeps the idle lease mapped for
  // its successor, which adopts it (or refuses it, and the client asks
  // afresh); either way the next acquire reads the model's bytes.
  d.Start();
  const std::vector<std::string> again = worker->Ok("acquire m");
  ASSERT_EQ(again.size(), 3u);
  if (again[0] != lease) leases_.Add(again[0]);
  EXPECT_EQ(again[1], std::to_string(checksums_["m"]));
}

// ---- Release causality (protocol.h): an acquire made after another
// process's release call returned finds that room. The order between the
// two processes is this test's: it reads the first worker's answer on its
// pipe (the call returned) before it writes the second worker's acquire.

// A delegating worker whose reference ended before its idle notice went
// (the daemon still counts the lease in use): the "fail" acquire recalls
// it, the worker answers "release", and the acquire is served.
TEST_F(DelegationTest, AFailAcquireFindsTheRoomOfAReleaseNotToldIdleYet) {
  AddModel("m", 1 * kMiB, 21);
  AddModel("n", 1 * kMiB, 22);
  // A long recall timeout: the answer, not the clock, serves the acquire.
  Daemon& d = StartDaemon("1500KiB", {"--recall-timeout", "120s"});
  auto a = Connected(" reuse=1 keep_idle_ms=600000 notice_us=10000000");
  auto b = Connected(" reuse=0 keep_idle_ms=0");
  leases_.Add(a->Ok("acquire m")[0]);
  a->Ok("release m");
  EXPECT_EQ(a->Ok("idle"), std::vector<std::string>{"1"});
  EXPECT_EQ(d.Model("m")["leases"][0]["use"], "in_use")
      << "no idle notice has gone";
  const std::vector<std::string> n = b->Ok("acquire n 60000 fail");
  ASSERT_EQ(n.size(), 3u);
  leases_.Add(n[0]);
  EXPECT_EQ(n[1], std::to_string(checksums_["n"]));
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 1);
  EXPECT_EQ(Recalls("release"), 1);
  EXPECT_EQ(a->Ok("idle"), std::vector<std::string>{"0"});
  EXPECT_EQ(a->Ok("maps " + d.memfd_prefix()), std::vector<std::string>{"0"})
      << "unmapped before its release";
  ExpectWithinBudget(d);
  ExpectBooksCoverMaps(d);
}

// Workers that do not delegate release leases while the daemon reads
// nothing: 8 of them 120 each, and one 101, 'm' last. Each call returns once
// its releases are on its socket. Then an acquire under "fail" is written on
// another connection (this test's own, so that it is surely on the socket
// before the daemon reads again). The daemon reads 16 datagrams of each
// connection each time round its loop, so it reads the acquire long before
// 'm''s release; it reads every socket to its end before it refuses, and the
// acquire is served.
TEST_F(DelegationTest, AReleaseOnTheSocketBeforeAFailAcquireIsReadFirst) {
  AddModel("s", 64 * kKiB, 23);
  AddModel("m", 1 * kMiB, 24);
  AddModel("n", 1 * kMiB, 25);
  Daemon& d = StartDaemon("1500KiB", {}, /*gate=*/false, /*pause_hook=*/true);
  // Each under its window of unanswered releases (max_queued_replies / 2):
  // they all go on the socket at once, in any build.
  std::vector<std::unique_ptr<Worker>> fillers;
  for (int i = 0; i < 8; ++i) {
    fillers.push_back(Connected(" reuse=0 keep_idle_ms=0"));
    EXPECT_EQ(fillers.back()->Ok("acquire-many s 120"),
              std::vector<std::string>{"120"});
  }
  auto a = Connected(" reuse=0 keep_idle_ms=0");
  EXPECT_EQ(a->Ok("acquire-many s 100"), std::vector<std::string>{"100"});
  leases_.Add(a->Ok("acquire m")[0]);
  Raw b(d.socket());
  ASSERT_TRUE(b.Send(protocol::EncodeHello(1)));
  ASSERT_TRUE(b.Receive());
  d.PauseReads();
  for (auto& filler : fillers) EXPECT_EQ(filler->Do("release-all"), "ok");
  EXPECT_EQ(a->Do("release-all"), "ok");  // in the order acquired: 'm' last
  ASSERT_TRUE(b.Send(protocol::EncodeAcquire(2, "n", 60000, true)));
  d.ResumeReads();
  std::optional<detail::Datagram> granted = b.Receive();
  ASSERT_TRUE(granted);
  const protocol::ParsedReply reply = protocol::ParseReply(granted->bytes);
  ASSERT_TRUE(reply.reply && reply.reply->ok) << granted->bytes;
  leases_.Add(std::to_string(reply.reply->lease));
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 0);
  ExpectWithinBudget(d);
}

// Room that even the recallable leases would not make: no recall goes out,
// and the delegating worker keeps its lease.
TEST_F(DelegationTest, AFailAcquireThatCannotBeServedRecallsNothing) {
  AddModel("m", 1 * kMiB, 26);
  AddModel("n", 1 * kMiB, 27);
  AddModel("big", 2 * kMiB, 28);
  Daemon& d = StartDaemon("2600KiB", {"--recall-timeout", "120s"});
  auto a = Connected(" reuse=1 keep_idle_ms=600000 notice_us=10000000");
  auto b = Connected(" reuse=0 keep_idle_ms=0");
  auto c = Connected(" reuse=0 keep_idle_ms=0");
  leases_.Add(a->Ok("acquire m")[0]);
  a->Ok("release m");
  leases_.Add(c->Ok("acquire n")[0]);  // held, by one that does not delegate
  const std::string refused = b->Do("acquire big 60000 fail");
  EXPECT_THAT(refused, HasSubstr("CAPACITY"));
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 0);
  EXPECT_EQ(a->Ok("idle"), std::vector<std::string>{"1"}) << "still warm";
  EXPECT_EQ(a->Ok("maps " + d.memfd_prefix()), std::vector<std::string>{"1"});
  EXPECT_EQ(d.Model("m")["leases"].size(), 1u);
}

// A holder still using its lease answers the recall "use": the acquire is
// refused with CAPACITY once that answer is in, not at the recall timeout.
TEST_F(DelegationTest, AFailAcquireRecallsALeaseInUseAndIsRefusedWhenBusy) {
  AddModel("m", 1 * kMiB, 29);
  AddModel("n", 1 * kMiB, 30);
  Daemon& d = StartDaemon("1500KiB", {"--recall-timeout", "120s"});
  auto a = Connected(" reuse=1 keep_idle_ms=600000 notice_us=10000000");
  auto b = Connected(" reuse=0 keep_idle_ms=0");
  leases_.Add(a->Ok("acquire m")[0]);  // and used
  const std::string refused = b->Do("acquire n 60000 fail");
  EXPECT_THAT(refused, HasSubstr("CAPACITY"));
  EXPECT_THAT(refused, HasSubstr("'m'"));
  EXPECT_EQ(d.Metric("modelcache_recalls_sent_total"), 1);
  EXPECT_EQ(Recalls("busy"), 1);
  EXPECT_EQ(Recalls("unanswered"), 0);
  EXPECT_EQ(a->Ok("checksum"),
            std::vector<std::string>{std::to_string(checksums_["m"])});
  EXPECT_EQ(d.Model("m")["leases"][0]["use"], "in_use");
}

// A stateful test of the protocol: random acquires, releases, recalls
// (forced by a fourth client's loads into a full budget) and kills, across
// three delegating workers; after every step the daemon's books cover every
// mapping, the budget holds, and every reference a worker holds reads its
// model's bytes.
TEST_F(DelegationTest, RandomAcquiresReleasesRecallsAndKillsKeepEveryPromise) {
  const std::vector<std::string> models = {"a", "b", "c", "d"};
  for (size_t i = 0; i < models.size(); ++i)
    AddModel(models[i], 1 * kMiB, 20 + i);
  Daemon& d = StartDaemon("2600KiB");
  std::mt19937 random(20261202);
  constexpr int kWorkers = 3;
  std::vector<std::unique_ptr<Worker>> workers;
  std::vector<std::vector<std::string>> held(kWorkers);  // models, in order
  std::vector<std::set<std::string>> seen(kWorkers);     // leases
  for (int i = 0; i < kWorkers; ++i) workers.push_back(Connected());
  Client pressure = Client::Connect(d.socket());
  int steps_served = 0;
  for (int step = 0; step < 60; ++step) {
    const int k = static_cast<int>(random() % kWorkers);
    const std::string& model = models[random() % models.size()];
    const int op = static_cast<int>(random() % 10);
    SCOPED_TRACE("step " + std::to_string(step) + " op " + std::to_string(op) +
                 " worker " + std::to_string(k) + " model " + model);
    if (op < 4) {  // acquire, failing at once when there is no room
      const std::string r = workers[k]->Do("acquire " + model + " 5000 fail");
      if (r.rfind("ok ", 0) == 0) {
        std::istringstream in(r.substr(3));
        std::string lease, sum;
        in >> lease >> sum;
        // A worker sees one lease again only when it reuses it locally.
        if (seen[k].insert(lease).second) leases_.Add(lease);
        EXPECT_EQ(sum, std::to_string(checksums_[model]));
        held[k].push_back(model);
        ++steps_served;
      } else {
        EXPECT_THAT(r, HasSubstr("CAPACITY"));
      }
    } else if (op < 7) {  // release the oldest reference held
      if (held[k].empty()) continue;
      workers[k]->Ok("release " + held[k].front());
      held[k].erase(held[k].begin());
    } else if (op < 9) {  // pressure: a load that may recall idle leases
      RemoteAcquireOptions fail;
      fail.when_full = WhenFull::kFail;
      fail.timeout = std::chrono::seconds(5);
      try {
        RemoteWeights w = pressure.Acquire(model, fail);
        if (w.load() != "local") leases_.Add(std::to_string(w.lease()));
        EXPECT_EQ(Checksum(w.files()[0].data()), checksums_[model]);
      } catch (const ServeError& e) {
        EXPECT_EQ(e.serve_code(), ServeCode::kCapacity) << e.what();
      }
    } else {  // kill and replace
      workers[k]->process().Signal(SIGKILL);
      workers[k]->process().Wait();
      workers[k] = Connected();
      held[k].clear();
      seen[k].clear();
    }
    // Every reference held still reads its model's bytes.
    for (int i = 0; i < kWorkers; ++i) {
      std::vector<std::string> sums;
      for (const std::string& m : held[i]) {
        sums.push_back(std::to_string(checksums_[m]));
      }
      EXPECT_EQ(workers[i]->Ok("checksum"), sums);
    }
    ExpectBooksCoverMaps(d);
    ExpectWithinBudget(d);
  }
  EXPECT_GT(steps_served, 0);
  RecordProperty("recalls_sent",
                 std::to_string(d.Metric("modelcache_recalls_sent_total")));
}

}  // namespace
}  // namespace modelcache::serve::testing
