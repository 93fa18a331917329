// The multi-device model runtime: real model weights on real devices.
//
//   ModelRuntime
//     ├─ HostWeightStore   one canonical host copy per weight file, in one
//     │                    host RAM budget, shared by every device
//     └─ DeviceCache × N   one per device: a ModelCache of placed models in
//                          that device's budget (its capacity minus a
//                          working-memory reserve)
//
// A placed model holds references to its host copies for as long as it is
// on the device, so a model in use on any device is never evicted from the
// host store beneath it, and the host copy is read once however many devices
// use it. Acquire returns a ModelLease: while it lives the model stays on the
// device.
//
// Placement. kFull puts every tensor on the device, evicting unleased models
// as needed, or fails (kTooLarge, kCapacity). kPartial places a full copy
// whenever eviction of unleased models can make room for one; otherwise it
// puts the tensors that fit (in file order) on the device and leaves the
// rest on the host, and the lease says how much is where. A partial copy is
// replaced by a full one at a later acquire once room has appeared; a kFull
// acquire that cannot get that room fails and leaves the partial copy
// resident, with its device bytes, as it was.
//
// Layout and books. The placed tensors of a model share one device buffer.
// Each starts at an offset that is a multiple of kTensorAlignment (256
// bytes, what cudaMalloc guarantees for a buffer's base and what kernels
// assume of a tensor's), whatever the sizes of the tensors before it, in
// the same file or an earlier one, or of a tensor left on the host. The
// padding between tensors is part of the buffer, and the books count the
// buffer as the device's allocator does: its size rounded up to the
// device's allocation granularity (Device::AllocationSize). That is what a
// placement reserves in the device cache's budget, so the budget and the
// device's books agree byte for byte.
//
// The device's own allocator may refuse memory the books say is free (other
// libraries and processes use the GPU too). When the device allocator runs
// out of memory while unleased models are resident on that device, the
// placement evicts them one at a time (the policy's victim first) and tries
// again; only when none is left does it fail (DeviceError kOutOfMemory).
//
// Failures leave the books unchanged: a failed read, device allocation or
// copy returns every reserved byte and caches nothing. A device found
// unusable (a corrupted CUDA context) fails every placement at once with
// DeviceError kUnavailable; nothing is cached, so nothing retries on it.
#ifndef MODELCACHE_RUNTIME_RUNTIME_H_
#define MODELCACHE_RUNTIME_RUNTIME_H_

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "modelcache/core/cache.h"
#include "modelcache/device/device.h"
#include "modelcache/runtime/registry.h"
#include "modelcache/weights/host_store.h"

namespace modelcache::runtime {

enum class Placement { kFull, kPartial };

// Every placed tensor's device_offset is a multiple of this.
inline constexpr uint64_t kTensorAlignment = 256;

// One tensor of a placed model.
struct PlacedTensor {
  const weights::TensorInfo* info;  // name, dtype, shape
  bool on_device;
  // Into DeviceModel::buffer(), if on_device: a multiple of
  // kTensorAlignment, so buffer().data() + device_offset is as aligned as
  // the buffer (256 bytes on CUDA).
  uint64_t device_offset;
  std::span<const std::byte> host;  // its bytes in the host copy (always valid)
};

// A model's weights placed on one device. Immutable once loaded.
class DeviceModel {
 public:
  const std::string& id() const { return id_; }
  device::Device& device() const { return *buffer_.device(); }
  // The bytes of all the model's tensors (its files' data buffers).
  uint64_t total_bytes() const { return total_bytes_; }
  // The bytes of the tensors placed on the device (padding not counted).
  uint64_t bytes_on_device() const { return bytes_on_device_; }
  // What the placement takes from the device and the device cache's budget:
  // the buffer (tensors and the padding that aligns them), rounded up to the
  // device's allocation granularity.
  uint64_t device_bytes() const {
    return buffer_.device()->AllocationSize(buffer_.size());
  }
  // Every tensor is on the device.
  bool full() const { return full_; }
  const std::vector<PlacedTensor>& tensors() const { return tensors_; }
  // Every on-device tensor, at its device_offset.
  const device::DeviceBuffer& buffer() const { return buffer_; }

 private:
  friend class DeviceCache;
  std::string id_;
  uint64_t total_bytes_ = 0;
  uint64_t bytes_on_device_ = 0;
  bool full_ = false;
  // Declared before buffer_ so that the device memory goes first.
  std::vector<weights::HostWeights> host_;
  device::DeviceBuffer buffer_;
  std::vector<PlacedTensor> tensors_;
};

// A claim on a placed model: it stays on the device while the lease lives.
class ModelLease {
 public:
  ModelLease() = default;
  explicit operator bool() const { return static_cast<bool>(lease_); }
  const DeviceModel& model() const { return *lease_.get<DeviceModel>(); }
  const DeviceModel* operator->() const { return &model(); }
  void Release() { lease_.Release(); }

