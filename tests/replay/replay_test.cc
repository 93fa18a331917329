// modelcache replay: trace formats, their errors, and the replay semantics
// (exact LRU, Belady's optimality on equal sizes, held leases), plus the
// command line's contract on bad input.
#include "modelcache/replay/replay.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>

#include "../test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace modelcache::replay {
namespace {

ReplayOptions Untimed() {
  ReplayOptions options;
  options.timed = false;
  return options;
}

using ::testing::HasSubstr;
using ::testing::StartsWith;

const std::string kAzureTrace = std::string(MODELCACHE_SHARED_DATA) +
                                "/traces/azure-functions-2019-100fn.csv";
const std::string kAzureMemory =
    std::string(MODELCACHE_SHARED_DATA) +
    "/traces/azure-functions-2019-100fn-memory.csv";

using ::modelcache::testing::TempFile;

std::string TraceErrorOf(const std::string& contents,
                         const SizeTable* sizes = nullptr) {
  TempFile file(contents);
  try {
    ReadCsvTrace(file.path(), sizes);
  } catch (const TraceError& e) {
    const std::string message = e.what();
    EXPECT_THAT(message, StartsWith(file.path() + ":"));
    return message.substr(file.path().size());
  }
  ADD_FAILURE() << "no error for:\n" << contents;
  return "";
}

TEST(ParseBytes, AcceptsBinaryAndDecimalUnits) {
  EXPECT_EQ(ParseBytes("16GiB"), uint64_t{16} << 30);
  EXPECT_EQ(ParseBytes("1.5 GiB"), uint64_t{3} << 29);
  EXPECT_EQ(ParseBytes("512MiB"), uint64_t{512} << 20);
  EXPECT_EQ(ParseBytes("4096"), 4096u);
  EXPECT_EQ(ParseBytes("2GB"), 2000000000u);
  EXPECT_THROW(ParseBytes("16 gigs"), Error);
  EXPECT_THROW(ParseBytes("-1GiB"), Error);
  EXPECT_THROW(ParseBytes(""), Error);
}

TEST(CsvTrace, ReadsRequestsSizesAndIgnoresOtherColumns) {
  TempFile file(
      "region,t_ms,model,size_bytes\n"
      "eu,0,sdxl,100\n"
      "us,5,\"lora, anime\",10\n"
      "eu,5,sdxl,\n"
      "us,7.4,sdxl,100\n");
  Trace trace = ReadCsvTrace(file.path(), nullptr);
  ASSERT_EQ(trace.models.size(), 2u);
  EXPECT_EQ(trace.models[1], "lora, anime");
  EXPECT_EQ(trace.sizes, (std::vector<uint64_t>{100, 10}));
  ASSERT_EQ(trace.requests.size(), 4u);
  EXPECT_EQ(trace.requests[3].t_ms, 7);
  EXPECT_EQ(trace.requests[1].model, 1u);
}

TEST(CsvTrace, SizesMayComeFromASizesFile) {
  TempFile sizes_file("model,size_bytes\na,7\nb,9\n");
  SizeTable sizes = ReadSizes(sizes_file.path());
  TempFile file("t_ms,model\n1,a\n2,b\n3,a\n");
  Trace trace = ReadCsvTrace(file.path(), &sizes);
  EXPECT_EQ(trace.sizes, (std::vector<uint64_t>{7, 9}));
}

TEST(CsvTrace, BadInputNamesTheFileAndLine) {
  EXPECT_THAT(TraceErrorOf("time,model\n1,a\n"),
              HasSubstr(":1: the header must name"));
  EXPECT_THAT(TraceErrorOf("t_ms,name\n1,a\n"), HasSubstr("(no 'model')"));
  EXPECT_THAT(TraceErrorOf("t_ms,model\n1,a\n2,b\n"),
              HasSubstr(":2: model 'a' has no size"));
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes\n1,a,10\n2,b,-5\n"),
              HasSubstr(":3: negative size_bytes '-5'"));
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes\n5,a,10\n4,a,10\n"),
              HasSubstr(":3: t_ms 4 is earlier than the previous request's"));
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes\nsoon,a,10\n"),
              HasSubstr(":2: t_ms 'soon' is not a number"));
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes\n1,a,10\n2,a,11\n"),
              HasSubstr(":3: model 'a' has size_bytes 11 here but 10 earlier"));
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes\n1\n"),
              HasSubstr(":2: expected at least 3 fields"));
  EXPECT_THAT(TraceErrorOf(""), HasSubstr(":1: empty file"));
}

TEST(AzureTrace, MapsTheRealTraceAsSpecified) {
  Trace trace = ReadAzureFunctionsTrace(kAzureTrace, 0, nullptr, 42);
  EXPECT_EQ(trace.requests.size(), 339657u);  // the data README's total
  EXPECT_TRUE(std::is_sorted(
      trace.requests.begin(), trace.requests.end(),
      [](const Request& a, const Request& b) { return a.t_ms < b.t_ms; }));
  EXPECT_GE(trace.requests.front().t_ms, 480 * 60000);
  EXPECT_LT(trace.requests.back().t_ms, 960 * 60000);
  // Fewer models folds functions onto them.
  Trace folded = ReadAzureFunctionsTrace(kAzureTrace, 7, nullptr, 42);
  EXPECT_EQ(folded.models.size(), 7u);
  EXPECT_EQ(folded.requests.size(), trace.requests.size());
  for (size_t i = 0; i < trace.requests.size(); i += 997) {
    EXPECT_EQ(folded.requests[i].model, trace.requests[i].model % 7);
  }
}

