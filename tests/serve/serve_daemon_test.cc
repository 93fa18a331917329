// `modelcache serve` as its users meet it: the daemon is the real binary,
// clients are real processes (serve_test_worker) or this process, and every
// step is synchronised through pipes, sockets, pidfds and the daemon's own
// books. After every test, the "Never" checks hold: no memfd that a live
// process maps is missing from the daemon's books, used + orphaned never
// exceeds the capacity, the daemon's descriptors come back to their number
// at start once every client is gone, and no lease id is ever handed out
// twice.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/serve/client.h"
#include "modelcache/weights/memfd.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(ServeTest, AnotherProcessLeasesMapsAndReleasesACopy) {
  AddModel("tiny", 300 * kKiB, 1, false, {"small"});
  Daemon& d = StartDaemon();
  {
    Worker worker(d.socket());
    const auto got = worker.Ok("acquire small");  // by alias
    ASSERT_EQ(got.size(), 3u);
    leases_.Add(got[0]);
    EXPECT_EQ(got[1], std::to_string(checksums_["tiny"]));
    const json model = d.Model("tiny");
    EXPECT_EQ(model["state"], "READY");
    ASSERT_EQ(model["leases"].size(), 1u);
    EXPECT_EQ(model["leases"][0]["pid"].get<pid_t>(), worker.pid());
    EXPECT_EQ(model["leases"][0]["uid"].get<uid_t>(), ::getuid());
    EXPECT_EQ(std::to_string(model["leases"][0]["lease"].get<uint64_t>()),
              got[0]);
    EXPECT_EQ(worker.Ok("maps " + d.memfd_prefix()),
              std::vector<std::string>{"1"})
        << "one mapping: the data (the header is read, not kept mapped)";
    worker.Ok("release-all");
    Eventually([&] { return d.Model("tiny")["leases"].empty(); },
               "the release reaches the daemon");
    EXPECT_EQ(worker.Ok("maps " + d.memfd_prefix()),
              std::vector<std::string>{"0"});
  }
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"loaded\"}"), 1);
}

// A release the client cannot send now (the daemon reads nothing, the
// socket fills) is sent once the socket is writable, in order, never
// dropped, and without the daemon's answers piling up past its limit; the
// release call returns once it is on the socket.
TEST_F(ServeTest, ReleasesTheSocketHasNoRoomForAreSentAndAllReachTheDaemon) {
  AddModel("tiny", 64 * kKiB, 3);
  Daemon& d = StartDaemon("1GiB", {}, /*gate=*/false, /*pause_hook=*/true);
  // Far more releases than a socket's send buffer holds (a few hundred).
  constexpr int kLeases = 2000;
  {
    Worker worker(d.socket());
    EXPECT_EQ(worker.Ok("acquire-many tiny " + std::to_string(kLeases)),
              std::vector<std::string>{std::to_string(kLeases)});
    EXPECT_EQ(d.Metric("modelcache_leases"), kLeases);
    d.PauseReads();
    // Every release made while nothing is read: the call returns only once
    // the last is on the socket, so after the daemon reads again.
    worker.Send("release-all");
    EXPECT_EQ(d.Metric("modelcache_leases"), kLeases);
    d.ResumeReads();
    EXPECT_EQ(worker.Receive(), "ok");
    // A request made after the releases is sent after them: its answer
    // means the daemon has had every one.
    worker.Ok("ping");
    EXPECT_EQ(d.Metric("modelcache_leases"), 0);
    EXPECT_EQ(d.Model("tiny")["leases"].size(), 0u);
    EXPECT_EQ(d.Metric("modelcache_clients"), 1) << "still connected";
    EXPECT_EQ(
        d.Metric("modelcache_client_disconnects_total{reason=\"slow_reader\"}"),
        0);
  }
}

// A client that closes with replies of the daemon's unread makes the
// kernel report ECONNRESET to the daemon once, ahead of the datagrams the
// client sent last. The daemon still reads them: a release sent just
// before the close (Client::Close sends the idle leases' releases so)
// releases its lease instead of leaving it orphaned until a rescan.
TEST_F(ServeTest, AReleaseSentJustBeforeACloseWithRepliesUnreadIsRead) {
  AddModel("tiny", 64 * kKiB, 3);
  Daemon& d = StartDaemon("1GiB", {}, /*gate=*/false, /*pause_hook=*/true);
  Raw raw(d.socket());
  ASSERT_TRUE(raw.Send(protocol::EncodeHello(1)));
  ASSERT_TRUE(raw.Reply());
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(2, "tiny", 60000, false)));
  const auto acquired = raw.Reply();
  ASSERT_TRUE(acquired && acquired->ok);
  // A reply left unread: the ping's, once it has arrived.
  ASSERT_TRUE(raw.Send(protocol::EncodePing(3)));
  pollfd ready{raw.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&ready, 1, static_cast<int>(kBound.count() * 1000)), 1);
  // The release and the close reach the daemon while it reads nothing, so
  // that it meets the reset before the release.
  d.PauseReads();
  ASSERT_TRUE(raw.Send(protocol::EncodeRelease(4, acquired->lease)));
  raw.Close();
  d.ResumeReads();
  Eventually([&] { return d.Metric("modelcache_clients") == 0; },
             "the daemon hears the close");
  EXPECT_EQ(d.Metric("modelcache_leases"), 0);
  EXPECT_EQ(d.Metric("modelcache_orphaned_leases"), 0);
}

TEST_F(ServeTest, TwoWorkersShareOneCopy) {
  AddModel("shared", 2 * kMiB, 2);
  Daemon& d = StartDaemon();
  Worker a(d.socket());
  Worker b(d.socket());
  const auto got_a = a.Ok("acquire shared");
  const auto got_b = b.Ok("acquire shared");
  leases_.Add(got_a[0]);
  leases_.Add(got_b[0]);
  EXPECT_EQ(got_a[1], got_b[1]);
  EXPECT_EQ(got_a[1], std::to_string(checksums_["shared"]));
  // One copy: the same data memfd in both processes, one load, bytes once.
  std::set<uint64_t> inodes;
  for (const auto& m : detail::ScanMemfdMappings(d.memfd_prefix(), d.pid())) {
    if (m.pid == a.pid() || m.pid == b.pid()) inodes.insert(m.inode);
  }
  EXPECT_EQ(inodes.size(), 1u);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1);
  EXPECT_EQ(d.Budget()["used_bytes"].get<uint64_t>(), CopyBytes("shared"));
  EXPECT_GE(CopyBytes("shared"), 2 * kMiB);
  EXPECT_EQ(d.Model("shared")["leases"].size(), 2u);
}

TEST_F(ServeTest, ASigkilledClientsLeaseIsFreedAndTheCopyIsEvictableAgain) {
  AddModel("first", 1 * kMiB, 3);
  AddModel("second", 1 * kMiB, 4);
  // Room for one copy only.
  Daemon& d = StartDaemon("1500KiB");
  Worker holder(d.socket());
  leases_.Add(holder.Ok("acquire first")[0]);

  Client client = Client::Connect(d.socket());
  RemoteAcquireOptions fail_at_once;
  fail_at_once.when_full = WhenFull::kFail;
  try {
    client.Acquire("second", fail_at_once);
    FAIL() << "no CAPACITY while 'first' is leased";
  } catch (const ServeError& e) {
    EXPECT_EQ(e.serve_code(), ServeCode::kCapacity);
    EXPECT_THAT(e.what(), HasSubstr("first"));
  }

  holder.process().Signal(SIGKILL);
  holder.process().Wait();
  const auto killed = Clock::now();
  // Waits for room: served once the dead client's lease is freed and
  // 'first' evicted.
  RemoteAcquireOptions wait;
  wait.timeout = std::chrono::seconds(60);
  RemoteWeights second = client.Acquire("second", wait);
  const double ms =
      std::chrono::duration<double, std::milli>(Clock::now() - killed).count();
  RecordProperty("freed_after_kill_ms", std::to_string(ms));
  std::cout << "lease freed and the room reused " << ms
            << " ms after the client's death was reaped\n";
  leases_.Add(std::to_string(second.lease()));
  EXPECT_EQ(Checksum(second.files()[0].data()), checksums_["second"]);
  EXPECT_GE(d.Metric("modelcache_evictions_total"), 1);
  EXPECT_EQ(
      d.Metric("modelcache_client_disconnects_total{reason=\"closed\"}") +
          d.Metric(
              "modelcache_client_disconnects_total{reason=\"process_exit\"}"),
      1);
}

