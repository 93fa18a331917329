// Traces read as a stream and compressed traces: the sources give exactly
// the in-memory readers' traces (the same models, sizes, requests and
// service times, or the same first error), gzip and zstd files read as the
// plain file does, and truncated or corrupt ones are errors naming the file
// and the line.
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"
#include "replay_test_util.h"

namespace modelcache::replay {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::StartsWith;

const std::string kData = std::string(MODELCACHE_SHARED_DATA) + "/traces/";
const std::string kAzureTrace = kData + "azure-functions-2019-100fn.csv";
const std::string kAzureMemory =
    kData + "azure-functions-2019-100fn-memory.csv";
const std::string kAzureDurations =
    kData + "azure-functions-2019-100fn-durations.csv";

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

using ::modelcache::testing::TempFile;

std::string Gzip(const std::string& data) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 16 + 15, 8, Z_DEFAULT_STRATEGY),
            Z_OK);
  std::string out(deflateBound(&z, data.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string Zstd(const std::string& data, bool checksum = true) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, checksum ? 1 : 0);
  std::string out(ZSTD_compressBound(data.size()), '\0');
  const size_t n =
      ZSTD_compress2(cctx, out.data(), out.size(), data.data(), data.size());
  EXPECT_FALSE(ZSTD_isError(n));
  ZSTD_freeCCtx(cctx);
  out.resize(n);
  return out;
}

// Everything a source gives, as a Trace, read `chunk` requests at a time.
Trace Collect(const TraceSource& source, size_t chunk = 4096) {
  Trace trace;
  const TraceHeader& header = source.header();
  trace.models = header.models;
  trace.sizes = header.sizes;
  auto reader = source.Read();
  std::vector<Request> requests(chunk);
  std::vector<float> hold(chunk);
  for (size_t n; (n = reader->Read(requests.data(), hold.data(), chunk)) > 0;) {
    trace.requests.insert(trace.requests.end(), requests.begin(),
                          requests.begin() + static_cast<ptrdiff_t>(n));
    if (header.service_times) {
      trace.hold_ms.insert(trace.hold_ms.end(), hold.begin(),
                           hold.begin() + static_cast<ptrdiff_t>(n));
    }
  }
  return trace;
}

void ExpectSameTrace(const Trace& got, const Trace& want) {
  EXPECT_EQ(got.models, want.models);
  EXPECT_EQ(got.sizes, want.sizes);
  ASSERT_EQ(got.requests.size(), want.requests.size());
  for (size_t i = 0; i < want.requests.size(); ++i) {
    ASSERT_EQ(got.requests[i].t_ms, want.requests[i].t_ms) << "request " << i;
    ASSERT_EQ(got.requests[i].model, want.requests[i].model) << "request " << i;
  }
  EXPECT_EQ(got.hold_ms, want.hold_ms);
}

void ExpectHeaderOf(const TraceSource& source, const Trace& trace) {
  const TraceHeader want = HeaderOf(trace);
  const TraceHeader& got = source.header();
  EXPECT_EQ(got.models, want.models);
  EXPECT_EQ(got.sizes, want.sizes);
  EXPECT_EQ(got.requests, want.requests);
  EXPECT_EQ(got.t_first_ms, want.t_first_ms);
  EXPECT_EQ(got.t_last_ms, want.t_last_ms);
  EXPECT_EQ(got.service_times, want.service_times);
}

