// SimulatedDevice: host memory with a GPU's capacity, bandwidth and failures.
//
// Books: the base class counts bytes and copies; simulated time is derived
// from those counters on demand (bytes / bandwidth per direction + copies *
// latency) rather than accumulated per copy, so it is exact, independent of
// the order of concurrent copies, and nothing is counted for a failed copy.
//
// Faults and the backend's own memory books (backend_bytes_, external_bytes_)
// live under fault_mu_, a leaf lock of this class (the base class never
// calls the backend while holding its own lock, so the two are never held
// together). An allocation reserves its rounded size in backend_bytes_
// under fault_mu_ before it allocates and returns it on failure, so the
// physical limit is exact under concurrency like the base's capacity. Each
// backend call decides under fault_mu_ whether it fails and consumes one-shot
// faults there, so concurrent calls consume a fault exactly once. The copy
// predicate is user code: it is copied out under the lock (a shared_ptr) and
// run after the lock is released. A failing copy throws before touching the
// destination.
//
// Sleeping (options.sleep) happens after the copy, outside every lock.
#include "modelcache/device/simulated_device.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <thread>
#include <utility>

namespace modelcache::device {

namespace {

bool IsPowerOfTwo(size_t n) { return n != 0 && (n & (n - 1)) == 0; }

double ToHostBandwidth(const SimulatedDeviceOptions& options) {
  return options.to_host_bandwidth_bytes_per_second > 0
             ? options.to_host_bandwidth_bytes_per_second
             : options.bandwidth_bytes_per_second;
}

}  // namespace

SimulatedDevice::SimulatedDevice(SimulatedDeviceOptions options)
    : Device(options.name, DeviceKind::kSimulated, options.capacity_bytes,
             options.allocation_granularity),
      options_(std::move(options)),
      to_host_bandwidth_(ToHostBandwidth(options_)) {
  if (!(options_.bandwidth_bytes_per_second > 0) ||
      !std::isfinite(options_.bandwidth_bytes_per_second) ||
      options_.to_host_bandwidth_bytes_per_second < 0 ||
      !std::isfinite(to_host_bandwidth_)) {
    Fail(DeviceErrorCode::kInvalidArgument,
         "bandwidth must be a positive number of bytes per second");
  }
  if (!(options_.copy_latency_seconds >= 0) ||
      !std::isfinite(options_.copy_latency_seconds)) {
    Fail(DeviceErrorCode::kInvalidArgument,
         "copy latency must be zero or more seconds");
  }
  if (!IsPowerOfTwo(options_.alignment)) {
    Fail(DeviceErrorCode::kInvalidArgument,
         "alignment " + std::to_string(options_.alignment) +
             " is not a power of two");
  }
}

SimulatedDevice::~SimulatedDevice() = default;

double SimulatedDevice::TransferSeconds(CopyDirection direction,
                                        uint64_t bytes) const {
  const double bandwidth = direction == CopyDirection::kToDevice
                               ? options_.bandwidth_bytes_per_second
                               : to_host_bandwidth_;
  return static_cast<double>(bytes) / bandwidth + options_.copy_latency_seconds;
}

DeviceStats SimulatedDevice::Stats() const {
  DeviceStats stats = Device::Stats();
  stats.simulated_transfer_seconds =
      static_cast<double>(stats.bytes_copied_to_device) /
          options_.bandwidth_bytes_per_second +
      static_cast<double>(stats.bytes_copied_to_host) / to_host_bandwidth_ +
      static_cast<double>(stats.copies_to_device + stats.copies_to_host) *
          options_.copy_latency_seconds;
  return stats;
}

double SimulatedDevice::simulated_seconds() const {
  return Stats().simulated_transfer_seconds;
}

void SimulatedDevice::FailAllocation(uint64_t nth) {
  base::MutexLock lock(&fault_mu_);
  fail_allocation_in_ = nth;
}

void SimulatedDevice::FailAllocationsAbove(std::optional<uint64_t> bytes) {
  base::MutexLock lock(&fault_mu_);
  fail_allocations_above_ = bytes;
}

void SimulatedDevice::FailNextCopies(uint64_t count) {
  base::MutexLock lock(&fault_mu_);
  fail_next_copies_ = count;
}

void SimulatedDevice::FailCopiesWhere(
    std::function<bool(const CopyInfo&)> predicate) {
  auto shared =
      predicate ? std::make_shared<const std::function<bool(const CopyInfo&)>>(
                      std::move(predicate))
                : nullptr;
  base::MutexLock lock(&fault_mu_);
  copy_predicate_ = std::move(shared);
}

void SimulatedDevice::CorruptContext() {
  base::MutexLock lock(&fault_mu_);
  corrupt_next_ = true;
}

void SimulatedDevice::SetExternalBytes(uint64_t bytes) {
  base::MutexLock lock(&fault_mu_);
  external_bytes_ = bytes;
}

uint64_t SimulatedDevice::backend_bytes() const {
  base::MutexLock lock(&fault_mu_);
  return backend_bytes_;
}

void SimulatedDevice::MaybeCorrupt(const char* call) {
  {
    base::MutexLock lock(&fault_mu_);
    if (!corrupt_next_ && !corrupted_) return;
    if (corrupt_next_) ++injected_faults_;
    corrupt_next_ = false;
    corrupted_ = true;
  }
  FailUnusable(std::string("context corrupted: ") + call +
               " failed with an injected sticky error (CorruptContext); every "
               "later call fails: the process must restart to use the device "
               "again");
}

void SimulatedDevice::ClearFaults() {
  base::MutexLock lock(&fault_mu_);
  fail_allocation_in_ = 0;
  fail_allocations_above_.reset();
  fail_next_copies_ = 0;
  copy_predicate_.reset();
  corrupt_next_ = false;
}

uint64_t SimulatedDevice::injected_faults() const {
  base::MutexLock lock(&fault_mu_);
  return injected_faults_;
}

void* SimulatedDevice::DoAllocate(uint64_t bytes) {
  MaybeCorrupt("allocate");
  const uint64_t rounded = AllocationSize(bytes);
  {
    base::MutexLock lock(&fault_mu_);
    if (fail_allocation_in_ > 0 && --fail_allocation_in_ == 0) {
      ++injected_faults_;
      Fail(DeviceErrorCode::kOutOfMemory,
           "cannot allocate " + FormatBytes(bytes) +
               ": injected fault (FailAllocation)");
    }
    if (fail_allocations_above_ && bytes > *fail_allocations_above_) {
      ++injected_faults_;
      Fail(DeviceErrorCode::kOutOfMemory,
           "cannot allocate " + FormatBytes(bytes) +
               ": injected fault (FailAllocationsAbove " +
               FormatBytes(*fail_allocations_above_) + ")");
    }
    const uint64_t physical = options_.physical_bytes;
    if (physical > 0) {
      const uint64_t taken = backend_bytes_ + external_bytes_ < backend_bytes_
                                 ? UINT64_MAX
                                 : backend_bytes_ + external_bytes_;
      if (taken > physical || rounded > physical - taken) {
        Fail(DeviceErrorCode::kOutOfMemory,
             "cannot allocate " + FormatBytes(bytes) + ": " +
                 FormatBytes(backend_bytes_) + " held by this device and " +
                 FormatBytes(external_bytes_) + " by others, of " +
                 FormatBytes(physical) + " of memory");
      }
    }
    backend_bytes_ += rounded;  // reserved while the host allocates
  }
  const uint64_t size = bytes == 0 ? options_.alignment : bytes;
  void* data = nullptr;
  if (size <= SIZE_MAX) {
    data = ::operator new(static_cast<size_t>(size),
                          std::align_val_t(options_.alignment), std::nothrow);
  }
  if (data == nullptr) {
    {
      base::MutexLock lock(&fault_mu_);
      backend_bytes_ -= rounded;
    }
    Fail(DeviceErrorCode::kOutOfMemory,
         "cannot allocate " + FormatBytes(bytes) +
             ": the host refused the memory standing in for the device's");
  }
  return data;
}

void SimulatedDevice::DoFree(void* data, uint64_t bytes) noexcept {
  ::operator delete(data, std::align_val_t(options_.alignment));
  base::MutexLock lock(&fault_mu_);
  backend_bytes_ -= AllocationSize(bytes);
}

void SimulatedDevice::DoSynchronize() { MaybeCorrupt("synchronize"); }

void SimulatedDevice::MaybeFailCopy(CopyInfo info) {
  MaybeCorrupt(info.direction == CopyDirection::kToDevice ? "copy to device"
                                                          : "copy to host");
  std::shared_ptr<const std::function<bool(const CopyInfo&)>> predicate;
  {
    base::MutexLock lock(&fault_mu_);
    info.index = ++backend_copies_;
    if (fail_next_copies_ > 0) {
      --fail_next_copies_;
      ++injected_faults_;
    } else {
      predicate = copy_predicate_;
      if (predicate == nullptr) return;
    }
  }
  if (predicate != nullptr) {
    if (!(*predicate)(info)) return;
    base::MutexLock lock(&fault_mu_);
    ++injected_faults_;
  }
  Fail(DeviceErrorCode::kCopyFailed,
       std::string(info.direction == CopyDirection::kToDevice
                       ? "copy of "
                       : "copy back of ") +
           FormatBytes(info.bytes) + " at offset " +
           std::to_string(info.offset) + ": injected fault (" +
           (predicate != nullptr ? "FailCopiesWhere" : "FailNextCopies") + ")");
}

void SimulatedDevice::Spend(CopyDirection direction, uint64_t bytes) const {
  if (!options_.sleep) return;
  std::this_thread::sleep_for(
      std::chrono::duration<double>(TransferSeconds(direction, bytes)));
}

void SimulatedDevice::DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                                     std::span<const std::byte> src) {
  MaybeFailCopy(CopyInfo{.direction = CopyDirection::kToDevice,
                         .bytes = src.size(),
                         .offset = offset,
                         .buffer_size = dst.size(),
                         .buffer_data = dst.data()});
  std::memcpy(static_cast<std::byte*>(dst.data()) + offset, src.data(),
              src.size());
  Spend(CopyDirection::kToDevice, src.size());
}

void SimulatedDevice::DoCopyToHost(std::span<std::byte> dst,
                                   const DeviceBuffer& src, uint64_t offset) {
  MaybeFailCopy(CopyInfo{.direction = CopyDirection::kToHost,
                         .bytes = dst.size(),
                         .offset = offset,
                         .buffer_size = src.size(),
                         .buffer_data = src.data()});
  std::memcpy(dst.data(), static_cast<const std::byte*>(src.data()) + offset,
              dst.size());
  Spend(CopyDirection::kToHost, dst.size());
}

}  // namespace modelcache::device