TEST_F(ServeTest, AClosedSocketWithAMappingStaysOrphanedUntilTheProcessExits) {
  AddModel("kept", 1 * kMiB, 5);
  AddModel("other", 1 * kMiB, 6);
  Daemon& d = StartDaemon("1500KiB");
  auto worker = std::make_unique<Worker>(d.socket());
  const auto got = worker->Ok("acquire kept");
  leases_.Add(got[0]);
  worker->Ok("close");
  Eventually([&] { return d.Budget()["orphaned_leases"] == 1; },
             "the lease becomes orphaned");
  // Counted and never evicted: no room for 'other'.
  Client client = Client::Connect(d.socket());
  RemoteAcquireOptions fail_at_once;
  fail_at_once.when_full = WhenFull::kFail;
  try {
    client.Acquire("other", fail_at_once);
    FAIL() << "an orphaned copy was evicted";
  } catch (const ServeError& e) {
    EXPECT_EQ(e.serve_code(), ServeCode::kCapacity);
  }
  // The worker still reads its copy.
  EXPECT_EQ(worker->Ok("checksum"), std::vector<std::string>{got[1]});
  EXPECT_EQ(d.Model("kept")["leases"][0]["orphaned"], true);

  worker->Ok("exit");
  worker->process().Wait();
  worker.reset();
  Eventually([&] { return d.Budget()["orphaned_leases"] == 0; },
             "the orphaned lease ends with its process");
  RemoteWeights other = client.Acquire("other", fail_at_once);
  leases_.Add(std::to_string(other.lease()));
  EXPECT_EQ(Checksum(other.files()[0].data()), checksums_["other"]);
}

TEST_F(ServeTest, AnOrphanedLeaseEndsOnceItsProcessMapsTheCopyNoMore) {
  AddModel("kept", 1 * kMiB, 31);
  Daemon& d = StartDaemon();
  Worker worker(d.socket());
  const auto got = worker.Ok("acquire kept");
  leases_.Add(got[0]);
  worker.Ok("close");
  Eventually([&] { return d.Budget()["orphaned_leases"] == 1; },
             "the lease becomes orphaned");
  // Mapped: held, however many rescans pass meanwhile.
  EXPECT_EQ(worker.Ok("checksum"), std::vector<std::string>{got[1]});
  EXPECT_EQ(d.Metric("modelcache_orphaned_leases"), 1);
  worker.Ok("release-all");  // unmaps; the release cannot reach the daemon
  Eventually([&] { return d.Budget()["orphaned_leases"] == 0; },
             "the lease ends once the live process maps the copy no more");
  EXPECT_TRUE(d.Model("kept")["leases"].empty());
  EXPECT_FALSE(worker.process().Exited());
}

TEST_F(ServeTest,
       ADaemonKilledWhileCopiesAreMappedIsFollowedByOneThatBooksThem) {
  AddModel("big", 2 * kMiB, 7);
  // Room for one copy and a little more.
  Daemon& d = StartDaemon("2200KiB");
  // A client that reclaims nothing: what it maps stays orphaned (the
  // reclaim tests cover those that do).
  Worker worker;
  worker.Ok("connect " + d.socket() + " reclaim=0");
  const auto got = worker.Ok("acquire big");
  leases_.Add(got[0]);
  const uint64_t copy = CopyBytes("big");

  d.process().Signal(SIGKILL);
  d.process().Wait();
  // Every byte, still there, no SIGBUS.
  EXPECT_EQ(worker.Ok("checksum"), std::vector<std::string>{got[1]});
  d.Start();
  const json budget = d.Budget();
  // Only the data memfd is still mapped; its pages are booked.
  EXPECT_EQ(budget["orphaned_bytes"].get<uint64_t>(),
            weights::PageRoundedBytes(std::stoull(got[2])));
  EXPECT_LE(budget["used_bytes"].get<uint64_t>() +
                budget["orphaned_bytes"].get<uint64_t>(),
            budget["capacity_bytes"].get<uint64_t>());
  const json copies = d.GetJson("/v1/copies");
  ASSERT_EQ(copies["orphans"].size(), 1u);
  EXPECT_EQ(copies["orphans"][0]["pids"][0].get<pid_t>(), worker.pid());
  ExpectBooksCoverMaps(d);

  // The worker reconnects; the old copy and a new one do not both fit.
  const std::string refused = worker.Do("acquire big 60000 fail");
  EXPECT_THAT(refused, HasSubstr("error CAPACITY"));
  EXPECT_THAT(refused, HasSubstr("previous daemon"));
  worker.Ok("release-all");  // unmaps: the orphan goes
  Eventually([&] { return d.Budget()["orphaned_bytes"] == 0; },
             "the orphan is freed once unmapped");
  const auto again = worker.Ok("acquire big 60000 fail");
  leases_.Add(again[0]);
  EXPECT_EQ(again[1], got[1]);
  EXPECT_GT(std::stoull(again[0]), std::stoull(got[0]))
      << "a successor's lease ids come after its predecessor's";
  EXPECT_EQ(CopyBytes("big"), copy);
}

TEST_F(ServeTest, AForkedChildHasNoMappingAndNoLeaseAndItsParentIsUnchanged) {
  AddModel("forked", 1 * kMiB, 8);
  Daemon& d = StartDaemon();
  Worker worker;
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer stops a child of a threaded parent that starts a
  // thread: without reclaim no keeper thread watches the parent's lease.
  worker.Ok("connect " + d.socket() + " reclaim=0");
#else
  worker.Ok("connect " + d.socket());
#endif
  const auto got = worker.Ok("acquire forked");
  leases_.Add(got[0]);
  // ok CHILD_MAPS CHILD_LEASE CHILD_SUM | PARENT_SUM
  const auto report = worker.Ok("fork " + d.memfd_prefix() + " forked");
  ASSERT_EQ(report.size(), 5u) << ::testing::PrintToString(report);
  EXPECT_EQ(report[0], "0") << "the child maps its parent's copy";
  leases_.Add(report[1]);
  EXPECT_EQ(report[2], got[1]) << "the child reconnected and got the copy";
  EXPECT_EQ(report[4], got[1]) << "the parent's copy changed";
  // The child is gone: its lease with it. The parent's is untouched.
  Eventually([&] { return d.Model("forked")["leases"].size() == 1; },
             "the child's lease ends with the child");
  const json lease = d.Model("forked")["leases"][0];
  EXPECT_EQ(std::to_string(lease["lease"].get<uint64_t>()), got[0]);
  EXPECT_EQ(lease["pid"].get<pid_t>(), worker.pid());
  EXPECT_EQ(worker.Ok("checksum"), std::vector<std::string>{got[1]});
  worker.Ok("release-all");
}

TEST_F(ServeTest, ClientsThatDoNotReadOrFloodAreCutOffAndOthersAreServed) {
  AddModel("hot", 64 * kKiB, 9);
  Daemon& d = StartDaemon("1GiB", {"--max-queued-replies", "64"});
  Client client = Client::Connect(d.socket());
  { RemoteWeights warm = client.Acquire("hot", std::chrono::seconds(60)); }

  Worker flooder;
  Worker silent;
  flooder.Send("flood " + d.socket() + " 10000");
  silent.Send("noread " + d.socket() + " hot 10000");
  // A third client, meanwhile.
  std::vector<double> micros;
  for (int i = 0; i < 300; ++i) {
    const auto start = Clock::now();
    RemoteWeights w = client.Acquire("hot", std::chrono::seconds(60));
    w.Release();
    micros.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - start)
            .count());
  }
  const auto flooded = flooder.Receive();
  const auto silenced = silent.Receive();
  EXPECT_EQ(flooded.rfind("ok ", 0), 0u) << flooded;
  EXPECT_EQ(silenced.rfind("ok ", 0), 0u) << silenced;
  EXPECT_LT(std::stoi(flooded.substr(3)), 10000) << "the flood was not cut off";
  EXPECT_EQ(
      d.Metric("modelcache_client_disconnects_total{reason=\"slow_reader\"}"),
      2);
  std::sort(micros.begin(), micros.end());
  const double p50 = micros[micros.size() / 2];
  const double p99 = micros[micros.size() * 99 / 100];
  RecordProperty("third_client_p50_us", std::to_string(p50));
  RecordProperty("third_client_p99_us", std::to_string(p99));
  std::cout << "third client during the flood: acquire+release p50 " << p50
            << " us, p99 " << p99 << " us\n";
  // The daemon is well.
  EXPECT_EQ(d.Get("/healthz").status, 200);
  client.Ping();
}

