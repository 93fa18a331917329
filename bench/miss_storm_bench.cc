// Miss storm: 64 threads acquire the same cold key at once, as when a burst
// of requests reaches a server for a model it has not loaded yet.
//
// The cache must run exactly one load (a second load would double the memory
// and the load time) and hand its result to all 64 callers as soon as it
// completes: every caller should be served within the load time plus 1 ms.
// Each iteration builds a fresh ModelCache, parks 64 threads at a latch,
// releases them together and records when each one got its lease. The loader
// sleeps for a fixed time, standing in for reading weights from disk; it is
// the only sleep in the benchmark.
//
// Counters (averaged over iterations unless noted):
//   loads                      loader invocations per iteration; must be 1
//   load_ms                    time the loader took (from its own clock)
//   load_start_ms              release of the threads to the loader starting
//   max_served_after_start_ms  release of the threads to the last lease
//   overshoot_ms               max_served_after_start_ms - load_ms
//   worst_overshoot_ms         the largest overshoot of any iteration
//   late_iterations            iterations whose overshoot exceeded 1 ms
// The reported time per iteration is max_served_after_start_ms (manual time).
//
// BM_MissStorm_baseline runs the same storm through the least a single
// flight can do: a mutex-guarded flag picks the loader and everyone else
// blocks on one std::shared_future. Its overshoot is what waking 63 blocked
// threads costs on this machine; ModelCache's overshoot is to be read
// against it, in the same run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <future>
#include <latch>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "modelcache/core/cache.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kThreads = 64;
constexpr std::chrono::milliseconds kLoadTime{20};
constexpr uint64_t kModelBytes = uint64_t{1} << 30;
constexpr double kAllowedOvershootMs = 1.0;

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

struct IterationResult {
  int loads = 0;
  double load_ms = 0;
  double load_start_ms = 0;
  double max_served_ms = 0;
  std::string error;  // empty on success
};

// The system under test: a fresh ModelCache per storm.
class CacheStorm {
 public:
  using Handle = modelcache::Lease;
  CacheStorm() : cache_(Options()) {}
  Handle Acquire(const modelcache::Loader& loader) {
    return cache_.Acquire("cold-model", kModelBytes, loader);
  }
  static void* Value(const Handle& lease) { return lease.value(); }

 private:
  static modelcache::CacheOptions Options() {
    modelcache::CacheOptions options;
    options.name = "miss_storm_bench";
    options.capacity_bytes = 2 * kModelBytes;
    return options;
  }
  modelcache::ModelCache cache_;
};

// The baseline: the first caller loads, everyone waits on one future.
class SharedFutureStorm {
 public:
  using Handle = std::shared_ptr<void>;
  Handle Acquire(const modelcache::Loader& loader) {
    bool owner = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      owner = !started_;
      started_ = true;
    }
    if (owner) {
      try {
        promise_.set_value(loader().value);
      } catch (...) {
        promise_.set_exception(std::current_exception());
      }
    }
    return future_.get();
  }
  static void* Value(const Handle& value) { return value.get(); }

 private:
  std::mutex mu_;
  bool started_ = false;
  std::promise<std::shared_ptr<void>> promise_;
  std::shared_future<std::shared_ptr<void>> future_ = promise_.get_future();
};

template <typename Storm>
IterationResult RunStorm() {
  Storm storm;
  std::atomic<int> loads{0};
  Clock::time_point load_begin;
  Clock::time_point load_end;
  const modelcache::Loader loader = [&] {
    const bool first = loads.fetch_add(1, std::memory_order_relaxed) == 0;
    const Clock::time_point begin = Clock::now();
    std::this_thread::sleep_for(kLoadTime);
    if (first) {  // a second load is an error; keep only the first's times
      load_begin = begin;
      load_end = Clock::now();
    }
    modelcache::Loaded loaded;
    loaded.value = std::make_shared<int>(42);
    loaded.bytes = kModelBytes;
    return loaded;
  };

  std::latch ready(kThreads);  // every thread is parked at the gate
  std::latch go(1);            // opened once by this thread
  std::latch finished(kThreads);
  std::vector<Clock::time_point> served(kThreads);
  std::vector<void*> values(kThreads, nullptr);
  std::vector<std::exception_ptr> errors(kThreads);
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.count_down();
      go.wait();
      typename Storm::Handle handle;
      try {
        handle = storm.Acquire(loader);
        served[t] = Clock::now();
        values[t] = Storm::Value(handle);
      } catch (...) {
        errors[t] = std::current_exception();
      }
      // Keep the lease and the thread until every caller is served, so that
      // releasing and exiting do not take CPU from callers still waiting.
      finished.arrive_and_wait();
    });
  }
  ready.wait();
  const Clock::time_point start = Clock::now();
  go.count_down();
  for (std::thread& thread : threads) thread.join();

  IterationResult result;
  result.loads = loads.load();
  if (result.loads != 1) {
    result.error =
        "expected exactly 1 load, got " + std::to_string(result.loads);
    return result;
  }
  for (int t = 0; t < kThreads; ++t) {
    if (errors[t]) {
      try {
        std::rethrow_exception(errors[t]);
      } catch (const std::exception& e) {
        result.error = std::string("Acquire threw: ") + e.what();
      } catch (...) {
        result.error = "Acquire threw a non-std exception";
      }
      return result;
    }
    if (values[t] == nullptr || values[t] != values[0]) {
      result.error = "a caller did not receive the loaded model";
      return result;
    }
    result.max_served_ms =
        std::max(result.max_served_ms, Ms(served[t] - start));
  }
  result.load_ms = Ms(load_end - load_begin);
  result.load_start_ms = Ms(load_begin - start);
  return result;
}

template <typename Storm>
void RunStormBenchmark(benchmark::State& state) {
  double loads = 0;
  double load_ms = 0;
  double load_start_ms = 0;
  double max_served_ms = 0;
  double overshoot_ms = 0;
  double worst_overshoot_ms = 0;
  double late_iterations = 0;
  for (auto _ : state) {
    const IterationResult r = RunStorm<Storm>();
    if (!r.error.empty()) {
      state.SkipWithError(r.error.c_str());
      break;
    }
    const double overshoot = r.max_served_ms - r.load_ms;
    loads += r.loads;
    load_ms += r.load_ms;
    load_start_ms += r.load_start_ms;
    max_served_ms += r.max_served_ms;
    overshoot_ms += overshoot;
    worst_overshoot_ms = std::max(worst_overshoot_ms, overshoot);
    if (overshoot > kAllowedOvershootMs) ++late_iterations;
    state.SetIterationTime(r.max_served_ms / 1e3);
  }
  if (state.error_occurred()) return;
  using benchmark::Counter;
  state.counters["loads"] = Counter(loads, Counter::kAvgIterations);
  state.counters["load_ms"] = Counter(load_ms, Counter::kAvgIterations);
  state.counters["load_start_ms"] =
      Counter(load_start_ms, Counter::kAvgIterations);
  state.counters["max_served_after_start_ms"] =
      Counter(max_served_ms, Counter::kAvgIterations);
  state.counters["overshoot_ms"] =
      Counter(overshoot_ms, Counter::kAvgIterations);
  state.counters["worst_overshoot_ms"] = worst_overshoot_ms;
  state.counters["late_iterations"] = late_iterations;
}

void BM_MissStorm(benchmark::State& state) {
  RunStormBenchmark<CacheStorm>(state);
}
void BM_MissStorm_baseline(benchmark::State& state) {
  RunStormBenchmark<SharedFutureStorm>(state);
}

BENCHMARK(BM_MissStorm)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MissStorm_baseline)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
