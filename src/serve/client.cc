// The client: connection, request/reply matching, mapping of copies, fork.
//
// Design note.
//
// ClientCore holds at most one connection at a time (a Connection: the
// socket, a serial number, whether it broke, what hello said). A call takes
// a request id, sends its datagram (datagrams are atomic, so threads send
// without a lock of their own) and waits for the reply with its id. One
// waiting thread at a time reads the socket (the *reader*, chosen under mu_),
// with no lock held while it polls; it files each reply under its id and
// wakes the others, who wait on cv_. A reply nobody waits for any more (its
// caller timed out or was interrupted) that grants a lease is released at
// once, so an abandoned acquire never holds a copy.
//
// A connection breaks on EOF or a socket error. A message of the daemon's
// own (id 0) does not break it (protocol.h): its text becomes the reason
// given if the connection then ends. Callers waiting on it then retry on a new
// connection (acquires and pings; a lease dies with its connection, so retrying
// is safe) or fail with DaemonUnavailableError. Connecting is done by one
// thread at a time (connecting_), with exponential backoff, until the
// caller's deadline.
//
// Releases do not wait for their reply: RemoteWeights sends the release
// and drains, without blocking, whatever replies are waiting, so a client
// that only releases never lets the daemon's reply queue grow. A release
// the socket has no room for (the daemon is slow to read) is never dropped:
// it joins the connection's queue of unsent releases, which the *flusher*
// thread (started when the queue first fills, gone when it is empty and
// every release it sent is answered) sends, in order, as the socket becomes
// writable, reading the replies meanwhile when no other thread reads. Every
// other request of that connection is sent after the queued releases, so a
// reply to it means the daemon has had them all. All sends on a connection
// happen under mu_ (without blocking), which keeps that order.
//
// fork(): a child must not touch its parent's ClientCore, whose mutex may
// be held by a thread that does not exist in the child. An atfork handler
// bumps a global generation and closes every socket of every core (they are
// kept in a lock-free table for it). A Client whose core is of an older
// generation leaves it alone, leaked on purpose, and makes a new one. Grants
// and connections of an older generation do nothing when destroyed: the
// child has no mapping at their addresses (MADV_DONTFORK) and must not
// close descriptor numbers it may have reused.
#include "modelcache/serve/client.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "modelcache/base/mutex.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/weights/memfd.h"
#include "protocol.h"
#include "socket.h"

namespace modelcache::serve {

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<uint64_t> g_fork_generation{0};

// The sockets of every live connection, for the atfork child handler: a
// slot holds fd + 1, 0 when free (static storage starts zeroed).
constexpr size_t kSocketSlots = 256;
std::atomic<int> g_sockets[kSocketSlots];

void CloseSocketsInChild() {
  for (auto& slot : g_sockets) {
    const int held = slot.exchange(0);
    if (held > 0) ::close(held - 1);
  }
  g_fork_generation.fetch_add(1);
}

void InstallForkHandler() {
  static std::once_flag once;
  std::call_once(
      once, [] { ::pthread_atfork(nullptr, nullptr, &CloseSocketsInChild); });
}

int RegisterSocket(int fd) {
  for (size_t i = 0; i < kSocketSlots; ++i) {
    int expected = 0;
    if (g_sockets[i].compare_exchange_strong(expected, fd + 1)) {
      return static_cast<int>(i);
    }
  }
  return -1;  // table full: this socket stays open in children
}

std::string ErrnoText(int error) {
  char buffer[256];
  return ::strerror_r(error, buffer, sizeof(buffer));
}

int MillisUntil(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return 1000;
  const auto left =
      std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000));
}

Clock::time_point After(std::chrono::milliseconds d) {
  if (d.count() < 0) d = std::chrono::milliseconds(0);
  const auto now = Clock::now();
  if (d >= std::chrono::duration_cast<std::chrono::milliseconds>(
               Clock::time_point::max() - now)) {
    return Clock::time_point::max();
  }
  return now + d;
}

[[noreturn]] void ThrowErrorOf(const protocol::Reply& reply) {
  if (reply.code == ServeCode::kUnavailable) {
    throw DaemonUnavailableError(reply.message);
  }
  ErrorCode core = CoreCodeOf(reply.code);
  if (reply.code == ServeCode::kLoadFailed && reply.cause == "invalid_data") {
    core = ErrorCode::kInvalidData;
  }
  throw ServeError(reply.code, core, reply.message);
}

}  // namespace

