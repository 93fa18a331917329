// Swap scheduling in `modelcache serve` (DaemonOptions::drain_after), tested
// with a real daemon and real client processes (serve_test_worker): a load
// that waits for room is overtaken by acquires of the models that hold it
// for at most --drain-after; then those models drain, the acquires of them
// queue, and the waiter gets the room once the leases out end. The load
// queue follows the same rule. A process that reuses a lease locally is
// told to stop when its copy drains (a recall saying "drain"), both ways
// round a local reuse, and one that does not answer is waited on as
// before. Every wait is on a reply, a pipe, a hook or the daemon's books
// (Eventually), never a sleep.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// "ok LEASE CHECKSUM BYTES" -> {LEASE, CHECKSUM, BYTES}.
std::vector<std::string> Words(const std::string& reply) {
  std::istringstream in(reply);
  std::vector<std::string> words;
  std::string word;
  in >> word;
  EXPECT_EQ(word, "ok") << reply;
  while (in >> word) words.push_back(word);
  return words;
}

// A process that reuses its lease locally: every acquire of a model it maps
// is a local reference, and a lease whose references ended is kept (and
// said idle only after a minute, so that the daemon counts it in use).
constexpr const char* kReusing =
    " reuse=1 keep_idle_ms=600000 notice_us=60000000";
// An idle delegation: a process that reuses locally, whose lease no
// reference uses any more, with the daemon told "idle" at once.
constexpr const char* kDelegatingIdle =
    " reuse=1 keep_idle_ms=600000 notice_us=0";

// A reply's first word after "ok" (Worker::Ok), or "" after a failure.
std::string First(const std::vector<std::string>& words) {
  return words.empty() ? "" : words[0];
}

class DrainTest : public ServeTest {
 protected:
  double Metric(const std::string& name) { return daemon_->Metric(name); }

  // Room for one of 'a' and 'b' (4 MiB each in 6 MiB): a load of one waits
  // for the other's room. `args`: the daemon's flags.
  Daemon& StartWithRoomForOne(std::vector<std::string> args = {"--drain-after",
                                                               "0"}) {
    AddModel("a", 4 * kMiB, 1);
    AddModel("b", 4 * kMiB, 2);
    return StartDaemon("6MiB", std::move(args));
  }

  void AwaitMetric(const std::string& name, double value,
                   const std::string& what) {
    Eventually([&] { return Metric(name) == value; }, what);
  }
  void AwaitMetricAtLeast(const std::string& name, double value,
                          const std::string& what) {
    Eventually([&] { return Metric(name) >= value; }, what);
  }

  // An acquire's reply that must be `model` served: its lease (booked), or
  // "" after a failure.
  std::string Served(const std::string& reply, const std::string& model) {
    const std::vector<std::string> words = Words(reply);
    if (words.size() != 3) {
      ADD_FAILURE() << "'" << model << "' not served: " << reply;
      return "";
    }
    leases_.Add(words[0]);
    EXPECT_EQ(words[1], std::to_string(checksums_[model])) << reply;
    return words[0];
  }

  // Connects `w` with the worker's `settings` and acquires 'a': its lease.
  std::string HoldA(Worker& w, const std::string& settings) {
    w.Ok("connect " + daemon_->socket() + settings);
    const std::string lease = First(w.Ok("acquire a"));
    leases_.Add(lease);
    return lease;
  }

  // `w` holds an idle delegation of 'a' (its recalls gated), the daemon
  // told; `other` holds 'a' in use, so that the copy drains rather than
  // being evicted. The delegation's lease.
  std::string IdleDelegationOfA(Worker& w, Worker& other) {
    const std::string lease =
        HoldA(w, std::string(kDelegatingIdle) + " recall_gate=1");
    w.Ok("release a");
    AwaitMetric("modelcache_delegated_leases{use=\"idle\"}", 1,
                "the daemon told the lease is idle");
    leases_.Add(First(other.Ok("acquire a")));
    return lease;
  }
};

