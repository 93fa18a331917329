#include "keep_alive_driver.h"

#include <chrono>
#include <cmath>
#include <utility>

#include "cache_internal.h"

namespace modelcache::detail {
namespace {

// The thread runs only on the default clock, the steady clock read coarsely
// (CacheOptions::now): it reads the steady clock precisely, so an action
// is never found not yet due after the wait for it ended.
double SteadyNowMs() {
  return std::chrono::duration<double, std::milli>(
             Clock::now().time_since_epoch())
      .count();
}

// Bounds the per-key states: past it, the half whose last request is oldest
// is forgotten (a forgotten key starts again with no idle history).
constexpr size_t kMaxKeys = 65536;

}  // namespace

KeepAliveDriver::KeepAliveDriver(CacheCore* core,
                                 std::shared_ptr<const KeepAlivePolicy> policy,
                                 int max_prewarms, bool own_thread)
    : core_(core),
      policy_(std::move(policy)),
      max_prewarms_(std::max(0, max_prewarms)) {
  if (own_thread) thread_ = std::thread([this] { ThreadMain(); });
}

KeepAliveDriver::~KeepAliveDriver() { Stop(); }

void KeepAliveDriver::Stop() {
  {
    base::MutexLock lock(&mu_);
    stop_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

KeepAliveDriver::KeyState& KeepAliveDriver::StateLocked(std::string_view key,
                                                        double now_ms) {
  auto it = keys_.find(key);
  if (it != keys_.end()) return it->second;
  if (keys_.size() >= kMaxKeys) {
    std::vector<double> lasts;
    lasts.reserve(keys_.size());
    for (const auto& [name, state] : keys_) {
      lasts.push_back(state.last_request_ms);
    }
    auto median = lasts.begin() + static_cast<ptrdiff_t>(lasts.size() / 2);
    std::nth_element(lasts.begin(), median, lasts.end());
    const double cutoff = *median;
    absl::erase_if(keys_, [&](const auto& entry) {
      return entry.second.last_request_ms <= cutoff;
    });
  }
  KeyState& state = keys_[std::string(key)];
  state.last_request_ms = now_ms;
  return state;
}

void KeepAliveDriver::QueueLocked(double at_ms, ActionKind kind,
                                  std::string_view key, uint64_t generation) {
  actions_.push(Action{at_ms, seq_++, kind, std::string(key), generation});
}

bool KeepAliveDriver::CurrentLocked(const Action& action) {
  auto it = keys_.find(action.key);
  return it != keys_.end() && it->second.generation == action.generation;
}

void KeepAliveDriver::OnRequest(std::string_view key, bool request_in_progress,
                                double now_ms) {
  base::MutexLock lock(&mu_);
  KeyState& state = StateLocked(key, now_ms);
  ++state.generation;  // every action planned before is void
  state.last_request_ms = now_ms;
  if (!request_in_progress && std::isfinite(state.last_end_ms)) {
    state.idle.Record(std::max(0.0, now_ms - state.last_end_ms));
  }
}

void KeepAliveDriver::OnIdle(std::string_view key, double now_ms) {
  bool wake = false;
  {
    base::MutexLock lock(&mu_);
    KeyState& state = StateLocked(key, now_ms);
    state.last_end_ms = now_ms;
    const KeepAlivePlan plan = policy_->Plan(state.idle, now_ms, state.load_ms);
    const double next_before =
        actions_.empty() ? KeepAlivePlan::kNever : actions_.top().at_ms;
    if (plan.unload_now) {
      QueueLocked(now_ms, ActionKind::kUnload, key, state.generation);
    }
    if (std::isfinite(plan.prewarm_at)) {
      QueueLocked(plan.prewarm_at, ActionKind::kPrewarm, key, state.generation);
    }
    if (std::isfinite(plan.keep_until)) {
      QueueLocked(plan.keep_until, ActionKind::kUnload, key, state.generation);
    }
    wake = !actions_.empty() && actions_.top().at_ms < next_before;
  }
  // The thread sleeps until its earliest action: tell it of an earlier one.
  if (wake) wake_.NotifyAll();
}

void KeepAliveDriver::OnLoaded(std::string_view key, double load_ms) {
  base::MutexLock lock(&mu_);
  auto it = keys_.find(key);
  if (it != keys_.end()) it->second.load_ms = load_ms;
}

void KeepAliveDriver::OnNoDemandLoads() {
  bool wake;
  {
    base::MutexLock lock(&mu_);
    wake = !deferred_.empty();
  }
  if (wake) wake_.NotifyAll();
}

size_t KeepAliveDriver::RunDue(double now_ms) {
  std::vector<Action> due;
  {
    base::MutexLock lock(&mu_);
    // Deferred prewarms first: they came due earlier.
    for (Action& action : deferred_) due.push_back(std::move(action));
    deferred_.clear();
    while (!actions_.empty() && actions_.top().at_ms <= now_ms) {
      due.push_back(actions_.top());
      actions_.pop();
    }
  }
  size_t done = 0;
  for (const Action& action : due) {
    if (Run(action)) ++done;
  }
  return done;
}

bool KeepAliveDriver::Run(const Action& action) {
  {
    base::MutexLock lock(&mu_);
    if (stop_ || !CurrentLocked(action)) return false;  // a request came since
    if (action.kind == ActionKind::kPrewarm) {
      if (core_->DemandLoadsInFlight() > 0 ||
          prewarms_in_flight_ >= max_prewarms_) {
        deferred_.push_back(action);
        return false;
      }
      ++prewarms_in_flight_;
    }
  }
  if (action.kind == ActionKind::kUnload) {
    return core_->KeepAliveUnload(action.key);
  }
  const bool loaded = core_->KeepAlivePrewarm(
      action.key, policy_->prewarm_evicts_lower_ranked());
  {
    base::MutexLock lock(&mu_);
    --prewarms_in_flight_;
  }
  return loaded;
}

void KeepAliveDriver::ThreadMain() {
  for (;;) {
    {
      base::MutexLock lock(&mu_);
      for (;;) {
        if (stop_) return;
        const bool deferred_may_start =
            !deferred_.empty() && core_->DemandLoadsInFlight() == 0;
        if (deferred_may_start) break;
        if (!actions_.empty() && actions_.top().at_ms <= SteadyNowMs()) break;
        if (actions_.empty()) {
          wake_.Wait(&mu_);
        } else {
          const auto at = Clock::time_point(std::chrono::nanoseconds(
              static_cast<int64_t>(std::ceil(actions_.top().at_ms * 1e6))));
          wake_.WaitUntil(&mu_, at);
        }
      }
    }
    RunDue(SteadyNowMs());
  }
}

}  // namespace modelcache::detail