struct Connection {
  base::UniqueFd fd;
  int slot = -1;
  uint64_t serial = 0;
  uint64_t generation = 0;
  bool broken = false;  // guarded by the core's mu_
  ServerInfo info;
  // Guarded by the core's mu_: releases not sent yet, in the order they
  // were made (id, datagram), and the ids of releases sent but not answered.
  // At most `window` releases are unanswered at once, so that the daemon's
  // answers never pile up past its max_queued_replies while we send.
  std::deque<std::pair<uint64_t, std::string>> unsent;
  std::unordered_set<uint64_t> unanswered;
  size_t window = 64;
  std::string note;  // the daemon's last id-0 message (core's mu_)

  ~Connection() {
    if (generation != g_fork_generation.load()) {
      fd.release();  // closed at fork; the number may be another's now
      return;
    }
    if (slot >= 0) {
      int expected = fd.get() + 1;
      g_sockets[static_cast<size_t>(slot)].compare_exchange_strong(expected, 0);
    }
  }
};

struct Grant {
  std::shared_ptr<ClientCore> core;
  uint64_t serial = 0;
  uint64_t lease = 0;
  uint64_t generation = 0;
  std::string model;
  std::string load;  // the reply's "load"
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
  };
  std::vector<Mapping> mappings;
  std::vector<weights::WeightSet> files;
  std::vector<RemoteTensor> tensors;
  std::vector<size_t> first_tensor;  // of each file, in `tensors`
  uint64_t data_bytes = 0;

  ~Grant();
};

class ClientCore : public std::enable_shared_from_this<ClientCore> {
 public:
  ClientCore(std::string path, ClientOptions options)
      : path_(std::move(path)),
        options_(options),
        generation_(g_fork_generation.load()) {}
  // Stops the flusher: releases still queued die with the connection
  // (which closes now), as the daemon's books of it do.
  ~ClientCore() MC_EXCLUDES(mu_);

  uint64_t generation() const { return generation_; }
  const std::string& path() const { return path_; }
  const ClientOptions& options() const { return options_; }

  // Connects unless connected; throws as Client::Connect says.
  std::shared_ptr<Connection> Connected(Clock::time_point deadline,
                                        const WaitInterrupt* interrupt)
      MC_EXCLUDES(mu_);

  RemoteWeights Acquire(std::string_view model,
                        const RemoteAcquireOptions& options);
  void Ping(std::chrono::milliseconds timeout);
  void Close() MC_EXCLUDES(mu_);
  // Ends a lease of connection `serial`: nothing if that connection is gone.
  void Release(uint64_t serial, uint64_t lease) noexcept MC_EXCLUDES(mu_);

 private:
  struct Slot {
    uint64_t serial = 0;
    bool done = false;
    protocol::Reply reply;
    std::vector<base::UniqueFd> fds;
  };
  struct Exchanged {
    protocol::Reply reply;
    std::vector<base::UniqueFd> fds;
    std::shared_ptr<Connection> connection;
  };

  std::shared_ptr<Connection> Dial(Clock::time_point deadline);
  // Sends the request `encode(id)` and waits for its reply, reconnecting
  // and sending again when the connection breaks, until `deadline`.
  Exchanged Exchange(const std::function<std::string(uint64_t)>& encode,
                     Clock::time_point deadline, const WaitInterrupt* interrupt)
      MC_EXCLUDES(mu_);
  // Sends `message` after the releases queued on `c`, waiting for room
  // until `deadline`; false when it could not.
  bool SendOn(Connection& c, std::string_view message,
              Clock::time_point deadline) MC_EXCLUDES(mu_);
  // Sends a release of `lease` on `c`, or queues it when the socket is full.
  void SendRelease(const std::shared_ptr<Connection>& c, uint64_t lease)
      MC_REQUIRES(mu_);
  // Sends what `c` has queued until the socket is full; false on a socket
  // error.
  bool FlushUnsent(Connection& c) MC_REQUIRES(mu_);
  void StartFlusher() MC_REQUIRES(mu_);
  void Flusher() MC_EXCLUDES(mu_);
  // Reads what the socket holds (waiting up to `wait_ms`) and files it.
  // Called by the reader, without mu_.
  void ReadAndFile(const std::shared_ptr<Connection>& c, int wait_ms)
      MC_EXCLUDES(mu_);
  void Broke(const std::shared_ptr<Connection>& c) MC_REQUIRES(mu_);

