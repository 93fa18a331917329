// Takeover: a running daemon hands its listening sockets, its copies and
// its leases to a successor started with --takeover, which loads nothing
// again (docs/serve.md, "Upgrades and crashes").
//
// The old daemon (on its loop):
//   serving --"takeover" from its own uid, same handover version, same
//     catalog--> draining: nothing is accepted, no other connection is
//     read, nothing new loads; the loads running finish and are delivered
//   draining --no load runs--> sent: the books (handover.h) and every
//     descriptor went out, its copies held by store leases meanwhile
//   sent --"commit"--> handed over: answers it, makes its callers' listeners
//     accept nothing here (dup2 of a socket that listens on nothing), closes
//     every client without a word (each reconnects to the successor and
//     reclaims its leases), and stops without unlinking the socket or
//     touching the record: both are the successor's now
//   draining/sent --the connection ends, or handover_deadline_--> serving,
//     as before
// A refused takeover is one error reply; nothing changes.
//
// The new daemon (its constructor): connects to the socket, asks, reads the
// handover, adopts every copy (a store lease each, "taken over"), files
// every lease as an orphan of its process (reclaim turns it back into a
// connection's lease; the process's exit ends it), takes the listening
// sockets, and commits. Anything before the commit fails the constructor
// with the reason, and the old daemon serves on; after it, the new one
// serves.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "daemon_internal.h"
#include "event_loop.h"
#include "handover.h"
#include "modelcache/base/bytes.h"
#include "modelcache/base/text.h"
#include "modelcache/weights/memfd.h"
#include "socket.h"

