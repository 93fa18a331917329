// DeviceCache, ModelRuntime and PatchScope.
//
// DeviceCache::Acquire, step by step:
//   1. Take references to the model's host copies from the host store
//      (single flight there: one read however many devices ask).
//   2. Lay the tensors out (PlanLayout: each at the next multiple of
//      kTensorAlignment) and decide how much to place: every tensor for
//      kFull; for kPartial, every tensor if eviction of unleased models can
//      make room for the whole buffer, else the tensors that fit (greedy, in
//      file order) in a buffer whose rounded size can be had. The bytes
//      reserved are the buffer's size rounded up to the device's allocation
//      granularity: exactly what the device's books will count.
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
//
// Eviction when the device's allocator runs out (AllocateEvictingIfNeeded).
// The budget only knows the bytes of this cache; memory others took from
// the GPU shows up as an out-of-memory error from the allocator while the
// budget still has room. The loader then evicts one unleased model and
// tries again, until the allocation succeeds or nothing is left to evict.
// The core cache picks the victim: EvictOne reserves, for an instant, one
// byte more than the budget has free, which makes Budget::Reserve evict the
// policy's lowest-ranked unleased, unpinned record (whose value, the placed
// model, is dropped on this thread, so its device memory is freed before
// Reserve returns), or fail at once with kCapacity when there is none. The
// loader runs with no cache lock held, so it may reserve. The momentary
// reservation may show in the budget's high-water mark, never beyond its
// capacity.
#include "modelcache/runtime/runtime.h"

#include <algorithm>
#include <cstdint>

namespace modelcache::runtime {

namespace {

// Where each tensor goes in the device buffer.
struct Layout {
  std::vector<PlacedTensor> tensors;
  uint64_t buffer_bytes = 0;     // the end of the last placed tensor
  uint64_t bytes_on_device = 0;  // of the placed tensors, padding excluded
  bool full = true;              // every tensor placed
};

// Greedy in file order: a tensor goes to the device, at the next multiple
// of kTensorAlignment, if it ends within `limit` bytes of buffer; zero-byte
// tensors always do, at offset 0. Exact for every size: no sum wraps.
Layout PlanLayout(const std::vector<weights::HostWeights>& host,
                  uint64_t limit) {
  Layout layout;
  for (const weights::HostWeights& h : host) {
    for (const weights::TensorInfo& tensor : h.weights().tensors()) {
      const uint64_t bytes = tensor.bytes();
      const uint64_t end = layout.buffer_bytes;
      const uint64_t pad =
          (kTensorAlignment - end % kTensorAlignment) % kTensorAlignment;
      const bool fits = bytes == 0 || (end <= limit && pad <= limit - end &&
                                       bytes <= limit - end - pad);
      const uint64_t offset = bytes == 0 ? 0 : end + pad;
      layout.tensors.push_back(PlacedTensor{&tensor, fits, fits ? offset : 0,
                                            h.weights().data(tensor)});
      if (!fits) {
        layout.full = false;
        continue;
      }
      if (bytes > 0) layout.buffer_bytes = offset + bytes;
      layout.bytes_on_device += bytes;
    }
  }
  return layout;
}

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
  cache.drain_after = options.drain_after;
  return cache;
}

}  // namespace

DeviceCache::DeviceCache(weights::HostWeightSource& host,
                         device::Device& device, DeviceCacheOptions options)
    : host_(host),
      device_(device),
      cache_(DeviceCacheOptionsOf(device, options)) {}

ModelLease DeviceCache::Acquire(const std::string& id,
                                const std::vector<std::string>& files,
                                Placement placement,
                                const AcquireOptions& options) {
  // 1. Host copies.
  std::vector<weights::HostWeights> host =
      host_.AcquireModel(id, files, options);
  uint64_t total = 0;
  for (const weights::HostWeights& h : host) {
    const uint64_t bytes = h.weights().data_bytes();
    if (bytes > UINT64_MAX - total) {
      throw Error(ErrorCode::kTooLarge,
                  "model '" + id + "': its files hold more than 2^64 bytes");
    }
    total += bytes;
  }

  // 2. The layout, and how much to place.
  Layout layout = PlanLayout(host, UINT64_MAX);
  if (!layout.full) {
    throw Error(ErrorCode::kTooLarge,
                "model '" + id +
                    "': its tensors, each aligned to 256 bytes, take more than "
                    "2^64 bytes");
  }
  uint64_t want = device_.AllocationSize(layout.buffer_bytes);
  if (placement == Placement::kPartial) {
    const uint64_t obtainable = cache_.budget().ObtainableBytes();
    if (want > obtainable) {
      layout = PlanLayout(
          host, obtainable - obtainable % device_.allocation_granularity());
      want = device_.AllocationSize(layout.buffer_bytes);
    }
  }

  // 3. A resident copy with at least as much on the device is a hit.
  const std::string key = cache_.Resolve(id);
  if (auto lease = cache_.Lookup(key)) {
    const DeviceModel& resident = *lease->get<DeviceModel>();
    if (resident.full() ||
        resident.bytes_on_device() >= layout.bytes_on_device) {
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
    // The old copy's lease is held across the wait: a drain for this
    // placement must not take it (it would wait for itself).
    std::vector<uint64_t> holds = options.holds;
    holds.push_back(lease->id());
    cache_.budget().Reserve(more,
                            {.when_full = options.when_full,
                             .deadline = options.deadline,
                             .already_reserved = freed,
                             .interrupt = &options.interrupt,
                             .arrival = options.arrival,
                             .holds = std::move(holds),
                             .for_what = "'" + key + "' on " + device_.name()});
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
        model->bytes_on_device_ = layout.bytes_on_device;
        model->full_ = layout.full;
        model->tensors_ = std::move(layout.tensors);
        model->buffer_ = AllocateEvictingIfNeeded(layout.buffer_bytes);
        for (const PlacedTensor& t : model->tensors_) {
          if (t.on_device && !t.host.empty()) {
            device_.CopyToDevice(model->buffer_, t.device_offset, t.host);
          }
        }
        device_.Synchronize();
        // The host copies now belong to the placed model.
        model->host_ = std::move(host);
        return Loaded{model, want, {}};
      },
      options);
  return ModelLease(std::move(lease));
}

device::DeviceBuffer DeviceCache::AllocateEvictingIfNeeded(uint64_t bytes) {
  for (;;) {
    try {
      return device_.Allocate(bytes);
    } catch (const device::DeviceError& e) {
      if (e.device_code() != device::DeviceErrorCode::kOutOfMemory ||
          !cache_.budget().EvictLowestRanked()) {
        throw;
      }
    }
  }
}

ModelRuntime::ModelRuntime(ModelRegistry registry, RuntimeOptions options)
    : registry_(std::move(registry)) {
  if (options.host_source) {
    source_ = std::move(options.host_source);
  } else {
    weights::HostStoreOptions host;
    host.budget = options.host_budget
                      ? std::move(options.host_budget)
                      : std::make_shared<Budget>(
                            options.host_capacity_bytes, host.name,
                            BudgetOptions{.drain_after = kDrainNever});
    host.load = options.load;
    host_ = std::make_unique<weights::HostWeightStore>(std::move(host));
    // Not owning: host_ outlives every use of source_.
    source_ = std::shared_ptr<weights::HostWeightSource>(
        std::shared_ptr<void>(), host_.get());
  }
  for (const RuntimeDevice& d : options.devices) {
    devices_.push_back(
        std::make_unique<DeviceCache>(*source_, *d.device, d.options));
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
