// The CUDA backend on a real GPU. Built only when CMake found the CUDA
// toolkit; every test skips, saying why, where CUDA is unavailable (no GPU,
// no driver). Also runs the Device contract suite (device_contract_test.cc)
// over cuda:0 with a small accounting capacity.
//
// Scenarios: every GPU is enumerated as cuda:N; 64 MiB round trips
// byte-identical, also through a staging pipeline of many small chunks at odd
// offsets; asynchronous copies are complete once Synchronize() returns
// (checked with a plain cudaMemcpy, which does not wait for the device's
// non-blocking stream); a buffer may be freed right after an unsynchronised
// copy; an absurd size is refused with kOutOfMemory both by the capacity
// check and by cudaMalloc itself, leaving the books unchanged and the device
// usable.

#include "modelcache/device/cuda_device.h"

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device_test_util.h"
#include "modelcache/device/device.h"

namespace modelcache::device::testing {

std::vector<std::string> ContractBackends() { return {"Cuda"}; }

std::unique_ptr<Device> MakeContractDevice(const std::string& /*backend*/,
                                           uint64_t capacity_bytes,
                                           std::string* skip_reason) {
  if (!CudaAvailable()) {
    *skip_reason = "CUDA unavailable: " + CudaUnavailableReason();
    return nullptr;
  }
  // Small staging buffers so the contract's MiB-sized copies go through the
  // chunked pipeline.
  return MakeCudaDevice(0, CudaDeviceOptions{.capacity_bytes = capacity_bytes,
                                             .staging_buffer_bytes = 256 << 10,
                                             .staging_buffers = 3});
}

namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) {
      GTEST_SKIP() << "CUDA unavailable: " << CudaUnavailableReason();
    }
  }
};

TEST_F(CudaDeviceTest, EnumeratesEveryGpu) {
  std::vector<std::unique_ptr<Device>> devices = CudaDevices();
  ASSERT_EQ(devices.size(), static_cast<size_t>(CudaDeviceCount()));
  for (size_t i = 0; i < devices.size(); ++i) {
    EXPECT_EQ(devices[i]->name(), "cuda:" + std::to_string(i));
    EXPECT_EQ(devices[i]->kind(), DeviceKind::kCuda);
    EXPECT_GT(devices[i]->capacity_bytes(), 0u);
    EXPECT_EQ(devices[i]->bytes_allocated(), 0u);
  }
  try {
    MakeCudaDevice(CudaDeviceCount());
    FAIL() << "a GPU past the last one was made";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kUnavailable);
    EXPECT_THAT(e.what(), HasSubstr("no such GPU"));
  }
}

TEST_F(CudaDeviceTest, RoundTripOf64MiBIsByteIdentical) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  const std::vector<std::byte> data = Pattern(1, 64 * kMiB);
  DeviceBuffer buffer = gpu->Allocate(data.size());
  EXPECT_EQ(gpu->bytes_allocated(), 64 * kMiB);
  gpu->CopyToDevice(buffer, 0, data);
  gpu->Synchronize();
  std::vector<std::byte> back(data.size());
  gpu->CopyToHost(back, buffer, 0);
  EXPECT_TRUE(back == data);
  buffer.Reset();
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
}

TEST_F(CudaDeviceTest, ManySmallStagingChunksAtOddOffsets) {
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.staging_buffer_bytes = 1 * kMiB + 3,
                                          .staging_buffers = 3});
  const size_t size = 64 * kMiB + 123;
  const std::vector<std::byte> data = Pattern(2, size);
  DeviceBuffer buffer = gpu->Allocate(size + 5);
  gpu->CopyToDevice(buffer, 5, data);
  std::vector<std::byte> back(size);
  gpu->CopyToHost(back, buffer, 5);  // ordered after the copy in
  EXPECT_TRUE(back == data);
  std::vector<std::byte> tail(10 * kMiB + 1);
  gpu->CopyToHost(tail, buffer, 5 + size - tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), data.end() - tail.size()));
}

