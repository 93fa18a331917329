// Eviction cost against the resident set: what a miss that must evict pays
// when 100, 1,000, 10,000 or 100,000 models are resident.
//
// A cache of LRU order holds exactly N models of one size. The timed loop
// acquires names from a cycle of 2N, so every acquire is a miss whose model
// was evicted N acquires ago, and every miss evicts exactly one model (the
// least recently used): the time per iteration is one miss, one load of a
// trivial loader, one eviction and one lease release. Before every eviction
// the budget checks that evicting can make room ("a refused request evicts
// nothing", budget.h); that check is what used to scan every resident
// record, so its cost grew with N. Flat per-iteration times across N are the
// goal.
//
// Counters: evictions_per_iteration (must be 1), resident (must be N).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/core/cache.h"

namespace {

constexpr uint64_t kModelBytes = 4096;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "eviction_bench: %s\n", what);
  std::abort();
}

modelcache::Loaded TrivialLoad() {
  modelcache::Loaded loaded;
  loaded.value = std::make_shared<int>(0);
  loaded.bytes = kModelBytes;
  return loaded;
}

void BM_MissThatEvicts(benchmark::State& state) {
  const int64_t resident = state.range(0);
  std::vector<std::string> names;
  names.reserve(static_cast<size_t>(2 * resident));
  for (int64_t i = 0; i < 2 * resident; ++i) {
    names.push_back("model-" + std::to_string(i));
  }
  modelcache::CacheOptions options;
  options.name = "eviction_bench";
  options.capacity_bytes = static_cast<uint64_t>(resident) * kModelBytes;
  modelcache::ModelCache cache(std::move(options));
  const modelcache::Loader loader = TrivialLoad;
  // Fill: names [N, 2N) resident, so the loop's first name (0) is a miss
  // that evicts name N, the least recently used.
  for (int64_t i = resident; i < 2 * resident; ++i) {
    cache.Prefetch(names[static_cast<size_t>(i)], kModelBytes, loader);
  }
  const modelcache::CacheStats before = cache.Stats();
  if (before.resident_entries != static_cast<uint64_t>(resident) ||
      before.evictions != 0) {
    Die("the fill did not leave exactly N models resident");
  }
  size_t next = 0;
  for (auto _ : state) {
    modelcache::Lease lease = cache.Acquire(names[next], kModelBytes, loader);
    benchmark::DoNotOptimize(lease.value());
    if (++next == names.size()) next = 0;
  }
  const modelcache::CacheStats after = cache.Stats();
  const auto iterations = static_cast<double>(state.iterations());
  state.counters["evictions_per_iteration"] =
      static_cast<double>(after.evictions - before.evictions) / iterations;
  state.counters["resident"] = static_cast<double>(after.resident_entries);
  if (after.evictions - before.evictions !=
      static_cast<uint64_t>(state.iterations())) {
    Die("an iteration did not evict exactly one model");
  }
}
BENCHMARK(BM_MissThatEvicts)->Arg(100)->Arg(1000)->Arg(10000)->Arg(100000);

}  // namespace

BENCHMARK_MAIN();
