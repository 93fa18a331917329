// The runtime on a real GPU: placements on cuda:0, checked byte for byte.
// Built with the GPU suites (tests/device/CMakeLists.txt); every test skips,
// saying why, where CUDA is unavailable, and fails instead under
// MODELCACHE_REQUIRE_GPU=1.
//
// Scenarios: every placed tensor's device address is a multiple of 256,
// after odd-sized U8, BOOL and F16 tensors, across files and after a tensor
// left on the host, and reads back exactly; a cache at the device's default
// capacity filled with (2 MiB + 1)-byte models evicts rather than raising,
// and the GPU memory it really uses is what its books say; when another
// library takes the GPU's memory, a placement evicts unleased models and
// succeeds, and with every model leased it fails with kOutOfMemory and the
// books unchanged.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "modelcache/device/cuda_device.h"
#include "modelcache/runtime/runtime.h"
#include "modelcache/weights/safetensors_writer.h"

namespace modelcache::runtime {
namespace {

namespace fs = std::filesystem;
using device::CudaDeviceOptions;
using device::Device;
using device::MakeCudaDevice;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

class CudaRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MC_SKIP_OR_FAIL_WITHOUT_GPU();
    dir_ = fs::temp_directory_path() /
           ("modelcache_cuda_runtime_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    if (!dir_.empty()) fs::remove_all(dir_, ignored);
  }

  struct Tensor {
    std::string name;
    weights::Dtype dtype;
    uint64_t elements;
  };
  std::string Write(const std::string& name,
                    const std::vector<Tensor>& tensors) {
    weights::SafetensorsWriter writer;
    uint64_t seed = 1;
    for (const Tensor& t : tensors) {
      writer.AddTensor(t.name, t.dtype, {t.elements},
                       weights::PatternFill(seed++));
    }
    const std::string path = (dir_ / (name + ".safetensors")).string();
    writer.Write(path);
    return path;
  }

  static uint64_t FreeGpuMemory() {
    size_t free_bytes = 0;
    size_t total = 0;
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
    return free_bytes;
  }

  fs::path dir_;
};

// Every on-device tensor starts 256-aligned and holds its host bytes.
void ExpectAlignedAndExact(const DeviceModel& model) {
  int placed = 0;
  for (const PlacedTensor& t : model.tensors()) {
    if (!t.on_device || t.host.empty()) continue;
    ++placed;
    const auto address =
        reinterpret_cast<uintptr_t>(model.buffer().data()) + t.device_offset;
    EXPECT_EQ(address % 256, 0u)
        << t.info->name << " at offset " << t.device_offset;
    std::vector<std::byte> back(t.host.size());
    model.device().CopyToHost(back, model.buffer(), t.device_offset);
    EXPECT_TRUE(std::equal(back.begin(), back.end(), t.host.begin()))
        << t.info->name;
  }
  EXPECT_GT(placed, 0);
}

TEST_F(CudaRuntimeTest, EveryPlacedTensorIsAlignedAndExact) {
  using weights::Dtype;
  const std::string first = Write("first", {{"a", Dtype::kU8, 1},
                                            {"b", Dtype::kU8, 300},
                                            {"c", Dtype::kF16, 3},
                                            {"d", Dtype::kBool, 7}});
  const std::string second =
      Write("second", {{"e", Dtype::kU8, 1001}, {"f", Dtype::kF32, 5}});
  const std::string skip = Write("skip", {{"t0", Dtype::kU8, 100},
                                          {"t1", Dtype::kU8, 3 * kMiB},
                                          {"t2", Dtype::kU8, 10}});
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.capacity_bytes = 64 * kMiB});
  weights::HostWeightStore host({.capacity_bytes = 64 * kMiB});
  {
    DeviceCache cache(host, *gpu);
    ModelLease lease = cache.Acquire("two-files", {first, second});
    EXPECT_TRUE(lease->full());
    ExpectAlignedAndExact(lease.model());
    EXPECT_EQ(gpu->bytes_allocated(), lease->device_bytes());
    EXPECT_EQ(cache.cache().Entry("two-files")->bytes, lease->device_bytes());
  }
  {
    // 2 MiB for models: t1 stays on the host, t2 comes after it.
    DeviceCache cache(host, *gpu, {.capacity_bytes = 2 * kMiB});
    ModelLease lease = cache.Acquire("skip", {skip}, Placement::kPartial);
    EXPECT_FALSE(lease->full());
    int on_device = 0;
    for (const PlacedTensor& t : lease->tensors()) on_device += t.on_device;
    EXPECT_EQ(on_device, 2);
    ExpectAlignedAndExact(lease.model());
  }
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
}

