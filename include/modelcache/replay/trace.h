// Traces: a time-ordered list of (time, model) requests with a size per
// model, and optionally each request's service time; the readers of the CSV
// and Azure Functions layouts, and the embedded default trace (trace.cc,
// csv_trace.cc, azure_trace.cc).
#ifndef MODELCACHE_REPLAY_TRACE_H_
#define MODELCACHE_REPLAY_TRACE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "modelcache/base/bytes.h"
#include "modelcache/base/duration.h"
#include "modelcache/base/errors.h"

namespace modelcache::replay {

// A bad trace or sizes file: the message names the file and the line.
class TraceError : public Error {
 public:
  explicit TraceError(const std::string& message)
      : Error(ErrorCode::kInvalidData, message) {}
};

struct Request {
  int64_t t_ms;
  uint32_t model;  // index into Trace::models
};

struct Trace {
  std::vector<std::string> models;  // index -> name
  std::vector<uint64_t> sizes;      // index -> bytes
  std::vector<Request> requests;    // ordered by time
  // Per request, how long it holds its lease (its service time) in ms; empty
  // when the trace has none (ReplayOptions::hold_ms applies).
  std::vector<float> hold_ms;
};

using SizeTable = std::map<std::string, uint64_t, std::less<>>;

using ::modelcache::FormatBytes;
using ::modelcache::ParseBytes;  // throws Error kInvalidArgument

// A `model,size_bytes` CSV with that header.
SizeTable ReadSizes(const std::string& path);

using ::modelcache::ParseDurationMs;  // throws Error kInvalidArgument

// A CSV whose header names at least `t_ms` and `model`, optionally
// `size_bytes` and `duration_ms` (the request's service time); other columns
// are ignored. A model's size comes from its
// rows' size_bytes, else from `sizes`; a model with neither is an error, as
// are negative sizes, malformed numbers and times earlier than the previous
// request's.
// `sizes_path` names the file `sizes` came from, for the error of a model
// it lacks.
Trace ReadCsvTrace(const std::string& path, const SizeTable* sizes,
                   const std::string& sizes_path = {});

// The Azure Functions 2019 per-minute layout (HashOwner, HashApp,
// HashFunction, Trigger, then one column per minute of the day). Functions
// with no invocation are dropped; function i (0-based, file order) is model
// i % num_models (num_models 0: one model per function); a count c in minute
// m becomes c requests at m*60000 + ((2j+1)*60000)/(2c) ms, j = 0..c-1,
// ordered by time, then function, then j. Sizes come from `sizes` (by model
// name, "model-<i>") or else from DefaultModelSize.
Trace ReadAzureFunctionsTrace(const std::string& path, uint32_t num_models,
                              const SizeTable* sizes, uint64_t seed);

struct AzureOptions {
  uint32_t num_models = 0;
  const SizeTable* sizes = nullptr;
  std::string sizes_path;  // where `sizes` came from, for errors
  uint64_t seed = 42;
  // Spread each minute's c requests as a seeded Poisson process (c uniform
  // times in the minute, sorted) instead of evenly.
  bool poisson = false;
  // The trace's memory file: model i is sized by the 50th-percentile MB of
  // the first function mapped to it, times `memory_scale` (a positive
  // number; anything else is an InvalidArgument error), in MiB.
  std::string memory_path;
  double memory_scale = 1;
  // The trace's durations file: each request's service time is a seeded draw
  // from its function's duration percentiles (piecewise linear between them).
  std::string durations_path;
  // Invocation counts that add up to more requests than this are refused
  // with a TraceError before they are expanded (each request takes about 32
  // bytes while the file is read). The default is far above any real trace
  // a replay could hold, and is there so that a malformed count is an error,
  // not an allocation that fails or exhausts memory.
  uint64_t max_requests = 1'000'000'000;
};
Trace ReadAzureFunctionsTrace(const std::string& path,
                              const AzureOptions& options);

// A realistic serving mix, deterministic in (model, seed): 40% small vision
// and embedding models (20-300 MiB), 30% mid-size models and adapters
// (300 MiB-1.5 GiB), 20% diffusion checkpoints (2-7 GiB), 10% LLMs
// (7-16 GiB); log-uniform within each class.
uint64_t DefaultModelSize(uint32_t model, uint64_t seed);

// The embedded default: a zoo of 60 models sized by DefaultModelSize and
// 200,000 requests over 8 hours with Zipf popularity (exponent 2.2) that
// drifts over the day (what is hot in the morning cools by the afternoon).
Trace GenerateDefaultTrace(uint64_t seed);

// The embedded default's popularity as its generator draws it: a request at
// trace time t (ms) is for model m with probability (1 - t / span_ms) *
// morning[m] + (t / span_ms) * afternoon[m] (each vector sums to 1), and
// requests are spread uniformly over the span. For analysis: the most an
// online policy could know about the trace (bench/policy_bound.cc).
struct DefaultTracePopularity {
  std::vector<double> morning, afternoon;
  int64_t span_ms = 0;
};
DefaultTracePopularity DefaultTracePopularityOf(uint64_t seed);

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_TRACE_H_
