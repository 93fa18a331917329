// The wire protocol's parsers and encoders (src/serve/protocol.h): untrusted
// bytes in, a reply or a reason out, never a throw.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "modelcache/serve/catalog.h"
#include "modelcache/serve/errors.h"
#include "protocol.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

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

  for (const auto& [text, op] :
       {std::pair{protocol::EncodeIdle(8, 17), protocol::Op::kIdle},
        std::pair{protocol::EncodeUse(9, 17), protocol::Op::kUse}}) {
    p = protocol::ParseRequest(text);
    ASSERT_TRUE(p.request) << p.error;
    EXPECT_EQ(p.request->op, op);
    EXPECT_EQ(p.request->lease, 17u);
  }
  p = protocol::ParseRequest(R"({"op":"idle","id":10})");
  EXPECT_FALSE(p.request);
  EXPECT_EQ(p.error, "missing field 'lease'");
  p = protocol::ParseRequest(R"({"op":"use","id":11,"lease":1,"model":"m"})");
  EXPECT_FALSE(p.request);
  EXPECT_EQ(p.error, "field 'model' does not belong to op 'use'");

  // A client that stops local reuse of a draining copy says so.
  p = protocol::ParseRequest(protocol::EncodeDrain(12));
  ASSERT_TRUE(p.request) << p.error;
  EXPECT_EQ(p.request->op, protocol::Op::kDrain);
  EXPECT_EQ(p.request->id, 12u);
  p = protocol::ParseRequest(R"({"op":"drain","id":13,"lease":1})");
  EXPECT_FALSE(p.request);
  EXPECT_EQ(p.error, "field 'lease' does not belong to op 'drain'");

  p = protocol::ParseRequest(R"({"op":"hello","id":2,"version":1})");
  ASSERT_TRUE(p.request);
  EXPECT_EQ(p.request->op, protocol::Op::kHello);
  p = protocol::ParseRequest(R"( {"op" : "ping" , "id" : 3} )");
  ASSERT_TRUE(p.request) << p.error;
}

// What the client sends after a reconnect is what the daemon reads.
TEST(Protocol, AReclaimRoundTripsWithItsLeaseModelAndUse) {
  for (const bool idle : {false, true}) {
    const std::string text = protocol::EncodeReclaim(12, 17, "sdxl-1.0", idle);
    const protocol::ParsedRequest p = protocol::ParseRequest(text);
    ASSERT_TRUE(p.request) << p.error << ": " << text;
    EXPECT_EQ(p.request->op, protocol::Op::kReclaim);
    EXPECT_EQ(p.request->id, 12u);
    EXPECT_EQ(p.request->lease, 17u);
    EXPECT_EQ(p.request->model, "sdxl-1.0");
    EXPECT_EQ(p.request->idle, idle);
    EXPECT_THAT(text,
                HasSubstr(idle ? R"("use":"idle")" : R"("use":"in_use")"));
  }
  const struct {
    const char* message;
    const char* says;
  } bad[] = {
      {R"({"op":"reclaim","id":4,"lease":1,"model":"m"})",
       "missing field 'use'"},
      {R"({"op":"reclaim","id":4,"lease":1,"model":"m","use":"busy"})",
       "\"in_use\" or \"idle\""},
      {R"({"op":"reclaim","id":4,"model":"m","use":"idle"})",
       "missing field 'lease'"},
      {R"({"op":"reclaim","id":4,"lease":1,"use":"idle"})",
       "missing field 'model'"},
  };
  for (const auto& c : bad) {
    SCOPED_TRACE(c.message);
    const protocol::ParsedRequest p = protocol::ParseRequest(c.message);
    EXPECT_FALSE(p.request);
    EXPECT_THAT(p.error, HasSubstr(c.says));
    EXPECT_EQ(p.id, 4u);
  }
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

  // The daemon's recall: an id-0 message with the lease.
  r = protocol::ParseReply(protocol::EncodeRecall(42));
  ASSERT_TRUE(r.reply) << r.error;
  EXPECT_EQ(r.reply->id, 0u);
  EXPECT_TRUE(r.reply->ok);
  EXPECT_EQ(r.reply->recall, 42u);
  EXPECT_EQ(protocol::ParseReply(protocol::EncodeOk(5)).reply->recall, 0u);
  EXPECT_FALSE(r.reply->drain);

  // A draining copy's recall says so.
  r = protocol::ParseReply(
      protocol::EncodeRecall(43, /*retired=*/false, /*drain=*/true));
  ASSERT_TRUE(r.reply) << r.error;
  EXPECT_EQ(r.reply->recall, 43u);
  EXPECT_TRUE(r.reply->drain);
  EXPECT_FALSE(r.reply->retired);
  EXPECT_FALSE(
      protocol::ParseReply(R"({"id":0,"ok":true,"recall":1,"drain":1})").reply);

  for (const char* bad :
       {"", "[]", R"({"ok":true})", R"({"id":0,"ok":true,"recall":"x"})",
        R"({"id":1})", R"({"id":1,"ok":false})",
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

}  // namespace
}  // namespace modelcache::serve
