// The multi-device runtime on simulated devices: one host copy shared by
// every device (InvokeAI's multi-GPU scenarios), partial placement, patch
// scopes, failures that leave the books unchanged, and a stress run across
// two devices. What a first run on a GPU would hit, modelled on simulated
// devices: tensors 256-byte aligned after odd sizes, across files and after
// a tensor left on the host, with the padding in the books; placements
// counted in the allocator's units in both books; an allocator out of memory
// (others hold the GPU's memory) made up by evicting unleased models; a
// corrupted device failing every placement at once.
#include "modelcache/runtime/runtime.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <latch>
#include <random>
#include <thread>

#include "../test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/device/simulated_device.h"
#include "modelcache/weights/safetensors_writer.h"

namespace modelcache::runtime {
namespace {

namespace fs = std::filesystem;
using device::SimulatedDevice;
using device::SimulatedDeviceOptions;
using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;

class RuntimeTest : public ::testing::Test {
 protected:
  // A model file of `tensors` F32 tensors of `kib_each` KiB.
  std::string MakeModel(const std::string& name, int tensors,
                        uint64_t kib_each) {
    const std::string path = (dir_.path() / (name + ".safetensors")).string();
    weights::SafetensorsWriter writer;
    for (int i = 0; i < tensors; ++i) {
      writer.AddTensor(name + ".t" + std::to_string(i), weights::Dtype::kF32,
                       {kib_each * kKiB / 4}, weights::PatternFill(i));
    }
    writer.Write(path);
    return path;
  }

  static std::unique_ptr<SimulatedDevice> Sim(const std::string& name,
                                              uint64_t capacity) {
    SimulatedDeviceOptions options;
    options.name = name;
    options.capacity_bytes = capacity;
    options.bandwidth_bytes_per_second = 1e9;
    return std::make_unique<SimulatedDevice>(options);
  }

  struct Tensor {
    std::string name;
    weights::Dtype dtype;
    uint64_t elements;
  };
  // A model file of the given tensors.
  std::string MakeFile(const std::string& name,
                       const std::vector<Tensor>& tensors) {
    const std::string path = (dir_.path() / (name + ".safetensors")).string();
    weights::SafetensorsWriter writer;
    uint64_t seed = 1;
    for (const Tensor& t : tensors) {
      writer.AddTensor(t.name, t.dtype, {t.elements},
                       weights::PatternFill(seed++));
    }
    writer.Write(path);
    return path;
  }