  const std::string path_;
  const ClientOptions options_;
  const uint64_t generation_;

  base::Mutex mu_;
  base::CondVar cv_;
  std::shared_ptr<Connection> conn_ MC_GUARDED_BY(mu_);
  bool connecting_ MC_GUARDED_BY(mu_) = false;
  bool reading_ MC_GUARDED_BY(mu_) = false;
  uint64_t next_id_ MC_GUARDED_BY(mu_) = 1;
  uint64_t next_serial_ MC_GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, Slot> pending_ MC_GUARDED_BY(mu_);
  std::string last_break_ MC_GUARDED_BY(mu_);

  // The flusher (see the design note); wake_fd_ interrupts its poll.
  bool flushing_ MC_GUARDED_BY(mu_) = false;
  bool stop_ MC_GUARDED_BY(mu_) = false;
  std::thread flusher_ MC_GUARDED_BY(mu_);
  base::UniqueFd wake_fd_ MC_GUARDED_BY(mu_);

  // Headers already parsed, so that a copy acquired again is not parsed
  // again. Keyed by what fstat says of the header memfd: a memfd's inode
  // number comes round again only after 2^32 others, and never with the
  // same change time to the nanosecond.
  struct HeaderKey {
    uint64_t dev;
    uint64_t inode;
    uint64_t size;
    int64_t ctime_ns;
    auto operator<=>(const HeaderKey&) const = default;
  };
  static constexpr size_t kMaxHeaders = 1024;
  std::map<HeaderKey, std::shared_ptr<const weights::SafetensorsHeader>>
      headers_ MC_GUARDED_BY(mu_);

  std::shared_ptr<const weights::SafetensorsHeader> CachedHeader(
      const HeaderKey& key) MC_EXCLUDES(mu_) {
    base::MutexLock lock(&mu_);
    const auto it = headers_.find(key);
    return it == headers_.end() ? nullptr : it->second;
  }
  void CacheHeader(const HeaderKey& key,
                   std::shared_ptr<const weights::SafetensorsHeader> header)
      MC_EXCLUDES(mu_) {
    base::MutexLock lock(&mu_);
    if (headers_.size() >= kMaxHeaders) headers_.clear();
    headers_.emplace(key, std::move(header));
  }
};

Grant::~Grant() {
  if (generation != g_fork_generation.load()) return;  // a forked child's
  files.clear();
  for (const Mapping& m : mappings) ::munmap(m.base, m.bytes);
  mappings.clear();
  if (core && lease != 0) core->Release(serial, lease);
}

