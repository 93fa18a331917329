// Device: memory a model's weights can be placed in, and copies to and from
// it.
//
// A Device owns a fixed byte capacity. Allocate() hands out DeviceBuffers,
// move-only handles that free their memory exactly once, when destroyed or
// Reset(). Every backend (host, simulated, CUDA) shares the same contract,
// enforced here in the base class rather than in each backend:
//
//  * Exact books, in the allocator's units. Each allocation is counted as
//    AllocationSize(bytes): its size rounded up to the device's allocation
//    granularity (1 for host memory, 2 MiB for CUDA, whose allocator hands
//    out whole pages), because that is what it takes from the device.
//    bytes_allocated() is the sum of the rounded sizes of the live buffers
//    plus allocations in progress, exact under any concurrency, and never
//    exceeds capacity_bytes(): room is reserved under the device's lock
//    before the backend allocates, and returned if the backend fails.
//  * Failures leave the books unchanged. A refused or failed allocation, a
//    failed copy, and an invalid argument change no byte count; only the
//    failure counters move. Every failure is a DeviceError with a code and one
//    message that names the device.
//  * Unusable for good. A backend that finds the device can never work again
//    in this process (a corrupted CUDA context) marks it unusable: that call
//    and every later Allocate, copy and Synchronize throw kUnavailable with
//    the reason, without reaching the backend, and Stats() says so. Freeing
//    still returns a buffer's bytes to the books.
//  * Thread-safe. Any method may be called from any thread. Copies into
//    disjoint ranges may run concurrently; overlapping ones are the caller's
//    race, as with memcpy.
//  * Ordering. Copies issued to one device complete in the order they were
//    issued. CopyToDevice may return before the bytes reach the device (the
//    CUDA backend stages them and copies asynchronously), but the source may
//    be reused as soon as it returns; the bytes are on the device once
//    Synchronize() returns. CopyToHost returns once `dst` holds the bytes,
//    including those of every CopyToDevice issued before it. A buffer may be
//    freed while copies into it are in flight: the backend waits for them
//    before the memory can be handed out again.
//
// Example:
//
//   std::unique_ptr<Device> gpu = ...;  // HostDevice, SimulatedDevice, CUDA
//   DeviceBuffer weights = gpu->Allocate(tensor.size());
//   gpu->CopyToDevice(weights, 0, tensor);
//   gpu->Synchronize();
//   Run(weights.data());
//   // ~DeviceBuffer frees the memory and returns its bytes.
#ifndef MODELCACHE_DEVICE_DEVICE_H_
#define MODELCACHE_DEVICE_DEVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "modelcache/base/bytes.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/mutex.h"

namespace modelcache::device {

enum class DeviceKind { kHost, kSimulated, kCuda };
const char* DeviceKindName(DeviceKind kind);  // "host", "simulated", "cuda"

enum class DeviceErrorCode {
  // Not enough room: beyond the device's capacity, or the backend itself
  // could not allocate (cudaMalloc failed, an injected allocation fault).
  kOutOfMemory,
  // A copy to or from the device failed (a CUDA error, an injected fault).
  kCopyFailed,
  // The call is invalid: a range outside the buffer, an empty buffer, a
  // buffer of another device, a bad option.
  kInvalidArgument,
  // The device or its backend cannot be used: no GPU, no driver, a CUDA
  // build without CUDA, or a device marked unusable (a corrupted CUDA
  // context: the process must restart to use the GPU again).
  kUnavailable,
};
// "out_of_memory", "copy_failed", "invalid_argument", "unavailable".
const char* DeviceErrorCodeName(DeviceErrorCode code);

// Every failure of a Device: a modelcache::Error whose code() is the coarse
// kind (kCapacity for out of memory, kIo for a failed copy,
// kInvalidArgument, kUnavailable) and whose device_code() is the device's
// own. what() reads
//   "device sim0: out of memory: cannot allocate 2.00 GiB: 1.50 GiB of
//    2.00 GiB allocated"
class DeviceError : public Error {
 public:
  DeviceError(DeviceErrorCode code, const std::string& device,
              const std::string& message);
  DeviceErrorCode device_code() const { return device_code_; }
  const std::string& device() const { return device_; }

