// The CUDA entry points of a build without the CUDA toolkit.
//
// CMake compiles this file instead of cuda_device.cc when it does not find
// the toolkit (or MODELCACHE_ENABLE_CUDA is OFF), so callers need no #if:
// CUDA is simply never available.
#include "modelcache/device/cuda_device.h"

namespace modelcache::device {

namespace {

constexpr const char* kWhy =
    "modelcache was built without CUDA (the CUDA toolkit was not found, or "
    "MODELCACHE_ENABLE_CUDA was OFF)";

}  // namespace

bool CudaAvailable() { return false; }

std::string CudaUnavailableReason() { return kWhy; }

int CudaDeviceCount() { return 0; }

std::vector<std::unique_ptr<Device>> CudaDevices(
    const CudaDeviceOptions& /*options*/) {
  return {};
}

std::unique_ptr<Device> MakeCudaDevice(int ordinal,
                                       const CudaDeviceOptions& /*options*/) {
  throw DeviceError(DeviceErrorCode::kUnavailable,
                    "cuda:" + std::to_string(ordinal), kWhy);
}

void* CudaStreamOf(const Device& /*device*/) { return nullptr; }

}  // namespace modelcache::device
