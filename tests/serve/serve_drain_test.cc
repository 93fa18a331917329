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

class DrainTest : public ServeTest {
 protected:
  double Metric(const std::string& name) { return daemon_->Metric(name); }
};

// The starvation scenario across processes: room for one model, three
// processes keep 'a' in use with overlapping leases, a fourth asks for 'b'
// and waits. With --drain-after 0, 'a' drains at once: the next acquires
// of 'a' queue instead of overtaking, 'b' gets the room as soon as the last
// lease of 'a' out ends, and the queued acquires of 'a' are served after.
TEST_F(DrainTest, AWaiterForRoomIsServedWhileOtherProcessesKeepTheModelBusy) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker w1(d.socket());
  Worker w2(d.socket());
  Worker w3(d.socket());
  Worker wb(d.socket());
  leases_.Add(w1.Ok("acquire a")[0]);
  EXPECT_EQ(Metric("modelcache_oldest_room_wait_seconds"), 0);

  wb.Send("acquire b 120000");
  Eventually([&] { return Metric("modelcache_drains_total") >= 1; },
             "'a' draining for 'b'");
  EXPECT_GT(Metric("modelcache_oldest_room_wait_seconds"), 0)
      << "'b' waits for room";
  // A second process asks for 'a' while the first still holds it: it
  // queues behind the drain rather than overtaking 'b'.
  w2.Send("acquire a 120000");
  Eventually(
      [&] { return Metric("modelcache_queued_behind_drain_total") >= 1; },
      "an acquire of 'a' queued behind its drain");
  w3.Send("acquire a 120000");
  Eventually([&] { return Metric("modelcache_waiting_acquires") == 3; },
             "'b' and two acquires of 'a' waiting");
  EXPECT_EQ(d.Model("a")["leases"].size(), 1u) << "the drain took no lease";
  EXPECT_EQ(d.Model("a")["queued_behind_drain"], 1)
      << "one load of 'a' (both acquires' waits) queued behind its drain";

  // The last lease of 'a' out ends: 'b' gets the room.
  w1.Ok("release a");
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  EXPECT_EQ(b[1], std::to_string(checksums_["b"]));
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 2)
      << "the acquires of 'a' wait for room in their turn";

  // 'b' done: the acquires of 'a' go on.
  wb.Ok("release b");
  for (Worker* w : {&w2, &w3}) {
    const std::vector<std::string> a = Words(w->Receive());
    ASSERT_EQ(a.size(), 3u);
    leases_.Add(a[0]);
    EXPECT_EQ(a[1], std::to_string(checksums_["a"]));
    w->Ok("release a");
  }
  EXPECT_EQ(Metric("modelcache_acquires_total{result=\"timeout\"}"), 0);
}

// The holder of a draining copy is SIGKILLed: its lease ends with its
// process, which ends the drain's wait like a release, and the acquire of
// 'a' queued behind the drain is served after 'b'.
TEST_F(DrainTest, ASigkilledHolderOfADrainingCopyEndsItsLease) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker holder(d.socket());
  Worker next(d.socket());
  Worker wb(d.socket());
  leases_.Add(holder.Ok("acquire a")[0]);
  wb.Send("acquire b 120000");
  Eventually([&] { return Metric("modelcache_drains_total") >= 1; },
             "'a' draining for 'b'");
  next.Send("acquire a 120000");
  Eventually(
      [&] { return Metric("modelcache_queued_behind_drain_total") >= 1; },
      "an acquire of 'a' queued behind its drain");
  holder.process().Signal(SIGKILL);
  holder.process().Wait();
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  EXPECT_EQ(b[1], std::to_string(checksums_["b"]));
  wb.Ok("release b");
  const std::vector<std::string> a = Words(next.Receive());
  ASSERT_EQ(a.size(), 3u);
  leases_.Add(a[0]);
  EXPECT_EQ(a[1], std::to_string(checksums_["a"]));
  next.Ok("release a");
}

// --drain-after inf keeps the rule of before: models in use never drain,
// acquires of them overtake the waiter, which waits to its deadline.
TEST_F(DrainTest, DrainAfterInfLetsTheBusyModelOvertakeTheWaiterForEver) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "inf"});
  Worker w1(d.socket());
  Worker w2(d.socket());
  Worker wb(d.socket());
  leases_.Add(w1.Ok("acquire a")[0]);
  wb.Send("acquire b 5000");
  Eventually([&] { return Metric("modelcache_oldest_room_wait_seconds") > 0; },
             "'b' waiting for room");
  leases_.Add(w2.Ok("acquire a 5000")[0]);  // a hit, at once
  w1.Ok("release a");
  EXPECT_THAT(wb.Receive(), StartsWith("error TIMEOUT"));
  EXPECT_EQ(Metric("modelcache_drains_total"), 0);
  w2.Ok("release a");
}