TEST_F(CudaRuntimeTest, ACacheAtDefaultCapacityFilledWithOddModelsEvicts) {
  const std::string file =
      Write("odd", {{"w", weights::Dtype::kU8, 2 * kMiB + 1}});
  const uint64_t free_before = FreeGpuMemory();
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  weights::HostWeightStore host({.capacity_bytes = 64 * kMiB});
  DeviceCache cache(host, *gpu);
  const uint64_t per_model = gpu->AllocationSize(2 * kMiB + 1);
  ASSERT_EQ(per_model, 4 * kMiB);
  const uint64_t fit = cache.cache().budget().capacity() / per_model;
  const uint64_t models = fit + 256;
  const auto start = std::chrono::steady_clock::now();
  uint64_t placed = 0;
  for (uint64_t i = 0; i < models; ++i) {
    try {
      cache.Acquire("m" + std::to_string(i), {file}).Release();
      ++placed;
    } catch (const std::exception& e) {
      FAIL() << "model " << i << " of " << models << " (" << fit
             << " fit): " << e.what();
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const CacheStats stats = cache.cache().Stats();
  const uint64_t used_on_gpu = free_before - FreeGpuMemory();
  std::printf(
      "%llu placements of 2 MiB + 1 bytes in %.1f s: %llu evictions; books "
      "%s of %s capacity; the GPU lost %s of %s free\n",
      static_cast<unsigned long long>(placed), seconds,
      static_cast<unsigned long long>(stats.evictions),
      FormatBytes(gpu->bytes_allocated()).c_str(),
      FormatBytes(gpu->capacity_bytes()).c_str(),
      FormatBytes(used_on_gpu).c_str(), FormatBytes(free_before).c_str());
  EXPECT_EQ(placed, models);
  EXPECT_GE(stats.evictions, models - fit);
  EXPECT_EQ(gpu->bytes_allocated(), cache.cache().budget().used());
  EXPECT_LE(gpu->bytes_allocated(), gpu->capacity_bytes());
  // The books are what the GPU really gave, give or take the driver's own
  // pages and the staging buffers.
  EXPECT_LE(used_on_gpu, gpu->bytes_allocated() + 256 * kMiB);
  cache.cache().Prune();
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
}

// Takes all but about `leave` bytes of the GPU's free memory, as another
// library would; gives it back when destroyed.
class OtherLibrary {
 public:
  explicit OtherLibrary(uint64_t leave) {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    for (uint64_t chunk = kGiB; chunk >= 2 * kMiB;) {
      size_t free_bytes = 0;
      size_t total = 0;
      EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
      if (free_bytes < leave + chunk) {
        chunk /= 2;
        continue;
      }
      void* p = nullptr;
      if (cudaMalloc(&p, chunk) != cudaSuccess) {
        cudaGetLastError();
        chunk /= 2;
        continue;
      }
      taken_.push_back(p);
    }
  }
  ~OtherLibrary() {
    for (void* p : taken_) cudaFree(p);
  }
  OtherLibrary(const OtherLibrary&) = delete;
  OtherLibrary& operator=(const OtherLibrary&) = delete;

 private:
  std::vector<void*> taken_;
};

TEST_F(CudaRuntimeTest, MemoryTakenByAnotherLibraryIsMadeUpByEvicting) {
  const std::string file =
      Write("quarter", {{"w", weights::Dtype::kU8, 256 * kMiB}});
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  weights::HostWeightStore host({.capacity_bytes = 512 * kMiB});
  DeviceCache cache(host, *gpu);
  cache.Acquire("a", {file}).Release();
  ModelLease b = cache.Acquire("b", {file});
  OtherLibrary other(128 * kMiB);
  ASSERT_LT(FreeGpuMemory(), 256 * kMiB) << "could not fill the GPU";
  // The budget has room; the GPU has not: "a", unleased, makes way.
  ModelLease c = cache.Acquire("c", {file});
  EXPECT_FALSE(cache.cache().Entry("a").has_value());
  EXPECT_EQ(cache.cache().Stats().evictions, 1u);
  ExpectAlignedAndExact(c.model());
  EXPECT_EQ(gpu->bytes_allocated(), cache.cache().budget().used());
  // Everything leased: nothing to evict, an honest out-of-memory error.
  const device::DeviceStats before = gpu->Stats();
  try {
    cache.Acquire("d", {file});
    FAIL() << "placed with no memory left";
  } catch (const device::DeviceError& e) {
    EXPECT_EQ(e.device_code(), device::DeviceErrorCode::kOutOfMemory);
    EXPECT_EQ(e.code(), ErrorCode::kCapacity);
  }
  EXPECT_EQ(gpu->bytes_allocated(), before.bytes_allocated);
  EXPECT_EQ(cache.cache().budget().used(), before.bytes_allocated);
  EXPECT_FALSE(cache.cache().Entry("d").has_value());
}

}  // namespace
}  // namespace modelcache::runtime
