// Replay throughput: requests per second through the real cache, one policy
// and one capacity per run, on the shared Azure Functions trace (339,657
// requests) and on the embedded default trace. The target is at least two
// million requests per second for LRU with no held leases.
#include <benchmark/benchmark.h>

#include <string>

#include "modelcache/tools/replay.h"

namespace {

namespace replay = modelcache::replay;

const replay::Trace& AzureTrace() {
  static const replay::Trace* const trace =
      new replay::Trace(replay::ReadAzureFunctionsTrace(
          std::string(MODELCACHE_SHARED_DATA) +
              "/traces/azure-functions-2019-100fn.csv",
          0, nullptr, 42));
  return *trace;
}

const replay::Trace& DefaultTrace() {
  static const replay::Trace* const trace =
      new replay::Trace(replay::GenerateDefaultTrace(42));
  return *trace;
}

void RunReplay(benchmark::State& state, const replay::Trace& trace,
               const char* policy) {
  const uint64_t capacity = static_cast<uint64_t>(state.range(0)) << 30;
  uint64_t requests = 0;
  double hit_ratio = 0;
  for (auto _ : state) {
    replay::RunResult result = replay::Replay(trace, policy, capacity);
    requests += result.requests;
    hit_ratio = result.hit_ratio;
    benchmark::DoNotOptimize(result.bytes_loaded);
  }
  state.SetItemsProcessed(static_cast<int64_t>(requests));
  state.counters["hit_ratio"] = hit_ratio;
}

void BM_Replay_azure_lru(benchmark::State& state) {
  RunReplay(state, AzureTrace(), "lru");
}
void BM_Replay_azure_gdsf(benchmark::State& state) {
  RunReplay(state, AzureTrace(), "gdsf");
}
void BM_Replay_default_lru(benchmark::State& state) {
  RunReplay(state, DefaultTrace(), "lru");
}
void BM_Replay_default_gdsf(benchmark::State& state) {
  RunReplay(state, DefaultTrace(), "gdsf");
}

// Capacities in GiB.
BENCHMARK(BM_Replay_azure_lru)
    ->Arg(8)
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Replay_azure_gdsf)
    ->Arg(8)
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Replay_default_lru)
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Replay_default_gdsf)
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
