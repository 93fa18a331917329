// The books of a replay in trace time: what the engine counts and
// integrates, and their reduction to a RunResult. Knows nothing of events,
// loads or caches: the engine reports each request's outcome and, between
// events, the piecewise-constant state of the node (idle bytes, loads in
// flight, the queue, resident bytes), which the books integrate over the
// trace's span, [first request, last request]. The span is known before the
// first request (TraceHeader), so the books hold the models and a fixed
// number of bins, never the requests: a trace of any length fits.
#ifndef MODELCACHE_SRC_REPLAY_BOOKS_H_
#define MODELCACHE_SRC_REPLAY_BOOKS_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {

// The waits of the requests served, for their percentiles (nearest rank,
// as Percentile). Exact while at most `max_exact` of them are not 0: those
// are kept, the zeros only counted. Beyond that, the waits that are not 0
// are counted in buckets 1/1024 of a power of two wide (from 2^-20 ms, about
// a nanosecond, to 2^44 ms; about 512 KB), and a percentile is the upper
// edge of its bucket, capped by the longest wait: never below the exact
// value and at most 0.1% above it (a wait under 2^-20 ms reads as at most
// 2^-20 ms; one over 2^44 ms as the longest wait).
class WaitDistribution {
 public:
  explicit WaitDistribution(uint64_t max_exact) : max_exact_(max_exact) {}

  void Add(double ms);
  uint64_t count() const { return zeros_ + nonzero_; }
  double max() const { return max_; }
  bool exact() const { return buckets_.empty(); }
  // The waits at each of `p` (in [0, 1]); 0 when there are none.
  std::vector<double> Percentiles(const std::vector<double>& p) &&;

 private:
  static constexpr int kSubBits = 10;
  static constexpr int kMinExponent = -20, kMaxExponent = 44;
  static size_t Bucket(double ms);
  static double UpperEdge(size_t bucket);

  const uint64_t max_exact_;
  uint64_t zeros_ = 0, nonzero_ = 0;
  double max_ = 0;
  std::vector<double> exact_;      // the waits that are not 0, while exact
  std::vector<uint64_t> buckets_;  // counts, once not exact
};

class Books {
 public:
  // The node's state between two events.
  struct State {
    uint64_t idle_bytes = 0;  // resident, no lease, not loading
    bool loading = false;     // at least one load in flight
    uint32_t queued = 0;      // demand loads waiting for a slot or room
    uint64_t resident_bytes = 0;
  };

  // The books of a replay of `trace`'s models (its names and sizes; its
  // requests are not read) over [t_first, t_last], of which 240 bins are
  // kept; the waits exact as WaitDistribution says.
  Books(const TraceHeader& trace, double t_first, double t_last,
        uint64_t max_exact_waits);

  // The state held over [from, to); only the part within the span counts.
  void Advance(double from, double to, const State& state);
  // The queue's length once the loads that could start have started.
  void NoteQueue(uint32_t queued);

  // A request for model `m` arrived: a hit, a model too large for the
  // capacity, or a cold start (it waits for a load started or joined). The
  // books count the requests they are told of (a node of several sees only
  // its own).
  void Hit(uint32_t m);
  void TooLarge(uint32_t m);
  void ColdStart(uint32_t m);
  // A served request's wait (0 for a hit); one that left is rejected.
  void Waited(double ms) { waits_.Add(ms); }
  void Rejected() { ++result_.rejected; }
  // A load of `m` started; one ended after `ms` (ahead of demand, if
  // `prewarm`).
  void LoadStarted(uint32_t m) { ++result_.loads_per_model[m]; }
  void LoadEnded(double ms, bool prewarm);

  // The RunResult: these books, with the cache's counters.
  RunResult Finish(const CacheStats& cache, const TimeModel& time,
                   bool timed) &&;

 private:
  const TraceHeader& trace_;
  const double t_first_, t_last_;
  RunResult result_;
  // A request for `m` arrived (each of Hit, TooLarge and ColdStart).
  void Requested(uint32_t m);

  uint64_t requested_bytes_ = 0, missed_bytes_ = 0;
  std::vector<uint64_t> requests_, cold_starts_;  // per model
  WaitDistribution waits_;
  // Integrals over [t_first_, t_last_].
  double idle_byte_ms_ = 0, busy_ms_ = 0, queue_ms_ = 0;
  // Bins of trace time.
  size_t bin_ = 0;
  double bin_width_ = 0;
  double bin_min_ = std::numeric_limits<double>::infinity(), bin_max_ = 0,
         bin_area_ = 0;
  uint32_t bin_queue_max_ = 0;
};

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_BOOKS_H_
