// The books of a replay in trace time: what the engine counts and
// integrates, and their reduction to a RunResult. Knows nothing of events,
// loads or caches: the engine reports each request's outcome and, between
// events, the piecewise-constant state of the node (idle bytes, loads in
// flight, the queue, resident bytes), which the books integrate over the
// trace's span, [first request, last request].
#ifndef MODELCACHE_SRC_REPLAY_BOOKS_H_
#define MODELCACHE_SRC_REPLAY_BOOKS_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {

class Books {
 public:
  // The node's state between two events.
  struct State {
    uint64_t idle_bytes = 0;  // resident, no lease, not loading
    bool loading = false;     // at least one load in flight
    uint32_t queued = 0;      // demand loads waiting for a slot or room
    uint64_t resident_bytes = 0;
  };

  // `span_ms`: [t_first, t_last]; 240 bins of it are kept.
  Books(const Trace& trace, double t_first, double t_last);

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
  void Waited(double ms) { waits_.push_back(ms); }
  void Rejected() { ++result_.rejected; }
  // A load of `m` started; one ended after `ms` (ahead of demand, if
  // `prewarm`).
  void LoadStarted(uint32_t m) { ++result_.loads_per_model[m]; }
  void LoadEnded(double ms, bool prewarm);

  // The RunResult: these books, with the cache's counters.
  RunResult Finish(const CacheStats& cache, const TimeModel& time,
                   bool timed) &&;

 private:
  const Trace& trace_;
  const double t_first_, t_last_;
  RunResult result_;
  // A request for `m` arrived (each of Hit, TooLarge and ColdStart).
  void Requested(uint32_t m);

  uint64_t requested_bytes_ = 0, missed_bytes_ = 0;
  std::vector<uint64_t> requests_, cold_starts_;  // per model
  std::vector<double> waits_;
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