TEST_F(ServeTest, AThousandClientsOnOneColdModelLoadItOnceAndTheNextIsBusy) {
  AddModel("cold", 256 * kKiB, 10);
  Daemon& d = StartDaemon("1GiB", {"--max-clients", "1000"}, /*gate=*/true);
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < 4; ++i) {
    workers.push_back(std::make_unique<Worker>());
    workers.back()->Send("storm " + d.socket() + " cold 250 600000");
  }
  // All 1,000 wait on the one load, held at the gate.
  Eventually([&] { return d.Metric("modelcache_waiting_acquires") == 1000; },
             "1,000 acquires waiting");
  EXPECT_EQ(d.Metric("modelcache_clients"), 1000);
  {
    Raw extra(d.socket());
    extra.Send(protocol::EncodeHello(1));
    const auto reply = extra.Reply();
    ASSERT_TRUE(reply);
    EXPECT_FALSE(reply->ok);
    EXPECT_EQ(reply->code, ServeCode::kBusy);
    EXPECT_EQ(reply->id, 0u);
    EXPECT_THAT(reply->message, HasSubstr("too many clients"));
  }
  d.CloseGate();
  int served = 0;
  for (auto& w : workers) {
    const std::string reply = w->Receive();
    std::istringstream in(reply);
    std::string ok;
    int s = 0;
    int busy = 0;
    int other = 0;
    in >> ok >> s >> busy >> other;
    EXPECT_EQ(ok, "ok") << reply;
    EXPECT_EQ(busy + other, 0) << reply;
    served += s;
    std::string lease;
    while (in >> lease) leases_.Add(lease);
  }
  EXPECT_EQ(served, 1000);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"loaded\"}"), 1000);
  ExpectBooksCoverMaps(d);
  for (auto& w : workers) w->Ok("storm-close");
}

TEST_F(ServeTest, AcquiresSayWhetherTheyHitStartedTheLoadOrJoinedIt) {
  AddModel("m", 64 * kKiB, 12);
  Daemon& d = StartDaemon("1GiB", {}, /*gate=*/true);
  Client client = Client::Connect(d.socket());
  RemoteWeights first;
  std::thread starter(
      [&] { first = client.Acquire("m", std::chrono::seconds(60)); });
  Eventually([&] { return d.Metric("modelcache_waiting_acquires") == 1; },
             "the first acquire waits for its load");
  RemoteWeights second;
  std::thread joiner(
      [&] { second = client.Acquire("m", std::chrono::seconds(60)); });
  Eventually([&] { return d.Metric("modelcache_waiting_acquires") == 2; },
             "the second acquire waits for the same load");
  d.CloseGate();
  starter.join();
  joiner.join();
  EXPECT_EQ(first.load(), "miss");
  EXPECT_EQ(second.load(), "joined");
  // A process that holds a lease on the model reuses it locally.
  RemoteWeights third = client.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(third.load(), "local");
  EXPECT_TRUE(third.lease() == first.lease() ||
              third.lease() == second.lease());
  Client other = Client::Connect(d.socket());
  RemoteWeights fourth = other.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(fourth.load(), "hit");
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1);
}

TEST_F(ServeTest, BadMessagesGetClearErrorsAndNothingBreaks) {
  AddModel("m", 64 * kKiB, 11);
  Daemon& d = StartDaemon();
  Raw raw(d.socket());
  const auto expect_invalid = [&](std::string_view message,
                                  const std::string& says) {
    SCOPED_TRACE(std::string(message.substr(0, 80)));
    ASSERT_TRUE(raw.Send(message));
    const auto reply = raw.Reply();
    ASSERT_TRUE(reply) << "no reply: the daemon hung up";
    EXPECT_FALSE(reply->ok);
    EXPECT_EQ(reply->code, ServeCode::kInvalid);
    EXPECT_THAT(reply->message, HasSubstr(says));
  };
  expect_invalid("not json", "not valid JSON");
  expect_invalid("[1, 2]", "must be a JSON object");
  expect_invalid("{\"op\": \"ping\", \"id\": 1, \"x\": {\"deep\": 1}}",
                 "must be a string or a non-negative integer");
  expect_invalid("{\"op\": \"launch\", \"id\": 2}", "unknown op 'launch'");
  expect_invalid("{\"op\": \"ping\", \"id\": 3, \"color\": \"red\"}",
                 "unknown field 'color'");
  expect_invalid("{\"op\": \"ping\", \"id\": 4, \"id\": 5}", "duplicate field");
  expect_invalid("{\"op\": \"ping\"}", "missing field 'id'");
  expect_invalid("{\"op\": \"release\", \"id\": 6}", "missing field 'lease'");
  expect_invalid(
      "{\"op\": \"acquire\", \"id\": 7, \"model\": \"m\", \"lease\": 1}",
      "does not belong to op 'acquire'");
  expect_invalid(
      "{\"op\": \"acquire\", \"id\": 8, \"model\": \"../etc/passwd\"}",
      "is not valid");
  expect_invalid("{\"op\": \"acquire\", \"id\": 9, \"model\": \"/etc/passwd\"}",
                 "is not valid");
  expect_invalid("{\"op\": \"acquire\", \"id\": 10, \"model\": \"" +
                     std::string(200, 'a') + "\"}",
                 "is not valid");
  expect_invalid("{\"op\": \"hello\", \"id\": 11, \"version\": 99}",
                 "version 99 is not supported");
  static constexpr char kNul[] = "{\"op\": \"ping\", \"id\": 12}\0junk";
  expect_invalid(std::string(kNul, sizeof(kNul) - 1), "NUL");
  expect_invalid("{\"op\": \"ping\", \"id\": 13", "not valid JSON");
  // Oversized: truncated on receipt, refused by size.
  expect_invalid(std::string(200 * 1024, ' '), "exceeds the limit");
  // Descriptors sent to the daemon are closed and the request refused.
  {
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    const int fds[2] = {devnull, devnull};
    ASSERT_TRUE(raw.Send(protocol::EncodePing(14), fds));
    const auto reply = raw.Reply();
    ASSERT_TRUE(reply);
    EXPECT_EQ(reply->code, ServeCode::kInvalid);
    EXPECT_THAT(reply->message,
                HasSubstr("only a reclaim carries file descriptors"));
    ::close(devnull);
  }
  // Unknown leases and models.
  ASSERT_TRUE(raw.Send(protocol::EncodeRelease(15, 123456)));
  auto reply = raw.Reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->code, ServeCode::kNotFound);
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(16, "ghost", 1000, false)));
  reply = raw.Reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->code, ServeCode::kNotFound);
  EXPECT_THAT(reply->message, HasSubstr("no model 'ghost'"));
  // Still serving, with the same descriptors as before (the received ones
  // were closed) plus this connection's socket and pidfd.
  ASSERT_TRUE(raw.Send(protocol::EncodePing(17)));
  reply = raw.Reply();
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok);
  EXPECT_EQ(reply->id, 17u);
  // (HTTP connections of these checks come and go: wait for them to go.)
  Eventually([&] { return d.OpenFds() == d.baseline_fds() + 2; },
             "the daemon holds this connection's socket and pidfd and no "
             "more");
  EXPECT_EQ(d.Metric("modelcache_protocol_errors_total"), 17);
  // An empty datagram reads as the end of the stream: the daemon hangs up.
  ASSERT_TRUE(raw.Send(""));
  EXPECT_FALSE(raw.Receive());
  EXPECT_EQ(d.Get("/healthz").status, 200);
}

