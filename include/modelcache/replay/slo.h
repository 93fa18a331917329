// The capacity an SLO needs: a search over capacities by replaying in trace
// time (slo.cc).
#ifndef MODELCACHE_REPLAY_SLO_H_
#define MODELCACHE_REPLAY_SLO_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "modelcache/replay/simulate.h"
#include "modelcache/replay/trace.h"
#include "modelcache/replay/trace_source.h"

namespace modelcache::replay {

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

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_SLO_H_
