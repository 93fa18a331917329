// Traces: the CSV and Azure Functions formats with their sizes, memory and
// durations files, and the embedded default trace.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <random>
#include <unordered_map>

#include "csv.h"
#include "input.h"
#include "modelcache/replay/replay.h"
#include "trace_internal.h"

namespace modelcache::replay {

namespace {

using csv::Fail;
using csv::kMaxMs;
using csv::kMaxWholeMs;
using csv::ParseInteger;
using csv::ParseNumber;
using csv::ParseSize;
using csv::SplitCsv;
using csv::TooLarge;
using csv::Trim;

struct TraceBuilder {
  Trace trace;
  std::unordered_map<std::string, uint32_t> index;
  std::vector<bool> sized;

  uint32_t Model(std::string_view name) {
    auto [it, inserted] = index.emplace(
        std::string(name), static_cast<uint32_t>(trace.models.size()));
    if (inserted) {
      trace.models.emplace_back(name);
      trace.sizes.push_back(0);
      sized.push_back(false);
    }
    return it->second;
  }
};

// Exponent 2.2: the most popular model takes two thirds of the requests,
// close to the Azure Functions trace, where one function takes 80%. With the
// 1.1 used before, the eight-hour default needed 12.7 GB/s of loads at
// 16 GiB and more than the 2 GB/s default link at every capacity: no row was
// a configuration anyone could run.
double Zipf(size_t rank) {
  return 1.0 / std::pow(static_cast<double>(rank + 1), 2.2);
}

}  // namespace
double ParseDurationMs(std::string_view text) {
  const std::string_view s = Trim(text);
  double value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec == std::errc() && end != s.data() && value >= 0 &&
      std::isfinite(value)) {
    const std::string_view unit =
        Trim(s.substr(static_cast<size_t>(end - s.data())));
    static const std::pair<std::string_view, double> kUnits[] = {
        {"", 1},      {"ms", 1},      {"s", 1000},
        {"m", 60000}, {"min", 60000}, {"h", 3600000}};
    for (const auto& [name, factor] : kUnits) {
      if (unit == name) return value * factor;
    }
  }
  throw Error(ErrorCode::kInvalidArgument,
              "not a duration: '" + std::string(text) +
                  "' (use a number with ms, s, m or h)");
}

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