TEST_F(ServeTest, AReceivedCopyCannotBeWritten) {
  AddModel("sealed", 100 * kKiB, 12);
  Daemon& d = StartDaemon();
  Raw raw(d.socket());
  raw.Send(protocol::EncodeHello(1));
  ASSERT_TRUE(raw.Reply());
  raw.Send(protocol::EncodeAcquire(2, "sealed", 60000, false));
  const auto reply = raw.Reply();
  ASSERT_TRUE(reply && reply->ok);
  leases_.Add(std::to_string(reply->lease));
  ASSERT_EQ(raw.last_fds().size(), 2u);
  for (const base::UniqueFd& fd : raw.last_fds()) {
    struct stat st;
    ASSERT_EQ(::fstat(fd.get(), &st), 0);
    const size_t bytes = static_cast<size_t>(st.st_size);
    errno = 0;
    void* writable =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    EXPECT_EQ(writable, MAP_FAILED);
    void* readable = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
    ASSERT_NE(readable, MAP_FAILED);
    EXPECT_NE(::mprotect(readable, bytes, PROT_READ | PROT_WRITE), 0);
    ::munmap(readable, bytes);
    const char byte = 0;
    EXPECT_EQ(::pwrite(fd.get(), &byte, 1, 0), -1);
    EXPECT_NE(::ftruncate(fd.get(), 0), 0);
    EXPECT_NE(::ftruncate(fd.get(), static_cast<off_t>(bytes) + 4096), 0);
    EXPECT_EQ(::fcntl(fd.get(), F_GET_SEALS), weights::MemfdSeals());
  }
  raw.last_fds().clear();
  raw.Send(protocol::EncodeRelease(3, reply->lease));
  ASSERT_TRUE(raw.Reply());
}

// A symbolic link in the catalog makes its model unavailable at start (or
// the daemon refuse to start, with --strict-catalog: see
// TheStrictDaemonRefusesWhatTheCatalogCheckRefuses); one that appears
// later is refused at load, which makes the model unavailable too.
TEST_F(ServeTest, ASymlinkUnderTheRootIsNeverFollowed) {
  AddModel("fine", 64 * kKiB, 13);
  // Outside the root: a real model file and a folder holding one.
  const std::string outside = dir_ / "outside/model.safetensors";
  WriteModel(outside, 64 * kKiB, 14);
  models_.push_back({"linked", {"linked/model.safetensors"}});
  models_.push_back({"via", {"via/model.safetensors"}});
  WriteCatalog(catalog_, models_);
  // Real files while the daemon starts, symbolic links once it runs.
  const auto real_files = [&] {
    fs::remove_all(root_ + "/linked");
    fs::remove_all(root_ + "/via");
    WriteModel(root_ + "/linked/model.safetensors", 64 * kKiB, 14);
    WriteModel(root_ + "/via/model.safetensors", 64 * kKiB, 14);
  };
  const auto symlinks = [&] {
    fs::remove_all(root_ + "/linked");
    fs::remove_all(root_ + "/via");
    fs::create_directories(root_ + "/linked");
    fs::create_symlink(outside, root_ + "/linked/model.safetensors");
    fs::create_directory_symlink(dir_ / "outside", root_ + "/via");
  };
  // Any open of the outside file shows here.
  const int watch = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ASSERT_GE(watch, 0);
  ASSERT_GE(::inotify_add_watch(watch, outside.c_str(), IN_OPEN), 0);

  for (const bool per_component : {false, true}) {
    SCOPED_TRACE(per_component ? "one component at a time" : "openat2");
    std::vector<std::string> args;
    if (per_component) args.push_back("--test-per-component-open");
    real_files();
    Daemon& d = StartDaemon("1GiB", args);
    symlinks();
    Client client = Client::Connect(d.socket());
    for (const char* id : {"linked", "via"}) {
      try {
        client.Acquire(id, std::chrono::seconds(60));
        ADD_FAILURE() << id << " was loaded through a symbolic link";
      } catch (const ServeError& e) {
        EXPECT_EQ(e.serve_code(), ServeCode::kUnavailable) << e.what();
        EXPECT_THAT(e.what(), HasSubstr("symbolic link")) << e.what();
        EXPECT_EQ(e.code(), ErrorCode::kIo);
      }
    }
    RemoteWeights fine = client.Acquire("fine", std::chrono::seconds(60));
    EXPECT_EQ(Checksum(fine.files()[0].data()), checksums_["fine"]);
    fine.Release();
    const json model = d.Model("linked");
    EXPECT_THAT(model["reason"].get<std::string>(), HasSubstr("symbolic link"));
    ExpectBooksCoverMaps(d);
    daemon_.reset();
  }
  char events[4096];
  EXPECT_EQ(::read(watch, events, sizeof(events)), -1)
      << "the file outside the root was opened";
  ::close(watch);
}

TEST_F(ServeTest, ACatalogWithDotDotIsRefusedWithItsReason) {
  AddModel("ok", 64 * kKiB, 15);
  models_.push_back({"escape", {"../outside.safetensors"}});
  WriteCatalog(catalog_, models_);
  for (const bool check : {true, false}) {
    Process::Spec spec;
    const std::string out = dir_ / "out.txt";
    spec.argv = {"/bin/sh", "-c",
                 std::string(MODELCACHE_CLI) + " serve --catalog " + catalog_ +
                     " --model-root " + root_ + " --socket " + socket_ +
                     (check ? " --check-catalog" : " --http off") + " >" + out +
                     " 2>&1"};
    Process p(spec);
    const int status = p.Wait();
    EXPECT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 1);
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
    EXPECT_THAT(text, HasSubstr("model 'escape': file '../outside.safetensors' "
                                "has a '..' component"));
  }
  EXPECT_FALSE(fs::exists(socket_));
}

// Without --strict-catalog such a file costs only its model
// (serve_unavailable_test.cc).
TEST_F(ServeTest,
       TheStrictDaemonRefusesWhatTheCatalogCheckRefusesWithItsMessage) {
  AddModel("ok", 64 * kKiB, 42);
  const std::string outside = dir_ / "outside/model.safetensors";
  WriteModel(outside, 64 * kKiB, 43);
  fs::create_directories(root_ + "/evil");
  fs::create_symlink(outside, root_ + "/evil/model.safetensors");
  const std::vector<ModelSpec> good = models_;
  models_.push_back({"evil", {"evil/model.safetensors"}, /*pinned=*/true});
  WriteCatalog(catalog_, models_);
  const std::string where = "--catalog " + catalog_ + " --model-root " + root_;
  const auto [check_status, check] =
      RunCli(dir_, "serve " + where + " --check-catalog");
  EXPECT_EQ(check_status, 1);
  EXPECT_THAT(check, HasSubstr("symbolic link")) << check;
  // At start: refused, with the check's words, and nothing listens.
  const auto [start_status, start] =
      RunCli(dir_, "serve " + where + " --socket " + socket_ +
                       " --http off --strict-catalog");
  EXPECT_EQ(start_status, 1);
  EXPECT_EQ(start.substr(start.find("error: ")), check);
  EXPECT_FALSE(fs::exists(socket_));
  // On reload: refused with the same words; the old catalog stays.
  WriteCatalog(catalog_, good);
  Daemon& d = StartDaemon("1GiB", {"--strict-catalog"});
  WriteCatalog(catalog_, models_);
  d.process().Signal(SIGHUP);
  Eventually(
      [&] { return d.GetJson("/readyz").contains("catalog_reload_error"); },
      "the refused reload is reported");
  EXPECT_EQ(
      "error: " +
          d.GetJson("/readyz")["catalog_reload_error"].get<std::string>() +
          "\n",
      check);
  EXPECT_EQ(d.Get("/readyz").status, 200) << "the old catalog has no pin";
  EXPECT_EQ(d.Get("/v1/models/evil").status, 404);
  EXPECT_EQ(d.Get("/v1/models/ok").status, 200);
  Worker worker(d.socket());
  worker.Ok("acquire ok");
  worker.Ok("release-all");
}

