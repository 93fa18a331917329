// The two replays, by name: the untimed replay (replay.cc's loop, or the
// engine with an infinitely fast load path for a policy that keeps models
// alive by time) and the replay in trace time (engine.h), and ReplayAll,
// which runs one of them for every (policy, capacity) pair.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "engine.h"
#include "modelcache/core/policy.h"
#include "modelcache/replay/replay.h"
#include "replay_internal.h"

namespace modelcache::replay {
namespace {

NamedPolicy ParsePolicy(const std::string& name, const TimeModel& time) {
  return PolicyByName(name, LoadCostModel{time.latency_ms / 1000,
                                          time.bandwidth_bytes_per_second});
}

RunResult RunEngine(const TraceSource& trace, const std::string& policy_name,
                    const NamedPolicy& policy, uint64_t capacity_bytes,
                    const SimulateOptions& options, bool timed) {
  const auto start = std::chrono::steady_clock::now();
  RunResult result =
      Engine(trace, policy, capacity_bytes, options, timed).Run();
  result.policy = policy_name;
  result.offline = policy.offline;
  result.capacity_bytes = capacity_bytes;
  if (timed) result.drain_after_ms = options.drain_after_ms;
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const double n = static_cast<double>(result.requests);
  result.requests_per_second = result.seconds > 0 ? n / result.seconds : 0;
  return result;
}

}  // namespace

namespace {

// A duration in ms as the core's clock counts it (whole nanoseconds); one
// beyond its range is kDrainNever.
std::chrono::nanoseconds CoreNanoseconds(double ms) {
  const double ns = ms * 1e6;
  if (!(ns < static_cast<double>(kDrainNever.count()))) return kDrainNever;
  return std::chrono::nanoseconds(static_cast<int64_t>(std::max(0.0, ns)));
}

double Milliseconds(std::chrono::nanoseconds d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

}  // namespace

double DefaultDrainAfterMs(double load_ms, double recent_drain_ms) {
  // The core's rule on the core's clock; a time beyond its range drains
  // never, as the core's would.
  const std::chrono::nanoseconds load = CoreNanoseconds(load_ms);
  const std::chrono::nanoseconds recent = CoreNanoseconds(recent_drain_ms);
  if (load == kDrainNever || recent == kDrainNever) return kNeverDrain;
  const std::chrono::nanoseconds after = DefaultDrainAfter(load, recent);
  if (after == kDrainNever) return kNeverDrain;
  return Milliseconds(after);
}

double NextRecentDrainMs(double recent_drain_ms, double drain_ms) {
  return Milliseconds(NextRecentDrains(CoreNanoseconds(recent_drain_ms),
                                       CoreNanoseconds(drain_ms)));
}

RunResult ReplayUntimed(const Trace& trace, const std::string& policy_name,
                        uint64_t capacity_bytes,
                        const SimulateOptions& options) {
  return ReplayUntimed(*SourceOf(trace), policy_name, capacity_bytes, options);
}

RunResult Simulate(const Trace& trace, const std::string& policy_name,
                   uint64_t capacity_bytes, const SimulateOptions& options) {
  return Simulate(*SourceOf(trace), policy_name, capacity_bytes, options);
}

RunResult ReplayUntimed(const TraceSource& trace,
                        const std::string& policy_name, uint64_t capacity_bytes,
                        const SimulateOptions& options) {
  const NamedPolicy policy = ParsePolicy(policy_name, options.time);
  const bool plain = policy.idle_ttl.count() == 0 && !policy.keep_alive;
  if (plain && options.prewarms.empty() && !trace.header().service_times) {
    return ReplayUntimedWith(trace, policy.eviction, capacity_bytes,
                             options.hold_ms, options);
  }
  // Time matters to its keep-alive, or to its service times: the engine,
  // with loads that take no time (which gives the untimed counts for every
  // other policy).
  return RunEngine(trace, policy_name, policy, capacity_bytes, options,
                   /*timed=*/false);
}

RunResult Simulate(const TraceSource& trace, const std::string& policy_name,
                   uint64_t capacity_bytes, const SimulateOptions& options) {
  const NamedPolicy policy = ParsePolicy(policy_name, options.time);
  return RunEngine(trace, policy_name, policy, capacity_bytes, options,
                   /*timed=*/true);
}

}  // namespace modelcache::replay