  modelcache::testing::TestDirectory dir_{"modelcache_runtime"};
};

// The layout the header promises: the placed tensors, in file order, each at
// the first multiple of 256 at or after the end of the one before; returns
// where the last one ends.
uint64_t ExpectPackedAt256(const DeviceModel& model) {
  uint64_t end = 0;
  for (const PlacedTensor& t : model.tensors()) {
    if (!t.on_device || t.info->bytes() == 0) continue;
    const uint64_t expected = (end + 255) / 256 * 256;
    EXPECT_EQ(t.device_offset, expected) << t.info->name;
    const auto address =
        reinterpret_cast<uintptr_t>(model.buffer().data()) + t.device_offset;
    EXPECT_EQ(address % 256, 0u) << t.info->name;
    end = t.device_offset + t.info->bytes();
  }
  return end;
}

// Device bytes hold exactly the host bytes of the placed tensors.
void ExpectDeviceBytesMatchHost(const DeviceModel& model) {
  for (const PlacedTensor& t : model.tensors()) {
    if (!t.on_device) continue;
    std::vector<std::byte> back(t.host.size());
    model.device().CopyToHost(back, model.buffer(), t.device_offset);
    EXPECT_TRUE(std::equal(back.begin(), back.end(), t.host.begin()))
        << t.info->name;
  }
}

TEST_F(RuntimeTest, TwoDeviceCachesShareOneHostCopyFreedOnlyWhenTheLastLetsGo) {
  const std::string file = MakeModel("sdxl", 4, 16);  // 64 KiB
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu0 = Sim("gpu0", 1 << 20), gpu1 = Sim("gpu1", 1 << 20);
  DeviceCache cache0(host, *gpu0), cache1(host, *gpu1);
  ModelLease on0 = cache0.Acquire("sdxl", {file});
  ModelLease on1 = cache1.Acquire("sdxl", {file});
  EXPECT_EQ(host.Stats().loads, 1u);
  EXPECT_EQ(host.budget().used(), 64 * kKiB);  // counted once
  EXPECT_EQ(gpu0->bytes_allocated(), 64 * kKiB);
  EXPECT_EQ(gpu1->bytes_allocated(), 64 * kKiB);
  ExpectDeviceBytesMatchHost(on0.model());
  ExpectDeviceBytesMatchHost(on1.model());

  on0.Release();
  cache0.cache().Prune();  // gpu0 lets go of the model
  EXPECT_EQ(gpu0->bytes_allocated(), 0u);
  EXPECT_EQ(host.Prune(), 0u);  // gpu1 still holds the host copy
  on1.Release();
  cache1.cache().Prune();
  EXPECT_EQ(host.Prune(), 1u);
  EXPECT_EQ(host.budget().used(), 0u);
}

TEST_F(RuntimeTest, DestroyingADeviceCacheWithoutShutdownReturnsEveryHostByte) {
  const std::string a = MakeModel("a", 2, 16), b = MakeModel("b", 2, 8);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 1 << 20);
  {
    DeviceCache cache(host, *gpu);
    cache.Acquire("a", {a});
    cache.Acquire("b", {b});
    EXPECT_EQ(gpu->bytes_allocated(), 48 * kKiB);
  }  // no shutdown call
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
  for (const EntryInfo& e : host.cache().Entries()) EXPECT_EQ(e.leases, 0);
  EXPECT_EQ(host.Prune(), 2u);
  EXPECT_EQ(host.budget().used(), 0u);
}

TEST_F(RuntimeTest, EvictionThenLaterReleaseIsExactlyOnce) {
  const std::string a = MakeModel("a", 1, 32), b = MakeModel("b", 1, 32);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 48 * kKiB);  // room for one model
  DeviceCache cache(host, *gpu);
  ModelLease first = cache.Acquire("a", {a});
  first.Release();
  ModelLease second = cache.Acquire("b", {b});  // evicts a
  EXPECT_FALSE(cache.cache().Entry("a").has_value());
  first.Release();  // released already: nothing happens
  EXPECT_EQ(gpu->bytes_allocated(), 32 * kKiB);
  EXPECT_EQ(cache.cache().CheckInvariants(), cache.cache().budget().used());
  // a's host copy is unreferenced now, b's is held by its placement.
  EXPECT_EQ(host.Prune(), 1u);
  EXPECT_EQ(host.budget().used(), 32 * kKiB);
}

TEST_F(RuntimeTest, ARetiredPlacementIsFreedByItsLastHolder) {
  const std::string a = MakeModel("a", 2, 16);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 1 << 20);
  DeviceCache cache(host, *gpu);
  ModelLease old_lease = cache.Acquire("a", {a});
  EXPECT_EQ(cache.cache().Invalidate("a"), RemoveOutcome::kRetired);
  ModelLease new_lease = cache.Acquire("a", {a});
  EXPECT_NE(&old_lease.model(), &new_lease.model());
  EXPECT_EQ(gpu->bytes_allocated(), 64 * kKiB);  // both placed
  old_lease.Release();
  EXPECT_EQ(gpu->bytes_allocated(), 32 * kKiB);
  EXPECT_EQ(host.Stats().loads, 1u);  // the host copy was shared throughout
}

