// HostDevice: aligned host RAM behind the Device contract.
//
// Memory comes from the aligned, nothrow operator new, so an allocation the
// system refuses becomes DeviceError kOutOfMemory rather than std::bad_alloc.
// A zero-byte buffer still gets a (one-alignment) block, so data() is never
// null. Copies are memcpy: complete on return, hence DoSynchronize is empty.
// The backend keeps no state of its own; the base class keeps the books.
#include "modelcache/device/host_device.h"

#include <unistd.h>

#include <cstring>
#include <new>
#include <utility>

namespace modelcache::device {

namespace {

bool IsPowerOfTwo(size_t n) { return n != 0 && (n & (n - 1)) == 0; }

}  // namespace

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

HostDevice::HostDevice(HostDeviceOptions options)
    : Device(std::move(options.name), DeviceKind::kHost,
             options.capacity_bytes != 0 ? options.capacity_bytes
                                         : PhysicalMemoryBytes()),
      alignment_(options.alignment) {
  if (!IsPowerOfTwo(alignment_)) {
    Fail(DeviceErrorCode::kInvalidArgument,
         "alignment " + std::to_string(alignment_) + " is not a power of two");
  }
}

HostDevice::~HostDevice() = default;

void* HostDevice::DoAllocate(uint64_t bytes) {
  const uint64_t size = bytes == 0 ? alignment_ : bytes;
  void* data = nullptr;
  if (size <= SIZE_MAX) {
    data = ::operator new(static_cast<size_t>(size),
                          std::align_val_t(alignment_), std::nothrow);
  }
  if (data == nullptr) {
    Fail(DeviceErrorCode::kOutOfMemory,
         "the system refused " + FormatBytes(bytes) + " of host memory");
  }
  return data;
}

void HostDevice::DoFree(void* data, uint64_t /*bytes*/) noexcept {
  ::operator delete(data, std::align_val_t(alignment_));
}

void HostDevice::DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                                std::span<const std::byte> src) {
  std::memcpy(static_cast<std::byte*>(dst.data()) + offset, src.data(),
              src.size());
}

void HostDevice::DoCopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                              uint64_t offset) {
  std::memcpy(dst.data(), static_cast<const std::byte*>(src.data()) + offset,
              dst.size());
}

}  // namespace modelcache::device
