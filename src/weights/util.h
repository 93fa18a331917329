// Helpers shared by the weights layer's implementation files: file
// descriptors and complete positioned reads and writes. (Message text, errno's
// and untrusted names', is base's: modelcache/base/text.h.)
#ifndef MODELCACHE_SRC_WEIGHTS_UTIL_H_
#define MODELCACHE_SRC_WEIGHTS_UTIL_H_

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "modelcache/weights/safetensors.h"

namespace modelcache::weights::detail {

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.Release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();

  int get() const { return fd_; }
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Opens `path` read-only and fstat()s it. Throws IoError when it cannot be
// opened, is a directory or is not a regular file.
Fd OpenRegularFile(const std::string& path, struct stat* st);

// Reads exactly `length` bytes at `offset`, retrying on EINTR and short reads.
// Throws IoError on a read error or when the file ends first.
void PreadFull(int fd, void* buffer, uint64_t length, uint64_t offset,
               const std::string& path);

// Writes all of `length` bytes, retrying on EINTR and short writes. Throws
// IoError.
void WriteFull(int fd, const void* buffer, uint64_t length,
               const std::string& path);

// Reads the 8-byte length and the header of the open file `fd` of
// `file_bytes` bytes, and validates them (see ReadSafetensorsHeader).
SafetensorsHeader ReadHeaderFromFd(int fd, uint64_t file_bytes,
                                   const std::string& path);

}  // namespace modelcache::weights::detail

#endif  // MODELCACHE_SRC_WEIGHTS_UTIL_H_