TEST_F(ServeTest, ReadyzGivesAPinnedModelsRealReason) {
  AddModel("fits", 64 * kKiB, 44);
  AddModel("big", 3 * kMiB, 45, /*pinned=*/true);
  Daemon& d = StartDaemon("2MiB");
  Eventually(
      [&] {
        return d.Get("/readyz").body.find("load failed") != std::string::npos;
      },
      "/readyz names the pinned model's load failure");
  const HttpResult ready = d.Get("/readyz");
  EXPECT_EQ(ready.status, 503);
  const std::string reason = ready.Json()["reasons"][0].get<std::string>();
  EXPECT_THAT(reason, HasSubstr("pinned model 'big' is not resident: load "
                                "failed: "));
  EXPECT_EQ(reason.find("not resident yet"), std::string::npos) << reason;
  EXPECT_THAT(d.Model("big")["reason"].get<std::string>(),
              HasSubstr("load failed: "));
}

TEST_F(ServeTest, ATimeoutWaitingForRoomSaysSoAndNamesWhatHoldsIt) {
  AddModel("tiny", 3 * kMiB, 46);
  AddModel("tiny2", 3 * kMiB, 47);
  Daemon& d = StartDaemon("5MiB");
  Worker holder(d.socket());
  leases_.Add(holder.Ok("acquire tiny")[0]);
  Worker other(d.socket());
  const std::string reply = other.Do("acquire tiny2 300");
  EXPECT_THAT(reply, HasSubstr("error TIMEOUT"));
  EXPECT_THAT(reply, HasSubstr("within 300 ms: waiting for room"));
  EXPECT_THAT(reply, HasSubstr("held by: 'tiny' ("));
  EXPECT_THAT(reply, HasSubstr("1 lease"));
  EXPECT_EQ(reply.find("still running"), std::string::npos) << reply;
  holder.Ok("release-all");
}

TEST_F(ServeTest, ThePolicyIsTheRegistrysAndAnUnknownOneIsRefusedNamingThem) {
  AddModel("m", 64 * kKiB, 32);
  for (const char* policy : {"nope", "belady"}) {
    SCOPED_TRACE(policy);
    const std::string out = dir_ / "out.txt";
    Process::Spec spec;
    spec.argv = {"/bin/sh", "-c",
                 std::string(MODELCACHE_CLI) + " serve --catalog " + catalog_ +
                     " --model-root " + root_ + " --socket " + socket_ +
                     " --http off --policy " + policy + " >" + out + " 2>&1"};
    Process p(spec);
    const int status = p.Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)),
                           std::istreambuf_iterator<char>());
    EXPECT_THAT(text, HasSubstr(policy));
    EXPECT_THAT(text, HasSubstr("next-use"));
    EXPECT_THAT(text, HasSubstr("hybrid-histogram"));
  }
  // A keep-alive policy serves like any other.
  Daemon& d = StartDaemon("1GiB", {"--policy", "hybrid-histogram"});
  Client client = Client::Connect(d.socket());
  RemoteWeights m = client.Acquire("m", std::chrono::seconds(60));
  leases_.Add(std::to_string(m.lease()));
  EXPECT_EQ(Checksum(m.files()[0].data()), checksums_["m"]);
}

TEST_F(ServeTest, AModelIdlePastATtlPolicysTtlIsUnloaded) {
  AddModel("m", 64 * kKiB, 32);
  Daemon& d = StartDaemon("1GiB", {"--policy", "ttl-200ms"});
  Client client = Client::Connect(d.socket());
  {
    RemoteWeights m = client.Acquire("m", std::chrono::seconds(60));
    leases_.Add(std::to_string(m.lease()));
    EXPECT_EQ(Checksum(m.files()[0].data()), checksums_["m"]);
    EXPECT_EQ(d.Model("m")["state"], "READY");
  }
  // No other request comes: the daemon itself notices the idle time. The
  // record leaves the store before its unloader has run, and the budget gets
  // the bytes back only once it has: wait for both.
  Eventually(
      [&] {
        return d.Model("m")["state"] == "UNAVAILABLE" &&
               d.Budget()["used_bytes"] == 0;
      },
      "the idle model is unloaded and its bytes returned");
  // And it loads again on demand.
  RemoteWeights again = client.Acquire("m", std::chrono::seconds(60));
  leases_.Add(std::to_string(again.lease()));
  EXPECT_EQ(d.Model("m")["loads"], 2);
}

TEST_F(ServeTest, EveryLimitAnswersBusyNamingItAndLoadsWaitForASlot) {
  AddModel("a", 64 * kKiB, 33);
  AddModel("b", 64 * kKiB, 34);
  AddModel("c", 64 * kKiB, 35);
  Daemon& d =
      StartDaemon("1GiB",
                  {"--max-requests-per-client", "1", "--max-leases-per-client",
                   "2", "--max-waiters", "2", "--load-slots", "1"},
                  /*gate=*/true);
  const auto expect_reply = [](Raw& raw, uint64_t id) {
    const auto reply = raw.Reply();
    EXPECT_TRUE(reply) << "no reply to " << id;
    if (!reply) return protocol::Reply{};
    EXPECT_EQ(reply->id, id);
    return *reply;
  };
  const auto expect_busy = [&](Raw& raw, uint64_t id, const std::string& says) {
    const protocol::Reply reply = expect_reply(raw, id);
    EXPECT_FALSE(reply.ok);
    EXPECT_EQ(reply.code, ServeCode::kBusy);
    EXPECT_THAT(reply.message, HasSubstr(says));
  };
  const auto expect_lease = [&](Raw& raw, uint64_t id) {
    const protocol::Reply reply = expect_reply(raw, id);
    EXPECT_TRUE(reply.ok) << reply.message;
    leases_.Add(std::to_string(reply.lease));
    return reply.lease;
  };
  Raw first(d.socket());
  ASSERT_TRUE(first.Send(protocol::EncodeAcquire(1, "a", 600000, false)));
  // One acquire waiting is this connection's limit (--max-requests-...).
  ASSERT_TRUE(first.Send(protocol::EncodeAcquire(2, "b", 600000, false)));
  expect_busy(first, 2, "1 acquires waiting (the limit is 1)");
  Raw second(d.socket());
  ASSERT_TRUE(second.Send(protocol::EncodeAcquire(1, "b", 600000, false)));
  Eventually([&] { return d.Metric("modelcache_waiting_acquires") == 2; },
             "two acquires waiting");
  // One load slot: 'a' loads (held at the gate) and 'b' waits for the slot.
  Eventually([&] { return d.Model("a")["state"] == "LOADING"; }, "'a' loading");
  EXPECT_EQ(d.Model("b")["state"], "UNAVAILABLE");
  // Two acquires waiting is the daemon's limit (--max-waiters).
  Raw third(d.socket());
  ASSERT_TRUE(third.Send(protocol::EncodeAcquire(1, "c", 600000, false)));
  expect_busy(third, 1, "2 acquires are waiting (the limit is 2)");

  d.OpenGate();  // 'a' loads; its slot goes to 'b'
  const uint64_t a = expect_lease(first, 1);
  Eventually([&] { return d.Model("b")["state"] == "LOADING"; },
             "'b' loading once 'a' left the slot");
  d.CloseGate();
  const uint64_t b = expect_lease(second, 1);
  // Two leases is a connection's limit (--max-leases-per-client), hit or
  // not.
  ASSERT_TRUE(first.Send(protocol::EncodeAcquire(3, "b", 600000, false)));
  const uint64_t b_too = expect_lease(first, 3);
  ASSERT_TRUE(first.Send(protocol::EncodeAcquire(4, "b", 600000, false)));
  expect_busy(first, 4, "holds 2 leases and waits for 0 (the limit is 2)");
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"busy\"}"), 3);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 2);
  // Once a lease ends there is room again.
  ASSERT_TRUE(first.Send(protocol::EncodeRelease(5, a)));
  EXPECT_TRUE(expect_reply(first, 5).ok);
  ASSERT_TRUE(first.Send(protocol::EncodeAcquire(6, "c", 600000, false)));
  const uint64_t c = expect_lease(first, 6);
  for (const auto& [raw, lease] :
       {std::pair<Raw*, uint64_t>{&first, b_too}, {&first, c}, {&second, b}}) {
    ASSERT_TRUE(raw->Send(protocol::EncodeRelease(7, lease)));
    EXPECT_TRUE(expect_reply(*raw, 7).ok);
  }
}

