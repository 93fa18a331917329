// The serve layer's parts alone: the protocol's parsers and encoders, the
// catalog's rules, the /proc/PID/maps reader, and opening files beneath the
// model root with either resolver.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "files.h"
#include "modelcache/serve/catalog.h"
#include "modelcache/serve/errors.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"
#include "proc_maps.h"
#include "protocol.h"
#include "throttle.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// ---- protocol ----

TEST(Protocol, ParsesEveryOpWithItsFields) {
  auto p = protocol::ParseRequest(
      R"({"op":"acquire","id":7,"model":"sdxl-1.0_b","timeout_ms":250,"when_full":"fail"})");
  ASSERT_TRUE(p.request) << p.error;
  EXPECT_EQ(p.request->op, protocol::Op::kAcquire);
  EXPECT_EQ(p.request->id, 7u);
  EXPECT_EQ(p.request->model, "sdxl-1.0_b");
  EXPECT_EQ(p.request->timeout_ms, 250u);
  EXPECT_TRUE(p.request->fail_when_full);

  p = protocol::ParseRequest(R"({"id":1,"op":"acquire","model":"m"})");
  ASSERT_TRUE(p.request);
  EXPECT_EQ(p.request->timeout_ms, protocol::kDefaultTimeoutMs);
  EXPECT_FALSE(p.request->fail_when_full);

  p = protocol::ParseRequest(
      R"({"op":"release","id":18446744073709551615,"lease":3})");
  ASSERT_TRUE(p.request) << p.error;
  EXPECT_EQ(p.request->id, UINT64_MAX);
  EXPECT_EQ(p.request->lease, 3u);

  p = protocol::ParseRequest(R"({"op":"hello","id":2,"version":1})");
  ASSERT_TRUE(p.request);
  EXPECT_EQ(p.request->op, protocol::Op::kHello);
  p = protocol::ParseRequest(R"( {"op" : "ping" , "id" : 3} )");
  ASSERT_TRUE(p.request) << p.error;
}

TEST(Protocol, RefusesWithAReasonAndTheIdWhenItWasRead) {
  const struct {
    std::string message;
    std::string says;
    uint64_t id;
  } cases[] = {
      {"", "not valid JSON", 0},
      {"{", "not valid JSON", 0},
      {"null", "must be a JSON object", 0},
      {R"({"id":5,"op":"ping"} {})", "not valid JSON", 5},
      {R"({"id":5,"op":"ping","x":[1]})", "must be a string or a non-negative",
       5},
      {R"({"id":5,"op":"ping","x":true})", "must be a string or a non-negative",
       5},
      {R"({"id":-1,"op":"ping"})", "must be a string or a non-negative", 0},
      {R"({"id":1.5,"op":"ping"})", "must be a string or a non-negative", 0},
      {R"({"id":0,"op":"ping"})", "from 1 to 2^64 - 1", 0},
      {R"({"id":"9","op":"ping"})", "from 1 to 2^64 - 1", 0},
      {R"({"id":18446744073709551616,"op":"ping"})", "must be a string", 0},
      {R"({"id":5})", "missing field 'op'", 5},
      {R"({"id":5,"op":7})", "'op' must be a string", 5},
      {R"({"id":5,"op":"PING"})", "unknown op 'PING'", 5},
      {R"({"id":5,"op":"ping","lease":1})", "does not belong to op 'ping'", 5},
      {R"({"id":5,"op":"ping","z":1})", "unknown field 'z'", 5},
      {R"({"id":5,"op":"ping","op":"ping"})", "duplicate field 'op'", 5},
      {R"({"id":5,"op":"acquire"})", "missing field 'model'", 5},
      {R"({"id":5,"op":"acquire","model":3})", "'model' must be a string", 5},
      {R"({"id":5,"op":"acquire","model":"a/b"})", "is not valid", 5},
      {R"({"id":5,"op":"acquire","model":"a..b"})", "is not valid", 5},
      {R"({"id":5,"op":"acquire","model":".hidden"})", "is not valid", 5},
      {R"({"id":5,"op":"acquire","model":""})", "is not valid", 5},
      {R"({"id":5,"op":"acquire","model":"m","timeout_ms":"1"})",
       "non-negative integer", 5},
      {R"({"id":5,"op":"acquire","model":"m","timeout_ms":86400001})",
       "exceeds", 5},
      {R"({"id":5,"op":"acquire","model":"m","when_full":"never"})",
       "\"wait\" or \"fail\"", 5},
      {R"({"id":5,"op":"release","lease":"x"})", "non-negative integer", 5},
      {R"({"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9})",
       "more than 8", 0},
      {std::string("{\"id\":5,\"op\":\"ping\"}\0", 21), "NUL", 0},
      {std::string(protocol::kMaxMessageBytes + 1, ' '), "exceeds the limit",
       0},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message.substr(0, 80));
    const protocol::ParsedRequest p = protocol::ParseRequest(c.message);
    EXPECT_FALSE(p.request);
    EXPECT_THAT(p.error, HasSubstr(c.says));
    EXPECT_EQ(p.id, c.id);
  }
  // A name longer than the limit, shown cut.
  const auto long_op = protocol::ParseRequest("{\"id\":5,\"op\":\"" +
                                              std::string(10000, 'x') + "\"}");
  EXPECT_LT(long_op.error.size(), 200u);
}

