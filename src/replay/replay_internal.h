// What the untimed and the timed replay share: leases held for a while in
// trace time, by slot number, so that a min-heap of (end time, slot) can
// release them in order; and the untimed replay itself.
#ifndef MODELCACHE_REPLAY_REPLAY_INTERNAL_H_
#define MODELCACHE_REPLAY_REPLAY_INTERNAL_H_

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "modelcache/core/cache.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {

class LeasePool {
 public:
  // Keeps `lease` and returns its slot; slots are reused once released.
  size_t Hold(Lease lease) {
    size_t slot;
    if (free_.empty()) {
      slot = leases_.size();
      leases_.emplace_back();
    } else {
      slot = free_.back();
      free_.pop_back();
    }
    leases_[slot] = std::move(lease);
    return slot;
  }

  void Release(size_t slot) {
    leases_[slot].Release();
    free_.push_back(slot);
  }

  // Releases every lease still held. REQUIRES: before the cache goes.
  void Clear() {
    leases_.clear();
    free_.clear();
  }

 private:
  std::vector<Lease> leases_;
  std::vector<size_t> free_;
};

// The untimed replay's own loop, with a policy object rather than a name:
// for an eviction policy alone, every lease taken and given back at once or
// held for `hold_ms`. Defined in replay.cc.
RunResult ReplayUntimedWith(const Trace& trace,
                            std::shared_ptr<const EvictionPolicy> policy,
                            uint64_t capacity_bytes, double hold_ms);

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_REPLAY_INTERNAL_H_