// A copy held by an orphaned lease (its connection closed, its process
// still mapping it) counts as pinned: no drain takes it, so the waiter
// waits to its deadline as for pinned room, and acquires of it stay hits.
TEST_F(DrainTest, ACopyHeldByAnOrphanIsNeverDrained) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker orphan(d.socket());
  leases_.Add(orphan.Ok("acquire a")[0]);
  orphan.Ok("close");  // the socket goes, the mapping stays
  Eventually([&] { return Metric("modelcache_orphaned_leases") == 1; },
             "the lease orphaned");
  Worker wb(d.socket());
  EXPECT_THAT(wb.Do("acquire b 1000"), StartsWith("error TIMEOUT"));
  EXPECT_EQ(Metric("modelcache_drains_total"), 0);
  Worker w(d.socket());
  leases_.Add(w.Ok("acquire a")[0]);
  EXPECT_EQ(Metric("modelcache_acquires_total{result=\"hit\"}"), 1);
  w.Ok("release a");
  orphan.Ok("release-all");
}

// ---- local reuse (protocol.h, "Drains") ----

// A process that reuses its lease locally: every acquire of a model it maps
// is a local reference, and a lease whose references ended is kept (and
// said idle only after a minute, so that the daemon counts it in use).
constexpr const char* kReusing =
    " reuse=1 keep_idle_ms=600000 notice_us=60000000";

// The starvation scenario through local reuse: one process keeps 'a' busy
// with references of its own lease, never asking the daemon; another waits
// for room. The drain tells the first to stop, so its lease ends with the
// reference under way and the waiter is served within the bound (here 5 s
// for microseconds of references and a load); the busy process's next
// acquires queue at the daemon and are served after.
TEST_F(DrainTest, AWaiterIsServedWhileAnotherProcessReusesTheModelLocally) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker busy;
  busy.Ok("connect " + d.socket() + kReusing);
  busy.Ok("cycle-start 120000 a");
  busy.Ok("cycle-wait 3");  // its lease is local now
  Worker wb(d.socket());
  const std::vector<std::string> b = Words(wb.Do("acquire b 5000"));
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  EXPECT_EQ(b[1], std::to_string(checksums_["b"]));
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
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker w;
  w.Ok("connect " + d.socket() + kReusing + " recall_gate=1");
  const std::string lease = w.Ok("acquire a")[0];
  leases_.Add(lease);
  Worker other(d.socket());
  leases_.Add(other.Ok("acquire a")[0]);
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(w.Ok("recall-wait")[0], lease) << "the drain recalls it";
  w.Ok("recall-go");
  Eventually(
      [&] { return Metric("modelcache_recalls_total{answer=\"busy\"}") == 1; },
      "the recall answered: in use");
  EXPECT_EQ(w.Ok("acquire-local a")[0], "none") << "it lends no more";
  w.Ok("release a");  // the last reference: the lease ends
  w.Send("acquire a 120000");
  Eventually(
      [&] { return Metric("modelcache_queued_behind_drain_total") >= 1; },
      "the acquire of 'a' queued behind its drain at the daemon");
  other.Ok("release a");
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  wb.Ok("release b");
  const std::vector<std::string> a = Words(w.Receive());
  ASSERT_EQ(a.size(), 3u);
  leases_.Add(a[0]);
  EXPECT_NE(a[0], lease) << "a lease of its own, from the daemon";
  EXPECT_EQ(a[1], std::to_string(checksums_["a"]));
  w.Ok("release a");
}

// A local reuse made before the drain's recall is read: the reference
// counts as a lease out, and the drain waits for it to end as for any.
TEST_F(DrainTest, ALocalReuseBeforeTheDrainIsReadIsALeaseOutThatItWaitsFor) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker w;
  w.Ok("connect " + d.socket() + kReusing + " recall_gate=1");
  const std::string lease = w.Ok("acquire a")[0];
  leases_.Add(lease);
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(w.Ok("recall-wait")[0], lease);  // held in the hook, unread
  EXPECT_EQ(w.Ok("acquire-local a")[0], lease) << "reused before the recall";
  w.Ok("recall-go");
  Eventually(
      [&] { return Metric("modelcache_recalls_total{answer=\"busy\"}") == 1; },
      "the recall answered: in use");
  w.Ok("release a");  // one reference of two
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 1) << "'b' still waits";
  EXPECT_EQ(d.Model("a")["leases"].size(), 1u);
  w.Ok("release a");  // the last: released, and 'b' gets the room
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  wb.Ok("release b");
}

// An idle delegation: a process that reuses locally, whose lease no
// reference uses any more, with the daemon told "idle" at once.
constexpr const char* kDelegatingIdle =
    " reuse=1 keep_idle_ms=600000 notice_us=0 recall_gate=1";