TEST(Protocol, ModelIdsAreNeverPaths) {
  for (const char* ok : {"a", "A9", "sdxl-base_1.0", "x.y.z", "0"}) {
    EXPECT_TRUE(protocol::IsValidModelId(ok)) << ok;
  }
  for (const char* bad : {"", ".", "..", "-a", "_a", "a/b", "/a", "a\\b",
                          "a..b", "a b", "a\n", "é"}) {
    EXPECT_FALSE(protocol::IsValidModelId(bad)) << bad;
  }
  EXPECT_TRUE(protocol::IsValidModelId(std::string(128, 'a')));
  EXPECT_FALSE(protocol::IsValidModelId(std::string(129, 'a')));
}

TEST(Protocol, RepliesRoundTrip) {
  auto r = protocol::ParseReply(protocol::EncodeAcquireReply(
      3, 99, "m", "joined", {{"a/x.safetensors", 10, 20}, {"b", 0, 2}}));
  ASSERT_TRUE(r.reply) << r.error;
  EXPECT_TRUE(r.reply->ok);
  EXPECT_EQ(r.reply->id, 3u);
  EXPECT_EQ(r.reply->lease, 99u);
  EXPECT_EQ(r.reply->load, "joined");
  ASSERT_EQ(r.reply->files.size(), 2u);
  EXPECT_EQ(r.reply->files[0].name, "a/x.safetensors");
  EXPECT_EQ(r.reply->files[1].header_bytes, 2u);

  r = protocol::ParseReply(protocol::EncodeError(4, ServeCode::kLoadFailed,
                                                 std::string("bad \xff bytes"),
                                                 "invalid_data"));
  ASSERT_TRUE(r.reply) << r.error;
  EXPECT_FALSE(r.reply->ok);
  EXPECT_EQ(r.reply->code, ServeCode::kLoadFailed);
  EXPECT_EQ(r.reply->cause, "invalid_data");

  r = protocol::ParseReply(
      protocol::EncodeHelloReply(1, "modelcache", {{"max_leases", 8}}));
  ASSERT_TRUE(r.reply);
  EXPECT_EQ(r.reply->limits.at("max_leases"), 8u);
  EXPECT_EQ(r.reply->version, protocol::kVersion);

  for (const char* bad :
       {"", "[]", R"({"ok":true})", R"({"id":1})", R"({"id":1,"ok":false})",
        R"({"id":1,"ok":false,"error":{"code":"WHAT","message":""}})",
        R"({"id":1,"ok":true,"files":[1]})", R"({"id":1,"ok":true,"lease":-1})",
        R"({"id":1,"ok":true,"files":[[[[[[[]]]]]]]})",
        R"({"id":1,"ok":true,"lease":2,"load":"maybe"})",
        R"({"id":1,"ok":true,"lease":2,"load":1})"}) {
    EXPECT_FALSE(protocol::ParseReply(bad).reply) << bad;
  }
  // Unknown fields of a reply are a newer daemon's: ignored.
  EXPECT_TRUE(
      protocol::ParseReply(R"({"id":1,"ok":true,"new":{"x":1}})").reply);
}