// The starvation scenario across processes: room for one model, three
// processes keep 'a' in use with overlapping leases, a fourth asks for 'b'
// and waits. With --drain-after 0, 'a' drains at once: the next acquires
// of 'a' queue instead of overtaking, 'b' gets the room as soon as the last
// lease of 'a' out ends, and the queued acquires of 'a' are served after.
TEST_F(DrainTest, AWaiterForRoomIsServedWhileOtherProcessesKeepTheModelBusy) {
  Daemon& d = StartWithRoomForOne();
  Worker w1(d.socket());
  Worker w2(d.socket());
  Worker w3(d.socket());
  Worker wb(d.socket());
  leases_.Add(First(w1.Ok("acquire a")));
  EXPECT_EQ(Metric("modelcache_oldest_room_wait_seconds"), 0);

  wb.Send("acquire b 120000");
  AwaitMetricAtLeast("modelcache_drains_total", 1, "'a' draining for 'b'");
  EXPECT_GT(Metric("modelcache_oldest_room_wait_seconds"), 0)
      << "'b' waits for room";
  // A second process asks for 'a' while the first still holds it: it
  // queues behind the drain rather than overtaking 'b'.
  w2.Send("acquire a 120000");
  AwaitMetricAtLeast("modelcache_queued_behind_drain_total", 1,
                     "an acquire of 'a' queued behind its drain");
  w3.Send("acquire a 120000");
  AwaitMetric("modelcache_waiting_acquires", 3,
              "'b' and two acquires of 'a' waiting");
  EXPECT_EQ(d.Model("a")["leases"].size(), 1u) << "the drain took no lease";
  EXPECT_EQ(d.Model("a")["queued_behind_drain"], 1)
      << "one load of 'a' (both acquires' waits) queued behind its drain";
  EXPECT_EQ(d.Model("a")["draining"], true);
  EXPECT_THAT(d.Model("a")["drain_for"].get<std::string>(), HasSubstr("'b'"))
      << "/v1/models names whom 'a' drains for";
  EXPECT_EQ(d.Model("b")["drain_for"], nullptr);

  // The last lease of 'a' out ends: 'b' gets the room.
  w1.Ok("release a");
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 2)
      << "the acquires of 'a' wait for room in their turn";
  EXPECT_EQ(d.Model("a")["draining"], false) << "the drain ended with 'b'";

  // 'b' done: the acquires of 'a' go on.
  wb.Ok("release b");
  for (Worker* w : {&w2, &w3}) {
    ASSERT_NE(Served(w->Receive(), "a"), "");
    w->Ok("release a");
  }
  EXPECT_EQ(Metric("modelcache_acquires_total{result=\"timeout\"}"), 0);
}

// The holder of a draining copy is SIGKILLed: its lease ends with its
// process, which ends the drain's wait like a release, and the acquire of
// 'a' queued behind the drain is served after 'b'.
TEST_F(DrainTest, ASigkilledHolderOfADrainingCopyEndsItsLease) {
  Daemon& d = StartWithRoomForOne();
  Worker holder(d.socket());
  Worker next(d.socket());
  Worker wb(d.socket());
  leases_.Add(First(holder.Ok("acquire a")));
  wb.Send("acquire b 120000");
  AwaitMetricAtLeast("modelcache_drains_total", 1, "'a' draining for 'b'");
  next.Send("acquire a 120000");
  AwaitMetricAtLeast("modelcache_queued_behind_drain_total", 1,
                     "an acquire of 'a' queued behind its drain");
  holder.process().Signal(SIGKILL);
  holder.process().Wait();
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  wb.Ok("release b");
  ASSERT_NE(Served(next.Receive(), "a"), "");
  next.Ok("release a");
}

// --drain-after inf keeps the rule of before: models in use never drain,
// acquires of them overtake the waiter, which waits to its deadline.
TEST_F(DrainTest, DrainAfterInfLetsTheBusyModelOvertakeTheWaiterForEver) {
  Daemon& d = StartWithRoomForOne({"--drain-after", "inf"});
  Worker w1(d.socket());
  Worker w2(d.socket());
  Worker wb(d.socket());
  leases_.Add(First(w1.Ok("acquire a")));
  wb.Send("acquire b 5000");
  Eventually([&] { return Metric("modelcache_oldest_room_wait_seconds") > 0; },
             "'b' waiting for room");
  leases_.Add(First(w2.Ok("acquire a 5000")));  // a hit, at once
  w1.Ok("release a");
  EXPECT_THAT(wb.Receive(), StartsWith("error TIMEOUT"));
  EXPECT_EQ(Metric("modelcache_drains_total"), 0);
  w2.Ok("release a");
}

