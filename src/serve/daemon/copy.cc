#include "copy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "files.h"
#include "handover.h"
#include "modelcache/base/bytes.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::serve::detail {
namespace {

MemfdId IdOf(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    throw Error(ErrorCode::kIo,
                std::string("cannot stat a memfd: ") + std::to_string(error));
  }
  return MemfdId{static_cast<uint64_t>(st.st_dev),
                 static_cast<uint64_t>(st.st_ino)};
}

// The checks of one file, open as `fd`: a safetensors header whose length
// fits the file and which parses. Returns the file's size, and adds to
// `copy_bytes` what its copy takes (as LoadCopy makes it: a data memfd of
// the data bytes, none when there are none, and a header memfd of the
// header's JSON text). Throws weights::IoError or weights::FormatError.
uint64_t CheckFile(int fd, const std::string& file, uint64_t* copy_bytes) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    throw weights::IoError(file, "cannot stat", errno);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  unsigned char prefix[8] = {};
  if (size < 8 || ::pread(fd, prefix, 8, 0) != 8) {
    throw weights::FormatError(file, "too short for a safetensors file");
  }
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
  if (length > weights::kMaxHeaderBytes || length > size - 8) {
    throw weights::FormatError(file, "header length " + std::to_string(length) +
                                         " does not fit the file of " +
                                         std::to_string(size) + " bytes");
  }
  std::string json(length, '\0');
  if (::pread(fd, json.data(), length, 8) != static_cast<ssize_t>(length)) {
    throw weights::IoError(file, "cannot read the header", errno);
  }
  const weights::SafetensorsHeader header =
      weights::ParseSafetensorsHeader(json, size, file);
  const uint64_t data = header.data_bytes();
  *copy_bytes +=
      (data > 0 ? weights::PageRoundedBytes(data) : 0) +
      weights::PageRoundedBytes(weights::SafetensorsHeaderJson(header).size());
  return size;
}

}  // namespace

int FileCopy::data_fd() const {
  if (adopted_data) return adopted_data.get();
  if (empty_data) return empty_data.get();
  return allocator->fd(weights->data().data());
}

ModelCopy::~ModelCopy() {
  if (observer_) {
    for (const FileCopy& file : files_) {
      observer_(file.data_id, false);
      observer_(file.header_id, false);
    }
  }
  if (free_later_ && !files_.empty()) {
    try {
      free_later_(std::move(files_));
    } catch (...) {
      // No memory to queue it: freed here, now.
    }
  }
}

uint64_t ExpectedCopyBytes(const CopyLoadOptions& options,
                           const CatalogModel& model) {
  uint64_t total = 0;
  for (const std::string& file : model.files) {
    try {
      const base::UniqueFd fd = OpenBeneath(
          options.root_fd, file,
          options.use_openat2 ? Resolver::kOpenat2 : Resolver::kPerComponent);
      struct stat st;
      if (::fstat(fd.get(), &st) != 0) continue;
      const uint64_t bytes =
          weights::PageRoundedBytes(static_cast<uint64_t>(st.st_size)) +
          weights::PageRoundedBytes(1);
      total = bytes > UINT64_MAX - total ? UINT64_MAX : total + bytes;
    } catch (const Error&) {
      // The load reports it.
    }
  }
  return total;
}

