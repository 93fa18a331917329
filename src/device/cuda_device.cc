// CudaDevice: device memory, pinned staging, asynchronous copies.
//
// Compiled by the host compiler against the CUDA runtime API (no kernels, no
// nvcc), only when CMake found the toolkit; cuda_unavailable.cc stands in
// otherwise.
//
// Per device:
//   stream_   a non-blocking stream that carries every copy of this device,
//             so copies complete in issue order and never synchronise with
//             the legacy default stream.
//   slots_    `staging_buffers` pinned host buffers of staging_buffer_bytes
//             each, every one with an event recorded after the last DMA that
//             used it.
//
// CopyToDevice, per chunk: wait for the slot's event (its previous DMA is
// done), memcpy the chunk into the slot, cudaMemcpyAsync slot -> device on
// stream_, record the slot's event. Slots rotate, so the host memcpy of one
// chunk overlaps the DMA of the previous ones. It returns once the last chunk
// is staged: the caller's source is no longer read, and Synchronize()
// (cudaStreamSynchronize) waits for the DMA.
//
// CopyToHost keeps up to `staging_buffers` DMAs device -> slot in flight; as
// each completes (its event) the chunk is copied out of the slot and the
// slot is reused for the next chunk. Returns when the destination is full.
// Being on stream_, it is ordered after every earlier CopyToDevice.
//
// Locking: staging_mu_ serialises the users of the staging slots (one copy
// at a time per device; copies share one stream and one copy engine per
// direction anyway). It is a leaf; the base class's lock is never held while
// the backend runs. Allocate, Free and Synchronize do not take it:
// cudaMalloc/cudaFree/cudaStreamSynchronize are thread-safe.
//
// Freeing: cudaFree waits for pending work on the device, so a buffer freed
// right after an unsynchronised CopyToDevice is not freed under its DMA.
//
// Current device: the CUDA runtime's current device is per thread. Each call
// makes this GPU current (cudaSetDevice) and restores the caller's previous
// one on return (DeviceScope).
#include "modelcache/device/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/base/mutex.h"

namespace modelcache::device {

namespace {

std::string CudaMessage(const char* call, cudaError_t error) {
  return std::string(call) + ": " + cudaGetErrorString(error) + " (" +
         cudaGetErrorName(error) + ")";
}

// Makes `ordinal` the calling thread's current device for a scope.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ == ordinal) {
      previous_ = -1;
      error_ = cudaSuccess;
      return;
    }
    error_ = cudaSetDevice(ordinal);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// cudaGetDeviceCount, and why it failed. Clears the runtime's last error.
int DeviceCount(std::string* why_not) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    if (why_not != nullptr) *why_not = CudaMessage("cudaGetDeviceCount", error);
    return 0;
  }
  if (count <= 0 && why_not != nullptr) *why_not = "no CUDA GPU is visible";
  return std::max(count, 0);
}

class CudaDevice final : public Device {
 public:
  // Everything is created in Init(); the constructor cannot fail.
  CudaDevice(int ordinal, uint64_t capacity, const CudaDeviceOptions& options)
      : Device("cuda:" + std::to_string(ordinal), DeviceKind::kCuda, capacity),
        ordinal_(ordinal),
        chunk_bytes_(options.staging_buffer_bytes),
        slot_count_(options.staging_buffers) {}