 private:
  DeviceErrorCode device_code_;
  std::string device_;
};

using ::modelcache::FormatBytes;

class Device;

// A block of a Device's memory. Move-only; frees the memory exactly once:
// when destroyed, when Reset(), or when assigned over. A moved-from or
// default-constructed buffer is empty and frees nothing.
// REQUIRES: the device outlives its buffers.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // True while the buffer holds an allocation (even one of zero bytes).
  explicit operator bool() const { return device_ != nullptr; }
  // The device the memory belongs to; null when empty.
  Device* device() const { return device_; }
  // The size asked for. The device's books count
  // device()->AllocationSize(size()).
  uint64_t size() const { return size_; }
  // The address in the device's address space: host memory for the host and
  // simulated backends, a device pointer (not dereferenceable on the host)
  // for CUDA. May be null for a zero-byte buffer.
  void* data() const { return data_; }

  // Frees the memory now and leaves the buffer empty. No-op when empty.
  void Reset() noexcept;

 private:
  friend class Device;
  DeviceBuffer(Device* device, void* data, uint64_t size)
      : device_(device), data_(data), size_(size) {}

  Device* device_ = nullptr;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

enum class CopyDirection { kToDevice, kToHost };

// A snapshot of a device's books. Copies are counted when issued (for the
// CUDA backend, before they complete); failed calls count only as failures.
struct DeviceStats {
  uint64_t capacity_bytes = 0;
  // Every allocation is counted rounded up to this (see AllocationSize).
  uint64_t allocation_granularity = 1;
  // Live buffers + allocations in progress, each rounded up to the
  // granularity.
  uint64_t bytes_allocated = 0;
  uint64_t high_water_bytes = 0;
  uint64_t allocations = 0;         // that succeeded
  uint64_t frees = 0;               // allocations - frees = live buffers
  uint64_t failed_allocations = 0;  // refused for capacity or by the backend
  uint64_t copies_to_device = 0;
  uint64_t copies_to_host = 0;
  uint64_t bytes_copied_to_device = 0;
  uint64_t bytes_copied_to_host = 0;
  uint64_t failed_copies = 0;  // invalid arguments are not counted
  uint64_t synchronizations = 0;
  // True once the device was marked unusable; every call but freeing then
  // fails with kUnavailable and `unusable_reason`.
  bool unusable = false;
  std::string unusable_reason;
  // The simulated backend's modelled transfer time; 0 for other backends.
  double simulated_transfer_seconds = 0;
};

class Device {
 public:
  // REQUIRES: every buffer of this device has been freed. (Checked by an
  // assert in debug builds.)
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "host", "sim0", "cuda:0": names the device in every error message.
  const std::string& name() const { return name_; }
  DeviceKind kind() const { return kind_; }
  uint64_t capacity_bytes() const { return capacity_; }
  // The unit the device's allocator hands memory out in; >= 1.
  uint64_t allocation_granularity() const { return granularity_; }
  // What an allocation of `bytes` takes from the device and its books:
  // `bytes` rounded up to allocation_granularity(); 0 for 0; UINT64_MAX when
  // the rounded size does not fit in 64 bits (no capacity admits it).
  uint64_t AllocationSize(uint64_t bytes) const;
  uint64_t bytes_allocated() const MC_EXCLUDES(mu_);
  virtual DeviceStats Stats() const MC_EXCLUDES(mu_);

  // False once the device was marked unusable (see the contract above).
  bool usable() const { return !unusable_.load(std::memory_order_acquire); }
  // Why the device is unusable; empty while it is usable.
  std::string unusable_reason() const MC_EXCLUDES(mu_);