TEST(AzureTrace, SpreadsEachMinutesCountEvenlyAndDropsSilentFunctions) {
  TempFile file(
      "HashOwner,HashApp,HashFunction,Trigger,480,481\n"
      "o,a,f0,http,0,0\n"  // never invoked: dropped
      "o,a,f1,http,3,0\n"
      "o,a,f2,timer,1,1\n");
  Trace trace = ReadAzureFunctionsTrace(file.path(), 0, nullptr, 1);
  ASSERT_EQ(trace.models.size(), 2u);
  std::vector<std::pair<int64_t, uint32_t>> got;
  for (const Request& r : trace.requests) got.emplace_back(r.t_ms, r.model);
  const int64_t m = 480 * 60000;
  EXPECT_EQ(
      got, (std::vector<std::pair<int64_t, uint32_t>>{{m + 10000, 0},
                                                      {m + 30000, 0},
                                                      {m + 30000, 1},
                                                      {m + 50000, 0},
                                                      {m + 60000 + 30000, 1}}));
}

TEST(AzureTrace, PoissonArrivalsKeepEachMinutesCountWithinTheMinute) {
  TempFile file(
      "HashOwner,HashApp,HashFunction,Trigger,480,481\n"
      "o,a,f1,http,30,0\n"
      "o,a,f2,timer,5,7\n");
  AzureOptions options;
  options.poisson = true;
  options.seed = 3;
  Trace trace = ReadAzureFunctionsTrace(file.path(), options);
  ASSERT_EQ(trace.requests.size(), 42u);
  std::map<std::pair<int64_t, uint32_t>, int> per_minute;
  for (const Request& r : trace.requests)
    ++per_minute[{r.t_ms / 60000, r.model}];
  EXPECT_EQ((per_minute[{480, 0}]), 30);
  EXPECT_EQ((per_minute[{480, 1}]), 5);
  EXPECT_EQ((per_minute[{481, 1}]), 7);
  EXPECT_TRUE(std::is_sorted(
      trace.requests.begin(), trace.requests.end(),
      [](const Request& a, const Request& b) { return a.t_ms < b.t_ms; }));
  // Seeded: the same seed gives the same times, not the even spread.
  Trace again = ReadAzureFunctionsTrace(file.path(), options);
  Trace even = ReadAzureFunctionsTrace(file.path(), 0, nullptr, 3);
  std::vector<int64_t> a, b, c;
  for (const Request& r : trace.requests) a.push_back(r.t_ms);
  for (const Request& r : again.requests) b.push_back(r.t_ms);
  for (const Request& r : even.requests) c.push_back(r.t_ms);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(AzureTrace, SizesFromTheMemoryFileAndServiceTimesFromTheDurations) {
  TempFile file(
      "HashOwner,HashApp,HashFunction,Trigger,480\n"
      "o,a,f1,http,50\n"
      "o,a,f2,timer,50\n");
  TempFile memory(
      "HashFunction,HashOwner,HashApp,AverageAllocatedMb_pct50\n"
      "f2,o,a,100\n"
      "f1,o,a,12.5\n");
  TempFile durations(
      "HashOwner,HashApp,HashFunction,percentile_Average_0,percentile_Average_"
      "1,percentile_Average_25,percentile_Average_50,percentile_Average_75,"
      "percentile_Average_99,percentile_Average_100\n"
      "o,a,f1,10,10,10,10,10,10,10\n"
      "o,a,f2,100,110,200,300,400,900,1000\n");
  AzureOptions options;
  options.memory_path = memory.path();
  options.memory_scale = 4;
  options.durations_path = durations.path();
  Trace trace = ReadAzureFunctionsTrace(file.path(), options);
  EXPECT_EQ(trace.sizes, (std::vector<uint64_t>{50 * (uint64_t{1} << 20),
                                                400 * (uint64_t{1} << 20)}));
  ASSERT_EQ(trace.hold_ms.size(), trace.requests.size());
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    if (trace.requests[i].model == 0) {
      EXPECT_EQ(trace.hold_ms[i], 10);
    } else {
      EXPECT_GE(trace.hold_ms[i], 100);
      EXPECT_LE(trace.hold_ms[i], 1000);
    }
  }
}

TEST(AzureTrace, BadInputNamesTheFileAndLine) {
  TempFile wrong_header("Owner,App,Function,Trigger,480\n");
  EXPECT_THROW(ReadAzureFunctionsTrace(wrong_header.path(), 0, nullptr, 1),
               TraceError);
  TempFile negative(
      "HashOwner,HashApp,HashFunction,Trigger,480\no,a,f,http,-2\n");
  try {
    ReadAzureFunctionsTrace(negative.path(), 0, nullptr, 1);
    FAIL();
  } catch (const TraceError& e) {
    EXPECT_THAT(e.what(),
                HasSubstr(negative.path() + ":2: negative invocation count"));
  }
}