std::shared_ptr<Connection> ClientCore::Dial(Clock::time_point deadline) {
  sockaddr_un address{};
  if (path_.empty() || path_.size() >= sizeof(address.sun_path)) {
    throw DaemonUnavailableError("socket path '" + path_ +
                                 "' is empty or too long");
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path_.c_str(), path_.size() + 1);
  auto c = std::make_shared<Connection>();
  c->generation = generation_;
  c->fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!c->fd) {
    const int e = errno;
    throw DaemonUnavailableError("cannot make a socket: " + ErrnoText(e));
  }
  // A full backlog makes connect wait; bound that wait.
  timeval tv{};
  tv.tv_sec = 1;
  ::setsockopt(c->fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int r;
  do {
    r = ::connect(c->fd.get(), reinterpret_cast<sockaddr*>(&address),
                  sizeof(address));
  } while (r != 0 && errno == EINTR);
  if (r != 0) {
    const int e = errno;
    throw DaemonUnavailableError("cannot reach the daemon at " + path_ + ": " +
                                 ErrnoText(e));
  }
  ::fcntl(c->fd.get(), F_SETFL, ::fcntl(c->fd.get(), F_GETFL) | O_NONBLOCK);
  InstallForkHandler();
  c->slot = RegisterSocket(c->fd.get());

  // hello, on a socket nobody else uses yet. A daemon that refuses the
  // connection (too many clients) has already queued its reason: read it
  // even when the send fails.
  const Clock::time_point hello_deadline =
      std::max(deadline, Clock::now() + std::chrono::seconds(5));
  const bool sent = SendOn(*c, protocol::EncodeHello(1), hello_deadline);
  Datagram datagram;
  for (;;) {
    const int got = ReceiveDatagram(c->fd.get(), protocol::kMaxMessageBytes, 0,
                                    MSG_DONTWAIT, &datagram);
    if (got == 0) {
      throw DaemonUnavailableError("the daemon at " + path_ +
                                   " closed the connection");
    }
    if (got > 0) {
      const protocol::ParsedReply parsed = protocol::ParseReply(datagram.bytes);
      if (!parsed.reply) {
        throw ServeError(ServeCode::kInvalid,
                         "malformed reply to hello: " + parsed.error);
      }
      if (!parsed.reply->ok) ThrowErrorOf(*parsed.reply);
      if (parsed.reply->id != 1) continue;
      c->info.server = parsed.reply->server;
      c->info.version = parsed.reply->version;
      c->info.limits = parsed.reply->limits;
      if (const auto it = c->info.limits.find("max_queued_replies");
          it != c->info.limits.end()) {
        c->window =
            static_cast<size_t>(std::clamp<uint64_t>(it->second / 2, 1, 1024));
      }
      return c;
    }
    // A peer that closed with our hello unread reports ECONNRESET once,
    // before the messages it queued: read on.
    if (errno == ECONNRESET) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      const int e = errno;
      throw DaemonUnavailableError("lost the daemon at " + path_ + ": " +
                                   ErrnoText(e));
    }
    if (!sent) {
      throw DaemonUnavailableError("the daemon at " + path_ +
                                   " closed the connection");
    }
    if (Clock::now() >= hello_deadline) {
      throw DaemonUnavailableError("the daemon at " + path_ +
                                   " did not answer hello");
    }
    pollfd p{c->fd.get(), POLLIN, 0};
    ::poll(&p, 1, MillisUntil(hello_deadline));
  }
}

