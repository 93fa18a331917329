// Mapping a granted copy: the reply's sealed memfds checked, the headers
// parsed (once per memfd), the data mapped read-only; a failure releases
// the lease (design note: client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

MappedCopy::~MappedCopy() {
  if (generation != g_fork_generation.load()) {
    // A forked child's: the memfds were closed at fork (or, past the
    // table, stay open in the child until it exits); either way their
    // numbers are not ours to close.
    for (base::UniqueFd& fd : fds) fd.release();
    return;
  }
  files.clear();
  for (const Mapping& m : mappings) ::munmap(m.base, m.bytes);
  mappings.clear();
  // Out of the fork table before the numbers are free for reuse.
  for (size_t i = 0; i < fd_slots.size() && i < fds.size(); ++i) {
    UnregisterMemfd(fd_slots[i], fds[i].get());
  }
  fds.clear();
}

Grant::~Grant() {
  if (generation != g_fork_generation.load()) return;  // a forked child's
  if (core && copy) core->Unref(std::move(copy));
}

std::optional<RemoteWeights> ClientCore::AcquireLocal(std::string_view model) {
  if (std::shared_ptr<Grant> local = LocalAcquire(std::string(model))) {
    return RemoteWeights(std::move(local));
  }
  return std::nullopt;
}

