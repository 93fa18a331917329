// Sealed memfds: MemfdHostBufferAllocator and CreateSealedMemfd.
//
// A buffer's life: Allocate creates the memfd, sizes it to whole pages and
// maps it shared and writable (at the alignment asked for: a PROT_NONE
// reservation of size + alignment is made, the memfd is mapped over its
// aligned part with MAP_FIXED and the slack is unmapped). The load writes it.
// Seal adds the seals and maps the memfd again over the same range with
// PROT_READ and MAP_FIXED, which replaces the writable mapping atomically:
// no moment exists at which the address is unmapped. A read-only shared
// mapping made after F_SEAL_FUTURE_WRITE has no VM_MAYWRITE, so not even
// mprotect can make it writable again. Deallocate unmaps and closes.
#include "modelcache/weights/memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <fstream>
#include <new>
#include <utility>

#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"
#include "util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1
#endif

namespace modelcache::weights {
namespace {

uint64_t PageBytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

Error MemfdError(const std::string& name, const std::string& what, int error) {
  return Error(ErrorCode::kIo, "memfd '" + base::Printable(name, 256) + "': " +
                                   what + ": " + base::ErrnoText(error));
}

// memfd_create's limit on a name: 249 bytes (NAME_MAX minus "memfd:").
std::string MemfdName(const std::string& name) {
  return name.size() <= 249 ? name : name.substr(0, 249);
}

base::UniqueFd NewMemfd(const std::string& name, uint64_t bytes) {
  base::UniqueFd fd(
      ::memfd_create(MemfdName(name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) {
    const int e = errno;
    throw MemfdError(name, "memfd_create failed", e);
  }
  if (bytes > static_cast<uint64_t>(INT64_MAX) ||
      ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    const int e = bytes > static_cast<uint64_t>(INT64_MAX) ? EFBIG : errno;
    throw MemfdError(
        name, "cannot size it to " + std::to_string(bytes) + " bytes", e);
  }
  return fd;
}

void AddSeals(int fd, const std::string& name) {
  if (::fcntl(fd, F_ADD_SEALS, MemfdSeals()) != 0) {
    const int e = errno;
    throw MemfdError(name, "cannot seal", e);
  }
}

}  // namespace

int MemfdSeals() {
  return F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
}

uint64_t PageRoundedBytes(uint64_t bytes) {
  const uint64_t page = PageBytes();
  const uint64_t rest = bytes % page;
  if (rest == 0) return bytes;
  if (bytes > UINT64_MAX - (page - rest)) return UINT64_MAX / page * page;
  return bytes + (page - rest);
}

std::string ShmemHugePageMode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string line;
  if (!in || !std::getline(in, line)) return "unavailable";
  const size_t open = line.find('[');
  const size_t close = line.find(']', open);
  if (open == std::string::npos || close == std::string::npos) {
    return "unavailable";
  }
  return line.substr(open + 1, close - open - 1);
}

std::string DescribeShmemHugePages(const std::string& mode) {
  std::string what;
  if (mode == "advise") {
    what = "MADV_HUGEPAGE on buffers of 2 MiB alignment takes effect";
  } else if (mode == "always" || mode == "force") {
    what = "every buffer may use huge pages";
  } else if (mode == "within_size") {
    what = "huge pages within each memfd's size";
  } else {
    what = "small pages only (MADV_HUGEPAGE has no effect)";
  }
  return "shmem huge pages: " + mode + " (" + what + ")";
}

base::UniqueFd CreateSealedMemfd(const std::string& name,
                                 std::span<const std::byte> bytes) {
  base::UniqueFd fd = NewMemfd(name, bytes.size());
  uint64_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd.get(), bytes.data() + done,
                               bytes.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      throw MemfdError(name, "cannot write", e);
    }
    done += static_cast<uint64_t>(n);
  }
  AddSeals(fd.get(), name);
  return fd;
}

MemfdHostBufferAllocator::MemfdHostBufferAllocator(std::string name)
    : name_(std::move(name)) {}

