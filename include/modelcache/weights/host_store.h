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
  // A reference to a copy held elsewhere, such as another process's store
  // mapped here (serve::RemoteHostWeights): `weights` keeps it alive, and
  // this reference ends when the pointer is dropped.
  explicit HostWeights(std::shared_ptr<const WeightSet> weights)
      : shared_(std::move(weights)) {}
  explicit operator bool() const {
    return static_cast<bool>(lease_) || static_cast<bool>(shared_);
  }
  // REQUIRES: *this holds a reference.
  const WeightSet& weights() const {
    return shared_ ? *shared_ : *lease_.get<WeightSet>();
  }
  void Release() {
    lease_.Release();
    shared_.reset();
  }

 private:
  friend class HostWeightStore;
  explicit HostWeights(Lease lease) : lease_(std::move(lease)) {}
  Lease lease_;
  std::shared_ptr<const WeightSet> shared_;
};

// Where the host copies of a model's files come from: this process's own
// HostWeightStore, or the copies a node daemon shares between processes
// (serve::RemoteHostWeights). The runtime's device caches take their host
// copies from one, so they run unchanged on either.
class HostWeightSource {
 public:
  virtual ~HostWeightSource() = default;

  // One reference per file of the model `model`, in the order of `files`,
  // each valid until released. A store loads `files` by path; a source that
  // names models by id (a daemon's catalog) may take `model` alone, and
  // then returns the catalog's files. Throws what the source throws:
  // IoError, FormatError, modelcache::Error (kTooLarge, kCapacity, kTimeout,
  // kNotFound, kUnavailable).
  virtual std::vector<HostWeights> AcquireModel(
      const std::string& model, const std::vector<std::string>& files,
      const AcquireOptions& options) = 0;
};

class HostWeightStore : public HostWeightSource {
 public:
  explicit HostWeightStore(HostStoreOptions options);
  // REQUIRES: every HostWeights and HostWeightHolder of this store is gone.
  ~HostWeightStore() override;

  // A reference to the canonical copy of the file at `path` (by identity, so
  // two paths to one file share a copy), loading it if needed. Throws
  // IoError, FormatError, or modelcache::Error (kTooLarge, kCapacity,
  // kTimeout) as ModelCache::Acquire does.
  HostWeights Acquire(const std::string& path,
                      const AcquireOptions& options = {});

  // Acquire of each of `files` in turn; `model` only names it. If one
  // fails, the references already taken are returned and the error
  // propagates.
  std::vector<HostWeights> AcquireModel(const std::string& model,
                                        const std::vector<std::string>& files,
                                        const AcquireOptions& options) override;

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