  ~CudaDevice() override {
    DeviceScope scope(ordinal_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    base::MutexLock lock(&staging_mu_);
    for (Slot& slot : slots_) {
      if (slot.event != nullptr) cudaEventDestroy(slot.event);
      if (slot.host != nullptr) cudaFreeHost(slot.host);
    }
    cudaGetLastError();
  }

  // Creates the stream and the staging slots. Throws kUnavailable.
  void Init() {
    DeviceScope scope(ordinal_);
    Check(scope.error(), "cudaSetDevice", DeviceErrorCode::kUnavailable);
    Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags", DeviceErrorCode::kUnavailable);
    base::MutexLock lock(&staging_mu_);
    slots_.resize(static_cast<size_t>(slot_count_));
    for (Slot& slot : slots_) {
      Check(cudaHostAlloc(&slot.host, chunk_bytes_, cudaHostAllocPortable),
            "cudaHostAlloc of the pinned staging buffers",
            DeviceErrorCode::kUnavailable);
      Check(cudaEventCreateWithFlags(&slot.event, cudaEventDisableTiming),
            "cudaEventCreateWithFlags", DeviceErrorCode::kUnavailable);
    }
  }

 protected:
  void* DoAllocate(uint64_t bytes) override {
    DeviceScope scope(ordinal_);
    Check(scope.error(), "cudaSetDevice", DeviceErrorCode::kUnavailable);
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();  // an out-of-memory error is not sticky: clear it
      Fail(error == cudaErrorMemoryAllocation ? DeviceErrorCode::kOutOfMemory
                                              : DeviceErrorCode::kUnavailable,
           "cannot allocate " + FormatBytes(bytes) + ": " +
               CudaMessage("cudaMalloc", error));
    }
    return data;
  }

  void DoFree(void* data, uint64_t /*bytes*/) noexcept override {
    if (data == nullptr) return;
    DeviceScope scope(ordinal_);
    // Nothing sensible to do about a failure here (typically a context
    // already torn down at process exit); the bytes are returned regardless.
    if (cudaFree(data) != cudaSuccess) cudaGetLastError();
  }

  void DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                      std::span<const std::byte> src)
      MC_EXCLUDES(staging_mu_) override {
    DeviceScope scope(ordinal_);
    Check(scope.error(), "cudaSetDevice", DeviceErrorCode::kCopyFailed);
    auto* device = static_cast<std::byte*>(dst.data()) + offset;
    base::MutexLock lock(&staging_mu_);
    for (uint64_t done = 0; done < src.size();) {
      const uint64_t n = std::min<uint64_t>(chunk_bytes_, src.size() - done);
      Slot& slot = slots_[next_slot_];
      next_slot_ = (next_slot_ + 1) % slots_.size();
      Check(cudaEventSynchronize(slot.event), "cudaEventSynchronize",
            DeviceErrorCode::kCopyFailed);
      std::memcpy(slot.host, src.data() + done, n);
      Check(cudaMemcpyAsync(device + done, slot.host, n, cudaMemcpyHostToDevice,
                            stream_),
            "cudaMemcpyAsync (host to device)", DeviceErrorCode::kCopyFailed);
      Check(cudaEventRecord(slot.event, stream_), "cudaEventRecord",
            DeviceErrorCode::kCopyFailed);
      done += n;
    }
  }

  void DoCopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                    uint64_t offset) MC_EXCLUDES(staging_mu_) override {
    DeviceScope scope(ordinal_);
    Check(scope.error(), "cudaSetDevice", DeviceErrorCode::kCopyFailed);
    const auto* device = static_cast<const std::byte*>(src.data()) + offset;
    base::MutexLock lock(&staging_mu_);
    const uint64_t chunks = (dst.size() + chunk_bytes_ - 1) / chunk_bytes_;
    const size_t first_slot = next_slot_;
    uint64_t issued = 0;
    for (uint64_t done = 0; done < chunks; ++done) {
      // Keep every slot busy: issue DMAs up to `slots` chunks ahead. A slot
      // is reissued only after its previous chunk was copied out below, and
      // a DMA into it is ordered after any earlier DMA out of it (one
      // stream).
      while (issued < chunks && issued - done < slots_.size()) {
        Slot& slot = slots_[(first_slot + issued) % slots_.size()];
        const uint64_t at = issued * chunk_bytes_;
        Check(cudaMemcpyAsync(slot.host, device + at,
                              std::min<uint64_t>(chunk_bytes_, dst.size() - at),
                              cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync (device to host)", DeviceErrorCode::kCopyFailed);
        Check(cudaEventRecord(slot.event, stream_), "cudaEventRecord",
              DeviceErrorCode::kCopyFailed);
        ++issued;
      }
      Slot& slot = slots_[(first_slot + done) % slots_.size()];
      const uint64_t at = done * chunk_bytes_;
      Check(cudaEventSynchronize(slot.event), "cudaEventSynchronize",
            DeviceErrorCode::kCopyFailed);
      std::memcpy(dst.data() + at, slot.host,
                  std::min<uint64_t>(chunk_bytes_, dst.size() - at));
    }
    next_slot_ = (first_slot + chunks) % slots_.size();
  }

  void DoSynchronize() override {
    DeviceScope scope(ordinal_);
    Check(scope.error(), "cudaSetDevice", DeviceErrorCode::kCopyFailed);
    Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize",
          DeviceErrorCode::kCopyFailed);
  }

 private:
  struct Slot {
    void* host = nullptr;  // pinned, chunk_bytes_
    cudaEvent_t event = nullptr;
  };

  void Check(cudaError_t error, const char* call, DeviceErrorCode code) const {
    if (error == cudaSuccess) return;
    cudaGetLastError();
    Fail(code, CudaMessage(call, error));
  }

  const int ordinal_;
  const uint64_t chunk_bytes_;
  const int slot_count_;
  cudaStream_t stream_ = nullptr;  // set in Init, then read-only

  base::Mutex staging_mu_;
  std::vector<Slot> slots_ MC_GUARDED_BY(staging_mu_);
  size_t next_slot_ MC_GUARDED_BY(staging_mu_) = 0;
};

