// HostDevice: a Device whose memory is ordinary, aligned host RAM.
//
// For CPU inference and as the reference backend of the Device contract
// (see device.h). Copies are memcpy and complete before they return, so
// Synchronize() has nothing to wait for.
#ifndef MODELCACHE_DEVICE_HOST_DEVICE_H_
#define MODELCACHE_DEVICE_HOST_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "modelcache/device/device.h"

namespace modelcache::device {

struct HostDeviceOptions {
  std::string name = "host";
  // 0: the machine's physical memory.
  uint64_t capacity_bytes = 0;
  // Of every buffer's data(). A power of two; the default (a page) suits
  // O_DIRECT reads and page-granular pinning.
  size_t alignment = 4096;
};

class HostDevice : public Device {
 public:
  // Throws DeviceError kInvalidArgument if the alignment is not a power of
  // two or the name is empty.
  explicit HostDevice(HostDeviceOptions options = {});
  ~HostDevice() override;

  size_t alignment() const { return alignment_; }

 protected:
  void* DoAllocate(uint64_t bytes) override;
  void DoFree(void* data, uint64_t bytes) noexcept override;
  void DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                      std::span<const std::byte> src) override;
  void DoCopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                    uint64_t offset) override;
  void DoSynchronize() override {}

 private:
  const size_t alignment_;
};

// The machine's physical memory in bytes (sysconf), 0 if unknown.
uint64_t PhysicalMemoryBytes();

}  // namespace modelcache::device

#endif  // MODELCACHE_DEVICE_HOST_DEVICE_H_
