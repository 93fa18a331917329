// Loading a safetensors file: validated header, then mmap or parallel pread.
//
// Open() reads the header through the file descriptor with pread and
// validates it completely (detail::ReadHeaderFromFd) before mapping or
// allocating anything, so the sizes used below are the validated ones, taken
// from one fstat. The file size is checked again after the load: a file that
// changed size meanwhile is reported instead of half-read.
//
// kMmap maps the whole file PROT_READ/MAP_SHARED: no copy, pages shared with
// the page cache and with every other process mapping the file. The data span
// points 8 + N bytes into the mapping.
//
// kPread allocates one buffer aligned to LoadOptions::buffer_alignment (2 MiB
// with MADV_HUGEPAGE for large data by default, so page faults on first touch
// are few) and splits the data buffer into fixed-size chunks. Worker threads
// (the calling thread is one of them) claim chunk indices from an atomic
// counter and pread each chunk in full. The first failure is kept under a
// mutex and makes the other workers stop claiming; it is rethrown after every
// worker has been joined, so no thread outlives Open or writes into a freed
// buffer.
#include "modelcache/weights/weight_set.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/base/mutex.h"
#include "modelcache/base/text.h"
#include "util.h"

namespace modelcache::weights {

static_assert(sizeof(size_t) == sizeof(uint64_t),
              "the weights layer assumes a 64-bit address space");

namespace {

constexpr size_t kSmallAlignment = size_t{4} << 10;

}  // namespace

const char* LoadModeName(LoadMode mode) {
  switch (mode) {
    case LoadMode::kMmap:
      return "mmap";
    case LoadMode::kPread:
      return "pread";
  }
  return "unknown";
}

// The memory behind a WeightSet's data: a file mapping, or a host buffer
// from an allocator. Releases it on destruction.
class WeightSet::Storage {
 public:
  // A mapping of `length` bytes.
  Storage(void* base, size_t length) : base_(base), length_(length) {}
  // A buffer `allocator` returned for (`length`, `alignment`).
  Storage(std::shared_ptr<HostBufferAllocator> allocator, void* base,
          size_t length, size_t alignment)
      : allocator_(std::move(allocator)),
        base_(base),
        length_(length),
        alignment_(alignment) {}
  // Memory `owner` keeps valid.
  explicit Storage(std::shared_ptr<const void> owner)
      : owner_(std::move(owner)), base_(nullptr), length_(0) {}
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (base_ == nullptr) return;
    if (allocator_) {
      allocator_->Deallocate(base_, length_, alignment_);
    } else {
      ::munmap(base_, length_);
    }
  }

  std::byte* base() const { return static_cast<std::byte*>(base_); }

 private:
  const std::shared_ptr<HostBufferAllocator> allocator_;  // null: a mapping
  const std::shared_ptr<const void> owner_;  // set: someone else's memory
  void* const base_;
  const size_t length_;
  const size_t alignment_ = 0;
};

namespace {

void CheckOptions(const LoadOptions& options) {
  if (options.mode == LoadMode::kPread) {
    if (options.threads < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "LoadOptions::threads must be >= 1, got " +
                      std::to_string(options.threads));
    }
    if (options.chunk_bytes < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "LoadOptions::chunk_bytes must be >= 1");
    }
    const size_t a = options.buffer_alignment;
    if (a != 0 && (a < sizeof(void*) || (a & (a - 1)) != 0)) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "LoadOptions::buffer_alignment must be 0 or a power of two >= 8, "
          "got " +
              std::to_string(a));
    }
  }
}

FileIdentity IdentityOf(const struct stat& st) {
  FileIdentity id;
  id.device = static_cast<uint64_t>(st.st_dev);
  id.inode = static_cast<uint64_t>(st.st_ino);
  id.size = static_cast<uint64_t>(st.st_size);
  id.mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return id;
}

