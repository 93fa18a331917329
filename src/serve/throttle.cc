#include "throttle.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "modelcache/base/errors.h"

namespace modelcache::serve::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Less than half a byte left is rounding: done (replay's rule).
constexpr double kDoneBytes = 0.5;

}  // namespace

SharedDisk::SharedDisk(double bytes_per_second)
    : bytes_per_second_(bytes_per_second) {}

int SharedDisk::Advance(double now) {
  int ended = 0;
  while (now > now_ && !remaining_.empty()) {
    double least = kInf;
    for (const auto& [id, left] : remaining_) least = std::min(least, left);
    const double rate =
        bytes_per_second_ / static_cast<double>(remaining_.size());
    const double until = now_ + least / rate;
    if (until > now) {
      // None ends within the step.
      for (auto& [id, left] : remaining_) left -= (now - now_) * rate;
      now_ = now;
      break;
    }
    // The shortest ends within the step: move to its end (those within
    // half a byte of it end with it, rounding) and go on at the share of
    // those left.
    now_ = until;
    for (auto it = remaining_.begin(); it != remaining_.end();) {
      it->second -= least;
      if (it->second <= kDoneBytes) {
        it = remaining_.erase(it);
        ++ended;
      } else {
        ++it;
      }
    }
  }
  now_ = std::max(now_, now);
  return ended;
}

void SharedDisk::Add(uint64_t id, uint64_t bytes) {
  if (!std::isfinite(bytes_per_second_)) return;
  const double b = static_cast<double>(bytes);
  if (b <= kDoneBytes) return;
  remaining_[id] = b;
}

double SharedDisk::NextDeparture() const {
  if (remaining_.empty()) return kInf;
  double least = kInf;
  for (const auto& [id, left] : remaining_) least = std::min(least, left);
  return now_ +
         least * static_cast<double>(remaining_.size()) / bytes_per_second_;
}

LoadThrottle::LoadThrottle(double bytes_per_second, Clock::duration latency)
    : bytes_per_second_(bytes_per_second),
      latency_(latency),
      disk_(bytes_per_second) {}

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
  if (disk_.Advance(Seconds(Clock::now())) > 0) cv_.NotifyAll();
  disk_.Add(id, bytes);
  for (;;) {
    if (stopped_) {
      disk_.Remove(id);
      throw stopped();
    }
    if (disk_.Advance(Seconds(Clock::now())) > 0) cv_.NotifyAll();
    if (disk_.Done(id)) break;
    const auto next =
        origin_ + std::chrono::ceil<Clock::duration>(
                      std::chrono::duration<double>(disk_.NextDeparture()));
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
