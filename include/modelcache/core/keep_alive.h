// Keep-alive and prewarm planning: when to unload a model that went idle,
// and when to load it again ahead of its next request.
//
// A KeepAlivePolicy is pure: it keeps no clock, no state of its own and
// touches no cache. Its caller keeps an IdleHistory per model, records in it
// each idle time (from the end of one request to the arrival of the next,
// when no other request was in progress), and asks the policy for a plan
// each time the model's last request ends. Two callers run this same code:
// the replay's simulation, in trace time, and a ModelCache, on its clock
// (CacheOptions::keep_alive), which carries the plans out.
//
// Times are milliseconds on the caller's clock.
#ifndef MODELCACHE_CORE_KEEP_ALIVE_H_
#define MODELCACHE_CORE_KEEP_ALIVE_H_

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace modelcache {

// One model's idle times, as Shahrad et al.'s hybrid histogram keeps them
// ("Serverless in the Wild", ATC 2020): one-minute bins over four hours, a
// count of the idle times beyond, and the most recent few for the
// time-series fallback.
class IdleHistory {
 public:
  static constexpr int kBins = 240;         // one-minute bins
  static constexpr double kBinMs = 60'000;  // a minute
  static constexpr size_t kRecent = 8;      // for the moving average

  // An idle time of `idle_ms` (>= 0) ended with a request.
  void Record(double idle_ms);

  uint32_t samples() const { return samples_; }
  // Idle times of four hours or more.
  uint32_t out_of_range() const { return out_of_range_; }
  // The count in bin `b` (0 <= b < kBins).
  uint32_t bin(int b) const { return bins_.empty() ? 0 : bins_[b]; }
  // The sum of the squares of the bin counts (for their coefficient of
  // variation in O(1)).
  double sum_squares() const { return sum_squares_; }
  // The last kRecent idle times, oldest first.
  const std::deque<double>& recent() const { return recent_; }

 private:
  std::vector<uint32_t> bins_;  // allocated on the first in-range sample
  uint32_t samples_ = 0, out_of_range_ = 0;
  double sum_squares_ = 0;
  std::deque<double> recent_;
};

// What to do with a model whose last request just ended.
struct KeepAlivePlan {
  static constexpr double kNever = std::numeric_limits<double>::infinity();
  // Unload it now: it is not expected before `prewarm_at`.
  bool unload_now = false;
  // When to load it again ahead of its next request; kNever: not at all.
  // Set only with unload_now.
  double prewarm_at = kNever;
  // When to unload it if it is still idle then; kNever: never (the eviction
  // policy alone decides).
  double keep_until = kNever;

  bool operator==(const KeepAlivePlan&) const = default;
};

class KeepAlivePolicy {
 public:
  virtual ~KeepAlivePolicy() = default;
  virtual std::string name() const = 0;
  // The plan for a model whose last request ended at `now_ms`, given its
  // idle history and how long a load of it is expected to take now
  // (`load_ms`: latency, transfer, and the loads queued ahead of it).
  virtual KeepAlivePlan Plan(const IdleHistory& history, double now_ms,
                             double load_ms) const = 0;
  // Whether a prewarm may make room by evicting idle models the eviction
  // policy ranks below the model it loads (AcquireOptions::
  // evict_only_lower_ranked). Otherwise a prewarm uses free memory only.
  virtual bool prewarm_evicts_lower_ranked() const { return false; }
};

struct HybridHistogramOptions {
  // Start each prewarm the expected load time earlier than the window's
  // start, so that a large model is ready in time (ours; the paper prewarms
  // at the window's start).
  bool lead_by_load_time = false;
  // See KeepAlivePolicy::prewarm_evicts_lower_ranked.
  bool prewarm_evicts_lower_ranked = false;
};

// Shahrad et al.'s hybrid histogram policy. With at least 5 idle times:
//  * when more than half fall beyond four hours, the next is predicted as
//    the mean of the last 8 (the paper uses ARIMA): unload now, prewarm at
//    85% of it, keep until 115%;
//  * else, when the bin counts' coefficient of variation is at least 2 (the
//    histogram is representative): unload now and prewarm at 90% of the 5th
//    percentile's bin start (less the load time, with lead_by_load_time),
//    keep until 110% of the 99th percentile's bin end; a prewarm time of 0
//    keeps the model instead of unloading it.
// Otherwise keep it for four hours and do not prewarm.
std::shared_ptr<const KeepAlivePolicy> NewHybridHistogramKeepAlive(
    HybridHistogramOptions options = {});

}  // namespace modelcache

#endif  // MODELCACHE_CORE_KEEP_ALIVE_H_
