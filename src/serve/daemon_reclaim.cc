// Reclaim: the record of the copies this daemon made, and copies a
// predecessor made, adopted when a client that still maps them brings
// their memfds back (design note: daemon_internal.h).
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
//
// After a crash, the successor reads the file (predecessor_) and books what
// live processes still map as orphaned bytes (daemon_orphans.cc). A
// reclaim names a lease and brings the copy's descriptors:
//   the lease is an orphan of this daemon (a takeover's, or a connection
//     that broke) held by the same process, over the same memfds
//     --> it belongs to the connection again;
//   the memfds are a copy in the store --> a new lease on it (a second
//     holder of a copy someone reclaimed first);
//   the memfds are a copy the predecessor recorded, sealed, of the recorded
//     sizes and header bytes --> adopted into the store (the orphaned bytes
//     move into the store's capacity in the same step, so used + orphaned
//     never grows), the lease with it; a model no longer in the catalog is
//     adopted retired;
//   anything else --> refused, counted, the descriptors closed.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <set>

#include "daemon_internal.h"
#include "event_loop.h"
#include "handover.h"
#include "modelcache/base/bytes.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::serve {

namespace detail {
thread_local bool g_adopting = false;
}  // namespace detail

using detail::Connection;
using detail::MemfdId;
using detail::Use;

namespace {

MemfdId IdOfStat(const struct stat& st) {
  return MemfdId{static_cast<uint64_t>(st.st_dev),
                 static_cast<uint64_t>(st.st_ino)};
}

bool Sealed(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & weights::MemfdSeals()) == weights::MemfdSeals();
}

// The memfd's first `size` bytes, or nullopt when it has fewer.
std::optional<std::string> ReadAll(int fd, uint64_t size) {
  std::string text(size, '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::pread(fd, text.data() + done, text.size() - done,
                              static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    done += static_cast<size_t>(n);
  }
  return text;
}

// What a descriptor brought back (a reclaim, the fd store) is.
struct Seen {
  MemfdId id;
  uint64_t size = 0;
  bool sealed = false;
};

// Whether `fd` is a regular file (a memfd); `out` says what it is.
bool See(int fd, Seen* out) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  *out = {IdOfStat(st), static_cast<uint64_t>(st.st_size), Sealed(fd)};
  return true;
}

// Why file `index` of a recorded copy, brought back as `header` (its
// descriptor `header_fd`) and `data`, is not what the record says, or "".
std::string Mismatch(const detail::RecordedFile& want, size_t index,
                     const Seen& header, int header_fd, const Seen& data) {
  const std::string file = "file " + std::to_string(index);
  if (header.id != want.header || data.id != want.data) {
    return file + " is not the recorded memfd";
  }
  if (!header.sealed || !data.sealed) {
    return "a memfd of " + file + " is not sealed";
  }
  if (header.size != want.header_bytes || data.size != want.data_size) {
    return "a memfd of " + file + " is not of the recorded size";
  }
  const std::optional<std::string> text =
      want.header_bytes <= weights::kMaxHeaderBytes
          ? ReadAll(header_fd, want.header_bytes)
          : std::nullopt;
  if (!text || detail::HeaderHash(*text) != want.header_hash) {
    return "the header of " + file + " does not hold the recorded bytes";
  }
  return "";
}

}  // namespace

// ---- the record ----

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

// ---- the fd store ----

void Daemon::Impl::TakeStored() {
  if (!options_.systemd) return;
  detail::ListenFds passed = detail::TakeListenFds();
  if (!passed.error.empty()) Log("systemd's descriptors: " + passed.error);
  stored_ = std::move(passed.fds);
  notifier_.emplace();
  if (!notifier_->enabled()) {
    if (!notifier_->error().empty()) {
      Log("NOTIFY_SOCKET refused: " + notifier_->error());
    }
    notifier_.reset();
  }
}