TEST_F(RuntimeTest, PartialPlacementAtSixtyPercentThenFullWhenRoomAppears) {
  const std::string big = MakeModel("big", 10, 10);     // 100 KiB
  const std::string other = MakeModel("other", 4, 10);  // 40 KiB
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 100 * kKiB);
  DeviceCache cache(host, *gpu);
  ModelLease held = cache.Acquire("other", {other});  // 40 KiB leased
  // Only 60 KiB can be had: 60% of the model goes to the device.
  ModelLease partial = cache.Acquire("big", {big}, Placement::kPartial);
  EXPECT_GT(partial->bytes_on_device(), 0u);
  EXPECT_LT(partial->bytes_on_device(), partial->total_bytes());
  EXPECT_EQ(partial->bytes_on_device(), 60 * kKiB);
  EXPECT_FALSE(partial->full());
  size_t on_device = 0;
  for (const PlacedTensor& t : partial->tensors()) on_device += t.on_device;
  EXPECT_EQ(on_device, 6u);
  ExpectDeviceBytesMatchHost(partial.model());
  // A full placement is refused while "other" is leased.
  try {
    cache.Acquire("big", {big}, Placement::kFull);
    FAIL() << "expected no room";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCapacity);
  }
  // Room appears: the next acquire places it fully (evicting "other").
  held.Release();
  partial.Release();
  ModelLease full = cache.Acquire("big", {big}, Placement::kPartial);
  EXPECT_TRUE(full->full());
  EXPECT_EQ(gpu->bytes_allocated(), 100 * kKiB);
  EXPECT_FALSE(cache.cache().Entry("other").has_value());
}

TEST_F(RuntimeTest, FailedFullPlacementKeepsThePartialCopyItMeantToReplace) {
  const std::string big = MakeModel("big", 10, 10);     // 100 KiB
  const std::string other = MakeModel("other", 4, 10);  // 40 KiB
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 100 * kKiB);
  DeviceCache cache(host, *gpu);
  ModelLease held = cache.Acquire("other", {other});           // 40 KiB leased
  cache.Acquire("big", {big}, Placement::kPartial).Release();  // 60 KiB, idle
  const device::DeviceStats before = gpu->Stats();
  const uint64_t host_before = host.budget().used();
  ASSERT_EQ(before.bytes_allocated, 100 * kKiB);

  // The full copy cannot be had while "other" is leased. The partial copy is
  // idle, but giving it up would not make room for the full one: it stays.
  try {
    cache.Acquire("big", {big}, Placement::kFull);
    FAIL() << "expected no room";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCapacity) << e.what();
  }
  const auto entry = cache.cache().Entry("big");
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->state, EntryState::kResident);
  EXPECT_EQ(entry->bytes, 60 * kKiB);
  const device::DeviceStats after = gpu->Stats();
  EXPECT_EQ(after.bytes_allocated, before.bytes_allocated);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.frees, before.frees);
  EXPECT_EQ(after.bytes_copied_to_device, before.bytes_copied_to_device);
  EXPECT_EQ(host.budget().used(), host_before);
  EXPECT_EQ(cache.cache().CheckInvariants(), cache.cache().budget().used());

  // The partial copy is still served, without copying anything again.
  ModelLease partial = cache.Acquire("big", {big}, Placement::kPartial);
  EXPECT_EQ(partial->bytes_on_device(), 60 * kKiB);
  EXPECT_EQ(gpu->Stats().bytes_copied_to_device, before.bytes_copied_to_device);
  partial.Release();

  // A full placement larger than the device is refused the same way.
  auto small_gpu = Sim("gpu1", 80 * kKiB);
  DeviceCache small(host, *small_gpu);
  small.Acquire("big", {big}, Placement::kPartial).Release();  // 80 KiB
  try {
    small.Acquire("big", {big}, Placement::kFull);
    FAIL() << "expected too large";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTooLarge) << e.what();
  }
  ASSERT_TRUE(small.cache().Entry("big").has_value());
  EXPECT_EQ(small_gpu->bytes_allocated(), 80 * kKiB);

  // Once room appears, the full placement replaces the partial one.
  held.Release();
  ModelLease full = cache.Acquire("big", {big}, Placement::kFull);
  EXPECT_TRUE(full->full());
  EXPECT_EQ(gpu->bytes_allocated(), 100 * kKiB);
}

TEST_F(RuntimeTest, PartialPlacementPrefersAFullOneWhenEvictionCanMakeRoom) {
  const std::string big = MakeModel("big", 10, 10);
  const std::string other = MakeModel("other", 4, 10);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 100 * kKiB);
  DeviceCache cache(host, *gpu);
  cache.Acquire("other", {other});  // resident but unleased
  ModelLease lease = cache.Acquire("big", {big}, Placement::kPartial);
  EXPECT_TRUE(lease->full());
  EXPECT_FALSE(cache.cache().Entry("other").has_value());
}