  // Allocates `bytes` (zero is allowed and yields a non-empty buffer of size
  // zero). Contents are unspecified. Throws DeviceError kOutOfMemory when
  // bytes_allocated() + AllocationSize(bytes) would exceed capacity_bytes()
  // or the backend cannot allocate; the books are then unchanged.
  // kUnavailable when the device is unusable.
  DeviceBuffer Allocate(uint64_t bytes) MC_EXCLUDES(mu_);

  // Copies `src` into `dst` at byte `offset`. The source may be reused once
  // this returns; the bytes are on the device once Synchronize() returns.
  // Throws kInvalidArgument unless `dst` is a non-empty buffer of this device
  // and offset + src.size() <= dst.size(); kCopyFailed if the backend fails;
  // kUnavailable when the device is unusable. A zero-byte copy does nothing.
  void CopyToDevice(DeviceBuffer& dst, uint64_t offset,
                    std::span<const std::byte> src) MC_EXCLUDES(mu_);

  // Copies dst.size() bytes of `src` from byte `offset` into `dst`; returns
  // once `dst` holds them. Throws like CopyToDevice.
  void CopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                  uint64_t offset) MC_EXCLUDES(mu_);

  // Waits for every copy issued before it. Throws kCopyFailed if one of them
  // failed after it was issued (the CUDA backend reports such errors here),
  // kUnavailable when the device is unusable.
  void Synchronize() MC_EXCLUDES(mu_);

 protected:
  // Throws DeviceError kInvalidArgument if `name` is empty or
  // `allocation_granularity` is 0.
  Device(std::string name, DeviceKind kind, uint64_t capacity_bytes,
         uint64_t allocation_granularity = 1);

  // ---- Backends implement these; the base has already checked arguments
  // and capacity, and keeps the books. Called without any lock of the base.

  // Returns the memory for `bytes` (zero allowed; may return null then).
  // Throws DeviceError (kOutOfMemory) on failure.
  virtual void* DoAllocate(uint64_t bytes) = 0;
  // Frees what DoAllocate returned. Must not throw. Called also when the
  // device is unusable. Copies into the memory may still be in flight: the
  // backend must let them finish before the memory can be reused.
  virtual void DoFree(void* data, uint64_t bytes) noexcept = 0;
  // REQUIRES: offset + src.size() <= dst.size(), src is not empty.
  virtual void DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                              std::span<const std::byte> src) = 0;
  // REQUIRES: offset + dst.size() <= src.size(), dst is not empty.
  virtual void DoCopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                            uint64_t offset) = 0;
  virtual void DoSynchronize() = 0;

  // Throws DeviceError(code, name(), message).
  [[noreturn]] void Fail(DeviceErrorCode code,
                         const std::string& message) const;

  // Marks the device unusable for good with `reason` (the first reason
  // wins) and throws DeviceError kUnavailable with it. Thread-safe.
  [[noreturn]] void FailUnusable(const std::string& reason) MC_EXCLUDES(mu_);

 private:
  friend class DeviceBuffer;
  // Called by DeviceBuffer::Reset, exactly once per successful Allocate.
  void Free(void* data, uint64_t bytes) noexcept MC_EXCLUDES(mu_);
  void CheckRange(const char* op, const DeviceBuffer& buffer, uint64_t offset,
                  uint64_t bytes) const;
  // Throws kUnavailable (counting a failed copy) when the device is
  // unusable.
  void CheckUsableForCopy() MC_EXCLUDES(mu_);

  const std::string name_;
  const DeviceKind kind_;
  const uint64_t capacity_;
  const uint64_t granularity_;

  // Set once, under mu_, with stats_.unusable_reason; read without the lock
  // on the copy path.
  std::atomic<bool> unusable_{false};
  mutable base::Mutex mu_;
  DeviceStats stats_ MC_GUARDED_BY(mu_);
};

}  // namespace modelcache::device

#endif  // MODELCACHE_DEVICE_DEVICE_H_
