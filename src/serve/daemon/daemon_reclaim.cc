// Reclaim: copies a predecessor made (recorded in daemon_record.cc),
// adopted when a client that still maps them brings their memfds back, or
// when systemd's fd store passes them back at start (design note:
// daemon_internal.h).
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
    std::optional<Lease> lease = Adopt(adopted, /*booked=*/0, &why);
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
    SendError(c, r.id, code, LogRefusedReclaim(r, why));
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

  std::vector<MemfdId> memfds;  // as LeaseEntry::memfds lists them
  for (size_t f = 0; f < files; ++f) {
    memfds.push_back(seen[2 * f + 1].id);
    memfds.push_back(seen[2 * f].id);
  }
  // An orphan of this daemon's own, held by the same process.
  {
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

  // A copy whose adoption is in flight: this reclaim is handled again once
  // that ends (FinishReclaim), and then finds the copy in the store, held
  // for this process among its other mappers. (The store may hold it
  // already, but its mappers are held only once the adoption ends.)
  if (const auto p = predecessor_by_data_.find(seen[1].id);
      p != predecessor_by_data_.end()) {
    if (const auto in_flight = adopting_.find(p->second.first);
        in_flight != adopting_.end()) {
      SetAdopting(c, true);
      in_flight->second.push_back({c.id, r, std::move(fds)});
      return;
    }
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

  // Adopted already but retired (not the store's under its model): never a
  // second copy over its memfds, whose freeing would unbook them.
  if (!lease && ReclaimHeldCopy(c, r, memfds)) return;
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
    const size_t index = p->second.first;
    const detail::RecordedCopy& rc = predecessor_[index];
    if (rc.model != r.model || rc.files.size() != files) {
      refuse(ServeCode::kInvalid,
             "the predecessor made that copy of '" + rc.model + "' with " +
                 std::to_string(rc.files.size()) + " files");
      return;
    }
    detail::Adoption adoption;
    adoption.copy = std::make_shared<detail::AdoptedCopy>();
    adoption.copy->model = rc.model;
    adoption.copy->origin = "reclaimed";
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
      adoption.copy->files.push_back(
          {want.name, want.data_bytes, want.header_bytes, want.header_hash,
           std::move(fds[2 * f]), std::move(fds[2 * f + 1])});
    }
    // The bytes of its memfds booked as orphaned: they move into the
    // store's capacity with its reservation.
    {
      base::MutexLock lock(&orphans_mu_);
      std::set<MemfdId> counted;
      for (const Seen& s : seen) {
        const auto o = restart_orphans_.find(s.id);
        if (o != restart_orphans_.end() && counted.insert(s.id).second) {
          adoption.booked += o->second.bytes;
        }
      }
    }
    adoption.connection = c.id;
    adoption.request = r;
    adoption.pid = c.pid;
    adoption.predecessor = index;
    adoption.mappers = std::move(mappers);
    AdoptLater(c, std::move(adoption));
    return;
  }
  fds.clear();
  FileReclaimedLease(c, r, std::move(*lease), mappers);
}

void Daemon::Impl::FileReclaimedLease(Connection& c, const protocol::Request& r,
                                      Lease lease,
                                      const std::set<pid_t>& mappers) {
  // The lease, as Grant files one (already delivered: the client maps it).
  const auto* copy = lease.get<detail::ModelCopy>();
  std::shared_ptr<const detail::ModelCopy> keep = copy->shared_from_this();
  detail::LeaseEntry entry;
  entry.connection = c.id;
  entry.model = r.model;
  entry.pid = c.pid;
  entry.uid = c.uid;
  entry.bytes = lease.bytes();
  entry.copy = copy;
  entry.delivered = true;
  entry.lease = std::move(lease);
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
    if (retired) RecallInUseRetired(c, r.lease);
  }
  EndGrace(&r.model);
}

// ---- adoption, off the loop ----

void Daemon::Impl::SetAdopting(Connection& c, bool adopting) {
  if (c.adopting == adopting) return;
  c.adopting = adopting;
  EpollMod(epoll_fd_.get(), c.fd.get(), ConnectionEvents(c),
           Tagged(kConnTag, c.id));
}

void Daemon::Impl::AdoptLater(Connection& c, detail::Adoption adoption) {
  SetAdopting(c, true);
  adopting_[adoption.predecessor];
  ++adoptions_in_flight_;
  {
    base::MutexLock lock(&inbox_mu_);
    ++adoptions_queued_;
  }
  auto job = std::make_shared<detail::Adoption>(std::move(adoption));
  Later([this, job] {
    job->lease = Adopt(*job->copy, job->booked, &job->why);
    job->copy.reset();  // the descriptors the adoption did not take close
    {
      base::MutexLock lock(&inbox_mu_);
      adopted_.push_back(std::move(*job));
      --adoptions_queued_;
      adoptions_cv_.NotifyAll();
    }
    Wake();
  });
}

