// What next-use's request history costs per request: RequestHistory::Record
// is called on every request to a cache whose policy keeps histories (a hit
// included), under the shard's lock. 100 keys, each with a memory of 32
// gaps, requested in turn at exponential gaps of 10 s on average (so that a
// key's gaps fall into a realistic spread of bins).
//
//   ./build/bin/modelcache_request_history_bench
//       --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "modelcache/core/policy.h"

namespace {

void BM_RecordRequest(benchmark::State& state) {
  constexpr size_t kKeys = 100;
  constexpr size_t kGaps = 1 << 16;
  std::mt19937_64 rng(1);
  std::vector<double> gaps(kGaps);
  for (double& gap : gaps) {
    gap = -10 * std::log1p(-static_cast<double>(rng() >> 11) * 0x1p-53);
  }
  std::vector<modelcache::RequestHistory> histories(
      kKeys, modelcache::RequestHistory(modelcache::kNextUseHistoryLength));
  std::vector<double> now(kKeys, 0);
  size_t i = 0;
  for (auto _ : state) {
    const size_t key = i % kKeys;
    now[key] += gaps[i % kGaps];
    histories[key].Record(now[key]);
    ++i;
  }
  benchmark::DoNotOptimize(histories.data());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RecordRequest);

}  // namespace

BENCHMARK_MAIN();
