// Replay through the core cache without the time model, and the runs of
// every policy and capacity.
//
// Replay drives a ModelCache with one shard (an exact eviction order) from a
// single thread: each request acquires its model with a loader that only
// records that it ran, so a request is a hit exactly when the loader did not
// run. Held leases (--hold-ms) live in a min-heap by end time and are
// released before the first request at or after that time.
#include "modelcache/replay/replay.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <queue>

#include "modelcache/core/cache.h"
#include "modelcache/core/policy.h"
#include "parallel.h"
#include "replay_internal.h"

namespace modelcache::replay {

NextUseIndex::NextUseIndex(const TraceSource& source, const std::string& policy,
                           uint64_t max_bytes) {
  const TraceHeader& header = source.header();
  const uint64_t needed = BytesFor(header.requests);
  if (needed > max_bytes) {
    throw Error(ErrorCode::kInvalidArgument,
                "policy '" + policy + "' needs the future: an index of " +
                    FormatBytes(needed) + " (4 bytes for each of the " +
                    std::to_string(header.requests) +
                    " requests), more than the " + FormatBytes(max_bytes) +
                    " allowed (SimulateOptions::max_next_use_index_bytes, "
                    "--max-index-memory); allow more, or replay an online "
                    "policy");
  }
  gaps_.assign(header.requests, 0);
  constexpr uint64_t kNone = ~uint64_t{0};
  std::vector<uint64_t> last(header.models.size(), kNone);
  std::unique_ptr<RequestReader> reader = source.Read();
  std::vector<Request> chunk(kReadChunk);
  std::vector<float> hold(header.service_times ? kReadChunk : 0);
  uint64_t i = 0;
  for (size_t n;
       (n = reader->Read(chunk.data(), hold.data(), kReadChunk)) > 0;) {
    for (size_t k = 0; k < n; ++k, ++i) {
      uint64_t& previous = last[chunk[k].model];
      if (previous != kNone) {
        const uint64_t gap = i - previous;
        if (gap < kFar) {
          gaps_[previous] = static_cast<uint32_t>(gap);
        } else {
          gaps_[previous] = kFar;
          far_.emplace(previous, i);
        }
      }
      previous = i;
    }
  }
}

RunResult ReplayUntimedWith(const TraceSource& source,
                            std::shared_ptr<const EvictionPolicy> policy,
                            uint64_t capacity_bytes, double hold_ms,
                            const SimulateOptions& simulate) {
  const TraceHeader& header = source.header();
  const bool belady = !policy->monotone();
  const uint64_t n = header.requests;
  RunResult result;
  result.policy = policy->name();
  result.offline = belady;
  result.capacity_bytes = capacity_bytes;
  result.requests = n;
  result.loads_per_model.assign(header.models.size(), 0);

  std::optional<NextUseIndex> next_use;
  if (belady) {
    next_use.emplace(source, policy->name(), simulate.max_next_use_index_bytes);
  }

  CacheOptions options;
  options.name = "replay";
  options.capacity_bytes = capacity_bytes;
  options.policy = policy;
  options.shard_bits = 0;
  double now_ms = 0;
  options.now = [&now_ms] {
    return Clock::time_point(
        std::chrono::nanoseconds(static_cast<int64_t>(now_ms * 1e6)));
  };
  ModelCache cache(std::move(options));

  const auto token = std::make_shared<char>(0);
  bool loaded = false;
  uint32_t current = 0;
  const Loader loader = [&] {
    loaded = true;
    ++result.loads_per_model[current];
    return Loaded{token, header.sizes[current], {}};
  };

  using Held = std::pair<double, size_t>;
  std::priority_queue<Held, std::vector<Held>, std::greater<>> ends;
  LeasePool held;

  constexpr size_t kSamples = 240;
  const int64_t t0 = header.t_first_ms;
  const int64_t t1 = header.t_last_ms;
  size_t next_sample = 0;
  uint64_t requested_bytes = 0, missed_bytes = 0;

  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<RequestReader> reader = source.Read();
  std::vector<Request> chunk(kReadChunk);
  std::vector<float> hold(header.service_times ? kReadChunk : 0);
  uint64_t i = 0;
  for (size_t got;
       (got = reader->Read(chunk.data(), hold.data(), kReadChunk)) > 0;) {
    for (size_t k = 0; k < got; ++k, ++i) {
      const Request& request = chunk[k];
      while (!ends.empty() &&
             ends.top().first <= static_cast<double>(request.t_ms)) {
        now_ms = ends.top().first;
        held.Release(ends.top().second);
        ends.pop();
      }
      now_ms = static_cast<double>(request.t_ms);
      const uint64_t size = header.sizes[request.model];
      requested_bytes += size;
      AcquireOptions acquire;
      if (belady) acquire.policy_hint = next_use->At(i);
      loaded = false;
      current = request.model;
      try {
        Lease lease =
            cache.Acquire(header.models[request.model], size, loader, acquire);
        if (loaded) {
          ++result.misses;
          missed_bytes += size;
        } else {
          ++result.hits;
        }
        if (hold_ms > 0) {
          ends.emplace(static_cast<double>(request.t_ms) + hold_ms,
                       held.Hold(std::move(lease)));
        }
      } catch (const Error& e) {
        ++result.misses;
        missed_bytes += size;
        if (e.code() == ErrorCode::kTooLarge) {
          ++result.too_large;
        } else {
          ++result.blocked;
        }
      }
      while (
          next_sample < kSamples &&
          (t1 == t0 ||
           request.t_ms >= t0 + (t1 - t0) * static_cast<int64_t>(next_sample) /
                                    static_cast<int64_t>(kSamples - 1))) {
        result.resident_over_time.emplace_back(request.t_ms,
                                               cache.budget().used());
        ++next_sample;
        if (t1 == t0) break;
      }
    }
    if (simulate.requests_done) {
      simulate.requests_done->fetch_add(got, std::memory_order_relaxed);
    }
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  held.Clear();

  const CacheStats stats = cache.Stats();
  result.bytes_loaded = stats.bytes_loaded;
  result.evictions = stats.evictions;
  result.peak_resident_bytes = stats.high_water_bytes;
  result.hit_ratio =
      n ? static_cast<double>(result.hits) / static_cast<double>(n) : 0;
  result.byte_miss_ratio = requested_bytes
                               ? static_cast<double>(missed_bytes) /
                                     static_cast<double>(requested_bytes)
                               : 0;
  result.requests_per_second =
      result.seconds > 0 ? static_cast<double>(n) / result.seconds : 0;
  return result;
}

std::vector<RunResult> ReplayAll(
    const Trace& trace, const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, const ReplayOptions& options,
    unsigned threads, const std::function<void(size_t, size_t)>& progress) {
  return ReplayAll(*SourceOf(trace), policies, capacities, options, threads,
                   progress);
}

std::vector<RunResult> ReplayAll(
    const TraceSource& trace, const std::vector<std::string>& policies,
    const std::vector<uint64_t>& capacities, const ReplayOptions& options,
    unsigned threads, const std::function<void(size_t, size_t)>& progress) {
  for (const std::string& p : policies) {
    PolicyByName(p);  // throws the clear error
  }
  auto run = [&](const std::string& policy, uint64_t capacity) {
    return options.timed ? Simulate(trace, policy, capacity, options)
                         : ReplayUntimed(trace, policy, capacity, options);
  };
  const size_t total = policies.size() * capacities.size();
  std::vector<RunResult> results(total);
  RunParallel(
      total, threads,
      [&](size_t task) {
        results[task] = run(policies[task / capacities.size()],
                            capacities[task % capacities.size()]);
      },
      progress ? [&](size_t done) { progress(done, total); }
               : std::function<void(size_t)>());
  return results;
}

}  // namespace modelcache::replay
