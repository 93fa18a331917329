// Host-to-device bandwidth of placing one model through the runtime, beside
// cudaMemcpy from pinned and from pageable memory, in the same run on the
// same GPU (cuda:0).
//
//   modelcache_cuda_transfer_bench [--bytes N] [--repetitions R]
//                                  [--dir DIR] [--json FILE]
//
// The model (default 4 GiB: 64 U8 tensors) is written to DIR and read by the
// runtime through the host store (mmap, the default). Measured, each the
// median of R runs after one warm-up:
//   pinned     cudaMemcpy of the whole size from cudaHostAlloc'd memory
//   pageable   cudaMemcpy from ordinary (touched) host memory
//   runtime    ModelRuntime::Acquire of the model on a default-capacity CUDA
//              device while its host copy is resident: the staging pipeline,
//              the 256-byte layout and the books, Synchronize included
//   first      the first Acquire (once): the host copy is mapped and its
//              pages faulted in from the page cache as they are copied
// Every byte placed is read back and compared with the file's.
//
// Prints a table and, with --json, writes the figures. Exits 2, saying why,
// when CUDA is unavailable; 1 when a placement reads back wrong.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "modelcache/device/cuda_device.h"
#include "modelcache/runtime/runtime.h"
#include "modelcache/weights/safetensors_writer.h"

namespace {

namespace fs = std::filesystem;
namespace device = modelcache::device;
namespace runtime = modelcache::runtime;
namespace weights = modelcache::weights;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr int kTensors = 64;

struct Options {
  uint64_t bytes = 4 * kGiB;
  int repetitions = 3;
  std::string dir;
  std::string json;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: modelcache_cuda_transfer_bench [--bytes N] "
               "[--repetitions R] [--dir DIR] [--json FILE]\n",
               why.c_str());
  std::exit(64);
}

Options Parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage("missing a value after " + flag);
    const std::string value = argv[++i];
    if (flag == "--bytes") {
      options.bytes = std::stoull(value);
    } else if (flag == "--repetitions") {
      options.repetitions = std::stoi(value);
    } else if (flag == "--dir") {
      options.dir = value;
    } else if (flag == "--json") {
      options.json = value;
    } else {
      Usage("unknown flag " + flag);
    }
  }
  if (options.bytes < kTensors || options.repetitions < 1) {
    Usage("--bytes must be at least 64 and --repetitions at least 1");
  }
  return options;
}

void Check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " +
                             cudaGetErrorName(error));
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The medians of `repetitions` timed cudaMemcpy of `bytes` from `src`, after
// one warm-up.
std::vector<double> TimeMemcpy(void* dst, const void* src, uint64_t bytes,
                               int repetitions) {
  Check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "warm-up");
  std::vector<double> seconds;
  for (int r = 0; r < repetitions; ++r) {
    const auto start = Clock::now();
    Check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    seconds.push_back(Seconds(start));
  }
  return seconds;
}

// Every placed tensor reads back as in the host copy.
bool ReadsBackExactly(const runtime::DeviceModel& model) {
  std::vector<std::byte> back;
  for (const runtime::PlacedTensor& t : model.tensors()) {
    if (!t.on_device) return false;
    back.resize(t.host.size());
    model.device().CopyToHost(back, model.buffer(), t.device_offset);
    if (std::memcmp(back.data(), t.host.data(), back.size()) != 0) {
      return false;
    }
  }
  return true;
}

nlohmann::json Figure(const std::vector<double>& seconds, uint64_t bytes) {
  const double median = Median(seconds);
  return {{"seconds", seconds},
          {"median_seconds", median},
          {"gb_per_second", static_cast<double>(bytes) / median / 1e9}};
}