TEST_F(ServeTest, ErrorsNameTheirCause) {
  AddModel("small", 64 * kKiB, 16);
  AddModel("huge", 4 * kMiB, 17);
  // Valid when the daemon starts, broken by its first load: the model is
  // unavailable, with the file's error as its cause.
  WriteModel(root_ + "/broken.safetensors", 4 * kKiB, 18);
  models_.push_back({"broken", {"broken.safetensors"}});
  WriteCatalog(catalog_, models_);
  Daemon& d = StartDaemon("2MiB", {}, /*gate=*/true);
  std::ofstream(root_ + "/broken.safetensors") << "not a safetensors file";
  Client client = Client::Connect(d.socket());
  const auto code_of = [&](const std::string& model,
                           std::chrono::milliseconds timeout) {
    try {
      client.Acquire(model, timeout);
    } catch (const ServeError& e) {
      return std::make_pair(e.serve_code(), std::string(e.what()));
    }
    return std::make_pair(ServeCode::kInvalid, std::string("no error"));
  };
  auto [code, message] = code_of("huge", std::chrono::seconds(60));
  EXPECT_EQ(code, ServeCode::kTooLarge) << message;
  // The gate holds the load: the daemon's timer answers.
  std::tie(code, message) = code_of("small", std::chrono::milliseconds(100));
  EXPECT_EQ(code, ServeCode::kTimeout) << message;
  EXPECT_THAT(message, HasSubstr("within 100 ms"));
  d.CloseGate();
  std::tie(code, message) = code_of("broken", std::chrono::seconds(60));
  EXPECT_EQ(code, ServeCode::kUnavailable) << message;
  EXPECT_THAT(message, HasSubstr("broken.safetensors"));
  try {
    client.Acquire("broken", std::chrono::seconds(60));
  } catch (const ServeError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidData) << "a format error's cause";
  }
  RemoteWeights small = client.Acquire("small", std::chrono::seconds(60));
  EXPECT_EQ(small.Find("first")->dtype(), weights::Dtype::kF32);
  EXPECT_EQ(small.Find("scalar")->shape().size(), 0u);
  EXPECT_EQ(small.Find("nothing"), nullptr);
  EXPECT_THROW(small.data("nothing"), Error);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"too_large\"}"), 1);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"timeout\"}"), 1);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"unavailable\"}"), 2);
}

TEST_F(ServeTest, TheHttpApiShowsAndSteersTheStore) {
  AddModel("a", 256 * kKiB, 18);
  AddModel("b", 256 * kKiB, 19);
  Daemon& d = StartDaemon();
  EXPECT_EQ(d.Get("/healthz").status, 200);
  EXPECT_EQ(d.Get("/readyz").status, 200);
  EXPECT_EQ(d.Get("/nothing").status, 404);
  EXPECT_EQ(d.Get("/v1/models/ghost").status, 404);
  EXPECT_EQ(d.Get("/v1/models/..").status, 400);
  // Changes only on the admin listener.
  EXPECT_EQ(d.Send("POST", "/v1/models/a/load", "", /*admin=*/false).status,
            403);
  EXPECT_EQ(d.Send("POST", "/v1/models/a/load").status, 200);
  EXPECT_EQ(d.Model("a")["state"], "READY");
  EXPECT_EQ(d.Model("a")["loads"], 1);
  EXPECT_EQ(d.Send("POST", "/v1/models/a/launch").status, 404);
  // Pin: never evicted, even by a shrink.
  EXPECT_EQ(d.Send("POST", "/v1/models/b/pin").status, 200);
  EXPECT_EQ(d.Model("b")["pinned"], true);
  EXPECT_EQ(
      d.Send("PUT", "/v1/budget", "{\"capacity_bytes\": \"300KiB\"}").status,
      200);
  EXPECT_EQ(d.Model("b")["state"], "READY");
  EXPECT_EQ(d.Model("a")["state"], "UNAVAILABLE") << "evicted by the shrink";
  EXPECT_EQ(d.Send("POST", "/v1/models/b/unpin").status, 200);
  EXPECT_EQ(
      d.Send("PUT", "/v1/budget", "{\"capacity_bytes\": 1073741824}").status,
      200);
  EXPECT_EQ(d.Budget()["capacity_bytes"], 1073741824);
  EXPECT_EQ(d.Send("PUT", "/v1/budget", "{\"capacity\": 1}").status, 400);
  EXPECT_EQ(d.Send("PUT", "/v1/budget", std::string(100 * 1024, ' ')).status,
            413);
  // Unload of a leased model retires it.
  Client client = Client::Connect(d.socket());
  RemoteWeights held = client.Acquire("b", std::chrono::seconds(60));
  leases_.Add(std::to_string(held.lease()));
  const HttpResult unload = d.Send("POST", "/v1/models/b/unload");
  EXPECT_EQ(unload.status, 200);
  EXPECT_EQ(unload.Json()["outcome"], "retired");
  EXPECT_THAT(unload.Json()["message"].get<std::string>(),
              HasSubstr("1 leases"));
  EXPECT_EQ(d.Model("b")["state"], "UNAVAILABLE");
  EXPECT_GT(d.Model("b")["retired_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(Checksum(held.files()[0].data()), checksums_["b"]);
  held.Release();
  Eventually([&] { return d.Model("b")["retired_bytes"] == 0; },
             "the retired copy is freed by its last lease");
  EXPECT_EQ(d.Send("POST", "/v1/models/b/unload").Json()["outcome"],
            "not_resident");
  const json list = d.GetJson("/v1/models");
  EXPECT_EQ(list["models"].size(), 2u);
}

TEST_F(ServeTest, MetricsPassPromtool) {
  AddModel("m1", 64 * kKiB, 20);
  AddModel("m2", 64 * kKiB, 21);
  Daemon& d =
      StartDaemon("1GiB", {"--per-model-metrics", "--throttle-load-bandwidth",
                           "1GB/s", "--throttle-load-latency", "1ms"});
  {
    Client client = Client::Connect(d.socket());
    RemoteWeights w = client.Acquire("m1", std::chrono::seconds(60));
    try {
      client.Acquire("ghost", std::chrono::seconds(1));
    } catch (const ServeError&) {
    }
    EXPECT_THAT(d.Get("/metrics").body,
                HasSubstr("modelcache_model_leases{model=\"m1\"} 1"));
    ExpectPromtoolPasses(d, dir_ / "metrics.txt");
  }
  for (const char* name :
       {"modelcache_budget_capacity_bytes",
        "modelcache_budget_used_bytes",
        "modelcache_budget_high_water_bytes",
        "modelcache_resident_bytes",
        "modelcache_retired_bytes",
        "modelcache_orphaned_bytes",
        "modelcache_resident_models",
        "modelcache_leases",
        "modelcache_clients",
        "modelcache_waiting_acquires",
        "modelcache_loads_total",
        "modelcache_load_failures_total",
        "modelcache_evictions_total",
        "modelcache_loaded_bytes_total",
        "modelcache_protocol_errors_total",
        "modelcache_load_duration_seconds_count",
        "modelcache_acquire_wait_seconds_count",
        "modelcache_throttle_load_bandwidth_bytes_per_second",
        "modelcache_throttle_load_latency_seconds",
        "modelcache_throttle_held_seconds_total"}) {
    EXPECT_GE(d.Metric(name), 0) << name;
  }
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"not_found\"}"), 1);
  EXPECT_EQ(d.Metric("modelcache_load_duration_seconds_count"), 1);
}

// SIGTERM abandons a load in flight rather than finishing it (a copy is a
// cache; a supervisor's stop timeout wants a prompt exit).
TEST_F(ServeTest, SigtermAnswersWaitersAndAbandonsTheLoadInFlight) {
  AddModel("held", 256 * kKiB, 22);
  AddModel("slow", 256 * kKiB, 23);
  Daemon& d = StartDaemon("1GiB", {}, /*gate=*/true);
  // Any read of the slow model's file from now on shows here (the start's
  // catalog check has read its header already).
  const int watch = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ASSERT_GE(watch, 0);
  ASSERT_GE(::inotify_add_watch(
                watch, (root_ + "/slow/model.safetensors").c_str(), IN_ACCESS),
            0);
  d.OpenGate();  // one load passes: 'held'
  Worker holder(d.socket());
  const auto got = holder.Ok("acquire held");
  Worker waiter(d.socket());
  waiter.Send("acquire slow 600000");
  Eventually([&] { return d.Metric("modelcache_waiting_acquires") == 1; },
             "the acquire of 'slow' waits at the gate");
  d.process().Signal(SIGTERM);
  const std::string answer = waiter.Receive();
  EXPECT_THAT(answer, HasSubstr("error UNAVAILABLE"));
  EXPECT_THAT(answer, HasSubstr("shutting down"));
  // The load of 'slow' is still in flight (held at the gate, before its
  // read): the daemon waits for it to stop.
  EXPECT_FALSE(d.process().Exited());
  EXPECT_FALSE(fs::exists(d.socket())) << "still accepting";
  d.CloseGate();
  const int status = d.process().Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  char events[4096];
  EXPECT_EQ(::read(watch, events, sizeof(events)), -1)
      << "the load went on to read its file after SIGTERM";
  ::close(watch);
  // The holder's copy outlives the daemon.
  EXPECT_EQ(holder.Ok("checksum"), std::vector<std::string>{got[1]});
}

