// Opening a catalog's files beneath the model root, and nowhere else.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_FILES_H_
#define MODELCACHE_SRC_SERVE_DAEMON_FILES_H_

#include <string>

#include "modelcache/base/unique_fd.h"

namespace modelcache::serve::detail {

// How OpenBeneath resolves a path.
enum class Resolver {
  // openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS),
  // falling back to kPerComponent where the kernel lacks openat2 (ENOSYS).
  kOpenat2,
  // One openat(O_NOFOLLOW) per component: directories with O_PATH |
  // O_DIRECTORY, the file with O_RDONLY.
  kPerComponent,
};

// Opens the regular file `relative` beneath the directory `root_fd` for
// reading (close-on-exec), resolving no symbolic link at all and never
// leaving the root. Also refuses what the catalog refuses (absolute paths,
// "." and ".." components, empty ones), so that it is safe on its own.
// Opens without blocking, so a FIFO under the root cannot stall the caller.
// Throws weights::IoError naming `relative`: "is or passes through a
// symbolic link (refused)", "leaves the model root", "not a regular file",
// or the system's error.
base::UniqueFd OpenBeneath(int root_fd, const std::string& relative,
                           Resolver resolver = Resolver::kOpenat2);

// Opens the directory `path` as a model root (O_PATH | O_DIRECTORY). Throws
// weights::IoError.
base::UniqueFd OpenRoot(const std::string& path);

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_FILES_H_
