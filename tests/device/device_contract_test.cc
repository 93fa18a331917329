// The Device contract (device.h), one suite run over every backend.
//
// Each test binary that links this file defines ContractBackends() and
// MakeContractDevice(): the backends it runs the suite on (device_test: host
// and simulated; cuda_device_test: CUDA, skipped where no GPU is present).
//
// Books are in the allocator's units: every expectation about
// bytes_allocated() counts AllocationSize(size), so the suite holds for a
// granularity of one byte (host, simulated) and of 2 MiB pages (CUDA, and a
// simulated device with CUDA's granularity).
//
// Scenarios: exact books through allocate and free; byte-identical round
// trips at odd offsets and sizes; a refusal beyond capacity leaves the books
// unchanged and names the device; invalid copies change nothing; free is
// exactly once through moves, assignment, Reset and destruction; 8 threads
// allocating and freeing never push the books past capacity, and the books
// are exact at a barrier and at the end; concurrent copies into disjoint
// ranges are counted exactly.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device_test_util.h"
#include "modelcache/device/device.h"

namespace modelcache::device::testing {

// Defined by each test binary: the names of the backends to run the suite
// on, and a fresh device of one of them with `capacity_bytes`, or null with
// *skip_reason set when that backend cannot run here.
std::vector<std::string> ContractBackends();
std::unique_ptr<Device> MakeContractDevice(const std::string& backend,
                                           uint64_t capacity_bytes,
                                           std::string* skip_reason);

namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;

DeviceErrorCode CodeOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const DeviceError& e) {
    return e.device_code();
  }
  ADD_FAILURE() << "no DeviceError thrown";
  return DeviceErrorCode::kUnavailable;
}

class DeviceContractTest : public ::testing::TestWithParam<std::string> {
 protected:
  // A fresh device, or skips the test.
  std::unique_ptr<Device> Make(uint64_t capacity_bytes) {
    std::string skip_reason;
    auto device = MakeContractDevice(GetParam(), capacity_bytes, &skip_reason);
    if (device == nullptr) {
      skip_reason_ = skip_reason.empty() ? "backend unavailable" : skip_reason;
    }
    return device;
  }
  std::string skip_reason_;
};

#define MAKE_OR_SKIP(var, capacity)                 \
  std::unique_ptr<Device> var = Make(capacity);     \
  if (var == nullptr) GTEST_SKIP() << skip_reason_; \
  static_assert(true, "require a semicolon after the macro")

TEST_P(DeviceContractTest, AllocateAndFreeKeepExactBooks) {
  MAKE_OR_SKIP(device, 16 * kMiB);
  EXPECT_EQ(device->capacity_bytes(), 16 * kMiB);
  EXPECT_EQ(device->bytes_allocated(), 0u);
  const uint64_t a_books = device->AllocationSize(1 * kMiB);
  const uint64_t b_books = device->AllocationSize(3 * kMiB + 17);
  EXPECT_GE(b_books, 3 * kMiB + 17);
  {
    DeviceBuffer a = device->Allocate(1 * kMiB);
    DeviceBuffer b = device->Allocate(3 * kMiB + 17);
    ASSERT_TRUE(a);
    ASSERT_TRUE(b);
    EXPECT_EQ(a.device(), device.get());
    EXPECT_EQ(a.size(), 1 * kMiB);
    EXPECT_EQ(b.size(), 3 * kMiB + 17);
    EXPECT_NE(a.data(), b.data());
    EXPECT_EQ(device->bytes_allocated(), a_books + b_books);
    a.Reset();
    EXPECT_FALSE(a);
    EXPECT_EQ(device->bytes_allocated(), b_books);
    DeviceStats stats = device->Stats();
    EXPECT_EQ(stats.allocations, 2u);
    EXPECT_EQ(stats.frees, 1u);
    EXPECT_EQ(stats.high_water_bytes, a_books + b_books);
    EXPECT_EQ(stats.capacity_bytes, 16 * kMiB);
    EXPECT_EQ(stats.allocation_granularity, device->allocation_granularity());
  }
  DeviceStats stats = device->Stats();
  EXPECT_EQ(stats.bytes_allocated, 0u);
  EXPECT_EQ(stats.allocations, 2u);
  EXPECT_EQ(stats.frees, 2u);
  EXPECT_EQ(stats.failed_allocations, 0u);
}