TEST_F(RuntimeTest, ConcurrentAcquiresOnTwoDevicesReadTheFileOnce) {
  const std::string file = MakeModel("m", 8, 64);
  for (int round = 0; round < 10; ++round) {
    weights::HostWeightStore host({.capacity_bytes = 1 << 22});
    auto gpu0 = Sim("gpu0", 1 << 22), gpu1 = Sim("gpu1", 1 << 22);
    DeviceCache cache0(host, *gpu0), cache1(host, *gpu1);
    std::latch start(2);
    std::thread t0([&] {
      start.arrive_and_wait();
      EXPECT_TRUE(cache0.Acquire("m", {file}));
    });
    std::thread t1([&] {
      start.arrive_and_wait();
      EXPECT_TRUE(cache1.Acquire("m", {file}));
    });
    t0.join();
    t1.join();
    EXPECT_EQ(host.Stats().loads, 1u);
    EXPECT_EQ(host.Stats().bytes_loaded, 512 * kKiB);
  }
}

TEST_F(RuntimeTest, AModelInUseOnOneDeviceIsNeverEvictedFromTheHostBeneathIt) {
  const std::string a = MakeModel("a", 1, 64), b = MakeModel("b", 1, 64);
  weights::HostWeightStore host({.capacity_bytes = 100 * kKiB});  // one copy
  auto gpu0 = Sim("gpu0", 1 << 20), gpu1 = Sim("gpu1", 1 << 20);
  DeviceCache cache0(host, *gpu0), cache1(host, *gpu1);
  ModelLease in_use = cache0.Acquire("a", {a});
  try {
    cache1.Acquire("b", {b});
    FAIL() << "expected no host room";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kCapacity);
    EXPECT_THAT(e.what(), HasSubstr("1 lease"));
  }
  ExpectDeviceBytesMatchHost(in_use.model());  // its host copy is intact
  EXPECT_EQ(gpu1->bytes_allocated(), 0u);
}

TEST_F(RuntimeTest, FailedAllocationOrCopyLeavesTheBooksUnchanged) {
  const std::string a = MakeModel("a", 4, 16);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 1 << 20);
  DeviceCache cache(host, *gpu);
  gpu->FailAllocation(1);
  EXPECT_THROW(cache.Acquire("a", {a}), device::DeviceError);
  gpu->FailNextCopies(1);
  try {
    cache.Acquire("a", {a});
    FAIL() << "expected a copy failure";
  } catch (const device::DeviceError& e) {
    EXPECT_EQ(e.device_code(), device::DeviceErrorCode::kCopyFailed);
    EXPECT_THAT(e.what(), HasSubstr("gpu0"));
  }
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
  EXPECT_EQ(cache.cache().budget().used(), 0u);
  EXPECT_FALSE(cache.cache().Entry("a").has_value());
  EXPECT_EQ(cache.cache().Stats().load_failures, 2u);
  // The host copy is unreferenced, not leaked.
  EXPECT_EQ(host.Prune(), 1u);
  // And the next attempt works.
  EXPECT_TRUE(cache.Acquire("a", {a}));
}

TEST_F(RuntimeTest, TensorsAreAlignedTo256BytesAndThePaddingIsInTheBooks) {
  using weights::Dtype;
  const std::string first = MakeFile("first", {{"a", Dtype::kU8, 1},
                                               {"b", Dtype::kU8, 300},
                                               {"c", Dtype::kF16, 3},
                                               {"d", Dtype::kBool, 7}});
  const std::string second =
      MakeFile("second", {{"e", Dtype::kU8, 1001}, {"f", Dtype::kF32, 5}});
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 1 << 20);
  DeviceCache cache(host, *gpu);
  ModelLease lease = cache.Acquire("m", {first, second});
  ASSERT_TRUE(lease->full());
  const uint64_t end = ExpectPackedAt256(lease.model());
  EXPECT_GT(end, 5 * 256u);  // six tensors, each at its own multiple of 256
  EXPECT_EQ(lease->bytes_on_device(), 1 + 300 + 6 + 7 + 1001 + 20u);
  EXPECT_EQ(lease->bytes_on_device(), lease->total_bytes());
  EXPECT_EQ(lease.model().buffer().size(), end);
  EXPECT_EQ(lease->device_bytes(), end);
  EXPECT_EQ(gpu->bytes_allocated(), end);
  EXPECT_EQ(cache.cache().Entry("m")->bytes, end);
  EXPECT_EQ(cache.cache().budget().used(), end);
  ExpectDeviceBytesMatchHost(lease.model());
}

