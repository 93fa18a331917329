// UniqueFd: sole ownership of a file descriptor, closed on destruction.
#ifndef MODELCACHE_BASE_UNIQUE_FD_H_
#define MODELCACHE_BASE_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace modelcache::base {

// Owns a file descriptor (or none: -1). Move-only; the destructor closes it.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  // Gives the descriptor up without closing it.
  int release() { return std::exchange(fd_, -1); }
  // Closes the descriptor held, if any, and holds `fd` instead. close(2)'s
  // EINTR is not retried: on Linux the descriptor is gone either way.
  void reset(int fd = -1) {
    const int old = std::exchange(fd_, fd);
    if (old >= 0) ::close(old);
  }

 private:
  int fd_ = -1;
};

}  // namespace modelcache::base

#endif  // MODELCACHE_BASE_UNIQUE_FD_H_