TEST(Protocol, CodesMapToTheCoresAndBack) {
  for (const ServeCode code :
       {ServeCode::kNotFound, ServeCode::kTooLarge, ServeCode::kCapacity,
        ServeCode::kTimeout, ServeCode::kLoadFailed, ServeCode::kBusy,
        ServeCode::kInvalid, ServeCode::kUnavailable}) {
    EXPECT_EQ(ParseServeCode(ServeCodeName(code)), code);
  }
  EXPECT_EQ(CoreCodeOf(ServeCode::kCapacity), ErrorCode::kCapacity);
  EXPECT_EQ(CoreCodeOf(ServeCode::kBusy), ErrorCode::kUnavailable);
  EXPECT_FALSE(ParseServeCode("busy"));
  const DaemonUnavailableError e("gone");
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_EQ(e.serve_code(), ServeCode::kUnavailable);
}

// ---- catalog ----

TEST(CatalogTest, ParsesModelsAliasesPinsAndPriorities) {
  const Catalog c = Catalog::Parse(
      R"({"models": [
        {"id": "sdxl", "files": ["sdxl/unet.safetensors", "sdxl/vae.safetensors"],
         "aliases": ["sd", "xl"], "pinned": true, "priority": -3},
        {"id": "tiny", "files": ["tiny.safetensors"]}]})",
      "c.json");
  ASSERT_EQ(c.models().size(), 2u);
  EXPECT_EQ(c.Find("sd"), &c.models()[0]);
  EXPECT_EQ(c.Find("sdxl")->files.size(), 2u);
  EXPECT_TRUE(c.Find("xl")->pinned);
  EXPECT_EQ(c.Find("sdxl")->priority, -3);
  EXPECT_FALSE(c.Find("tiny")->pinned);
  EXPECT_EQ(c.Find("nothing"), nullptr);
  EXPECT_EQ(c.Find("sdxl/unet.safetensors"), nullptr);
}

TEST(CatalogTest, RefusesWhatCouldLeaveTheRootOrIsAmbiguous) {
  const auto error = [](const std::string& models) {
    try {
      Catalog::Parse("{\"models\": [" + models + "]}", "c.json");
    } catch (const CatalogError& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidData);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error(R"({"id": "a", "files": ["../x"]})"),
              HasSubstr("c.json: model 'a': file '../x' has a '..' component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x/../../y"]})"),
              HasSubstr("'..' component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["/etc/passwd"]})"),
              HasSubstr("is absolute"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x//y"]})"),
              HasSubstr("empty component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["./x"]})"),
              HasSubstr("'.' component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x/"]})"),
              HasSubstr("empty component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x", "x"]})"),
              HasSubstr("listed twice"));
  EXPECT_THAT(error(R"({"id": "a", "files": []})"),
              HasSubstr("needs 1 to 100"));
  EXPECT_THAT(error(R"({"id": "a"})"), HasSubstr("has no \"files\""));
  EXPECT_THAT(error(R"({"id": "../a", "files": ["x"]})"),
              HasSubstr("not a valid id"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "aliases": ["b/c"]})"),
              HasSubstr("alias 'b/c' is not a valid id"));
  EXPECT_THAT(
      error(R"({"id": "a", "files": ["x"]}, {"id": "a", "files": ["y"]})"),
      HasSubstr("used twice"));
  EXPECT_THAT(
      error(
          R"({"id": "a", "files": ["x"]}, {"id": "b", "files": ["y"], "aliases": ["a"]})"),
      HasSubstr("alias 'a' is used twice"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "size": 1})"),
              HasSubstr("unknown key 'size'"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "priority": 1001})"),
              HasSubstr("from -1000 to 1000"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "pinned": "yes"})"),
              HasSubstr("\"pinned\" is not true or false"));
  EXPECT_THAT(
      error(R"({"id": "a", "files": [")" + std::string(1100, 'x') + "\"]}"),
      HasSubstr("longer than 1024"));
  EXPECT_THROW(Catalog::Parse("{\"models\": []} x", "c"), CatalogError);
  EXPECT_THROW(Catalog::Parse("{\"other\": []}", "c"), CatalogError);
  EXPECT_THROW(Catalog::Parse(std::string(100, '['), "c"), CatalogError);
  EXPECT_THROW(Catalog::FromFile("/nonexistent/catalog.json"), CatalogError);
}