void Daemon::Impl::FinishReclaim(detail::Adoption adoption) {
  --adoptions_in_flight_;
  std::vector<detail::DeferredReclaim> deferred;
  if (const auto it = adopting_.find(adoption.predecessor);
      it != adopting_.end()) {
    deferred = std::move(it->second);
    adopting_.erase(it);
  }
  const protocol::Request& r = adoption.request;
  const auto conn = conns_.find(adoption.connection);
  Connection* c = conn == conns_.end() ? nullptr : conn->second.get();
  if (c != nullptr) SetAdopting(*c, false);
  std::map<MemfdId, detail::RestartOrphan> orphans;
  int unreadable;
  {
    base::MutexLock lock(&orphans_mu_);
    orphans = restart_orphans_;
    unreadable = unreadable_maps_;
  }
  if (adoption.lease) {
    const auto* copy = adoption.lease->get<detail::ModelCopy>();
    bytes_reclaimed_ += copy->bytes();
    // Its bytes left the orphaned ones with the reservation; the rest are
    // booked again (the pids watched for them, too).
    for (const detail::FileCopy& f : copy->files()) {
      orphans.erase(f.data_id);
      orphans.erase(f.header_id);
    }
  }
  // Applies what waited for the adoptions in flight, once none is.
  BookRestartOrphans(std::move(orphans), unreadable, /*now=*/false);
  if (!adoption.lease) {
    ++reclaims_refused_;
    const std::string text = LogRefusedReclaim(r, adoption.why);
    if (c != nullptr) SendError(*c, r.id, ServeCode::kCapacity, text);
  } else if (c != nullptr) {
    FileReclaimedLease(*c, r, std::move(*adoption.lease), adoption.mappers);
  } else {
    // Its connection ended meanwhile: its process, if it still maps the
    // copy, is held for as any other mapper, before the lease goes.
    const auto* copy = adoption.lease->get<detail::ModelCopy>();
    const std::shared_ptr<const Catalog> cat = catalog();
    const CatalogModel* spec = cat->Find(r.model);
    adoption.mappers.insert(adoption.pid);
    HoldForMappers(*copy, r.model, spec == nullptr || spec->id != r.model,
                   adoption.mappers);
    adoption.lease.reset();
    EndGrace(&r.model);
  }
  for (detail::DeferredReclaim& d : deferred) {
    const auto other = conns_.find(d.connection);
    if (other == conns_.end()) continue;  // its descriptors close
    SetAdopting(*other->second, false);
    HandleReclaim(*other->second, d.request, std::move(d.fds));
  }
}

std::optional<Lease> Daemon::Impl::Adopt(const detail::AdoptedCopy& adopted,
                                         uint64_t booked, std::string* why) {
  std::shared_ptr<detail::ModelCopy> made =
      detail::AdoptCopy(copy_options_, adopted);
  const uint64_t bytes = made->bytes();
  const std::string model = adopted.model;
  bool used = false;
  const void* id = made.get();
  const Loader loader = [&]() -> Loaded {
    used = true;
    return Loaded{made, bytes, [this, id] { GateUnload(id); }};
  };
  std::optional<Lease> lease;
  {
    // capacity_mu_: the store's capacity and the orphaned bytes change
    // together (lock order: capacity_mu_, then the store's). Held across
    // the reservation, which may evict: never on the loop.
    base::MutexLock lock(&capacity_mu_);
    detail::g_adopting = true;
    struct Done {
      ~Done() { detail::g_adopting = false; }
    } done;
    AcquireOptions options;
    options.when_full = WhenFull::kFail;
    options.request = false;
    // Never waits for a load or an unload of the model in progress: the
    // adoption is refused instead (it would be refused after the load
    // anyway, a copy being resident).
    options.deadline = Clock::now();
    options.grow_capacity = std::min(booked, orphaned_.load());
    try {
      Lease l = store_->Acquire(model, bytes, loader, options);
      if (used) {
        lease = std::move(l);
        ++adoptions_;
        adopted_bytes_ += bytes;
        orphaned_ -= options.grow_capacity;
      } else {
        *why = "another copy of '" + model + "' is resident";
      }
    } catch (const Error& e) {
      *why = e.what();
    }
  }
  if (!lease) return std::nullopt;
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