// ---- the load throttle (a testing and sizing knob) ----
//
// A throttle promises "no earlier than": each check below is a lower bound
// that the model implies and that a throttle without it (no latency per
// load, or no sharing of the bandwidth) would break.

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

TEST_F(ServeTest, CheckCatalogJsonGivesEachModelsBytesInTheBudget) {
  // Data sizes on and off page boundaries.
  AddModel("small", 64 * kKiB, 43);
  AddModel("odd", 300 * kKiB + 123, 44);
  AddModel("big", 2 * kMiB, 45);
  const auto [status, out] =
      RunCli(dir_, "serve --check-catalog --json --catalog " + catalog_ +
                       " --model-root " + root_);
  ASSERT_EQ(status, 0) << out;
  const json check = json::parse(out, nullptr, false);
  ASSERT_TRUE(check.is_object()) << out;
  EXPECT_THAT(check["summary"].get<std::string>(), HasSubstr("valid"));
  ASSERT_EQ(check["models"].size(), 3u);
  Daemon& d = StartDaemon();
  Client client = Client::Connect(d.socket());
  for (const json& m : check["models"]) {
    const std::string id = m["id"].get<std::string>();
    RemoteWeights w = client.Acquire(id, std::chrono::seconds(60));
    leases_.Add(std::to_string(w.lease()));
    EXPECT_EQ(m["bytes"].get<uint64_t>(), CopyBytes(id)) << id;
  }
  uint64_t sum = 0;
  for (const json& m : check["models"]) sum += m["bytes"].get<uint64_t>();
  EXPECT_EQ(d.Budget()["used_bytes"].get<uint64_t>(), sum);
  // Without a root the files are not read: no bytes.
  const auto [status2, out2] =
      RunCli(dir_, "serve --check-catalog --json --catalog " + catalog_);
  ASSERT_EQ(status2, 0) << out2;
  EXPECT_TRUE(json::parse(out2)["models"][0]["bytes"].is_null()) << out2;
  const auto [status3, out3] =
      RunCli(dir_, "serve --json --catalog " + catalog_ + " --model-root " +
                       root_ + " --socket " + socket_ + " --http off");
  EXPECT_EQ(status3, 1);
  EXPECT_THAT(out3, HasSubstr("error: --json goes with --check-catalog"));
}

TEST_F(ServeTest,
       TheThrottleGivesEachLoadItsLatencyThenItsBytesOneSlotAtATime) {
  AddModel("a", 256 * kKiB, 46);
  AddModel("b", 256 * kKiB, 47);
  AddModel("c", 384 * kKiB, 48);
  const double bandwidth = 4.0 * kMiB;
  const double latency = 0.03;
  Daemon& d =
      StartDaemon("1GiB", {"--load-slots", "1", "--throttle-load-bandwidth",
                           "4MiB/s", "--throttle-load-latency", "30ms"});
  // One load alone: its latency, then its copy's bytes at the bandwidth.
  Client client = Client::Connect(d.socket());
  const auto t0 = Clock::now();
  RemoteWeights a = client.Acquire("a", std::chrono::seconds(60));
  const double took = Seconds(Clock::now() - t0);
  leases_.Add(std::to_string(a.lease()));
  EXPECT_GE(took, latency + static_cast<double>(CopyBytes("a")) / bandwidth);
  // Two at once through one slot: one after the other (FIFO), each with its
  // latency from when it got the slot.
  Raw raw(d.socket());
  const auto t1 = Clock::now();
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(1, "b", 600000, false)));
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(2, "c", 600000, false)));
  std::vector<uint64_t> order;
  for (int i = 0; i < 2; ++i) {
    const auto reply = raw.Reply();
    ASSERT_TRUE(reply);
    ASSERT_TRUE(reply->ok) << reply->message;
    leases_.Add(std::to_string(reply->lease));
    order.push_back(reply->id);
  }
  const double both = Seconds(Clock::now() - t1);
  EXPECT_EQ(order, (std::vector<uint64_t>{1, 2})) << "first come, first loaded";
  EXPECT_GE(both,
            2 * latency + static_cast<double>(CopyBytes("b") + CopyBytes("c")) /
                              bandwidth);
  // Its settings and what it held, in /metrics.
  EXPECT_EQ(d.Metric("modelcache_throttle_load_bandwidth_bytes_per_second"),
            bandwidth);
  EXPECT_DOUBLE_EQ(d.Metric("modelcache_throttle_load_latency_seconds"),
                   latency);
  EXPECT_GT(d.Metric("modelcache_throttle_held_seconds_total"), 0);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 3);
}

TEST_F(ServeTest, LoadsMovingBytesAtOnceShareTheThrottlesBandwidth) {
  AddModel("a", 512 * kKiB, 49);
  AddModel("b", 512 * kKiB, 50);
  const double bandwidth = 4.0 * kMiB;
  Daemon& d = StartDaemon(
      "1GiB", {"--load-slots", "2", "--throttle-load-bandwidth", "4MiB/s"});
  Raw raw(d.socket());
  const auto t0 = Clock::now();
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(1, "a", 600000, false)));
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(2, "b", 600000, false)));
  for (int i = 0; i < 2; ++i) {
    const auto reply = raw.Reply();
    ASSERT_TRUE(reply);
    ASSERT_TRUE(reply->ok) << reply->message;
    leases_.Add(std::to_string(reply->lease));
  }
  // Two slots, one bandwidth: both loads together take their bytes over
  // it, not the larger one's alone (each alone would take half of this).
  EXPECT_GE(Seconds(Clock::now() - t0),
            static_cast<double>(CopyBytes("a") + CopyBytes("b")) / bandwidth);
}

TEST_F(ServeTest, SigtermEndsALoadTheThrottleHolds) {
  AddModel("slow", 256 * kKiB, 51);
  // Hours for this load: only shutdown ends it.
  Daemon& d = StartDaemon("1GiB", {"--throttle-load-bandwidth", "16/s"});
  Raw raw(d.socket());
  ASSERT_TRUE(raw.Send(protocol::EncodeAcquire(1, "slow", 600000, false)));
  Eventually([&] { return d.Model("slow")["state"] == "LOADING"; },
             "the load is held");
  d.process().Signal(SIGTERM);
  const auto reply = raw.Reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->code, ServeCode::kUnavailable);
  const int status = d.process().Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(ServeTest, BadThrottleValuesAreRefusedNamingTheFlag) {
  AddModel("m", 64 * kKiB, 52);
  const std::string base = "serve --catalog " + catalog_ + " --model-root " +
                           root_ + " --socket " + socket_ + " --http off ";
  for (const char* bad :
       {"0", "0MB/s", "-5MB/s", "nan", "abc", "5XB/s", "MB/s", "/s"}) {
    SCOPED_TRACE(bad);
    const auto [status, out] =
        RunCli(dir_, base + "--throttle-load-bandwidth='" + bad + "'");
    EXPECT_EQ(status, 1) << out;
    EXPECT_THAT(out, HasSubstr("error: --throttle-load-bandwidth: not a "
                               "bandwidth: '" +
                               std::string(bad) + "'"));
  }
  for (const char* bad : {"-1ms", "nan", "inf", "x", "5 parsecs", "25h"}) {
    SCOPED_TRACE(bad);
    const auto [status, out] =
        RunCli(dir_, base + "--throttle-load-latency='" + bad + "'");
    EXPECT_EQ(status, 1) << out;
    EXPECT_THAT(out, HasSubstr("error: --throttle-load-latency: "));
    EXPECT_THAT(out, HasSubstr(bad));
  }
  EXPECT_FALSE(fs::exists(socket_));
}

