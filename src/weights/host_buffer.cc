// Host buffer allocators.
//
// RecyclingHostBufferAllocator invariants (under mu_):
//   R1 retained_bytes_ == sum of retained_[i].bytes <= retain_bytes_.
//   R2 every buffer the upstream allocator handed out and did not take back
//      is in exactly one of retained_ and outstanding_, with the size and
//      alignment it was allocated with.
// Upstream calls are made outside mu_: allocating or freeing gigabytes can
// take milliseconds, and other loads must not queue behind them.
#include "modelcache/weights/host_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>

namespace modelcache::weights {
namespace {

class AlignedAllocator final : public HostBufferAllocator {
 public:
  void* Allocate(uint64_t bytes, size_t alignment) override {
    // aligned_alloc wants a size that is a multiple of the alignment.
    const uint64_t rounded = (bytes + alignment - 1) / alignment * alignment;
    if (rounded < bytes) throw std::bad_alloc();
    void* buffer = std::aligned_alloc(alignment, rounded);
    if (buffer == nullptr) throw std::bad_alloc();
    // Advice only: fewer page faults when the buffer is first written.
    if (alignment >= kHugePageBytes) ::madvise(buffer, rounded, MADV_HUGEPAGE);
    return buffer;
  }
  void Deallocate(void* buffer, uint64_t, size_t) noexcept override {
    std::free(buffer);
  }
};

}  // namespace

std::shared_ptr<HostBufferAllocator> DefaultHostBufferAllocator() {
  static const std::shared_ptr<HostBufferAllocator> allocator =
      std::make_shared<AlignedAllocator>();
  return allocator;
}

RecyclingHostBufferAllocator::RecyclingHostBufferAllocator(
    uint64_t retain_bytes, std::shared_ptr<HostBufferAllocator> upstream)
    : retain_bytes_(retain_bytes),
      upstream_(upstream ? std::move(upstream) : DefaultHostBufferAllocator()) {
}

RecyclingHostBufferAllocator::~RecyclingHostBufferAllocator() {
  Trim();
  base::MutexLock lock(&mu_);
  assert(outstanding_.empty());
}

void* RecyclingHostBufferAllocator::Allocate(uint64_t bytes, size_t alignment) {
  {
    base::MutexLock lock(&mu_);
    // At most a quarter larger; saturating, since `bytes` is the caller's.
    const uint64_t quarter = bytes / 4;
    const uint64_t most =
        bytes > UINT64_MAX - quarter ? UINT64_MAX : bytes + quarter;
    auto best = retained_.end();
    for (auto it = retained_.begin(); it != retained_.end(); ++it) {
      if (it->bytes >= bytes && it->bytes <= most &&
          it->alignment >= alignment &&
          (best == retained_.end() || it->bytes < best->bytes)) {
        best = it;
      }
    }
    if (best != retained_.end()) {
      outstanding_.reserve(outstanding_.size() +
                           1);  // may throw; nothing moved yet
      const Buffer buffer = *best;
      retained_.erase(best);
      retained_bytes_ -= buffer.bytes;
      outstanding_.push_back(buffer);
      ++reused_;
      return buffer.data;
    }
  }
  void* data = upstream_->Allocate(bytes, alignment);
  base::MutexLock lock(&mu_);
  try {
    outstanding_.push_back(Buffer{data, bytes, alignment});
  } catch (...) {
    upstream_->Deallocate(data, bytes, alignment);
    throw;
  }
  ++allocated_;
  return data;
}

void RecyclingHostBufferAllocator::Deallocate(void* data, uint64_t bytes,
                                              size_t alignment) noexcept {
  std::vector<Buffer> to_free;
  Buffer buffer{data, bytes, alignment};
  {
    base::MutexLock lock(&mu_);
    auto it = std::find_if(outstanding_.begin(), outstanding_.end(),
                           [&](const Buffer& b) { return b.data == data; });
    assert(it != outstanding_.end());
    if (it != outstanding_.end()) {
      buffer = *it;
      outstanding_.erase(it);
    }
    // Reserve first, so that nothing below can throw: a buffer that cannot
    // be kept for lack of memory is freed instead.
    bool keep = buffer.bytes <= retain_bytes_;
    if (keep) {
      try {
        to_free.reserve(retained_.size());
        retained_.reserve(retained_.size() + 1);
      } catch (const std::bad_alloc&) {
        keep = false;
      }
    }
    if (keep) {
      while (retained_bytes_ + buffer.bytes > retain_bytes_) {  // oldest first
        to_free.push_back(retained_.front());
        retained_bytes_ -= retained_.front().bytes;
        retained_.erase(retained_.begin());
      }
      retained_.push_back(buffer);
      retained_bytes_ += buffer.bytes;
      buffer.data = nullptr;
    }
  }
  for (const Buffer& b : to_free) {
    upstream_->Deallocate(b.data, b.bytes, b.alignment);
  }
  if (buffer.data != nullptr) {
    upstream_->Deallocate(buffer.data, buffer.bytes, buffer.alignment);
  }
}

void RecyclingHostBufferAllocator::Trim() {
  std::vector<Buffer> to_free;
  {
    base::MutexLock lock(&mu_);
    to_free.swap(retained_);
    retained_bytes_ = 0;
  }
  for (const Buffer& b : to_free) {
    upstream_->Deallocate(b.data, b.bytes, b.alignment);
  }
}

RecyclingStats RecyclingHostBufferAllocator::Stats() const {
  base::MutexLock lock(&mu_);
  RecyclingStats stats;
  stats.reused = reused_;
  stats.allocated = allocated_;
  stats.retained_bytes = retained_bytes_;
  stats.retained_buffers = retained_.size();
  stats.outstanding_buffers = outstanding_.size();
  return stats;
}

}  // namespace modelcache::weights
