// Takeover: `modelcache serve --takeover` beside a running daemon takes its
// sockets, copies and leases; nothing is loaded again, the old daemon exits
// 0, and the bytes of leases held across it stay valid (daemon_handover.cc). A
// refused takeover leaves the old daemon serving, unchanged.
#include <gmock/gmock.h>

#include "handover.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

class Takeover : public ServeTest {};

TEST_F(Takeover, LoadsNothingKeepsHeldBytesValidAndTheOldDaemonExitsZero) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 1 * kMiB, 2);
  Daemon& d = StartDaemon("16MiB");
  Worker holder(d.socket());
  const std::vector<std::string> held = holder.Ok("acquire a");
  ASSERT_EQ(held.size(), 3u);
  leases_.Add(held[0]);
  EXPECT_EQ(held[1], std::to_string(checksums_["a"]));
  {
    Worker other(d.socket());
    const std::vector<std::string> b = other.Ok("acquire b");
    ASSERT_EQ(b.size(), 3u);
    leases_.Add(b[0]);
    other.Ok("release-all");
  }
  const double loads_before = d.Metric("modelcache_loads_total");
  EXPECT_EQ(loads_before, 2);
  const pid_t old_pid = d.pid();

  EXPECT_EQ(d.Takeover(), 0);  // the old daemon's exit status
  EXPECT_NE(d.pid(), old_pid);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 0);
  EXPECT_GT(d.Metric("modelcache_adopted_bytes_total{origin=\"taken_over\"}"),
            0);
  EXPECT_GT(d.Metric("modelcache_takeover_seconds"), 0);

  // The lease held across it reads the same bytes, is reclaimed on the new
  // daemon (the holder's client notices the old connection's end by
  // itself), and is released there as usual.
  EXPECT_EQ(holder.Ok("checksum"),
            std::vector<std::string>{std::to_string(checksums_["a"])});
  Eventually(
      [&] {
        return d.Metric("modelcache_reclaims_total{result=\"accepted\"}") == 1;
      },
      "the held lease reclaimed");
  // The daemon counts the reclaim before its answer reaches the client.
  const std::vector<std::string> reclaimed{"1", "0", "0", "0"};
  Eventually([&] { return holder.Ok("reclaims") == reclaimed; },
             "the holder counts its reclaim");
  EXPECT_EQ(d.Metric("modelcache_orphaned_bytes"), 0);
  Worker fresh(d.socket());
  const std::vector<std::string> again = fresh.Ok("acquire b");
  ASSERT_EQ(again.size(), 3u);
  leases_.Add(again[0]);
  EXPECT_EQ(again[1], std::to_string(checksums_["b"]));
  fresh.Ok("release-all");
  holder.Ok("release-all");
  Eventually([&] { return d.Metric("modelcache_leases") == 0; },
             "every lease released on the new daemon");
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 0);
  ExpectWithinBudget(d);
}

// Four workers loop acquire, checksum, release across a takeover: none of
// their requests fails, the two daemons load each model once between them,
// and the new one ends with every lease released.
TEST_F(Takeover, UnderLoadNoRequestFailsAndNothingIsLoadedTwice) {
  const std::vector<std::string> models = {"a", "b", "c"};
  for (size_t i = 0; i < models.size(); ++i) {
    AddModel(models[i], (i + 1) * kMiB, i + 1);
  }
  Daemon& d = StartDaemon("64MiB");
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < 4; ++i) {
    workers.push_back(std::make_unique<Worker>(d.socket()));
    // Each starts at another model.
    std::string line = "cycle-start 60000";
    for (size_t k = 0; k < models.size(); ++k) {
      line += " " + models[(i + k) % models.size()];
    }
    workers.back()->Ok(line);
  }
  // Every worker is well into its loop, every model loaded.
  for (auto& w : workers) w->Ok("cycle-wait 20");
  const double old_loads = d.Metric("modelcache_loads_total");
  EXPECT_EQ(old_loads, static_cast<double>(models.size()));

  EXPECT_EQ(d.Takeover(), 0);
  // And each goes on on the new one.
  for (auto& w : workers) w->Ok("cycle-wait 20");
  for (auto& w : workers) {
    const std::vector<std::string> end = w->Ok("cycle-stop");
    ASSERT_GE(end.size(), 2u);
    EXPECT_EQ(end[1], "0") << "failed requests: "
                           << ::testing::PrintToString(end);
    std::set<std::string> seen(end.begin() + 2, end.end());
    std::set<std::string> expected;
    for (const std::string& m : models) {
      expected.insert(m + "=" + std::to_string(checksums_[m]));
    }
    EXPECT_EQ(seen, expected);
  }
  EXPECT_EQ(old_loads + d.Metric("modelcache_loads_total"),
            static_cast<double>(models.size()));
  Eventually([&] { return d.Metric("modelcache_leases") == 0; },
             "every lease released on the new daemon");
  EXPECT_EQ(d.Metric("modelcache_orphaned_bytes"), 0);
  ExpectWithinBudget(d);
}

