// Missing or unreadable files cost their model, not the node: a model whose
// files fail the checks of --check-catalog is unavailable (its acquires
// fail with UNAVAILABLE at once, naming the file; /v1/models, /readyz,
// /metrics and one log line say so), the daemon starts and reloads without
// it, and a reload or an acquire after the back-off finds the files again
// (daemon_unavailable.cc). --strict-catalog keeps the old refusal. The
// restart and the takeover with a file gone are in serve_reclaim_test.cc
// and serve_takeover_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "modelcache/serve/client.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

using ::testing::HasSubstr;

class Unavailable : public ServeTest {
 protected:
  Unavailable() { daemon_log_ = dir_ / "daemon.log"; }

  std::string Log() const {
    std::ifstream in(daemon_log_);
    return std::string((std::istreambuf_iterator<char>(in)),
                       std::istreambuf_iterator<char>());
  }

  // How many times the log says `text`.
  int Said(const std::string& text) const {
    const std::string log = Log();
    int n = 0;
    for (size_t at = log.find(text); at != std::string::npos;
         at = log.find(text, at + text.size())) {
      ++n;
    }
    return n;
  }

  std::string File(const std::string& id) const {
    return root_ + "/" + id + "/model.safetensors";
  }

  // The ServeError an acquire of `model` fails with (kInvalid and "no
  // error" when it succeeds).
  ServeError AcquireError(Client& client, const std::string& model) {
    try {
      client.Acquire(model, std::chrono::seconds(60));
    } catch (const ServeError& e) {
      EXPECT_EQ(dynamic_cast<const DaemonUnavailableError*>(&e), nullptr)
          << "the daemon answered: " << e.what();
      return e;
    }
    return ServeError(ServeCode::kInvalid, "no error");
  }
};

TEST_F(Unavailable, AMissingFileCostsItsModelNotTheDaemon) {
  AddModel("x", 64 * kKiB, 1);
  AddModel("y", 64 * kKiB, 2);
  AddModel("gone", 64 * kKiB, 3);
  fs::remove(File("gone"));
  // A back-off no test outlives: every acquire below is refused without a
  // load.
  Daemon& d = StartDaemon("1GiB", {"--unavailable-retry", "1h"});

  Worker worker(d.socket());
  const std::vector<std::string> x = worker.Ok("acquire x");
  ASSERT_EQ(x.size(), 3u);
  leases_.Add(x[0]);
  EXPECT_EQ(x[1], std::to_string(checksums_["x"]));

  Client client = Client::Connect(d.socket());
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    const ServeError e = AcquireError(client, "gone");
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(30)) << "no wait";
    EXPECT_EQ(e.serve_code(), ServeCode::kUnavailable) << e.what();
    EXPECT_EQ(e.code(), ErrorCode::kIo) << "its cause: the file's error";
    EXPECT_THAT(e.what(), HasSubstr("model 'gone' is unavailable"));
    EXPECT_THAT(e.what(), HasSubstr("gone/model.safetensors: cannot open: No "
                                    "such file or directory"));
  }
  EXPECT_EQ(worker.Do("acquire gone").rfind("error UNAVAILABLE ", 0), 0u);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"unavailable\"}"), 4);
  EXPECT_EQ(d.Metric("modelcache_load_failures_total"), 0) << "no load tried";
  EXPECT_EQ(d.Metric("modelcache_waiting_acquires"), 0);

  const json gone = d.Model("gone");
  EXPECT_EQ(gone["state"], "UNAVAILABLE");
  ASSERT_TRUE(gone["unavailable"].is_object()) << gone.dump();
  EXPECT_THAT(gone["unavailable"]["error"].get<std::string>(),
              HasSubstr("gone/model.safetensors: cannot open"));
  EXPECT_GT(gone["unavailable"]["retry_in_seconds"].get<double>(), 60);
  EXPECT_THAT(gone["reason"].get<std::string>(),
              HasSubstr("files unavailable: gone/model.safetensors"));
  EXPECT_TRUE(d.Model("x")["unavailable"].is_null());
  EXPECT_TRUE(d.Model("y")["unavailable"].is_null());

  // Ready: the others serve.
  const HttpResult ready = d.Get("/readyz");
  EXPECT_EQ(ready.status, 200) << ready.body;
  EXPECT_TRUE(ready.Json()["reasons"].empty()) << ready.body;
  EXPECT_THAT(ready.Json()["unavailable"]["gone"].get<std::string>(),
              HasSubstr("gone/model.safetensors: cannot open"));

  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 1);
  EXPECT_EQ(d.Metric("modelcache_model_unavailable{model=\"gone\"}"), 1);
  ExpectPromtoolPasses(d, dir_ / "metrics.txt");
  EXPECT_EQ(Said("model 'gone' is unavailable"), 1) << Log();
  EXPECT_THAT(Log(), HasSubstr("gone/model.safetensors: cannot open"));

  // The file comes back; a reload finds it.
  checksums_["gone"] = WriteModel(File("gone"), 64 * kKiB, 3);
  d.process().Signal(SIGHUP);
  Eventually([&] { return d.Metric("modelcache_unavailable_models") == 0; },
             "the reload finds gone's file");
  EXPECT_TRUE(d.Model("gone")["unavailable"].is_null());
  EXPECT_FALSE(d.GetJson("/readyz").contains("unavailable"));
  const std::vector<std::string> back = worker.Ok("acquire gone");
  ASSERT_EQ(back.size(), 3u);
  leases_.Add(back[0]);
  EXPECT_EQ(back[1], std::to_string(checksums_["gone"]));
  EXPECT_EQ(Said("model 'gone' is available again"), 1) << Log();
  EXPECT_EQ(Said("model 'gone' is unavailable"), 1) << Log();
  worker.Ok("release-all");
}

