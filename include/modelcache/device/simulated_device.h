// SimulatedDevice: a stand-in for a GPU, with a byte capacity, a bandwidth
// and fault injection, for tests and benchmarks on machines without one.
//
// Its memory is host RAM and its copies really copy, so data round-trips
// exactly as on a real device. Each copy also costs simulated time,
// bytes / bandwidth (+ a fixed latency per copy), summed in
// simulated_seconds(); nothing sleeps unless `sleep` is set, so tests stay
// fast and deterministic.
//
// Like a GPU's allocator it can hand out memory in units larger than a byte
// (`allocation_granularity`: the books count every allocation rounded up),
// and its memory can be smaller than what its books allow: with
// `physical_bytes` set, the backend refuses an allocation, as cudaMalloc
// does, when the rounded sizes of its live allocations plus what others hold
// (SetExternalBytes: a framework's allocator, another process) would exceed
// it, even though the capacity check passed.
//
// Fault injection makes the backend itself fail, as cudaMalloc or
// cudaMemcpy would, after the Device contract's own checks passed:
//
//   SimulatedDevice gpu({.name = "sim0", .capacity_bytes = 1 << 30});
//   gpu.FailAllocation(2);            // the 2nd allocation from now fails
//   gpu.FailAllocationsAbove(256 << 20);
//   gpu.FailNextCopies(1);            // the next copy fails
//   gpu.FailCopiesWhere([](const CopyInfo& c) { return c.offset > 0; });
//   gpu.CorruptContext();             // the next call poisons the device
//
// An injected allocation fault throws DeviceError kOutOfMemory, an injected
// copy fault kCopyFailed (the destination is left untouched); either leaves
// the books unchanged, as every failure does. Faults are one-shot except the
// size limit and the predicate, which stay until cleared. CorruptContext
// stands for a kernel that corrupted a CUDA context: the next allocation,
// copy or Synchronize that reaches the backend marks the device unusable
// and fails with kUnavailable, and so does every later call; ClearFaults
// does not undo that.
#ifndef MODELCACHE_DEVICE_SIMULATED_DEVICE_H_
#define MODELCACHE_DEVICE_SIMULATED_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "modelcache/base/mutex.h"
#include "modelcache/device/device.h"

namespace modelcache::device {

struct SimulatedDeviceOptions {
  std::string name = "sim";
  uint64_t capacity_bytes = 0;
  // Host-to-device bandwidth, bytes per second. > 0.
  double bandwidth_bytes_per_second = 16e9;
  // Device-to-host bandwidth; 0 means the same as host-to-device.
  double to_host_bandwidth_bytes_per_second = 0;
  // Fixed cost of every copy, seconds. >= 0.
  double copy_latency_seconds = 0;
  // Really sleep for each copy's simulated time (outside every lock), for
  // demos that should feel like a real transfer. Off by default: tests must
  // not sleep.
  bool sleep = false;
  // Of every buffer's data(); cudaMalloc guarantees 256. A power of two.
  size_t alignment = 256;
  // The allocator's unit: the books count each allocation rounded up to a
  // multiple of it (CUDA: 2 MiB). >= 1.
  uint64_t allocation_granularity = 1;
  // The device's real memory; 0: as much as the capacity (no allocation the
  // capacity admits is ever refused for room). See SetExternalBytes.
  uint64_t physical_bytes = 0;
};

// What a copy fault predicate sees.
struct CopyInfo {
  CopyDirection direction;
  uint64_t bytes = 0;
  uint64_t offset = 0;       // into the device buffer
  uint64_t buffer_size = 0;  // of the device buffer
  const void* buffer_data = nullptr;
  uint64_t index = 0;  // 1 for the first copy that reaches the backend
};

class SimulatedDevice : public Device {
 public:
  // Throws DeviceError kInvalidArgument for a non-positive bandwidth, a
  // negative latency, an alignment that is not a power of two, a zero
  // allocation granularity, or an empty name.
  explicit SimulatedDevice(SimulatedDeviceOptions options);
  ~SimulatedDevice() override;

  const SimulatedDeviceOptions& options() const { return options_; }