TEST_F(RuntimeTest, ATensorAfterOneLeftOnTheHostIsAlignedToo) {
  using weights::Dtype;
  const std::string file = MakeFile("m", {{"t0", Dtype::kU8, 100},
                                          {"t1", Dtype::kU8, 5000},
                                          {"t2", Dtype::kU8, 10},
                                          {"t3", Dtype::kU8, 3}});
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 1000);
  DeviceCache cache(host, *gpu);
  ModelLease lease = cache.Acquire("m", {file}, Placement::kPartial);
  EXPECT_FALSE(lease->full());
  std::vector<std::string> on_device;
  for (const PlacedTensor& t : lease->tensors()) {
    if (t.on_device) on_device.push_back(t.info->name);
  }
  EXPECT_EQ(on_device, (std::vector<std::string>{"t0", "t2", "t3"}));
  EXPECT_EQ(ExpectPackedAt256(lease.model()),
            512 + 3u);  // t2 at 256, t3 at 512
  EXPECT_EQ(lease->bytes_on_device(), 113u);
  EXPECT_EQ(gpu->bytes_allocated(), 515u);
  EXPECT_EQ(cache.cache().Entry("m")->bytes, 515u);
  ExpectDeviceBytesMatchHost(lease.model());
}

TEST_F(RuntimeTest, PlacementsAreCountedInTheAllocatorsUnitsInBothBooks) {
  using weights::Dtype;
  // 8 KiB + 1 of tensors: 12 KiB in 4 KiB units.
  const std::string file =
      MakeFile("m", {{"w", Dtype::kU8, 8 * kKiB}, {"b", Dtype::kU8, 1}});
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  SimulatedDeviceOptions options;
  options.name = "gpu0";
  options.capacity_bytes = 32 * kKiB;
  options.allocation_granularity = 4 * kKiB;
  SimulatedDevice gpu(options);
  DeviceCache cache(host, gpu);
  ModelLease a = cache.Acquire("a", {file});
  EXPECT_EQ(a->device_bytes(), 12 * kKiB);
  EXPECT_EQ(cache.cache().Entry("a")->bytes, 12 * kKiB);
  EXPECT_EQ(gpu.bytes_allocated(), 12 * kKiB);
  cache.Acquire("b", {file}).Release();
  a.Release();
  // A third does not fit beside two (36 KiB of 32): the budget evicts one,
  // as the device's books require, instead of the device refusing.
  ModelLease c = cache.Acquire("c", {file});
  EXPECT_EQ(cache.cache().Stats().evictions, 1u);
  EXPECT_EQ(gpu.Stats().failed_allocations, 0u);
  EXPECT_EQ(gpu.bytes_allocated(), 24 * kKiB);
  EXPECT_EQ(cache.cache().budget().used(), gpu.bytes_allocated());
  // Partial placement asks only for what whole units can hold: 32 KiB less
  // c's 12 KiB leave 20 KiB; x and y, 16 KiB and 4 KiB + 1, would need 24.
  const std::string big = MakeFile(
      "big", {{"x", Dtype::kU8, 16 * kKiB}, {"y", Dtype::kU8, 4 * kKiB + 1}});
  ModelLease partial = cache.Acquire("big", {big}, Placement::kPartial);
  EXPECT_FALSE(partial->full());
  EXPECT_EQ(partial->bytes_on_device(), 16 * kKiB);
  EXPECT_EQ(partial->device_bytes(), 16 * kKiB);
  EXPECT_EQ(cache.cache().budget().used(), gpu.bytes_allocated());
  EXPECT_EQ(cache.cache().CheckInvariants(), cache.cache().budget().used());
}