TEST_P(DeviceContractTest, ZeroByteBufferIsValidAndCountsNothing) {
  MAKE_OR_SKIP(device, 1 * kMiB);
  EXPECT_EQ(device->AllocationSize(0), 0u);
  DeviceBuffer empty = device->Allocate(0);
  EXPECT_TRUE(empty);
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(device->bytes_allocated(), 0u);
  device->CopyToDevice(empty, 0, {});  // a zero-byte copy does nothing
  device->CopyToHost({}, empty, 0);
  EXPECT_EQ(device->Stats().copies_to_device, 0u);
  empty.Reset();
  EXPECT_EQ(device->Stats().frees, 1u);
}

TEST_P(DeviceContractTest, RoundTripIsByteIdentical) {
  MAKE_OR_SKIP(device, 16 * kMiB);
  const size_t size = 5 * kMiB + 3;
  const std::vector<std::byte> data = Pattern(1, size);
  DeviceBuffer buffer = device->Allocate(size);

  // In three uneven pieces, the last at an odd offset.
  const size_t cut1 = 1 * kMiB + 1;
  const size_t cut2 = 4 * kMiB + 5;
  std::span<const std::byte> all(data);
  device->CopyToDevice(buffer, 0, all.subspan(0, cut1));
  device->CopyToDevice(buffer, cut1, all.subspan(cut1, cut2 - cut1));
  device->CopyToDevice(buffer, cut2, all.subspan(cut2));
  device->Synchronize();

  std::vector<std::byte> back(size);
  device->CopyToHost(back, buffer, 0);
  EXPECT_TRUE(back == data);

  // A slice from the middle.
  std::vector<std::byte> slice(100 * kKiB + 7);
  device->CopyToHost(slice, buffer, 2 * kMiB + 9);
  EXPECT_TRUE(
      std::equal(slice.begin(), slice.end(), data.begin() + 2 * kMiB + 9));

  DeviceStats stats = device->Stats();
  EXPECT_EQ(stats.copies_to_device, 3u);
  EXPECT_EQ(stats.bytes_copied_to_device, size);
  EXPECT_EQ(stats.copies_to_host, 2u);
  EXPECT_EQ(stats.bytes_copied_to_host, size + slice.size());
  EXPECT_EQ(stats.synchronizations, 1u);
  EXPECT_EQ(stats.failed_copies, 0u);
}

TEST_P(DeviceContractTest, CopyToHostSeesEveryEarlierCopyToDevice) {
  MAKE_OR_SKIP(device, 4 * kMiB);
  DeviceBuffer buffer = device->Allocate(2 * kMiB);
  for (uint64_t round = 0; round < 4; ++round) {
    const std::vector<std::byte> data = Pattern(10 + round, 2 * kMiB);
    device->CopyToDevice(buffer, 0, data);
    std::vector<std::byte> back(2 * kMiB);
    device->CopyToHost(back, buffer, 0);  // no Synchronize in between
    EXPECT_TRUE(back == data) << "round " << round;
  }
}

TEST_P(DeviceContractTest, SourceMayBeReusedOnceCopyToDeviceReturns) {
  MAKE_OR_SKIP(device, 8 * kMiB);
  const std::vector<std::byte> data = Pattern(2, 3 * kMiB + 1);
  std::vector<std::byte> source = data;
  DeviceBuffer buffer = device->Allocate(source.size());
  device->CopyToDevice(buffer, 0, source);
  std::fill(source.begin(), source.end(), std::byte{0xEE});
  source.clear();
  source.shrink_to_fit();
  device->Synchronize();
  std::vector<std::byte> back(data.size());
  device->CopyToHost(back, buffer, 0);
  EXPECT_TRUE(back == data);
}

