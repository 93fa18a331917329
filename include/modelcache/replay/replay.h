// Trace replay: how a request mix behaves under a memory budget.
//
// A trace is a time-ordered list of (time, model) requests with a size per
// model. A replay runs it through the real core cache (ModelCache with one
// shard, so the eviction order is exact), with a policy from the core's
// registry (PolicyByName), once per (policy, capacity) pair, and reports
// hits, misses, bytes loaded again and evictions. There are two:
//   * Simulate: in trace time. Loads take time on a modelled load path
//     (TimeModel: latency, shared bandwidth, slots), requests wait for them
//     and hold their leases for their service time, keep-alive policies
//     unload and prewarm on the trace's clock; it reports waits, cold
//     starts, idle memory and the load queue besides.
//   * ReplayUntimed: every load instantaneous, each lease given back before
//     the next request unless a hold time keeps it; the counts alone.
// ReplayAll runs either for many (policy, capacity) pairs on several
// threads.
#ifndef MODELCACHE_REPLAY_REPLAY_H_
#define MODELCACHE_REPLAY_REPLAY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/bytes.h"
#include "modelcache/base/duration.h"
#include "modelcache/base/errors.h"
#include "modelcache/core/cache.h"

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

// ---- Traces read as a stream (csv_trace.cc, azure_trace.cc) ----
//
// Every file replay reads (traces, sizes, memory and durations files) may be
// compressed: gzip and zstd are recognised by their first bytes, and data
// that is truncated or corrupt is a TraceError naming the file and the line
// being read.
//
// A trace too large to hold is read as a stream. A TraceSource knows the
// trace's models and extent (its TraceHeader) before any request is read,
// and gives its requests in order, once per pass, as many passes as asked:
// a replay holds memory in proportion to the models and to the requests in
// flight, never to the trace. OpenCsvTrace and OpenAzureFunctionsTrace read
// their file once when opened (to learn the header, with every check and
// message of ReadCsvTrace and ReadAzureFunctionsTrace: each format has one
// parser, which the in-memory reader uses too), and the CSV source reads it
// again for each pass; the requests of a pass are exactly those the
// in-memory reader gives.

// A trace without its requests: what a replay needs to know before the
// first request.
struct TraceHeader {
  std::vector<std::string> models;  // index -> name
  std::vector<uint64_t> sizes;      // index -> bytes
  uint64_t requests = 0;
  // The first and the last request's time (0 when there are none).
  int64_t t_first_ms = 0, t_last_ms = 0;
  // Each request carries its service time (Trace::hold_ms).
  bool service_times = false;
};

TraceHeader HeaderOf(const Trace& trace);

// One pass over a trace's requests.
class RequestReader {
 public:
  virtual ~RequestReader() = default;
  // Copies up to `max` (> 0) next requests into `requests`, and their
  // service times into `hold_ms` when the header says it has them (else
  // `hold_ms` is not used and may be null); returns how many, 0 only at the
  // end of the trace. Throws TraceError (a file that changed or broke since
  // the source was opened).
  virtual size_t Read(Request* requests, float* hold_ms, size_t max) = 0;
};

class TraceSource {
 public:
  virtual ~TraceSource() = default;
  virtual const TraceHeader& header() const = 0;
  // A new pass, from the first request. Passes are independent: several may
  // be open at once, on different threads.
  virtual std::unique_ptr<RequestReader> Read() const = 0;
};

struct StreamOptions {
  // Called now and then while a file is first read, from the calling
  // thread, with the bytes of the file read so far and its size (0 when it
  // is not a regular file).
  std::function<void(uint64_t done, uint64_t total)> progress;
  // The file the sizes table came from, for the error of a model it lacks.
  std::string sizes_path;
};

// The CSV of ReadCsvTrace, as a stream. Opening reads the whole file once
// (its models, sizes, requests and span); each pass reads it again.
// Holds the models' names and sizes, and one buffer of the file.
std::unique_ptr<TraceSource> OpenCsvTrace(const std::string& path,
                                          const SizeTable* sizes,
                                          const StreamOptions& stream = {});

// The Azure Functions layout of ReadAzureFunctionsTrace, as a stream.
// Opening reads the file: its non-zero counts are kept (memory in proportion
// to the file, not to the requests they stand for). A pass expands them a
// minute at a time, merging the functions' requests of each minute by time;
// with Poisson arrivals it keeps a random number generator per function
// (5 KB each) and the draws of the minute being read (at most 480 KB per
// function). options.max_requests caps the requests as it does there.
std::unique_ptr<TraceSource> OpenAzureFunctionsTrace(
    const std::string& path, const AzureOptions& options,
    const StreamOptions& stream = {});