// Fails when the file's size is no longer the one the header was checked
// against.
void CheckSizeUnchanged(int fd, uint64_t expected, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    throw IoError(path, "cannot stat: " + base::ErrnoText(e), e);
  }
  if (static_cast<uint64_t>(st.st_size) != expected) {
    throw IoError(path,
                  "file size changed from " + std::to_string(expected) +
                      " to " + std::to_string(st.st_size) + " while loading",
                  0);
  }
}

// The first of the exceptions several threads may raise.
class FirstError {
 public:
  void Offer(std::exception_ptr error) MC_EXCLUDES(mu_) {
    base::MutexLock lock(&mu_);
    if (!error_) error_ = std::move(error);
  }
  void RethrowIfAny() MC_EXCLUDES(mu_) {
    base::MutexLock lock(&mu_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  base::Mutex mu_;
  std::exception_ptr error_ MC_GUARDED_BY(mu_);
};

// Reads `length` bytes at file offset `offset` into `dst` with up to `threads`
// threads, `chunk_bytes` per pread.
void ParallelPread(int fd, std::byte* dst, uint64_t offset, uint64_t length,
                   int threads, uint64_t chunk_bytes, const std::string& path) {
  if (length == 0) return;
  const uint64_t chunks = (length - 1) / chunk_bytes + 1;
  const int workers = static_cast<int>(
      std::min<uint64_t>(static_cast<uint64_t>(threads), chunks));

  std::atomic<uint64_t> next_chunk{0};
  std::atomic<bool> failed{false};
  FirstError first_error;

  const auto work = [&]() {
    try {
      while (!failed.load(std::memory_order_relaxed)) {
        const uint64_t i = next_chunk.fetch_add(1, std::memory_order_relaxed);
        if (i >= chunks) return;
        const uint64_t begin = i * chunk_bytes;
        const uint64_t n = std::min(chunk_bytes, length - begin);
        detail::PreadFull(fd, dst + begin, n, offset + begin, path);
      }
    } catch (...) {
      failed.store(true, std::memory_order_relaxed);
      first_error.Offer(std::current_exception());
    }
  };

  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  try {
    for (int i = 1; i < workers; ++i) pool.emplace_back(work);
  } catch (...) {
    // Could not start a thread: stop the ones running, then report.
    failed.store(true);
    for (std::thread& t : pool) t.join();
    throw;
  }
  work();
  for (std::thread& t : pool) t.join();

  first_error.RethrowIfAny();
}

}  // namespace

WeightSet WeightSet::Open(const std::string& path, const LoadOptions& options) {
  CheckOptions(options);
  struct stat st;
  const detail::Fd fd = detail::OpenRegularFile(path, &st);
  return Load(fd.get(), IdentityOf(st), path, options);
}

WeightSet WeightSet::OpenFd(int fd, const std::string& path,
                            const LoadOptions& options) {
  CheckOptions(options);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    throw IoError(path, "cannot stat: " + base::ErrnoText(e), e);
  }
  if (S_ISDIR(st.st_mode)) throw IoError(path, "is a directory", EISDIR);
  if (!S_ISREG(st.st_mode)) throw IoError(path, "not a regular file", EINVAL);
  return Load(fd, IdentityOf(st), path, options);
}

WeightSet WeightSet::FromMemory(std::string path, FileIdentity identity,
                                std::shared_ptr<const SafetensorsHeader> header,
                                std::span<const std::byte> data,
                                std::shared_ptr<const void> owner) {
  if (!header) {
    throw Error(ErrorCode::kInvalidArgument,
                "WeightSet::FromMemory needs a header");
  }
  if (data.size() != header->data_bytes()) {
    throw Error(ErrorCode::kInvalidArgument,
                base::Printable(path, 4096) + ": " +
                    std::to_string(data.size()) +
                    " bytes of data for a header that describes " +
                    std::to_string(header->data_bytes()));
  }
  WeightSet set;
  set.path_ = std::move(path);
  set.mode_ = LoadMode::kPread;
  set.identity_ = identity;
  set.header_ = std::move(header);
  set.storage_ = std::make_unique<Storage>(std::move(owner));
  set.data_ = data;
  return set;
}