RemoteWeights ClientCore::Acquire(std::string_view model,
                                  const RemoteAcquireOptions& options) {
  if (std::optional<RemoteWeights> local = AcquireLocal(model)) {
    return std::move(*local);
  }
  const std::string name(model);
  const Clock::time_point daemon_deadline = After(options.timeout);
  const Clock::time_point deadline =
      daemon_deadline == Clock::time_point::max()
          ? daemon_deadline
          : daemon_deadline + options_.reply_margin;
  const WaitInterrupt* interrupt =
      options.interrupt.check ? &options.interrupt : nullptr;
  const bool fail = options.when_full == WhenFull::kFail;
  Exchanged ex = Exchange(
      [&](uint64_t id) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(
            daemon_deadline - Clock::now());
        const uint64_t ms =
            daemon_deadline == Clock::time_point::max()
                ? protocol::kMaxTimeoutMs
                : static_cast<uint64_t>(std::clamp<int64_t>(
                      left.count(), 0,
                      static_cast<int64_t>(protocol::kMaxTimeoutMs)));
        return protocol::EncodeAcquire(id, name, ms, fail);
      },
      deadline, interrupt);
  if (!ex.reply.ok) ThrowErrorOf(ex.reply);

  auto grant = std::make_shared<Grant>();
  grant->core = shared_from_this();
  grant->generation = generation_;
  grant->load = ex.reply.load;
  grant->copy = std::make_shared<MappedCopy>();
  MappedCopy* copy = grant->copy.get();
  copy->serial = ex.connection->serial;
  copy->lease = ex.reply.lease;
  copy->generation = generation_;
  copy->model = ex.reply.model;
  // From here on a failure releases the lease (through ~Grant: not filed in
  // the table yet, it is released at once).
  const auto bad = [&](const std::string& why) {
    return ServeError(ServeCode::kInvalid,
                      "the daemon's copy of '" + copy->model + "': " + why);
  };
  if (ex.fds.size() != 2 * ex.reply.files.size()) {
    throw bad(std::to_string(ex.fds.size()) + " descriptors for " +
              std::to_string(ex.reply.files.size()) + " files");
  }
  copy->files.reserve(ex.reply.files.size());
  for (size_t i = 0; i < ex.reply.files.size(); ++i) {
    const protocol::FileReply& f = ex.reply.files[i];
    const int header_fd = ex.fds[2 * i].get();
    const int data_fd = ex.fds[2 * i + 1].get();
    const std::string source = copy->model + "/" + f.name;
    for (const int fd : {header_fd, data_fd}) {
      const int seals = ::fcntl(fd, F_GET_SEALS);
      if (seals < 0 ||
          (seals & weights::MemfdSeals()) != weights::MemfdSeals()) {
        throw bad("a memfd of " + f.name + " is not sealed");
      }
    }
    struct stat header_st;
    struct stat data_st;
    if (::fstat(header_fd, &header_st) != 0 ||
        ::fstat(data_fd, &data_st) != 0 ||
        static_cast<uint64_t>(header_st.st_size) != f.header_bytes ||
        static_cast<uint64_t>(data_st.st_size) < f.data_bytes ||
        f.header_bytes > weights::kMaxHeaderBytes) {
      throw bad("the memfds of " + f.name + " do not have the sizes announced");
    }
    const HeaderKey key{
        static_cast<uint64_t>(header_st.st_dev),
        static_cast<uint64_t>(header_st.st_ino),
        static_cast<uint64_t>(header_st.st_size),
        static_cast<int64_t>(header_st.st_ctim.tv_sec) * 1000000000 +
            header_st.st_ctim.tv_nsec};
    std::shared_ptr<const weights::SafetensorsHeader> header =
        CachedHeader(key);
    if (!header) {
      std::string json(f.header_bytes, '\0');
      size_t done = 0;
      while (done < json.size()) {
        const ssize_t n = ::pread(header_fd, json.data() + done,
                                  json.size() - done, static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw bad("cannot read the header of " + f.name);
        done += static_cast<size_t>(n);
      }
      if (f.data_bytes >
          UINT64_MAX - weights::kLengthPrefixBytes - json.size()) {
        throw bad("sizes overflow");
      }
      header = std::make_shared<const weights::SafetensorsHeader>(
          weights::ParseSafetensorsHeader(
              json, weights::kLengthPrefixBytes + json.size() + f.data_bytes,
              source));
      CacheHeader(key, header);
    }
    if (header->data_bytes() != f.data_bytes) {
      throw bad("the header of " + f.name + " does not match its data");
    }
    std::span<const std::byte> data;
    if (f.data_bytes > 0) {
      const size_t bytes = static_cast<size_t>(data_st.st_size);
      void* base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, data_fd, 0);
      if (base == MAP_FAILED) {
        const int e = errno;
        throw ServeError(
            ServeCode::kLoadFailed, ErrorCode::kIo,
            "cannot map the copy of " + source + ": " + base::ErrnoText(e));
      }
      copy->mappings.push_back({base, bytes});
      // A forked child must not share it: it holds no lease.
      ::madvise(base, bytes, MADV_DONTFORK);
      data = std::span<const std::byte>(static_cast<const std::byte*>(base),
                                        f.data_bytes);
    }
    copy->files.push_back(weights::WeightSet::FromMemory(
        source,
        weights::FileIdentity{static_cast<uint64_t>(data_st.st_dev),
                              static_cast<uint64_t>(data_st.st_ino),
                              static_cast<uint64_t>(data_st.st_size), 0},
        std::move(header), data, nullptr));
    copy->data_bytes += f.data_bytes;
  }
  if (options_.reclaim) {
    // Kept for a successor to adopt (a reclaim); out of forked children.
    copy->fd_slots.reserve(ex.fds.size());
    for (const base::UniqueFd& fd : ex.fds) {
      copy->fd_slots.push_back(RegisterMemfd(fd.get()));
    }
    copy->fds = std::move(ex.fds);
  }
  ex.fds.clear();  // mapped: not needed otherwise
  size_t count = 0;
  for (const weights::WeightSet& file : copy->files) {
    count += file.tensors().size();
  }
  copy->tensors.reserve(count);
  for (size_t i = 0; i < copy->files.size(); ++i) {
    copy->first_tensor.push_back(copy->tensors.size());
    for (const weights::TensorInfo& t : copy->files[i].tensors()) {
      copy->tensors.push_back({&t, copy->files[i].data(t), i});
    }
  }
  std::vector<std::string> names{name};
  if (copy->model != name) names.push_back(copy->model);
  Keep(grant->copy, names, *ex.connection);
  return RemoteWeights(std::move(grant));
}

}  // namespace modelcache::serve::detail
