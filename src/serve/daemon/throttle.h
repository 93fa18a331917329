// The daemon's load throttle (DaemonOptions::throttle_load_*): a testing and
// sizing knob that makes each load take the time `modelcache replay`'s time
// model gives it, so that a live daemon's load times can be predicted.
//
// Design note. Replay's disk gives each load a fixed latency once it starts,
// then moves its bytes at an equal share of the bandwidth among the loads
// moving bytes at that moment (processor sharing: with n transfers each
// moves at bandwidth / n; one that ends speeds up the others). That fluid
// model is core's LoadLink (modelcache/core/load_link.h), the one the replay
// runs; LoadThrottle runs it on the steady clock, in seconds: a load's
// transfer joins the link at max(its start + latency, the end of its real
// read), and the load is held until the link has moved all of its bytes. A
// transfer is marked done only once the clock has passed the time the model
// gives it, so a load never ends earlier than the model says.
//
// States of a transfer: waiting out its latency (not on the link) ->
// moving (on the link, sharing) -> done (off the link). Every waiter
// sleeps until the next end the link foresees; an end wakes all (the
// others speed up), an arrival wakes none (the others only slow down, so
// they wake early, look again and sleep on).
#ifndef MODELCACHE_SRC_SERVE_DAEMON_THROTTLE_H_
#define MODELCACHE_SRC_SERVE_DAEMON_THROTTLE_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "modelcache/base/mutex.h"
#include "modelcache/core/load_link.h"

namespace modelcache::serve::detail {

class LoadThrottle {
 public:
  using Clock = std::chrono::steady_clock;

  // REQUIRES: bytes_per_second > 0 (+inf: latency only); latency >= 0.
  LoadThrottle(double bytes_per_second, Clock::duration latency);

  // Holds a load that started at `start` and whose real read is done (now)
  // until the model's end for its `bytes`: the bytes join the shared link at
  // max(start + latency, now). Returns how long it held the load. Throws
  // Error kUnavailable when Stop() is called meanwhile.
  Clock::duration Hold(Clock::time_point start, uint64_t bytes)
      MC_EXCLUDES(mu_);
  // Ends every hold, now and from now on. Thread-safe.
  void Stop() MC_EXCLUDES(mu_);

  double bytes_per_second() const { return bytes_per_second_; }
  Clock::duration latency() const { return latency_; }
  // Every hold's time, summed.
  double held_seconds() const { return held_seconds_.load(); }

 private:
  double Seconds(Clock::time_point t) const;

  const double bytes_per_second_;
  const Clock::duration latency_;
  const Clock::time_point origin_ = Clock::now();
  base::Mutex mu_;
  base::CondVar cv_;
  LoadLink link_ MC_GUARDED_BY(mu_);
  uint64_t next_id_ MC_GUARDED_BY(mu_) = 1;
  bool stopped_ MC_GUARDED_BY(mu_) = false;
  std::atomic<double> held_seconds_{0};
};

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_THROTTLE_H_