TEST_F(RuntimeTest, DeviceOutOfMemoryEvictsUnleasedModelsAndRetries) {
  const std::string a = MakeModel("a", 1, 256), b = MakeModel("b", 1, 256),
                    c = MakeModel("c", 1, 256);
  weights::HostWeightStore host({.capacity_bytes = 4 << 20});
  SimulatedDeviceOptions options;
  options.name = "gpu0";
  options.capacity_bytes = 1024 * kKiB;
  options.physical_bytes = 1024 * kKiB;
  SimulatedDevice gpu(options);
  DeviceCache cache(host, gpu);
  cache.Acquire("a", {a}).Release();
  cache.Acquire("b", {b}).Release();
  // Another library takes 400 KiB: the budget still has 512 KiB free, the
  // device only 112 KiB.
  gpu.SetExternalBytes(400 * kKiB);
  ModelLease lease = cache.Acquire("c", {c});
  EXPECT_FALSE(cache.cache().Entry("a").has_value());  // the LRU victim
  EXPECT_TRUE(cache.cache().Entry("b").has_value());
  EXPECT_EQ(cache.cache().Stats().evictions, 1u);
  EXPECT_EQ(gpu.Stats().failed_allocations, 1u);  // the one that was retried
  EXPECT_EQ(gpu.bytes_allocated(), 512 * kKiB);
  EXPECT_EQ(cache.cache().budget().used(), 512 * kKiB);
  ExpectDeviceBytesMatchHost(lease.model());
}

TEST_F(RuntimeTest, DeviceOutOfMemoryWithEveryModelLeasedFailsAndKeepsBooks) {
  const std::string a = MakeModel("a", 1, 256), b = MakeModel("b", 1, 256),
                    c = MakeModel("c", 1, 256);
  weights::HostWeightStore host({.capacity_bytes = 4 << 20});
  SimulatedDeviceOptions options;
  options.name = "gpu0";
  options.capacity_bytes = 1024 * kKiB;
  options.physical_bytes = 1024 * kKiB;
  SimulatedDevice gpu(options);
  DeviceCache cache(host, gpu);
  ModelLease held_a = cache.Acquire("a", {a});
  ModelLease held_b = cache.Acquire("b", {b});
  cache.cache().Pin("b");
  held_b.Release();  // pinned: not evictable either
  gpu.SetExternalBytes(400 * kKiB);
  const device::DeviceStats before = gpu.Stats();
  try {
    cache.Acquire("c", {c});
    FAIL() << "placed beyond the device's memory";
  } catch (const device::DeviceError& e) {
    EXPECT_EQ(e.device_code(), device::DeviceErrorCode::kOutOfMemory);
    EXPECT_THAT(e.what(), HasSubstr("by others"));
  }
  EXPECT_EQ(gpu.bytes_allocated(), before.bytes_allocated);
  EXPECT_EQ(cache.cache().budget().used(), 512 * kKiB);
  EXPECT_FALSE(cache.cache().Entry("c").has_value());
  EXPECT_EQ(cache.cache().Stats().evictions, 0u);
  EXPECT_EQ(cache.cache().CheckInvariants(), cache.cache().budget().used());
  // Room again: the same placement works.
  gpu.SetExternalBytes(0);
  EXPECT_TRUE(cache.Acquire("c", {c}));
}

TEST_F(RuntimeTest, AnUnusableDeviceFailsEveryPlacementAtOnce) {
  const std::string a = MakeModel("a", 2, 16), b = MakeModel("b", 2, 16);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 1 << 20);
  DeviceCache cache(host, *gpu);
  ModelLease resident = cache.Acquire("a", {a});
  gpu->CorruptContext();  // as another library's faulty kernel would
  for (int attempt = 0; attempt < 3; ++attempt) {
    try {
      cache.Acquire("b", {b});
      FAIL() << "placed on a corrupted device";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
      EXPECT_THAT(e.what(), HasSubstr("context corrupted"));
    }
  }
  EXPECT_EQ(gpu->injected_faults(), 1u);  // later attempts never reached it
  EXPECT_TRUE(gpu->Stats().unusable);
  EXPECT_FALSE(cache.cache().Entry("b").has_value());
  EXPECT_EQ(cache.cache().Stats().load_failures, 3u);
  EXPECT_EQ(gpu->bytes_allocated(), 32 * kKiB);  // only "a"
  EXPECT_EQ(cache.cache().budget().used(), 32 * kKiB);
  resident.Release();
  cache.cache().Prune();  // freeing still works
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
}

