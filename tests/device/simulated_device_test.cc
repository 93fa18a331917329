// The simulated backend: modelled transfer time and fault injection.
//
// Transfer time is bytes / bandwidth (+ latency per copy), exact, counted
// only for copies that succeed, and never slept by default (a copy of a
// mebibyte at one byte per second returns at once). Injected faults fail the
// backend the way cudaMalloc and cudaMemcpy would: the Nth allocation, every
// allocation above a size, the next N copies, or copies a predicate picks.
// Each failure leaves the books unchanged, leaves the destination untouched,
// and carries a clear error; one-shot faults are consumed exactly once even
// under concurrency. An allocation granularity rounds the books; a physical
// memory smaller than the books allow, with memory held by others, makes the
// backend refuse what the capacity admits, as cudaMalloc does; a corrupted
// context makes the device unusable for good.

#include "modelcache/device/simulated_device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device_test_util.h"

namespace modelcache::device {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<std::byte> Filled(size_t bytes, unsigned char value) {
  return std::vector<std::byte>(bytes, std::byte{value});
}

SimulatedDeviceOptions Options(uint64_t capacity = 64 * kMiB) {
  return SimulatedDeviceOptions{.name = "sim0",
                                .capacity_bytes = capacity,
                                .bandwidth_bytes_per_second = 1e9};
}

// Books a failure must leave alone, simulated time included.
void ExpectSameSimulatedBooks(const DeviceStats& before,
                              const DeviceStats& after) {
  testing::ExpectSameBooks(before, after);
  EXPECT_EQ(after.simulated_transfer_seconds,
            before.simulated_transfer_seconds);
}

TEST(SimulatedDeviceTest, DescribesItself) {
  SimulatedDevice sim(Options());
  EXPECT_EQ(sim.name(), "sim0");
  EXPECT_EQ(sim.kind(), DeviceKind::kSimulated);
  EXPECT_EQ(sim.capacity_bytes(), 64 * kMiB);
  EXPECT_EQ(sim.simulated_seconds(), 0.0);
  DeviceBuffer buffer = sim.Allocate(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 256, 0u);
}

TEST(SimulatedDeviceTest, TransferTimeIsBytesOverBandwidth) {
  SimulatedDevice sim(Options());
  DeviceBuffer buffer = sim.Allocate(8 * kMiB);
  const std::vector<std::byte> a = Filled(3 * kMiB + 1, 1);
  const std::vector<std::byte> b = Filled(5 * kMiB - 1, 2);
  sim.CopyToDevice(buffer, 0, a);
  sim.CopyToDevice(buffer, a.size(), b);
  EXPECT_DOUBLE_EQ(sim.simulated_seconds(), (8.0 * kMiB) / 1e9);

  std::vector<std::byte> back(2 * kMiB);
  sim.CopyToHost(back, buffer, 0);
  EXPECT_DOUBLE_EQ(sim.simulated_seconds(), (10.0 * kMiB) / 1e9);

  const DeviceStats stats = sim.Stats();
  EXPECT_EQ(stats.bytes_copied_to_device, 8 * kMiB);
  EXPECT_EQ(stats.bytes_copied_to_host, 2 * kMiB);
  EXPECT_EQ(stats.copies_to_device, 2u);
  EXPECT_EQ(stats.copies_to_host, 1u);
  EXPECT_DOUBLE_EQ(stats.simulated_transfer_seconds, (10.0 * kMiB) / 1e9);
  EXPECT_DOUBLE_EQ(sim.TransferSeconds(CopyDirection::kToDevice, 1000000000),
                   1.0);
}

TEST(SimulatedDeviceTest, DirectionsHaveTheirOwnBandwidthAndLatency) {
  SimulatedDevice sim(
      SimulatedDeviceOptions{.name = "sim1",
                             .capacity_bytes = 16 * kMiB,
                             .bandwidth_bytes_per_second = 2e9,
                             .to_host_bandwidth_bytes_per_second = 5e8,
                             .copy_latency_seconds = 1e-5});
  DeviceBuffer buffer = sim.Allocate(4 * kMiB);
  sim.CopyToDevice(buffer, 0, Filled(4 * kMiB, 7));
  std::vector<std::byte> back(1 * kMiB);
  sim.CopyToHost(back, buffer, 0);
  sim.CopyToHost(back, buffer, 1 * kMiB);
  EXPECT_DOUBLE_EQ(sim.simulated_seconds(),
                   (4.0 * kMiB) / 2e9 + (2.0 * kMiB) / 5e8 + 3 * 1e-5);
  EXPECT_DOUBLE_EQ(sim.TransferSeconds(CopyDirection::kToHost, 5e8),
                   1.0 + 1e-5);
}

TEST(SimulatedDeviceTest, DoesNotSleepByDefault) {
  // A mebibyte at one byte per second is twelve simulated days; the test
  // finishing at all shows nothing slept.
  SimulatedDevice sim(SimulatedDeviceOptions{
      .name = "slow", .capacity_bytes = kMiB, .bandwidth_bytes_per_second = 1});
  DeviceBuffer buffer = sim.Allocate(kMiB);
  sim.CopyToDevice(buffer, 0, Filled(kMiB, 3));
  EXPECT_DOUBLE_EQ(sim.simulated_seconds(), static_cast<double>(kMiB));
}

TEST(SimulatedDeviceTest, BadOptionsAreInvalidArguments) {
  auto code_of = [](SimulatedDeviceOptions options) {
    try {
      SimulatedDevice sim(options);
    } catch (const DeviceError& e) {
      return e.device_code();
    }
    return DeviceErrorCode::kUnavailable;  // not thrown
  };
  SimulatedDeviceOptions zero_bandwidth = Options();
  zero_bandwidth.bandwidth_bytes_per_second = 0;
  SimulatedDeviceOptions negative_latency = Options();
  negative_latency.copy_latency_seconds = -1;
  SimulatedDeviceOptions odd_alignment = Options();
  odd_alignment.alignment = 100;
  SimulatedDeviceOptions no_name = Options();
  no_name.name = "";
  SimulatedDeviceOptions negative_to_host = Options();
  negative_to_host.to_host_bandwidth_bytes_per_second = -5;
  SimulatedDeviceOptions zero_granularity = Options();
  zero_granularity.allocation_granularity = 0;
  for (const auto& options : {zero_bandwidth, negative_latency, odd_alignment,
                              no_name, negative_to_host, zero_granularity}) {
    EXPECT_EQ(code_of(options), DeviceErrorCode::kInvalidArgument);
  }
}

TEST(SimulatedDeviceFaultTest, NthAllocationFailsOnceWithBooksUnchanged) {
  SimulatedDevice sim(Options());
  sim.FailAllocation(3);
  DeviceBuffer first = sim.Allocate(1 * kMiB);
  DeviceBuffer second = sim.Allocate(1 * kMiB);
  const DeviceStats before = sim.Stats();
  try {
    sim.Allocate(1 * kMiB);
    FAIL() << "third allocation succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_STREQ(e.what(),
                 "device sim0: out of memory: cannot allocate 1.00 MiB: "
                 "injected fault (FailAllocation)");
  }
  const DeviceStats after = sim.Stats();
  ExpectSameSimulatedBooks(before, after);
  EXPECT_EQ(after.failed_allocations, 1u);
  EXPECT_EQ(after.bytes_allocated, 2 * kMiB);
  EXPECT_EQ(sim.injected_faults(), 1u);

