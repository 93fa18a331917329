// CudaDevice: device memory, pinned staging, asynchronous copies.
//
// Compiled by the host compiler against the CUDA runtime API (no kernels, no
// nvcc), only when CMake found the toolkit; cuda_unavailable.cc stands in
// otherwise. The few driver API functions used (contexts) are reached
// through cudaGetDriverEntryPoint*, so nothing links libcuda: a build made
// on a machine without a driver runs there and reports CUDA unavailable.
//
// Per device:
//   context_  the GPU's primary context, retained for the device's life
//             (cuDevicePrimaryCtxRetain: the one the runtime API and the
//             frameworks use).
//   stream_   a non-blocking stream that carries every copy of this device,
//             so copies complete in issue order and never synchronise with
//             the legacy default stream.
//   slots_    `staging_buffers` pinned host buffers of staging_buffer_bytes
//             each, every one with an event (blocking sync) recorded after
//             the last DMA that used it. Fixed after Init.
//   busy_     which slots a copy holds now, under staging_mu_.
//
// The caller's state. Every entry point runs inside a ContextScope: it notes
// whether the runtime had an error pending for this thread, makes context_
// current if it is not (cuCtxSetCurrent), and on leaving restores the
// context that was current (none included) and clears the runtime's last
// error only if none was pending before. No cudaSetDevice is ever called, so
// the runtime's per-thread device is never touched and no context is made
// on a GPU the caller did not ask for.
//
// CopyToDevice, per chunk: claim a free slot (waiting only while holding
// none), wait for the slot's event (its previous DMA is done), memcpy the
// chunk into the slot, cudaMemcpyAsync slot -> device on stream_, record the
// slot's event, release the slot. Slots rotate, so the host memcpy of one
// chunk overlaps the DMA of the previous ones, and concurrent copies share
// the slots chunk by chunk. It returns once the last chunk is staged: the
// caller's source is no longer read, and Synchronize() waits for the DMA.
//
// CopyToHost keeps up to `staging_buffers` DMAs device -> slot in flight:
// it claims its first slot waiting if need be and further ones only if free
// now, so a thread that holds slots never waits for another one (no
// deadlock between copies). As each DMA completes (its event) the chunk is
// copied out of the slot and the slot is released. A DMA into a slot is
// ordered after any earlier DMA out of it (one stream). Being on stream_, it
// is ordered after every earlier CopyToDevice.
//
// Locking: staging_mu_ guards only busy_ and next_slot_, held for the claim
// and the release, never across a wait for the GPU or a host memcpy (which
// may page-fault on an mmap'd file). It is a leaf; the base class's lock is
// never held while the backend runs. Allocate, Free and Synchronize do not
// take it: cudaMalloc/cudaFree/stream and event calls are thread-safe.
//
// Failures. A copy that fails after it issued a DMA waits for the stream
// before it releases its slots and throws: a failed event record would leave
// a DMA in flight that the slot's event does not cover, and the next user of
// the slot would overwrite it under the DMA. A sticky error (the context is
// corrupted; see IsStickyError) marks the device unusable (base class) and
// throws kUnavailable; every later call then fails in the base class without
// reaching CUDA.
//
// Freeing: DoFree waits for stream_ (an event with blocking sync) before
// cudaFree, which the CUDA documentation says only *may* synchronise: a copy
// still in flight into the buffer lands before its memory can be reused.
#include "modelcache/device/cuda_device.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/base/mutex.h"