// Numbers that parse but that the replay cannot hold are errors too. Before,
// such a duration became an infinite service time, such a time wrapped
// negative, such a minute overflowed (undefined behaviour) and such a memory
// figure became a meaningless size.
TEST(TraceReaders, RejectNumbersTooLargeToReplay) {
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes\n0,a,1\n1e300,a,1\n"),
              HasSubstr(":3: t_ms 1e300 is too large (at most "
                        "9007199254740992)"));
  EXPECT_THAT(TraceErrorOf("t_ms,model,size_bytes,duration_ms\n0,a,1,1e300\n"),
              HasSubstr(":2: duration_ms 1e300 is too large (at most "
                        "9007199254740992)"));
  // The largest time that is allowed still reads.
  TempFile largest("t_ms,model,size_bytes\n9007199254740992,a,1\n");
  EXPECT_EQ(ReadCsvTrace(largest.path(), nullptr).requests.at(0).t_ms,
            int64_t{9007199254740992});

  auto azure_error = [](const std::string& invocations,
                        const AzureOptions& options) -> std::string {
    TempFile file(invocations);
    try {
      ReadAzureFunctionsTrace(file.path(), options);
    } catch (const TraceError& e) {
      return e.what();
    }
    ADD_FAILURE() << "no error for:\n" << invocations;
    return "";
  };
  EXPECT_THAT(azure_error("HashOwner,HashApp,HashFunction,Trigger,"
                          "100000000000000000\no,a,f,http,1\n",
                          {}),
              HasSubstr(":1: minute column '100000000000000000' is too large"));

  const std::string invocations =
      "HashOwner,HashApp,HashFunction,Trigger,0\no,a,f,http,1\n";
  TempFile memory("HashFunction,AverageAllocatedMb_pct50\nf,1e12\n");
  AzureOptions sized;
  sized.memory_path = memory.path();
  sized.memory_scale = 1e7;  // 1e12 MB x 1e7 MiB: more than 2^63 bytes
  EXPECT_THAT(azure_error(invocations, sized),
              HasSubstr(memory.path() +
                        ": function f: AverageAllocatedMb_pct50 times the "
                        "memory scale is more than 2^63 bytes"));
  // The header's contract: a scale that is not a positive number is an
  // InvalidArgument error.
  for (double scale : {-1.0, 0.0, std::nan(""), HUGE_VAL}) {
    sized.memory_scale = scale;
    TempFile file(invocations);
    try {
      ReadAzureFunctionsTrace(file.path(), sized);
      ADD_FAILURE() << "no error for memory_scale " << scale;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << scale;
      EXPECT_THAT(e.what(), HasSubstr("the memory scale must be a positive"));
    }
  }

  TempFile durations(
      "HashFunction,percentile_Average_0,percentile_Average_1,percentile_"
      "Average_25,percentile_Average_50,percentile_Average_75,percentile_"
      "Average_99,percentile_Average_100\nf,1,1,1,1,1,1,1e300\n");
  AzureOptions timed;
  timed.durations_path = durations.path();
  EXPECT_THAT(azure_error(invocations, timed),
              HasSubstr(durations.path() +
                        ":2: percentile_Average_100 1e300 is too large"));
}

TEST(AzureTrace, CountsAddingUpToMoreThanMaxRequestsAreAnError) {
  TempFile file(
      "HashOwner,HashApp,HashFunction,Trigger,0,1\n"
      "o,a,f,http,3,4\n"
      "o,a,g,http,2,99999999999999\n");
  AzureOptions options;
  options.max_requests = 9;  // 3 + 4 + 2 fit; the next count does not
  try {
    ReadAzureFunctionsTrace(file.path(), options);
    FAIL();
  } catch (const TraceError& e) {
    EXPECT_THAT(e.what(),
                HasSubstr(file.path() +
                          ":3: the invocation counts add up to more than 9 "
                          "requests by minute 1"));
  }
  // At the limit exactly, the trace reads.
  TempFile exact(
      "HashOwner,HashApp,HashFunction,Trigger,0,1\n"
      "o,a,f,http,3,4\n"
      "o,a,g,http,2,0\n");
  EXPECT_EQ(ReadAzureFunctionsTrace(exact.path(), options).requests.size(), 9u);
}

// An independent byte-capacity LRU, the reference for --policy lru.
struct ReferenceLru {
  uint64_t hits = 0, misses = 0, too_large = 0, evictions = 0, bytes_loaded = 0;
  void Run(const Trace& trace, uint64_t capacity) {
    std::list<uint32_t> order;  // front = most recent
    std::unordered_map<uint32_t, std::list<uint32_t>::iterator> where;
    uint64_t used = 0;
    for (const Request& r : trace.requests) {
      const uint64_t size = trace.sizes[r.model];
      auto it = where.find(r.model);
      if (it != where.end()) {
        ++hits;
        order.splice(order.begin(), order, it->second);
        continue;
      }
      ++misses;
      if (size > capacity) {
        ++too_large;
        continue;
      }
      while (used + size > capacity) {
        used -= trace.sizes[order.back()];
        where.erase(order.back());
        order.pop_back();
        ++evictions;
      }
      order.push_front(r.model);
      where[r.model] = order.begin();
      used += size;
      bytes_loaded += size;
    }
  }
};

Trace RandomTrace(uint64_t seed, uint32_t models, size_t requests,
                  bool equal_sizes) {
  std::mt19937_64 rng(seed);
  Trace trace;
  for (uint32_t m = 0; m < models; ++m) {
    trace.models.push_back("m" + std::to_string(m));
    trace.sizes.push_back(equal_sizes ? 10 : 1 + rng() % 100);
  }
  std::vector<double> weights;
  for (uint32_t m = 0; m < models; ++m) weights.push_back(1.0 / (1 + m));
  std::discrete_distribution<uint32_t> pick(weights.begin(), weights.end());
  for (size_t i = 0; i < requests; ++i) {
    trace.requests.push_back(Request{static_cast<int64_t>(i), pick(rng)});
  }
  return trace;
}

