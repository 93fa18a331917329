// A safetensors file loaded into memory: its validated header and its data.
//
// Two ways to get the bytes:
//   - LoadMode::kMmap maps the file read-only and shared. Nothing is copied;
//     tensors are views into the mapping, and pages come from (and stay in) the
//     page cache, shared with every other process that maps the same file.
//     Opening costs the same whatever the file size; pages are read on first
//     touch (or up front with LoadOptions::mmap_populate).
//   - LoadMode::kPread reads the data buffer with `threads` threads, each
//     issuing pread(2) for `chunk_bytes` chunks, into one private, aligned
//     host buffer. The load is done when Open returns.
//
// The header is read with pread and validated before anything else happens;
// the data is never interpreted. In kPread mode the data buffer starts at the
// start of an aligned allocation, so a tensor is aligned to
// gcd(alignment, begin); in kMmap mode the data buffer starts at byte 8 + N of
// a page-aligned mapping (files written by SafetensorsWriter have 8 | N).
//
// Lifetime: every span returned stays valid as long as the WeightSet, or the
// WeightSet it is moved into, lives. In kMmap mode the file must not be
// truncated meanwhile: touching a page past the new end raises SIGBUS, as with
// every mapped file. Writes to the file by others show through a kMmap set.
//
// A moved-from WeightSet may only be destroyed or assigned to.
//
// Thread safety: a WeightSet is immutable after Open; any number of threads
// may read it at once.
#ifndef MODELCACHE_WEIGHTS_WEIGHT_SET_H_
#define MODELCACHE_WEIGHTS_WEIGHT_SET_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/weights/host_buffer.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::weights {

enum class LoadMode {
  kMmap,
  kPread,
};

// "mmap" or "pread".
const char* LoadModeName(LoadMode mode);

struct LoadOptions {
  LoadMode mode = LoadMode::kMmap;

  // kMmap: fault every page in during Open (MAP_POPULATE).
  bool mmap_populate = false;

  // kPread: threads reading at once (>= 1; never more than there are chunks).
  int threads = 4;
  // kPread: bytes per pread request (>= 1). Chunk i covers data bytes
  // [i * chunk_bytes, (i + 1) * chunk_bytes); threads take the next chunk as
  // they finish one.
  uint64_t chunk_bytes = uint64_t{8} << 20;
  // kPread: alignment of the host buffer, a power of two >= 8; 0 chooses
  // 2 MiB when the data buffer is at least 2 MiB, 4 KiB otherwise.
  size_t buffer_alignment = 0;
  // kPread: where the host buffer comes from (it is given back when the
  // WeightSet is destroyed); null means DefaultHostBufferAllocator(). A
  // RecyclingHostBufferAllocator shared by the loads of a server turns each
  // eviction's buffer into the next load's.
  std::shared_ptr<HostBufferAllocator> allocator;
};

// What identifies the file a WeightSet was loaded from, as fstat saw it when
// the file was opened.
struct FileIdentity {
  uint64_t device = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;

  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};

class WeightSet {
 public:
  // Opens, validates and loads the file at `path`. Throws IoError (cannot
  // open, a directory, not a regular file, read or mmap failed, file shrank
  // while being read), FormatError (not a valid safetensors file) or
  // Error kInvalidArgument (bad options).
  static WeightSet Open(const std::string& path,
                        const LoadOptions& options = {});

  // Like Open, from a file already open for reading as `fd` (which stays
  // the caller's: it is neither closed nor moved). `path` names the file in
  // path() and in messages. For callers that open files their own way (the
  // serve daemon opens them beneath its model root with openat2).
  static WeightSet OpenFd(int fd, const std::string& path,
                          const LoadOptions& options = {});

  // A set over bytes already in memory that this process did not load
  // itself, such as a read-only mapping of a host copy another process holds
  // (serve::RemoteWeights). `data` is header.data_bytes() bytes and stays
  // valid while `owner` lives; the set keeps `owner` until it is destroyed.
  // `header` (not null) may be shared with other sets. mode() is kPread: a
  // host copy, not a mapping of the file. Throws Error kInvalidArgument when
  // data.size() != header->data_bytes().
  static WeightSet FromMemory(std::string path, FileIdentity identity,
                              std::shared_ptr<const SafetensorsHeader> header,
                              std::span<const std::byte> data,
                              std::shared_ptr<const void> owner);

  WeightSet(WeightSet&& other) noexcept;
  WeightSet& operator=(WeightSet&& other) noexcept;
  WeightSet(const WeightSet&) = delete;
  WeightSet& operator=(const WeightSet&) = delete;
  ~WeightSet();

  const std::string& path() const { return path_; }
  LoadMode mode() const { return mode_; }
  const FileIdentity& identity() const { return identity_; }
  const SafetensorsHeader& header() const { return *header_; }

  const std::vector<TensorInfo>& tensors() const { return header_->tensors(); }
  const std::map<std::string, std::string>& metadata() const {
    return header_->metadata();
  }
  // The data buffer's size: the bytes of every tensor together.
  uint64_t data_bytes() const { return header_->data_bytes(); }

  // The whole data buffer.
  std::span<const std::byte> data() const { return data_; }
  // The bytes of the named tensor (empty for a zero-size tensor). Throws
  // modelcache::Error with ErrorCode::kNotFound when there is no such tensor.
  std::span<const std::byte> data(std::string_view name) const;
  // The bytes of a tensor of this set's header.
  std::span<const std::byte> data(const TensorInfo& tensor) const {
    return data_.subspan(tensor.begin, tensor.bytes());
  }

 private:
  class Storage;

  WeightSet() = default;
  // Open and OpenFd, once the options are checked and `fd` is known to be a
  // regular file of that identity.
  static WeightSet Load(int fd, const FileIdentity& identity,
                        const std::string& path, const LoadOptions& options);

  std::string path_;
  LoadMode mode_ = LoadMode::kMmap;
  FileIdentity identity_;
  // Shared: sets over copies of one file (serve::RemoteWeights, one per
  // lease) parse its header once.
  std::shared_ptr<const SafetensorsHeader> header_;
  std::unique_ptr<Storage> storage_;
  std::span<const std::byte> data_;
};

}  // namespace modelcache::weights

#endif  // MODELCACHE_WEIGHTS_WEIGHT_SET_H_
