// What a daemon writes down of its copies for a successor: the *record*
// (a small state file in the socket's folder, read after a crash) and the
// *handover* (sent to a successor that takes over, with the descriptors).
//
// Both name each memfd by its identity (st_dev, st_ino) and size, and each
// header memfd by a hash of its bytes too. A successor adopts a descriptor a
// client brings back (a reclaim) only when its identity is in its
// predecessor's record and its seals and bytes still say what the record
// says: memfd names can be forged, identities of live files cannot, so a
// client cannot plant weights for others.
//
// Both parsers take untrusted bytes (the record is a file anyone of the
// daemon's group may read, the handover comes over a socket) and never
// throw: they return why the text was refused, or "".
#ifndef MODELCACHE_SRC_SERVE_DAEMON_HANDOVER_H_
#define MODELCACHE_SRC_SERVE_DAEMON_HANDOVER_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "copy.h"

namespace modelcache::serve::detail {

// Bumped whenever either format changes: a successor refuses what it does
// not know (a takeover is then refused, a record ignored).
inline constexpr uint64_t kHandoverVersion = 1;

// One file of a copy: its two memfds.
struct RecordedFile {
  std::string name;           // the catalog's path of the file
  uint64_t data_bytes = 0;    // the header's data bytes
  uint64_t header_bytes = 0;  // the header's JSON text
  MemfdId data;
  uint64_t data_size = 0;  // the data memfd's size (st_size)
  MemfdId header;
  uint64_t header_hash = 0;  // HeaderHash of its bytes
};

struct RecordedCopy {
  std::string model;  // the catalog id it was loaded as
  std::vector<RecordedFile> files;
};

// The state file.
struct Record {
  std::string instance;  // the memfd prefix it was written under
  int64_t pid = 0;
  std::vector<RecordedCopy> copies;
};

// A lease of the handover: whose it is and what it holds.
struct HandoverLease {
  uint64_t id = 0;
  size_t copy = 0;  // index into Handover::copies
  int64_t pid = 0;
  uint64_t uid = 0;
  bool idle = false;
};

struct Handover {
  uint64_t version = kHandoverVersion;
  std::string catalog;      // CatalogDigest of the old daemon's catalog
  uint64_t next_lease = 0;  // lease ids go on from here
  // The listening sockets' names, in the order of their descriptors, which
  // come first; then, per copy and per file, its header memfd and its data
  // memfd.
  std::vector<std::string> listeners;
  std::vector<RecordedCopy> copies;
  std::vector<uint64_t> loads;  // per copy: how many loads it took (stats)
  std::vector<bool> pinned;     // per copy
  std::vector<HandoverLease> leases;
};

// The name a copy's memfds are stored under in systemd's fd store
// (FDNAME=): "copy-<dev>-<inode>" of its first header memfd.
std::string FdStoreName(const MemfdId& first_header);

// A hash of a header memfd's bytes (FNV-1a, 64 bits).
uint64_t HeaderHash(std::string_view bytes);
// A digest of a catalog's text: two daemons take over from each other only
// when they read the same catalog.
std::string CatalogDigest(std::string_view catalog_text);

std::string EncodeRecord(const Record& record);
std::string ParseRecord(std::string_view text, Record* out);
std::string EncodeHandover(const Handover& handover);
std::string ParseHandover(std::string_view text, Handover* out);
// Descriptors a handover's text announces.
size_t HandoverFdCount(const Handover& handover);

// The record's path for a daemon on `socket_path`.
std::string RecordPath(const std::string& socket_path);
// Writes `text` to `path` atomically (a temporary file beside it, named
// for this process, synced, renamed over it), mode 0640. Writers in one
// process must not overlap. Throws modelcache::Error kIo.
void WriteFileAtomically(const std::string& path, std::string_view text);
// The file's bytes (at most 16 MiB), or nullopt when it does not exist.
// Throws modelcache::Error kIo when it exists and cannot be read.
std::optional<std::string> ReadSmallFile(const std::string& path);

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_HANDOVER_H_
