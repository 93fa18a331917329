// DeviceCache, ModelRuntime and PatchScope.
//
// DeviceCache::Acquire, step by step:
//   1. Take references to the model's host copies from the host store
//      (single flight there: one read however many devices ask).
//   2. Decide how many bytes to place: all of them for kFull; for kPartial,
//      all of them if eviction of unleased models can make room, else what
//      can be had.
//   3. If the model is resident with at least that much on the device, that
//      is a hit. A partial copy when more can be placed now is retired
//      (current users keep it) and placed again, once the room for the new
//      copy is known to be there: a full placement that cannot be had fails
//      with the partial copy still resident. (A concurrent load may still
//      take that room between the check and the new placement; then the new
//      placement fails like any other.)
//   4. Otherwise the device cache reserves the bytes (evicting) and the
//      loader allocates one device buffer, copies the placed tensors into
//      it, and synchronizes. The record's value is a DeviceModel that owns
//      the buffer and the host references, so evicting or removing it frees
//      both, and a failed load frees both.
#include "modelcache/runtime/runtime.h"

#include <algorithm>
#include <cstdint>

namespace modelcache::runtime {

namespace {

CacheOptions DeviceCacheOptionsOf(const device::Device& device,
                                  const DeviceCacheOptions& options) {
  const uint64_t capacity =
      options.capacity_bytes ? options.capacity_bytes : device.capacity_bytes();
  CacheOptions cache;
  cache.name = device.name();
  cache.capacity_bytes = capacity > options.working_reserve_bytes
                             ? capacity - options.working_reserve_bytes
                             : 0;
  cache.policy = options.policy;
  cache.on_event = options.on_event;
  cache.shard_bits = 2;
  return cache;
}

}  // namespace

DeviceCache::DeviceCache(weights::HostWeightStore& host, device::Device& device,
                         DeviceCacheOptions options)
    : host_(host),
      device_(device),
      cache_(DeviceCacheOptionsOf(device, options)) {}

ModelLease DeviceCache::Acquire(const std::string& id,
                                const std::vector<std::string>& files,
                                Placement placement,
                                const AcquireOptions& options) {
  // 1. Host copies.
  std::vector<weights::HostWeights> host;
  uint64_t total = 0;
  for (const std::string& file : files) {
    host.push_back(host_.Acquire(file, options));
    const uint64_t bytes = host.back().weights().data_bytes();
    if (bytes > UINT64_MAX - total) {
      throw Error(ErrorCode::kTooLarge,
                  "model '" + id + "': its files hold more than 2^64 bytes");
    }
    total += bytes;
  }

  // 2. How much to place.
  uint64_t want = total;
  if (placement == Placement::kPartial) {
    want = std::min(total, cache_.budget().ObtainableBytes());
  }

  // 3. A resident copy with enough on the device is a hit.
  const std::string key = cache_.Resolve(id);
  if (auto lease = cache_.Lookup(key)) {
    if (lease->get<DeviceModel>()->bytes_on_device() >= want) {
      return ModelLease(std::move(*lease));
    }
    // More is wanted than this copy has on the device: place it again. The
    // old copy's bytes come back only once it is unloaded, so first make
    // sure the room is there, holding the old copy (our lease keeps it from
    // being evicted meanwhile). If it is not, the failure leaves the old
    // copy and the books as they were.
    const auto entry = cache_.Entry(key);
    const bool sole_holder = entry && entry->leases == 1;
    const uint64_t freed = sole_holder ? lease->bytes() : 0;
    const uint64_t more = want > freed ? want - freed : 0;
    cache_.budget().Reserve(more, {.when_full = options.when_full,
                                   .deadline = options.deadline,
                                   .already_reserved = freed});
    cache_.budget().Release(more);
    lease->Release();
    cache_.Invalidate(key);
  }

  // 4. Place it.
  Lease lease = cache_.Acquire(
      key, want,
      [&] {
        auto model = std::make_shared<DeviceModel>();
        model->id_ = key;
        model->total_bytes_ = total;
        // Greedy in file order: a tensor goes to the device if it fits in
        // what is left of `want`.
        uint64_t placed = 0;
        for (const weights::HostWeights& h : host) {
          for (const weights::TensorInfo& tensor : h.weights().tensors()) {
            const bool fits = tensor.bytes() <= want - placed;
            model->tensors_.push_back(PlacedTensor{
                &tensor, fits, fits ? placed : 0, h.weights().data(tensor)});
            if (fits) placed += tensor.bytes();
          }
        }
        model->buffer_ = device_.Allocate(placed);
        for (const PlacedTensor& t : model->tensors_) {
          if (t.on_device && !t.host.empty()) {
            device_.CopyToDevice(model->buffer_, t.device_offset, t.host);
          }
        }
        device_.Synchronize();
        // The host copies now belong to the placed model.
        model->host_ = std::move(host);
        return Loaded{model, placed, {}};
      },
      options);
  return ModelLease(std::move(lease));
}

ModelRuntime::ModelRuntime(ModelRegistry registry, RuntimeOptions options)
    : registry_(std::move(registry)) {
  weights::HostStoreOptions host;
  host.budget = std::move(options.host_budget);
  host.capacity_bytes = options.host_capacity_bytes;
  host.load = options.load;
  host_ = std::make_unique<weights::HostWeightStore>(std::move(host));
  for (const RuntimeDevice& d : options.devices) {
    devices_.push_back(
        std::make_unique<DeviceCache>(*host_, *d.device, d.options));
  }
}

ModelRuntime::~ModelRuntime() {
  devices_.clear();  // before the host store they hold references into
}

ModelLease ModelRuntime::Acquire(std::string_view model, size_t device_index,
                                 Placement placement,
                                 const AcquireOptions& options) {
  const ModelSpec* spec = registry_.Find(model);
  if (!spec) {
    throw Error(ErrorCode::kNotFound,
                "no model named '" + std::string(model) + "' in the registry");
  }
  if (device_index >= devices_.size()) {
    throw Error(ErrorCode::kInvalidArgument,
                "device index " + std::to_string(device_index) +
                    " out of range: the runtime has " +
                    std::to_string(devices_.size()) + " devices");
  }
  DeviceCache& cache = *devices_[device_index];
  ModelLease lease = cache.Acquire(spec->id, spec->files, placement, options);
  if (spec->pinned) cache.cache().Pin(spec->id);
  return lease;
}

PatchScope::PatchScope(ModelRuntime& runtime, size_t device_index,
                       const std::vector<std::string>& patches,
                       const AcquireOptions& options) {
  // On failure the leases taken so far are released by patches_'s
  // destructor as the exception leaves the constructor.
  for (const std::string& patch : patches) {
    patches_.push_back(
        runtime.Acquire(patch, device_index, Placement::kFull, options));
  }
}

}  // namespace modelcache::runtime