WeightSet WeightSet::Load(int fd, const FileIdentity& identity,
                          const std::string& path, const LoadOptions& options) {
  const uint64_t file_bytes = identity.size;

  WeightSet set;
  set.path_ = path;
  set.mode_ = options.mode;
  set.identity_ = identity;
  set.header_ = std::make_shared<const SafetensorsHeader>(
      detail::ReadHeaderFromFd(fd, file_bytes, path));
  const uint64_t data_offset = set.header_->data_offset();
  const uint64_t data_bytes = set.header_->data_bytes();

  if (options.mode == LoadMode::kMmap) {
    // A valid file is never empty (it holds at least the 8-byte length).
    int flags = MAP_SHARED;
    if (options.mmap_populate) flags |= MAP_POPULATE;
    void* base = ::mmap(nullptr, file_bytes, PROT_READ, flags, fd, 0);
    if (base == MAP_FAILED) {
      const int e = errno;
      throw IoError(path, "mmap failed: " + base::ErrnoText(e), e);
    }
    try {
      set.storage_ = std::make_unique<Storage>(base, file_bytes);
    } catch (...) {
      ::munmap(base, file_bytes);
      throw;
    }
    CheckSizeUnchanged(fd, file_bytes, path);
    set.data_ = std::span<const std::byte>(set.storage_->base() + data_offset,
                                           data_bytes);
    return set;
  }

  if (data_bytes == 0) {
    CheckSizeUnchanged(fd, file_bytes, path);
    return set;  // data_ stays an empty span
  }
  size_t alignment = options.buffer_alignment;
  if (alignment == 0) {
    alignment = data_bytes >= kHugePageBytes ? kHugePageBytes : kSmallAlignment;
  }
  std::shared_ptr<HostBufferAllocator> allocator =
      options.allocator ? options.allocator : DefaultHostBufferAllocator();
  void* buffer = nullptr;
  try {
    buffer = allocator->Allocate(data_bytes, alignment);
  } catch (const std::bad_alloc&) {
    throw IoError(path,
                  "cannot allocate " + std::to_string(data_bytes) +
                      " bytes for the data buffer",
                  ENOMEM);
  }
  try {
    set.storage_ =
        std::make_unique<Storage>(allocator, buffer, data_bytes, alignment);
  } catch (...) {
    allocator->Deallocate(buffer, data_bytes, alignment);
    throw;
  }
  ParallelPread(fd, set.storage_->base(), data_offset, data_bytes,
                options.threads, options.chunk_bytes, path);
  CheckSizeUnchanged(fd, file_bytes, path);
  set.data_ = std::span<const std::byte>(set.storage_->base(), data_bytes);
  return set;
}

WeightSet::WeightSet(WeightSet&& other) noexcept
    : path_(std::move(other.path_)),
      mode_(other.mode_),
      identity_(other.identity_),
      header_(std::move(other.header_)),
      storage_(std::move(other.storage_)),
      data_(std::exchange(other.data_, {})) {}

WeightSet& WeightSet::operator=(WeightSet&& other) noexcept {
  if (this != &other) {
    path_ = std::move(other.path_);
    mode_ = other.mode_;
    identity_ = other.identity_;
    header_ = std::move(other.header_);
    storage_ = std::move(other.storage_);
    data_ = std::exchange(other.data_, {});
  }
  return *this;
}

WeightSet::~WeightSet() = default;

std::span<const std::byte> WeightSet::data(std::string_view name) const {
  const TensorInfo* tensor = header_->Find(name);
  if (tensor == nullptr) {
    throw Error(ErrorCode::kNotFound, base::Printable(path_, 4096) +
                                          ": no tensor named " +
                                          base::Quoted(name));
  }
  return data(*tensor);
}

}  // namespace modelcache::weights