TEST_F(Takeover, ARefusedTakeoverLeavesTheOldDaemonServing) {
  AddModel("a", 1 * kMiB, 1);
  Daemon& d = StartDaemon("16MiB");
  Worker worker(d.socket());
  worker.Ok("acquire a");
  const pid_t old_pid = d.pid();
  // The catalogs disagree: the new daemon reads one more model.
  AddModel("b", 1 * kMiB, 2);
  EXPECT_THROW(d.Takeover(), std::runtime_error);
  EXPECT_EQ(d.pid(), old_pid);
  EXPECT_FALSE(d.process().Exited());
  // It serves on, unchanged: its copy, its lease, new acquires.
  EXPECT_EQ(worker.Ok("checksum"),
            std::vector<std::string>{std::to_string(checksums_["a"])});
  Worker other(d.socket());
  const std::vector<std::string> again = other.Ok("acquire a");
  ASSERT_EQ(again.size(), 3u);
  EXPECT_EQ(again[1], std::to_string(checksums_["a"]));
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1);
  other.Ok("release-all");
  worker.Ok("release-all");
}

// A takeover of another handover version (a binary whose books this one
// cannot read) is refused with one error reply; the daemon serves on.
TEST_F(Takeover, AnotherHandoverVersionIsRefusedAndTheDaemonServesOn) {
  AddModel("a", 1 * kMiB, 1);
  Daemon& d = StartDaemon("16MiB");
  Worker worker(d.socket());
  const std::vector<std::string> got = worker.Ok("acquire a");
  ASSERT_EQ(got.size(), 3u);
  leases_.Add(got[0]);
  Raw raw(d.socket());
  ASSERT_TRUE(raw.Send(protocol::EncodeHello(1)));
  ASSERT_TRUE(raw.Reply());
  ASSERT_TRUE(raw.Send(protocol::EncodeTakeover(2, detail::kHandoverVersion + 1,
                                                "0000000000000000:0")));
  const auto reply = raw.Reply();
  ASSERT_TRUE(reply);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->code, ServeCode::kInvalid);
  EXPECT_THAT(
      reply->message,
      ::testing::HasSubstr("handover version " +
                           std::to_string(detail::kHandoverVersion + 1)));
  // Unchanged: its lease, its copy, new acquires on the same connection
  // and others.
  ASSERT_TRUE(raw.Send(protocol::EncodePing(3)));
  const auto pong = raw.Reply();
  ASSERT_TRUE(pong);
  EXPECT_TRUE(pong->ok);
  EXPECT_EQ(worker.Ok("checksum"),
            std::vector<std::string>{std::to_string(checksums_["a"])});
  Worker other(d.socket());
  const std::vector<std::string> again = other.Ok("acquire a");
  ASSERT_EQ(again.size(), 3u);
  leases_.Add(again[0]);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 1);
  other.Ok("release-all");
  worker.Ok("release-all");
}

// A model's file gone does not refuse a takeover of the copies in memory:
// the new daemon starts (it refused to before), its copy is handed over
// and serves without its file, and the model is unavailable for what is
// not resident.
TEST_F(Takeover, AFileGoneDoesNotRefuseTheTakeoverOfItsCopy) {
  AddModel("a", 1 * kMiB, 1);
  AddModel("b", 1 * kMiB, 2);
  Daemon& d = StartDaemon("16MiB");
  {
    Worker worker(d.socket());
    leases_.Add(worker.Ok("acquire a")[0]);
    worker.Ok("release-all");
  }
  fs::remove(root_ + "/a/model.safetensors");

  EXPECT_EQ(d.Takeover(), 0);
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 1);
  Worker fresh(d.socket());
  const std::vector<std::string> got = fresh.Ok("acquire a");
  ASSERT_EQ(got.size(), 3u);
  leases_.Add(got[0]);
  EXPECT_EQ(got[1], std::to_string(checksums_["a"]));
  EXPECT_EQ(d.Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(d.Model("a")["state"], "READY");
  EXPECT_TRUE(d.Model("a")["unavailable"].is_object());
  const std::vector<std::string> b = fresh.Ok("acquire b");
  ASSERT_EQ(b.size(), 3u);
  leases_.Add(b[0]);
  EXPECT_EQ(b[1], std::to_string(checksums_["b"]));
  fresh.Ok("release-all");
  fresh.Ok("ping");  // answered after the releases: the daemon has them

  // Once its copy goes, its acquires are refused, naming the file.
  EXPECT_EQ(d.Send("POST", "/v1/models/a/unload").Json()["outcome"], "removed");
  const std::string refused = fresh.Do("acquire a");
  EXPECT_EQ(refused.rfind("error UNAVAILABLE ", 0), 0u) << refused;
  EXPECT_NE(refused.find("a/model.safetensors"), std::string::npos) << refused;
}

}  // namespace
}  // namespace modelcache::serve::testing