// A copy held by an orphaned lease (its connection closed, its process
// still mapping it) counts as pinned: no drain takes it, so the waiter
// waits to its deadline as for pinned room, and acquires of it stay hits.
TEST_F(DrainTest, ACopyHeldByAnOrphanIsNeverDrained) {
  Daemon& d = StartWithRoomForOne();
  Worker orphan(d.socket());
  leases_.Add(First(orphan.Ok("acquire a")));
  orphan.Ok("close");  // the socket goes, the mapping stays
  AwaitMetric("modelcache_orphaned_leases", 1, "the lease orphaned");
  Worker wb(d.socket());
  EXPECT_THAT(wb.Do("acquire b 1000"), StartsWith("error TIMEOUT"));
  EXPECT_EQ(Metric("modelcache_drains_total"), 0);
  Worker w(d.socket());
  leases_.Add(First(w.Ok("acquire a")));
  EXPECT_EQ(Metric("modelcache_acquires_total{result=\"hit\"}"), 1);
  w.Ok("release a");
  orphan.Ok("release-all");
}

// ---- local reuse (protocol.h, "Drains") ----

// The starvation scenario through local reuse: one process keeps 'a' busy
// with references of its own lease, never asking the daemon; another waits
// for room. The drain tells the first to stop, so its lease ends with the
// reference under way and the waiter is served within the bound (here 5 s
// for microseconds of references and a load); the busy process's next
// acquires queue at the daemon and are served after.
TEST_F(DrainTest, AWaiterIsServedWhileAnotherProcessReusesTheModelLocally) {
  Daemon& d = StartWithRoomForOne();
  Worker busy;
  busy.Ok("connect " + d.socket() + kReusing);
  busy.Ok("cycle-start 120000 a");
  busy.Ok("cycle-wait 3");  // its lease is local now
  Worker wb(d.socket());
  ASSERT_NE(Served(wb.Do("acquire b 5000"), "b"), "");
  wb.Ok("release b");
  busy.Ok("cycle-wait 3");  // 'a' again, from the daemon
  const std::vector<std::string> done = busy.Ok("cycle-stop");
  ASSERT_GE(done.size(), 3u);
  EXPECT_EQ(done[1], "0") << "no acquire of 'a' failed";
  EXPECT_EQ(done[2], "a=" + std::to_string(checksums_["a"]));
  EXPECT_GE(Metric("modelcache_recalls_total{answer=\"release\"}") +
                Metric("modelcache_recalls_total{answer=\"busy\"}"),
            1);
}

// The drain's recall is read before a local reuse: the reuse finds nothing
// local (the copy lends no more), and the acquire goes to the daemon,
// where it queues behind the drain (which still waits for another
// process's lease) and is served after the waiter.
TEST_F(DrainTest, ADrainReadBeforeALocalReuseSendsTheReuseToTheDaemon) {
  Daemon& d = StartWithRoomForOne();
  Worker w;
  const std::string lease = HoldA(w, std::string(kReusing) + " recall_gate=1");
  Worker other(d.socket());
  leases_.Add(First(other.Ok("acquire a")));
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(First(w.Ok("recall-wait")), lease) << "the drain recalls it";
  w.Ok("recall-go");
  AwaitMetric("modelcache_recalls_total{answer=\"busy\"}", 1,
              "the recall answered: in use");
  EXPECT_EQ(First(w.Ok("acquire-local a")), "none") << "it lends no more";
  w.Ok("release a");  // the last reference: the lease ends
  w.Send("acquire a 120000");
  AwaitMetricAtLeast(
      "modelcache_queued_behind_drain_total", 1,
      "the acquire of 'a' queued behind its drain at the daemon");
  other.Ok("release a");
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  wb.Ok("release b");
  EXPECT_NE(Served(w.Receive(), "a"), lease)
      << "a lease of its own, from the daemon";
  w.Ok("release a");
}

