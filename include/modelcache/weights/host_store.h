// The host weight store: one canonical host copy per weight file, shared by
// every user (every device cache) and counted once in the host budget.
//
// The store is a ModelCache keyed by file identity (device, inode, size,
// mtime), so it inherits the cache's guarantees: a file is loaded at most
// once however many users race for it; each reference is a lease, released
// exactly once; a copy with references is never evicted; invalidation
// retires a referenced copy until its last holder lets go; release is safe
// from any context. A copy nobody references stays resident and evictable
// until the budget needs its bytes (Prune() frees them at once).
//
// HostWeightHolder is the per-user side: it remembers every reference its
// user took and returns all of them when it is destroyed, with or without an
// explicit ReleaseAll(), so a user that goes away can never leave phantom
// bytes in the shared budget.
#ifndef MODELCACHE_WEIGHTS_HOST_STORE_H_
#define MODELCACHE_WEIGHTS_HOST_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "modelcache/base/mutex.h"
#include "modelcache/core/cache.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::weights {

struct HostStoreOptions {
  std::string name = "host";
  // The host RAM budget, possibly shared; when null, one of capacity_bytes.
  std::shared_ptr<Budget> budget;
  uint64_t capacity_bytes = 0;
  std::shared_ptr<const EvictionPolicy> policy;  // LRU when null
  LoadOptions load;                              // how copies are read
  std::function<void(const CacheEvent&)> on_event;
};

// One reference to a canonical host copy. Move-only; Release() (or
// destruction) gives it back exactly once, later calls do nothing.
class HostWeights {
 public:
  HostWeights() = default;
  explicit operator bool() const { return static_cast<bool>(lease_); }
  // REQUIRES: *this holds a reference.
  const WeightSet& weights() const { return *lease_.get<WeightSet>(); }
  void Release() { lease_.Release(); }

 private:
  friend class HostWeightStore;
  explicit HostWeights(Lease lease) : lease_(std::move(lease)) {}
  Lease lease_;
};

class HostWeightStore {
 public:
  explicit HostWeightStore(HostStoreOptions options);
  // REQUIRES: every HostWeights and HostWeightHolder of this store is gone.
  ~HostWeightStore();

  // A reference to the canonical copy of the file at `path` (by identity, so
  // two paths to one file share a copy), loading it if needed. Throws
  // IoError, FormatError, or modelcache::Error (kTooLarge, kCapacity,
  // kTimeout) as ModelCache::Acquire does.
  HostWeights Acquire(const std::string& path,
                      const AcquireOptions& options = {});

  // Retires the copy of the file at `path`: later acquires load it afresh,
  // current holders keep theirs until they let go. kNotFound when no copy of
  // the file's current identity is resident.
  RemoveOutcome Invalidate(const std::string& path);

  // Frees every copy nobody references; returns how many.
  size_t Prune() { return cache_.Prune(); }

  CacheStats Stats() const { return cache_.Stats(); }
  Budget& budget() const { return cache_.budget(); }
  ModelCache& cache() { return cache_; }

  // The cache key of a file: its identity as stat(2) sees it now.
  static std::string IdentityKey(const std::string& path);

 private:
  const LoadOptions load_;
  ModelCache cache_;
};

// The references one user holds. Thread-safe.
class HostWeightHolder {
 public:
  explicit HostWeightHolder(HostWeightStore& store) : store_(store) {}
  // Returns every reference still held.
  ~HostWeightHolder() { ReleaseAll(); }
  HostWeightHolder(const HostWeightHolder&) = delete;
  HostWeightHolder& operator=(const HostWeightHolder&) = delete;

  // Takes one more reference to the copy of `path` and returns its weights,
  // valid until that reference is released.
  const WeightSet& Acquire(const std::string& path,
                           const AcquireOptions& options = {}) MC_EXCLUDES(mu_);

  // Gives back one reference to `weights` taken through this holder. A set
  // this holder holds no reference to (already released, retired and
  // replaced, or another holder's) is left alone: returns false.
  bool Release(const WeightSet& weights) MC_EXCLUDES(mu_);

  // Gives back everything; the holder stays usable.
  void ReleaseAll() MC_EXCLUDES(mu_);

  size_t held() const MC_EXCLUDES(mu_);

 private:
  HostWeightStore& store_;
  mutable base::Mutex mu_;
  std::vector<HostWeights> held_ MC_GUARDED_BY(mu_);
};

}  // namespace modelcache::weights

#endif  // MODELCACHE_WEIGHTS_HOST_STORE_H_