// With no back-off every acquire of an unavailable model tries its files
// again, on the pool: a file that appears serves the next acquire.
TEST_F(Unavailable, AFileThatAppearsServesTheFirstAcquireAfterTheBackOff) {
  AddModel("x", 64 * kKiB, 4);
  AddModel("gone", 256 * kKiB, 5);
  fs::remove(File("gone"));
  Daemon& d = StartDaemon("1GiB", {"--unavailable-retry", "0"});
  Client client = Client::Connect(d.socket());
  for (int i = 0; i < 3; ++i) {
    const ServeError e = AcquireError(client, "gone");
    EXPECT_EQ(e.serve_code(), ServeCode::kUnavailable) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("gone/model.safetensors: cannot open"));
  }
  EXPECT_EQ(d.Metric("modelcache_load_failures_total"), 3)
      << "each acquire's load tried the file";
  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 1);
  EXPECT_EQ(Said("model 'gone' is unavailable"), 1)
      << "one line, not one per try:\n"
      << Log();

  checksums_["gone"] = WriteModel(File("gone"), 256 * kKiB, 5);
  RemoteWeights gone = client.Acquire("gone", std::chrono::seconds(60));
  leases_.Add(std::to_string(gone.lease()));
  EXPECT_EQ(gone.load(), "miss");
  EXPECT_EQ(Checksum(gone.files()[0].data()), checksums_["gone"]);
  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 0);
  EXPECT_TRUE(d.Model("gone")["unavailable"].is_null());
  EXPECT_EQ(d.Model("gone")["state"], "READY");
  EXPECT_EQ(Said("model 'gone' is available again"), 1) << Log();
}

// A file made invalid under a running daemon: the load that finds it so
// makes the model unavailable (not LOAD_FAILED), the next acquire within
// the back-off loads nothing, and a reload once it is valid again serves it.
TEST_F(Unavailable, ATruncatedFileMakesItsModelUnavailableUntilItIsValid) {
  AddModel("x", 64 * kKiB, 6);
  AddModel("cut", 512 * kKiB, 7);
  Daemon& d = StartDaemon("1GiB", {"--unavailable-retry", "1h"});
  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 0);
  fs::resize_file(File("cut"), fs::file_size(File("cut")) / 2);
  Client client = Client::Connect(d.socket());
  ServeError e = AcquireError(client, "cut");
  EXPECT_EQ(e.serve_code(), ServeCode::kUnavailable) << e.what();
  EXPECT_EQ(e.code(), ErrorCode::kInvalidData) << e.what();
  EXPECT_THAT(e.what(), HasSubstr("cut/model.safetensors"));
  EXPECT_EQ(d.Metric("modelcache_load_failures_total"), 1);
  // Within the back-off: refused at once, no load.
  e = AcquireError(client, "cut");
  EXPECT_EQ(e.serve_code(), ServeCode::kUnavailable) << e.what();
  EXPECT_EQ(d.Metric("modelcache_load_failures_total"), 1);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"unavailable\"}"), 2);
  EXPECT_EQ(d.Metric("modelcache_acquires_total{result=\"load_failed\"}"), 0);
  const json cut = d.Model("cut");
  EXPECT_EQ(cut["state"], "UNAVAILABLE");
  EXPECT_THAT(cut["unavailable"]["error"].get<std::string>(),
              HasSubstr("cut/model.safetensors"));
  EXPECT_EQ(d.Get("/readyz").status, 200);
  EXPECT_EQ(Said("model 'cut' is unavailable"), 1) << Log();

  // A reload while it is still cut: still unavailable, and x serves on.
  d.process().Signal(SIGHUP);
  Eventually([&] { return Said("catalog reloaded") == 1; }, "the reload");
  EXPECT_THAT(Log(), HasSubstr("catalog reloaded: 2 models, 1 unavailable"));
  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 1);
  RemoteWeights x = client.Acquire("x", std::chrono::seconds(60));
  EXPECT_EQ(Checksum(x.files()[0].data()), checksums_["x"]);

  checksums_["cut"] = WriteModel(File("cut"), 512 * kKiB, 7);
  d.process().Signal(SIGHUP);
  Eventually([&] { return d.Metric("modelcache_unavailable_models") == 0; },
             "the reload finds the file valid");
  RemoteWeights again = client.Acquire("cut", std::chrono::seconds(60));
  leases_.Add(std::to_string(again.lease()));
  EXPECT_EQ(Checksum(again.files()[0].data()), checksums_["cut"]);
}