TEST_F(RuntimeTest, WorkingReserveIsKeptFree) {
  const std::string a = MakeModel("a", 1, 64);
  weights::HostWeightStore host({.capacity_bytes = 1 << 20});
  auto gpu = Sim("gpu0", 100 * kKiB);
  DeviceCache cache(host, *gpu, {.working_reserve_bytes = 50 * kKiB});
  try {
    cache.Acquire("a", {a});
    FAIL() << "64 KiB cannot fit in 100 KiB less a 50 KiB reserve";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTooLarge);
  }
}

class RuntimeWithRegistryTest : public RuntimeTest {
 protected:
  std::string WriteRegistry(const std::string& json) {
    const std::string path = (dir_.path() / "models.json").string();
    std::ofstream(path) << json;
    return path;
  }
};

TEST_F(RuntimeWithRegistryTest,
       RegistryFromJsonResolvesAliasesAndRelativeFiles) {
  MakeModel("base", 2, 8);
  MakeModel("lora", 1, 4);
  const std::string path = WriteRegistry(R"({"models": [
      {"id": "base", "files": ["base.safetensors"], "aliases": ["latest"]},
      {"id": "lora", "files": ["lora.safetensors"], "pinned": true, "size_bytes": 4096}]})");
  ModelRegistry registry = ModelRegistry::FromJsonFile(path);
  ASSERT_NE(registry.Find("latest"), nullptr);
  EXPECT_EQ(registry.Find("latest")->id, "base");
  EXPECT_EQ(registry.Find("lora")->files[0],
            (dir_.path() / "lora.safetensors").string());
  EXPECT_TRUE(registry.Find("lora")->pinned);

  auto gpu = Sim("gpu0", 1 << 20);
  ModelRuntime runtime(std::move(registry), {.host_capacity_bytes = 1 << 20,
                                             .devices = {{gpu.get(), {}}}});
  ModelLease lease = runtime.Acquire("latest", 0);
  EXPECT_EQ(lease->id(), "base");
  runtime.Acquire("lora", 0);
  EXPECT_TRUE(runtime.device_cache(0).cache().Entry("lora")->pinned);
  try {
    runtime.Acquire("nope", 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  }
  EXPECT_THROW(runtime.Acquire("base", 3), Error);
}

TEST_F(RuntimeWithRegistryTest, BadRegistriesAreClearErrors) {
  auto error_of = [&](const std::string& json) {
    try {
      ModelRegistry::FromJsonFile(WriteRegistry(json));
    } catch (const RegistryError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error_of("{\"models\": [{\"id\": \"a\", \"files\": [\"x\"], "
                       "\"colour\": 1}]}"),
              HasSubstr("models[0]: unknown key 'colour'"));
  EXPECT_THAT(
      error_of("{\"models\": [{\"id\": \"a\", \"files\": [\"x\"]}, "
               "{\"id\": \"b\", \"files\": [\"y\"], \"aliases\": [\"a\"]}]}"),
      HasSubstr("the name 'a' is already taken by model 'a'"));
  EXPECT_THAT(error_of("{\"models\": [{\"id\": \"a\"}]}"),
              HasSubstr("model 'a' has no weight files"));
  EXPECT_THAT(error_of("{\"models\": [{\"id\": \"a\", \"files\": \"x\"}]}"),
              HasSubstr("models[0].files has the wrong type"));
  EXPECT_THAT(error_of("{\"modelz\": []}"), HasSubstr("unknown key 'modelz'"));
  EXPECT_THAT(error_of("{\"models\": ["), HasSubstr("not valid JSON"));
}

TEST_F(RuntimeWithRegistryTest, PatchScopeHoldsItsPatchesForItsRegionOnly) {
  MakeModel("base", 1, 40);
  MakeModel("lora-a", 1, 20);
  MakeModel("lora-b", 1, 20);
  MakeModel("other", 1, 40);
  ModelRegistry registry =
      ModelRegistry::FromJsonFile(WriteRegistry(R"({"models": [
      {"id": "base", "files": ["base.safetensors"]},
      {"id": "lora-a", "files": ["lora-a.safetensors"]},
      {"id": "lora-b", "files": ["lora-b.safetensors"]},
      {"id": "other", "files": ["other.safetensors"]}]})"));
  auto gpu = Sim("gpu0", 100 * kKiB);
  ModelRuntime runtime(std::move(registry), {.host_capacity_bytes = 1 << 20,
                                             .devices = {{gpu.get(), {}}}});
  ModelLease base = runtime.Acquire("base", 0);
  {
    PatchScope scope(runtime, 0, {"lora-a", "lora-b"});
    EXPECT_EQ(scope.patches().size(), 2u);
    EXPECT_EQ(runtime.device_cache(0).cache().Entry("lora-a")->leases, 1);
    // Nothing can make room for "other" while the patches are applied.
    try {
      runtime.Acquire("other", 0);
      FAIL() << "a patch was evicted while applied";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kCapacity);
      EXPECT_THAT(e.what(), HasSubstr("'lora-a'"));
    }
  }
  EXPECT_EQ(runtime.device_cache(0).cache().Entry("lora-a")->leases, 0);
  base.Release();
  EXPECT_TRUE(runtime.Acquire("other", 0));  // patches evictable again
}