  // The modelled time of one copy of `bytes` in `direction`.
  double TransferSeconds(CopyDirection direction, uint64_t bytes) const;
  // The modelled time of every successful copy so far:
  //   to_device_bytes / bandwidth + to_host_bytes / to_host_bandwidth
  //   + copies * latency.
  double simulated_seconds() const;
  DeviceStats Stats() const override;

  // ---- Fault injection. Thread-safe; applies to calls that reach the
  // backend, i.e. that passed the argument and capacity checks.

  // The `nth` allocation from now fails (1: the next one), once. 0 disarms.
  void FailAllocation(uint64_t nth) MC_EXCLUDES(fault_mu_);
  // Every allocation larger than `bytes` fails until cleared (nullopt).
  void FailAllocationsAbove(std::optional<uint64_t> bytes)
      MC_EXCLUDES(fault_mu_);
  // The next `count` copies fail (in either direction).
  void FailNextCopies(uint64_t count) MC_EXCLUDES(fault_mu_);
  // Every copy for which `predicate` returns true fails until cleared (an
  // empty function). The predicate runs outside the device's locks, on the
  // copying thread, and must be thread-safe.
  void FailCopiesWhere(std::function<bool(const CopyInfo&)> predicate)
      MC_EXCLUDES(fault_mu_);
  // The next allocation, copy or Synchronize that reaches the backend marks
  // the device unusable, as a corrupted CUDA context would (see above).
  void CorruptContext() MC_EXCLUDES(fault_mu_);
  // Disarms every fault (a device already unusable stays so).
  void ClearFaults() MC_EXCLUDES(fault_mu_);

  // ---- Memory held outside this Device (only with physical_bytes set).

  // Sets how much of physical_bytes others hold now: the backend refuses an
  // allocation (kOutOfMemory) when its live allocations, rounded, plus
  // `bytes` plus the new one would exceed physical_bytes. Buffers already
  // handed out are unaffected.
  void SetExternalBytes(uint64_t bytes) MC_EXCLUDES(fault_mu_);
  // The rounded bytes of the live allocations the backend holds.
  uint64_t backend_bytes() const MC_EXCLUDES(fault_mu_);
  // Faults injected so far (allocations and copies that failed because of
  // one).
  uint64_t injected_faults() const MC_EXCLUDES(fault_mu_);

 protected:
  void* DoAllocate(uint64_t bytes) MC_EXCLUDES(fault_mu_) override;
  void DoFree(void* data, uint64_t bytes) noexcept override;
  void DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                      std::span<const std::byte> src)
      MC_EXCLUDES(fault_mu_) override;
  void DoCopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                    uint64_t offset) MC_EXCLUDES(fault_mu_) override;
  void DoSynchronize() MC_EXCLUDES(fault_mu_) override;

 private:
  // Throws kCopyFailed if a copy fault applies to this copy.
  void MaybeFailCopy(CopyInfo info) MC_EXCLUDES(fault_mu_);
  // Marks the device unusable and throws, if CorruptContext is armed (or
  // the device was already corrupted by the backend).
  void MaybeCorrupt(const char* call) MC_EXCLUDES(fault_mu_);
  void Spend(CopyDirection direction, uint64_t bytes) const;

  const SimulatedDeviceOptions options_;
  const double to_host_bandwidth_;

  mutable base::Mutex fault_mu_;
  uint64_t fail_allocation_in_ MC_GUARDED_BY(fault_mu_) = 0;
  std::optional<uint64_t> fail_allocations_above_ MC_GUARDED_BY(fault_mu_);
  uint64_t fail_next_copies_ MC_GUARDED_BY(fault_mu_) = 0;
  std::shared_ptr<const std::function<bool(const CopyInfo&)>> copy_predicate_
      MC_GUARDED_BY(fault_mu_);
  bool corrupt_next_ MC_GUARDED_BY(fault_mu_) = false;
  bool corrupted_ MC_GUARDED_BY(fault_mu_) = false;
  uint64_t external_bytes_ MC_GUARDED_BY(fault_mu_) = 0;
  uint64_t backend_bytes_ MC_GUARDED_BY(fault_mu_) = 0;
  uint64_t backend_copies_ MC_GUARDED_BY(fault_mu_) = 0;
  uint64_t injected_faults_ MC_GUARDED_BY(fault_mu_) = 0;
};

}  // namespace modelcache::device

#endif  // MODELCACHE_DEVICE_SIMULATED_DEVICE_H_
