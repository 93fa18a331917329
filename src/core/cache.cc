// The public face of the core, include/modelcache/core/cache.h: Lease,
// ModelCache (a thin forwarder to CacheCore), and the names of its enums.
#include "modelcache/core/cache.h"

#include "cache_internal.h"

namespace modelcache {

// ---- Lease ----

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    core_ = other.core_;
    record_ = other.record_;
    other.core_ = nullptr;
    other.record_ = nullptr;
  }
  return *this;
}

void* Lease::value() const { return record_ ? record_->value.get() : nullptr; }

const std::string& Lease::key() const {
  static const std::string kEmpty;
  return record_ ? record_->key : kEmpty;
}

uint64_t Lease::bytes() const { return record_ ? record_->bytes : 0; }

uint64_t Lease::id() const { return record_ ? record_->id : 0; }

void Lease::Release() {
  if (record_ == nullptr) return;
  detail::CacheCore* core = core_;
  detail::Record* record = record_;
  core_ = nullptr;
  record_ = nullptr;
  core->ReleaseLease(record);
}

// ---- ModelCache ----

ModelCache::ModelCache(CacheOptions options)
    : core_(std::make_shared<detail::CacheCore>(std::move(options))) {
  core_->budget().Register(core_);
}

ModelCache::~ModelCache() { core_->Shutdown(); }

Lease ModelCache::Acquire(std::string_view key, uint64_t expected_bytes,
                          const Loader& loader, const AcquireOptions& options) {
  return core_->Acquire(key, expected_bytes, loader, options);
}

std::optional<Lease> ModelCache::Lookup(std::string_view key) {
  return core_->Lookup(key, /*count_miss=*/true, /*policy_hint=*/0);
}

std::optional<Lease> ModelCache::TryAcquire(std::string_view key,
                                            double policy_hint) {
  return core_->Lookup(key, /*count_miss=*/false, policy_hint);
}

void ModelCache::Prefetch(std::string_view key, uint64_t expected_bytes,
                          const Loader& loader, const AcquireOptions& options) {
  core_->Prefetch(key, expected_bytes, loader, options);
}

RemoveOutcome ModelCache::Remove(std::string_view key,
                                 Clock::time_point deadline) {
  return core_->Remove(key, deadline, /*invalidate=*/false);
}

RemoveOutcome ModelCache::Invalidate(std::string_view key,
                                     Clock::time_point deadline) {
  return core_->Remove(key, deadline, /*invalidate=*/true);
}

void ModelCache::Pin(std::string_view key) { core_->SetPinned(key, true); }
void ModelCache::Unpin(std::string_view key) { core_->SetPinned(key, false); }

void ModelCache::AddAlias(std::string_view alias, std::string_view canonical) {
  core_->AddAlias(alias, canonical);
}
bool ModelCache::RemoveAlias(std::string_view alias) {
  return core_->RemoveAlias(alias);
}
std::string ModelCache::Resolve(std::string_view key) const {
  return core_->Resolve(key);
}

size_t ModelCache::EvictExpired() { return core_->EvictExpired(); }
size_t ModelCache::RunKeepAlive() { return core_->RunKeepAlive(); }
size_t ModelCache::Prune() { return core_->Prune(); }
uint64_t ModelCache::SetCapacity(uint64_t capacity_bytes) {
  return core_->budget().SetCapacity(capacity_bytes);
}

CacheStats ModelCache::Stats() const { return core_->Stats(); }
std::vector<EntryInfo> ModelCache::Entries() const { return core_->Entries(); }
std::optional<EntryInfo> ModelCache::Entry(std::string_view key) const {
  return core_->Entry(key);
}
Budget& ModelCache::budget() const { return core_->budget(); }
const std::string& ModelCache::name() const { return core_->name(); }
uint64_t ModelCache::CheckInvariants() const {
  return core_->CheckInvariants();
}

const char* EventTypeName(EventType type) {
  switch (type) {
    case EventType::kLoaded:
      return "loaded";
    case EventType::kLoadFailed:
      return "load_failed";
    case EventType::kEvicted:
      return "evicted";
    case EventType::kExpired:
      return "expired";
    case EventType::kUnloadFailed:
      return "unload_failed";
    case EventType::kRemoved:
      return "removed";
    case EventType::kRetired:
      return "retired";
    case EventType::kRetiredFreed:
      return "retired_freed";
    case EventType::kDrainStarted:
      return "drain_started";
    case EventType::kDrainEnded:
      return "drain_ended";
  }
  return "unknown";
}

const char* EntryStateName(EntryState state) {
  switch (state) {
    case EntryState::kLoading:
      return "loading";
    case EntryState::kResident:
      return "resident";
    case EntryState::kUnloading:
      return "unloading";
    case EntryState::kRetired:
      return "retired";
  }
  return "unknown";
}

}  // namespace modelcache
