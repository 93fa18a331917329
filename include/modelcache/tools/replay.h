// Trace replay: how a request mix behaves under a memory budget.
//
// A trace is a time-ordered list of (time, model) requests with a size per
// model. Replay runs it through the real core cache (ModelCache with one
// shard, so the eviction order is exact) once per (policy, capacity) pair
// and reports hits, misses, bytes loaded again and evictions. Requests are
// served one at a time; each lease ends before the next request unless a
// hold time keeps it for that long in trace time.
#ifndef MODELCACHE_TOOLS_REPLAY_H_
#define MODELCACHE_TOOLS_REPLAY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/core/bytes.h"

namespace modelcache::replay {

// A bad trace or sizes file: the message names the file and the line.
class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Request {
  int64_t t_ms;
  uint32_t model;  // index into Trace::models
};

struct Trace {
  std::vector<std::string> models;  // index -> name
  std::vector<uint64_t> sizes;      // index -> bytes
  std::vector<Request> requests;    // ordered by time
};

using SizeTable = std::map<std::string, uint64_t, std::less<>>;

// "16GiB", "512MiB", "1.5 GiB", "4096" (bytes); KiB/MiB/GiB/TiB and
// KB/MB/GB/TB. Throws std::invalid_argument on anything else.
uint64_t ParseBytes(std::string_view text);
using ::modelcache::FormatBytes;

// A `model,size_bytes` CSV with that header.
SizeTable ReadSizes(const std::string& path);

// A CSV whose header names at least `t_ms` and `model`, optionally
// `size_bytes`; other columns are ignored. A model's size comes from its
// rows' size_bytes, else from `sizes`; a model with neither is an error, as
// are negative sizes, malformed numbers and times earlier than the previous
// request's.
Trace ReadCsvTrace(const std::string& path, const SizeTable* sizes);

// The Azure Functions 2019 per-minute layout (HashOwner, HashApp,
// HashFunction, Trigger, then one column per minute of the day). Functions
// with no invocation are dropped; function i (0-based, file order) is model
// i % num_models (num_models 0: one model per function); a count c in minute
// m becomes c requests at m*60000 + ((2j+1)*60000)/(2c) ms, j = 0..c-1,
// ordered by time, then function, then j. Sizes come from `sizes` (by model
// name, "model-<i>") or else from DefaultModelSize.
Trace ReadAzureFunctionsTrace(const std::string& path, uint32_t num_models,
                              const SizeTable* sizes, uint64_t seed);

// A realistic serving mix, deterministic in (model, seed): 40% small vision
// and embedding models (20-300 MiB), 30% mid-size models and adapters
// (300 MiB-1.5 GiB), 20% diffusion checkpoints (2-7 GiB), 10% LLMs
// (7-16 GiB); log-uniform within each class.
uint64_t DefaultModelSize(uint32_t model, uint64_t seed);

// The embedded default: a zoo of 60 models sized by DefaultModelSize and
// 200,000 requests over 8 hours with Zipf-like popularity that drifts over
// the day (what is hot in the morning cools by the afternoon).
Trace GenerateDefaultTrace(uint64_t seed);

struct RunResult {
  std::string policy;
  bool offline = false;  // Belady's: needs the future
  uint64_t capacity_bytes = 0;
  uint64_t requests = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;     // includes too_large and blocked
  uint64_t too_large = 0;  // model larger than the capacity: refused
  uint64_t blocked = 0;    // no room: every resident model held by a lease
  uint64_t bytes_loaded = 0;
  uint64_t evictions = 0;
  double hit_ratio = 0;
  // Bytes of the requests that missed / bytes of all requests.
  double byte_miss_ratio = 0;
  double seconds = 0;
  double requests_per_second = 0;
  uint64_t peak_resident_bytes = 0;
  // Resident bytes at evenly spaced points of trace time: (t_ms, bytes).
  std::vector<std::pair<int64_t, uint64_t>> resident_over_time;
  std::vector<uint32_t> loads_per_model;
};

// One replay through a fresh cache. `policy` is a PolicyByName name.
// Throws std::invalid_argument for an unknown policy.
RunResult Replay(const Trace& trace, const std::string& policy,
                 uint64_t capacity_bytes, double hold_ms = 0);

// Every (policy, capacity) pair, on up to `threads` threads; results in
// policy-major order. `progress` (may be empty) is called with the number of
// finished runs, from the calling thread.
std::vector<RunResult> ReplayAll(
    const Trace& trace, const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, double hold_ms, unsigned threads,
    const std::function<void(size_t done, size_t total)>& progress = {});

std::string ResultsTable(const Trace& trace,
                         const std::vector<RunResult>& results);
std::string ResultsJson(const Trace& trace,
                        const std::vector<RunResult>& results);
// One self-contained HTML page (inline SVG, no scripts, no network).
std::string HtmlReport(const Trace& trace, const std::string& title,
                       const std::vector<RunResult>& results);

}  // namespace modelcache::replay

#endif  // MODELCACHE_TOOLS_REPLAY_H_