// ---- /proc/PID/maps ----

TEST(ProcMaps, ReadsMemfdLinesOfOnePrefixOnly) {
  const auto m = detail::ParseMapsLine(
      "7f0c00000000-7f0c00200000 r--s 00001000 00:01 4242                      "
      " "
      "/memfd:modelcache:abc:sdxl#0 (deleted)",
      "modelcache:abc:", 17);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->pid, 17);
  EXPECT_EQ(m->start, 0x7f0c00000000u);
  EXPECT_EQ(m->end, 0x7f0c00200000u);
  EXPECT_EQ(m->offset, 0x1000u);
  EXPECT_EQ(m->dev_major, 0u);
  EXPECT_EQ(m->dev_minor, 1u);
  EXPECT_EQ(m->inode, 4242u);
  EXPECT_EQ(m->name, "modelcache:abc:sdxl#0");
  EXPECT_EQ(m->reach(), 0x201000u);
  for (const char* other :
       {"7f0c00000000-7f0c00200000 r--s 00000000 00:01 4242 "
        "/memfd:modelcache:xyz:sdxl#0 (deleted)",
        "7f0c00000000-7f0c00200000 r--p 00000000 08:01 99 /usr/lib/libc.so.6",
        "7f0c00000000-7f0c00200000 rw-p 00000000 00:00 0",
        "7f0c00000000-7f0c00200000 r--s 00000000 00:01 4242 "
        "/memfd:modelcache:ab",
        "garbage", "",
        "7f0c00200000-7f0c00000000 r--s 0 00:01 1 /memfd:modelcache:abc:x"}) {
    EXPECT_FALSE(detail::ParseMapsLine(other, "modelcache:abc:", 1)) << other;
  }
}

TEST(ProcMaps, FindsThisProcessesMappingOfAMemfd) {
  const std::vector<std::byte> bytes(8192, std::byte{1});
  base::UniqueFd fd =
      weights::CreateSealedMemfd("modelcache:unit:scan#0", bytes);
  void* map = ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd.get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  const auto found = detail::ScanMemfdMappings("modelcache:unit:", 0);
  ::munmap(map, 8192);
  bool mine = false;
  for (const auto& m : found) {
    if (m.pid == ::getpid() && m.name == "modelcache:unit:scan#0") {
      mine = true;
      EXPECT_EQ(m.reach(), 8192u);
    }
  }
  EXPECT_TRUE(mine);
  const auto excluded =
      detail::ScanMemfdMappings("modelcache:unit:", ::getpid());
  for (const auto& m : excluded) EXPECT_NE(m.pid, ::getpid());
}

// ---- files beneath the root ----

class BeneathTest : public ::testing::TestWithParam<detail::Resolver> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("beneath_" + std::to_string(::getpid()) + "_" +
            std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "root/sub");
    fs::create_directories(dir_ / "outside");
    std::ofstream(dir_ / "root/sub/in.bin") << "inside";
    std::ofstream(dir_ / "outside/secret.bin") << "secret";
    fs::create_symlink(dir_ / "outside/secret.bin", dir_ / "root/link.bin");
    fs::create_symlink("sub/in.bin", dir_ / "root/relative-link.bin");
    fs::create_directory_symlink(dir_ / "outside", dir_ / "root/dirlink");
    ::mkfifo((dir_ / "root/fifo").c_str(), 0600);
    root_ = detail::OpenRoot((dir_ / "root").string());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Error(const std::string& path) {
    try {
      detail::OpenBeneath(root_.get(), path, GetParam());
    } catch (const weights::IoError& e) {
      return e.what();
    }
    return "opened";
  }

  fs::path dir_;
  base::UniqueFd root_;
};