void Daemon::Impl::AdoptStored() {
  if (stored_.empty()) return;
  std::map<MemfdId, size_t> by_id;  // index into stored_
  std::vector<Seen> seen(stored_.size());
  for (size_t i = 0; i < stored_.size(); ++i) {
    if (See(stored_[i].fd.get(), &seen[i])) by_id[seen[i].id] = i;
  }
  std::set<std::string> kept;
  uint64_t adopted_bytes = 0;
  size_t adopted_copies = 0;
  for (const detail::RecordedCopy& rc : predecessor_) {
    if (rc.files.empty()) continue;
    detail::AdoptedCopy adopted;
    adopted.model = rc.model;
    adopted.origin = "reclaimed";
    std::string why;
    bool any = false;
    for (size_t f = 0; f < rc.files.size() && why.empty(); ++f) {
      const detail::RecordedFile& want = rc.files[f];
      const auto h = by_id.find(want.header);
      const auto d = by_id.find(want.data);
      if (h == by_id.end() || d == by_id.end()) {
        why = "file " + std::to_string(f) + " is not in the store";
        any = any || h != by_id.end() || d != by_id.end();
        continue;
      }
      any = true;
      why = Mismatch(want, f, seen[h->second], stored_[h->second].fd.get(),
                     seen[d->second]);
      if (!why.empty()) continue;
      adopted.files.push_back(
          {want.name, want.data_bytes, want.header_bytes, want.header_hash,
           base::UniqueFd(
               ::fcntl(stored_[h->second].fd.get(), F_DUPFD_CLOEXEC, 0)),
           base::UniqueFd(
               ::fcntl(stored_[d->second].fd.get(), F_DUPFD_CLOEXEC, 0))});
      if (!adopted.files.back().header || !adopted.files.back().data) {
        why = "out of descriptors";
      }
    }
    if (!why.empty()) {
      if (any) {
        Log("systemd's fd store: the copy of '" + rc.model +
            "' is not adopted: " + why);
      }
      continue;
    }
    const MemfdId key = rc.files[0].header;
    {
      // Stored already: RecordCopy, in Adopt, sends it no second time.
      base::MutexLock lock(&record_mu_);
      in_fd_store_.insert(key);
    }
    std::optional<Lease> lease = Adopt(std::move(adopted), false, &why);
    if (!lease) {
      base::MutexLock lock(&record_mu_);
      in_fd_store_.erase(key);
      Log("systemd's fd store: the copy of '" + rc.model +
          "' is not adopted: " + why);
      continue;
    }
    bytes_reclaimed_ += lease->bytes();
    adopted_bytes += lease->bytes();
    ++adopted_copies;
    kept.insert(detail::FdStoreName(key));
    // Resident and idle: evictable as any copy no one holds.
  }
  // The rest goes from systemd's store too.
  std::set<std::string> removed;
  for (const detail::ListenedFd& s : stored_) {
    if (kept.count(s.name) == 0 && removed.insert(s.name).second && notifier_ &&
        detail::IsValidFdName(s.name)) {
      notifier_->RemoveFds(s.name);
    }
  }
  Log("systemd's fd store: " + std::to_string(stored_.size()) +
      " descriptors passed back, " + std::to_string(adopted_copies) +
      " copies adopted (" + FormatBytes(adopted_bytes) + "), " +
      std::to_string(removed.size()) + " names removed");
  stored_.clear();
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

void Daemon::Impl::StartGrace() {
  if (predecessor_.empty() || options_.reclaim_grace.count() <= 0) return;
  // Only copies a live process still maps can come back.
  std::set<MemfdId> mapped;
  {
    base::MutexLock lock(&orphans_mu_);
    for (const auto& [id, o] : restart_orphans_) mapped.insert(id);
  }
  for (const detail::RecordedCopy& rc : predecessor_) {
    for (const detail::RecordedFile& f : rc.files) {
      if (mapped.count(f.data) != 0) reclaimable_.insert(rc.model);
    }
  }
  if (reclaimable_.empty()) return;
  grace_end_ = Clock::now() + options_.reclaim_grace;
  reclaiming_ = static_cast<int>(reclaimable_.size());
  Log("reclaim: " + std::to_string(reclaimable_.size()) +
      " models' copies are still mapped; their acquires wait up to " +
      std::to_string(options_.reclaim_grace.count()) + " ms for a reclaim");
}

bool Daemon::Impl::AwaitsReclaim(const std::string& model) const {
  return grace_end_ != Clock::time_point::max() &&
         reclaimable_.count(model) != 0;
}

void Daemon::Impl::EndGrace(const std::string* model) {
  std::vector<std::string> models;
  if (model != nullptr) {
    if (reclaimable_.erase(*model) == 0) return;
    models.push_back(*model);
  } else {
    models.assign(reclaimable_.begin(), reclaimable_.end());
    reclaimable_.clear();
    if (!models.empty()) {
      Log("reclaim: the grace period ended; " + std::to_string(models.size()) +
          " models were not reclaimed and load again when asked for");
    }
  }
  if (reclaimable_.empty()) grace_end_ = Clock::time_point::max();
  reclaiming_ = static_cast<int>(reclaimable_.size());
  for (const std::string& m : models) {
    const auto q = queues_.find(m);
    // Their task finds the model resident when it was reclaimed.
    if (q != queues_.end() && !q->second.waiters.empty()) Dispatch(m);
  }
}

// ---- reclaim ----

void Daemon::Impl::HandleReclaim(Connection& c, const protocol::Request& r,
                                 std::vector<base::UniqueFd> fds) {
  const auto refuse = [&](ServeCode code, const std::string& why) {
    ++reclaims_refused_;
    SendError(c, r.id, code,
              "reclaim of lease " + std::to_string(r.lease) + " ('" + r.model +
                  "') refused: " + why);
  };
  if (stopping_) {
    SendError(c, r.id, ServeCode::kUnavailable, "the daemon is shutting down");
    return;
  }
  if (fds.empty() || fds.size() % 2 != 0) {
    refuse(ServeCode::kInvalid, "it must carry 2 descriptors per file, not " +
                                    std::to_string(fds.size()));
    return;
  }
  if (c.leases.size() + c.waiters.size() >=
      static_cast<size_t>(options_.limits.max_leases_per_client)) {
    refuse(ServeCode::kBusy, "this connection holds too many leases");
    return;
  }
  // What each descriptor is.
  std::vector<Seen> seen(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    if (!See(fds[i].get(), &seen[i])) {
      refuse(ServeCode::kInvalid, "a descriptor is not a memfd");
      return;
    }
  }
  const size_t files = fds.size() / 2;

  // An orphan of this daemon's own, held by the same process.
  {
    std::vector<MemfdId> memfds;
    for (size_t f = 0; f < files; ++f) {
      memfds.push_back(seen[2 * f + 1].id);
      memfds.push_back(seen[2 * f].id);
    }
    bool own = false;
    bool mismatch = false;
    {
      base::MutexLock lock(&leases_mu_);
      const auto it = leases_.find(r.lease);
      if (it != leases_.end()) {
        detail::LeaseEntry& e = it->second;
        if (e.connection != 0 || e.pid != c.pid || e.model != r.model ||
            e.memfds != memfds) {
          mismatch = true;
        } else {
          own = true;
          e.connection = c.id;
          e.orphaned = false;
        }
      }
    }
    if (mismatch) {
      refuse(ServeCode::kInvalid,
             "that lease is held by another, or over other memfds");
      return;
    }
    if (own) {
      for (auto g = orphan_groups_.begin(); g != orphan_groups_.end(); ++g) {
        auto& ids = g->second.leases;
        const auto at = std::find(ids.begin(), ids.end(), r.lease);
        if (at == ids.end()) continue;
        ids.erase(at);
        --orphaned_leases_;
        if (ids.empty()) {
          EpollDel(epoll_fd_.get(), g->second.pidfd.get());
          orphan_groups_.erase(g);
        }
        break;
      }
      c.leases.insert(r.lease);
      ++reclaims_accepted_;
      if (r.idle) {
        protocol::Request idle = r;
        idle.op = protocol::Op::kIdle;
        HandleIdle(c, idle);  // answers ok
      } else {
        Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      }
      return;
    }
  }
  if (r.lease >= first_lease_) {
    refuse(ServeCode::kNotFound, "no such lease was handed out here");
    return;
  }

  // A copy in the store already (another holder reclaimed it first, or a
  // takeover brought it): a lease on it.
  std::optional<Lease> lease;
  const detail::ModelCopy* copy = nullptr;
  if (std::optional<Lease> hit = store_->TryAcquire(r.model)) {
    const auto* resident = hit->get<detail::ModelCopy>();
    bool same = resident->files().size() == files;
    for (size_t f = 0; same && f < files; ++f) {
      same = resident->files()[f].header_id == seen[2 * f].id &&
             resident->files()[f].data_id == seen[2 * f + 1].id;
    }
    if (same) {
      copy = resident;
      lease = std::move(*hit);
    }
  }

  // Other processes that map this copy too, as the scan at start saw them:
  // once it is adopted, the copy stays in use for each of them until it
  // reclaims its own lease, lets go, or exits (HoldForMappers). Until then
  // their mapping is in the books only through it.
  std::set<pid_t> mappers;
  if (lease) {
    // Adopted already: its mappers are held since. This process's hold,
    // if it has one, gives way to the lease it reclaims now.
    DropMapperHolds(c.pid, copy);
  } else {
    base::MutexLock lock(&orphans_mu_);
    for (const Seen& s : seen) {
      const auto o = restart_orphans_.find(s.id);
      if (o != restart_orphans_.end()) {
        mappers.insert(o->second.pids.begin(), o->second.pids.end());
      }
    }
  }
  mappers.erase(c.pid);

  if (!lease) {
    // A copy the predecessor recorded.
    const auto p = predecessor_by_data_.find(seen[1].id);
    if (p == predecessor_by_data_.end() || p->second.second != 0) {
      bytes_refused_ += seen[1].size;
      refuse(ServeCode::kInvalid,
             "these memfds are not a copy the predecessor made");
      return;
    }
    const detail::RecordedCopy& rc = predecessor_[p->second.first];
    if (rc.model != r.model || rc.files.size() != files) {
      refuse(ServeCode::kInvalid,
             "the predecessor made that copy of '" + rc.model + "' with " +
                 std::to_string(rc.files.size()) + " files");
      return;
    }
    detail::AdoptedCopy adopted;
    adopted.model = rc.model;
    adopted.origin = "reclaimed";
    for (size_t f = 0; f < files; ++f) {
      const detail::RecordedFile& want = rc.files[f];
      const Seen& data = seen[2 * f + 1];
      const std::string why =
          Mismatch(want, f, seen[2 * f], fds[2 * f].get(), data);
      if (!why.empty()) {
        bytes_refused_ += data.size;
        refuse(ServeCode::kInvalid, why);
        return;
      }
      adopted.files.push_back({want.name, want.data_bytes, want.header_bytes,
                               want.header_hash, std::move(fds[2 * f]),
                               std::move(fds[2 * f + 1])});
    }
    std::string why;
    lease = Adopt(std::move(adopted), /*from_orphans=*/true, &why);
    if (!lease) {
      refuse(ServeCode::kCapacity, why);
      return;
    }
    copy = lease->get<detail::ModelCopy>();
    bytes_reclaimed_ += copy->bytes();
  }
  fds.clear();

  // The lease, as Grant files one (already delivered: the client maps it).
  std::shared_ptr<const detail::ModelCopy> keep = copy->shared_from_this();
  detail::LeaseEntry entry;
  entry.connection = c.id;
  entry.model = r.model;
  entry.pid = c.pid;
  entry.uid = c.uid;
  entry.bytes = lease->bytes();
  entry.copy = copy;
  entry.delivered = true;
  entry.lease = std::move(*lease);
  for (const detail::FileCopy& f : keep->files()) {
    entry.memfds.push_back(f.data_id);
    entry.memfds.push_back(f.header_id);
  }
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* spec = cat->Find(r.model);
  entry.retired = spec == nullptr || spec->id != r.model;
  const bool retired = entry.retired;
  {
    base::MutexLock lock(&leases_mu_);
    leases_.emplace(r.lease, std::move(entry));
  }
  c.leases.insert(r.lease);
  ++reclaims_accepted_;
  HoldForMappers(*keep, r.model, retired, mappers);
  if (r.idle) {
    protocol::Request idle = r;
    idle.op = protocol::Op::kIdle;
    HandleIdle(c, idle);
  } else {
    Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
  }
  EndGrace(&r.model);
}

void Daemon::Impl::HoldForMappers(const detail::ModelCopy& copy,
                                  const std::string& model, bool retired,
                                  const std::set<pid_t>& pids) {
  if (pids.empty()) return;
  std::vector<MemfdId> memfds;
  for (const detail::FileCopy& f : copy.files()) {
    memfds.push_back(f.data_id);
    memfds.push_back(f.header_id);
  }
  for (const pid_t pid : pids) {
    base::UniqueFd pidfd(PidfdOpen(pid));
    if (!pidfd) continue;  // exited: it maps nothing any more
    ::fcntl(pidfd.get(), F_SETFD, FD_CLOEXEC);
    const uint64_t id = ++next_lease_;
    detail::LeaseEntry entry;
    entry.connection = 0;
    entry.orphaned = true;
    entry.held_for_mapper = true;
    entry.delivered = true;
    entry.model = model;
    entry.pid = pid;
    entry.bytes = copy.bytes();
    entry.copy = &copy;
    entry.memfds = memfds;
    entry.retired = retired;
    {
      // No store lease yet: uncovered, so its copy's unloader refuses until
      // CoverUncovered gives it one (a retired copy's stays refused).
      base::MutexLock lock(&leases_mu_);
      auto [it, inserted] = leases_.emplace(id, std::move(entry));
      IndexCoverage(id, it->second);
    }
    const uint64_t group = next_group_++;
    detail::OrphanGroup g;
    g.pidfd = std::move(pidfd);
    g.pid = pid;
    g.leases = {id};
    ++orphaned_leases_;
    EpollAdd(epoll_fd_.get(), g.pidfd.get(), EPOLLIN,
             Tagged(kOrphanPidTag, group));
    orphan_groups_.emplace(group, std::move(g));
    Log("pid " + std::to_string(pid) + " maps the reclaimed copy of '" + model +
        "' too: held in use for it until it reclaims its lease, lets go "
        "or exits");
  }
  CoverUncovered();
  ScheduleRescan();
}

void Daemon::Impl::DropMapperHolds(pid_t pid, const void* copy) {
  std::vector<uint64_t> drop;
  {
    base::MutexLock lock(&leases_mu_);
    for (const auto& [group_id, g] : orphan_groups_) {
      if (g.pid != pid) continue;
      for (const uint64_t id : g.leases) {
        const auto it = leases_.find(id);
        if (it != leases_.end() && it->second.held_for_mapper &&
            it->second.copy == copy) {
          drop.push_back(id);
        }
      }
    }
  }
  if (drop.empty()) return;
  for (auto g = orphan_groups_.begin(); g != orphan_groups_.end();) {
    auto& ids = g->second.leases;
    const size_t before = ids.size();
    std::erase_if(ids, [&](uint64_t id) {
      return std::find(drop.begin(), drop.end(), id) != drop.end();
    });
    orphaned_leases_ -= static_cast<int>(before - ids.size());
    if (ids.empty()) {
      EpollDel(epoll_fd_.get(), g->second.pidfd.get());
      g = orphan_groups_.erase(g);
    } else {
      ++g;
    }
  }
  // After the reclaimed lease took its store lease: the copy never looks
  // unleased in between.
  for (const uint64_t id : drop) ReleaseLease(id);
}

std::optional<Lease> Daemon::Impl::Adopt(detail::AdoptedCopy adopted,
                                         bool from_orphans, std::string* why) {
  std::shared_ptr<detail::ModelCopy> made =
      detail::AdoptCopy(copy_options_, adopted);
  const uint64_t bytes = made->bytes();
  const std::string model = adopted.model;
  // The bytes of its memfds booked as orphaned: they move into the store.
  std::set<MemfdId> ids;
  for (const detail::FileCopy& f : made->files()) {
    ids.insert(f.data_id);
    ids.insert(f.header_id);
  }
  uint64_t booked = 0;
  if (from_orphans) {
    base::MutexLock lock(&orphans_mu_);
    for (const MemfdId& id : ids) {
      const auto o = restart_orphans_.find(id);
      if (o != restart_orphans_.end()) booked += o->second.bytes;
    }
  }
  bool used = false;
  const void* id = made.get();
  const Loader loader = [&]() -> Loaded {
    used = true;
    return Loaded{made, bytes, [this, id] { GateUnload(id); }};
  };
  std::optional<Lease> lease;
  {
    // capacity_mu_: the store's capacity and the orphaned bytes change
    // together (lock order: capacity_mu_, then the store's). No other
    // thread holds it across evictions (ApplyCapacity evicts nothing), so
    // the loop waits here for short steps only.
    base::MutexLock lock(&capacity_mu_);
    detail::g_adopting = true;
    struct Done {
      ~Done() { detail::g_adopting = false; }
    } done;
    AcquireOptions options;
    options.when_full = WhenFull::kFail;
    options.request = false;
    // Never waits, on the loop, for a load or an unload of the model in
    // progress: the adoption is refused instead (it would be refused after
    // the load anyway, a copy being resident).
    options.deadline = Clock::now();
    options.grow_capacity = std::min(booked, orphaned_.load());
    try {
      Lease l = store_->Acquire(model, bytes, loader, options);
      if (used) {
        lease = std::move(l);
        ++adoptions_;
        adopted_bytes_ += bytes;
        if (options.grow_capacity > 0) {
          orphaned_ -= options.grow_capacity;
          booked_orphaned_ -= std::min(booked_orphaned_, options.grow_capacity);
        }
      } else {
        *why = "another copy of '" + model + "' is resident";
      }
    } catch (const Error& e) {
      *why = e.what();
    }
  }
  if (!lease) return std::nullopt;
  if (from_orphans) {
    // Its bytes left the orphaned ones with the reservation; the rest are
    // booked again (the pids watched for them, too).
    std::map<MemfdId, detail::RestartOrphan> orphans;
    int unreadable;
    {
      base::MutexLock lock(&orphans_mu_);
      orphans = restart_orphans_;
      unreadable = unreadable_maps_;
    }
    for (const MemfdId& i : ids) orphans.erase(i);
    BookRestartOrphans(std::move(orphans), unreadable, /*now=*/true);
  }
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* spec = cat->Find(model);
  if (spec == nullptr || spec->id != model) {
    // Gone from the catalog: its holders keep it, no one new gets it.
    store_->Remove(model);
  }
  RecordCopy(*made, /*later=*/true);
  Log(std::string("adopted the copy of '") + model + "' (" +
      FormatBytes(bytes) + ", " + adopted.origin + "): no byte loaded");
  return lease;
}

}  // namespace modelcache::serve