// The message of the TraceError (or other modelcache::Error) `read` throws;
// "" if it throws none.
std::string ErrorOf(const std::function<void()>& read) {
  try {
    read();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ---- compressed input ----

TEST(CompressedInput, GzipAndZstdReadAsThePlainFile) {
  const std::string text = Slurp(kAzureTrace);
  ASSERT_FALSE(text.empty());
  TempFile gz(Gzip(text), ".csv.gz"), zst(Zstd(text), ".csv.zst");
  // Told apart by their bytes, not by their names.
  TempFile gz_unnamed(Gzip(text), ".csv"), zst_unnamed(Zstd(text), ".data");
  AzureOptions options;
  options.poisson = true;
  options.memory_path = kAzureMemory;
  options.memory_scale = 16;
  options.durations_path = kAzureDurations;
  const Trace plain = ReadAzureFunctionsTrace(kAzureTrace, options);
  for (const TempFile* file : {&gz, &zst, &gz_unnamed, &zst_unnamed}) {
    SCOPED_TRACE(file->path());
    ExpectSameTrace(ReadAzureFunctionsTrace(file->path(), options), plain);
    ExpectSameTrace(Collect(*OpenAzureFunctionsTrace(file->path(), options)),
                    plain);
  }
  // The other files too: memory, durations and sizes files.
  TempFile memory(Zstd(Slurp(kAzureMemory)), ".zst");
  TempFile durations(Gzip(Slurp(kAzureDurations)), ".gz");
  AzureOptions compressed = options;
  compressed.memory_path = memory.path();
  compressed.durations_path = durations.path();
  ExpectSameTrace(ReadAzureFunctionsTrace(kAzureTrace, compressed), plain);
  TempFile sizes(Gzip("model,size_bytes\na,7\nb,9\n"), ".gz");
  EXPECT_EQ(ReadSizes(sizes.path()), (SizeTable{{"a", 7}, {"b", 9}}));
}

TEST(CompressedInput, ConcatenatedMembersAndFramesReadAsOneFile) {
  const std::string a = "t_ms,model,size_bytes\n1,a,10\n2,b,";
  const std::string b = "20\n3,a,10\n";
  const Trace want = [&] {
    TempFile plain(a + b);
    return ReadCsvTrace(plain.path(), nullptr);
  }();
  ASSERT_EQ(want.requests.size(), 3u);
  TempFile gz(Gzip(a) + Gzip(b)), zst(Zstd(a) + Zstd("") + Zstd(b));
  for (const TempFile* file : {&gz, &zst}) {
    ExpectSameTrace(ReadCsvTrace(file->path(), nullptr), want);
    ExpectSameTrace(Collect(*OpenCsvTrace(file->path(), nullptr)), want);
  }
}

// A CSV trace of `lines` requests, some 40 bytes a line.
std::string CsvText(int lines) {
  std::string text = "t_ms,model,size_bytes,duration_ms\n";
  std::mt19937_64 rng(7);
  for (int i = 0; i < lines; ++i) {
    const uint64_t m = rng() % 50;
    text += std::to_string(i * 10) + ",model-" + std::to_string(m) + "," +
            std::to_string(1000 + m) + "," + std::to_string(rng() % 100) + "\n";
  }
  return text;
}

TEST(CompressedInput, TruncatedOrCorruptDataIsAnErrorWithTheFileAndLine) {
  const std::string text = CsvText(20000);
  struct Case {
    std::string name, bytes, expected;
  };
  const std::string gz = Gzip(text), zst = Zstd(text);
  std::vector<Case> cases;
  for (double keep : {0.1, 0.5, 0.9, 0.999}) {
    cases.push_back({"gzip cut at " + std::to_string(keep),
                     gz.substr(0, static_cast<size_t>(gz.size() * keep)),
                     "truncated gzip data"});
    cases.push_back({"zstd cut at " + std::to_string(keep),
                     zst.substr(0, static_cast<size_t>(zst.size() * keep)),
                     "truncated zstd data"});
  }
  // Only the magic bytes and a few more.
  cases.push_back({"gzip header only", gz.substr(0, 5), "truncated gzip data"});
  cases.push_back({"zstd magic only", zst.substr(0, 4), "truncated zstd data"});
  // A byte changed halfway: found by deflate's or zstd's block checks, or
  // by the checksum at the end of the member or frame. The text decoded
  // before then is read as it comes (a stream), so when it no longer parses
  // that is the error, at its line; either way an error names the file and
  // a line ("" below: any message).
  std::string gz_flipped = gz, zst_flipped = zst;
  gz_flipped[gz.size() / 2] ^= 0x10;
  zst_flipped[zst.size() / 2] ^= 0x10;
  cases.push_back({"gzip with a byte changed", gz_flipped, ""});
  cases.push_back({"zstd with a byte changed", zst_flipped, ""});
  cases.push_back({"gzip then garbage", gz + "garbage", "corrupt gzip data"});
  cases.push_back({"zstd then garbage", zst + "garbage", "corrupt zstd data"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempFile file(c.bytes);
    const std::string prefix = file.path() + ":";
    for (const auto& read : std::vector<std::function<void()>>{
             [&] { ReadCsvTrace(file.path(), nullptr); },
             [&] { OpenCsvTrace(file.path(), nullptr); }}) {
      const std::string message = ErrorOf(read);
      EXPECT_THAT(message, StartsWith(prefix));
      EXPECT_THAT(message, HasSubstr(c.expected));
      // The line being read when the data broke.
      const size_t line = std::stoul(
          message.substr(prefix.size(), message.find(':', prefix.size())));
      EXPECT_GE(line, 1u);
      EXPECT_LE(line, 20002u);
    }
  }
  // Cut late, most lines were read before the error: its line says where.
  TempFile late(zst.substr(0, zst.size() - 20));
  const std::string message =
      ErrorOf([&] { ReadCsvTrace(late.path(), nullptr); });
  EXPECT_THAT(message, MatchesRegex(".*:[0-9]{5}: truncated zstd data.*"));
}

// ---- the CSV source ----

TEST(CsvSource, GivesTheInMemoryTraceAndHeader) {
  TempFile sizes_file("model,size_bytes\nb,9\nc,11\n");
  const SizeTable sizes = ReadSizes(sizes_file.path());
  for (const std::string& text :
       {std::string("t_ms,model,size_bytes\n"), CsvText(5000),
        std::string("region,t_ms,model,size_bytes\n"
                    "eu,0,sdxl,100\n"
                    "us,5,\"lora, anime\",10\n"
                    "\n"
                    "eu,5,sdxl,\n"
                    "us,7.4,sdxl,100\r\n"
                    "us , 7.6 ,\" q\"\"uoted\",5\n"),
        std::string("t_ms,model,duration_ms\n1,b,\n2,c,1.5\n2.5,b,0\n"),
        std::string("model,t_ms\nb,3\nb,4")}) {
    SCOPED_TRACE(text.substr(0, 80));
    TempFile file(text);
    const Trace want = ReadCsvTrace(file.path(), &sizes);
    const auto source = OpenCsvTrace(file.path(), &sizes);
    ExpectHeaderOf(*source, want);
    for (size_t chunk : {1, 7, 4096})
      ExpectSameTrace(Collect(*source, chunk), want);
    // Passes are independent, and may overlap.
    auto first = source->Read(), second = source->Read();
    Request r1, r2;
    float h1, h2;
    while (first->Read(&r1, &h1, 1) == 1) {
      ASSERT_EQ(second->Read(&r2, &h2, 1), 1u);
      EXPECT_EQ(r1.t_ms, r2.t_ms);
    }
    EXPECT_EQ(second->Read(&r2, &h2, 1), 0u);
  }
}

// Thousands of models whose names run from 1 to 34 bytes, many sharing
// their first bytes, and times written in every way a CSV field may hold
// one: the stream numbers the models and rounds the times as the in-memory
// reader does.
TEST(CsvSource, ManyModelsAndEveryWayOfWritingATime) {
  std::string text = "t_ms,model,size_bytes\n";
  std::mt19937_64 rng(11);
  const auto name = [](uint64_t m) {
    return std::string(m % 31, 'x') + std::to_string(m);
  };
  for (uint64_t i = 0; i < 20000; ++i) {
    const uint64_t m = i < 3000 ? i : rng() % 3000;  // each model, then any
    const uint64_t t = 1000 + 2 * i;
    const std::string digits = std::to_string(t);
    const std::string ways[] = {
        digits,
        "000" + digits,
        digits + ".5",  // rounds up
        digits + ".49",
        " " + digits + "\t",
        digits + "e0",
        "0000000000" + digits,      // 14 or 15 digits
        "00000000000000" + digits,  // 18 or 19
    };
    const std::string& time = ways[i % std::size(ways)];
    text += time + "," + name(m) + "," + std::to_string(100 + m) + "\n";
  }
  text += "999999999999999," + name(7) + ",107\n";   // 15 digits
  text += "1000000000000000," + name(8) + ",108\n";  // 16
  text += "9007199254740992," + name(9) + ",109\n";  // 2^53, the largest
  TempFile file(text);
  const Trace want = ReadCsvTrace(file.path(), nullptr);
  ASSERT_EQ(want.models.size(), 3000u);
  const auto source = OpenCsvTrace(file.path(), nullptr);
  ExpectHeaderOf(*source, want);
  ExpectSameTrace(Collect(*source), want);
}

TEST(CsvSource, BadInputGivesTheInMemoryReadersError) {
  const SizeTable sizes = {{"a", 1}};
  for (const std::string& text : {
           std::string(""),
           std::string("\n  \n"),
           std::string("time,model\n1,a\n"),
           std::string("t_ms,name\n1,a\n"),
           std::string("t_ms,model\n1,a\n2,b\n3,c\n"),
           std::string("t_ms,model,size_bytes\n1,a,10\n2,b,-5\n"),
           std::string("t_ms,model,size_bytes\n5,a,10\n4,a,10\n"),
           std::string("t_ms,model,size_bytes\nsoon,a,10\n"),
           std::string("t_ms,model,size_bytes\n1,a,10\n2,a,11\n"),
           std::string("t_ms,model,size_bytes\n1\n"),
           std::string("t_ms,model,size_bytes\n-1,a,1\n"),
           std::string("t_ms,model,size_bytes\n1e300,a,1\n"),
           std::string("t_ms,model\n1e16,a\n"),
           std::string("t_ms,model\n+5,a\n"),
           std::string("t_ms,model\n0x10,a\n"),
           std::string("t_ms,model\n1 2,a\n"),
           std::string("t_ms,model,size_bytes\n1, ,1\n"),
           std::string("t_ms,model,size_bytes\n1,a,1.5\n"),
           std::string("t_ms,model,duration_ms\n1,a,x\n"),
           std::string("t_ms,model,duration_ms\n1,a,-1\n"),
           std::string("t_ms,model,duration_ms\n1,a,1e300\n"),
           // The size conflict comes before the bad duration on its line.
           std::string("t_ms,model,size_bytes,duration_ms\n1,a,1,1\n2,a,2,x\n"),
       }) {
    SCOPED_TRACE(text);
    TempFile file(text);
    const std::string want =
        ErrorOf([&] { ReadCsvTrace(file.path(), &sizes); });
    ASSERT_THAT(want, StartsWith(file.path() + ":"));
    EXPECT_EQ(ErrorOf([&] { OpenCsvTrace(file.path(), &sizes); }), want);
  }
}

TEST(CsvSource, AFileThatChangesBetweenPassesIsAnError) {
  TempFile file("t_ms,model,size_bytes\n1,a,10\n2,b,20\n");
  const auto source = OpenCsvTrace(file.path(), nullptr);
  file.Write("t_ms,model,size_bytes\n1,a,10\n2,c,20\n");
  EXPECT_THAT(ErrorOf([&] { Collect(*source); }),
              HasSubstr(":3: the file changed since it was first read"));
  file.Write("t_ms,model,size_bytes\n1,a,10\n");
  EXPECT_THAT(ErrorOf([&] { Collect(*source); }), HasSubstr("changed"));
  file.Write("t_ms,model,size_bytes\n1,a,10\n2,b,20\n3,a,10\n");
  EXPECT_THAT(ErrorOf([&] { Collect(*source); }), HasSubstr("changed"));
}

// ---- the Azure Functions source ----

TEST(AzureSource, GivesTheInMemoryTraceOfTheSharedTrace) {
  for (bool poisson : {false, true}) {
    for (uint32_t models : {0u, 7u}) {
      AzureOptions options;
      options.poisson = poisson;
      options.num_models = models;
      options.seed = 9;
      SCOPED_TRACE(std::to_string(poisson) + " " + std::to_string(models));
      const Trace want = ReadAzureFunctionsTrace(kAzureTrace, options);
      const auto source = OpenAzureFunctionsTrace(kAzureTrace, options);
      ExpectHeaderOf(*source, want);
      ExpectSameTrace(Collect(*source, 1000), want);
    }
  }
  AzureOptions options;
  options.memory_path = kAzureMemory;
  options.memory_scale = 32;
  options.durations_path = kAzureDurations;
  options.poisson = true;
  const Trace want = ReadAzureFunctionsTrace(kAzureTrace, options);
  const auto source = OpenAzureFunctionsTrace(kAzureTrace, options);
  ExpectHeaderOf(*source, want);
  ExpectSameTrace(Collect(*source, 333), want);
  // Passes are independent: a second one gives the same.
  ExpectSameTrace(Collect(*source, 4096), want);
}

TEST(AzureSource, MinuteColumnsInAnyOrderAndLargeCounts) {
  // Minutes out of order and repeated, a count large enough to be counted
  // per millisecond, functions that share a minute.
  const std::string text =
      "HashOwner,HashApp,HashFunction,Trigger,5,3,5,4,3\n"
      "o,a,f0,http,2,0,1,9000,3\n"
      "o,a,f1,http,0,0,0,0,0\n"
      "o,a,f2,http,7,1,0,20000,0\n"
      "o,a,f3,timer,1,1,1,1,1\n";
  TempFile file(text);
  for (bool poisson : {false, true}) {
    SCOPED_TRACE(poisson);
    AzureOptions options;
    options.poisson = poisson;
    options.seed = 5;
    const Trace want = ReadAzureFunctionsTrace(file.path(), options);
    ASSERT_EQ(want.requests.size(), 2u + 1 + 9000 + 3 + 7 + 1 + 20000 + 5);
    const auto source = OpenAzureFunctionsTrace(file.path(), options);
    ExpectHeaderOf(*source, want);
    ExpectSameTrace(Collect(*source, 100), want);
  }
}

TEST(AzureSource, BadInputGivesTheInMemoryReadersError) {
  TempFile memory("HashFunction,AverageAllocatedMb_pct50\nf1,10\n");
  TempFile bad_memory("HashFunction,AverageAllocatedMb_pct50\nf1,ten\n");
  for (const std::string& text : {
           std::string(""),
           std::string("Owner,App,Function,Trigger,480\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,x\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,1e20\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,480\n"
                       "o,a,f,http,-2\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,480\n"
                       "o,a,f,http,2.5\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,480\n"
                       "o,a,f,http\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,480,481\n"
                       "o,a,f1,http,600,500\n"),
           std::string("HashOwner,HashApp,HashFunction,Trigger,480\n"
                       "o,a,f2,http,6\n"),
       }) {
    SCOPED_TRACE(text);
    TempFile file(text);
    for (const std::string* memory_path :
         {static_cast<const std::string*>(nullptr), &memory.path(),
          &bad_memory.path()}) {
      AzureOptions options;
      options.max_requests = 1000;
      if (memory_path) options.memory_path = *memory_path;
      const std::string want =
          ErrorOf([&] { ReadAzureFunctionsTrace(file.path(), options); });
      EXPECT_EQ(ErrorOf([&] { OpenAzureFunctionsTrace(file.path(), options); }),
                want);
    }
  }
}

TEST(SourceOf, GivesTheTraceItWraps) {
  const Trace trace = GenerateDefaultTrace(3);
  const auto source = SourceOf(trace);
  ExpectHeaderOf(*source, trace);
  ExpectSameTrace(Collect(*source, 999), trace);
}

// ---- the waits' percentiles beyond the exact limit ----

// Never below the exact value, at most 0.1% (2^-10) above it.
void ExpectWithinTheBound(double summary, double exact) {
  EXPECT_GE(summary, exact);
  EXPECT_LE(summary, exact * (1 + 1.0 / 1024));
}

TEST(WaitPercentiles, BeyondTheExactLimitWithinATenthOfAPercentAbove) {
  const Trace trace = GenerateDefaultTrace(42);
  for (const char* policy : {"lru", "next-use"}) {
    SCOPED_TRACE(policy);
    SimulateOptions exact_options;
    const RunResult exact =
        Simulate(trace, policy, uint64_t{32} << 30, exact_options);
    ASSERT_GT(exact.cold_starts, 10000u);  // enough waits to summarise
    SimulateOptions summary_options;
    summary_options.max_exact_waits = 1000;
    const RunResult summary =
        Simulate(trace, policy, uint64_t{32} << 30, summary_options);
    ExpectSameResult(summary, exact, /*same_waits=*/false);
    ExpectWithinTheBound(summary.wait_ms.p50, exact.wait_ms.p50);
    ExpectWithinTheBound(summary.wait_ms.p95, exact.wait_ms.p95);
    ExpectWithinTheBound(summary.wait_ms.p99, exact.wait_ms.p99);
    ExpectWithinTheBound(summary.wait_ms.p999, exact.wait_ms.p999);
    ASSERT_EQ(summary.wait_quantiles.size(), exact.wait_quantiles.size());
    size_t differ = 0;
    for (size_t q = 0; q < exact.wait_quantiles.size(); ++q) {
      ExpectWithinTheBound(summary.wait_quantiles[q], exact.wait_quantiles[q]);
      differ += summary.wait_quantiles[q] != exact.wait_quantiles[q];
    }
    // The summary was used: most quantiles that are not 0 moved up a little.
    EXPECT_GT(differ, 100u);
    // At the limit, still exact: the waits that may not be 0 are the cold
    // starts' and those of requests queued behind a drain.
    SimulateOptions at_limit;
    at_limit.max_exact_waits = exact.cold_starts + exact.drain_queued;
    ExpectSameResult(Simulate(trace, policy, uint64_t{32} << 30, at_limit),
                     exact);
  }
}

// ---- replays of a stream ----

// The JSON of a replay without the time each run took.
std::string JsonWithoutTimes(const TraceHeader& header,
                             std::vector<RunResult> results,
                             const RunInfo& info) {
  for (RunResult& r : results) {
    r.seconds = 0;
    r.requests_per_second = 0;
  }
  return ResultsJson(header, results, info);
}

TEST(StreamReplay, SameJsonAsInMemoryOnTheSharedTraceAndCompressedCopies) {
  AzureOptions azure;
  azure.memory_path = kAzureMemory;
  azure.durations_path = kAzureDurations;
  azure.poisson = true;
  const Trace trace = ReadAzureFunctionsTrace(kAzureTrace, azure);
  // An online and an offline policy (the CSV test below has the rest).
  const std::vector<std::string> policies = {"lru", "belady"};
  uint64_t total = 0;
  for (uint64_t size : trace.sizes) total += size;
  const std::vector<uint64_t> capacities = {total / 4};
  const std::string plain = Slurp(kAzureTrace);
  TempFile gz(Gzip(plain), ".csv.gz"), zst(Zstd(plain), ".csv.zst");
  for (bool timed : {true, false}) {
    SCOPED_TRACE(timed ? "timed" : "untimed");
    ReplayOptions options;
    options.timed = timed;
    RunInfo info;
    info.timed = timed;
    info.time = options.time;
    const std::string want = JsonWithoutTimes(
        HeaderOf(trace), ReplayAll(trace, policies, capacities, options, 2),
        info);
    for (const std::string& path : {kAzureTrace, gz.path(), zst.path()}) {
      SCOPED_TRACE(path);
      const auto source = OpenAzureFunctionsTrace(path, azure);
      EXPECT_EQ(JsonWithoutTimes(
                    source->header(),
                    ReplayAll(*source, policies, capacities, options, 2), info),
                want);
    }
  }
}

// The embedded default trace as a CSV file (t_ms,model,size_bytes).
std::string CsvOf(const Trace& trace) {
  std::string text = "t_ms,model,size_bytes\n";
  for (const Request& r : trace.requests) {
    text += std::to_string(r.t_ms) + "," + trace.models[r.model] + "," +
            std::to_string(trace.sizes[r.model]) + "\n";
  }
  return text;
}

TEST(StreamReplay, CsvStreamGivesTheInMemoryResultsForEveryPolicyKind) {
  const Trace generated = GenerateDefaultTrace(5);
  const std::string text = CsvOf(generated);
  TempFile plain(text), zst(Zstd(text), ".csv.zst");
  const Trace trace = ReadCsvTrace(plain.path(), nullptr);
  SimulateOptions options;
  options.hold_ms = 50;
  std::atomic<uint64_t> done{0};
  options.requests_done = &done;
  const auto source = OpenCsvTrace(zst.path(), nullptr);
  for (const char* policy : {"lru", "ttl-10m", "next-use-prewarm", "belady"}) {
    SCOPED_TRACE(policy);
    done = 0;
    ExpectSameResult(Simulate(*source, policy, uint64_t{24} << 30, options),
                     Simulate(trace, policy, uint64_t{24} << 30, options));
    // Both runs counted every request they replayed.
    EXPECT_EQ(done.load(), 2 * trace.requests.size());
    ExpectSameResult(
        ReplayUntimed(*source, policy, uint64_t{24} << 30, options),
        ReplayUntimed(trace, policy, uint64_t{24} << 30, options));
  }
}

TEST(StreamReplay, AnOfflinePolicyOverItsIndexBudgetNamesTheMemoryItNeeds) {
  const Trace trace = GenerateDefaultTrace(5);
  const auto source = SourceOf(trace);
  SimulateOptions options;
  options.max_next_use_index_bytes = 4 * trace.requests.size() - 1;
  for (bool timed : {true, false}) {
    const std::string message = ErrorOf([&] {
      if (timed) {
        Simulate(*source, "belady", uint64_t{24} << 30, options);
      } else {
        ReplayUntimed(*source, "belady", uint64_t{24} << 30, options);
      }
    });
    EXPECT_THAT(message, HasSubstr("policy 'belady' needs the future"));
    EXPECT_THAT(message, HasSubstr(FormatBytes(4 * trace.requests.size())));
    EXPECT_THAT(message,
                HasSubstr(std::to_string(trace.requests.size()) + " requests"));
  }
  // At the limit it runs; online policies need no index at all.
  options.max_next_use_index_bytes = 4 * trace.requests.size();
  EXPECT_EQ(Simulate(*source, "belady", uint64_t{24} << 30, options).requests,
            trace.requests.size());
  options.max_next_use_index_bytes = 0;
  EXPECT_EQ(Simulate(*source, "lru", uint64_t{24} << 30, options).requests,
            trace.requests.size());
}

}  // namespace
}  // namespace modelcache::replay