TEST_F(ServeTest, SighupReloadsTheCatalogAndRetiresWhatLeftIt) {
  AddModel("stays", 64 * kKiB, 24);
  AddModel("goes", 64 * kKiB, 25);
  Daemon& d = StartDaemon();
  Worker worker(d.socket());
  const auto got = worker.Ok("acquire goes");
  leases_.Add(got[0]);
  models_.erase(models_.begin() + 1);
  const std::string file = "comes/model.safetensors";
  checksums_["comes"] = WriteModel(root_ + "/" + file, 64 * kKiB, 26);
  models_.push_back({"comes", {file}, /*pinned=*/true});
  WriteCatalog(catalog_, models_);
  d.process().Signal(SIGHUP);
  Eventually([&] { return d.Get("/v1/models/goes").status == 404; },
             "the reload drops 'goes'");
  Eventually([&] { return d.Get("/readyz").status == 200; },
             "the new pinned model is loaded");
  EXPECT_EQ(d.Model("comes")["pinned"], true);
  EXPECT_THAT(worker.Do("acquire goes"), HasSubstr("error NOT_FOUND"));
  EXPECT_EQ(worker.Ok("checksum"), std::vector<std::string>{got[1]})
      << "a current lease keeps its copy";
  EXPECT_GT(d.Metric("modelcache_retired_bytes"), 0);
  worker.Ok("release-all");
  Eventually([&] { return d.Metric("modelcache_retired_bytes") == 0; },
             "the retired copy goes with its lease");
  // A bad catalog is refused and the old one kept.
  std::ofstream(catalog_) << "{\"models\": [{\"id\": \"x\"}]}";
  d.process().Signal(SIGHUP);
  Eventually(
      [&] { return d.GetJson("/readyz").contains("catalog_reload_error"); },
      "the failed reload is reported");
  EXPECT_EQ(d.Get("/v1/models/stays").status, 200);
  worker.Ok("acquire stays");
  worker.Ok("release-all");
  d.Send("POST", "/v1/models/comes/unpin");
}

TEST_F(ServeTest, PinnedModelsLoadAtStartAndReadyWaitsForThem) {
  AddModel("pinned", 64 * kKiB, 27, /*pinned=*/true);
  Daemon& d = StartDaemon("1GiB", {}, /*gate=*/true);
  const HttpResult not_yet = d.Get("/readyz");
  EXPECT_EQ(not_yet.status, 503);
  EXPECT_THAT(not_yet.body, HasSubstr("pinned model 'pinned'"));
  d.CloseGate();
  Eventually([&] { return d.Get("/readyz").status == 200; },
             "the pinned model is resident");
  EXPECT_EQ(d.Model("pinned")["pinned"], true);
  d.Send("POST", "/v1/models/pinned/unpin");
}

TEST_F(ServeTest, ReadyzStaysUnreadyForTheGracePeriod) {
  AddModel("m", 64 * kKiB, 28);
  Daemon& d = StartDaemon("1GiB", {"--ready-grace", "1h"});
  const HttpResult r = d.Get("/readyz");
  EXPECT_EQ(r.status, 503);
  EXPECT_THAT(r.body, HasSubstr("grace period"));
  EXPECT_EQ(d.Get("/healthz").status, 200);
}

TEST_F(ServeTest, TheSocketAndItsFolderAreClosedToOthers) {
  AddModel("m", 64 * kKiB, 29);
  Daemon& d = StartDaemon();
  struct stat st;
  ASSERT_EQ(::stat(d.socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  ASSERT_EQ(::stat(fs::path(d.socket()).parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0750u);
  daemon_.reset();
  // A folder open to others is refused.
  ::chmod(fs::path(socket_).parent_path().c_str(), 0777);
  EXPECT_THROW(StartDaemon(), std::runtime_error);
  daemon_.reset();
  ::chmod(fs::path(socket_).parent_path().c_str(), 0750);
}

TEST_F(ServeTest, PeersOutsideTheAllowListAreRefused) {
  if (::geteuid() != 0)
    GTEST_SKIP() << "needs root to run a peer as another uid";
  AddModel("m", 64 * kKiB, 30);
  // Let group 0 reach the socket's folder (0750 itself).
  ::chmod(dir_.path().c_str(), 0750);
  Daemon& d = StartDaemon("1GiB", {"--allow-uid", "4242"});
  // uid 65534 in group 0: the socket's mode lets it in, the list does not.
  const std::string program =
      std::string(
          "import socket,os\n"
          "os.setgid(0); os.setgroups([]); os.setuid(65534)\n"
          "s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
          "s.settimeout(60)\n"
          "s.connect('") +
      d.socket() +
      "')\n"
      // The daemon refuses at accept, before any request: the reason is
      // queued, and a hello sent now could meet the closed socket (EPIPE).
      "print(s.recv(65536).decode())\n";
  const std::string out = dir_ / "peer.txt";
  Process::Spec spec;
  spec.argv = {"/bin/sh", "-c", "/usr/bin/python3 -c \"$0\" > " + out + " 2>&1",
               program};
  Process peer(spec);
  peer.Wait();
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("INVALID"));
  EXPECT_THAT(text, HasSubstr("uid 65534 is not allowed"));
  EXPECT_GE(d.Metric("modelcache_client_disconnects_total{reason=\"refused\"}"),
            1);
  // This process's uid is the daemon's: always allowed.
  Client::Connect(d.socket()).Ping();
}

}  // namespace
}  // namespace modelcache::serve::testing

namespace modelcache::serve::testing {
namespace {

// Workers acquire, check and release copies of three models in a budget that
// holds two, close their sockets while mapping, and die by SIGKILL, while a
// sampler checks the books against every process's maps and the budget.
TEST_F(ServeTest, StressWithASamplerKeepsEveryNever) {
  for (int i = 0; i < 3; ++i) {
    AddModel("s" + std::to_string(i), 512 * kKiB, 100 + i);
  }
  Daemon& d = StartDaemon("1300KiB");
  std::atomic<bool> done{false};
  std::atomic<int> samples{0};
  std::thread sampler([&] {
    while (!done.load()) {
      ExpectBooksCoverMaps(d);
      ExpectWithinBudget(d);
      ++samples;
    }
  });
  std::mutex mu;
  const auto add_lease = [&](const std::string& lease) {
    std::lock_guard<std::mutex> lock(mu);
    leases_.Add(lease);
  };
  constexpr int kWorkers = 5;
  constexpr int kRounds = 24;
  std::vector<std::thread> drivers;
  for (int w = 0; w < kWorkers; ++w) {
    drivers.emplace_back([&, w] {
      uint64_t state = 0x9e3779b97f4a7c15ull * (w + 1);
      const auto next = [&] {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        return state;
      };
      auto worker = std::make_unique<Worker>(d.socket());
      for (int round = 0; round < kRounds; ++round) {
        const std::string id = "s" + std::to_string(next() % 3);
        const auto got = worker->Ok("acquire " + id + " 120000");
        if (got.size() != 3) return;
        add_lease(got[0]);
        EXPECT_EQ(got[1], std::to_string(checksums_[id]));
        switch (next() % 6) {
          case 0:  // dies holding the lease
            worker->process().Signal(SIGKILL);
            worker->process().Wait();
            worker = std::make_unique<Worker>(d.socket());
            break;
          case 1:  // closes its socket, keeps the mapping a while
            worker->Ok("close");
            EXPECT_EQ(worker->Ok("checksum"), std::vector<std::string>{got[1]});
            worker->Ok("release-all");
            break;
          default:
            worker->Ok("release-all");
            break;
        }
      }
    });
  }
  for (std::thread& t : drivers) t.join();
  done = true;
  sampler.join();
  std::cout << samples.load() << " samples of the books while "
            << kWorkers * kRounds << " acquires ran\n";
  EXPECT_GT(samples.load(), 0);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"hit\"}") +
                d.Metric("modelcache_acquires_total{result=\"loaded\"}"),
            kWorkers * kRounds);
}

}  // namespace
}  // namespace modelcache::serve::testing