TEST(Replay, LruIsExactlyByteCapacityLru) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    Trace trace = RandomTrace(seed, 40, 20000, /*equal_sizes=*/false);
    for (uint64_t capacity : {50u, 300u, 1000u}) {
      ReferenceLru reference;
      reference.Run(trace, capacity);
      RunResult result = ReplayUntimed(trace, "lru", capacity);
      EXPECT_EQ(result.hits, reference.hits) << seed << " " << capacity;
      EXPECT_EQ(result.misses, reference.misses);
      EXPECT_EQ(result.too_large, reference.too_large);
      EXPECT_EQ(result.evictions, reference.evictions);
      EXPECT_EQ(result.bytes_loaded, reference.bytes_loaded);
      EXPECT_LE(result.peak_resident_bytes, capacity);
    }
  }
}

TEST(Replay, BeladyIsOptimalForEqualSizes) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    Trace trace = RandomTrace(seed, 30, 10000, /*equal_sizes=*/true);
    RunResult belady = ReplayUntimed(trace, "belady", 80);
    EXPECT_TRUE(belady.offline);
    for (const char* online : {"lru", "gdsf", "gdsf-uniform"}) {
      EXPECT_GT(belady.hits, ReplayUntimed(trace, online, 80).hits) << online;
    }
  }
  // A hand-checked case: capacity for two, requests a b c a b.
  Trace trace{
      {"a", "b", "c"}, {1, 1, 1}, {{0, 0}, {1, 1}, {2, 2}, {3, 0}, {4, 1}}};
  EXPECT_EQ(ReplayUntimed(trace, "belady", 2).hits,
            1u);  // c evicts b, so a hits
  EXPECT_EQ(ReplayUntimed(trace, "lru", 2).hits, 0u);
}

TEST(Replay, HeldLeasesBlockEvictionForTheirServiceTime) {
  // Capacity for one model; b arrives while a is still being served.
  Trace trace{{"a", "b"}, {10, 10}, {{0, 0}, {5, 1}, {20, 1}}};
  RunResult held = ReplayUntimed(trace, "lru", 10, {.hold_ms = 10});
  EXPECT_EQ(held.blocked, 1u);  // b at t=5: a is held until t=10
  EXPECT_EQ(held.misses, 3u);
  RunResult unheld = ReplayUntimed(trace, "lru", 10);
  EXPECT_EQ(unheld.blocked, 0u);
  EXPECT_EQ(unheld.hits, 1u);  // b at t=20
}

TEST(Replay, UnknownPolicyIsAClearError) {
  Trace trace = RandomTrace(1, 3, 10, true);
  try {
    ReplayUntimed(trace, "fifo", 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("unknown policy 'fifo'"));
  }
}

TEST(Replay, CostAwarePolicyLoadsFewerBytesThanLruOnTheSharedTrace) {
  // The capacities the README shows.
  Trace trace = ReadAzureFunctionsTrace(kAzureTrace, 0, nullptr, 42);
  const std::vector<uint64_t> capacities = {
      ParseBytes("8GiB"), ParseBytes("16GiB"), ParseBytes("32GiB"),
      ParseBytes("64GiB")};
  auto results = ReplayAll(trace, {"lru", "gdsf"}, capacities, Untimed(), 2);
  for (size_t i = 0; i < capacities.size(); ++i) {
    EXPECT_LT(results[capacities.size() + i].bytes_loaded,
              results[i].bytes_loaded)
        << FormatBytes(capacities[i]);
  }
}

// The policy choice must hold beyond one trace: next-use loads fewer bytes
// than both GDSF variants on the shared trace with either size model and on
// the embedded default, at the two larger capacities of each. (The table in
// docs/benchmarks.md has every capacity, and held-out workloads too.)
TEST(Replay, NextUseLoadsFewerBytesThanEitherGdsfOnEveryWorkload) {
  AzureOptions memory_sized;
  memory_sized.memory_path = kAzureMemory;
  memory_sized.memory_scale = 32;
  struct Workload {
    const char* name;
    Trace trace;
    std::vector<uint64_t> capacities;
  };
  std::vector<Workload> workloads;
  workloads.push_back({"azure, serving mix",
                       ReadAzureFunctionsTrace(kAzureTrace, 0, nullptr, 42),
                       {ParseBytes("32GiB"), ParseBytes("64GiB")}});
  workloads.push_back({"azure, memory file x32",
                       ReadAzureFunctionsTrace(kAzureTrace, memory_sized),
                       {ParseBytes("32GiB"), ParseBytes("64GiB")}});
  workloads.push_back({"default, seed 42",
                       GenerateDefaultTrace(42),
                       {ParseBytes("48GiB"), ParseBytes("64GiB")}});
  for (const Workload& w : workloads) {
    const size_t n = w.capacities.size();
    auto results = ReplayAll(w.trace, {"gdsf", "gdsf-classic", "next-use"},
                             w.capacities, Untimed(), 2);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(std::string(w.name) + " at " + FormatBytes(w.capacities[i]));
      EXPECT_EQ(results[2 * n + i].policy, "next-use");
      EXPECT_LT(results[2 * n + i].bytes_loaded, results[i].bytes_loaded);
      EXPECT_LT(results[2 * n + i].bytes_loaded, results[n + i].bytes_loaded);
    }
  }
}