// A local reuse made before the drain's recall is read: the reference
// counts as a lease out, and the drain waits for it to end as for any.
TEST_F(DrainTest, ALocalReuseBeforeTheDrainIsReadIsALeaseOutThatItWaitsFor) {
  Daemon& d = StartWithRoomForOne();
  Worker w;
  const std::string lease = HoldA(w, std::string(kReusing) + " recall_gate=1");
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(First(w.Ok("recall-wait")), lease);  // held in the hook, unread
  EXPECT_EQ(First(w.Ok("acquire-local a")), lease)
      << "reused before the recall";
  w.Ok("recall-go");
  AwaitMetric("modelcache_recalls_total{answer=\"busy\"}", 1,
              "the recall answered: in use");
  w.Ok("release a");  // one reference of two
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 1) << "'b' still waits";
  EXPECT_EQ(d.Model("a")["leases"].size(), 1u);
  w.Ok("release a");  // the last: released, and 'b' gets the room
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  wb.Ok("release b");
}

// The drain's recall of an idle delegation (another process keeps the copy
// in use, so it drains rather than being evicted) is read before a local
// revival: no reference uses the lease, so it is released at once, the
// revival finds nothing local, and the acquire goes to the daemon, where it
// queues behind the drain and is served after the waiter.
TEST_F(DrainTest, ADrainReadBeforeAnIdleLeaseIsRevivedReleasesIt) {
  Daemon& d = StartWithRoomForOne();
  Worker w;
  Worker other(d.socket());
  const std::string lease = IdleDelegationOfA(w, other);
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(First(w.Ok("recall-wait")), lease) << "the drain recalls it, idle";
  w.Ok("recall-go");
  AwaitMetric("modelcache_recalls_total{answer=\"release\"}", 1,
              "the recall answered: released");
  EXPECT_EQ(w.Ok("idle"), std::vector<std::string>{"0"});
  EXPECT_EQ(First(w.Ok("acquire-local a")), "none") << "nothing left to revive";
  w.Send("acquire a 120000");
  AwaitMetricAtLeast(
      "modelcache_queued_behind_drain_total", 1,
      "the acquire of 'a' queued behind its drain at the daemon");
  other.Ok("release a");
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  wb.Ok("release b");
  EXPECT_NE(Served(w.Receive(), "a"), lease)
      << "a lease of its own, from the daemon";
  w.Ok("release a");
}

// An idle delegation revived locally before the drain's recall is read:
// the recall is answered "use", the revived reference is a lease out that
// the drain waits for (the copy it maps is not freed when the other
// process's lease ends), no new local reference is taken once the recall
// is read, and the reference's end releases the lease: the waiter is
// served.
TEST_F(DrainTest, AnIdleLeaseRevivedBeforeTheDrainIsReadIsALeaseOutToWaitFor) {
  Daemon& d = StartWithRoomForOne();
  Worker w;
  Worker other(d.socket());
  const std::string lease = IdleDelegationOfA(w, other);
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(First(w.Ok("recall-wait")), lease);  // held in the hook, unread
  EXPECT_EQ(First(w.Ok("acquire-local a")), lease)
      << "revived before the recall";
  w.Ok("recall-open");  // this recall and any later one are answered
  AwaitMetricAtLeast("modelcache_recalls_total{answer=\"busy\"}", 1,
                     "the recall answered: in use");
  EXPECT_EQ(First(w.Ok("acquire-local a")), "none")
      << "no new local reference once the drain is read";
  other.Ok("release a");
  AwaitMetricAtLeast(
      "modelcache_refused_unloads_total", 1,
      "the drained copy's unload refused: the revived lease maps it");
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 1) << "'b' still waits";
  EXPECT_EQ(d.Model("a")["leases"].size(), 1u);
  w.Ok("release a");  // the last reference: released, not kept idle
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  EXPECT_EQ(w.Ok("idle"), std::vector<std::string>{"0"});
  wb.Ok("release b");
}