namespace modelcache::device {

namespace {

// The errors after which CUDA fails every later call in the process: the
// CUDA runtime's documentation says of each that it "leaves the process in
// an inconsistent state and any further CUDA work will return the same
// error. To continue using CUDA, the process must be terminated and
// relaunched." The driver's CUresult values are the same numbers. By
// number, so that the list compiles with toolkits that lack the newer names.
bool IsStickyError(int code) {
  switch (code) {
    case 226:  // cudaErrorContained
    case 700:  // cudaErrorIllegalAddress
    case 702:  // cudaErrorLaunchTimeout
    case 710:  // cudaErrorAssert
    case 714:  // cudaErrorHardwareStackError
    case 715:  // cudaErrorIllegalInstruction
    case 716:  // cudaErrorMisalignedAddress
    case 717:  // cudaErrorInvalidAddressSpace
    case 718:  // cudaErrorInvalidPc
    case 719:  // cudaErrorLaunchFailure
    case 721:  // cudaErrorTensorMemoryLeak
    case 810:  // cudaErrorMpsClientTerminated
    case 911:  // cudaErrorExternalDevice
      return true;
    default:
      return false;
  }
}

std::string CudaMessage(const char* call, cudaError_t error) {
  return std::string(call) + ": " + cudaGetErrorString(error) + " (" +
         cudaGetErrorName(error) + ")";
}

std::string VersionText(int version) {
  return std::to_string(version / 1000) + "." +
         std::to_string(version % 1000 / 10);
}

// "CUDA runtime 13.0, driver 12.4", for messages about availability.
std::string Versions() {
  int runtime = 0;
  int driver = 0;
  const bool have_runtime = cudaRuntimeGetVersion(&runtime) == cudaSuccess;
  const bool have_driver = cudaDriverGetVersion(&driver) == cudaSuccess;
  std::string text = "CUDA runtime " +
                     (have_runtime ? VersionText(runtime) : "unknown") +
                     ", driver ";
  if (!have_driver) return text + "unknown";
  if (driver == 0) return text + "none (no NVIDIA driver is installed)";
  text += VersionText(driver);
  if (have_runtime && driver < runtime) {
    text += " (older than the runtime: update the driver)";
  }
  return text;
}

// Keeps the calling thread's runtime error state as the caller left it: at
// construction it notes whether an error was pending; at destruction it
// clears what modelcache's own calls left, unless an error was pending
// before (another library's, which that library must still see). Declared
// first in every scope that calls CUDA, so it is destroyed last.
class ErrorStateGuard {
 public:
  ErrorStateGuard() : pending_(cudaPeekAtLastError() != cudaSuccess) {}
  ~ErrorStateGuard() {
    if (!pending_) cudaGetLastError();
  }
  ErrorStateGuard(const ErrorStateGuard&) = delete;
  ErrorStateGuard& operator=(const ErrorStateGuard&) = delete;

 private:
  const bool pending_;
};

// The driver API functions used, reached through the runtime.
struct DriverApi {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_ctx_release)(CUdevice) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
};

// One driver function by name, as of CUDA 11.0 (every function used has
// existed since then; cuDevicePrimaryCtxRelease resolves to its _v2).
template <typename Fn>
bool Resolve(const char* symbol, Fn* fn) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t error = cudaGetDriverEntryPointByVersion(
      symbol, &address, 11000, cudaEnableDefault, &status);
#elif CUDART_VERSION >= 12000
  const cudaError_t error =
      cudaGetDriverEntryPoint(symbol, &address, cudaEnableDefault, &status);
#else
  const cudaError_t error =
      cudaGetDriverEntryPoint(symbol, &address, cudaEnableDefault);
  status = cudaDriverEntryPointSuccess;
#endif
  if (error != cudaSuccess || status != cudaDriverEntryPointSuccess ||
      address == nullptr) {
    return false;
  }
  *fn = reinterpret_cast<Fn>(address);
  return true;
}

// The driver API, resolved once; null with *why_not set if the driver lacks
// a function. REQUIRES: cudaGetDeviceCount succeeded.
const DriverApi* Driver(std::string* why_not) {
  static const std::pair<DriverApi, std::string> resolved = [] {
    ErrorStateGuard errors;
    DriverApi api;
    std::string missing;
    auto need = [&](const char* symbol, auto* fn) {
      if (!Resolve(symbol, fn)) {
        missing += (missing.empty() ? "" : ", ") + std::string(symbol);
      }
    };
    need("cuCtxGetCurrent", &api.ctx_get_current);
    need("cuCtxSetCurrent", &api.ctx_set_current);
    need("cuDeviceGet", &api.device_get);
    need("cuDevicePrimaryCtxRetain", &api.primary_ctx_retain);
    need("cuDevicePrimaryCtxRelease", &api.primary_ctx_release);
    Resolve("cuGetErrorName", &api.get_error_name);  // only for messages
    return std::make_pair(api, missing.empty()
                                   ? std::string()
                                   : "the CUDA driver lacks " + missing + " (" +
                                         Versions() + ")");
  }();
  if (!resolved.second.empty()) {
    if (why_not != nullptr) *why_not = resolved.second;
    return nullptr;
  }
  return &resolved.first;
}

std::string DriverMessage(const DriverApi& api, const char* call,
                          CUresult result) {
  const char* name = nullptr;
  if (api.get_error_name == nullptr ||
      api.get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "unknown";
  }
  return std::string(call) + ": " + name + " (CUresult " +
         std::to_string(static_cast<int>(result)) + ")";
}