  DeviceBuffer fourth = sim.Allocate(1 * kMiB);  // one-shot: disarmed
  EXPECT_EQ(sim.bytes_allocated(), 3 * kMiB);
}

TEST(SimulatedDeviceFaultTest, RefusalForCapacityDoesNotConsumeTheFault) {
  SimulatedDevice sim(Options(2 * kMiB));
  sim.FailAllocation(1);
  try {
    sim.Allocate(4 * kMiB);  // refused by the capacity check first
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_THAT(e.what(), HasSubstr("0 B of 2.00 MiB allocated"));
  }
  EXPECT_EQ(sim.injected_faults(), 0u);
  EXPECT_THROW(sim.Allocate(1 * kMiB), DeviceError);  // now the fault fires
  EXPECT_EQ(sim.injected_faults(), 1u);
  EXPECT_EQ(sim.Stats().failed_allocations, 2u);
  EXPECT_EQ(sim.bytes_allocated(), 0u);
}

TEST(SimulatedDeviceFaultTest, AllocationsAboveASizeFailUntilCleared) {
  SimulatedDevice sim(Options());
  sim.FailAllocationsAbove(1 * kMiB);
  DeviceBuffer ok = sim.Allocate(1 * kMiB);
  for (int i = 0; i < 3; ++i) {
    try {
      sim.Allocate(1 * kMiB + 1);
      FAIL() << "allocation above the limit succeeded";
    } catch (const DeviceError& e) {
      EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
      EXPECT_THAT(e.what(),
                  HasSubstr("injected fault (FailAllocationsAbove 1.00 MiB)"));
    }
  }
  EXPECT_EQ(sim.bytes_allocated(), 1 * kMiB);
  EXPECT_EQ(sim.Stats().allocations, 1u);
  sim.FailAllocationsAbove(std::nullopt);
  DeviceBuffer big = sim.Allocate(8 * kMiB);
  EXPECT_EQ(sim.bytes_allocated(), 9 * kMiB);
  EXPECT_EQ(sim.injected_faults(), 3u);
}

