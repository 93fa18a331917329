// Device: the contract every backend shares (see device.h).
//
// The base class keeps the books; backends only move bytes. Every public
// operation follows one pattern:
//
//   Allocate:     check usable, reserve AllocationSize(bytes) under mu_
//                 ->  DoAllocate (no lock)
//                 -> on success count it; on failure return the reservation.
//   Free:         DoFree (no lock)  ->  return the bytes under mu_.
//   Copy*:        check the range and usable (no lock)  ->  Do*Copy (no lock)
//                 -> count it, or count a failure.
//
// Invariants, under mu_:
//   stats_.bytes_allocated = sum of AllocationSize(size) of live buffers +
//                            reservations of allocations in progress
//                            <=  capacity_
//   stats_.allocations - stats_.frees = live buffers
//   stats_.high_water_bytes = max of bytes_allocated seen when an
//                             allocation succeeded (a failed one leaves it)
// Reserving before the backend allocates is what makes the capacity a hard
// limit under concurrency: two racing allocations can never both see the
// same free bytes. mu_ is a leaf: no backend code runs while it is held, so
// backends may keep locks of their own in any order with respect to it.
//
// DeviceBuffer frees exactly once: Reset() clears device_ before it calls
// Free, and a move leaves the source empty. A buffer keeps the size asked
// for; Free rounds it again (AllocationSize is a pure function of it), so
// the bytes returned are exactly the bytes reserved.
//
// Unusable: unusable_ goes from false to true once, under mu_, together with
// stats_.unusable_reason. Allocate checks it under mu_ with its
// reservation; copies and Synchronize read the atomic first, so a call that
// started before the device was marked may still reach the backend, which
// then fails by itself (a corrupted context fails every call).
#include "modelcache/device/device.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <utility>