// Makes `context` current on the calling thread for a scope, then restores
// exactly the context that was current (none included). result() says
// whether it could; on failure nothing was changed.
class ContextScope {
 public:
  ContextScope(const DriverApi& api, CUcontext context) : api_(api) {
    CUcontext current = nullptr;
    result_ = api_.ctx_get_current(&current);
    if (result_ != CUDA_SUCCESS || current == context) return;
    result_ = api_.ctx_set_current(context);
    if (result_ == CUDA_SUCCESS) {
      saved_ = current;
      restore_ = true;
    }
  }
  ~ContextScope() {
    if (restore_) api_.ctx_set_current(saved_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

  CUresult result() const { return result_; }

 private:
  ErrorStateGuard errors_;  // first: destroyed after the context is restored
  const DriverApi& api_;
  CUresult result_ = CUDA_SUCCESS;
  CUcontext saved_ = nullptr;
  bool restore_ = false;
};

// cudaGetDeviceCount, and why it failed.
int DeviceCount(std::string* why_not) {
  ErrorStateGuard errors;
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    if (why_not != nullptr) {
      *why_not = CudaMessage("cudaGetDeviceCount", error) + "; " + Versions();
    }
    return 0;
  }
  if (count <= 0 && why_not != nullptr) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    *why_not = std::string("no CUDA GPU is visible") +
               (visible != nullptr
                    ? " (CUDA_VISIBLE_DEVICES=\"" + std::string(visible) + "\")"
                    : std::string()) +
               "; " + Versions();
  }
  return std::max(count, 0);
}

// Releases a retained primary context unless Disown() was called.
class PrimaryContextHold {
 public:
  PrimaryContextHold(const DriverApi& api, CUdevice device)
      : api_(api), device_(device) {}
  ~PrimaryContextHold() {
    if (held_) api_.primary_ctx_release(device_);
  }
  PrimaryContextHold(const PrimaryContextHold&) = delete;
  PrimaryContextHold& operator=(const PrimaryContextHold&) = delete;
  void Held() { held_ = true; }
  void Disown() { held_ = false; }

 private:
  const DriverApi& api_;
  const CUdevice device_;
  bool held_ = false;
};

class CudaDevice final : public Device {
 public:
  // Takes over one retain of `context`, the primary context of `device`.
  // Everything else is created in Init(); the constructor cannot fail.
  CudaDevice(int ordinal, uint64_t capacity, const DriverApi& api,
             CUdevice device, CUcontext context,
             const CudaDeviceOptions& options)
      : Device("cuda:" + std::to_string(ordinal), DeviceKind::kCuda, capacity,
               kCudaAllocationGranularity),
        api_(api),
        cu_device_(device),
        context_(context),
        chunk_bytes_(options.staging_buffer_bytes),
        slot_count_(static_cast<size_t>(options.staging_buffers)) {}

  ~CudaDevice() override {
    {
      ContextScope scope(api_, context_);
      if (scope.result() == CUDA_SUCCESS) {
        if (stream_ != nullptr) {
          WaitForStream();
          cudaStreamDestroy(stream_);
        }
        for (Slot& slot : slots_) {
          if (slot.event != nullptr) cudaEventDestroy(slot.event);
          if (slot.host != nullptr) cudaFreeHost(slot.host);
        }
      }
    }
    api_.primary_ctx_release(cu_device_);
  }

  // Creates the stream and the staging slots. Throws kUnavailable.
  void Init() {
    ContextScope scope(api_, context_);
    CheckContext(scope, DeviceErrorCode::kUnavailable);
    Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags", DeviceErrorCode::kUnavailable);
    slots_.resize(slot_count_);
    {
      base::MutexLock lock(&staging_mu_);
      busy_.assign(slot_count_, false);
    }
    for (Slot& slot : slots_) {
      Check(cudaHostAlloc(&slot.host, chunk_bytes_, cudaHostAllocPortable),
            "cudaHostAlloc of the pinned staging buffers",
            DeviceErrorCode::kUnavailable);
      Check(cudaEventCreateWithFlags(
                &slot.event, cudaEventDisableTiming | cudaEventBlockingSync),
            "cudaEventCreateWithFlags", DeviceErrorCode::kUnavailable);
    }
  }

  cudaStream_t stream() const { return stream_; }