TEST_P(DeviceContractTest, RefusalBeyondCapacityLeavesBooksUnchanged) {
  MAKE_OR_SKIP(device, 8 * kMiB);
  DeviceBuffer half = device->Allocate(4 * kMiB);
  const DeviceStats before = device->Stats();
  try {
    device->Allocate(4 * kMiB + 1);
    FAIL() << "allocation beyond capacity succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_EQ(e.device(), device->name());
    EXPECT_THAT(e.what(), HasSubstr("device " + device->name() + ": "));
    EXPECT_THAT(e.what(), HasSubstr("out of memory"));
    EXPECT_THAT(e.what(), HasSubstr("4.00 MiB of 8.00 MiB allocated"));
  }
  const DeviceStats after = device->Stats();
  ExpectSameBooks(before, after);
  EXPECT_EQ(after.failed_allocations, before.failed_allocations + 1);

  // Exactly the rest fits; then not one byte more.
  DeviceBuffer rest = device->Allocate(4 * kMiB);
  EXPECT_EQ(device->bytes_allocated(), 8 * kMiB);
  EXPECT_EQ(CodeOf([&] { device->Allocate(1); }),
            DeviceErrorCode::kOutOfMemory);
  EXPECT_EQ(device->bytes_allocated(), 8 * kMiB);
  EXPECT_EQ(
      CodeOf([&] { device->Allocate(std::numeric_limits<uint64_t>::max()); }),
      DeviceErrorCode::kOutOfMemory);
  rest.Reset();
  half.Reset();
  EXPECT_EQ(device->bytes_allocated(), 0u);
  EXPECT_EQ(device->Stats().high_water_bytes, 8 * kMiB);
}

TEST_P(DeviceContractTest, InvalidCopiesAreRejectedAndChangeNothing) {
  MAKE_OR_SKIP(device, 4 * kMiB);
  DeviceBuffer buffer = device->Allocate(1 * kKiB);
  const std::vector<std::byte> data = Pattern(3, 1 * kKiB);
  device->CopyToDevice(buffer, 0, data);
  std::vector<std::byte> small(16);
  const DeviceStats before = device->Stats();

  std::span<const std::byte> src(data);
  auto invalid = [&](const std::function<void()>& call) {
    EXPECT_EQ(CodeOf(call), DeviceErrorCode::kInvalidArgument);
  };
  invalid([&] { device->CopyToDevice(buffer, 1, src); });  // one past the end
  invalid([&] { device->CopyToDevice(buffer, 1 * kKiB + 1, {}); });
  invalid([&] {
    device->CopyToDevice(buffer, std::numeric_limits<uint64_t>::max() - 3,
                         src.subspan(0, 16));  // offset + size overflows
  });
  invalid([&] { device->CopyToHost(small, buffer, 1 * kKiB - 15); });
  DeviceBuffer empty;
  invalid([&] { device->CopyToDevice(empty, 0, src.subspan(0, 1)); });
  invalid([&] { device->CopyToHost(small, empty, 0); });

  std::unique_ptr<Device> other = Make(4 * kMiB);
  ASSERT_NE(other, nullptr);
  DeviceBuffer foreign = other->Allocate(1 * kKiB);
  try {
    device->CopyToDevice(foreign, 0, src);
    FAIL() << "copy into another device's buffer succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("a buffer of device"));
  }

  const DeviceStats after = device->Stats();
  ExpectSameBooks(before, after);
  EXPECT_EQ(after.failed_copies, before.failed_copies);
  std::vector<std::byte> back(1 * kKiB);
  device->CopyToHost(back, buffer, 0);
  EXPECT_TRUE(back == data) << "a rejected copy wrote to the buffer";
  foreign.Reset();
}

TEST_P(DeviceContractTest, FreeIsExactlyOnceThroughMovesAndDestruction) {
  MAKE_OR_SKIP(device, 4 * kMiB);
  {
    DeviceBuffer a = device->Allocate(1 * kKiB);
    void* data = a.data();
    DeviceBuffer b(std::move(a));  // move construction
    EXPECT_FALSE(a);               // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(a.size(), 0u);       // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(b.data(), data);
    EXPECT_EQ(device->Stats().frees, 0u);

    DeviceBuffer c = device->Allocate(2 * kKiB);
    c = std::move(b);  // frees c's own 2 KiB, once
    EXPECT_EQ(device->Stats().frees, 1u);
    EXPECT_EQ(device->bytes_allocated(), device->AllocationSize(1 * kKiB));
    EXPECT_EQ(c.data(), data);

    DeviceBuffer& alias = c;
    c = std::move(alias);  // self-move keeps the buffer
    EXPECT_TRUE(c);
    EXPECT_EQ(device->Stats().frees, 1u);

    c.Reset();
    c.Reset();  // already empty: nothing more
    EXPECT_EQ(device->Stats().frees, 2u);

    DeviceBuffer d = device->Allocate(3 * kKiB);
    DeviceBuffer e;
    e = std::move(d);  // into an empty buffer: frees nothing
    EXPECT_EQ(device->Stats().frees, 2u);
    // a, b, d empty; e is freed at scope exit.
  }
  const DeviceStats stats = device->Stats();
  EXPECT_EQ(stats.allocations, 3u);
  EXPECT_EQ(stats.frees, 3u);
  EXPECT_EQ(stats.bytes_allocated, 0u);
}