TEST(SimulatedDeviceFaultTest, NextCopiesFailAndLeaveDestinationUntouched) {
  SimulatedDevice sim(Options());
  DeviceBuffer buffer = sim.Allocate(64 * kKiB);
  const std::vector<std::byte> original = Filled(64 * kKiB, 0xAB);
  sim.CopyToDevice(buffer, 0, original);
  const DeviceStats before = sim.Stats();

  sim.FailNextCopies(2);
  try {
    sim.CopyToDevice(buffer, 4 * kKiB, Filled(8 * kKiB, 0xCD));
    FAIL() << "copy succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kCopyFailed);
    EXPECT_STREQ(e.what(),
                 "device sim0: copy failed: copy of 8.00 KiB at offset 4096: "
                 "injected fault (FailNextCopies)");
  }
  std::vector<std::byte> back = Filled(64 * kKiB, 0);
  try {
    sim.CopyToHost(back, buffer, 0);
    FAIL() << "copy back succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kCopyFailed);
    EXPECT_THAT(e.what(), HasSubstr("copy back of 64.00 KiB at offset 0"));
  }
  EXPECT_EQ(back, Filled(64 * kKiB, 0)) << "a failed copy wrote to the host";
  const DeviceStats after = sim.Stats();
  ExpectSameSimulatedBooks(before, after);
  EXPECT_EQ(after.failed_copies, 2u);
  EXPECT_EQ(sim.injected_faults(), 2u);

  sim.CopyToHost(back, buffer, 0);  // the third copy works
  EXPECT_EQ(back, original) << "a failed copy wrote to the device";
}

TEST(SimulatedDeviceFaultTest, PredicatePicksWhichCopiesFail) {
  SimulatedDevice sim(Options());
  DeviceBuffer buffer = sim.Allocate(1 * kMiB);
  std::vector<CopyInfo> seen;
  sim.FailCopiesWhere([&](const CopyInfo& info) {
    seen.push_back(info);
    return info.direction == CopyDirection::kToHost && info.offset >= kKiB;
  });
  sim.CopyToDevice(buffer, 0, Filled(1 * kMiB, 5));
  std::vector<std::byte> back(kKiB);
  sim.CopyToHost(back, buffer, 0);
  try {
    sim.CopyToHost(back, buffer, kKiB);
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kCopyFailed);
    EXPECT_THAT(e.what(), HasSubstr("injected fault (FailCopiesWhere)"));
  }
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].direction, CopyDirection::kToDevice);
  EXPECT_EQ(seen[0].bytes, 1 * kMiB);
  EXPECT_EQ(seen[0].buffer_size, 1 * kMiB);
  EXPECT_EQ(seen[0].buffer_data, buffer.data());
  EXPECT_EQ(seen[0].index, 1u);
  EXPECT_EQ(seen[2].offset, kKiB);
  EXPECT_EQ(seen[2].index, 3u);
  EXPECT_EQ(sim.Stats().copies_to_host, 1u);
  EXPECT_EQ(sim.Stats().failed_copies, 1u);
  EXPECT_DOUBLE_EQ(sim.simulated_seconds(), (1.0 * kMiB + kKiB) / 1e9)
      << "a failed copy must cost no simulated time";

  sim.ClearFaults();
  sim.CopyToHost(back, buffer, kKiB);
  EXPECT_EQ(seen.size(), 3u) << "a cleared predicate still ran";
}