Trace ReadCsvTrace(const std::string& path, const SizeTable* sizes,
                   const std::string& sizes_path) {
  LineReader in(path);
  TraceBuilder builder;
  std::vector<size_t> first_line;  // per model, for errors
  std::string_view line;
  std::vector<std::string> fields;
  size_t line_no = 0;
  int t_col = -1, model_col = -1, size_col = -1, duration_col = -1;
  size_t needed = 0;
  double previous_t = -std::numeric_limits<double>::infinity();
  while (in.Next(&line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    SplitCsv(line, &fields);
    if (t_col < 0) {
      bool azure_like = false;
      for (size_t i = 0; i < fields.size(); ++i) {
        const std::string_view name = Trim(fields[i]);
        if (name == "t_ms") t_col = static_cast<int>(i);
        if (name == "model") model_col = static_cast<int>(i);
        if (name == "size_bytes") size_col = static_cast<int>(i);
        if (name == "duration_ms") duration_col = static_cast<int>(i);
        if (name == "HashFunction") azure_like = true;
      }
      if (t_col < 0 || model_col < 0) {
        Fail(path, line_no, MissingColumnsMessage(t_col >= 0, azure_like));
      }
      needed = static_cast<size_t>(
                   std::max({t_col, model_col, size_col, duration_col})) +
               1;
      continue;
    }
    if (fields.size() < needed) {
      Fail(path, line_no,
           "expected at least " + std::to_string(needed) + " fields, found " +
               std::to_string(fields.size()));
    }
    double t = 0;
    if (!ParseNumber(fields[t_col], &t)) {
      Fail(path, line_no,
           "t_ms '" + std::string(Trim(fields[t_col])) + "' is not a number");
    }
    if (t < 0) {
      Fail(path, line_no, "negative t_ms " + std::string(Trim(fields[t_col])));
    }
    if (t > kMaxMs) {
      Fail(path, line_no, TooLarge("t_ms", Trim(fields[t_col])));
    }
    if (t < previous_t) {
      Fail(path, line_no,
           "t_ms " + std::string(Trim(fields[t_col])) +
               " is earlier than the previous request's; the trace must be "
               "sorted by time");
    }
    previous_t = t;
    const std::string_view name = Trim(fields[model_col]);
    if (name.empty()) Fail(path, line_no, "empty model name");
    const uint32_t model = builder.Model(name);
    if (first_line.size() < builder.trace.models.size())
      first_line.push_back(line_no);
    if (size_col >= 0 && !Trim(fields[size_col]).empty()) {
      const uint64_t size = ParseSize(path, line_no, fields[size_col]);
      if (builder.sized[model] && builder.trace.sizes[model] != size) {
        Fail(path, line_no,
             "model '" + std::string(name) + "' has size_bytes " +
                 std::to_string(size) + " here but " +
                 std::to_string(builder.trace.sizes[model]) + " earlier");
      }
      builder.trace.sizes[model] = size;
      builder.sized[model] = true;
    }
    if (duration_col >= 0) {
      double duration = 0;
      const std::string_view text = Trim(fields[duration_col]);
      if (!text.empty() && !ParseNumber(text, &duration)) {
        Fail(path, line_no,
             "duration_ms '" + std::string(text) + "' is not a number");
      }
      if (duration < 0) {
        Fail(path, line_no, "negative duration_ms " + std::string(text));
      }
      if (duration > kMaxMs) {
        Fail(path, line_no, TooLarge("duration_ms", text));
      }
      builder.trace.hold_ms.push_back(static_cast<float>(duration));
    }
    builder.trace.requests.push_back(
        Request{static_cast<int64_t>(std::llround(t)), model});
  }
  if (t_col < 0)
    Fail(path, 1, "empty file: expected a header naming 't_ms' and 'model'");
  if (builder.trace.requests.empty()) builder.trace.hold_ms.clear();
  for (uint32_t m = 0; m < builder.trace.models.size(); ++m) {
    if (builder.sized[m]) continue;
    const std::string& name = builder.trace.models[m];
    auto it = sizes ? sizes->find(name) : SizeTable::const_iterator{};
    if (!sizes || it == sizes->end()) {
      Fail(path, first_line[m], NoSizeMessage(name, sizes, sizes_path));
    }
    builder.trace.sizes[m] = it->second;
  }
  return std::move(builder.trace);
}

namespace {

// Reads a per-function CSV keyed by the column `key`, returning for each
// function the numbers in `columns` (whole-field, from 0 to kMaxMs).
std::unordered_map<std::string, std::vector<double>> ReadPerFunction(
    const std::string& path, const std::string& key,
    const std::vector<std::string>& columns) {
  LineReader in(path);
  std::unordered_map<std::string, std::vector<double>> out;
  std::string_view line;
  std::vector<std::string> fields;
  size_t line_no = 0;
  int key_col = -1;
  std::vector<int> cols;
  size_t needed = 0;
  while (in.Next(&line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    SplitCsv(line, &fields);
    if (key_col < 0) {
      for (size_t i = 0; i < fields.size(); ++i) {
        if (Trim(fields[i]) == key) key_col = static_cast<int>(i);
      }
      if (key_col < 0) {
        Fail(path, line_no, "the header must name the column '" + key + "'");
      }
      for (const std::string& c : columns) {
        auto it =
            std::find_if(fields.begin(), fields.end(),
                         [&](const std::string& f) { return Trim(f) == c; });
        if (it == fields.end()) {
          Fail(path, line_no, "the header must name the column '" + c + "'");
        }
        cols.push_back(static_cast<int>(it - fields.begin()));
      }
      needed = static_cast<size_t>(std::max(
                   key_col, *std::max_element(cols.begin(), cols.end()))) +
               1;
      continue;
    }
    if (fields.size() < needed) {
      Fail(path, line_no,
           "expected at least " + std::to_string(needed) + " fields, found " +
               std::to_string(fields.size()));
    }
    std::vector<double> values;
    for (size_t k = 0; k < cols.size(); ++k) {
      double v = 0;
      const std::string_view text = Trim(fields[cols[k]]);
      if (!ParseNumber(text, &v)) {
        Fail(path, line_no,
             columns[k] + " '" + std::string(text) + "' is not a number");
      }
      if (v < 0) {
        Fail(path, line_no, "negative " + columns[k] + " " + std::string(text));
      }
      if (v > kMaxMs) {
        Fail(path, line_no, TooLarge(columns[k], text));
      }
      values.push_back(v);
    }
    out[std::string(Trim(fields[key_col]))] = std::move(values);
  }
  if (key_col < 0) {
    Fail(path, 1, "empty file: expected a header naming '" + key + "'");
  }
  return out;
}

}  // namespace

Trace ReadAzureFunctionsTrace(const std::string& path, uint32_t num_models,
                              const SizeTable* sizes, uint64_t seed) {
  AzureOptions options;
  options.num_models = num_models;
  options.sizes = sizes;
  options.seed = seed;
  return ReadAzureFunctionsTrace(path, options);
}

Trace ReadAzureFunctionsTrace(const std::string& path,
                              const AzureOptions& options) {
  if (!options.memory_path.empty() &&
      !(options.memory_scale > 0 && std::isfinite(options.memory_scale))) {
    throw Error(ErrorCode::kInvalidArgument,
                "the memory scale must be a positive number, not " +
                    std::to_string(options.memory_scale));
  }
  const uint64_t seed = options.seed;
  std::mt19937_64 arrivals_rng(seed ^ 0x5DEECE66DULL);
  LineReader in(path);
  std::string_view line;
  std::vector<std::string> fields;
  size_t line_no = 0;
  std::vector<int64_t> minutes;
  struct Burst {
    int64_t t_ms;
    uint32_t function;
    uint32_t j;
  };
  std::vector<Burst> bursts;
  std::vector<std::string> hashes;  // per kept function
  uint32_t function = 0;
  uint64_t total = 0;  // requests so far, at most options.max_requests
  std::vector<int64_t> offsets;
  while (in.Next(&line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    SplitCsv(line, &fields);
    if (minutes.empty()) {
      static const char* const kLeading[] = {"HashOwner", "HashApp",
                                             "HashFunction", "Trigger"};
      for (size_t i = 0; i < 4; ++i) {
        if (fields.size() <= i || Trim(fields[i]) != kLeading[i]) {
          Fail(path, line_no,
               std::string("expected the Azure Functions header "
                           "'HashOwner,HashApp,HashFunction,Trigger,<minutes>.."
                           ".', column ") +
                   std::to_string(i + 1) + " should be '" + kLeading[i] + "'");
        }
      }
      for (size_t i = 4; i < fields.size(); ++i) {
        int64_t minute = 0;
        if (!ParseInteger(fields[i], &minute) || minute < 0) {
          Fail(path, line_no,
               "minute column '" + std::string(Trim(fields[i])) +
                   "' is not a whole minute number");
        }
        if (static_cast<double>(minute) > kMaxMs / 60000 - 1) {
          Fail(path, line_no,
               "minute column '" + std::string(Trim(fields[i])) +
                   "' is too large (its requests would come after " +
                   std::to_string(kMaxWholeMs) + " ms)");
        }
        minutes.push_back(minute);
      }
      if (minutes.empty())
        Fail(path, line_no, "no minute columns after 'Trigger'");
      continue;
    }
    if (fields.size() != minutes.size() + 4) {
      Fail(path, line_no,
           "expected " + std::to_string(minutes.size() + 4) +
               " fields, found " + std::to_string(fields.size()));
    }
    std::vector<Burst> mine;
    for (size_t c = 0; c < minutes.size(); ++c) {
      const std::string_view text = Trim(fields[c + 4]);
      if (!text.empty() && text.front() == '-') {
        Fail(path, line_no,
             "negative invocation count in minute " +
                 std::to_string(minutes[c]));
      }
      uint64_t count = 0;
      if (!text.empty() && !ParseInteger(text, &count)) {
        Fail(path, line_no,
             "invocation count '" + std::string(text) +
                 "' is not a whole number");
      }
      if (count > options.max_requests - total) {
        Fail(path, line_no,
             "the invocation counts add up to more than " +
                 std::to_string(options.max_requests) + " requests by minute " +
                 std::to_string(minutes[c]) + " (AzureOptions::max_requests)");
      }
      total += count;
      if (options.poisson && count > 0) {
        // Given the minute's count, Poisson arrival times are that many
        // uniform draws, sorted.
        offsets.resize(count);
        std::uniform_int_distribution<int64_t> within(0, 59999);
        for (auto& o : offsets) o = within(arrivals_rng);
        std::sort(offsets.begin(), offsets.end());
      }
      for (uint64_t j = 0; j < count; ++j) {
        const int64_t t =
            minutes[c] * 60000 +
            (options.poisson
                 ? offsets[j]
                 : static_cast<int64_t>(((2 * j + 1) * 60000) / (2 * count)));
        mine.push_back(Burst{t, function, static_cast<uint32_t>(j)});
      }
    }
    if (mine.empty()) continue;  // never invoked: dropped
    bursts.insert(bursts.end(), mine.begin(), mine.end());
    hashes.emplace_back(Trim(fields[2]));
    ++function;
  }
  if (minutes.empty())
    Fail(path, 1, "empty file: expected the Azure Functions header");
  std::sort(bursts.begin(), bursts.end(), [](const Burst& a, const Burst& b) {
    if (a.t_ms != b.t_ms) return a.t_ms < b.t_ms;
    if (a.function != b.function) return a.function < b.function;
    return a.j < b.j;
  });
  Trace trace;
  AzureModels(path, options, hashes, &trace.models, &trace.sizes);
  const uint32_t models = static_cast<uint32_t>(trace.models.size());
  trace.requests.reserve(bursts.size());
  for (const Burst& b : bursts)
    trace.requests.push_back(Request{b.t_ms, b.function % models});
  if (!options.durations_path.empty()) {
    AzureDurations durations(options, hashes);
    trace.hold_ms.reserve(bursts.size());
    for (const Burst& b : bursts) {
      trace.hold_ms.push_back(durations.Draw(b.function));
    }
  }
  return trace;
}

void AzureModels(const std::string& path, const AzureOptions& options,
                 const std::vector<std::string>& hashes,
                 std::vector<std::string>* names,
                 std::vector<uint64_t>* sizes) {
  const uint32_t function = static_cast<uint32_t>(hashes.size());
  const uint32_t models = options.num_models == 0
                              ? std::max<uint32_t>(function, 1)
                              : options.num_models;
  std::unordered_map<std::string, std::vector<double>> memory;
  if (!options.memory_path.empty()) {
    memory = ReadPerFunction(options.memory_path, "HashFunction",
                             {"AverageAllocatedMb_pct50"});
  }
  for (uint32_t m = 0; m < models; ++m) {
    names->push_back("model-" + std::to_string(m));
    uint64_t size = DefaultModelSize(m, options.seed);
    if (options.sizes) {
      auto it = options.sizes->find(names->back());
      if (it != options.sizes->end()) {
        size = it->second;
      } else {
        throw TraceError(
            path + ": the sizes file " +
            (options.sizes_path.empty() ? std::string()
                                        : options.sizes_path + " ") +
            "has no size for '" + names->back() + "' (add '" + names->back() +
            ",SIZE_BYTES' there: the trace's models are model-0 to model-" +
            std::to_string(models - 1) + ")");
      }
    } else if (!options.memory_path.empty() && m < function) {
      auto it = memory.find(hashes[m]);
      if (it == memory.end()) {
        throw TraceError(options.memory_path + ":1: no row for function " +
                         hashes[m]);
      }
      const double bytes = it->second[0] * options.memory_scale * 1048576.0;
      if (!(bytes < 0x1p63)) {
        throw TraceError(options.memory_path + ": function " + hashes[m] +
                         ": AverageAllocatedMb_pct50 times the memory scale "
                         "is more than 2^63 bytes");
      }
      size = static_cast<uint64_t>(std::llround(bytes));
    }
    sizes->push_back(size);
  }
}

namespace {

constexpr double kDurationAt[] = {0, 0.01, 0.25, 0.5, 0.75, 0.99, 1};

}  // namespace

AzureDurations::AzureDurations(const AzureOptions& options,
                               const std::vector<std::string>& hashes)
    : rng_(options.seed ^ 0xD0A710ULL) {
  const std::vector<std::string> columns = {
      "percentile_Average_0",  "percentile_Average_1",  "percentile_Average_25",
      "percentile_Average_50", "percentile_Average_75", "percentile_Average_99",
      "percentile_Average_100"};
  auto durations =
      ReadPerFunction(options.durations_path, "HashFunction", columns);
  per_function_.reserve(hashes.size());
  for (const std::string& hash : hashes) {
    auto it = durations.find(hash);
    if (it == durations.end()) {
      throw TraceError(options.durations_path + ":1: no row for function " +
                       hash);
    }
    per_function_.push_back(it->second);
  }
}

float AzureDurations::Draw(uint32_t function) {
  // The inverse of the CDF the percentiles sketch, linear between them.
  const std::vector<double>& p = per_function_[function];
  const double u = uniform_(rng_);
  size_t k = 1;
  while (k + 1 < std::size(kDurationAt) && u > kDurationAt[k]) ++k;
  const double f =
      (u - kDurationAt[k - 1]) / (kDurationAt[k] - kDurationAt[k - 1]);
  return static_cast<float>(p[k - 1] + f * (p[k] - p[k - 1]));
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
