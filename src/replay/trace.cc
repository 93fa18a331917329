// The sizes file of a CSV trace, and the embedded default trace. (The trace
// formats: csv_trace.cc, azure_trace.cc.)
#include <algorithm>
#include <cmath>
#include <random>

#include "csv.h"
#include "input.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {

namespace {

using csv::Fail;
using csv::ParseSize;
using csv::SplitCsv;
using csv::Trim;

// Exponent 2.2: the most popular model takes two thirds of the requests,
// close to the Azure Functions trace, where one function takes 80%. With the
// 1.1 used before, the eight-hour default needed 12.7 GB/s of loads at
// 16 GiB and more than the 2 GB/s default link at every capacity: no row was
// a configuration anyone could run.
double Zipf(size_t rank) {
  return 1.0 / std::pow(static_cast<double>(rank + 1), 2.2);
}

}  // namespace

SizeTable ReadSizes(const std::string& path) {
  LineReader in(path);
  SizeTable sizes;
  std::string_view line;
  std::vector<std::string> fields;
  size_t line_no = 0;
  int model_col = -1, size_col = -1;
  while (in.Next(&line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    SplitCsv(line, &fields);
    if (model_col < 0) {
      for (size_t i = 0; i < fields.size(); ++i) {
        if (Trim(fields[i]) == "model") model_col = static_cast<int>(i);
        if (Trim(fields[i]) == "size_bytes") size_col = static_cast<int>(i);
      }
      if (model_col < 0 || size_col < 0) {
        Fail(path, line_no,
             "the header must name the columns 'model' and 'size_bytes'");
      }
      continue;
    }
    if (static_cast<int>(fields.size()) <= std::max(model_col, size_col)) {
      Fail(path, line_no,
           "expected at least " +
               std::to_string(std::max(model_col, size_col) + 1) +
               " fields, found " + std::to_string(fields.size()));
    }
    std::string model(Trim(fields[model_col]));
    if (model.empty()) Fail(path, line_no, "empty model name");
    const uint64_t size = ParseSize(path, line_no, fields[size_col]);
    auto [it, inserted] = sizes.emplace(model, size);
    if (!inserted && it->second != size) {
      Fail(path, line_no,
           "model '" + model + "' listed again with another size");
    }
  }
  if (model_col < 0)
    Fail(path, 1, "empty file: expected a 'model,size_bytes' header");
  return sizes;
}

uint64_t DefaultModelSize(uint32_t model, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + model);
  constexpr double kMiB = 1048576.0;
  const double u = std::uniform_real_distribution<double>(0, 1)(rng);
  double low, high;
  if (u < 0.4) {
    low = 20 * kMiB, high = 300 * kMiB;
  } else if (u < 0.7) {
    low = 300 * kMiB, high = 1536 * kMiB;
  } else if (u < 0.9) {
    low = 2048 * kMiB, high = 7168 * kMiB;
  } else {
    low = 7168 * kMiB, high = 16384 * kMiB;
  }
  const double v = std::uniform_real_distribution<double>(0, 1)(rng);
  return static_cast<uint64_t>(low * std::pow(high / low, v));
}

namespace {

constexpr uint32_t kDefaultModels = 60;
constexpr int64_t kDefaultSpanMs = int64_t{8} * 3600 * 1000;

// Two popularity rankings, unrelated to size: the morning's and the
// afternoon's. The first draws of the generator's stream.
void DefaultRankings(std::mt19937_64& rng, std::vector<uint32_t>* morning,
                     std::vector<uint32_t>* afternoon) {
  morning->resize(kDefaultModels);
  afternoon->resize(kDefaultModels);
  for (uint32_t m = 0; m < kDefaultModels; ++m) {
    (*morning)[m] = (*afternoon)[m] = m;
  }
  std::shuffle(morning->begin(), morning->end(), rng);
  std::shuffle(afternoon->begin(), afternoon->end(), rng);
}

}  // namespace

DefaultTracePopularity DefaultTracePopularityOf(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> morning, afternoon;
  DefaultRankings(rng, &morning, &afternoon);
  DefaultTracePopularity out;
  out.span_ms = kDefaultSpanMs;
  out.morning.assign(kDefaultModels, 0);
  out.afternoon.assign(kDefaultModels, 0);
  double total = 0;
  for (uint32_t r = 0; r < kDefaultModels; ++r) total += Zipf(r);
  for (uint32_t r = 0; r < kDefaultModels; ++r) {
    out.morning[morning[r]] = Zipf(r) / total;
    out.afternoon[afternoon[r]] = Zipf(r) / total;
  }
  return out;
}

Trace GenerateDefaultTrace(uint64_t seed) {
  constexpr size_t kRequests = 200000;
  Trace trace;
  for (uint32_t m = 0; m < kDefaultModels; ++m) {
    trace.models.push_back("model-" + std::to_string(m));
    trace.sizes.push_back(DefaultModelSize(m, seed));
  }
  std::mt19937_64 rng(seed);
  // Each request draws from a mix that shifts from the morning's ranking to
  // the afternoon's (DefaultTracePopularityOf says the same in closed form).
  std::vector<uint32_t> morning, afternoon;
  DefaultRankings(rng, &morning, &afternoon);
  std::vector<double> weights;
  for (uint32_t r = 0; r < kDefaultModels; ++r) weights.push_back(Zipf(r));
  std::discrete_distribution<uint32_t> rank(weights.begin(), weights.end());
  std::vector<int64_t> times(kRequests);
  std::uniform_int_distribution<int64_t> when(0, kDefaultSpanMs - 1);
  for (auto& t : times) t = when(rng);
  std::sort(times.begin(), times.end());
  std::uniform_real_distribution<double> coin(0, 1);
  trace.requests.reserve(kRequests);
  for (int64_t t : times) {
    const double afternoon_share =
        static_cast<double>(t) / static_cast<double>(kDefaultSpanMs);
    const auto& order = coin(rng) < afternoon_share ? afternoon : morning;
    trace.requests.push_back(Request{t, order[rank(rng)]});
  }
  return trace;
}

}  // namespace modelcache::replay