void CheckOptions(const CudaDeviceOptions& options) {
  if (options.staging_buffer_bytes == 0 || options.staging_buffers < 1) {
    throw DeviceError(DeviceErrorCode::kInvalidArgument, "cuda",
                      "staging_buffer_bytes and staging_buffers must be >= 1");
  }
}

}  // namespace

bool CudaAvailable() { return DeviceCount(nullptr) > 0; }

std::string CudaUnavailableReason() {
  std::string why_not;
  DeviceCount(&why_not);
  return why_not;
}

int CudaDeviceCount() { return DeviceCount(nullptr); }

std::unique_ptr<Device> MakeCudaDevice(int ordinal,
                                       const CudaDeviceOptions& options) {
  CheckOptions(options);
  const std::string name = "cuda:" + std::to_string(ordinal);
  std::string why_not;
  const int count = DeviceCount(&why_not);
  if (count == 0) {
    throw DeviceError(DeviceErrorCode::kUnavailable, name, why_not);
  }
  if (ordinal < 0 || ordinal >= count) {
    throw DeviceError(DeviceErrorCode::kUnavailable, name,
                      "no such GPU: " + std::to_string(count) +
                          " visible (CUDA_VISIBLE_DEVICES applies)");
  }
  uint64_t capacity = options.capacity_bytes;
  if (capacity == 0) {
    DeviceScope scope(ordinal);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    cudaError_t error = scope.error();
    if (error == cudaSuccess) error = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();
      throw DeviceError(
          DeviceErrorCode::kUnavailable, name,
          CudaMessage(
              scope.error() != cudaSuccess ? "cudaSetDevice" : "cudaMemGetInfo",
              error));
    }
    capacity = free_bytes;
  }
  auto device = std::make_unique<CudaDevice>(ordinal, capacity, options);
  device->Init();
  return device;
}

std::vector<std::unique_ptr<Device>> CudaDevices(
    const CudaDeviceOptions& options) {
  CheckOptions(options);
  std::vector<std::unique_ptr<Device>> devices;
  const int count = DeviceCount(nullptr);
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    devices.push_back(MakeCudaDevice(ordinal, options));
  }
  return devices;
}

}  // namespace modelcache::device