std::shared_ptr<ModelCopy> LoadCopy(const CopyLoadOptions& options,
                                    const CatalogModel& model) {
  auto copy = std::make_shared<ModelCopy>(model.id);
  std::vector<FileCopy>& files = copy->files_;
  files.reserve(model.files.size());
  uint64_t total = 0;
  for (size_t i = 0; i < model.files.size(); ++i) {
    const std::string& path = model.files[i];
    const std::string name =
        options.memfd_prefix + model.id + "#" + std::to_string(i);
    // The checks of the start and of a reload, on the descriptor that is
    // read: a file that fails them makes the model unavailable. The header's
    // come after before_read, so that a load held there has read nothing.
    base::UniqueFd fd;
    try {
      fd = OpenBeneath(
          options.root_fd, path,
          options.use_openat2 ? Resolver::kOpenat2 : Resolver::kPerComponent);
    } catch (const Error& e) {
      throw FilesUnavailable(e);
    }
    auto allocator = std::make_shared<weights::MemfdHostBufferAllocator>(name);
    weights::LoadOptions load;
    load.mode = weights::LoadMode::kPread;
    load.threads = options.threads;
    load.allocator = allocator;
    if (options.before_read) {
      struct stat st;
      const uint64_t size =
          ::fstat(fd.get(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
      options.before_read(size);
    }
    try {
      uint64_t ignored = 0;
      CheckFile(fd.get(), path, &ignored);
    } catch (const Error& e) {
      throw FilesUnavailable(e);
    }
    FileCopy file;
    file.name = path;
    file.weights.emplace(weights::WeightSet::OpenFd(fd.get(), path, load));
    file.allocator = allocator;
    if (file.weights->data_bytes() > 0) {
      allocator->Seal(file.weights->data().data());
      file.memfd_bytes = allocator->memfd_bytes(file.weights->data().data());
    } else {
      file.empty_data = weights::CreateSealedMemfd(name, {});
    }
    const std::string header =
        weights::SafetensorsHeaderJson(file.weights->header());
    file.header = weights::CreateSealedMemfd(
        name + ":header",
        std::span<const std::byte>(
            reinterpret_cast<const std::byte*>(header.data()), header.size()));
    file.header_bytes = header.size();
    file.header_hash = HeaderHash(header);
    file.data_bytes = file.weights->data_bytes();
    file.memfd_bytes += weights::PageRoundedBytes(header.size());
    file.data_id = IdOf(file.data_fd());
    file.header_id = IdOf(file.header.get());
    total += file.memfd_bytes;
    files.push_back(std::move(file));
  }
  copy->bytes_ = total;
  // Known to the books only once complete: a failed load was never live.
  if (options.observer) {
    for (const FileCopy& file : files) {
      options.observer(file.data_id, true);
      options.observer(file.header_id, true);
    }
    copy->observer_ = options.observer;
  }
  copy->free_later_ = options.free_later;
  return copy;
}

std::shared_ptr<ModelCopy> AdoptCopy(const CopyLoadOptions& options,
                                     const AdoptedCopy& adopted) {
  auto copy = std::make_shared<ModelCopy>(adopted.model);
  copy->origin_ = adopted.origin;
  uint64_t total = 0;
  for (const AdoptedFile& a : adopted.files) {
    FileCopy file;
    file.name = a.name;
    file.data_bytes = a.data_bytes;
    file.header_bytes = a.header_bytes;
    file.header_hash = a.header_hash;
    file.adopted_data =
        base::UniqueFd(::fcntl(a.data.get(), F_DUPFD_CLOEXEC, 0));
    file.header = base::UniqueFd(::fcntl(a.header.get(), F_DUPFD_CLOEXEC, 0));
    if (!file.adopted_data || !file.header) {
      const int error = errno;
      throw Error(ErrorCode::kIo,
                  "cannot keep a memfd: " + base::ErrnoText(error));
    }
    struct stat st;
    if (::fstat(file.adopted_data.get(), &st) != 0) {
      throw Error(ErrorCode::kIo, "cannot stat a memfd");
    }
    file.memfd_bytes =
        weights::PageRoundedBytes(static_cast<uint64_t>(st.st_size)) +
        weights::PageRoundedBytes(a.header_bytes);
    file.data_id = IdOf(file.adopted_data.get());
    file.header_id = IdOf(file.header.get());
    total += file.memfd_bytes;
    copy->files_.push_back(std::move(file));
  }
  copy->bytes_ = total;
  if (options.observer) {
    for (const FileCopy& file : copy->files_) {
      options.observer(file.data_id, true);
      options.observer(file.header_id, true);
    }
    copy->observer_ = options.observer;
  }
  copy->free_later_ = options.free_later;
  return copy;
}

uint64_t CheckModelFiles(const CatalogModel& model, int root_fd,
                         uint64_t* copy_bytes, Resolver resolver) {
  uint64_t bytes = 0;
  uint64_t copy = 0;
  for (const std::string& file : model.files) {
    const base::UniqueFd fd = OpenBeneath(root_fd, file, resolver);
    bytes += CheckFile(fd.get(), file, &copy);
  }
  if (copy_bytes != nullptr) *copy_bytes = copy;
  return bytes;
}

uint64_t CheckCatalogFiles(
    const Catalog& catalog, int root_fd,
    std::vector<std::pair<std::string, uint64_t>>* copy_bytes_out) {
  uint64_t bytes = 0;
  for (const CatalogModel& m : catalog.models()) {
    uint64_t copy_bytes = 0;
    bytes += CheckModelFiles(m, root_fd, &copy_bytes);
    if (copy_bytes_out != nullptr)
      copy_bytes_out->emplace_back(m.id, copy_bytes);
  }
  return bytes;
}

std::map<std::string, FileProblem> FindFileProblems(const Catalog& catalog,
                                                    int root_fd) {
  std::map<std::string, FileProblem> problems;
  for (const CatalogModel& m : catalog.models()) {
    try {
      CheckModelFiles(m, root_fd, nullptr);
    } catch (const Error& e) {
      problems[m.id] = FileProblem{e.what(), e.code()};
    }
  }
  return problems;
}

}  // namespace modelcache::serve::detail

namespace modelcache::serve {

CatalogCheck CheckCatalog(const std::string& catalog_path,
                          const std::string& model_root) {
  const Catalog catalog = Catalog::FromFile(catalog_path);
  size_t files = 0;
  for (const CatalogModel& m : catalog.models()) files += m.files.size();
  const size_t models = catalog.models().size();
  std::string summary = catalog_path + ": " + std::to_string(models) +
                        (models == 1 ? " model, " : " models, ") +
                        std::to_string(files) +
                        (files == 1 ? " file" : " files");
  if (model_root.empty()) return {summary + " (files not checked)", {}};
  CatalogCheck check;
  const base::UniqueFd root = detail::OpenRoot(model_root);
  const uint64_t bytes =
      detail::CheckCatalogFiles(catalog, root.get(), &check.copy_bytes);
  check.summary =
      summary + " under " + model_root + ", " + FormatBytes(bytes) + ": valid";
  return check;
}

}  // namespace modelcache::serve
