#include "files.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string_view>
#include <vector>

#include "modelcache/base/text.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::serve::detail {
namespace {

[[noreturn]] void Fail(const std::string& path, int error) {
  switch (error) {
    case ELOOP:
      throw weights::IoError(
          path, "is or passes through a symbolic link (refused)", error);
    case EXDEV:
      throw weights::IoError(path, "leaves the model root", error);
    case ENOTDIR:
      throw weights::IoError(
          path, "passes through something that is not a directory", error);
    default:
      throw weights::IoError(path, "cannot open: " + base::ErrnoText(error),
                             error);
  }
}

std::vector<std::string_view> Components(const std::string& path) {
  if (path.empty() || path.front() == '/') Fail(path, EXDEV);
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    const std::string_view part(path.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") Fail(path, EXDEV);
    parts.push_back(part);
    start = end + 1;
  }
  return parts;
}

constexpr int kFileFlags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;

base::UniqueFd OpenPerComponent(int root_fd, const std::string& path) {
  const std::vector<std::string_view> parts = Components(path);
  base::UniqueFd dir;
  int at = root_fd;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string part(parts[i]);
    const bool last = i + 1 == parts.size();
    // O_NOFOLLOW with O_PATH opens a symbolic link itself, which
    // O_DIRECTORY then refuses (ENOTDIR): no link is ever followed.
    const int flags = last ? kFileFlags | O_NOFOLLOW
                           : O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    int fd;
    do {
      fd = ::openat(at, part.c_str(), flags);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      int error = errno;
      if (!last && error == ENOTDIR) {
        struct stat st;
        if (::fstatat(at, part.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISLNK(st.st_mode)) {
          error = ELOOP;
        }
      }
      Fail(path, error);
    }
    if (last) return base::UniqueFd(fd);
    dir.reset(fd);
    at = dir.get();
  }
  Fail(path, ENOENT);
}

}  // namespace

base::UniqueFd OpenBeneath(int root_fd, const std::string& relative,
                           Resolver resolver) {
  Components(relative);  // refuses what no resolver may see
  base::UniqueFd fd;
  if (resolver == Resolver::kOpenat2) {
    open_how how{};
    how.flags = kFileFlags;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    long result;
    do {
      result =
          ::syscall(SYS_openat2, root_fd, relative.c_str(), &how, sizeof(how));
    } while (result < 0 && errno == EINTR);
    if (result >= 0) {
      fd.reset(static_cast<int>(result));
    } else if (errno == ENOSYS) {
      fd = OpenPerComponent(root_fd, relative);
    } else {
      Fail(relative, errno);
    }
  } else {
    fd = OpenPerComponent(root_fd, relative);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) Fail(relative, errno);
  if (!S_ISREG(st.st_mode)) {
    throw weights::IoError(
        relative, S_ISDIR(st.st_mode) ? "is a directory" : "not a regular file",
        EINVAL);
  }
  // Reads of a regular file ignore O_NONBLOCK; clear it all the same.
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  return fd;
}

base::UniqueFd OpenRoot(const std::string& path) {
  const int fd = ::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    throw weights::IoError(
        path, "cannot open the model root: " + base::ErrnoText(error), error);
  }
  return base::UniqueFd(fd);
}

}  // namespace modelcache::serve::detail
