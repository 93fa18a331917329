// Two devices, one host copy: the runtime's shared host store against a
// baseline that keeps one independent host copy per device.
//
// Both serve the same request sequence (Zipf-like popularity over 12 models
// of 4-16 MiB, requests alternating between two simulated devices of 48 MiB
// each with a 2 GB/s link) through the same DeviceCache code; only the host
// side differs. Counters:
//   host_bytes_read     bytes read from files into host memory
//   peak_host_bytes     most host bytes held at once, all host stores together
//   device_bytes        bytes copied host -> device
//   simulated_transfer_seconds, transfer_bytes_per_second (device_bytes over
//   the simulated time, to check against the configured bandwidth)
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "modelcache/device/simulated_device.h"
#include "modelcache/runtime/runtime.h"
#include "modelcache/weights/safetensors_writer.h"

namespace {

namespace fs = std::filesystem;
namespace rt = modelcache::runtime;
namespace w = modelcache::weights;
using modelcache::device::SimulatedDevice;
using modelcache::device::SimulatedDeviceOptions;

constexpr uint64_t kMiB = 1 << 20;
constexpr double kBandwidth = 2e9;

struct Workload {
  fs::path dir = fs::temp_directory_path() /
                 ("modelcache_multi_device_" + std::to_string(::getpid()));
  std::vector<std::string> files;
  std::vector<std::pair<int, int>> requests;  // (model, device)

  Workload() {
    fs::create_directories(dir);
    for (int m = 0; m < 12; ++m) {
      w::SafetensorsWriter writer;
      const uint64_t mib = 4 + 4 * (m % 4);
      for (int t = 0; t < 4; ++t) {
        writer.AddTensor("t" + std::to_string(t), w::Dtype::kF16,
                         {mib * kMiB / 4 / 2}, w::PatternFill(m * 10 + t));
      }
      files.push_back(
          (dir / ("model" + std::to_string(m) + ".safetensors")).string());
      writer.Write(files.back());
    }
    std::mt19937 rng(7);
    std::vector<double> weights;
    for (int m = 0; m < 12; ++m) weights.push_back(1.0 / (m + 1));
    std::discrete_distribution<int> pick(weights.begin(), weights.end());
    for (int i = 0; i < 600; ++i) requests.emplace_back(pick(rng), i % 2);
  }
  ~Workload() { fs::remove_all(dir); }
};

const Workload& TheWorkload() {
  static const Workload workload;
  return workload;
}

std::unique_ptr<SimulatedDevice> Device(const std::string& name) {
  SimulatedDeviceOptions options;
  options.name = name;
  options.capacity_bytes = 48 * kMiB;
  options.bandwidth_bytes_per_second = kBandwidth;
  return std::make_unique<SimulatedDevice>(options);
}

void Serve(benchmark::State& state, bool shared) {
  const Workload& work = TheWorkload();
  uint64_t host_read = 0, peak_host = 0, device_bytes = 0;
  double simulated = 0;
  for (auto _ : state) {
    auto gpu0 = Device("gpu0"), gpu1 = Device("gpu1");
    // Shared: one store for both devices. Independent: one store each.
    std::vector<std::unique_ptr<w::HostWeightStore>> stores;
    for (int i = 0; i < (shared ? 1 : 2); ++i) {
      stores.push_back(std::make_unique<w::HostWeightStore>(
          w::HostStoreOptions{.capacity_bytes = uint64_t{1} << 30}));
    }
    {
      rt::DeviceCache cache0(*stores[0], *gpu0);
      rt::DeviceCache cache1(*stores[shared ? 0 : 1], *gpu1);
      rt::DeviceCache* caches[2] = {&cache0, &cache1};
      for (auto [model, device] : work.requests) {
        rt::ModelLease lease = caches[device]->Acquire(
            "model" + std::to_string(model), {work.files[model]});
        benchmark::DoNotOptimize(lease->bytes_on_device());
      }
    }
    for (auto& store : stores) {
      host_read += store->Stats().bytes_loaded;
      peak_host += store->budget().high_water();
    }
    device_bytes += gpu0->Stats().bytes_copied_to_device +
                    gpu1->Stats().bytes_copied_to_device;
    simulated += gpu0->simulated_seconds() + gpu1->simulated_seconds();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["host_bytes_read"] = static_cast<double>(host_read) / n;
  state.counters["peak_host_bytes"] = static_cast<double>(peak_host) / n;
  state.counters["device_bytes"] = static_cast<double>(device_bytes) / n;
  state.counters["simulated_transfer_seconds"] = simulated / n;
  state.counters["transfer_bytes_per_second"] =
      simulated > 0 ? static_cast<double>(device_bytes) / simulated : 0;
  state.counters["simulated_bandwidth"] = kBandwidth;
}

void BM_MultiDevice_shared(benchmark::State& state) { Serve(state, true); }
void BM_MultiDevice_independent(benchmark::State& state) {
  Serve(state, false);
}

BENCHMARK(BM_MultiDevice_shared)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MultiDevice_independent)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
