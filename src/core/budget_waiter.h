// Budget::Waiter: one reservation waiting for room, as the drain scheduler
// (budget_drain.cc) and Budget::Reserve (budget.cc) share it. Not part of the
// public API.
#ifndef MODELCACHE_SRC_CORE_BUDGET_WAITER_H_
#define MODELCACHE_SRC_CORE_BUDGET_WAITER_H_

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "modelcache/core/budget.h"

namespace modelcache {

// Lives on the stack of its Reserve call. Filed in Budget::queue_ (under the
// budget's mutex) from its first look for room that falls short until it
// leaves; only its own thread touches the fields not marked otherwise.
struct Budget::Waiter {
  std::chrono::steady_clock::time_point arrival;
  uint64_t ticket = 0;  // breaks ties of arrival: first filed, first served
  uint64_t bytes = 0;
  bool waits = false;       // WhenFull::kWait: filed in the queue
  bool registered = false;  // counted in waiters_
  uint64_t evicted = 0;     // victims this call evicted
  const std::vector<uint64_t>* holds = nullptr;
  std::chrono::nanoseconds expected_load{0};  // ReserveOptions::expected_load
  std::string for_what;
  // No drain can serve it (what it needs is pinned or its own), as of
  // change_count_ == refused_at: older than it, it does not hold back the
  // drains of younger waiters until the budget changes. Under mu_.
  // A refusal that passed over victims whose unloader threw (failed, below)
  // holds only until the next change of any kind, when they may go again.
  bool refused = false;
  bool refused_over_failed = false;
  uint64_t refused_at = 0;      // change_count_ - quiet_changes_
  uint64_t refused_at_raw = 0;  // change_count_
  // Its drain was counted in drains_: from when its set first covered it
  // until the drain ends.
  bool drain_counted = false;
  // Its drain set while it drains: each record with the member holding it.
  std::vector<
      std::pair<std::shared_ptr<detail::BudgetMember>, detail::VictimCandidate>>
      set;
  // Victims of its drain whose unloader threw: left out until the budget
  // changes (after change_count_ == failed_at).
  std::unordered_set<uint64_t> failed;
  uint64_t failed_at = 0;
};

// a + b, or the largest uint64_t where that overflows.
inline uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return b > std::numeric_limits<uint64_t>::max() - a
             ? std::numeric_limits<uint64_t>::max()
             : a + b;
}

}  // namespace modelcache

#endif  // MODELCACHE_SRC_CORE_BUDGET_WAITER_H_
