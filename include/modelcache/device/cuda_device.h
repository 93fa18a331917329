// The CUDA backend: device memory, pinned host staging, asynchronous copies.
//
// Built when CMake finds the CUDA toolkit (MODELCACHE_HAVE_CUDA is then
// defined to 1 for users of modelcache_device); otherwise these functions
// still exist and report that CUDA is unavailable. This header never includes
// CUDA headers, so it compiles everywhere.
//
// A CUDA device (see device.h for the contract every Device keeps):
//
//  * Allocate is cudaMalloc on that GPU, Free is cudaFree. Its capacity is an
//    accounting limit (by default the GPU's free memory when the Device was
//    made); cudaMalloc may still fail below it when other processes use the
//    GPU, and then Allocate throws kOutOfMemory with the books unchanged.
//    Bytes are counted as asked for; the driver rounds allocations up.
//  * CopyToDevice copies the source through pinned staging buffers
//    (cudaHostAlloc) and cudaMemcpyAsync on the device's own non-blocking
//    stream, overlapping the host-side memcpy of one chunk with the DMA of
//    the previous one. It returns once the last chunk is staged, so the
//    source may be reused at once; the data is on the GPU when Synchronize()
//    (cudaStreamSynchronize) returns. CopyToHost is pipelined the same way
//    and returns when the destination holds the data.
//  * An error of an asynchronous copy may surface only at the next copy or
//    Synchronize(), as kCopyFailed. CUDA errors that poison the context
//    (sticky errors) make every later call fail the same way.
//  * Every call makes its GPU current on the calling thread for its duration
//    and restores the thread's previous current device.
#ifndef MODELCACHE_DEVICE_CUDA_DEVICE_H_
#define MODELCACHE_DEVICE_CUDA_DEVICE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/device/device.h"

namespace modelcache::device {

struct CudaDeviceOptions {
  // The accounting capacity. 0: the GPU's free memory when the Device is
  // made (cudaMemGetInfo). Any other value is taken as is, even beyond the
  // GPU's memory (cudaMalloc then decides).
  uint64_t capacity_bytes = 0;
  // Size and number of the pinned staging buffers each device keeps. The
  // copy pipeline keeps `staging_buffers` chunks in flight. >= 1 each.
  uint64_t staging_buffer_bytes = uint64_t{8} << 20;
  int staging_buffers = 2;
};

// True when this build has the CUDA backend and at least one GPU can be used
// (cudaGetDeviceCount succeeds with a count > 0). Never throws.
bool CudaAvailable();
// Why CudaAvailable() is false ("built without CUDA", "cudaGetDeviceCount:
// CUDA driver version is insufficient..."); empty when it is true.
std::string CudaUnavailableReason();
// The number of usable GPUs; 0 when CUDA is unavailable. Never throws.
int CudaDeviceCount();

// One Device per GPU, named "cuda:0", "cuda:1", ...; empty when CUDA is
// unavailable. Throws DeviceError kUnavailable if a GPU that exists cannot be
// set up (its stream or staging buffers), or kInvalidArgument for bad
// options.
std::vector<std::unique_ptr<Device>> CudaDevices(
    const CudaDeviceOptions& options = {});

// The Device for GPU `ordinal`. Throws DeviceError kUnavailable when CUDA is
// unavailable or there is no such GPU, kInvalidArgument for bad options.
std::unique_ptr<Device> MakeCudaDevice(int ordinal,
                                       const CudaDeviceOptions& options = {});

}  // namespace modelcache::device

#endif  // MODELCACHE_DEVICE_CUDA_DEVICE_H_