TEST(SimulatedDeviceFaultTest,
     OneShotFaultsAreConsumedExactlyOnceAcrossThreads) {
  constexpr int kThreads = 8;
  constexpr int kCopies = 20;
  SimulatedDevice sim(Options());
  DeviceBuffer buffer = sim.Allocate(kThreads * kKiB);
  sim.FailNextCopies(5);
  sim.FailAllocation(7);
  std::atomic<int> copy_failures{0};
  std::atomic<int> allocation_failures{0};
  std::barrier start(kThreads);
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back([&, id] {
      const std::vector<std::byte> data =
          Filled(kKiB, static_cast<unsigned char>(id));
      start.arrive_and_wait();
      for (int i = 0; i < kCopies; ++i) {
        try {
          sim.CopyToDevice(buffer, id * kKiB, data);
        } catch (const DeviceError& e) {
          EXPECT_EQ(e.device_code(), DeviceErrorCode::kCopyFailed);
          copy_failures.fetch_add(1);
        }
        try {
          DeviceBuffer scratch = sim.Allocate(kKiB);
        } catch (const DeviceError& e) {
          EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
          allocation_failures.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(copy_failures.load(), 5);
  EXPECT_EQ(allocation_failures.load(), 1);
  const DeviceStats stats = sim.Stats();
  EXPECT_EQ(stats.copies_to_device, kThreads * kCopies - 5u);
  EXPECT_EQ(stats.failed_copies, 5u);
  EXPECT_EQ(stats.failed_allocations, 1u);
  EXPECT_EQ(stats.allocations, 1u + kThreads * kCopies - 1u);
  EXPECT_EQ(stats.bytes_allocated, kThreads * kKiB);
  EXPECT_EQ(sim.injected_faults(), 6u);
}

TEST(SimulatedDeviceTest, BooksCountAllocationsInTheAllocatorsUnits) {
  SimulatedDeviceOptions options = Options(10 * kKiB);
  options.allocation_granularity = 4 * kKiB;
  SimulatedDevice sim(options);
  EXPECT_EQ(sim.allocation_granularity(), 4 * kKiB);
  EXPECT_EQ(sim.AllocationSize(0), 0u);
  EXPECT_EQ(sim.AllocationSize(1), 4 * kKiB);
  EXPECT_EQ(sim.AllocationSize(4 * kKiB), 4 * kKiB);
  EXPECT_EQ(sim.AllocationSize(4 * kKiB + 1), 8 * kKiB);
  EXPECT_EQ(sim.AllocationSize(UINT64_MAX - 1), UINT64_MAX);  // saturates

  DeviceBuffer one = sim.Allocate(1);
  EXPECT_EQ(one.size(), 1u);  // the buffer keeps the size asked for
  EXPECT_EQ(sim.bytes_allocated(), 4 * kKiB);
  const DeviceStats before = sim.Stats();
  try {
    sim.Allocate(4 * kKiB + 1);  // 8 KiB: 12 KiB of 10 KiB
    FAIL() << "the capacity check did not round";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_THAT(e.what(), HasSubstr("cannot allocate 4.00 KiB (8.00 KiB in "
                                    "units of 4.00 KiB): 4.00 KiB of 10.00 "
                                    "KiB allocated"));
  }
  ExpectSameSimulatedBooks(before, sim.Stats());
  DeviceBuffer four = sim.Allocate(4 * kKiB);
  EXPECT_EQ(sim.bytes_allocated(), 8 * kKiB);
  EXPECT_EQ(sim.Stats().high_water_bytes, 8 * kKiB);
  EXPECT_EQ(sim.Stats().allocation_granularity, 4 * kKiB);
  EXPECT_THROW(sim.Allocate(1), DeviceError);
  one.Reset();
  EXPECT_EQ(sim.bytes_allocated(), 4 * kKiB);  // exactly what was counted
  four.Reset();
  EXPECT_EQ(sim.bytes_allocated(), 0u);
  EXPECT_EQ(sim.backend_bytes(), 0u);
}

TEST(SimulatedDeviceTest, MemoryHeldByOthersMakesTheBackendRefuse) {
  SimulatedDeviceOptions options = Options(1 * kMiB);
  options.physical_bytes = 1 * kMiB;
  options.allocation_granularity = 64 * kKiB;
  SimulatedDevice sim(options);
  DeviceBuffer mine = sim.Allocate(100 * kKiB);  // 128 KiB
  EXPECT_EQ(sim.backend_bytes(), 128 * kKiB);
  sim.SetExternalBytes(768 * kKiB);  // a framework's allocator took it
  const DeviceStats before = sim.Stats();
  try {
    sim.Allocate(129 * kKiB);  // 192 KiB: the books admit it, the memory not
    FAIL() << "allocated memory others hold";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_THAT(e.what(),
                HasSubstr("128.00 KiB held by this device and 768.00 KiB by "
                          "others, of 1.00 MiB of memory"));
  }
  ExpectSameSimulatedBooks(before, sim.Stats());
  EXPECT_EQ(sim.backend_bytes(), 128 * kKiB);
  EXPECT_EQ(sim.injected_faults(), 0u);          // not a fault: a real refusal
  DeviceBuffer fits = sim.Allocate(128 * kKiB);  // exactly what is left
  EXPECT_EQ(sim.backend_bytes(), 256 * kKiB);
  EXPECT_THROW(sim.Allocate(1), DeviceError);
  sim.SetExternalBytes(0);  // given back
  DeviceBuffer more = sim.Allocate(512 * kKiB);
  EXPECT_EQ(sim.bytes_allocated(), 768 * kKiB);
  mine.Reset();
  fits.Reset();
  more.Reset();
  EXPECT_EQ(sim.backend_bytes(), 0u);
}

TEST(SimulatedDeviceFaultTest, ACorruptedContextMakesTheDeviceUnusable) {
  SimulatedDevice sim(Options());
  DeviceBuffer buffer = sim.Allocate(1 * kMiB);
  const std::vector<std::byte> data = Filled(1 * kMiB, 7);
  sim.CopyToDevice(buffer, 0, data);
  EXPECT_TRUE(sim.usable());
  sim.CorruptContext();
  auto expect_unavailable = [&](const char* what,
                                const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << what << " succeeded on a corrupted device";
    } catch (const DeviceError& e) {
      EXPECT_EQ(e.device_code(), DeviceErrorCode::kUnavailable) << what;
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << what;
      EXPECT_THAT(e.what(), HasSubstr("device sim0: unavailable: context "
                                      "corrupted: copy to device failed"))
          << what;
      EXPECT_THAT(e.what(), HasSubstr("the process must restart")) << what;
    }
  };
  const DeviceStats before = sim.Stats();
  expect_unavailable("the copy that meets it",
                     [&] { sim.CopyToDevice(buffer, 0, data); });
  EXPECT_FALSE(sim.usable());
  sim.ClearFaults();  // does not undo a corruption
  std::vector<std::byte> back(1 * kMiB);
  expect_unavailable("CopyToDevice",
                     [&] { sim.CopyToDevice(buffer, 0, data); });
  expect_unavailable("CopyToHost", [&] { sim.CopyToHost(back, buffer, 0); });
  expect_unavailable("Allocate", [&] { sim.Allocate(1); });
  expect_unavailable("Allocate(0)", [&] { sim.Allocate(0); });
  expect_unavailable("Synchronize", [&] { sim.Synchronize(); });
  EXPECT_EQ(sim.injected_faults(), 1u);
  const DeviceStats after = sim.Stats();
  ExpectSameSimulatedBooks(before, after);
  EXPECT_TRUE(after.unusable);
  EXPECT_THAT(after.unusable_reason, HasSubstr("context corrupted"));
  EXPECT_EQ(sim.unusable_reason(), after.unusable_reason);
  EXPECT_EQ(after.failed_copies, 3u);
  EXPECT_EQ(after.failed_allocations, 2u);
  buffer.Reset();  // freeing still returns the books
  EXPECT_EQ(sim.bytes_allocated(), 0u);
  EXPECT_EQ(sim.Stats().frees, 1u);
}

TEST(SimulatedDeviceFaultTest, ACorruptionMetBySynchronizeIsReportedThere) {
  SimulatedDevice sim(Options());
  sim.CorruptContext();
  try {
    sim.Synchronize();
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kUnavailable);
    EXPECT_THAT(e.what(), HasSubstr("context corrupted: synchronize failed"));
  }
  EXPECT_FALSE(sim.usable());
  EXPECT_EQ(sim.Stats().synchronizations, 0u);
}

TEST(SimulatedDeviceFaultTest, SleepOptionSpendsTheSimulatedTime) {
  // The one test that may take real time: 2 ms, opted into explicitly.
  SimulatedDevice sim(SimulatedDeviceOptions{.name = "real",
                                             .capacity_bytes = kMiB,
                                             .bandwidth_bytes_per_second = 5e8,
                                             .sleep = true});
  DeviceBuffer buffer = sim.Allocate(kMiB);
  const auto start = std::chrono::steady_clock::now();
  sim.CopyToDevice(buffer, 0, Filled(kMiB, 1));
  EXPECT_GE(std::chrono::steady_clock::now() - start,
            std::chrono::duration<double>(kMiB / 5e8));
}

}  // namespace
}  // namespace modelcache::device