 private:
  friend class DeviceCache;
  explicit ModelLease(Lease lease) : lease_(std::move(lease)) {}
  Lease lease_;
};

struct DeviceCacheOptions {
  // The bytes models may use on the device; 0 means the device's capacity.
  uint64_t capacity_bytes = 0;
  // Kept free for activations and workspaces: the budget is capacity minus
  // this.
  uint64_t working_reserve_bytes = 0;
  std::shared_ptr<const EvictionPolicy> policy;  // LRU when null
  std::function<void(const CacheEvent&)> on_event;
  // How long a placement waiting for device room may be overtaken by
  // requests for the models that hold it before they drain
  // (CacheOptions::drain_after; budget.h, "Who waits"). A placement never
  // drains the copy it is replacing (the lease it holds while it reserves).
  std::chrono::nanoseconds drain_after = kDefaultDrainAfter;
};

// The models placed on one device.
class DeviceCache {
 public:
  // REQUIRES: `host` and `device` outlive the cache. `host` is this
  // process's HostWeightStore or another source of host copies (a node
  // daemon's: serve::RemoteHostWeights).
  DeviceCache(weights::HostWeightSource& host, device::Device& device,
              DeviceCacheOptions options = {});
  // Frees every placed model's device memory and returns its host
  // references, without any explicit shutdown.
  // REQUIRES: no lease is outstanding.
  ~DeviceCache() = default;

  // Places the model `id`, made of `files`, on this device (see the file
  // comment for placement, layout and books). Throws what the host store,
  // the device or the cache throw: weights::IoError / FormatError,
  // device::DeviceError, modelcache::Error.
  ModelLease Acquire(const std::string& id,
                     const std::vector<std::string>& files,
                     Placement placement = Placement::kFull,
                     const AcquireOptions& options = {});

  device::Device& device() const { return device_; }
  ModelCache& cache() { return cache_; }

 private:
  // device_.Allocate(bytes), evicting unleased models of this cache one at a
  // time while the device's allocator is out of memory.
  // (Budget::EvictLowestRanked picks each victim.)
  device::DeviceBuffer AllocateEvictingIfNeeded(uint64_t bytes);

  weights::HostWeightSource& host_;
  device::Device& device_;
  ModelCache cache_;
};

struct RuntimeDevice {
  device::Device* device;  // not owned; must outlive the runtime
  DeviceCacheOptions options;
};

struct RuntimeOptions {
  // The host RAM budget; when null, one of host_capacity_bytes whose models
  // never drain (kDrainNever): every model placed on a device holds its host
  // copies' leases for as long as it stays there, so a drain of them would
  // wait for device evictions that only device pressure makes. A budget
  // given here keeps its own drain_after.
  std::shared_ptr<Budget> host_budget;
  uint64_t host_capacity_bytes = 0;
  weights::LoadOptions load;
  std::vector<RuntimeDevice> devices;
  // Where host copies come from instead of a store of the runtime's own:
  // for example a node daemon's shared copies (serve::RemoteHostWeights),
  // which it names by model id. When set, host_budget, host_capacity_bytes
  // and load are not used.
  std::shared_ptr<weights::HostWeightSource> host_source;
};

class ModelRuntime {
 public:
  // Names are resolved through the registry (ids and aliases), so the
  // device caches only ever see model ids.
  ModelRuntime(ModelRegistry registry, RuntimeOptions options);
  // REQUIRES: no lease or patch scope is outstanding.
  ~ModelRuntime();

  // A lease on `model` (an id or alias) placed on device `device_index`.
  // Throws Error kNotFound for an unknown model, kInvalidArgument for a bad
  // device index, and whatever DeviceCache::Acquire throws.
  ModelLease Acquire(std::string_view model, size_t device_index,
                     Placement placement = Placement::kFull,
                     const AcquireOptions& options = {});

  const ModelRegistry& registry() const { return registry_; }
  // The runtime's own host store.
  // REQUIRES: RuntimeOptions::host_source was not set.
  weights::HostWeightStore& host() { return *host_; }
  // Where host copies come from: the own store, or host_source.
  weights::HostWeightSource& host_source() { return *source_; }
  size_t device_count() const { return devices_.size(); }
  DeviceCache& device_cache(size_t index) { return *devices_.at(index); }

 private:
  ModelRegistry registry_;
  std::unique_ptr<weights::HostWeightStore> host_;  // null with host_source
  std::shared_ptr<weights::HostWeightSource> source_;
  std::vector<std::unique_ptr<DeviceCache>> devices_;
};

// Patches (LoRA adapters and the like) applied to a model for a region of
// code: the scope holds a lease on every patch model, on one device, from
// construction to destruction, so none can be evicted while it is applied.
class PatchScope {
 public:
  // Acquires every patch (fully placed), or none: if one fails, those already
  // acquired are released and the error propagates.
  PatchScope(ModelRuntime& runtime, size_t device_index,
             const std::vector<std::string>& patches,
             const AcquireOptions& options = {});
  ~PatchScope() = default;  // releases every patch
  PatchScope(const PatchScope&) = delete;
  PatchScope& operator=(const PatchScope&) = delete;

  const std::vector<ModelLease>& patches() const { return patches_; }

 private:
  std::vector<ModelLease> patches_;
};

}  // namespace modelcache::runtime

#endif  // MODELCACHE_RUNTIME_RUNTIME_H_
