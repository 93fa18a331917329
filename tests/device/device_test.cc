// The host backend, the shared vocabulary of devices, and how the CUDA entry
// points behave in this build (on a machine without a GPU: unavailable, with
// a reason, and no crash), with the default capacity a CUDA device gets.
// Also runs the Device contract suite (device_contract_test.cc) over the
// host and simulated backends, and over a simulated device that counts in
// CUDA's 2 MiB pages.

#include "modelcache/device/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/device/cuda_device.h"
#include "modelcache/device/host_device.h"
#include "modelcache/device/simulated_device.h"

namespace modelcache::device::testing {

std::vector<std::string> ContractBackends() {
  return {"Host", "Simulated", "SimulatedPaged"};
}

std::unique_ptr<Device> MakeContractDevice(const std::string& backend,
                                           uint64_t capacity_bytes,
                                           std::string* /*skip_reason*/) {
  if (backend == "Host") {
    return std::make_unique<HostDevice>(
        HostDeviceOptions{.name = "host", .capacity_bytes = capacity_bytes});
  }
  return std::make_unique<SimulatedDevice>(SimulatedDeviceOptions{
      .name = "sim0",
      .capacity_bytes = capacity_bytes,
      .bandwidth_bytes_per_second = 25e9,
      .allocation_granularity =
          backend == "SimulatedPaged" ? kCudaAllocationGranularity : 1});
}

namespace {

using ::testing::HasSubstr;

TEST(HostDeviceTest, DescribesItself) {
  HostDevice host(HostDeviceOptions{.capacity_bytes = 1 << 20});
  EXPECT_EQ(host.name(), "host");
  EXPECT_EQ(host.kind(), DeviceKind::kHost);
  EXPECT_EQ(host.capacity_bytes(), 1u << 20);
  EXPECT_EQ(host.alignment(), 4096u);
  EXPECT_STREQ(DeviceKindName(host.kind()), "host");
}

TEST(HostDeviceTest, DefaultCapacityIsPhysicalMemory) {
  HostDevice host;
  EXPECT_GT(PhysicalMemoryBytes(), 0u);
  EXPECT_EQ(host.capacity_bytes(), PhysicalMemoryBytes());
}

TEST(HostDeviceTest, BuffersAreAligned) {
  for (size_t alignment : {size_t{64}, size_t{4096}, size_t{1} << 16}) {
    HostDevice host(
        HostDeviceOptions{.capacity_bytes = 1 << 24, .alignment = alignment});
    for (uint64_t size : {0u, 1u, 100u, 5000u, 70000u}) {
      DeviceBuffer buffer = host.Allocate(size);
      ASSERT_NE(buffer.data(), nullptr);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % alignment, 0u)
          << "alignment " << alignment << " size " << size;
    }
  }
}

TEST(HostDeviceTest, BadOptionsAreInvalidArguments) {
  try {
    HostDevice host(HostDeviceOptions{.alignment = 48});
    FAIL() << "alignment 48 accepted";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("device host: invalid argument: "
                                    "alignment 48 is not a power of two"));
  }
  EXPECT_THROW(HostDevice(HostDeviceOptions{.name = ""}), DeviceError);
}

TEST(DeviceErrorTest, MessageNamesDeviceAndKind) {
  DeviceError error(DeviceErrorCode::kCopyFailed, "cuda:1", "it broke");
  EXPECT_STREQ(error.what(), "device cuda:1: copy failed: it broke");
  EXPECT_EQ(error.device_code(), DeviceErrorCode::kCopyFailed);
  EXPECT_EQ(error.device(), "cuda:1");
  // One root: a DeviceError is a modelcache::Error with the coarse kind.
  const Error& root = error;
  EXPECT_EQ(root.code(), ErrorCode::kIo);
  EXPECT_EQ(DeviceError(DeviceErrorCode::kOutOfMemory, "d", "m").code(),
            ErrorCode::kCapacity);
  EXPECT_EQ(DeviceError(DeviceErrorCode::kUnavailable, "d", "m").code(),
            ErrorCode::kUnavailable);
  EXPECT_EQ(DeviceError(DeviceErrorCode::kInvalidArgument, "d", "m").code(),
            ErrorCode::kInvalidArgument);
}

