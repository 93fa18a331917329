// The base layer on its own: byte sizes both ways, durations, CSV fields,
// the error root and message text. (Printable's escapes are checked where it
// was first offered, as weights::Printable: tests/weights/safetensors_test.)
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/bytes.h"
#include "modelcache/base/csv.h"
#include "modelcache/base/duration.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/mutex.h"
#include "modelcache/base/text.h"

namespace modelcache {
namespace {

// Debug builds check ranked mutexes' order at run time: a lower rank taken
// while a higher (or equal) one is held aborts, naming both, even where no
// deadlock happens in the run.
TEST(LockRank, ATakenOutOfOrderAbortsNamingBoth) {
#ifdef NDEBUG
  GTEST_SKIP() << "lock ranks are checked without NDEBUG only";
#else
  base::Mutex outer(base::LockRank{1, "outer"});
  base::Mutex inner(base::LockRank{2, "inner"});
  base::Mutex peer(base::LockRank{2, "peer"});
  base::Mutex unranked;
  {
    base::MutexLock a(&outer);
    base::MutexLock b(&inner);
    base::MutexLock c(&unranked);  // never checked
  }
  {
    base::MutexLock b(&inner);
    base::MutexLock c(&unranked);
  }
  // Unlocks need not nest: letting go of the outer one first leaves the
  // inner one held, and the outer one may not be taken under it.
  outer.Lock();
  inner.Lock();
  outer.Unlock();
  inner.Unlock();
  {
    base::MutexLock a(&outer);  // nothing is held any more
  }
  EXPECT_DEATH(
      {
        base::MutexLock b(&inner);
        base::MutexLock a(&outer);
      },
      "lock order broken: outer \\(rank 1\\) taken while holding inner "
      "\\(rank 2\\)");
  EXPECT_DEATH(
      {
        base::MutexLock b(&inner);
        base::MutexLock c(&peer);
      },
      "peer \\(rank 2\\) taken while holding inner");
#endif
}

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

TEST(ParseDurationMs, AcceptsMillisecondsSecondsMinutesAndHours) {
  EXPECT_EQ(ParseDurationMs("100ms"), 100);
  EXPECT_EQ(ParseDurationMs("1.5s"), 1500);
  EXPECT_EQ(ParseDurationMs("10m"), 600000);
  EXPECT_EQ(ParseDurationMs("10min"), 600000);
  EXPECT_EQ(ParseDurationMs("2h"), 7200000);
  EXPECT_EQ(ParseDurationMs("250"), 250);
  EXPECT_EQ(ParseDurationMs(" 2 s "), 2000);
  EXPECT_EQ(ParseDurationMs("0"), 0);
}

TEST(ParseDurationMs, AnythingElseIsAnInvalidArgumentNamingTheText) {
  for (const char* bad :
       {"", "-1s", "xm", "5 days", "1 sec", "inf", "nan", "s", "1e400"}) {
    try {
      ParseDurationMs(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << bad;
      EXPECT_EQ(std::string(e.what()),
                std::string("not a duration: '") + bad +
                    "' (use a number with ms, s, m or h)");
    }
  }
}

TEST(Csv, SplitsQuotedFieldsWithCommasAndDoubledQuotes) {
  std::vector<std::string> fields;
  csv::SplitCsv(R"(a,"b,c","say ""hi""",,x)", &fields);
  EXPECT_EQ(fields,
            (std::vector<std::string>{"a", "b,c", "say \"hi\"", "", "x"}));
  std::vector<std::string_view> views;
  EXPECT_TRUE(csv::SplitPlain("a, b,,c\r", &views));
  EXPECT_EQ(views, (std::vector<std::string_view>{"a", " b", "", "c\r"}));
  EXPECT_FALSE(csv::SplitPlain(R"(a,"b")", &views));
  EXPECT_EQ(csv::Trim(" \t x y \t\r"), "x y");
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

TEST(ErrnoText, NamesTheErrorAndAnUnknownNumber) {
  EXPECT_EQ(base::ErrnoText(ENOENT), "No such file or directory");
  EXPECT_EQ(base::ErrnoText(EACCES), "Permission denied");
  // Not in the table: glibc writes the number into the caller's buffer.
  EXPECT_EQ(base::ErrnoText(99999), "Unknown error 99999");
}

TEST(Quoted, QuotesThePrintableFormAndCutsItShort) {
  EXPECT_EQ(base::Quoted("model/a"), "'model/a'");
  EXPECT_EQ(base::Quoted("a\nb\x1b"), R"('a\nb\x1B')");
  EXPECT_EQ(base::Quoted(std::string(100, 'x'), 8), "'xxxxxxxx...'");
  EXPECT_EQ(base::Quoted(""), "''");
}

}  // namespace
}  // namespace modelcache