 protected:
  void* DoAllocate(uint64_t bytes) override {
    if (bytes == 0) return nullptr;  // no CUDA call for nothing
    ContextScope scope(api_, context_);
    CheckContext(scope, DeviceErrorCode::kUnavailable);
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, bytes);
    if (error == cudaSuccess) return data;
    Raise(error,
          "cannot allocate " + FormatBytes(bytes) + ": " +
              CudaMessage("cudaMalloc", error),
          error == cudaErrorMemoryAllocation ? DeviceErrorCode::kOutOfMemory
                                             : DeviceErrorCode::kUnavailable);
  }

  void DoFree(void* data, uint64_t /*bytes*/) noexcept override {
    if (data == nullptr) return;
    ContextScope scope(api_, context_);
    // Nothing sensible to do about a failure here (a corrupted context, a
    // context already torn down at process exit); the bytes are returned to
    // the books regardless.
    if (scope.result() != CUDA_SUCCESS) return;
    if (usable()) {
      const cudaError_t waited = WaitForStream();  // copies into `data` land
      if (IsStickyError(waited)) {
        try {  // marks the device unusable; a free cannot throw
          Raise(waited, CudaMessage("waiting for copies before a free", waited),
                DeviceErrorCode::kCopyFailed);
        } catch (...) {
        }
      }
    }
    cudaFree(data);
  }

  void DoCopyToDevice(const DeviceBuffer& dst, uint64_t offset,
                      std::span<const std::byte> src)
      MC_EXCLUDES(staging_mu_) override {
    ContextScope scope(api_, context_);
    CheckContext(scope, DeviceErrorCode::kCopyFailed);
    auto* device = static_cast<std::byte*>(dst.data()) + offset;
    for (uint64_t done = 0; done < src.size();) {
      const uint64_t n = std::min<uint64_t>(chunk_bytes_, src.size() - done);
      const size_t s = ClaimSlot();
      const Slot& slot = slots_[s];
      const char* call = "cudaEventSynchronize (a staging buffer's last copy)";
      cudaError_t error = cudaEventSynchronize(slot.event);
      if (error == cudaSuccess) {
        std::memcpy(slot.host, src.data() + done, n);
        call = "cudaMemcpyAsync (host to device)";
        error = cudaMemcpyAsync(device + done, slot.host, n,
                                cudaMemcpyHostToDevice, stream_);
        if (error == cudaSuccess) {
          call = "cudaEventRecord";
          error = cudaEventRecord(slot.event, stream_);
        }
      }
      if (error != cudaSuccess) {
        // A DMA out of this slot may be in flight without the slot's event
        // covering it: it must end before anyone refills the slot.
        WaitForStream();
        ReleaseSlot(s);
        Raise(error, CudaMessage(call, error), DeviceErrorCode::kCopyFailed);
      }
      ReleaseSlot(s);
      done += n;
    }
  }

  void DoCopyToHost(std::span<std::byte> dst, const DeviceBuffer& src,
                    uint64_t offset) MC_EXCLUDES(staging_mu_) override {
    ContextScope scope(api_, context_);
    CheckContext(scope, DeviceErrorCode::kCopyFailed);
    const auto* device = static_cast<const std::byte*>(src.data()) + offset;
    struct InFlight {
      size_t slot;
      uint64_t at;
      uint64_t bytes;
    };
    std::deque<InFlight> in_flight;  // claimed slots, DMAs issued, in order
    uint64_t next = 0;               // the first byte not yet issued
    const char* call = nullptr;
    cudaError_t error = cudaSuccess;
    while (error == cudaSuccess && (next < dst.size() || !in_flight.empty())) {
      // Keep the slots busy: issue DMAs ahead, waiting for a slot only while
      // holding none.
      while (next < dst.size() && in_flight.size() < slots_.size()) {
        const std::optional<size_t> s =
            in_flight.empty() ? ClaimSlot() : TryClaimSlot();
        if (!s) break;
        const uint64_t n = std::min<uint64_t>(chunk_bytes_, dst.size() - next);
        in_flight.push_back({*s, next, n});
        next += n;
        call = "cudaMemcpyAsync (device to host)";
        error = cudaMemcpyAsync(slots_[*s].host, device + in_flight.back().at,
                                n, cudaMemcpyDeviceToHost, stream_);
        if (error != cudaSuccess) break;
        call = "cudaEventRecord";
        error = cudaEventRecord(slots_[*s].event, stream_);
        if (error != cudaSuccess) break;
      }
      if (error != cudaSuccess) break;
      const InFlight chunk = in_flight.front();
      call = "cudaEventSynchronize (a copy back)";
      error = cudaEventSynchronize(slots_[chunk.slot].event);
      if (error != cudaSuccess) break;
      std::memcpy(dst.data() + chunk.at, slots_[chunk.slot].host, chunk.bytes);
      in_flight.pop_front();
      ReleaseSlot(chunk.slot);
    }
    if (error == cudaSuccess) return;
    WaitForStream();  // DMAs may still be writing into the slots we hold
    for (const InFlight& chunk : in_flight) ReleaseSlot(chunk.slot);
    Raise(error, CudaMessage(call, error), DeviceErrorCode::kCopyFailed);
  }

  void DoSynchronize() override {
    ContextScope scope(api_, context_);
    CheckContext(scope, DeviceErrorCode::kCopyFailed);
    const cudaError_t error = WaitForStream();
    if (error != cudaSuccess) {
      Raise(error,
            CudaMessage("waiting for the copies on the device's stream", error),
            DeviceErrorCode::kCopyFailed);
    }
  }

 private:
  struct Slot {
    void* host = nullptr;  // pinned, chunk_bytes_
    cudaEvent_t event = nullptr;
  };

  // Throws for a sticky error (the device becomes unusable) or else
  // DeviceError `code` with `message`.
  [[noreturn]] void Raise(int error, const std::string& message,
                          DeviceErrorCode code) {
    if (IsStickyError(error)) {
      FailUnusable(
          "CUDA context corrupted: " + message +
          "; CUDA fails every later call in this process (a kernel's illegal "
          "or misaligned access, launch failure or assert poisons the whole "
          "context): the process must restart to use the GPU again");
    }
    Fail(code, message);
  }

  void Check(cudaError_t error, const char* call, DeviceErrorCode code) {
    if (error != cudaSuccess) Raise(error, CudaMessage(call, error), code);
  }

  void CheckContext(const ContextScope& scope, DeviceErrorCode code) {
    if (scope.result() != CUDA_SUCCESS) {
      Raise(scope.result(),
            DriverMessage(api_, "making the GPU's context current",
                          scope.result()),
            code);
    }
  }

  // Waits, sleeping, until everything enqueued on stream_ so far is done.
  // Returns the first error.
  cudaError_t WaitForStream() {
    cudaEvent_t event = nullptr;
    cudaError_t error = cudaEventCreateWithFlags(
        &event, cudaEventDisableTiming | cudaEventBlockingSync);
    if (error == cudaSuccess) {
      error = cudaEventRecord(event, stream_);
      if (error == cudaSuccess) error = cudaEventSynchronize(event);
      cudaEventDestroy(event);
      if (error == cudaSuccess || IsStickyError(error)) return error;
    }
    // No event to sleep on: wait all the same (spinning).
    const cudaError_t synchronized = cudaStreamSynchronize(stream_);
    return synchronized != cudaSuccess ? synchronized : error;
  }

  size_t ClaimSlot() MC_EXCLUDES(staging_mu_) {
    base::MutexLock lock(&staging_mu_);
    for (;;) {
      if (const std::optional<size_t> s = FreeSlotLocked()) return *s;
      slot_released_.Wait(&staging_mu_);
    }
  }

  std::optional<size_t> TryClaimSlot() MC_EXCLUDES(staging_mu_) {
    base::MutexLock lock(&staging_mu_);
    return FreeSlotLocked();
  }

  // Claims the free slot after the one claimed last, if any.
  std::optional<size_t> FreeSlotLocked() MC_REQUIRES(staging_mu_) {
    for (size_t i = 0; i < busy_.size(); ++i) {
      const size_t s = (next_slot_ + i) % busy_.size();
      if (!busy_[s]) {
        busy_[s] = true;
        next_slot_ = (s + 1) % busy_.size();
        return s;
      }
    }
    return std::nullopt;
  }

  void ReleaseSlot(size_t s) MC_EXCLUDES(staging_mu_) {
    {
      base::MutexLock lock(&staging_mu_);
      assert(busy_[s]);
      busy_[s] = false;
    }
    slot_released_.NotifyAll();
  }

  const DriverApi& api_;
  const CUdevice cu_device_;
  const CUcontext context_;
  const uint64_t chunk_bytes_;
  const size_t slot_count_;
  cudaStream_t stream_ = nullptr;  // set in Init, then read-only
  std::vector<Slot> slots_;        // set in Init, then read-only

  base::Mutex staging_mu_;
  base::CondVar slot_released_;
  std::vector<bool> busy_ MC_GUARDED_BY(staging_mu_);
  size_t next_slot_ MC_GUARDED_BY(staging_mu_) = 0;
};