bool ClientCore::SendOn(Connection& c, std::string_view message,
                        Clock::time_point deadline) {
  for (;;) {
    {
      base::MutexLock lock(&mu_);
      if (!FlushUnsent(c)) return false;
      if (!c.unsent.empty()) {
        // Behind the releases: the flusher sends them and says when.
        if (c.broken) return false;
        StartFlusher();
        if (!cv_.WaitUntil(&mu_, deadline) && Clock::now() >= deadline) {
          return false;
        }
        continue;
      }
      if (SendDatagram(c.fd.get(), message, {}, MSG_DONTWAIT) == 0) {
        return true;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    }
    if (Clock::now() >= deadline) return false;
    pollfd p{c.fd.get(), POLLOUT, 0};
    ::poll(&p, 1, MillisUntil(deadline));
  }
}

std::shared_ptr<Connection> ClientCore::Connected(
    Clock::time_point deadline, const WaitInterrupt* interrupt) {
  mu_.Lock();
  for (;;) {
    if (conn_ && !conn_->broken) {
      std::shared_ptr<Connection> c = conn_;
      mu_.Unlock();
      return c;
    }
    if (!connecting_) break;
    if (!cv_.WaitUntil(&mu_, deadline) && Clock::now() >= deadline) {
      mu_.Unlock();
      throw DaemonUnavailableError("timed out waiting to reconnect to " +
                                   path_);
    }
  }
  connecting_ = true;
  mu_.Unlock();

  const auto done = [this](std::shared_ptr<Connection> c) {
    base::MutexLock lock(&mu_);
    if (c) {
      c->serial = next_serial_++;
      conn_ = c;
    }
    connecting_ = false;
    cv_.NotifyAll();
  };
  auto backoff = options_.backoff_initial;
  for (;;) {
    try {
      std::shared_ptr<Connection> c = Dial(deadline);
      done(c);
      return c;
    } catch (const ServeError& e) {
      const bool retry = e.serve_code() == ServeCode::kUnavailable ||
                         e.serve_code() == ServeCode::kBusy;
      if (!retry || Clock::now() + backoff >= deadline) {
        done(nullptr);
        throw;
      }
    } catch (...) {
      done(nullptr);
      throw;
    }
    // Back off, in slices so that an interrupt is seen.
    const Clock::time_point until = Clock::now() + backoff;
    while (Clock::now() < until) {
      const auto slice = interrupt && interrupt->check
                             ? std::min<Clock::duration>(interrupt->every,
                                                         until - Clock::now())
                             : until - Clock::now();
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(slice);
      ::poll(nullptr, 0, static_cast<int>(std::max<int64_t>(ms.count(), 0)));
      if (interrupt && interrupt->check) {
        try {
          interrupt->check();
        } catch (...) {
          done(nullptr);
          throw;
        }
      }
    }
    backoff = std::min(backoff * 2, options_.backoff_max);
  }
}

void ClientCore::Broke(const std::shared_ptr<Connection>& c) {
  if (c->broken) return;
  c->broken = true;
  // Wakes a reader elsewhere and tells the daemon at once.
  ::shutdown(c->fd.get(), SHUT_RDWR);
  if (conn_ == c) conn_.reset();
  cv_.NotifyAll();
}

void ClientCore::ReadAndFile(const std::shared_ptr<Connection>& c,
                             int wait_ms) {
  std::vector<Datagram> got;
  bool broken = false;
  std::string why;
  if (wait_ms > 0) {
    pollfd p{c->fd.get(), POLLIN, 0};
    ::poll(&p, 1, wait_ms);
  }
  for (int i = 0; i < 64; ++i) {
    Datagram d;
    const int r =
        ReceiveDatagram(c->fd.get(), protocol::kMaxMessageBytes,
                        2 * protocol::kMaxFilesPerModel, MSG_DONTWAIT, &d);
    if (r > 0) {
      got.push_back(std::move(d));
      continue;
    }
    if (r == 0) {
      broken = true;
      why = "the daemon closed the connection";
    } else if (errno == ECONNRESET) {
      // Reported once, before what the daemon queued: read on.
      broken = true;
      why = "the daemon closed the connection";
      continue;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      broken = true;
      why = "the connection failed: " + ErrnoText(errno);
    }
    break;
  }
  std::vector<uint64_t> stray_leases;
  {
    base::MutexLock lock(&mu_);
    for (Datagram& d : got) {
      protocol::ParsedReply parsed = protocol::ParseReply(d.bytes);
      if (!parsed.reply) {
        broken = true;
        why = "the daemon sent a malformed reply: " + parsed.error;
        break;
      }
      protocol::Reply& reply = *parsed.reply;
      if (reply.id == 0) {  // the daemon's own: news, not the end
        c->note = reply.message;
        continue;
      }
      if (c->unanswered.erase(reply.id) != 0) continue;  // a release's
      const auto it = pending_.find(reply.id);
      if (it != pending_.end() && it->second.serial == c->serial &&
          !it->second.done) {
        it->second.done = true;
        it->second.reply = std::move(reply);
        it->second.fds = std::move(d.fds);
      } else if (reply.ok && reply.lease != 0) {
        stray_leases.push_back(reply.lease);  // its caller gave up
      }
    }
    if (broken) {
      last_break_ = c->note.empty() ? why : why + ": " + c->note;
      Broke(c);
    }
    for (const uint64_t lease : stray_leases) SendRelease(c, lease);
    cv_.NotifyAll();
  }
}

void ClientCore::SendRelease(const std::shared_ptr<Connection>& c,
                             uint64_t lease) {
  if (c->broken) return;  // the lease died with the connection
  const uint64_t id = next_id_++;
  c->unsent.emplace_back(id, protocol::EncodeRelease(id, lease));
  if (!FlushUnsent(*c)) {
    last_break_ = "the connection failed: " + ErrnoText(errno);
    Broke(c);
    return;
  }
  if (!c->unsent.empty()) StartFlusher();
}

bool ClientCore::FlushUnsent(Connection& c) {
  bool sent = false;
  while (!c.unsent.empty() && c.unanswered.size() < c.window) {
    if (SendDatagram(c.fd.get(), c.unsent.front().second, {}, MSG_DONTWAIT) !=
        0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      break;
    }
    c.unanswered.insert(c.unsent.front().first);
    c.unsent.pop_front();
    sent = true;
  }
  if (sent && c.unsent.empty()) cv_.NotifyAll();  // for SendOn
  return true;
}

void ClientCore::StartFlusher() {
  if (flushing_ || stop_) return;
  if (!wake_fd_) {
    wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_fd_) return;  // the next release or request sends the queue
  }
  if (flusher_.joinable()) flusher_.join();  // it has let go of mu_
  try {
    flusher_ = std::thread([this] { Flusher(); });
    flushing_ = true;
  } catch (const std::system_error&) {
    // No thread now: the next release or request sends the queue.
  }
}

