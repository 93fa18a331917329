// HostWeightStore and HostWeightHolder.
//
// The store adds nothing to the core cache but a key and a loader: the key is
// the file's identity, and the loader opens the file as a WeightSet and
// checks that it is still the file the key names. Bookkeeping (single flight,
// budget, retirement, exactly-once release) is the cache's.
//
// A holder keeps its references in a vector under its mutex. References are
// moved out under the lock and released after it is dropped, so releasing
// (which may free a retired copy and run its deleter) never happens while
// the holder's lock is held.
#include "modelcache/weights/host_store.h"

#include <sys/stat.h>

#include <cerrno>

#include "modelcache/base/text.h"

namespace modelcache::weights {

namespace {

FileIdentity StatIdentity(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int error = errno;
    throw IoError(path, "cannot stat: " + base::ErrnoText(error), error);
  }
  return FileIdentity{static_cast<uint64_t>(st.st_dev),
                      static_cast<uint64_t>(st.st_ino),
                      static_cast<uint64_t>(st.st_size),
                      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
                          st.st_mtim.tv_nsec};
}

std::string KeyOf(const FileIdentity& id) {
  return std::to_string(id.device) + ":" + std::to_string(id.inode) + ":" +
         std::to_string(id.size) + ":" + std::to_string(id.mtime_ns);
}

CacheOptions CacheOptionsOf(HostStoreOptions options) {
  CacheOptions cache;
  cache.name = std::move(options.name);
  cache.budget = std::move(options.budget);
  cache.capacity_bytes = options.capacity_bytes;
  cache.policy = std::move(options.policy);
  cache.on_event = std::move(options.on_event);
  cache.shard_bits = 2;
  return cache;
}

}  // namespace

HostWeightStore::HostWeightStore(HostStoreOptions options)
    : load_(options.load), cache_(CacheOptionsOf(std::move(options))) {}

HostWeightStore::~HostWeightStore() = default;

std::string HostWeightStore::IdentityKey(const std::string& path) {
  return KeyOf(StatIdentity(path));
}

HostWeights HostWeightStore::Acquire(const std::string& path,
                                     const AcquireOptions& options) {
  const FileIdentity identity = StatIdentity(path);
  const std::string key = KeyOf(identity);
  Lease lease = cache_.Acquire(
      key, identity.size,
      [&] {
        auto weights =
            std::make_shared<WeightSet>(WeightSet::Open(path, load_));
        if (!(weights->identity() == identity)) {
          throw IoError(path, "the file changed while it was being opened", 0);
        }
        const uint64_t bytes = weights->data_bytes();
        return Loaded{std::move(weights), bytes, {}};
      },
      options);
  return HostWeights(std::move(lease));
}

std::vector<HostWeights> HostWeightStore::AcquireModel(
    const std::string&, const std::vector<std::string>& files,
    const AcquireOptions& options) {
  std::vector<HostWeights> all;
  all.reserve(files.size());
  for (const std::string& file : files) all.push_back(Acquire(file, options));
  return all;
}

RemoveOutcome HostWeightStore::Invalidate(const std::string& path) {
  return cache_.Invalidate(IdentityKey(path));
}

const WeightSet& HostWeightHolder::Acquire(const std::string& path,
                                           const AcquireOptions& options) {
  HostWeights reference = store_.Acquire(path, options);
  const WeightSet& weights = reference.weights();
  base::MutexLock lock(&mu_);
  held_.push_back(std::move(reference));
  return weights;
}

bool HostWeightHolder::Release(const WeightSet& weights) {
  HostWeights reference;
  {
    base::MutexLock lock(&mu_);
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (&it->weights() == &weights) {
        reference = std::move(*it);
        held_.erase(it);
        break;
      }
    }
  }
  const bool found = static_cast<bool>(reference);
  reference.Release();  // outside the lock
  return found;
}

void HostWeightHolder::ReleaseAll() {
  std::vector<HostWeights> all;
  {
    base::MutexLock lock(&mu_);
    all.swap(held_);
  }
  all.clear();  // outside the lock
}

size_t HostWeightHolder::held() const {
  base::MutexLock lock(&mu_);
  return held_.size();
}

}  // namespace modelcache::weights
