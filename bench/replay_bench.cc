// Replay throughput: requests per second through the real cache, one policy
// and one capacity per run, with the time model (the default: 2 GB/s, 100 ms,
// 4 slots) and without it (--no-time), side by side, on the shared Azure
// Functions trace (339,657 requests) and on the embedded default trace. The
// target is at least 1 M requests/s for every row with the time model.
// Cluster/...: the replay of 4 nodes of 16 GiB behind a route (cluster.h),
// beside the one node of 64 GiB of the same policy.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "modelcache/replay/cluster.h"
#include "modelcache/replay/replay.h"

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
               const std::string& policy, uint64_t capacity_gib, bool timed) {
  uint64_t requests = 0;
  double hit_ratio = 0, p99 = 0;
  for (auto _ : state) {
    replay::RunResult result =
        timed ? replay::Simulate(trace, policy, capacity_gib << 30)
              : replay::ReplayUntimed(trace, policy, capacity_gib << 30);
    requests += result.requests;
    hit_ratio = result.hit_ratio;
    p99 = result.wait_ms.p99;
    benchmark::DoNotOptimize(result.bytes_loaded);
  }
  state.SetItemsProcessed(static_cast<int64_t>(requests));
  state.counters["hit_ratio"] = hit_ratio;
  if (timed) state.counters["p99_ms"] = p99;
}

void Register(const char* trace_name, const replay::Trace& (*trace)(),
              const std::vector<uint64_t>& capacities) {
  for (const char* policy :
       {"lru", "gdsf", "faascache", "ttl-10m", "hybrid-histogram",
        "gdsf-prewarm", "next-use", "next-use-prewarm"}) {
    for (uint64_t gib : capacities) {
      // The two rows of one policy and capacity next to each other.
      for (bool timed : {true, false}) {
        const std::string name = std::string("Replay/") + trace_name + "/" +
                                 policy + "/" + std::to_string(gib) + "GiB/" +
                                 (timed ? "time" : "no-time");
        benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State&
                                                           state) {
          RunReplay(state, trace(), policy, gib, timed);
        })->Unit(benchmark::kMillisecond);
      }
    }
  }
}

void RunCluster(benchmark::State& state, const replay::Trace& trace,
                const std::string& route) {
  replay::ClusterOptions options;
  options.nodes = replay::NumberedNodes(4);
  options.route = replay::ParseRoute(route);
  uint64_t requests = 0;
  double p99 = 0, loads = 0;
  for (auto _ : state) {
    replay::ClusterResult result =
        replay::SimulateCluster(trace, "next-use", uint64_t{16} << 30, options);
    requests += result.total.requests;
    p99 = result.total.wait_ms.p99;
    loads = static_cast<double>(result.loads);
    benchmark::DoNotOptimize(result.total.bytes_loaded);
  }
  state.SetItemsProcessed(static_cast<int64_t>(requests));
  state.counters["p99_ms"] = p99;
  state.counters["loads"] = loads;
}

void RegisterCluster(const char* trace_name, const replay::Trace& (*trace)()) {
  for (const char* route :
       {"roundrobin", "leastconn", "chash", "chash-bl:150"}) {
    const std::string name =
        std::string("Cluster/") + trace_name + "/next-use/4x16GiB/" + route;
    benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& state) {
      RunCluster(state, trace(), route);
    })->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Register("azure", AzureTrace, {8, 16, 32, 64});
  Register("default", DefaultTrace, {16, 32, 64});
  RegisterCluster("azure", AzureTrace);
  RegisterCluster("default", DefaultTrace);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
