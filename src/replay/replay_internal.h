// What the untimed and the timed replay share: leases held for a while in
// trace time, by slot number, so that a min-heap of (end time, slot) can
// release them in order; and the untimed replay itself.
#ifndef MODELCACHE_REPLAY_REPLAY_INTERNAL_H_
#define MODELCACHE_REPLAY_REPLAY_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
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

// How many requests the replays read from a source at a time.
constexpr size_t kReadChunk = 4096;

// What an offline policy (Belady) needs of the future: for each request, the
// position of the next request for the same model. Built in one pass over
// the source, before the replay's pass, at 4 bytes per request (the gap to
// the next use; the rare gap of 2^32 - 1 requests or more is kept apart).
class NextUseIndex {
 public:
  // The bytes the index of a trace of `requests` requests takes.
  static uint64_t BytesFor(uint64_t requests) { return requests * 4; }
  // Reads one pass of `source`. Throws Error kInvalidArgument naming the
  // memory needed when that is more than `max_bytes`.
  NextUseIndex(const TraceSource& source, const std::string& policy,
               uint64_t max_bytes);
  // The position of the request after request `i` for the same model, as
  // the policy's hint; infinity when there is none.
  double At(uint64_t i) const {
    const uint32_t gap = gaps_[i];
    if (gap == 0) return std::numeric_limits<double>::infinity();
    if (gap == kFar) return static_cast<double>(far_.at(i));
    return static_cast<double>(i + gap);
  }

 private:
  static constexpr uint32_t kFar = std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t> gaps_;  // 0: no next use
  std::unordered_map<uint64_t, uint64_t> far_;
};

// The untimed replay's own loop, with a policy object rather than a name:
// for an eviction policy alone, every lease taken and given back at once or
// held for `hold_ms`; `options` for its next-use index and its progress.
// Defined in replay.cc.
RunResult ReplayUntimedWith(const TraceSource& source,
                            std::shared_ptr<const EvictionPolicy> policy,
                            uint64_t capacity_bytes, double hold_ms,
                            const SimulateOptions& options = {});

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_REPLAY_INTERNAL_H_