void ClientCore::Flusher() {
  mu_.Lock();
  for (;;) {
    const std::shared_ptr<Connection> c = conn_;
    if (stop_ || !c || c->broken ||
        (c->unsent.empty() && c->unanswered.empty())) {
      break;
    }
    if (!FlushUnsent(*c)) {
      last_break_ = "the connection failed: " + ErrnoText(errno);
      Broke(c);
      continue;
    }
    const bool want_out =
        !c->unsent.empty() && c->unanswered.size() < c->window;
    const bool read = !reading_;
    if (!want_out && !read) {
      // Another thread reads: it files the answers and wakes us.
      cv_.WaitUntil(&mu_, Clock::now() + std::chrono::seconds(1));
      continue;
    }
    if (read) reading_ = true;
    const int wake = wake_fd_.get();
    mu_.Unlock();
    pollfd p[2] = {
        {c->fd.get(),
         static_cast<short>((want_out ? POLLOUT : 0) | (read ? POLLIN : 0)), 0},
        {wake, POLLIN, 0}};
    ::poll(p, 2, 1000);
    if (read) ReadAndFile(c, 0);
    mu_.Lock();
    if (read) {
      reading_ = false;
      cv_.NotifyAll();
    }
  }
  flushing_ = false;
  mu_.Unlock();
}

ClientCore::~ClientCore() {
  std::thread flusher;
  {
    base::MutexLock lock(&mu_);
    stop_ = true;
    cv_.NotifyAll();
    if (wake_fd_) {
      const uint64_t one = 1;
      [[maybe_unused]] const ssize_t n =
          ::write(wake_fd_.get(), &one, sizeof(one));
    }
    flusher.swap(flusher_);
  }
  if (flusher.joinable()) flusher.join();
}

ClientCore::Exchanged ClientCore::Exchange(
    const std::function<std::string(uint64_t)>& encode,
    Clock::time_point deadline, const WaitInterrupt* interrupt) {
  for (;;) {
    std::shared_ptr<Connection> c = Connected(deadline, interrupt);
    uint64_t id;
    {
      base::MutexLock lock(&mu_);
      id = next_id_++;
      pending_[id].serial = c->serial;
    }
    if (!SendOn(*c, encode(id), deadline)) {
      base::MutexLock lock(&mu_);
      pending_.erase(id);
      if (Clock::now() >= deadline) {
        throw ServeError(ServeCode::kTimeout, "the daemon at " + path_ +
                                                  " did not take the request "
                                                  "in time");
      }
      last_break_ = "the connection failed";
      Broke(c);
      continue;  // again on a new connection
    }
    mu_.Lock();
    for (;;) {
      Slot& slot = pending_[id];
      if (slot.done) {
        Exchanged out{std::move(slot.reply), std::move(slot.fds), c};
        pending_.erase(id);
        mu_.Unlock();
        return out;
      }
      if (c->broken) {
        pending_.erase(id);
        break;  // retried below
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        pending_.erase(id);
        mu_.Unlock();
        throw ServeError(ServeCode::kTimeout,
                         "no reply from the daemon at " + path_ + " in time");
      }
      Clock::time_point slice_end = deadline;
      if (interrupt && interrupt->check) {
        slice_end = std::min(slice_end, now + interrupt->every);
      }
      if (!reading_) {
        reading_ = true;
        mu_.Unlock();
        ReadAndFile(c, std::max(1, MillisUntil(slice_end)));
        mu_.Lock();
        reading_ = false;
        cv_.NotifyAll();
      } else {
        cv_.WaitUntil(&mu_, slice_end);
      }
      if (interrupt && interrupt->check) {
        mu_.Unlock();
        try {
          interrupt->check();
        } catch (...) {
          base::MutexLock lock(&mu_);
          pending_.erase(id);  // a lease it brings is released on arrival
          throw;
        }
        mu_.Lock();
      }
    }
    mu_.Unlock();
  }
}

