// The base layer on its own: byte sizes both ways, and the error root.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "modelcache/base/bytes.h"
#include "modelcache/base/errors.h"

namespace modelcache {
namespace {

TEST(ParseBytes, UnitsSpacesAndRounding) {
  EXPECT_EQ(ParseBytes("4096"), 4096u);
  EXPECT_EQ(ParseBytes("512 B"), 512u);
  EXPECT_EQ(ParseBytes("16GiB"), uint64_t{16} << 30);
  EXPECT_EQ(ParseBytes(" 1.5 MiB "), uint64_t{3} << 19);
  EXPECT_EQ(ParseBytes("2KB"), 2000u);
  EXPECT_EQ(ParseBytes("1TB"), 1000000000000u);
  EXPECT_EQ(ParseBytes("0.4"), 0u);  // rounded to whole bytes
}

TEST(ParseBytes, AnythingElseIsAnInvalidArgumentNamingTheText) {
  for (const char* bad : {"", "GiB", "-1", "1 XB", "1e400", "nan", "16 gib"}) {
    try {
      ParseBytes(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << bad;
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(ParseBytes, SizesOfTwoToTheSixtyFourOrMoreAreRefusedNotWrapped) {
  EXPECT_THROW(ParseBytes("16777216 TiB"), Error);  // exactly 2^64
  EXPECT_THROW(ParseBytes("1e20"), Error);
  EXPECT_EQ(ParseBytes("16777215 TiB"), uint64_t{16777215} << 40);
}

TEST(FormatBytes, BinaryUnitsWithTwoDecimals) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{12} << 20), "12.00 MiB");
  EXPECT_EQ(ParseBytes(FormatBytes(uint64_t{3} << 30)), uint64_t{3} << 30);
}

TEST(Error, EveryCodeHasAName) {
  EXPECT_STREQ(ErrorCodeName(ErrorCode::kTooLarge), "too_large");
  EXPECT_STREQ(ErrorCodeName(ErrorCode::kFailedPrecondition),
               "failed_precondition");
  EXPECT_STREQ(ErrorCodeName(ErrorCode::kInvalidData), "invalid_data");
  EXPECT_STREQ(ErrorCodeName(ErrorCode::kIo), "io");
  EXPECT_STREQ(ErrorCodeName(ErrorCode::kUnavailable), "unavailable");
  const Error e(ErrorCode::kIo, "disk gone");
  const std::runtime_error& root = e;
  EXPECT_STREQ(root.what(), "disk gone");
}

}  // namespace
}  // namespace modelcache
