// A model's host copy in the daemon: one sealed data memfd and one sealed
// header memfd per file.
//
// The header travels as a second, small memfd rather than a region in front
// of the data: the data memfd then holds exactly the bytes a kPread load
// writes (so the load goes through the ordinary HostBufferAllocator hook),
// its data starts at offset 0 (2 MiB aligned in the daemon's mapping, as
// huge pages want), and a worker maps the data alone. The header memfd holds
// the validated header as JSON text (weights::SafetensorsHeaderJson), which
// the worker parses with the same strict parser; it was validated once
// against the file, and the seal guarantees it is the text the daemon wrote.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_COPY_H_
#define MODELCACHE_SRC_SERVE_DAEMON_COPY_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "files.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/serve/catalog.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::serve::detail {

// A memfd's identity: its device and inode numbers as fstat sees them.
struct MemfdId {
  uint64_t dev = 0;
  uint64_t inode = 0;
  friend bool operator<(const MemfdId& a, const MemfdId& b) {
    return a.dev != b.dev ? a.dev < b.dev : a.inode < b.inode;
  }
  friend bool operator==(const MemfdId&, const MemfdId&) = default;
};

struct FileCopy {
  std::string name;  // the catalog's path, relative to the model root
  // Over the daemon's read-only mapping; none for an adopted copy.
  std::optional<weights::WeightSet> weights;
  // Owns the data memfd and the mapping (the weights give it back).
  std::shared_ptr<weights::MemfdHostBufferAllocator> allocator;
  base::UniqueFd empty_data;  // the data memfd of a file with no data
  // The data memfd of an adopted copy (AdoptCopy): not mapped here.
  base::UniqueFd adopted_data;
  base::UniqueFd header;      // the header memfd
  uint64_t data_bytes = 0;    // the header's data bytes
  uint64_t header_bytes = 0;  // the header text's size
  uint64_t header_hash = 0;   // HeaderHash of that text (handover.h)
  uint64_t memfd_bytes = 0;   // both memfds' pages together
  MemfdId data_id;
  MemfdId header_id;

  int data_fd() const;
};

// Called with each memfd of a copy when it is made and again when it is
// freed; the daemon keeps its books of live memfds with it.
using MemfdObserver = std::function<void(const MemfdId&, bool live)>;

struct CopyLoadOptions;
struct AdoptedCopy;

class ModelCopy : public std::enable_shared_from_this<ModelCopy> {
 public:
  explicit ModelCopy(std::string model) : model_(std::move(model)) {}
  ~ModelCopy();
  ModelCopy(const ModelCopy&) = delete;
  ModelCopy& operator=(const ModelCopy&) = delete;

  const std::string& model() const { return model_; }
  // How it came to be: "loaded", "taken over" or "reclaimed".
  const char* origin() const { return origin_; }
  const std::vector<FileCopy>& files() const { return files_; }
  // What the copy holds in memory: every memfd's pages.
  uint64_t bytes() const { return bytes_; }

 private:
  friend std::shared_ptr<ModelCopy> LoadCopy(const CopyLoadOptions&,
                                             const CatalogModel&);
  friend std::shared_ptr<ModelCopy> AdoptCopy(const CopyLoadOptions&,
                                              const AdoptedCopy&);
  const std::string model_;
  const char* origin_ = "loaded";
  MemfdObserver observer_;  // set once the copy is complete
  std::function<void(std::vector<FileCopy>)> free_later_;  // likewise
  std::vector<FileCopy> files_;
  uint64_t bytes_ = 0;
};

struct CopyLoadOptions {
  int root_fd = -1;
  // Memfds are named prefix + model + "#" + file index (":header" for the
  // header): "modelcache:<instance>:sdxl#0".
  std::string memfd_prefix;
  int threads = 4;  // pread threads per file
  bool use_openat2 = true;
  MemfdObserver observer;
  // When set, a complete copy's destructor hands its files (the mappings
  // and memfds, whose pages the kernel frees, which takes real time for a
  // large copy) to this rather than freeing them on the thread that let go
  // of the copy: the daemon frees them on a background thread (as Redis's
  // lazyfree does), off its event loop. The observer has been told first.
  std::function<void(std::vector<FileCopy>)> free_later;
  // Runs before each file's data is read (the daemon's load slots and its
  // test hooks); may throw to abandon the load.
  std::function<void(uint64_t data_bytes)> before_read;
};

