#include "throttle.h"

#include <algorithm>

#include "modelcache/base/errors.h"

namespace modelcache::serve::detail {

LoadThrottle::LoadThrottle(double bytes_per_second, Clock::duration latency)
    : bytes_per_second_(bytes_per_second),
      latency_(latency),
      link_(bytes_per_second) {}

double LoadThrottle::Seconds(Clock::time_point t) const {
  return std::chrono::duration<double>(t - origin_).count();
}

LoadThrottle::Clock::duration LoadThrottle::Hold(Clock::time_point start,
                                                 uint64_t bytes) {
  const Clock::time_point begin = Clock::now();
  const auto held = [&] {
    const Clock::duration d = Clock::now() - begin;
    double seen = held_seconds_.load();
    while (!held_seconds_.compare_exchange_weak(
        seen, seen + std::chrono::duration<double>(d).count())) {
    }
    return d;
  };
  const auto stopped = [&] {
    held();
    return Error(ErrorCode::kUnavailable, "the daemon is shutting down");
  };
  base::MutexLock lock(&mu_);
  // Its latency first, off the disk.
  const Clock::time_point moving_from = std::max(start + latency_, begin);
  while (!stopped_ && Clock::now() < moving_from) {
    cv_.WaitUntil(&mu_, moving_from);
  }
  if (stopped_) throw stopped();
  const uint64_t id = next_id_++;
  if (link_.Advance(Seconds(Clock::now())) > 0) cv_.NotifyAll();
  link_.Add(id, bytes);
  for (;;) {
    if (stopped_) {
      link_.Remove(id);
      throw stopped();
    }
    if (link_.Advance(Seconds(Clock::now())) > 0) cv_.NotifyAll();
    if (link_.Done(id)) break;
    const auto next =
        origin_ + std::chrono::ceil<Clock::duration>(
                      std::chrono::duration<double>(link_.RunOut()));
    cv_.WaitUntil(&mu_, next);
  }
  return held();
}

void LoadThrottle::Stop() {
  base::MutexLock lock(&mu_);
  stopped_ = true;
  cv_.NotifyAll();
}

}  // namespace modelcache::serve::detail