namespace modelcache::device {

const char* DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kHost:
      return "host";
    case DeviceKind::kSimulated:
      return "simulated";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

const char* DeviceErrorCodeName(DeviceErrorCode code) {
  switch (code) {
    case DeviceErrorCode::kOutOfMemory:
      return "out_of_memory";
    case DeviceErrorCode::kCopyFailed:
      return "copy_failed";
    case DeviceErrorCode::kInvalidArgument:
      return "invalid_argument";
    case DeviceErrorCode::kUnavailable:
      return "unavailable";
  }
  return "unknown";
}

namespace {

const char* Describe(DeviceErrorCode code) {
  switch (code) {
    case DeviceErrorCode::kOutOfMemory:
      return "out of memory";
    case DeviceErrorCode::kCopyFailed:
      return "copy failed";
    case DeviceErrorCode::kInvalidArgument:
      return "invalid argument";
    case DeviceErrorCode::kUnavailable:
      return "unavailable";
  }
  return "error";
}

}  // namespace

ErrorCode CoarseCode(DeviceErrorCode code) {
  switch (code) {
    case DeviceErrorCode::kOutOfMemory:
      return ErrorCode::kCapacity;
    case DeviceErrorCode::kCopyFailed:
      return ErrorCode::kIo;
    case DeviceErrorCode::kInvalidArgument:
      return ErrorCode::kInvalidArgument;
    case DeviceErrorCode::kUnavailable:
      return ErrorCode::kUnavailable;
  }
  return ErrorCode::kIo;
}

DeviceError::DeviceError(DeviceErrorCode code, const std::string& device,
                         const std::string& message)
    : Error(CoarseCode(code),
            "device " + device + ": " + Describe(code) + ": " + message),
      device_code_(code),
      device_(device) {}

// ---- DeviceBuffer ----

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() noexcept {
  Device* device = std::exchange(device_, nullptr);
  void* data = std::exchange(data_, nullptr);
  const uint64_t size = std::exchange(size_, 0);
  if (device != nullptr) device->Free(data, size);
}

// ---- Device ----

namespace {

std::string CheckedName(std::string name) {
  if (name.empty()) {
    throw DeviceError(DeviceErrorCode::kInvalidArgument, "(unnamed)",
                      "a device needs a name");
  }
  return name;
}

}  // namespace

Device::Device(std::string name, DeviceKind kind, uint64_t capacity_bytes,
               uint64_t allocation_granularity)
    : name_(CheckedName(std::move(name))),
      kind_(kind),
      capacity_(capacity_bytes),
      granularity_(allocation_granularity) {
  if (granularity_ == 0) {
    Fail(DeviceErrorCode::kInvalidArgument,
         "the allocation granularity must be at least 1 byte");
  }
}

Device::~Device() {
  base::MutexLock lock(&mu_);
  assert(stats_.allocations == stats_.frees &&
         "a DeviceBuffer outlived its Device");
  assert(stats_.bytes_allocated == 0 && "an allocation outlived its Device");
}

uint64_t Device::AllocationSize(uint64_t bytes) const {
  const uint64_t remainder = bytes % granularity_;
  if (remainder == 0) return bytes;
  const uint64_t pad = granularity_ - remainder;
  return bytes > UINT64_MAX - pad ? UINT64_MAX : bytes + pad;
}

std::string Device::unusable_reason() const {
  base::MutexLock lock(&mu_);
  return stats_.unusable_reason;
}

uint64_t Device::bytes_allocated() const {
  base::MutexLock lock(&mu_);
  return stats_.bytes_allocated;
}

DeviceStats Device::Stats() const {
  base::MutexLock lock(&mu_);
  DeviceStats stats = stats_;
  stats.capacity_bytes = capacity_;
  stats.allocation_granularity = granularity_;
  return stats;
}

void Device::Fail(DeviceErrorCode code, const std::string& message) const {
  throw DeviceError(code, name_, message);
}

void Device::FailUnusable(const std::string& reason) {
  std::string first;
  {
    base::MutexLock lock(&mu_);
    if (!stats_.unusable) {
      stats_.unusable = true;
      stats_.unusable_reason = reason;
      unusable_.store(true, std::memory_order_release);
    }
    first = stats_.unusable_reason;
  }
  Fail(DeviceErrorCode::kUnavailable, first);
}

DeviceBuffer Device::Allocate(uint64_t bytes) {
  const uint64_t rounded = AllocationSize(bytes);
  {
    base::MutexLock lock(&mu_);
    assert(stats_.bytes_allocated <= capacity_);
    if (stats_.unusable) {
      ++stats_.failed_allocations;
      Fail(DeviceErrorCode::kUnavailable, stats_.unusable_reason);
    }
    if (rounded > capacity_ - stats_.bytes_allocated) {
      ++stats_.failed_allocations;
      Fail(DeviceErrorCode::kOutOfMemory,
           "cannot allocate " + FormatBytes(bytes) +
               (rounded != bytes
                    ? " (" + FormatBytes(rounded) + " in units of " +
                          FormatBytes(granularity_) + ")"
                    : std::string()) +
               ": " + FormatBytes(stats_.bytes_allocated) + " of " +
               FormatBytes(capacity_) + " allocated");
    }
    stats_.bytes_allocated += rounded;  // reserved while the backend allocates
  }
  void* data = nullptr;
  try {
    data = DoAllocate(bytes);
  } catch (...) {
    base::MutexLock lock(&mu_);
    stats_.bytes_allocated -= rounded;
    ++stats_.failed_allocations;
    throw;
  }
  {
    base::MutexLock lock(&mu_);
    ++stats_.allocations;
    // Only now: a backend failure above must leave the high-water mark as
    // it was.
    stats_.high_water_bytes =
        std::max(stats_.high_water_bytes, stats_.bytes_allocated);
  }
  return DeviceBuffer(this, data, bytes);
}

void Device::Free(void* data, uint64_t bytes) noexcept {
  DoFree(data, bytes);
  const uint64_t rounded = AllocationSize(bytes);
  base::MutexLock lock(&mu_);
  assert(stats_.bytes_allocated >= rounded);
  assert(stats_.allocations > stats_.frees);
  stats_.bytes_allocated -= rounded;
  ++stats_.frees;
}

void Device::CheckUsableForCopy() {
  if (usable()) return;
  base::MutexLock lock(&mu_);
  ++stats_.failed_copies;
  Fail(DeviceErrorCode::kUnavailable, stats_.unusable_reason);
}

void Device::CheckRange(const char* op, const DeviceBuffer& buffer,
                        uint64_t offset, uint64_t bytes) const {
  if (!buffer) {
    Fail(DeviceErrorCode::kInvalidArgument,
         std::string(op) + " with an empty DeviceBuffer");
  }
  if (buffer.device() != this) {
    Fail(DeviceErrorCode::kInvalidArgument, std::string(op) +
                                                " with a buffer of device " +
                                                buffer.device()->name());
  }
  if (offset > buffer.size() || bytes > buffer.size() - offset) {
    Fail(DeviceErrorCode::kInvalidArgument,
         std::string(op) + " of " + std::to_string(bytes) +
             " bytes at offset " + std::to_string(offset) +
             " is outside a buffer of " + std::to_string(buffer.size()) +
             " bytes");
  }
}

void Device::CopyToDevice(DeviceBuffer& dst, uint64_t offset,
                          std::span<const std::byte> src) {
  CheckRange("CopyToDevice", dst, offset, src.size());
  if (src.empty()) return;
  CheckUsableForCopy();
  try {
    DoCopyToDevice(dst, offset, src);
  } catch (...) {
    base::MutexLock lock(&mu_);
    ++stats_.failed_copies;
    throw;
  }
  base::MutexLock lock(&mu_);
  ++stats_.copies_to_device;
  stats_.bytes_copied_to_device += src.size();
}

void Device::CopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                        uint64_t offset) {
  CheckRange("CopyToHost", src, offset, dst.size());
  if (dst.empty()) return;
  CheckUsableForCopy();
  try {
    DoCopyToHost(dst, src, offset);
  } catch (...) {
    base::MutexLock lock(&mu_);
    ++stats_.failed_copies;
    throw;
  }
  base::MutexLock lock(&mu_);
  ++stats_.copies_to_host;
  stats_.bytes_copied_to_host += dst.size();
}

void Device::Synchronize() {
  if (!usable()) Fail(DeviceErrorCode::kUnavailable, unusable_reason());
  DoSynchronize();
  base::MutexLock lock(&mu_);
  ++stats_.synchronizations;
}

}  // namespace modelcache::device