int Run(const Options& options) {
  nlohmann::json out = {{"benchmark", "cuda_transfer"},
                        {"bytes", options.bytes},
                        {"repetitions", options.repetitions}};
  auto write = [&] {
    if (options.json.empty()) return;
    std::ofstream(options.json) << out.dump(2) << "\n";
  };
  if (!device::CudaAvailable()) {
    const std::string why = device::CudaUnavailableReason();
    std::fprintf(stderr, "CUDA unavailable: %s\n", why.c_str());
    out["status"] = "unavailable";
    out["reason"] = why;
    write();
    return 2;
  }
  cudaDeviceProp properties{};
  Check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
  int runtime_version = 0;
  int driver_version = 0;
  cudaRuntimeGetVersion(&runtime_version);
  cudaDriverGetVersion(&driver_version);
  out["gpu"] = properties.name;
  out["cuda_runtime"] = runtime_version;
  out["cuda_driver"] = driver_version;
  const uint64_t bytes = options.bytes;

  // ---- The baselines.
  {
    void* on_gpu = nullptr;
    Check(cudaSetDevice(0), "cudaSetDevice");
    Check(cudaMalloc(&on_gpu, bytes), "cudaMalloc");
    std::unique_ptr<std::byte[]> pageable(new std::byte[bytes]);
    for (uint64_t i = 0; i < bytes; i += 4096) {
      pageable[i] = static_cast<std::byte>(i >> 12);  // every page touched
    }
    void* pinned = nullptr;
    Check(cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault), "cudaHostAlloc");
    std::memcpy(pinned, pageable.get(), bytes);
    out["pinned"] =
        Figure(TimeMemcpy(on_gpu, pinned, bytes, options.repetitions), bytes);
    out["pageable"] = Figure(
        TimeMemcpy(on_gpu, pageable.get(), bytes, options.repetitions), bytes);
    Check(cudaFreeHost(pinned), "cudaFreeHost");
    Check(cudaFree(on_gpu), "cudaFree");
  }

  // ---- The model, through the runtime.
  const fs::path dir =
      options.dir.empty()
          ? fs::temp_directory_path() /
                ("modelcache_transfer_" + std::to_string(::getpid()))
          : fs::path(options.dir);
  fs::create_directories(dir);
  const std::string file = (dir / "model.safetensors").string();
  {
    weights::SafetensorsWriter writer;
    const uint64_t each = bytes / kTensors;
    for (int i = 0; i < kTensors; ++i) {
      const uint64_t n =
          i + 1 < kTensors ? each : bytes - each * (kTensors - 1);
      writer.AddTensor("t" + std::to_string(i), weights::Dtype::kU8, {n},
                       weights::PatternFill(i));
    }
    const auto start = Clock::now();
    writer.Write(file, 64 * kMiB);
    out["write_seconds"] = Seconds(start);
  }
  std::ofstream(dir / "models.json")
      << R"({"models": [{"id": "model", "files": ["model.safetensors"]}]})";
  std::unique_ptr<device::Device> gpu = device::MakeCudaDevice(0);
  bool exact = true;
  {
    runtime::ModelRuntime rt(
        runtime::ModelRegistry::FromJsonFile((dir / "models.json").string()),
        {.host_capacity_bytes = bytes + kGiB, .devices = {{gpu.get(), {}}}});
    auto start = Clock::now();
    runtime::ModelLease lease = rt.Acquire("model", 0);
    out["first"] = Figure({Seconds(start)}, bytes);
    exact = ReadsBackExactly(lease.model());
    std::vector<double> seconds;
    for (int r = 0; r <= options.repetitions; ++r) {  // the first warms up
      lease.Release();
      rt.device_cache(0).cache().Remove("model");
      start = Clock::now();
      lease = rt.Acquire("model", 0);
      if (r > 0) seconds.push_back(Seconds(start));
    }
    exact = exact && ReadsBackExactly(lease.model());
    out["runtime"] = Figure(seconds, bytes);
    out["device_bytes"] = lease->device_bytes();
  }
  std::error_code ignored;
  if (options.dir.empty()) fs::remove_all(dir, ignored);

  const double runtime_gbps = out["runtime"]["gb_per_second"];
  const double pinned_gbps = out["pinned"]["gb_per_second"];
  const double pageable_gbps = out["pageable"]["gb_per_second"];
  out["runtime_over_pinned"] = runtime_gbps / pinned_gbps;
  out["runtime_over_pageable"] = runtime_gbps / pageable_gbps;
  out["read_back_exact"] = exact;
  out["status"] = exact ? "ok" : "wrong bytes";
  write();

  std::printf(
      "%s, CUDA runtime %d, driver %d: host to device, %s, median of "
      "%d\n",
      properties.name, runtime_version, driver_version,
      device::FormatBytes(bytes).c_str(), options.repetitions);
  for (const char* row : {"pinned", "pageable", "runtime", "first"}) {
    std::printf("  %-10s %8.3f s  %7.2f GB/s\n", row,
                out[row]["median_seconds"].get<double>(),
                out[row]["gb_per_second"].get<double>());
  }
  std::printf(
      "  runtime / pinned %.2fx, runtime / pageable %.2fx; read back "
      "%s\n",
      out["runtime_over_pinned"].get<double>(),
      out["runtime_over_pageable"].get<double>(), exact ? "exact" : "WRONG");
  return exact ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = Parse(argc, argv);
  try {
    return Run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_transfer_bench: %s\n", e.what());
    if (!options.json.empty()) {
      std::ofstream(options.json)
          << nlohmann::json{{"benchmark", "cuda_transfer"},
                            {"status", "error"},
                            {"reason", e.what()}}
                 .dump(2)
          << "\n";
    }
    return 1;
  }
}
