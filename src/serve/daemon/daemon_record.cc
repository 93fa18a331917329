// The record of the copies this daemon made: the state file a successor
// reads to know what it may adopt (daemon_reclaim.cc), and, under systemd,
// the copies' memfds in its fd store (design note: daemon_internal.h).
//
//   a copy made (LoadForStore, adopted) --> recorded (record_, written to
//     the state file before its descriptors go out)
//   its memfds freed (the observer) --> forgotten, the file rewritten on
//     the background thread; not once the daemon stops or hands over (the
//     record stays as it is, for a successor)
//   under systemd (DaemonOptions::systemd): recorded --> its memfds in
//     systemd's fd store too (FDSTORE=1, FdStoreName); forgotten --> out of
//     it (FDSTOREREMOVE=1). At start, what systemd passes back is adopted
//     when the predecessor's record names it and it passes a reclaim's
//     checks (AdoptStored), and removed from the store otherwise.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon_internal.h"
#include "handover.h"

namespace modelcache::serve {

using detail::MemfdId;

void Daemon::Impl::RecordCopy(const detail::ModelCopy& copy, bool later) {
  detail::RecordedCopy rc;
  rc.model = copy.model();
  for (const detail::FileCopy& f : copy.files()) {
    struct stat st;
    const uint64_t data_size =
        ::fstat(f.data_fd(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    rc.files.push_back({f.name, f.data_bytes, f.header_bytes, f.data_id,
                        data_size, f.header_id, f.header_hash});
  }
  if (rc.files.empty()) return;
  const detail::MemfdId key = rc.files[0].header;
  bool store = false;
  {
    base::MutexLock lock(&record_mu_);
    record_[key] = RecordEntry{std::move(rc), copy.origin(), copy.bytes()};
    store = notifier_ && in_fd_store_.insert(key).second;
  }
  if (later) {
    Later([this] { WriteRecord(); });
  } else {
    WriteRecord();
  }
  if (!store) return;
  // Duplicates, sent off the caller's thread (the loop's, for an
  // adoption): the copy may be freed before the chore runs.
  auto fds = std::make_shared<std::vector<base::UniqueFd>>();
  for (const detail::FileCopy& f : copy.files()) {
    fds->emplace_back(::fcntl(f.header.get(), F_DUPFD_CLOEXEC, 0));
    fds->emplace_back(::fcntl(f.data_fd(), F_DUPFD_CLOEXEC, 0));
  }
  Later([this, key, fds] {
    std::vector<int> raw;
    for (const base::UniqueFd& fd : *fds) {
      if (!fd) return;  // out of descriptors: not stored, still recorded
      raw.push_back(fd.get());
    }
    std::string why;
    if (!notifier_->StoreFds(detail::FdStoreName(key), raw, &why) &&
        !fd_store_error_logged_.exchange(true)) {
      Log("systemd's fd store: " + why + " (the copies are still recorded)");
    }
  });
}

void Daemon::Impl::ForgetRecorded(const MemfdId& id) {
  // Shutting down or handed over: what is recorded and stored stays, for a
  // successor.
  if (keep_record_.load() || handed_over_.load()) return;
  bool stored = false;
  {
    base::MutexLock lock(&record_mu_);
    if (record_.erase(id) == 0) return;
    stored = in_fd_store_.erase(id) != 0;
  }
  Later([this, id, stored] {
    WriteRecord();
    if (stored) notifier_->RemoveFds(detail::FdStoreName(id));
  });
}

void Daemon::Impl::WriteRecord() {
  // Handed over: the successor's now; taking over: the old daemon's still.
  if (handed_over_.load() || !record_writes_.load()) return;
  detail::Record record;
  record.instance = memfd_prefix_;
  record.pid = ::getpid();
  // One writer at a time, from the snapshot to the rename: writers sharing
  // the temporary file lost writes ("No such file or directory" when one
  // renamed the other's file away), and an older snapshot could land after
  // a newer one.
  base::MutexLock write_lock(&record_write_mu_);
  // Handed over while this writer waited: the successor writes it now
  // (HandleCommit waits for the writer already past here).
  if (handed_over_.load()) return;
  {
    base::MutexLock lock(&record_mu_);
    for (const auto& [id, e] : record_) record.copies.push_back(e.copy);
  }
  try {
    detail::WriteFileAtomically(detail::RecordPath(socket_path_),
                                detail::EncodeRecord(record));
  } catch (const Error& e) {
    // Without it a successor reclaims nothing: it loads again.
    ++record_write_failures_;
    if (!record_error_logged_.exchange(true)) Log(e.what());
  }
}

void Daemon::Impl::ReadPredecessorRecord() {
  std::optional<std::string> text;
  try {
    text = detail::ReadSmallFile(detail::RecordPath(socket_path_));
  } catch (const Error& e) {
    Log(std::string("the predecessor's record is unreadable: ") + e.what());
    return;
  }
  if (!text) return;
  detail::Record record;
  const std::string why = detail::ParseRecord(*text, &record);
  if (!why.empty()) {
    Log("the predecessor's record is refused (" + why + "): nothing reclaimed");
    return;
  }
  if (record.instance != memfd_prefix_) {
    Log("the record in " + detail::RecordPath(socket_path_) +
        " is another instance's: nothing reclaimed");
    return;
  }
  predecessor_ = std::move(record.copies);
  for (size_t i = 0; i < predecessor_.size(); ++i) {
    for (size_t f = 0; f < predecessor_[i].files.size(); ++f) {
      predecessor_by_data_[predecessor_[i].files[f].data] = {i, f};
    }
  }
}

}  // namespace modelcache::serve