TEST(Replay, DefaultTracePopularityIsWhatTheGeneratorDraws) {
  for (uint64_t seed : {42u, 7u}) {
    SCOPED_TRACE(seed);
    const Trace trace = GenerateDefaultTrace(seed);
    const DefaultTracePopularity pop = DefaultTracePopularityOf(seed);
    ASSERT_EQ(pop.morning.size(), trace.models.size());
    ASSERT_EQ(pop.afternoon.size(), trace.models.size());
    EXPECT_NEAR(std::accumulate(pop.morning.begin(), pop.morning.end(), 0.0),
                1.0, 1e-12);
    EXPECT_NEAR(
        std::accumulate(pop.afternoon.begin(), pop.afternoon.end(), 0.0), 1.0,
        1e-12);
    EXPECT_GE(pop.span_ms, trace.requests.back().t_ms);
    // In the first and the last quarter of the span, each model's share of
    // the requests is its weight mixed at the quarter's mean time (1/8 and
    // 7/8 of the way), within sampling error (about 50,000 draws each).
    for (int quarter : {0, 3}) {
      const double from = pop.span_ms * quarter / 4.0;
      const double to = pop.span_ms * (quarter + 1) / 4.0;
      const double s = (quarter + 0.5) / 4;
      std::vector<double> count(trace.models.size(), 0);
      double total = 0;
      for (const Request& r : trace.requests) {
        if (r.t_ms < from || r.t_ms >= to) continue;
        count[r.model] += 1;
        total += 1;
      }
      for (size_t m = 0; m < count.size(); ++m) {
        const double expected = (1 - s) * pop.morning[m] + s * pop.afternoon[m];
        const double sigma = std::sqrt(expected * (1 - expected) / total);
        EXPECT_NEAR(count[m] / total, expected, 5 * sigma + 1e-9)
            << "model " << m << ", quarter " << quarter;
      }
    }
  }
}

TEST(Replay, JsonAndHtmlCarryEveryRun) {
  Trace trace = RandomTrace(3, 20, 2000, false);
  auto results = ReplayAll(trace, {"lru", "belady"}, {100, 400}, Untimed(), 2);
  auto doc = nlohmann::json::parse(ResultsJson(trace, results));
  EXPECT_EQ(doc["requests"], 2000);
  ASSERT_EQ(doc["results"].size(), 4u);
  for (const char* key : {"policy", "capacity_bytes", "hits", "misses",
                          "too_large", "bytes_loaded", "evictions", "hit_ratio",
                          "byte_miss_ratio", "requests_per_second"}) {
    EXPECT_TRUE(doc["results"][0].contains(key)) << key;
  }
  EXPECT_EQ(doc["results"][3]["policy"], "belady");
  EXPECT_EQ(doc["results"][3]["offline"], true);
  const std::string html = HtmlReport(trace, "t <&>", results);
  EXPECT_THAT(html, HasSubstr("t &lt;&amp;&gt;"));
  size_t svgs = 0;
  for (size_t at = 0; (at = html.find("<svg", at)) != std::string::npos; ++at)
    ++svgs;
  EXPECT_EQ(svgs, 3u);
  // Self-contained: nothing fetched from anywhere.
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
}

// ---- the command line ----

using Command = ::modelcache::testing::CommandResult;

Command RunCli(const std::string& args) {
  return ::modelcache::testing::RunShell(std::string(MODELCACHE_CLI) + " " +
                                         args);
}

TEST(ReplayCli, NoTimeGivesANullTimeModel) {
  TempFile trace("t_ms,model,size_bytes\n1,a,10\n2,a,10\n");
  Command c =
      RunCli("replay " + trace.path() + " --no-time --json --capacity 1KiB");
  ASSERT_EQ(c.status, 0) << c.err;
  auto doc = nlohmann::json::parse(c.out);
  EXPECT_TRUE(doc["time_model"].is_null());
  EXPECT_EQ(doc["results"][0]["hits"], 1);
}

TEST(ReplayCli, BadTraceExitsOneWithOneErrorLineAndNoOutput) {
  TempFile unsorted("t_ms,model,size_bytes\n5,a,1\n3,a,1\n");
  Command c = RunCli("replay " + unsorted.path() + " --capacity 1GiB");
  EXPECT_EQ(c.status, 1);
  EXPECT_EQ(c.out, "");
  EXPECT_THAT(c.err, StartsWith("error: " + unsorted.path() + ":3: "));
  EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1);
}

TEST(ReplayCli, BadCapacityAndPolicyAreClearErrors) {
  TempFile trace("t_ms,model,size_bytes\n1,a,10\n");
  Command capacity = RunCli("replay " + trace.path() + " --capacity lots");
  EXPECT_EQ(capacity.status, 1);
  EXPECT_THAT(capacity.err,
              StartsWith("error: --capacity: not a byte size: 'lots'"));
  Command policy =
      RunCli("replay " + trace.path() + " --policy fifo --capacity 1GiB");
  EXPECT_EQ(policy.status, 1);
  EXPECT_THAT(policy.err, StartsWith("error: unknown policy 'fifo'"));
}

TEST(ReplayCli, BadInputOfTheTimeModelIsAnErrorWithFileAndLine) {
  TempFile negative_t("t_ms,model,size_bytes\n1,a,10\n-5,a,10\n");
  Command t = RunCli("replay " + negative_t.path() + " --capacity 1GiB");
  EXPECT_EQ(t.status, 1);
  EXPECT_THAT(t.err, StartsWith("error: " + negative_t.path() +
                                ":3: negative t_ms -5"));

  TempFile negative_d(
      "t_ms,model,size_bytes,duration_ms\n1,a,10,5\n2,a,10,-1\n");
  Command d = RunCli("replay " + negative_d.path() + " --capacity 1GiB");
  EXPECT_EQ(d.status, 1);
  EXPECT_THAT(d.err, StartsWith("error: " + negative_d.path() +
                                ":3: negative duration_ms -1"));

  TempFile durations(
      "HashOwner,HashApp,HashFunction,percentile_Average_0,percentile_Average_"
      "1,percentile_Average_25,percentile_Average_50,percentile_Average_75,"
      "percentile_Average_99,percentile_Average_100\n"
      "o,a,f,1,2,3,four,5,6,7\n");
  Command bad_durations = RunCli("replay " + kAzureTrace +
                                 " --format azure-functions --durations " +
                                 durations.path() + " --capacity 1GiB");
  EXPECT_EQ(bad_durations.status, 1);
  EXPECT_THAT(bad_durations.err,
              StartsWith("error: " + durations.path() +
                         ":2: percentile_Average_50 'four' is not a number"));

  TempFile trace("t_ms,model,size_bytes\n1,a,10\n");
  Command ttl =
      RunCli("replay " + trace.path() + " --policy ttl-xm --capacity 1GiB");
  EXPECT_EQ(ttl.status, 1);
  EXPECT_THAT(ttl.err, StartsWith("error: unknown policy 'ttl-xm'"));

  const std::string directory = std::filesystem::temp_directory_path().string();
  Command dir = RunCli("replay " + directory + " --capacity 1GiB");
  EXPECT_EQ(dir.status, 1);
  EXPECT_THAT(dir.err,
              StartsWith("error: " + directory + ":1: is a directory"));
}