MemfdHostBufferAllocator::~MemfdHostBufferAllocator() {
  base::MutexLock lock(&mu_);
  assert(buffers_.empty());
}

void* MemfdHostBufferAllocator::Allocate(uint64_t bytes, size_t alignment) {
  const uint64_t size = PageRoundedBytes(bytes == 0 ? 1 : bytes);
  base::UniqueFd fd = NewMemfd(name_, size);
  const size_t page = PageBytes();
  void* buffer = nullptr;
  if (alignment <= page) {
    buffer =
        ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (buffer == MAP_FAILED) throw std::bad_alloc();
  } else {
    if (size > SIZE_MAX - alignment) throw std::bad_alloc();
    const size_t reserved = size + alignment;
    void* reservation =
        ::mmap(nullptr, reserved, PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (reservation == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(reservation);
    const uintptr_t aligned = (start + alignment - 1) / alignment * alignment;
    buffer =
        ::mmap(reinterpret_cast<void*>(aligned), size, PROT_READ | PROT_WRITE,
               MAP_SHARED | MAP_FIXED, fd.get(), 0);
    if (buffer == MAP_FAILED) {
      ::munmap(reservation, reserved);
      throw std::bad_alloc();
    }
    if (aligned > start) ::munmap(reservation, aligned - start);
    const uintptr_t end = aligned + size;
    if (start + reserved > end) {
      ::munmap(reinterpret_cast<void*>(end), start + reserved - end);
    }
  }
  // Advice only: the kernel follows it as ShmemHugePageMode() allows.
  if (alignment >= kHugePageBytes) ::madvise(buffer, size, MADV_HUGEPAGE);
  try {
    base::MutexLock lock(&mu_);
    buffers_.emplace(buffer, Buffer{fd.get(), size, false});
  } catch (...) {
    ::munmap(buffer, size);
    throw;
  }
  fd.release();  // the map owns it now
  return buffer;
}

void MemfdHostBufferAllocator::Deallocate(void* buffer, uint64_t,
                                          size_t) noexcept {
  Buffer found{-1, 0, false};
  {
    base::MutexLock lock(&mu_);
    const auto it = buffers_.find(buffer);
    assert(it != buffers_.end());
    if (it == buffers_.end()) return;
    found = it->second;
    buffers_.erase(it);
  }
  ::munmap(buffer, found.bytes);
  ::close(found.fd);
}

void MemfdHostBufferAllocator::Seal(const void* buffer) {
  Buffer found{-1, 0, false};
  {
    base::MutexLock lock(&mu_);
    const auto it = buffers_.find(buffer);
    if (it == buffers_.end()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "memfd '" + base::Printable(name_, 256) +
                      "': Seal() of a buffer this allocator did not give");
    }
    if (it->second.sealed) return;
    found = it->second;
  }
  AddSeals(found.fd, name_);
  void* address = const_cast<void*>(buffer);
  if (::mmap(address, found.bytes, PROT_READ, MAP_SHARED | MAP_FIXED, found.fd,
             0) == MAP_FAILED) {
    // The writable mapping is still in place; the seals alone already keep
    // every other process from changing the bytes.
    const int e = errno;
    throw MemfdError(name_, "cannot map it read-only", e);
  }
  if (found.bytes >= kHugePageBytes) {
    ::madvise(address, found.bytes, MADV_HUGEPAGE);
  }
  base::MutexLock lock(&mu_);
  const auto it = buffers_.find(buffer);
  if (it != buffers_.end()) it->second.sealed = true;
}

int MemfdHostBufferAllocator::fd(const void* buffer) const {
  base::MutexLock lock(&mu_);
  const auto it = buffers_.find(buffer);
  return it == buffers_.end() ? -1 : it->second.fd;
}

uint64_t MemfdHostBufferAllocator::memfd_bytes(const void* buffer) const {
  base::MutexLock lock(&mu_);
  const auto it = buffers_.find(buffer);
  return it == buffers_.end() ? 0 : it->second.bytes;
}

}  // namespace modelcache::weights