// An in-memory trace as a source (no copy). REQUIRES: `trace` outlives it.
std::unique_ptr<TraceSource> SourceOf(const Trace& trace);

// The load path in trace time: `latency_ms + bytes / bandwidth` per load,
// loads in flight sharing the bandwidth equally, at most `slots` in flight.
struct TimeModel {
  double bandwidth_bytes_per_second = 2e9;  // may be infinity
  double latency_ms = 100;
  uint32_t slots = 4;  // 0: unlimited
};

struct SimulateOptions {
  // Service time of requests whose trace gives none.
  double hold_ms = 0;
  // The load path (Simulate only); also prices faascache and leads the
  // prewarm policies' prewarms.
  TimeModel time;
  // A request still waiting this long leaves, counted as rejected; a queued
  // load whose every requester left never starts. Infinity: none.
  double max_wait_ms = std::numeric_limits<double>::infinity();
  // Prewarms at fixed times, beside any the policy makes (what-if runs and
  // tests).
  std::vector<Request> prewarms;
  // Told every cache event with the trace time it happened at (tests).
  std::function<void(double t_ms, const CacheEvent& event)> on_event;
  // The waits' percentiles are exact while at most this many requests wait
  // more than 0 (each such wait is kept, 8 bytes: 128 MiB at the default,
  // about 16.8 M waits, so a 10-million-request trace is exact). Beyond,
  // they are counted in buckets 1/1024 of a power of two wide (512 KB), and
  // each percentile is at most 0.1% above the exact one, never below it.
  uint64_t max_exact_waits = uint64_t{1} << 24;
  // An offline policy (belady) needs the future: before its replay it reads
  // the trace once more for an index of each request's next use, 4 bytes a
  // request. A trace whose index would take more than this is an error that
  // names the memory it needs.
  uint64_t max_next_use_index_bytes = uint64_t{4} << 30;
  // When set, the replay adds the requests it has replayed, now and then
  // (progress for a long replay; ReplayAll's runs add to one counter).
  std::atomic<uint64_t>* requests_done = nullptr;
};

struct ReplayOptions : SimulateOptions {
  // Which replay ReplayAll runs: Simulate, or ReplayUntimed.
  bool timed = true;
};

// Nearest-rank percentile (p in [0, 1]) of `sorted`, which must be sorted
// ascending; 0 when empty.
double Percentile(const std::vector<double>& sorted, double p);

struct WaitSummary {
  double p50 = 0, p95 = 0, p99 = 0, p999 = 0, max = 0;
};

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

  // ---- the time model (zero when untimed) ----
  bool timed = false;
  uint64_t cold_starts =
      0;  // requests that waited for a load, started or joined
  double cold_start_ratio = 0;
  WaitSummary
      wait_ms;  // over the requests served (not too large, not rejected)
  uint64_t rejected = 0;       // left after ReplayOptions::max_wait_ms
  uint64_t prewarms = 0;       // loads the policy started ahead of demand
  double load_seconds = 0;     // trace time spent loading, summed over loads
  double disk_busy_ratio = 0;  // of trace time, at least one load in flight
  // Loads waiting for a slot or for room, time-weighted over the trace.
  uint64_t load_queue_peak = 0;
  double load_queue_mean = 0;
  double idle_gib_hours = 0;  // resident with no lease and not loading
  double p75_model_cold_start_ratio = 0;
  // The loads need the link at least 90% of the trace: the queue drains only
  // by requests joining loads already queued, and grows without bound.
  bool overloaded = false;
  // The wait distribution at 1000 evenly spaced quantiles (for the CDF).
  std::vector<double> wait_quantiles;
  // Evenly spaced bins of trace time: (t_ms at the bin's end, min, mean, max)
  // resident bytes and the load queue's longest within the bin.
  struct Bin {
    int64_t t_ms;
    double min_bytes, mean_bytes, max_bytes;
    uint32_t queue;
  };
  std::vector<Bin> bins;
};