RemoteWeights ClientCore::Acquire(std::string_view model,
                                  const RemoteAcquireOptions& options) {
  const Clock::time_point daemon_deadline = After(options.timeout);
  const Clock::time_point deadline =
      daemon_deadline == Clock::time_point::max()
          ? daemon_deadline
          : daemon_deadline + options_.reply_margin;
  const bool fail = options.when_full == WhenFull::kFail;
  const std::string name(model);
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
      deadline, options.interrupt.check ? &options.interrupt : nullptr);
  if (!ex.reply.ok) ThrowErrorOf(ex.reply);

  auto grant = std::make_shared<Grant>();
  grant->core = shared_from_this();
  grant->serial = ex.connection->serial;
  grant->lease = ex.reply.lease;
  grant->generation = generation_;
  grant->load = ex.reply.load;
  grant->model = ex.reply.model;
  // From here on a failure releases the lease (through ~Grant).
  const auto bad = [&](const std::string& why) {
    return ServeError(ServeCode::kInvalid,
                      "the daemon's copy of '" + grant->model + "': " + why);
  };
  if (ex.fds.size() != 2 * ex.reply.files.size()) {
    throw bad(std::to_string(ex.fds.size()) + " descriptors for " +
              std::to_string(ex.reply.files.size()) + " files");
  }
  grant->files.reserve(ex.reply.files.size());
  for (size_t i = 0; i < ex.reply.files.size(); ++i) {
    const protocol::FileReply& f = ex.reply.files[i];
    const int header_fd = ex.fds[2 * i].get();
    const int data_fd = ex.fds[2 * i + 1].get();
    const std::string source = grant->model + "/" + f.name;
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
            "cannot map the copy of " + source + ": " + ErrnoText(e));
      }
      grant->mappings.push_back({base, bytes});
      // A forked child must not share it: it holds no lease.
      ::madvise(base, bytes, MADV_DONTFORK);
      data = std::span<const std::byte>(static_cast<const std::byte*>(base),
                                        f.data_bytes);
    }
    grant->files.push_back(weights::WeightSet::FromMemory(
        source,
        weights::FileIdentity{static_cast<uint64_t>(data_st.st_dev),
                              static_cast<uint64_t>(data_st.st_ino),
                              static_cast<uint64_t>(data_st.st_size), 0},
        std::move(header), data, nullptr));
    grant->data_bytes += f.data_bytes;
  }
  ex.fds.clear();  // mapped: the descriptors are not needed
  size_t count = 0;
  for (const weights::WeightSet& file : grant->files) {
    count += file.tensors().size();
  }
  grant->tensors.reserve(count);
  for (size_t i = 0; i < grant->files.size(); ++i) {
    grant->first_tensor.push_back(grant->tensors.size());
    for (const weights::TensorInfo& t : grant->files[i].tensors()) {
      grant->tensors.push_back({&t, grant->files[i].data(t), i});
    }
  }
  return RemoteWeights(std::move(grant));
}

void ClientCore::Ping(std::chrono::milliseconds timeout) {
  Exchanged ex = Exchange([](uint64_t id) { return protocol::EncodePing(id); },
                          After(timeout), nullptr);
  if (!ex.reply.ok) ThrowErrorOf(ex.reply);
}

void ClientCore::Close() {
  base::MutexLock lock(&mu_);
  if (conn_) {
    last_break_ = "closed by the client";
    Broke(conn_);
  }
}

void ClientCore::Release(uint64_t serial, uint64_t lease) noexcept {
  std::shared_ptr<Connection> c;
  bool read;
  {
    base::MutexLock lock(&mu_);
    if (!conn_ || conn_->broken || conn_->serial != serial) return;
    c = conn_;
    SendRelease(c, lease);  // sent, or queued for the flusher
    read = !reading_ && !c->broken;
    if (read) reading_ = true;
  }
  if (read) {
    // Drain what is waiting, without blocking, so that replies to releases
    // never pile up in a client that only releases.
    ReadAndFile(c, 0);
    base::MutexLock lock(&mu_);
    reading_ = false;
    cv_.NotifyAll();
  }
}

}  // namespace detail

// ------------------------------------------------------- RemoteWeights ----

RemoteWeights& RemoteWeights::operator=(RemoteWeights&& other) noexcept {
  if (this != &other) {
    Release();
    grant_ = std::move(other.grant_);
  }
  return *this;
}