// --strict-catalog: today's refusal at start, with the check's message,
// exit status 1 and nothing listening. (Its refusal on reload, and a start
// refused for a symbolic link, are in
// ServeTest.TheStrictDaemonRefusesWhatTheCatalogCheckRefusesWithItsMessage.)
TEST_F(Unavailable, StrictCatalogRefusesToStartAsBefore) {
  AddModel("x", 64 * kKiB, 8);
  AddModel("gone", 64 * kKiB, 9);
  fs::remove(File("gone"));
  const std::string where =
      "serve --catalog " + catalog_ + " --model-root " + root_;
  const auto [check_status, check] = RunCli(dir_, where + " --check-catalog");
  EXPECT_EQ(check_status, 1);
  EXPECT_EQ(check,
            "error: gone/model.safetensors: cannot open: No such file or "
            "directory\n");
  const auto [status, start] = RunCli(
      dir_, where + " --socket " + socket_ + " --http off --strict-catalog");
  EXPECT_EQ(status, 1);
  ASSERT_NE(start.find("error: "), std::string::npos) << start;
  EXPECT_EQ(start.substr(start.find("error: ")), check);
  EXPECT_FALSE(fs::exists(socket_));
}

// A pinned model whose file is missing: the daemon starts without it (and
// says so), is not ready only while no model at all can be served, and
// pins it once a reload finds its file.
TEST_F(Unavailable, APinnedModelWhoseFileIsMissingIsPinnedOnceItIsBack) {
  AddModel("p", 64 * kKiB, 10, /*pinned=*/true);
  fs::remove(File("p"));
  Daemon& d = StartDaemon();
  EXPECT_EQ(Said("pinned model 'p' is unavailable"), 1) << Log();
  const HttpResult ready = d.Get("/readyz");
  EXPECT_EQ(ready.status, 503) << ready.body;
  EXPECT_THAT(ready.body, HasSubstr("no model can be served"));
  EXPECT_EQ(ready.body.find("pinned model 'p' is not resident"),
            std::string::npos)
      << ready.body;
  EXPECT_THAT(ready.Json()["unavailable"]["p"].get<std::string>(),
              HasSubstr("p/model.safetensors"));
  EXPECT_EQ(d.Model("p")["pinned"], false);

  // Another model that serves makes the node ready, the pinned one still
  // missing.
  checksums_["q"] = WriteModel(File("q"), 64 * kKiB, 11);
  models_.push_back({"q", {"q/model.safetensors"}});
  WriteCatalog(catalog_, models_);
  d.process().Signal(SIGHUP);
  Eventually([&] { return d.Get("/readyz").status == 200; },
             "a model that serves makes the node ready");
  EXPECT_EQ(d.Metric("modelcache_unavailable_models"), 1);

  checksums_["p"] = WriteModel(File("p"), 64 * kKiB, 10);
  d.process().Signal(SIGHUP);
  Eventually([&] { return d.Model("p")["pinned"] == true; },
             "the pinned model is loaded and pinned once its file is back");
  EXPECT_EQ(d.Model("p")["state"], "READY");
  EXPECT_EQ(d.Get("/readyz").status, 200);
  Worker worker(d.socket());
  const std::vector<std::string> p = worker.Ok("acquire p");
  ASSERT_EQ(p.size(), 3u);
  leases_.Add(p[0]);
  EXPECT_EQ(p[1], std::to_string(checksums_["p"]));
  worker.Ok("release-all");
  d.Send("POST", "/v1/models/p/unpin");
}

}  // namespace
}  // namespace modelcache::serve::testing