// The requests a run did not serve: too large for its capacity, rejected
// after ReplayOptions::max_wait_ms, or (untimed, with held leases) blocked.
// Waits are over the requests served, so a run with any of these meets no
// SLO however short its waits (SloProbe::served_all), and the table flags
// its row UNSERVED.
inline uint64_t UnservedRequests(const RunResult& r) {
  return r.too_large + r.rejected + r.blocked;
}

// The replay in trace time, through a fresh cache of `capacity_bytes` run
// by the policy named `policy` (PolicyByName, online or offline; faascache
// is priced by options.time). A discrete-event simulation; see engine.h.
// Throws Error kInvalidArgument for an unknown policy.
RunResult Simulate(const Trace& trace, const std::string& policy,
                   uint64_t capacity_bytes,
                   const SimulateOptions& options = {});
// The same, on one pass of `source` (two for an offline policy): memory in
// proportion to the models and the requests in flight, not to the trace.
// The result is the one of Simulate on the trace the source gives.
RunResult Simulate(const TraceSource& source, const std::string& policy,
                   uint64_t capacity_bytes,
                   const SimulateOptions& options = {});

// The untimed replay: every load instantaneous, no queue, nothing waits
// (options.time is not used but to price faascache). Gives the counts of
// Simulate with an infinitely fast load path. Throws Error kInvalidArgument
// for an unknown policy.
RunResult ReplayUntimed(const Trace& trace, const std::string& policy,
                        uint64_t capacity_bytes,
                        const SimulateOptions& options = {});
RunResult ReplayUntimed(const TraceSource& source, const std::string& policy,
                        uint64_t capacity_bytes,
                        const SimulateOptions& options = {});

// Every (policy, capacity) pair through Simulate (options.timed) or
// ReplayUntimed, on up to `threads` threads; results in policy-major order.
// `progress` (may be empty) is called with the number of finished runs, from
// the calling thread. Throws the first unknown policy's error before running
// anything.
std::vector<RunResult> ReplayAll(
    const Trace& trace, const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, const ReplayOptions& options,
    unsigned threads,
    const std::function<void(size_t done, size_t total)>& progress = {});
// The same on a source: each run reads its own passes.
std::vector<RunResult> ReplayAll(
    const TraceSource& source, const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, const ReplayOptions& options,
    unsigned threads,
    const std::function<void(size_t done, size_t total)>& progress = {});

// ---- The capacity an SLO needs (slo.cc) ----
//
// A capacity meets an SLO "wait at percentile P <= S ms" when the replay in
// trace time at that capacity serves every request (none too large for it,
// none rejected, none blocked) and the wait at P over the requests served is
// at most S. FindSloCapacities searches for the smallest such capacity per
// policy by replaying, between the largest requested model (below it some
// request is too large) and the sum of all models.
//
// The wait at a percentile is not exactly monotone in capacity: evicting a
// different model can delay a later load, so one more GiB can lengthen p99 a
// little. The search therefore answers the smallest capacity C that met the
// SLO such that every capacity it probed above C met it too, and records
// whether some probe below C also met it (SloAnswer::monotone). It probes
// in rounds, each round's probes run in parallel:
//   1. a coarse sweep: the sum of all models and geometrically spaced
//      capacities from the largest model up, so that consecutive probes
//      (those given in `known` included) are at most kSloSweepRatio apart;
//   2. then, while the bracket (largest probe below C, C] is wider than the
//      resolution, probes evenly spaced inside it (one, a bisection, when
//      there are more brackets than threads; more when threads are idle).
// Each round recomputes C from all probes, so a failing probe above the
// current C moves the answer up rather than being ignored.

inline constexpr double kSloSweepRatio = 2.0;

struct SloSearchOptions {
  double slo_ms = 1000;  // positive and finite
  // Of the waits, in (0, 100], in steps of 0.1 (the replay keeps the waits
  // at every 0.1% quantile); 100 is the longest wait.
  double percentile = 99;
  // The answer is at most max(resolution_fraction * answer,
  // resolution_bytes) above the largest capacity probed below it that
  // failed. Neither may be negative or non-finite, nor both zero.
  double resolution_fraction = 0.01;
  uint64_t resolution_bytes = uint64_t{256} << 20;
  // Further SLOs (ms) whose capacities are searched too, at the coarser
  // curve resolution, sharing the probes (the report's chart of capacity
  // against SLO). Each positive and finite.
  std::vector<double> curve_slo_ms;
  double curve_resolution_fraction = 0.10;
  uint64_t curve_resolution_bytes = uint64_t{256} << 20;
};