const std::string& RemoteWeights::model() const { return grant_->model; }
uint64_t RemoteWeights::lease() const { return grant_->lease; }
const std::string& RemoteWeights::load() const { return grant_->load; }
const std::vector<weights::WeightSet>& RemoteWeights::files() const {
  return grant_->files;
}
const std::vector<RemoteTensor>& RemoteWeights::tensors() const {
  return grant_->tensors;
}
uint64_t RemoteWeights::data_bytes() const { return grant_->data_bytes; }

const RemoteTensor* RemoteWeights::Find(std::string_view name) const {
  // Each file's header has an index of its own.
  for (size_t i = 0; i < grant_->files.size(); ++i) {
    const weights::WeightSet& file = grant_->files[i];
    if (const weights::TensorInfo* t = file.header().Find(name)) {
      return &grant_->tensors[grant_->first_tensor[i] +
                              static_cast<size_t>(t - file.tensors().data())];
    }
  }
  return nullptr;
}

std::span<const std::byte> RemoteWeights::data(std::string_view name) const {
  const RemoteTensor* t = Find(name);
  if (t == nullptr) {
    throw Error(ErrorCode::kNotFound, "model '" + grant_->model +
                                          "' has no tensor named '" +
                                          weights::Printable(name) + "'");
  }
  return t->data;
}

void RemoteWeights::Release() { grant_.reset(); }

std::vector<weights::HostWeights> RemoteWeights::ShareAsHostWeights() const {
  std::vector<weights::HostWeights> out;
  out.reserve(grant_->files.size());
  for (const weights::WeightSet& file : grant_->files) {
    out.emplace_back(std::shared_ptr<const weights::WeightSet>(grant_, &file));
  }
  return out;
}

// -------------------------------------------------------------- Client ----

Client::Client(std::shared_ptr<detail::ClientCore> core)
    : core_(std::move(core)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;

Client::~Client() = default;

Client Client::Connect(const std::string& socket_path, ClientOptions options) {
  auto core = std::make_shared<detail::ClientCore>(socket_path, options);
  core->Connected(detail::After(options.connect_timeout), nullptr);
  return Client(std::move(core));
}

detail::ClientCore& Client::Core() {
  if (core_->generation() != detail::g_fork_generation.load()) {
    // A forked child: the parent's core may hold a lock no thread here will
    // release. Leave it (leaked on purpose) and start afresh.
    const std::string path = core_->path();
    const ClientOptions options = core_->options();
    new std::shared_ptr<detail::ClientCore>(std::move(core_));
    core_ = std::make_shared<detail::ClientCore>(path, options);
  }
  return *core_;
}

RemoteWeights Client::Acquire(std::string_view model,
                              const RemoteAcquireOptions& options) {
  return Core().Acquire(model, options);
}

RemoteWeights Client::Acquire(std::string_view model,
                              std::chrono::milliseconds timeout) {
  RemoteAcquireOptions options;
  options.timeout = timeout;
  return Acquire(model, options);
}

void Client::Ping(std::chrono::milliseconds timeout) { Core().Ping(timeout); }

ServerInfo Client::Info() {
  return Core()
      .Connected(detail::After(std::chrono::seconds(5)), nullptr)
      ->info;
}

void Client::Close() { Core().Close(); }

const std::string& Client::socket_path() const { return core_->path(); }

// ---------------------------------------------------- RemoteHostWeights ----

RemoteHostWeights::RemoteHostWeights(Client client,
                                     RemoteAcquireOptions defaults)
    : client_(std::move(client)), defaults_(std::move(defaults)) {}

std::vector<weights::HostWeights> RemoteHostWeights::AcquireModel(
    const std::string& model, const std::vector<std::string>&,
    const AcquireOptions& options) {
  RemoteAcquireOptions remote = defaults_;
  if (options.deadline != Clock::time_point::max()) {
    remote.timeout =
        std::max(std::chrono::milliseconds(0),
                 std::chrono::duration_cast<std::chrono::milliseconds>(
                     options.deadline - Clock::now()));
  }
  remote.when_full = options.when_full;
  if (options.interrupt.check) remote.interrupt = options.interrupt;
  return client_.Acquire(model, remote).ShareAsHostWeights();
}

}  // namespace modelcache::serve