// What a load of `model` will reserve: each file's size rounded up to pages
// plus a page for its header (an upper bound of ModelCopy::bytes()). Files
// that cannot be opened count 0: the load then fails with their error.
uint64_t ExpectedCopyBytes(const CopyLoadOptions& options,
                           const CatalogModel& model);

// A file of a model failed the checks CheckModelFiles makes (it cannot be
// opened beneath the root, or it is not a valid safetensors file), at the
// start of a load: the model is unavailable, which is not a failed load (a
// read that fails later, a memfd or memory refused). The code and the
// message are those of the file's error, which names the file.
class FilesUnavailable : public Error {
 public:
  explicit FilesUnavailable(const Error& cause)
      : Error(cause.code(), cause.what()) {}
};

// Opens every file beneath the root, checks it as CheckModelFiles does, reads
// it into a sealed memfd and writes its header into another. Throws
// FilesUnavailable when a file fails those checks; weights::IoError,
// weights::FormatError or modelcache::Error when anything after them fails;
// nothing stays allocated on failure.
std::shared_ptr<ModelCopy> LoadCopy(const CopyLoadOptions& options,
                                    const CatalogModel& model);

// A copy a predecessor made, as its descriptors came back: from the old
// daemon in a takeover, or from the clients that map it after a crash.
struct AdoptedFile {
  std::string name;
  uint64_t data_bytes = 0;
  uint64_t header_bytes = 0;
  uint64_t header_hash = 0;
  base::UniqueFd header;
  base::UniqueFd data;
};
struct AdoptedCopy {
  std::string model;
  const char* origin = "reclaimed";  // or "taken over"
  std::vector<AdoptedFile> files;
};

// Makes a copy of the descriptors (checked by the caller against the
// predecessor's record): nothing is read or mapped. Its bytes are the
// memfds' pages, as LoadCopy counts them.
std::shared_ptr<ModelCopy> AdoptCopy(const CopyLoadOptions& options,
                                     const AdoptedCopy& adopted);

// What CheckCatalog checks of one model's files: each opens beneath the
// root (no symbolic link, never outside it), is a regular file, and holds a
// safetensors header whose length fits the file and which parses. Returns
// the bytes of its files, and sets `copy_bytes` (when not null) as
// CatalogCheck::copy_bytes says. Throws weights::IoError or
// weights::FormatError naming the file.
uint64_t CheckModelFiles(const CatalogModel& model, int root_fd,
                         uint64_t* copy_bytes,
                         Resolver resolver = Resolver::kOpenat2);

// CheckModelFiles for every model of a catalog already parsed, under a root
// already open: what `modelcache serve --check-catalog` refuses, and the
// daemon with --strict-catalog at start and on reload, with the same
// message. Returns the bytes of every file, and fills `copy_bytes` (when not
// null) as CatalogCheck::copy_bytes says. Throws at the first file that
// fails, as CheckCatalog does.
uint64_t CheckCatalogFiles(
    const Catalog& catalog, int root_fd,
    std::vector<std::pair<std::string, uint64_t>>* copy_bytes);

// Why a model's files fail CheckModelFiles: the file's error, naming it, and
// its code (kIo: it cannot be opened or read; kInvalidData: not valid).
struct FileProblem {
  std::string error;
  ErrorCode code = ErrorCode::kIo;
};

// Without --strict-catalog, at start and on reload: CheckModelFiles for
// every model, and the problem of each model whose files fail it (by id).
// A model's problem costs that model, not the others.
std::map<std::string, FileProblem> FindFileProblems(const Catalog& catalog,
                                                    int root_fd);

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_COPY_H_
