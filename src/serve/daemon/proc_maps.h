// Finding the memfds of a daemon that processes still map, from
// /proc/PID/maps: how a restarted daemon books the copies its predecessor
// handed out, and how tests check the daemon's books.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_PROC_MAPS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_PROC_MAPS_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace modelcache::serve::detail {

// One mapping of a memfd, as a line of /proc/PID/maps shows it:
//   7f0c00000000-7f0c00200000 r--s 00000000 00:01 4242   /memfd:NAME (deleted)
struct MemfdMapping {
  pid_t pid = 0;
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t offset = 0;  // into the memfd
  uint32_t dev_major = 0;
  uint32_t dev_minor = 0;
  uint64_t inode = 0;
  std::string name;  // the memfd's name, without "memfd:" and " (deleted)"

  // How much of the memfd the mapping reaches: offset + length.
  uint64_t reach() const { return offset + (end - start); }
};

// The mapping a maps line describes, when it is of a memfd whose name starts
// with `prefix`; nullopt for any other line, malformed ones included. `pid`
// is copied into the result.
std::optional<MemfdMapping> ParseMapsLine(std::string_view line,
                                          std::string_view prefix, pid_t pid);

// Every mapping of a memfd named `prefix`... in every process but
// `exclude_pid`, read from /proc/[0-9]*/maps. Processes that end while they
// are read are skipped; those whose maps cannot be read (another user's,
// without privilege) are counted in `*unreadable` when it is not null.
std::vector<MemfdMapping> ScanMemfdMappings(std::string_view prefix,
                                            pid_t exclude_pid,
                                            int* unreadable = nullptr);

// The (device, inode) of every memfd named `prefix`... that process `pid`
// maps or holds a descriptor of. False when its /proc entries cannot be
// read (it is gone, or another user's): then nothing is known.
bool ProcessMemfds(pid_t pid, std::string_view prefix,
                   std::vector<std::pair<uint64_t, uint64_t>>* found);

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_PROC_MAPS_H_