TEST_F(CudaDeviceTest, AsyncCopiesAreCompleteAfterSynchronize) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  constexpr int kPieces = 16;
  constexpr size_t kPiece = 4 * kMiB;
  DeviceBuffer buffer = gpu->Allocate(kPieces * kPiece);
  std::vector<std::byte> expected;
  for (int i = 0; i < kPieces; ++i) {
    std::vector<std::byte> piece = Pattern(100 + i, kPiece);
    gpu->CopyToDevice(buffer, i * kPiece, piece);
    expected.insert(expected.end(), piece.begin(), piece.end());
  }
  gpu->Synchronize();
  // Read behind the device's back: a plain cudaMemcpy does not wait for the
  // device's non-blocking stream, so only Synchronize() makes this pass.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  std::vector<std::byte> back(expected.size());
  ASSERT_EQ(cudaMemcpy(back.data(), buffer.data(), back.size(),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_TRUE(back == expected);
  EXPECT_EQ(gpu->Stats().copies_to_device, static_cast<uint64_t>(kPieces));
}

TEST_F(CudaDeviceTest, FreeRightAfterAnUnsynchronizedCopyIsSafe) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  const std::vector<std::byte> data = Pattern(3, 32 * kMiB);
  for (int i = 0; i < 4; ++i) {
    DeviceBuffer buffer = gpu->Allocate(data.size());
    gpu->CopyToDevice(buffer, 0, data);
  }  // cudaFree waits for the copy
  gpu->Synchronize();
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
  EXPECT_EQ(gpu->Stats().frees, 4u);
}

TEST_F(CudaDeviceTest, AbsurdSizeBeyondCapacityIsOutOfMemory) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  const DeviceStats before = gpu->Stats();
  try {
    gpu->Allocate(uint64_t{1} << 50);  // 1 PiB
    FAIL() << "1 PiB allocated";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_THAT(e.what(), HasSubstr("device cuda:0: out of memory"));
  }
  EXPECT_EQ(gpu->Stats().bytes_allocated, before.bytes_allocated);
  EXPECT_EQ(gpu->Stats().allocations, before.allocations);
}

TEST_F(CudaDeviceTest, CudaMallocFailureIsOutOfMemoryAndNotSticky) {
  // An accounting capacity beyond the GPU, so cudaMalloc itself refuses.
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.capacity_bytes = uint64_t{1} << 60});
  try {
    gpu->Allocate(uint64_t{1} << 50);
    FAIL() << "cudaMalloc of 1 PiB succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_THAT(e.what(), HasSubstr("cudaMalloc"));
  }
  DeviceStats stats = gpu->Stats();
  EXPECT_EQ(stats.bytes_allocated, 0u);
  EXPECT_EQ(stats.allocations, 0u);
  EXPECT_EQ(stats.failed_allocations, 1u);
  // The device still works.
  DeviceBuffer buffer = gpu->Allocate(1 * kMiB);
  const std::vector<std::byte> data = Pattern(4, 1 * kMiB);
  gpu->CopyToDevice(buffer, 0, data);
  std::vector<std::byte> back(data.size());
  gpu->CopyToHost(back, buffer, 0);
  EXPECT_TRUE(back == data);
}

TEST_F(CudaDeviceTest, TwoDevicesCopyIndependently) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two GPUs";
  std::vector<std::unique_ptr<Device>> gpus = CudaDevices();
  const std::vector<std::byte> a = Pattern(5, 8 * kMiB);
  const std::vector<std::byte> b = Pattern(6, 8 * kMiB);
  DeviceBuffer on0 = gpus[0]->Allocate(a.size());
  DeviceBuffer on1 = gpus[1]->Allocate(b.size());
  gpus[0]->CopyToDevice(on0, 0, a);
  gpus[1]->CopyToDevice(on1, 0, b);
  std::vector<std::byte> back(a.size());
  gpus[1]->CopyToHost(back, on1, 0);
  EXPECT_TRUE(back == b);
  gpus[0]->CopyToHost(back, on0, 0);
  EXPECT_TRUE(back == a);
}

}  // namespace
}  // namespace modelcache::device::testing
