// The replay of a trace through the real cache: in trace time (Simulate,
// with a modelled load path) or untimed (ReplayUntimed), one run per
// (policy, capacity) pair, and what a run reports (RunResult). See replay.h
// for the overview and src/replay/engine.h for the simulation's design.
#ifndef MODELCACHE_REPLAY_SIMULATE_H_
#define MODELCACHE_REPLAY_SIMULATE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/core/cache.h"
#include "modelcache/replay/trace.h"
#include "modelcache/replay/trace_source.h"

namespace modelcache::replay {

// The load path in trace time: `latency_ms + bytes / bandwidth` per load,
// loads in flight sharing the bandwidth equally, at most `slots` in flight.
struct TimeModel {
  double bandwidth_bytes_per_second = 2e9;  // may be infinity
  double latency_ms = 100;
  uint32_t slots = 4;  // 0: unlimited
};

// The drain (Simulate only; the rule is the core Budget's): while a demand
// load waits for room that only leased models can give, requests for those
// models overtake it (hits are admitted at once). Once the oldest such wait
// has lasted `drain_after`, the models whose eviction it needs (its drain
// set: resident models, idle and leased alike, least recently used first,
// until they cover the bytes it lacks) stop taking leases as a whole: new
// requests for them queue, in arrival order, and take no lease. When the
// set's last lease ends the waiter gets that room and loads; the bytes the
// set frees go only to it, and other loads may use only bytes that no one is
// owed. The drain ends with its waiter (it loads, or every request for it
// left after SimulateOptions::max_wait_ms); the requests queued behind it
// are then admitted in arrival order with their arrival times (a hit, or a
// miss that may wait for room in its turn, under the same rule). One drain
// runs at a time, for the oldest waiter. 0: strict arrival order; infinity
// (kNeverDrain): no drain, requests overtake a wait for room for ever.
inline constexpr double kNeverDrain = std::numeric_limits<double>::infinity();

// The default drain_after for a waiter whose load takes `load_ms` on an
// otherwise idle load path, on a node whose drains lasted `recent_drain_ms`
// of late (NextRecentDrainMs; 0 before the first): the core's rule
// (budget.h, kDrainAfterAuto and DefaultDrainAfter, one definition for
// both), the largest of kDrainAfterFloor, kDrainAfterLoadMultiple times the
// load time and kDrainAfterDrainMultiple times the recent drains. Chosen on
// the sweeps in docs/benchmarks.md ("drain-after"). The replay knows each
// load's time from the time model; a cache judges it by what it last
// measured loading the key (the floor before its first load), so the two
// agree where the floor rules or the key loaded before in the same time.
// A drain lasts from its start until its waiter gets the room or leaves,
// in both.
using ::modelcache::kDrainAfterDrainMultiple;
using ::modelcache::kDrainAfterLoadMultiple;
inline constexpr double kDrainAfterFloorMs =
    std::chrono::duration<double, std::milli>(kDrainAfterFloor).count();
double DefaultDrainAfterMs(double load_ms, double recent_drain_ms = 0);
// The node's recent drains after one of `drain_ms` (the core's
// NextRecentDrains, in ms).
double NextRecentDrainMs(double recent_drain_ms, double drain_ms);

struct SimulateOptions {
  // Service time of requests whose trace gives none.
  double hold_ms = 0;
  // The load path (Simulate only); also prices faascache and leads the
  // prewarm policies' prewarms.
  TimeModel time;
  // A request still waiting this long leaves, counted as rejected; a queued
  // load whose every requester left never starts. Infinity: none.
  double max_wait_ms = std::numeric_limits<double>::infinity();
  // How long the oldest wait for room lets requests overtake it before its
  // drain set drains (see kNeverDrain above). Empty: DefaultDrainAfterMs of
  // what the node last measured loading the waiter's model, as a cache does
  // (never loaded: the floor).
  std::optional<double> drain_after_ms;
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
                           // (timed: still waiting at the end; see below)
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
  // SimulateOptions::drain_after_ms of the run (empty: the default), and
  // the drains it started.
  std::optional<double> drain_after_ms;
  uint64_t drains = 0;
  // Requests that queued behind a drain (their model drained): served as
  // hits or cold starts when it ended, or rejected.
  uint64_t drain_queued = 0;
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
// after ReplayOptions::max_wait_ms, or blocked (untimed, with held leases;
// timed, still waiting when the replay had nothing left to do).
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

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_SIMULATE_H_
