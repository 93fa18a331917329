// The CUDA backend: device memory, pinned host staging, asynchronous copies.
//
// Built when CMake finds the CUDA toolkit (MODELCACHE_HAVE_CUDA is then
// defined to 1 for users of modelcache_device); otherwise these functions
// still exist and report that CUDA is unavailable. This header never includes
// CUDA headers, so it compiles everywhere.
//
// A CUDA device (see device.h for the contract every Device keeps):
//
//  * Allocate is cudaMalloc on that GPU, Free is cudaFree. Allocate(0) calls
//    no CUDA function and gives a buffer whose data() is null. Its books
//    count every allocation in 2 MiB units (allocation_granularity()), the
//    pages cudaMalloc takes large allocations in, so a budget filled to its
//    capacity does not make cudaMalloc fail. Its capacity is an accounting
//    limit, by default the GPU's free memory when the Device is made less a
//    headroom for the CUDA libraries and frameworks that allocate later
//    (CudaDefaultCapacity); cudaMalloc may still fail below it when others
//    use the GPU, and then Allocate throws kOutOfMemory with the books
//    unchanged (the runtime layer evicts unleased models and retries).
//  * CopyToDevice copies the source through pinned staging buffers
//    (cudaHostAlloc) and cudaMemcpyAsync on the device's own non-blocking
//    stream, overlapping the host-side memcpy of one chunk with the DMA of
//    the previous one. It returns once the last chunk is staged, so the
//    source may be reused at once; the data is on the GPU when Synchronize()
//    returns. CopyToHost is pipelined the same way and returns when the
//    destination holds the data. Concurrent copies share the staging
//    buffers, each holding one only while it fills or drains it. Waits for
//    the GPU block (events with cudaEventBlockingSync): a waiting thread
//    sleeps rather than spins.
//  * Freeing waits for the copies issued on the device's stream before it
//    calls cudaFree (which the CUDA documentation says only *may*
//    synchronise), so a copy still in flight never lands in memory already
//    handed to the next allocation.
//  * An error of an asynchronous copy may surface only at the next copy or
//    Synchronize(), as kCopyFailed. A sticky error, one after which CUDA
//    fails every later call in the process (an illegal address, a launch
//    failure, a misaligned access by any kernel in the context, an assert in
//    a kernel, ...), marks the device unusable: that call and every later one
//    throw kUnavailable "... context corrupted ...: the process must
//    restart", and DeviceStats::unusable says so.
//  * The caller's CUDA state is left as it was. Every call makes this GPU's
//    primary context current on the calling thread for its duration and
//    then restores exactly the context that was current before, none
//    included (through the driver API's cuCtxGetCurrent/cuCtxSetCurrent,
//    reached through the runtime, so nothing links libcuda): a thread that
//    never chose a GPU, and a process that uses only cuda:1, never get a
//    context on GPU 0 from modelcache. The runtime's last error is cleared of
//    the errors modelcache's own calls left, and only when no other error
//    was pending before the call: another library's pending error is never
//    cleared.
//  * fork(): CudaAvailable(), CudaDeviceCount() and everything else here
//    initialise the CUDA driver, and a child process forked after that
//    cannot use CUDA (a CUDA limitation). A server that forks its workers
//    should make its devices in the workers, after the fork, or start them
//    with spawn rather than fork.
#ifndef MODELCACHE_DEVICE_CUDA_DEVICE_H_
#define MODELCACHE_DEVICE_CUDA_DEVICE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/device/device.h"

namespace modelcache::device {

// The unit cudaMalloc hands out large allocations in; a CUDA device's books
// count every allocation rounded up to it.
inline constexpr uint64_t kCudaAllocationGranularity = uint64_t{2} << 20;
// The least memory the default capacity leaves free for others.
inline constexpr uint64_t kCudaMinHeadroomBytes = uint64_t{1} << 30;
// The share of the GPU's total memory the default capacity leaves free when
// that is more than kCudaMinHeadroomBytes: 1/20 (5%).
inline constexpr uint64_t kCudaHeadroomDivisor = 20;

// The capacity a CUDA device gets by default: `free_bytes` less a headroom
// of max(kCudaMinHeadroomBytes, total_bytes / kCudaHeadroomDivisor), rounded
// down to kCudaAllocationGranularity; 0 when the headroom is more than what
// is free. The headroom is for what CUDA libraries and frameworks allocate
// after the device is made: cuBLAS and cuDNN workspaces, PyTorch's caching
// allocator, activations.
constexpr uint64_t CudaDefaultCapacity(uint64_t free_bytes,
                                       uint64_t total_bytes) {
  const uint64_t share = total_bytes / kCudaHeadroomDivisor;
  const uint64_t headroom =
      share > kCudaMinHeadroomBytes ? share : kCudaMinHeadroomBytes;
  if (free_bytes <= headroom) return 0;
  const uint64_t capacity = free_bytes - headroom;
  return capacity - capacity % kCudaAllocationGranularity;
}

struct CudaDeviceOptions {
  // The accounting capacity. 0: CudaDefaultCapacity of the GPU's free and
  // total memory when the Device is made (cudaMemGetInfo); if that is 0,
  // making the device throws kUnavailable. Any other value is taken as is,
  // even beyond the GPU's memory (cudaMalloc then decides).
  uint64_t capacity_bytes = 0;
  // Size and number of the pinned staging buffers each device keeps. The
  // copy pipeline keeps up to `staging_buffers` chunks in flight. >= 1 each.
  uint64_t staging_buffer_bytes = uint64_t{8} << 20;
  int staging_buffers = 2;
};

// True when this build has the CUDA backend and at least one GPU can be used
// (cudaGetDeviceCount succeeds with a count > 0). Never throws. Initialises
// the CUDA driver (see fork() above).
bool CudaAvailable();
// Why CudaAvailable() is false, with the CUDA runtime's and driver's
// versions ("cudaGetDeviceCount: CUDA driver version is insufficient for
// CUDA runtime version (cudaErrorInsufficientDriver); runtime 13.0, driver
// 12.4", "built without CUDA", "no CUDA GPU is visible ..."); empty when it
// is true.
std::string CudaUnavailableReason();
// The number of usable GPUs; 0 when CUDA is unavailable. Never throws.
int CudaDeviceCount();

// One Device per GPU, named "cuda:0", "cuda:1", ...; empty when CUDA is
// unavailable. Throws DeviceError kUnavailable if a GPU that exists cannot be
// set up (its context, stream or staging buffers, or no room under the
// default capacity), or kInvalidArgument for bad options.
std::vector<std::unique_ptr<Device>> CudaDevices(
    const CudaDeviceOptions& options = {});

// The Device for GPU `ordinal`. Throws DeviceError kUnavailable when CUDA is
// unavailable or there is no such GPU, kInvalidArgument for bad options.
std::unique_ptr<Device> MakeCudaDevice(int ordinal,
                                       const CudaDeviceOptions& options = {});

// The cudaStream_t every copy of `device` runs on, for ordering other work
// after those copies (cudaStreamWaitEvent on an event recorded on it)
// without a full Synchronize(); null when `device` is not a CUDA device.
// Work enqueued on it delays the device's own copies, Synchronize and frees:
// never enqueue work that waits for them.
void* CudaStreamOf(const Device& device);

}  // namespace modelcache::device

#endif  // MODELCACHE_DEVICE_CUDA_DEVICE_H_
