// Host memory for weights loaded with LoadMode::kPread.
//
// A pread load writes every byte of a fresh buffer. Fresh memory is not free:
// the kernel faults each page in and zeroes it before the copy from the page
// cache can land, and on virtual machines the first touch of guest memory may
// also fault in the hypervisor. An inference server that evicts one model to
// load the next pays that on every load although it has just freed a buffer
// of about the right size. RecyclingHostBufferAllocator keeps released
// buffers (up to a byte cap) and hands them to the next load of a similar
// size, so the load is a copy into memory that is already mapped: the
// machine's memcpy bandwidth, not its page-fault rate.
//
// A HostBufferAllocator is also the hook for memory with other properties:
// pinned (page-locked) memory for faster device transfers, or memory bound to
// a NUMA node.
#ifndef MODELCACHE_WEIGHTS_HOST_BUFFER_H_
#define MODELCACHE_WEIGHTS_HOST_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "modelcache/base/mutex.h"

namespace modelcache::weights {

// A transparent huge page on x86-64: the alignment LoadOptions picks for data
// buffers of at least this size, and from which the default allocator
// advises huge pages.
inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Where a kPread load gets its data buffer. Implementations must be safe to
// call from several threads at once.
class HostBufferAllocator {
 public:
  virtual ~HostBufferAllocator() = default;

  // Returns a buffer of at least `bytes` bytes (> 0), aligned to `alignment`
  // (a power of two >= 8). Its contents are unspecified: the loader
  // overwrites every byte it uses. Throws std::bad_alloc when there is no
  // memory.
  virtual void* Allocate(uint64_t bytes, size_t alignment) = 0;

  // Takes back a buffer that Allocate returned, with the same `bytes` and
  // `alignment`. Called exactly once per buffer.
  virtual void Deallocate(void* buffer, uint64_t bytes,
                          size_t alignment) noexcept = 0;
};

// aligned_alloc and free. Buffers aligned to 2 MiB or more are advised as
// transparent huge pages (MADV_HUGEPAGE): 512 times fewer page faults when
// they are first written.
std::shared_ptr<HostBufferAllocator> DefaultHostBufferAllocator();

struct RecyclingStats {
  uint64_t reused = 0;     // Allocate calls served from a retained buffer
  uint64_t allocated = 0;  // Allocate calls passed to the upstream allocator
  uint64_t retained_bytes = 0;  // bytes held for reuse now
  uint64_t retained_buffers = 0;
  uint64_t outstanding_buffers = 0;  // handed out, not yet taken back
};

// Keeps buffers that are released and reuses them.
//
// Allocate serves a request from the smallest retained buffer that is large
// enough, aligned enough, and at most a quarter larger than the request (so
// a small model does not pin a large buffer); otherwise it allocates from
// `upstream`. Deallocate keeps the buffer, first returning the oldest
// retained buffers to `upstream` until the retained bytes fit in
// `retain_bytes`; a buffer larger than `retain_bytes` goes straight back.
//
// Retained bytes are memory the process holds outside every Budget: size
// `retain_bytes` to what the machine can spare (one or two of the largest
// models is enough to recycle each eviction's buffer into the next load).
// Thread-safe. Destroying it returns every retained buffer; buffers still
// handed out must be returned before (a WeightSet keeps its allocator alive
// through a shared_ptr, so this holds by construction).
class RecyclingHostBufferAllocator final : public HostBufferAllocator {
 public:
  explicit RecyclingHostBufferAllocator(
      uint64_t retain_bytes, std::shared_ptr<HostBufferAllocator> upstream =
                                 DefaultHostBufferAllocator());
  ~RecyclingHostBufferAllocator() override;

  void* Allocate(uint64_t bytes, size_t alignment) override MC_EXCLUDES(mu_);
  void Deallocate(void* buffer, uint64_t bytes,
                  size_t alignment) noexcept override MC_EXCLUDES(mu_);

  // Returns every retained buffer to the upstream allocator.
  void Trim() MC_EXCLUDES(mu_);
  RecyclingStats Stats() const MC_EXCLUDES(mu_);
  uint64_t retain_bytes() const { return retain_bytes_; }

 private:
  struct Buffer {
    void* data;
    uint64_t bytes;    // its real size, which may exceed a request's
    size_t alignment;  // its real alignment
  };

  const uint64_t retain_bytes_;
  const std::shared_ptr<HostBufferAllocator> upstream_;
  mutable base::Mutex mu_;
  std::vector<Buffer> retained_ MC_GUARDED_BY(mu_);  // oldest first
  std::vector<Buffer> outstanding_ MC_GUARDED_BY(mu_);
  uint64_t retained_bytes_ MC_GUARDED_BY(mu_) = 0;
  uint64_t reused_ MC_GUARDED_BY(mu_) = 0;
  uint64_t allocated_ MC_GUARDED_BY(mu_) = 0;
};

}  // namespace modelcache::weights

#endif  // MODELCACHE_WEIGHTS_HOST_BUFFER_H_