void CheckOptions(const CudaDeviceOptions& options) {
  if (options.staging_buffer_bytes == 0 || options.staging_buffers < 1) {
    throw DeviceError(DeviceErrorCode::kInvalidArgument, "cuda",
                      "staging_buffer_bytes and staging_buffers must be >= 1");
  }
}

}  // namespace

namespace {

// The GPUs that can be used: visible, with a driver that has every function
// the backend needs.
int UsableDeviceCount(std::string* why_not) {
  const int count = DeviceCount(why_not);
  if (count > 0 && Driver(why_not) == nullptr) return 0;
  return count;
}

}  // namespace

bool CudaAvailable() { return UsableDeviceCount(nullptr) > 0; }

std::string CudaUnavailableReason() {
  std::string why_not;
  UsableDeviceCount(&why_not);
  return why_not;
}

int CudaDeviceCount() { return UsableDeviceCount(nullptr); }

std::unique_ptr<Device> MakeCudaDevice(int ordinal,
                                       const CudaDeviceOptions& options) {
  CheckOptions(options);
  const std::string name = "cuda:" + std::to_string(ordinal);
  std::string why_not;
  const int count = UsableDeviceCount(&why_not);
  if (count == 0) {
    throw DeviceError(DeviceErrorCode::kUnavailable, name, why_not);
  }
  if (ordinal < 0 || ordinal >= count) {
    throw DeviceError(DeviceErrorCode::kUnavailable, name,
                      "no such GPU: " + std::to_string(count) +
                          " visible (CUDA_VISIBLE_DEVICES applies)");
  }
  const DriverApi* api = Driver(&why_not);
  assert(api != nullptr);
  ErrorStateGuard errors;
  CUdevice cu_device = 0;
  CUresult result = api->device_get(&cu_device, ordinal);
  if (result != CUDA_SUCCESS) {
    throw DeviceError(DeviceErrorCode::kUnavailable, name,
                      DriverMessage(*api, "cuDeviceGet", result));
  }
  CUcontext context = nullptr;
  PrimaryContextHold hold(*api, cu_device);
  result = api->primary_ctx_retain(&context, cu_device);
  if (result != CUDA_SUCCESS) {
    throw DeviceError(DeviceErrorCode::kUnavailable, name,
                      DriverMessage(*api, "cuDevicePrimaryCtxRetain", result));
  }
  hold.Held();
  uint64_t capacity = options.capacity_bytes;
  if (capacity == 0) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    cudaError_t error = cudaSuccess;
    {
      ContextScope scope(*api, context);
      if (scope.result() != CUDA_SUCCESS) {
        throw DeviceError(
            DeviceErrorCode::kUnavailable, name,
            DriverMessage(*api, "cuCtxSetCurrent", scope.result()));
      }
      error = cudaMemGetInfo(&free_bytes, &total_bytes);
    }
    if (error != cudaSuccess) {
      throw DeviceError(DeviceErrorCode::kUnavailable, name,
                        CudaMessage("cudaMemGetInfo", error));
    }
    capacity = CudaDefaultCapacity(free_bytes, total_bytes);
    if (capacity == 0) {
      throw DeviceError(
          DeviceErrorCode::kUnavailable, name,
          "only " + FormatBytes(free_bytes) + " of " +
              FormatBytes(total_bytes) +
              " is free, no more than the headroom the default capacity "
              "leaves for others (max(1 GiB, 5%)); pass capacity_bytes");
    }
  }
  hold.Disown();  // the device releases it
  auto device = std::make_unique<CudaDevice>(ordinal, capacity, *api, cu_device,
                                             context, options);
  device->Init();
  return device;
}

std::vector<std::unique_ptr<Device>> CudaDevices(
    const CudaDeviceOptions& options) {
  CheckOptions(options);
  std::vector<std::unique_ptr<Device>> devices;
  const int count = CudaDeviceCount();
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    devices.push_back(MakeCudaDevice(ordinal, options));
  }
  return devices;
}

void* CudaStreamOf(const Device& device) {
  const auto* cuda = dynamic_cast<const CudaDevice*>(&device);
  return cuda != nullptr ? static_cast<void*>(cuda->stream()) : nullptr;
}

}  // namespace modelcache::device