// One replay the search ran (or was given).
struct SloProbe {
  uint64_t capacity_bytes = 0;
  double wait_ms = 0;       // at the percentile, over the requests served
  bool served_all = false;  // none too large, rejected or blocked
};

struct SloAnswer {
  std::string policy;
  // The answer; empty ("none") when no capacity up to the sum of all models
  // meets the SLO.
  std::optional<uint64_t> capacity_bytes;
  // The largest capacity below the answer known to fail: a probe, or one
  // byte less than the largest requested model. With an answer, the SLO's
  // threshold lies in (failing_bytes, capacity_bytes].
  uint64_t failing_bytes = 0;
  // False when a probe below the answer met the SLO (the wait is not
  // monotone in capacity there).
  bool monotone = true;
  // Every probe of this policy, by capacity.
  std::vector<SloProbe> probes;
  // The capacity each of SloSearchOptions::curve_slo_ms needs, in its order.
  std::vector<std::optional<uint64_t>> curve;
};

// The answer a set of probes gives for an SLO of `slo_ms` (the search's
// rule, above): the smallest probed capacity that met it with every probe
// above it meeting it too; none when the largest probe failed or there is
// no probe. `largest_model` is the largest requested model: a capacity
// below it fails without a probe. Fills every field but policy and curve.
SloAnswer SloAnswerFromProbes(std::vector<SloProbe> probes,
                              uint64_t largest_model, double slo_ms);

// The wait at `percentile` (as SloSearchOptions::percentile) over the
// requests `result` served; 0 when it served none.
double WaitAtPercentile(const RunResult& result, double percentile);

// "p99", "p99.9", "max".
std::string PercentileName(double percentile);

// Throws Error kInvalidArgument naming the bad field of `options`.
void ValidateSloOptions(const SloSearchOptions& options);

// Where a search stands, for progress: the round under way (0 the sweep,
// then the bisections), its probes and those of it done, and a bound on the
// rounds after it (each bisection halves every open bracket, so the widest
// bracket and its resolution bound them; the search may end sooner).
struct SloProgress {
  size_t probes_done = 0;  // every round's, so far
  size_t round = 0;
  size_t round_probes = 0, round_done = 0;
  size_t rounds_left = 0;  // at most, after this one
};

// Per policy (in the order given), the smallest capacity that meets the SLO
// (see above), each probe a Simulate of `trace` with `options`, on up to
// `threads` threads. `known` are Simulate runs of the same trace and
// options (the table's, say); those of a searched policy count as probes.
// `progress` (may be empty) is called from the calling thread as each round
// starts and once for each of its probes that ends. Throws Error
// kInvalidArgument for bad options or an unknown policy, before replaying
// anything.
std::vector<SloAnswer> FindSloCapacities(
    const Trace& trace, const std::vector<std::string>& policies,
    const SimulateOptions& options, const SloSearchOptions& slo,
    unsigned threads, const std::vector<RunResult>& known = {},
    const std::function<void(const SloProgress&)>& progress = {});
// The same on a source (a streamed trace): one pass finds the requested
// models, and each probe reads its own passes.
std::vector<SloAnswer> FindSloCapacities(
    const TraceSource& source, const std::vector<std::string>& policies,
    const SimulateOptions& options, const SloSearchOptions& slo,
    unsigned threads, const std::vector<RunResult>& known = {},
    const std::function<void(const SloProgress&)>& progress = {});

// How the table, JSON and report describe the run.
struct RunInfo {
  bool timed = false;
  TimeModel time;
  // The SLO and its answers (none searched when empty).
  SloSearchOptions slo;
  std::vector<SloAnswer> slo_answers;
  // The policies whose time series the report draws (all when empty).
  std::vector<std::string> report_policies;
  // Lines the table prints above its header (how its capacities were
  // chosen, say).
  std::vector<std::string> notes;
};

// Each reads only the trace's models, sizes and request count: a
// TraceHeader (a streamed trace's) or a Trace.
std::string ResultsTable(const TraceHeader& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info = {});
std::string ResultsJson(const TraceHeader& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info = {});
// One self-contained HTML page (inline SVG, no scripts, no network).
std::string HtmlReport(const TraceHeader& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info = {});
std::string ResultsTable(const Trace& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info = {});
std::string ResultsJson(const Trace& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info = {});
std::string HtmlReport(const Trace& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info = {});

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_REPLAY_H_
