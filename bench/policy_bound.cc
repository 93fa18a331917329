// How close can an online policy come to Belady's bytes on the embedded
// default trace?
//
// The default trace draws every request independently from a popularity
// that drifts from a morning ranking to an afternoon one
// (DefaultTracePopularityOf). Under such a trace the best an online policy
// can know is each model's request rate at the moment it must choose. The
// "rate oracle" below keeps the models with the highest true rates, which
// no real policy knows: a resident model saves its size at every request,
// so the bytes saved per byte held are its rate. The "sized oracle" ranks
// by rate * size^0.25 instead (kNextUseSizeExponent), the same discount of
// small models that next-use applies, which loads fewer bytes in most rows.
// Belady's knows the actual future draws, so the gap between the oracles
// and it is what randomness alone costs a policy that ranks this way;
// next-use and GDSF are shown beside them.
//
// The oracles run in a small replay of their own (the core's policies never
// see the key they rank); the same loop run with Belady's rule must give the
// library's Belady bytes exactly, which checks that the two replays agree.
//
//   ./build/bin/modelcache_policy_bound [seed ...]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "modelcache/core/policy.h"
#include "modelcache/replay/replay.h"

namespace {

using modelcache::replay::DefaultTracePopularity;
using modelcache::replay::Trace;

enum class Rule { kRateOracle, kSizedRateOracle, kBelady };

// Bytes loaded by an untimed replay that, on a miss, evicts the resident
// model ranked lowest by `rule` (ties to the least recently used) until the
// new one fits. Models larger than the capacity are refused, as in Replay.
uint64_t BytesLoaded(const Trace& trace, const DefaultTracePopularity& pop,
                     uint64_t capacity, Rule rule) {
  const size_t n = trace.requests.size();
  const size_t models = trace.models.size();
  std::vector<double> next_use(n, std::numeric_limits<double>::infinity());
  if (rule == Rule::kBelady) {
    std::vector<double> seen(models, std::numeric_limits<double>::infinity());
    for (size_t i = n; i-- > 0;) {
      next_use[i] = seen[trace.requests[i].model];
      seen[trace.requests[i].model] = static_cast<double>(i);
    }
  }
  std::vector<bool> resident(models, false);
  std::vector<double> belady_rank(models, 0);
  std::vector<uint64_t> last_use(models, 0);
  uint64_t used = 0, loaded = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t m = trace.requests[i].model;
    const uint64_t size = trace.sizes[m];
    if (size > capacity) continue;
    if (!resident[m]) {
      const double share = static_cast<double>(trace.requests[i].t_ms) /
                           static_cast<double>(pop.span_ms);
      while (used + size > capacity) {
        size_t victim = models;
        double lowest = 0;
        for (size_t j = 0; j < models; ++j) {
          if (!resident[j]) continue;
          double rank = rule == Rule::kBelady ? belady_rank[j]
                                              : (1 - share) * pop.morning[j] +
                                                    share * pop.afternoon[j];
          if (rule == Rule::kSizedRateOracle) {
            rank *= std::pow(static_cast<double>(trace.sizes[j]) / 0x1p30,
                             modelcache::kNextUseSizeExponent);
          }
          if (victim == models || rank < lowest ||
              (rank == lowest && last_use[j] < last_use[victim])) {
            victim = j;
            lowest = rank;
          }
        }
        resident[victim] = false;
        used -= trace.sizes[victim];
      }
      resident[m] = true;
      used += size;
      loaded += size;
    }
    last_use[m] = i + 1;
    belady_rank[m] = -next_use[i];
  }
  return loaded;
}

double Tib(uint64_t bytes) { return static_cast<double>(bytes) / 0x1p40; }

}  // namespace

int main(int argc, char** argv) {
  namespace replay = modelcache::replay;
  std::vector<uint64_t> seeds;
  for (int i = 1; i < argc; ++i)
    seeds.push_back(std::strtoull(argv[i], nullptr, 10));
  if (seeds.empty()) seeds = {42, 1, 2};
  const std::vector<std::string> policies = {"gdsf", "next-use", "belady"};
  std::printf(
      "Bytes loaded again on the embedded default, as a ratio to Belady's\n"
      "(untimed replay; the oracles know each model's true request "
      "rate)\n\n");
  std::printf("%6s %9s %12s %12s %13s %9s %9s\n", "seed", "capacity", "belady",
              "rate-oracle", "sized-oracle", "next-use", "gdsf");
  for (uint64_t seed : seeds) {
    const Trace trace = replay::GenerateDefaultTrace(seed);
    const DefaultTracePopularity pop = replay::DefaultTracePopularityOf(seed);
    std::vector<uint64_t> capacities;
    for (const char* c : {"32GiB", "48GiB", "64GiB"}) {
      capacities.push_back(replay::ParseBytes(c));
    }
    const auto results = replay::ReplayAll(trace, policies, capacities, 0, 2);
    const size_t k = capacities.size();
    for (size_t c = 0; c < k; ++c) {
      const uint64_t belady = results[2 * k + c].bytes_loaded;
      // The check: this loop with Belady's rule is the library's replay.
      if (BytesLoaded(trace, pop, capacities[c], Rule::kBelady) != belady) {
        std::fprintf(stderr,
                     "error: the bound's replay disagrees with the "
                     "library's Belady replay\n");
        return 1;
      }
      const double b = static_cast<double>(belady);
      const uint64_t oracle =
          BytesLoaded(trace, pop, capacities[c], Rule::kRateOracle);
      const uint64_t sized =
          BytesLoaded(trace, pop, capacities[c], Rule::kSizedRateOracle);
      std::printf("%6llu %9s %9.2f TiB %12.3f %13.3f %9.3f %9.3f\n",
                  static_cast<unsigned long long>(seed),
                  replay::FormatBytes(capacities[c]).c_str(), Tib(belady),
                  static_cast<double>(oracle) / b,
                  static_cast<double>(sized) / b,
                  static_cast<double>(results[k + c].bytes_loaded) / b,
                  static_cast<double>(results[c].bytes_loaded) / b);
    }
  }
  return 0;
}