namespace modelcache::serve {

using detail::Connection;
using detail::Disconnect;
using json = nlohmann::json;

namespace {

constexpr size_t kChunkBytes = 16 << 10;  // of the books' text per message
constexpr size_t kFdsPerMessage = 250;    // SCM_MAX_FD is 253

[[noreturn]] void Refused(const std::string& why) {
  throw Error(ErrorCode::kUnavailable, "takeover refused: " + why);
}

}  // namespace

// ---- the old daemon ----

void Daemon::Impl::HandleTakeover(Connection& c, const protocol::Request& r) {
  const auto refuse = [&](const std::string& why) {
    Log("takeover asked by pid " + std::to_string(c.pid) + " refused: " + why);
    SendError(c, r.id, ServeCode::kInvalid, why);
  };
  if (c.uid != ::geteuid()) {
    refuse("only uid " + std::to_string(::geteuid()) +
           " (the daemon's own) may take over");
    return;
  }
  if (stopping_) {
    refuse("the daemon is shutting down");
    return;
  }
  if (handover_conn_ != 0) {
    refuse("another takeover is under way");
    return;
  }
  if (r.handover != detail::kHandoverVersion) {
    refuse("handover version " + std::to_string(r.handover) +
           " is not this daemon's (" +
           std::to_string(detail::kHandoverVersion) + ")");
    return;
  }
  std::string digest;
  {
    base::MutexLock lock(&catalog_mu_);
    digest = catalog_digest_;
  }
  if (r.catalog != digest) {
    refuse("the catalogs disagree (this daemon serves " + digest +
           ", the new one read " + r.catalog +
           "): start it with the same catalog, or reload this one first");
    return;
  }
  Log("takeover asked by pid " + std::to_string(c.pid) +
      ": draining (nothing accepted, no request read, nothing new loads)");
  handover_conn_ = c.id;
  handover_request_ = r.id;
  handover_sent_ = false;
  handover_deadline_ = Clock::now() + options_.takeover_timeout;
  EpollDel(epoll_fd_.get(), listen_fd_.get());
  for (const auto& [id, conn] : conns_) {
    EpollMod(epoll_fd_.get(), conn->fd.get(), ConnectionEvents(*conn),
             Tagged(kConnTag, id));
  }
  ContinueHandover(Clock::now());
}

void Daemon::Impl::ContinueHandover(Clock::time_point now) {
  if (handover_conn_ == 0 || handed_over_.load()) return;
  if (now >= handover_deadline_) {
    AbandonHandover("it took longer than the takeover timeout");
    return;
  }
  // Loads still running, or adoptions (their copies join the store), or a
  // reservation waiting for room (a prewarm's): the copies its drain holds
  // take no lease, and only leased copies are handed over.
  if (handover_sent_ || running_ > 0 || adoptions_in_flight_ > 0 ||
      store_->budget().OldestWaitArrival()) {
    return;
  }
  const auto it = conns_.find(handover_conn_);
  if (it == conns_.end()) return;
  SendHandover(*it->second);
}

void Daemon::Impl::SendHandover(Connection& c) {
  detail::Handover h;
  h.next_lease = next_lease_ + 1;
  {
    base::MutexLock lock(&catalog_mu_);
    h.catalog = catalog_digest_;
  }
  std::vector<int> fds;
  h.listeners.push_back("serve");
  fds.push_back(listen_fd_.get());
  {
    base::MutexLock lock(&handover_mu_);
    for (const auto& [name, fd] : handover_listeners_) {
      h.listeners.push_back(name);
      fds.push_back(fd);
    }
  }
  // The resident copies (a retired one is not handed over: its holders'
  // mappings are the successor's orphans), each held by a store lease
  // until the end.
  std::vector<std::string> models;
  {
    base::MutexLock lock(&record_mu_);
    for (const auto& [id, e] : record_) models.push_back(e.copy.model);
  }
  std::map<const void*, size_t> index;
  handover_leases_.clear();
  for (const std::string& model : models) {
    std::optional<Lease> lease = store_->TryAcquire(model);
    if (!lease) continue;
    const auto* copy = lease->get<detail::ModelCopy>();
    if (index.count(copy) != 0) continue;
    detail::RecordedCopy rc;
    rc.model = model;
    for (const detail::FileCopy& f : copy->files()) {
      struct stat st;
      const uint64_t size = ::fstat(f.data_fd(), &st) == 0
                                ? static_cast<uint64_t>(st.st_size)
                                : 0;
      rc.files.push_back({f.name, f.data_bytes, f.header_bytes, f.data_id, size,
                          f.header_id, f.header_hash});
      fds.push_back(f.header.get());
      fds.push_back(f.data_fd());
    }
    index[copy] = h.copies.size();
    h.copies.push_back(std::move(rc));
    {
      base::MutexLock lock(&stats_mu_);
      const auto s = model_stats_.find(model);
      h.loads.push_back(s == model_stats_.end() ? 0 : s->second.loads);
    }
    const std::optional<EntryInfo> entry = store_->Entry(model);
    h.pinned.push_back(entry && entry->pinned);
    handover_leases_.push_back(std::move(*lease));
  }
  {
    base::MutexLock lock(&leases_mu_);
    for (const auto& [id, e] : leases_) {
      const auto at = index.find(e.copy);
      if (at == index.end() || !e.delivered || e.retired) continue;
      h.leases.push_back({id, at->second, static_cast<int64_t>(e.pid),
                          static_cast<uint64_t>(e.uid),
                          e.use != detail::Use::kInUse});
    }
  }
  const std::string text = detail::EncodeHandover(h);
  // Messages of at most kChunkBytes of text and kFdsPerMessage descriptors.
  size_t at = 0;
  size_t fd_at = 0;
  uint64_t part = 0;
  while (at < text.size() || fd_at < fds.size()) {
    const size_t n = std::min(kChunkBytes, text.size() - at);
    const size_t k = std::min(kFdsPerMessage, fds.size() - fd_at);
    const bool more = at + n < text.size() || fd_at + k < fds.size();
    json message = {{"id", handover_request_},
                    {"ok", true},
                    {"part", part++},
                    {"more", more},
                    {"chunk", text.substr(at, n)}};
    detail::Outgoing out;
    out.bytes = message.dump();
    out.fds.assign(fds.begin() + static_cast<std::ptrdiff_t>(fd_at),
                   fds.begin() + static_cast<std::ptrdiff_t>(fd_at + k));
    Send(c, std::move(out));
    at += n;
    fd_at += k;
  }
  handover_sent_ = true;
  Log("takeover: handed over " + std::to_string(h.copies.size()) + " copies, " +
      std::to_string(h.leases.size()) + " leases and " +
      std::to_string(h.listeners.size()) + " listening sockets; " +
      "awaiting the commit");
}

void Daemon::Impl::AbandonHandover(const std::string& why) {
  if (handover_conn_ == 0 || handed_over_.load()) return;
  Log("takeover abandoned (" + why + "): serving on");
  const uint64_t conn = handover_conn_;
  handover_conn_ = 0;
  handover_sent_ = false;
  handover_deadline_ = Clock::time_point::max();
  handover_leases_.clear();
  EpollAdd(epoll_fd_.get(), listen_fd_.get(), EPOLLIN, Tagged(kListenTag, 0));
  for (const auto& [id, c] : conns_) {
    EpollMod(epoll_fd_.get(), c->fd.get(), ConnectionEvents(*c),
             Tagged(kConnTag, id));
  }
  if (const auto it = conns_.find(conn); it != conns_.end()) {
    Doom(*it->second, Disconnect::kClosed);
  }
  StartQueued();
}

void Daemon::Impl::HandleCommit(Connection& c, const protocol::Request& r) {
  if (c.id != handover_conn_ || !handover_sent_) {
    SendError(c, r.id, ServeCode::kInvalid, "no takeover to commit");
    return;
  }
  handed_over_ = true;
  // No record write of this daemon's may land after the successor's: one
  // past its handed_over_ check (the background thread's, a load's) ends
  // before the answer, and any later one sees handed_over_. The loop waits
  // for at most that one write here; it serves nothing after the commit,
  // and the successor awaits this answer.
  { base::MutexLock barrier(&record_write_mu_); }
  // Straight onto the socket: the successor read everything before it
  // committed, so there is room, and the connection closes next.
  detail::SendDatagram(c.fd.get(), protocol::EncodeOk(r.id), {}, MSG_DONTWAIT);
  Log("takeover committed: the successor serves; closing every client");
  // The callers' listeners accept nothing here from now on: their threads
  // let go of the descriptors (disown), and the same descriptor numbers
  // now name sockets that listen on nothing (their next accept fails,
  // which ends them), while the successor holds the listening sockets
  // themselves.
  {
    base::MutexLock lock(&handover_mu_);
    if (disown_listeners_) disown_listeners_();
    for (const auto& [name, fd] : handover_listeners_) {
      int domain = AF_UNIX;
      socklen_t length = sizeof(domain);
      ::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &length);
      const int dead = ::socket(domain, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (dead >= 0) {
        ::dup2(dead, fd);
        ::close(dead);
      }
    }
  }
  handover_leases_.clear();
  // Without a word: each client reconnects to the successor (a request in
  // flight is sent again there) and reclaims its leases. Its waiting
  // acquires go unanswered here, so that shutting down answers none.
  std::vector<uint64_t> seqs;
  for (const auto& [seq, w] : waiters_) seqs.push_back(seq);
  for (const uint64_t seq : seqs) RemoveWaiter(seq);
  for (const auto& [id, conn] : conns_) Doom(*conn, Disconnect::kShutdown);
  handover_conn_ = 0;
  handover_deadline_ = Clock::time_point::max();
  BeginShutdown();
}

// ---- the new daemon ----

void Daemon::Impl::TakeOver() {
  // The record is the old daemon's until the commit.
  record_writes_ = false;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + options_.takeover_timeout;
  sockaddr_un address{};
  if (socket_path_.size() >= sizeof(address.sun_path)) {
    Invalid("socket path '" + socket_path_ + "' is too long");
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path_.c_str(), socket_path_.size() + 1);
  base::UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                       sizeof(address)) != 0) {
    const int e = errno;
    Refused("no daemon serves on " + socket_path_ + " to take over from (" +
            base::ErrnoText(e) + ")");
  }
  const auto wait = [&](short events) {
    pollfd p{fd.get(), events, 0};
    for (;;) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) Refused("the old daemon did not finish in time");
      const int n = ::poll(&p, 1, static_cast<int>(left.count()));
      if (n > 0) return;
      if (n < 0 && errno != EINTR) Refused("poll failed");
    }
  };
  std::string digest;
  {
    base::MutexLock lock(&catalog_mu_);
    digest = catalog_digest_;
  }
  wait(POLLOUT);
  if (detail::SendDatagram(
          fd.get(),
          protocol::EncodeTakeover(1, detail::kHandoverVersion, digest), {},
          0) != 0) {
    Refused("cannot ask the old daemon");
  }
  // The handover: its parts in order, with their descriptors.
  std::string text;
  std::vector<base::UniqueFd> fds;
  for (;;) {
    wait(POLLIN);
    detail::Datagram d;
    const int got = detail::ReceiveDatagram(
        fd.get(), protocol::kMaxMessageBytes, 253, MSG_DONTWAIT, &d);
    if (got == 0) Refused("the old daemon closed the connection");
    if (got < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      Refused("cannot read the handover");
    }
    if (d.truncated || d.fds_truncated) Refused("a handover part was cut");
    const json m = json::parse(d.bytes, nullptr, /*allow_exceptions=*/false);
    if (!m.is_object() || !m.contains("id") || !m["id"].is_number_unsigned()) {
      Refused("the old daemon sent something that is not a reply");
    }
    if (m["id"].get<uint64_t>() == 0) continue;  // its own news
    if (!m.value("ok", false)) {
      const json error = m.value("error", json::object());
      Refused(error.is_object() && error.contains("message") &&
                      error["message"].is_string()
                  ? error["message"].get<std::string>()
                  : d.bytes);
    }
    if (!m.contains("chunk") || !m["chunk"].is_string() ||
        !m.contains("more") || !m["more"].is_boolean()) {
      Refused("a handover part lacks its chunk");
    }
    text += m["chunk"].get<std::string>();
    for (base::UniqueFd& f : d.fds) fds.push_back(std::move(f));
    if (!m["more"].get<bool>()) break;
  }
  detail::Handover h;
  if (const std::string why = detail::ParseHandover(text, &h); !why.empty()) {
    Refused("the handover is malformed: " + why);
  }
  if (fds.size() != detail::HandoverFdCount(h)) {
    Refused("the handover announced " +
            std::to_string(detail::HandoverFdCount(h)) +
            " descriptors and brought " + std::to_string(fds.size()));
  }
  size_t at = 0;
  std::map<std::string, base::UniqueFd> listeners;
  for (const std::string& name : h.listeners)
    listeners[name] = std::move(fds[at++]);
  if (listeners.count("serve") == 0 || !listeners["serve"]) {
    Refused("the handover has no listening socket");
  }
  // The copies: adopted, each with a store lease until its leases are filed.
  std::vector<std::optional<Lease>> held(h.copies.size());
  std::vector<const detail::ModelCopy*> copies(h.copies.size(), nullptr);
  for (size_t i = 0; i < h.copies.size(); ++i) {
    const detail::RecordedCopy& rc = h.copies[i];
    detail::AdoptedCopy adopted;
    adopted.model = rc.model;
    adopted.origin = "taken over";
    bool ok = true;
    for (const detail::RecordedFile& f : rc.files) {
      base::UniqueFd header = std::move(fds[at++]);
      base::UniqueFd data = std::move(fds[at++]);
      struct stat hs;
      struct stat ds;
      ok = ok && ::fstat(header.get(), &hs) == 0 &&
           ::fstat(data.get(), &ds) == 0 &&
           static_cast<uint64_t>(hs.st_ino) == f.header.inode &&
           static_cast<uint64_t>(ds.st_ino) == f.data.inode &&
           static_cast<uint64_t>(ds.st_size) == f.data_size;
      adopted.files.push_back({f.name, f.data_bytes, f.header_bytes,
                               f.header_hash, std::move(header),
                               std::move(data)});
    }
    if (!ok) {
      Log("takeover: the copy of '" + rc.model +
          "' came with descriptors that are not its own: not adopted");
      continue;
    }
    std::string why;
    held[i] = Adopt(std::move(adopted), /*from_orphans=*/false, &why);
    if (!held[i]) {
      Log("takeover: the copy of '" + rc.model + "' not adopted: " + why);
      continue;
    }
    copies[i] = held[i]->get<detail::ModelCopy>();
    bytes_taken_over_ += copies[i]->bytes();
    if (h.pinned[i]) store_->Pin(rc.model);
    base::MutexLock lock(&stats_mu_);
    model_stats_[rc.model].loads = h.loads[i];
  }
  // The leases: orphans of their processes until reclaimed.
  next_lease_ = std::max(next_lease_, h.next_lease);
  first_lease_ = next_lease_ + 1;
  std::map<int64_t, std::vector<uint64_t>> by_pid;
  for (const detail::HandoverLease& l : h.leases) {
    const detail::ModelCopy* copy = copies[l.copy];
    if (copy == nullptr) continue;
    std::optional<Lease> lease = store_->TryAcquire(copy->model());
    if (!lease || lease->get<detail::ModelCopy>() != copy) continue;
    detail::LeaseEntry e;
    e.lease = std::move(*lease);
    e.copy = copy;
    e.model = copy->model();
    e.pid = static_cast<pid_t>(l.pid);
    e.uid = static_cast<uid_t>(l.uid);
    e.delivered = true;
    e.orphaned = true;
    e.bytes = e.lease.bytes();
    for (const detail::FileCopy& f : copy->files()) {
      e.memfds.push_back(f.data_id);
      e.memfds.push_back(f.header_id);
    }
    {
      base::MutexLock lock(&leases_mu_);
      leases_.emplace(l.id, std::move(e));
    }
    by_pid[l.pid].push_back(l.id);
  }
  for (auto& [pid, ids] : by_pid) {
    base::UniqueFd pidfd(PidfdOpen(static_cast<pid_t>(pid)));
    if (!pidfd) {  // gone already
      for (const uint64_t id : ids) ReleaseLease(id);
      continue;
    }
    ::fcntl(pidfd.get(), F_SETFD, FD_CLOEXEC);
    const uint64_t group = next_group_++;
    detail::OrphanGroup g;
    g.pidfd = std::move(pidfd);
    g.pid = static_cast<pid_t>(pid);
    g.leases = ids;
    orphaned_leases_ += static_cast<int>(ids.size());
    EpollAdd(epoll_fd_.get(), g.pidfd.get(), EPOLLIN,
             Tagged(kOrphanPidTag, group));
    orphan_groups_.emplace(group, std::move(g));
  }
  if (!orphan_groups_.empty()) ScheduleRescan();
  held.clear();  // the leases filed hold the copies now

  // The commit: from here on this daemon serves, whatever the answer.
  wait(POLLOUT);
  detail::SendDatagram(fd.get(), protocol::EncodeCommit(2), {}, 0);
  wait(POLLIN);
  detail::Datagram answer;
  detail::ReceiveDatagram(fd.get(), protocol::kMaxMessageBytes, 0, MSG_DONTWAIT,
                          &answer);
  listen_fd_ = std::move(listeners["serve"]);
  listeners.erase("serve");
  struct stat st;
  if (::stat(socket_path_.c_str(), &st) == 0) socket_inode_ = st.st_ino;
  EpollAdd(epoll_fd_.get(), listen_fd_.get(), EPOLLIN, Tagged(kListenTag, 0));
  {
    base::MutexLock lock(&handover_mu_);
    taken_listeners_ = std::move(listeners);
  }
  takeover_seconds_ =
      std::chrono::duration<double>(Clock::now() - start).count();
  Log("took over " + std::to_string(h.copies.size()) + " copies (" +
      FormatBytes(bytes_taken_over_.load()) + ", no byte loaded) and " +
      std::to_string(h.leases.size()) + " leases in " +
      std::to_string(takeover_seconds_.load()) + " s; listening on " +
      socket_path_);
  record_writes_ = true;
  WriteRecord();
}

void Daemon::Impl::SetHandoverListeners(
    std::vector<std::pair<std::string, int>> fds,
    std::function<void()> disown) {
  base::MutexLock lock(&handover_mu_);
  handover_listeners_ = std::move(fds);
  disown_listeners_ = std::move(disown);
}

int Daemon::Impl::TakeHandedOverListener(const std::string& name) {
  base::MutexLock lock(&handover_mu_);
  const auto it = taken_listeners_.find(name);
  if (it == taken_listeners_.end()) return -1;
  const int fd = it->second.release();
  taken_listeners_.erase(it);
  return fd;
}

}  // namespace modelcache::serve