// A client that does not answer the drain's recall (its hook holds it): the
// recall timeout takes it as busy, as any recall, and the drain waits for
// its lease to end as before.
TEST_F(DrainTest, AClientThatNeverAnswersADrainIsTreatedAsBefore) {
  Daemon& d =
      StartWithRoomForOne({"--drain-after", "0", "--recall-timeout", "50ms"});
  Worker w;
  const std::string lease = HoldA(w, std::string(kReusing) + " recall_gate=1");
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(First(w.Ok("recall-wait")), lease);  // never answered
  AwaitMetric("modelcache_recalls_total{answer=\"unanswered\"}", 1,
              "the recall timed out");
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 1) << "'b' still waits";
  // (The hook holds the client's reading thread, which its release needs.)
  w.Ok("recall-go");
  w.Ok("release a");
  ASSERT_NE(Served(wb.Receive(), "b"), "");
  wb.Ok("release b");
}

// The load queue: with one load slot, a load queued before another of a
// higher catalog priority goes first once it has waited --drain-after (0
// here); before that (1h), priority goes first, as ever.
class DrainSlotTest : public DrainTest {
 protected:
  // Which of 'low' (queued first) and 'high' (priority 10) loads first
  // after 'x' leaves the only slot.
  std::string FirstToLoad(const std::string& drain_after) {
    AddModel("x", 256 * kKiB, 1);
    AddModel("low", 256 * kKiB, 2);
    AddModel("high", 256 * kKiB, 3);
    models_.back().priority = 10;
    WriteCatalog(catalog_, models_);
    Daemon& d =
        StartDaemon("1GiB", {"--load-slots", "1", "--drain-after", drain_after},
                    /*gate=*/true);
    Worker wx(d.socket());
    Worker wl(d.socket());
    Worker wh(d.socket());
    wx.Send("acquire x");
    Eventually([&] { return d.Model("x")["state"] == "LOADING"; },
               "'x' loading");
    wl.Send("acquire low");
    Eventually([&] { return Metric("modelcache_waiting_acquires") == 2; },
               "'low' queued");
    wh.Send("acquire high");
    Eventually([&] { return Metric("modelcache_waiting_acquires") == 3; },
               "'high' queued");
    d.OpenGate();  // 'x' loads; its slot goes to the next
    Served(wx.Receive(), "x");
    std::string first;
    Eventually(
        [&] {
          for (const char* m : {"low", "high"}) {
            if (d.Model(m)["state"] == "LOADING") first = m;
          }
          return !first.empty();
        },
        "the next load started");
    d.CloseGate();
    Served(wl.Receive(), "low");
    Served(wh.Receive(), "high");
    for (auto [w, m] : {std::pair<Worker*, const char*>{&wx, "x"},
                        {&wl, "low"},
                        {&wh, "high"}}) {
      w->Ok(std::string("release ") + m);
    }
    return first;
  }
};

TEST_F(DrainSlotTest, PastDrainAfterArrivalOrderOutranksPriority) {
  EXPECT_EQ(FirstToLoad("0"), "low");
}

TEST_F(DrainSlotTest, BeforeDrainAfterPriorityGoesFirst) {
  EXPECT_EQ(FirstToLoad("1h"), "high");
}

// --drain-after takes what replay's does; anything else stops the daemon
// at start, naming the flag.
TEST_F(DrainTest, DrainAfterIsCheckedAtStart) {
  AddModel("a", 256 * kKiB, 1);
  for (const char* ok : {"0", "250ms", "never", "default"}) {
    StartDaemon("1GiB", {"--drain-after", ok});
    daemon_.reset();
  }
  const auto [status, text] =
      RunCli(dir_, "serve --catalog " + catalog_ + " --model-root " + root_ +
                       " --socket " + socket_ +
                       " --host-capacity 1GiB --drain-after soon");
  EXPECT_NE(status, 0);
  EXPECT_THAT(text, HasSubstr("--drain-after: not a duration: 'soon'"));
}

}  // namespace
}  // namespace modelcache::serve::testing
