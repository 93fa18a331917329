// Retired copies, tested with a real daemon and real client processes
// (serve_test_worker): a copy the daemon retires (a SIGHUP reload that
// changes the model's files, an HTTP unload) is never reused locally. An
// idle delegation of it is recalled and released; a lease in use keeps the
// copy for the references that hold it, but neither Acquire nor
// AcquireLocal takes a new reference to it, not even while the daemon is
// away (SIGKILLed): the next Acquire asks the daemon for the current copy.
// Every wait is on a reply, a pipe or the daemon's books (Eventually), never
// a sleep.
#include <gtest/gtest.h>

#include <csignal>
#include <string>
#include <vector>

#include "modelcache/serve/client.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

// A worker that keeps idle leases and tells the daemon at once.
constexpr const char* kDelegating = " reuse=1 keep_idle_ms=600000 notice_us=0";
constexpr uint64_t kModelBytes = 256 * kKiB;

class RetireTest : public ServeTest {
 protected:
  double Recalls(const std::string& answer) {
    return daemon_->Metric("modelcache_recalls_total{answer=\"" + answer +
                           "\"}");
  }
  std::unique_ptr<Worker> Connected() {
    auto worker = std::make_unique<Worker>();
    EXPECT_EQ(worker->Do("connect " + daemon_->socket() + kDelegating), "ok");
    return worker;
  }
  // `worker`'s acquire of `model`, held: its lease, checksum and bytes.
  std::vector<std::string> Acquired(Worker& worker, const std::string& model) {
    std::vector<std::string> got = worker.Ok("acquire " + model);
    leases_.Add(got.at(0));
    return got;
  }
  // Makes `worker` hold an idle delegation of `model`, the daemon told;
  // returns its lease.
  std::string HoldIdle(Worker& worker, const std::string& model) {
    const std::string lease = Acquired(worker, model)[0];
    worker.Ok("release " + model);
    Eventually(
        [&] {
          return daemon_->Metric("modelcache_delegated_leases{use=\"idle\"}") ==
                 1;
        },
        "an idle delegation");
    return lease;
  }
  // Retires `id`'s copy by a reload: the catalog names another file for it
  // (new bytes, from `seed`), and the daemon is sent SIGHUP.
  void ReloadWithNewFile(const std::string& id, uint64_t seed) {
    const std::string file = id + "/v2.safetensors";
    checksums_[id] = WriteModel(root_ + "/" + file, kModelBytes, seed);
    for (ModelSpec& spec : models_) {
      if (spec.id == id) spec.files = {file};
    }
    WriteCatalog(catalog_, models_);
    daemon_->process().Signal(SIGHUP);
  }
  // Stops the daemon as a crash would, and reaps it.
  void Crash() {
    daemon_->process().Signal(SIGKILL);
    daemon_->process().Wait();
  }
};

const std::vector<std::string> kNone{"none"};

TEST_F(RetireTest, AnIdleDelegationOfACopyRetiredByAReloadIsNotReused) {
  AddModel("m", kModelBytes, 1);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::string old_lease = HoldIdle(*worker, "m");
  const uint64_t old_checksum = checksums_["m"];

  ReloadWithNewFile("m", 2);
  Eventually([&] { return Recalls("release") == 1; },
             "the idle delegation is recalled and released");
  EXPECT_EQ(worker->Ok("idle"), std::vector<std::string>{"0"});
  EXPECT_EQ(worker->Ok("acquire-local m"), kNone);

  const std::vector<std::string> fresh = Acquired(*worker, "m");
  EXPECT_NE(fresh[0], old_lease);
  EXPECT_EQ(fresh[1], std::to_string(checksums_["m"]));
  EXPECT_NE(fresh[1], std::to_string(old_checksum)) << "the new file's bytes";
  EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
            std::vector<std::string>{"1"})
      << "the retired copy is unmapped";
  worker->Ok("release-all");
}