TEST(DeviceErrorTest, CodeAndKindNames) {
  EXPECT_STREQ(DeviceErrorCodeName(DeviceErrorCode::kOutOfMemory),
               "out_of_memory");
  EXPECT_STREQ(DeviceErrorCodeName(DeviceErrorCode::kCopyFailed),
               "copy_failed");
  EXPECT_STREQ(DeviceErrorCodeName(DeviceErrorCode::kInvalidArgument),
               "invalid_argument");
  EXPECT_STREQ(DeviceErrorCodeName(DeviceErrorCode::kUnavailable),
               "unavailable");
  EXPECT_STREQ(DeviceKindName(DeviceKind::kSimulated), "simulated");
  EXPECT_STREQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

TEST(FormatBytesTest, PicksAUnit) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{1} << 50), "1.00 PiB");
}

TEST(DeviceBufferTest, DefaultIsEmpty) {
  DeviceBuffer buffer;
  EXPECT_FALSE(buffer);
  EXPECT_EQ(buffer.device(), nullptr);
  EXPECT_EQ(buffer.size(), 0u);
  EXPECT_EQ(buffer.data(), nullptr);
  buffer.Reset();  // no-op
}

TEST(CudaDefaultCapacityTest, LeavesAGibibyteOrFivePercentFree) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  // Small GPUs: 1 GiB of headroom.
  EXPECT_EQ(CudaDefaultCapacity(10 * kGiB, 16 * kGiB), 9 * kGiB);
  // Large ones: 5% of the total (an H200: 7 GiB of 140).
  EXPECT_EQ(CudaDefaultCapacity(139 * kGiB, 140 * kGiB), 132 * kGiB);
  EXPECT_EQ(CudaDefaultCapacity(80 * kGiB, 80 * kGiB), 76 * kGiB);
  // Rounded down to whole 2 MiB pages.
  EXPECT_EQ(CudaDefaultCapacity(kGiB + 5 * kMiB + 3, 8 * kGiB), 4 * kMiB);
  // No room for anything beyond the headroom.
  EXPECT_EQ(CudaDefaultCapacity(kGiB, 8 * kGiB), 0u);
  EXPECT_EQ(CudaDefaultCapacity(kGiB + kMiB, 8 * kGiB), 0u);
  EXPECT_EQ(CudaDefaultCapacity(0, 0), 0u);
  EXPECT_EQ(CudaDefaultCapacity(UINT64_MAX, UINT64_MAX) % (2 * kMiB), 0u);
}

// Holds in every build: with the CUDA backend and a GPU, without a GPU (the
// runtime reports why), and without the toolkit (the stub reports why).
TEST(CudaEntryPointsTest, AgreeWithEachOtherAndNeverCrash) {
  const bool available = CudaAvailable();
  const std::string reason = CudaUnavailableReason();
  if (available) {
    EXPECT_TRUE(reason.empty()) << reason;
    EXPECT_GT(CudaDeviceCount(), 0);
    EXPECT_EQ(CudaDevices(CudaDeviceOptions{.capacity_bytes = 1 << 20}).size(),
              static_cast<size_t>(CudaDeviceCount()));
    return;
  }
  EXPECT_FALSE(reason.empty());
#if MODELCACHE_HAVE_CUDA
  EXPECT_THAT(reason, HasSubstr("CUDA runtime "));  // the versions, to act on
#endif
  EXPECT_EQ(CudaDeviceCount(), 0);
  EXPECT_TRUE(CudaDevices().empty());
  HostDevice host(HostDeviceOptions{.capacity_bytes = 1 << 20});
  EXPECT_EQ(CudaStreamOf(host), nullptr);
  try {
    MakeCudaDevice(0);
    FAIL() << "MakeCudaDevice succeeded without CUDA";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kUnavailable);
    EXPECT_EQ(e.device(), "cuda:0");
    EXPECT_THAT(e.what(), HasSubstr(reason));
  }
#if MODELCACHE_HAVE_CUDA
  std::printf("CUDA backend built; unavailable here: %s\n", reason.c_str());
#else
  std::printf("CUDA backend not built: %s\n", reason.c_str());
#endif
}

}  // namespace
}  // namespace modelcache::device::testing