// The drain's recall of an idle delegation (another process keeps the copy
// in use, so it drains rather than being evicted) is read before a local
// revival: no reference uses the lease, so it is released at once, the
// revival finds nothing local, and the acquire goes to the daemon, where it
// queues behind the drain and is served after the waiter.
TEST_F(DrainTest, ADrainReadBeforeAnIdleLeaseIsRevivedReleasesIt) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker w;
  w.Ok("connect " + d.socket() + kDelegatingIdle);
  const std::string lease = w.Ok("acquire a")[0];
  leases_.Add(lease);
  w.Ok("release a");
  Eventually(
      [&] { return Metric("modelcache_delegated_leases{use=\"idle\"}") == 1; },
      "the daemon told the lease is idle");
  Worker other(d.socket());
  leases_.Add(other.Ok("acquire a")[0]);  // keeps the copy in use
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(w.Ok("recall-wait")[0], lease) << "the drain recalls it, idle";
  w.Ok("recall-go");
  Eventually(
      [&] {
        return Metric("modelcache_recalls_total{answer=\"release\"}") == 1;
      },
      "the recall answered: released");
  EXPECT_EQ(w.Ok("idle"), std::vector<std::string>{"0"});
  EXPECT_EQ(w.Ok("acquire-local a")[0], "none") << "nothing left to revive";
  w.Send("acquire a 120000");
  Eventually(
      [&] { return Metric("modelcache_queued_behind_drain_total") >= 1; },
      "the acquire of 'a' queued behind its drain at the daemon");
  other.Ok("release a");
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  EXPECT_EQ(b[1], std::to_string(checksums_["b"]));
  wb.Ok("release b");
  const std::vector<std::string> a = Words(w.Receive());
  ASSERT_EQ(a.size(), 3u);
  leases_.Add(a[0]);
  EXPECT_NE(a[0], lease) << "a lease of its own, from the daemon";
  EXPECT_EQ(a[1], std::to_string(checksums_["a"]));
  w.Ok("release a");
}

// An idle delegation revived locally before the drain's recall is read:
// the recall is answered "use", the revived reference is a lease out that
// the drain waits for (the copy it maps is not freed when the other
// process's lease ends), no new local reference is taken once the recall
// is read, and the reference's end releases the lease: the waiter is
// served.
TEST_F(DrainTest, AnIdleLeaseRevivedBeforeTheDrainIsReadIsALeaseOutToWaitFor) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d = StartDaemon("6MiB", {"--drain-after", "0"});
  Worker w;
  w.Ok("connect " + d.socket() + kDelegatingIdle);
  const std::string lease = w.Ok("acquire a")[0];
  leases_.Add(lease);
  w.Ok("release a");
  Eventually(
      [&] { return Metric("modelcache_delegated_leases{use=\"idle\"}") == 1; },
      "the daemon told the lease is idle");
  Worker other(d.socket());
  leases_.Add(other.Ok("acquire a")[0]);  // keeps the copy in use
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(w.Ok("recall-wait")[0], lease);  // held in the hook, unread
  EXPECT_EQ(w.Ok("acquire-local a")[0], lease) << "revived before the recall";
  w.Ok("recall-open");  // this recall and any later one are answered
  Eventually(
      [&] { return Metric("modelcache_recalls_total{answer=\"busy\"}") >= 1; },
      "the recall answered: in use");
  EXPECT_EQ(w.Ok("acquire-local a")[0], "none")
      << "no new local reference once the drain is read";
  other.Ok("release a");
  Eventually([&] { return Metric("modelcache_refused_unloads_total") >= 1; },
             "the drained copy's unload refused: the revived lease maps it");
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 1) << "'b' still waits";
  EXPECT_EQ(d.Model("a")["leases"].size(), 1u);
  w.Ok("release a");  // the last reference: released, not kept idle
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  EXPECT_EQ(b[1], std::to_string(checksums_["b"]));
  EXPECT_EQ(w.Ok("idle"), std::vector<std::string>{"0"});
  wb.Ok("release b");
}

// A client that does not answer the drain's recall (its hook holds it): the
// recall timeout takes it as busy, as any recall, and the drain waits for
// its lease to end as before.
TEST_F(DrainTest, AClientThatNeverAnswersADrainIsTreatedAsBefore) {
  AddModel("a", 4 * kMiB, 1);
  AddModel("b", 4 * kMiB, 2);
  Daemon& d =
      StartDaemon("6MiB", {"--drain-after", "0", "--recall-timeout", "50ms"});
  Worker w;
  w.Ok("connect " + d.socket() + kReusing + " recall_gate=1");
  const std::string lease = w.Ok("acquire a")[0];
  leases_.Add(lease);
  Worker wb(d.socket());
  wb.Send("acquire b 120000");
  EXPECT_EQ(w.Ok("recall-wait")[0], lease);  // never answered
  Eventually(
      [&] {
        return Metric("modelcache_recalls_total{answer=\"unanswered\"}") == 1;
      },
      "the recall timed out");
  EXPECT_EQ(Metric("modelcache_waiting_acquires"), 1) << "'b' still waits";
  // (The hook holds the client's reading thread, which its release needs.)
  w.Ok("recall-go");
  w.Ok("release a");
  const std::vector<std::string> b = Words(wb.Receive());
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
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
    leases_.Add(Words(wx.Receive())[0]);
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
    leases_.Add(Words(wl.Receive())[0]);
    leases_.Add(Words(wh.Receive())[0]);
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
