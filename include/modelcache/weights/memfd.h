// Host copies in sealed memfds: memory other processes can map and cannot
// change.
//
// `modelcache serve` keeps each model's weights in memfds and hands their
// file descriptors to worker processes, which map them read-only, so N
// workers share one copy. Two steps make a copy safe to hand out:
//
//   1. MemfdHostBufferAllocator gives a LoadMode::kPread load a data buffer
//      that is a memfd of its own (memfd_create(MFD_CLOEXEC |
//      MFD_ALLOW_SEALING)), named so that /proc/PID/maps says what it holds
//      ("/memfd:<name> (deleted)"). The load fills it through a shared,
//      writable mapping.
//   2. Seal() adds F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE |
//      F_SEAL_SEAL and replaces the writable mapping, at the same address,
//      by a read-only one. From then on no process can change the bytes: a
//      writable shared mapping, mprotect(PROT_WRITE) of a read-only one,
//      write(2), ftruncate(2) and punching holes all fail, and since the
//      size can never shrink, no mapping of it can raise SIGBUS. (A private
//      mapping may still be written: copy-on-write, invisible to others.)
//
// Not F_SEAL_WRITE: adding it fails while any writable mapping exists,
// waits for pages pinned by I/O, and on many kernels a memfd with that seal
// cannot be mapped MAP_SHARED at all, even read-only, which is how the
// workers map it. F_SEAL_FUTURE_WRITE gives the same guarantee for every
// mapping and write made after it.
//
// The bytes of a memfd count against the memory of the whole machine (they
// are shmem, shown as Shmem in /proc/meminfo) until the last descriptor and
// the last mapping of it are gone, in whatever process.
#ifndef MODELCACHE_WEIGHTS_MEMFD_H_
#define MODELCACHE_WEIGHTS_MEMFD_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "modelcache/base/mutex.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/weights/host_buffer.h"

namespace modelcache::weights {

// The seals every sealed memfd here carries.
int MemfdSeals();

// `bytes` rounded up to whole pages: what a memfd of that size holds in
// memory (a budget counts this). Saturates at the largest page multiple.
uint64_t PageRoundedBytes(uint64_t bytes);

// The shmem transparent huge page mode, which is what memfds follow:
// the selected word of /sys/kernel/mm/transparent_hugepage/shmem_enabled
// ("always", "within_size", "advise", "never", "deny", "force"), or
// "unavailable" when the kernel has no such file.
std::string ShmemHugePageMode();

// One line saying what a large memfd buffer gets under `mode`, e.g.
// "shmem huge pages: advise (MADV_HUGEPAGE on buffers of 2 MiB alignment)".
std::string DescribeShmemHugePages(const std::string& mode);

// A memfd named `name` holding `bytes`, sealed as above (the bytes are
// written before the seals). Throws Error kIo naming `name`.
base::UniqueFd CreateSealedMemfd(const std::string& name,
                                 std::span<const std::byte> bytes);

// Each buffer is a memfd of its own named `name` (memfd_create truncates
// names to 249 bytes), mapped shared and writable until Seal(). The memfd
// holds the request rounded up to pages; a buffer aligned to 2 MiB or more is
// advised as huge pages (MADV_HUGEPAGE), which the kernel honours as
// ShmemHugePageMode() says. Thread-safe.
//
// Allocate throws std::bad_alloc when the memory cannot be mapped, and
// Error kIo when memfd_create or ftruncate fail (too many open files, for
// example). Deallocate unmaps the buffer and closes the memfd: the memory
// is freed once no other process maps it or holds a descriptor of it.
class MemfdHostBufferAllocator final : public HostBufferAllocator {
 public:
  explicit MemfdHostBufferAllocator(std::string name);
  // REQUIRES: every buffer was deallocated.
  ~MemfdHostBufferAllocator() override;

  void* Allocate(uint64_t bytes, size_t alignment) override MC_EXCLUDES(mu_);
  void Deallocate(void* buffer, uint64_t bytes,
                  size_t alignment) noexcept override MC_EXCLUDES(mu_);

  // Seals the memfd behind `buffer` (see the top of this file) and maps it
  // read-only at the same address: the buffer's contents and address do not
  // change, writing to it from now on faults. Throws Error kIo.
  // REQUIRES: `buffer` was returned by Allocate and not deallocated; the
  // caller has finished writing it.
  void Seal(const void* buffer) MC_EXCLUDES(mu_);

  // The memfd behind `buffer` (owned by the allocator: valid until
  // Deallocate), or -1 when `buffer` is not one of this allocator's.
  int fd(const void* buffer) const MC_EXCLUDES(mu_);
  // The bytes that memfd holds (the request rounded up to pages), or 0.
  uint64_t memfd_bytes(const void* buffer) const MC_EXCLUDES(mu_);

  const std::string& name() const { return name_; }

 private:
  struct Buffer {
    int fd;
    uint64_t bytes;  // the memfd's size, a whole number of pages
    bool sealed;
  };

  const std::string name_;
  mutable base::Mutex mu_;
  std::map<const void*, Buffer> buffers_ MC_GUARDED_BY(mu_);
};

}  // namespace modelcache::weights

#endif  // MODELCACHE_WEIGHTS_MEMFD_H_