TEST_F(RetireTest, AnIdleDelegationOfAnUnloadedCopyIsNotServedInAnOutage) {
  AddModel("m", kModelBytes, 3);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  HoldIdle(*worker, "m");

  EXPECT_EQ(d.Send("POST", "/v1/models/m/unload").status, 200);
  Eventually([&] { return Recalls("release") == 1; },
             "the idle delegation is recalled and released");
  Crash();
  EXPECT_EQ(worker->Ok("acquire-local m"), kNone);
  EXPECT_EQ(worker->Ok("idle"), std::vector<std::string>{"0"});
  EXPECT_EQ(worker->Ok("maps " + d.memfd_prefix()),
            std::vector<std::string>{"0"});
}

TEST_F(RetireTest, ALeaseInUseOfARetiredCopyKeepsItButLendsItNoMore) {
  AddModel("m", kModelBytes, 4);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::vector<std::string> old = Acquired(*worker, "m");

  ReloadWithNewFile("m", 5);
  // The holder answers the retired recall "use": it has read it.
  Eventually([&] { return Recalls("busy") == 1; },
             "the lease in use is told its copy is retired");
  EXPECT_EQ(worker->Ok("checksum"), std::vector<std::string>{old[1]})
      << "its reference keeps the retired copy";
  EXPECT_EQ(worker->Ok("acquire-local m"), kNone);

  const std::vector<std::string> fresh = Acquired(*worker, "m");
  EXPECT_NE(fresh[0], old[0]) << "a round trip for the current copy";
  EXPECT_EQ(fresh[1], std::to_string(checksums_["m"]));
  EXPECT_EQ(worker->Ok("checksum"),
            (std::vector<std::string>{old[1], fresh[1]}));

  // The old reference's end releases the retired copy; the current one
  // is lent locally as before.
  worker->Ok("release m");
  Eventually([&] { return d.Metric("modelcache_retired_bytes") == 0; },
             "the retired copy goes with its last reference");
  const std::vector<std::string> local = worker->Ok("acquire-local m");
  ASSERT_EQ(local.size(), 4u);
  EXPECT_EQ(local[0], fresh[0]);
  EXPECT_EQ(local[3], "local");
  worker->Ok("release-all");
}

TEST_F(RetireTest, ALeaseInUseOfAnUnloadedCopyIsNotLentInAnOutage) {
  AddModel("m", kModelBytes, 6);
  Daemon& d = StartDaemon();
  auto worker = Connected();
  const std::vector<std::string> old = Acquired(*worker, "m");

  EXPECT_EQ(d.Send("POST", "/v1/models/m/unload").Json()["outcome"], "retired");
  Eventually([&] { return Recalls("busy") == 1; },
             "the lease in use is told its copy is retired");
  Crash();
  EXPECT_EQ(worker->Ok("acquire-local m"), kNone);
  EXPECT_EQ(worker->Ok("checksum"), std::vector<std::string>{old[1]})
      << "its reference keeps the copy through the outage";
}

// A copy reclaimed after a crash, of a model the catalog no longer lists,
// is adopted retired: its holder keeps its reference but lends it no more.
TEST_F(RetireTest, AReclaimedLeaseOfAModelTheCatalogDroppedIsLentNoMore) {
  AddModel("m", kModelBytes, 7);
  AddModel("n", kModelBytes, 8);
  StartDaemon();
  auto worker = Connected();
  const std::vector<std::string> old = Acquired(*worker, "m");

  Crash();
  models_.erase(models_.begin());  // "m" leaves the catalog
  WriteCatalog(catalog_, models_);
  daemon_->Start();
  Eventually([&] { return worker->Ok("reclaims")[0] == "1"; },
             "the lease is reclaimed");
  Eventually([&] { return Recalls("busy") == 1; },
             "the holder is told its copy is retired");
  EXPECT_EQ(worker->Ok("acquire-local m"), kNone);
  EXPECT_EQ(worker->Ok("checksum"), std::vector<std::string>{old[1]});
  worker->Ok("release m");
  Eventually([&] { return daemon_->Metric("modelcache_retired_bytes") == 0; },
             "the retired copy goes with its last reference");
}

}  // namespace
}  // namespace modelcache::serve::testing
