// File descriptor helpers of the weights layer.
//
// Every I/O helper retries EINTR and continues after short transfers, and
// turns any other failure into an IoError naming the file, the operation, the
// offset and errno's text.
#include "util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "modelcache/base/text.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::weights::detail {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.Release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd OpenRegularFile(const std::string& path, struct stat* st) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int e = errno;
    throw IoError(path, "cannot open: " + base::ErrnoText(e), e);
  }
  Fd owned(fd);
  if (::fstat(fd, st) != 0) {
    const int e = errno;
    throw IoError(path, "cannot stat: " + base::ErrnoText(e), e);
  }
  if (S_ISDIR(st->st_mode)) {
    throw IoError(path, "is a directory", EISDIR);
  }
  if (!S_ISREG(st->st_mode)) {
    throw IoError(path, "not a regular file", EINVAL);
  }
  return owned;
}

void PreadFull(int fd, void* buffer, uint64_t length, uint64_t offset,
               const std::string& path) {
  auto* out = static_cast<char*>(buffer);
  uint64_t done = 0;
  while (done < length) {
    // Linux transfers at most ~2 GiB per call; asking for more is fine.
    const ssize_t n = ::pread(fd, out + done, length - done,
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      throw IoError(path,
                    "read of " + std::to_string(length - done) +
                        " bytes at offset " + std::to_string(offset + done) +
                        " failed: " + base::ErrnoText(e),
                    e);
    }
    if (n == 0) {
      throw IoError(path,
                    "file ended at offset " + std::to_string(offset + done) +
                        " while " + std::to_string(offset + length) +
                        " bytes were expected (truncated while reading?)",
                    0);
    }
    done += static_cast<uint64_t>(n);
  }
}

void WriteFull(int fd, const void* buffer, uint64_t length,
               const std::string& path) {
  const auto* in = static_cast<const char*>(buffer);
  uint64_t done = 0;
  while (done < length) {
    const ssize_t n = ::write(fd, in + done, length - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      throw IoError(path, "write failed: " + base::ErrnoText(e), e);
    }
    done += static_cast<uint64_t>(n);
  }
}

}  // namespace modelcache::weights::detail