// One request for a model larger than the capacity: nothing is served, and
// the row must say so rather than read as a perfect result.
TEST(ReplayCli, ARequestThatIsNeverServedIsFlaggedNotAPerfectRow) {
  TempFile one("t_ms,model,size_bytes\n0,a,1000\n");
  Command c = RunCli("replay " + one.path() + " --capacity 16 --policy lru");
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_THAT(c.out, HasSubstr("unserved"));
  EXPECT_THAT(c.out,
              ::testing::ContainsRegex(
                  "lru +16 B +default +0 +100.00% .* - +- +- +- .*UNSERVED\n"));
  // The SLO search never answers with a capacity that serves nothing.
  EXPECT_THAT(c.out, HasSubstr("lru: 1000 B for p99 wait"));
  EXPECT_EQ(c.err,
            "warning: --capacity 16 B is smaller than the largest model ('a', "
            "1000 B): its requests cannot be served there and count as "
            "unserved\n");
  Command j =
      RunCli("replay " + one.path() + " --capacity 16,2KB --policy lru --json");
  ASSERT_EQ(j.status, 0) << j.err;
  auto doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["results"][0]["too_large"], 1);
  EXPECT_EQ(doc["results"][0]["rejected"], 0);
  EXPECT_EQ(doc["results"][0]["unserved"], 1);
  EXPECT_EQ(doc["results"][0]["unserved_ratio"], 1.0);
  EXPECT_EQ(doc["results"][1]["unserved"], 0);

  // --max-wait 0 rejects every request that misses: flagged, and warned of.
  Command w = RunCli("replay " + one.path() +
                     " --capacity 2KB --policy lru --max-wait 0 --slo-ms off");
  ASSERT_EQ(w.status, 0) << w.err;
  EXPECT_THAT(w.out, ::testing::ContainsRegex("lru .* 100.00% .*UNSERVED\n"));
  EXPECT_EQ(w.err,
            "warning: --max-wait 0: every request that has to wait for a load "
            "is rejected at once and counts as unserved\n");

  // The default capacities never include one below the largest model, and
  // say how they were chosen; the default policies include next-use.
  TempFile mixed(
      "t_ms,model,size_bytes\n0,big,9000\n1,a,100\n2,b,100\n3,a,100\n");
  Command d = RunCli("replay " + mixed.path() + " --json");
  ASSERT_EQ(d.status, 0) << d.err;
  EXPECT_EQ(d.err, "");
  auto defaults = nlohmann::json::parse(d.out);
  std::set<std::string> policies;
  for (const auto& r : defaults["results"]) {
    EXPECT_GE(r["capacity_bytes"].get<uint64_t>(), 9000u);
    EXPECT_EQ(r["unserved"], 0);
    policies.insert(r["policy"].get<std::string>());
  }
  EXPECT_EQ(policies, (std::set<std::string>{"lru", "gdsf", "next-use"}));
  Command t = RunCli("replay " + mixed.path() + " --slo-ms off");
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_THAT(t.out,
              HasSubstr("capacities: 10%, 25% and 50% of all model bytes "
                        "(choose with --capacity), none below the largest "
                        "model, 8.79 KiB\n"));
}

// --help says what runs by default and what the waits are taken over.
TEST(ReplayCli, HelpStatesTheDefaultsAndWhatTheWaitsAreOver) {
  Command c = RunCli("replay --help");
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_THAT(c.out, HasSubstr("On a TRACE, the default is --policy lru, "
                               "gdsf, next-use at 10%, 25% and 50% of all "
                               "model bytes, none below the largest model."));
  EXPECT_THAT(c.out, HasSubstr("The waits (p50 to max_wait) are over the "
                               "requests served;"));
}