TEST_P(DeviceContractTest, ConcurrentAllocationsNeverExceedCapacity) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 150;
  constexpr uint64_t kCapacity = 4 * kMiB;
  MAKE_OR_SKIP(device, kCapacity);

  std::atomic<uint64_t> attempts{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<bool> over_capacity{false};
  std::atomic<uint64_t> held_at_barrier{0};
  std::atomic<uint64_t> seen_at_barrier{0};
  std::barrier start(kThreads);
  std::barrier middle(kThreads, [&]() noexcept {
    // Every thread is parked here holding its buffers: the books must be
    // exactly what they hold.
    seen_at_barrier = device->bytes_allocated();
  });

  auto worker = [&](int id) {
    std::vector<DeviceBuffer> held;
    uint64_t x = 0x2545F4914F6CDD1Dull * static_cast<uint64_t>(id + 1);
    auto next = [&] {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    auto check = [&] {
      if (device->bytes_allocated() > kCapacity) over_capacity = true;
    };
    auto churn = [&](int rounds) {
      for (int i = 0; i < rounds; ++i) {
        // 1 KiB .. 384 KiB: 8 threads can want far more than the capacity.
        const uint64_t size = (next() % 384 + 1) * kKiB;
        attempts.fetch_add(1);
        try {
          held.push_back(device->Allocate(size));
        } catch (const DeviceError& e) {
          EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
          refused.fetch_add(1);
          if (!held.empty()) held.erase(held.begin());  // make room
        }
        check();
        if (held.size() > 4 || next() % 3 == 0) {
          if (!held.empty()) held.erase(held.begin() + next() % held.size());
        }
        check();
      }
    };
    start.arrive_and_wait();
    churn(kRounds);
    uint64_t mine = 0;
    for (const DeviceBuffer& b : held) mine += device->AllocationSize(b.size());
    held_at_barrier.fetch_add(mine);
    middle.arrive_and_wait();
    churn(kRounds);
    held.clear();
    check();
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();

  EXPECT_FALSE(over_capacity.load());
  EXPECT_EQ(seen_at_barrier.load(), held_at_barrier.load());
  const DeviceStats stats = device->Stats();
  EXPECT_EQ(stats.bytes_allocated, 0u);
  EXPECT_EQ(stats.allocations, stats.frees);
  EXPECT_EQ(stats.allocations + stats.failed_allocations, attempts.load());
  EXPECT_EQ(stats.failed_allocations, refused.load());
  EXPECT_LE(stats.high_water_bytes, kCapacity);
  EXPECT_GT(stats.failed_allocations, 0u) << "the test never hit capacity";
}

TEST_P(DeviceContractTest, ConcurrentCopiesIntoDisjointRangesAreExact) {
  constexpr int kThreads = 8;
  constexpr uint64_t kSlice = 256 * kKiB + 3;
  MAKE_OR_SKIP(device, 8 * kMiB);
  DeviceBuffer buffer = device->Allocate(kThreads * kSlice);
  std::barrier start(kThreads);
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back([&, id] {
      const std::vector<std::byte> data = Pattern(100 + id, kSlice);
      start.arrive_and_wait();
      for (int round = 0; round < 4; ++round) {
        device->CopyToDevice(buffer, id * kSlice, data);
        std::vector<std::byte> back(kSlice);
        device->CopyToHost(back, buffer, id * kSlice);
        EXPECT_TRUE(back == data) << "thread " << id << " round " << round;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  device->Synchronize();
  const DeviceStats stats = device->Stats();
  EXPECT_EQ(stats.copies_to_device, kThreads * 4u);
  EXPECT_EQ(stats.copies_to_host, kThreads * 4u);
  EXPECT_EQ(stats.bytes_copied_to_device, kThreads * 4 * kSlice);
  EXPECT_EQ(stats.bytes_copied_to_host, kThreads * 4 * kSlice);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceContractTest,
                         ::testing::ValuesIn(ContractBackends()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace modelcache::device::testing