TEST_P(BeneathTest, OpensFilesInsideAndNothingElse) {
  base::UniqueFd fd =
      detail::OpenBeneath(root_.get(), "sub/in.bin", GetParam());
  char text[16] = {};
  EXPECT_EQ(::read(fd.get(), text, sizeof(text)), 6);
  EXPECT_STREQ(text, "inside");
  EXPECT_EQ(::fcntl(fd.get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_THAT(Error("link.bin"), HasSubstr("symbolic link"));
  EXPECT_THAT(Error("relative-link.bin"), HasSubstr("symbolic link"));
  EXPECT_THAT(Error("dirlink/secret.bin"), HasSubstr("symbolic link"));
  EXPECT_THAT(Error("../outside/secret.bin"),
              HasSubstr("leaves the model root"));
  EXPECT_THAT(Error("sub/../../outside/secret.bin"),
              HasSubstr("leaves the model root"));
  EXPECT_THAT(Error("/etc/passwd"), HasSubstr("leaves the model root"));
  EXPECT_THAT(Error("sub"), HasSubstr("is a directory"));
  EXPECT_THAT(Error("fifo"), HasSubstr("not a regular file"));
  EXPECT_THAT(Error("missing.bin"), HasSubstr("No such file"));
  EXPECT_THAT(Error("sub/in.bin/x"), HasSubstr("not a directory"));
}

INSTANTIATE_TEST_SUITE_P(Resolvers, BeneathTest,
                         ::testing::Values(detail::Resolver::kOpenat2,
                                           detail::Resolver::kPerComponent));

// ---- the load throttle's disk: replay's processor sharing, exactly ----

using detail::SharedDisk;

TEST(ServeThrottleDisk, ALoneTransferTakesItsBytesOverTheBandwidth) {
  SharedDisk disk(100);  // bytes per second
  disk.Add(1, 100);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 1.0);
  EXPECT_EQ(disk.Advance(0.999), 0);
  EXPECT_FALSE(disk.Done(1));
  EXPECT_EQ(disk.Advance(1.0), 1);
  EXPECT_TRUE(disk.Done(1));
  EXPECT_EQ(disk.NextDeparture(), std::numeric_limits<double>::infinity());
}

TEST(ServeThrottleDisk, TransfersAtOnceShareTheBandwidthEqually) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  disk.Add(2, 300);
  // 50 B/s each: the shorter ends at 2 s; the other, alone from then, has
  // 200 bytes left at 100 B/s: 4 s, the sum of both over the bandwidth.
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 2.0);
  EXPECT_EQ(disk.Advance(1.999), 0);
  EXPECT_EQ(disk.Advance(2.0), 1);
  EXPECT_TRUE(disk.Done(1));
  EXPECT_FALSE(disk.Done(2));
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 4.0);
  EXPECT_EQ(disk.Advance(4.0), 1);
  EXPECT_TRUE(disk.Done(2));
}

TEST(ServeThrottleDisk, OneStepOverADepartureSpeedsTheRestUpFromThen) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  disk.Add(2, 300);
  // One step from 0 to 3 s: 1 ends at 2 s, then 2 moves alone for 1 s.
  EXPECT_EQ(disk.Advance(3.0), 1);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 4.0);
}

TEST(ServeThrottleDisk, ALaterTransferSlowsTheFirstFromItsArrival) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  EXPECT_EQ(disk.Advance(0.5), 0);  // 50 bytes moved alone
  disk.Add(2, 100);
  // 50 B/s each: 1 ends at 1.5 s; 2 has 50 bytes left, alone: 2 s.
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 1.5);
  EXPECT_EQ(disk.Advance(1.5), 1);
  EXPECT_TRUE(disk.Done(1));
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 2.0);
  EXPECT_EQ(disk.Advance(2.0), 1);
}

TEST(ServeThrottleDisk, ARemovedTransferLeavesTheBandwidthToTheOthers) {
  SharedDisk disk(100);
  disk.Add(1, 100);
  disk.Add(2, 100);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 2.0);
  disk.Remove(2);
  EXPECT_DOUBLE_EQ(disk.NextDeparture(), 1.0);
}

TEST(ServeThrottleDisk, NothingToMoveOrNoBandwidthLimitIsDoneAtOnce) {
  SharedDisk disk(100);
  disk.Add(1, 0);
  EXPECT_TRUE(disk.Done(1));
  SharedDisk unlimited(std::numeric_limits<double>::infinity());
  unlimited.Add(1, uint64_t{1} << 40);
  EXPECT_TRUE(unlimited.Done(1));
  EXPECT_EQ(unlimited.moving(), 0u);
}

}  // namespace
}  // namespace modelcache::serve