// A trace with a header and no request is an error naming the file; and no
// output ever shows a nan (here: models of 0 bytes, whose SLO answer is 0).
TEST(ReplayCli, AHeaderOnlyTraceIsAnErrorAndNothingPrintsNan) {
  TempFile empty("t_ms,model,size_bytes\n");
  Command c = RunCli("replay " + empty.path());
  EXPECT_EQ(c.status, 1);
  EXPECT_EQ(c.out, "");
  EXPECT_EQ(c.err, "error: " + empty.path() +
                       ": no requests: the trace has a header and no request "
                       "to replay\n");
  Command s = RunCli("replay " + empty.path() + " --stream --policy lru");
  EXPECT_EQ(s.status, 1);
  EXPECT_THAT(s.err, StartsWith("error: " + empty.path() + ": no requests"));

  TempFile zero("t_ms,model,size_bytes\n0,a,0\n5,b,0\n9,a,0\n");
  TempFile report("", ".html");
  for (const std::string format : {"", " --json"}) {
    Command z = RunCli("replay " + zero.path() +
                       " --policy lru,gdsf --report " + report.path() + format);
    ASSERT_EQ(z.status, 0) << z.err;
    std::string all = z.out;
    std::ifstream in(report.path());
    all += std::string(std::istreambuf_iterator<char>(in), {});
    std::transform(all.begin(), all.end(), all.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    EXPECT_EQ(all.find("nan"), std::string::npos) << all;
  }
  // The library's own output on an empty trace: no nan either.
  Trace nothing;
  ReplayOptions options;
  const auto results = ReplayAll(nothing, {"lru"}, {0, 1024}, options, 1);
  RunInfo info;
  info.timed = true;
  info.slo_answers =
      FindSloCapacities(nothing, {"lru", "gdsf"}, options, info.slo, 1);
  for (std::string text : {ResultsTable(nothing, results, info),
                           ResultsJson(nothing, results, info),
                           HtmlReport(nothing, "empty", results, info)}) {
    std::transform(text.begin(), text.end(), text.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  }
}

// Each mistake a user makes gets one line that says what is wrong, where,
// and what to do, with exit status 1 and nothing on stdout.
TEST(ReplayCli, EveryCommonMistakeIsAClearError) {
  TempFile trace("t_ms,model,size_bytes\n1,a,10\n2,b,10\n");
  auto expect_error = [&](const std::string& args, const std::string& message) {
    Command c = RunCli(args);
    EXPECT_EQ(c.status, 1) << args;
    EXPECT_EQ(c.out, "") << args;
    EXPECT_THAT(c.err, StartsWith("error: " + message)) << args;
    EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << c.err;
  };
  const std::string replay = "replay " + trace.path() + " ";
  expect_error(replay + "--hold-ms -1",
               "--hold-ms: not a duration of 0 ms or more: '-1' (use 0 or "
               "more milliseconds");
  expect_error(replay + "--load-slots -1",
               "--load-slots: not a whole number of 0 or more: '-1' (use 0 "
               "for unlimited");
  expect_error(replay + "--polciy lru",
               "unknown option --polciy (did you mean --policy?); modelcache "
               "replay --help lists the options");
  expect_error(replay + "--models 0",
               "--models applies to --format azure-functions");
  expect_error(replay + "--report /no/such/dir/r.html",
               "--report: cannot write /no/such/dir/r.html: No such file or "
               "directory");

  // An Azure Functions trace without --format: named, with the flag.
  TempFile azure(
      "HashOwner,HashApp,HashFunction,Trigger,1,2\no,a,f,http,1,0\n");
  expect_error("replay " + azure.path(),
               azure.path() +
                   ":1: the header must name the columns 't_ms' and 'model' "
                   "(no 't_ms'): it looks like an Azure Functions trace");
  Command a = RunCli("replay " + azure.path());
  EXPECT_THAT(a.err, HasSubstr("give --format azure-functions"));

  // A model the --sizes file lacks: the sizes file is named.
  TempFile unsized("t_ms,model\n1,a\n2,b\n");
  TempFile sizes("model,size_bytes\na,10\n");
  expect_error("replay " + unsized.path() + " --sizes " + sizes.path(),
               unsized.path() +
                   ":3: model 'b' has no size: no size_bytes here, and the "
                   "sizes file " +
                   sizes.path() + " has no row for it (add 'b,SIZE_BYTES'");
  expect_error("replay " + kAzureTrace +
                   " --format azure-functions --models 2 --sizes " +
                   sizes.path(),
               kAzureTrace + ": the sizes file " + sizes.path() +
                   " has no size for 'model-0'");

  // Spaces after the commas of a list, and a UTF-8 byte order mark before
  // the header, are accepted.
  Command spaced = RunCli(replay +
                          "--policy 'lru, gdsf' --capacity "
                          "'1KiB, 2KiB' --json --slo-ms off");
  ASSERT_EQ(spaced.status, 0) << spaced.err;
  auto doc = nlohmann::json::parse(spaced.out);
  ASSERT_EQ(doc["results"].size(), 4u);
  EXPECT_EQ(doc["results"][3]["policy"], "gdsf");
  EXPECT_EQ(doc["results"][3]["capacity_bytes"], 2048);
  TempFile bom("\xEF\xBB\xBFt_ms,model,size_bytes\n1,a,10\n5000,a,10\n");
  Command b = RunCli("replay " + bom.path() + " --json --policy lru");
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(nlohmann::json::parse(b.out)["results"][0]["hits"], 1);
  Command bs = RunCli("replay " + bom.path() + " --json --policy lru --stream");
  ASSERT_EQ(bs.status, 0) << bs.err;
}

// --drain-after: a list compared in one run, one row per value, in the
// order given; a bad value, a repeated one, or one without the time model
// is an error.
TEST(ReplayCli, DrainAfterComparesItsValuesInOneRun) {
  TempFile trace("t_ms,model,size_bytes\n0,a,1000\n7,a,1000\n200,b,1000\n");
  const std::string replay =
      "replay " + trace.path() + " --capacity 1000 --policy lru --hold-ms 20 ";
  Command c = RunCli(replay + "--drain-after 0,1s,default,inf --slo-ms off");
  EXPECT_EQ(c.status, 0) << c.err;
  EXPECT_THAT(c.out,
              ::testing::ContainsRegex("lru +1000 B +0ms +[0-9]+ .*\n"
                                       "lru +1000 B +1.00s +[0-9]+ .*\n"
                                       "lru +1000 B +default +[0-9]+ .*\n"
                                       "lru +1000 B +inf +0 .*\n"));
  auto expect_error = [&](const std::string& args, const std::string& message) {
    Command e = RunCli(replay + args);
    EXPECT_EQ(e.status, 1) << args;
    EXPECT_THAT(e.err, StartsWith("error: " + message)) << args;
  };
  expect_error("--drain-after 1x", "--drain-after: not a duration: '1x'");
  expect_error("--drain-after 0,0ms", "--drain-after: '0ms' is given twice");
  expect_error("--drain-after 0 --no-time",
               "--drain-after is a rule of the replay in trace time");
}

TEST(ReplayCli, JsonOnTheSharedTrace) {
  TempFile report("", ".html");
  Command c = RunCli("replay " + kAzureTrace +
                     " --format azure-functions --policy gdsf --capacity "
                     "16GiB,32GiB --json"
                     " --report " +
                     report.path());
  ASSERT_EQ(c.status, 0) << c.err;
  auto doc = nlohmann::json::parse(c.out);
  EXPECT_EQ(doc["requests"], 339657);
  EXPECT_EQ(doc["results"].size(), 2u);
  EXPECT_EQ(doc["results"][1]["capacity_bytes"], uint64_t{32} << 30);
  EXPECT_EQ(doc["time_model"]["slots"], 4);
  EXPECT_EQ(doc["time_model"]["latency_ms"], 100.0);
  EXPECT_EQ(doc["time_model"]["bandwidth_bytes_per_second"], 2e9);
  EXPECT_EQ(doc["slo"]["ms"], 1000.0);
  EXPECT_EQ(doc["slo"]["answers"].size(), 1u);
  for (const char* key :
       {"cold_starts", "cold_start_ratio", "rejected", "load_seconds",
        "disk_busy_ratio", "load_queue_peak", "load_queue_mean",
        "idle_gib_hours", "p75_model_cold_start_ratio", "overloaded"}) {
    EXPECT_TRUE(doc["results"][0].contains(key)) << key;
  }
  for (const char* key : {"p50", "p95", "p99", "p999", "max"}) {
    EXPECT_TRUE(doc["results"][0]["wait_ms"].contains(key)) << key;
  }
  std::ifstream html(report.path());
  EXPECT_TRUE(html.good());
}

TEST(ReplayCli,
     StreamedAndCompressedTracesPrintTheSameAndProgressGoesToStderr) {
  std::string text = "t_ms,model,size_bytes\n";
  for (int i = 0; i < 3000; ++i) {
    text += std::to_string(i * 10) + ",m" + std::to_string(i * 7 % 13) + "," +
            std::to_string(1 + i * 7 % 13) + "000000\n";
  }
  TempFile trace(text);
  const std::string flags = " --policy lru,belady --capacity 20MB,40MB --json";
  // Piped and not asked: nothing on stderr but the report's line.
  Command in_memory = RunCli("replay " + trace.path() + flags);
  ASSERT_EQ(in_memory.status, 0) << in_memory.err;
  EXPECT_EQ(in_memory.err, "");
  // The time each run took is the only field that may differ.
  auto without_times = [](const std::string& out) {
    nlohmann::json doc = nlohmann::json::parse(out);
    for (auto& r : doc["results"]) {
      r.erase("seconds");
      r.erase("requests_per_second");
    }
    return doc.dump();
  };
  Command streamed =
      RunCli("replay " + trace.path() + flags + " --stream --progress");
  ASSERT_EQ(streamed.status, 0) << streamed.err;
  EXPECT_EQ(without_times(streamed.out), without_times(in_memory.out));
  EXPECT_THAT(streamed.err, HasSubstr("replaying: "));
  EXPECT_THAT(streamed.err, HasSubstr("requests/s"));
  // The search has its own lines, with a bound on its rounds, and the
  // progress ends with one final line, also when stderr is not a terminal.
  EXPECT_THAT(streamed.err,
              HasSubstr("searching for the SLO's capacity: the sweep, 0/"));
  EXPECT_THAT(streamed.err, ::testing::ContainsRegex("more rounds?|the last "
                                                     "round"));
  ASSERT_FALSE(streamed.err.empty());
  const size_t last_line =
      streamed.err.rfind('\n', streamed.err.size() - 2) + 1;
  EXPECT_THAT(streamed.err.substr(last_line), StartsWith("done in "));
  EXPECT_THAT(streamed.err.substr(last_line), HasSubstr("; the SLO search: "));
  const std::string gz_path = trace.path() + ".gz";
  ASSERT_EQ(std::system(("gzip -c " + trace.path() + " > " + gz_path).c_str()),
            0);
  Command gz = RunCli("replay " + gz_path + flags);
  EXPECT_EQ(without_times(gz.out), without_times(in_memory.out));
  // Cut short, the copy is an error naming the file and a line.
  ASSERT_EQ(
      std::system(("head -c 2000 " + trace.path() + ".gz > " + gz_path + ".cut")
                      .c_str()),
      0);
  Command cut = RunCli("replay " + gz_path + ".cut" + flags);
  EXPECT_EQ(cut.status, 1);
  EXPECT_EQ(cut.out, "");
  EXPECT_THAT(cut.err, StartsWith("error: " + gz_path + ".cut:"));
  EXPECT_THAT(cut.err, HasSubstr(": truncated gzip data"));
  EXPECT_EQ(std::count(cut.err.begin(), cut.err.end(), '\n'), 1);
  std::remove(gz_path.c_str());
  std::remove((gz_path + ".cut").c_str());
}

}  // namespace
}  // namespace modelcache::replay