TEST_F(RuntimeWithRegistryTest, PatchScopeTakesAllOrNothing) {
  MakeModel("lora-a", 1, 20);
  ModelRegistry registry =
      ModelRegistry::FromJsonFile(WriteRegistry(R"({"models": [
      {"id": "lora-a", "files": ["lora-a.safetensors"]},
      {"id": "broken", "files": ["missing.safetensors"]}]})"));
  auto gpu = Sim("gpu0", 100 * kKiB);
  ModelRuntime runtime(std::move(registry), {.host_capacity_bytes = 1 << 20,
                                             .devices = {{gpu.get(), {}}}});
  EXPECT_THROW(PatchScope(runtime, 0, {"lora-a", "broken"}), weights::IoError);
  EXPECT_EQ(runtime.device_cache(0).cache().Entry("lora-a")->leases, 0);
}

TEST_F(RuntimeTest, StressAcrossTwoDevicesKeepsEveryBookExact) {
  std::vector<std::string> files;
  for (int i = 0; i < 6; ++i) {
    files.push_back(MakeModel("m" + std::to_string(i), 2, 8 * (1 + i % 3)));
  }
  weights::HostWeightStore host({.capacity_bytes = 160 * kKiB});
  auto gpu0 = Sim("gpu0", 96 * kKiB), gpu1 = Sim("gpu1", 96 * kKiB);
  DeviceCache caches[2] = {DeviceCache(host, *gpu0), DeviceCache(host, *gpu1)};
  std::atomic<int> unexpected{0};
  modelcache::testing::KeptErrors kept;  // declared before the threads
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<ModelLease> held;
      for (int i = 0; i < 150; ++i) {
        const int m = static_cast<int>(rng() % files.size());
        DeviceCache& cache = caches[rng() % 2];
        if (rng() % 4 == 0) gpu0->FailNextCopies(rng() % 2);
        try {
          AcquireOptions options;
          options.when_full = WhenFull::kWait;
          options.deadline = Clock::now() + std::chrono::milliseconds(20);
          held.push_back(cache.Acquire(
              "m" + std::to_string(m), {files[m]},
              rng() % 2 ? Placement::kFull : Placement::kPartial, options));
          if (held.size() > 2) held.erase(held.begin());
        } catch (const Error&) {  // DeviceError is one too
          kept.Keep(std::current_exception());
        } catch (const std::exception& e) {
          kept.Keep(std::current_exception());
          unexpected.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  gpu0->ClearFaults();
  EXPECT_EQ(unexpected.load(), 0);
  for (DeviceCache& cache : caches) {
    EXPECT_EQ(cache.cache().CheckInvariants(), cache.cache().budget().used());
    EXPECT_EQ(cache.device().bytes_allocated(), cache.cache().budget().used());
    cache.cache().Prune();
    EXPECT_EQ(cache.device().bytes_allocated(), 0u);
  }
  EXPECT_EQ(host.cache().CheckInvariants(), host.budget().used());
  host.Prune();
  EXPECT_EQ(host.budget().used(), 0u);
}

}  // namespace
}  // namespace modelcache::runtime
