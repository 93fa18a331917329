// The client's internals, shared by its files:
//   client_connect.cc  dialling with backoff, one thread at a time, and hello
//   client_mux.cc      the multiplexer: request and reply matching, the
//                      reader, releases and their queue, closing
//   client_reclaim.cc  a broken connection's leases kept, reclaimed on the
//                      next one before it is published (ReclaimAndPublish)
//   client_leases.cc   the table of held leases: local acquires, their ends,
//                      notices and the answers to recalls
//   client_keeper.cc   the keeper (flusher) thread and its idle chores
//   client_mapping.cc  mapping a granted copy (memfds to WeightSets)
//   client_fork.cc     fork safety: the generation and the socket table
//   client.cc          the public facades (Client, RemoteWeights, ...)
//
// Design note.
//
// ClientCore holds at most one connection at a time (a Connection: the
// socket, a serial number, whether it broke, what hello said). A call takes
// a request id, sends its datagram (under mu_, never blocking there; see
// the releases below) and waits for the reply with its id. One
// waiting thread at a time reads the socket (the *reader*, chosen under mu_),
// with no lock held while it polls; it files each reply under its id and
// wakes the others, who wait on cv_. A reply nobody waits for any more (its
// caller timed out or was interrupted) that grants a lease is released at
// once, so an abandoned acquire never holds a copy.
//
// A connection breaks on EOF or a socket error. A message of the daemon's
// own (id 0) does not break it (protocol.h): its text becomes the reason
// given if the connection then ends. Callers waiting on it then retry on a new
// connection (acquires and pings; a lease granted to an acquire whose reply
// was lost is not ours to reclaim, so retrying is safe) or fail with
// DaemonUnavailableError. Connecting is done by one thread at a time
// (connecting_), with exponential backoff, until the caller's deadline; the
// reclaims (below) go out on a new connection before anything else.
//
// Releases do not wait for their reply: RemoteWeights sends the release
// and drains, without blocking, whatever replies are waiting, so a client
// that only releases never lets the daemon's reply queue grow. They do wait
// for the release (or the idle notice of idle_notice_delay 0) to be on the
// socket (AwaitSent, on the releasing thread, never the reader's or the
// flusher's): another process's acquire made after the call returned is
// then read after it. A release
// the socket has no room for (the daemon is slow to read) is never dropped:
// it joins the connection's queue of unsent releases, which the *flusher*
// thread (started when the queue first fills, gone when it is empty and
// every release it sent is answered) sends, in order, as the socket becomes
// writable, reading the replies meanwhile when no other thread reads. Every
// other request of that connection is sent after the queued releases, so a
// reply to it means the daemon has had them all. All sends on a connection
// happen under mu_ (without blocking), which keeps that order.
//
// Drains: a connection with local reuse says "drain" after hello when the
// daemon lists it (Dial); a recall saying "drain" is answered as a retired
// one (AnswerRecalls), so that a draining copy is lent no more.
//
// Local reuse and delegation: a connection on which this process keeps
// leases past their last reference (local_reuse, keep_idle > 0) says
// "delegate" right after hello when the daemon lists "recall_in_use" (Dial),
// so that the daemon may recall a lease it still counts in use; the answer
// is the same as to any recall. held_ maps each lease this process holds to
// its MappedCopy (mapped once), its count of local references (Grants) and
// whether the daemon was told it is idle; by_name_ finds it by the names it
// was acquired as. An acquire of a held name is a new Grant (no round trip and
// no message: when the daemon was told "idle", the keeper says "use" once the
// lease has been used for idle_notice_delay, looking at least every
// kUseNoticeLag; a lease revived and released between its looks sends
// nothing). The last Grant's
// end (Unref) keeps the lease idle when the connection delegates
// (Connection::delegation) and keep_idle > 0, else forgets, unmaps and
// releases it. Without local reuse a lease is in held_ only when it can be
// reclaimed (below), under no name, and is forgotten at its Grant's end.
// The flusher thread is also the *keeper*: while any lease is idle it sends
// the idle and use notices due (idle_notice_delay), ends leases idle past
// keep_idle, and reads the socket when no other thread does, so that a
// recall is answered even by a process making no calls; on a connection that
// said "delegate" it reads so while any lease is held at all (a lease in use
// may be recalled: it answers "use" at once, at the cost of a hop through
// this thread for a reply it reads before its caller does). On a connection
// whose leases a successor could adopt it lives as long as the connection
// (so that no acquire starts a thread): with nothing to read it polls the
// socket for its end only (POLLHUP), so that the daemon's end is noticed
// (and the leases reclaimed) without a call, while a caller still reads its
// own reply with no hop through this thread; a message queued meanwhile
// wakes it (StartFlusherToSend). A recall is answered by whichever thread
// reads it (AnswerRecalls), under mu_: a lease with no reference is
// forgotten, unmapped, then released; one with references answers "use"
// (so a revival the daemon has not heard of yet never lets it free a copy
// this process maps).
//
// Reclaim (protocol.h). Each MappedCopy keeps its memfds open (header then
// data, per file) so that a successor daemon can adopt the copy. When a
// connection whose hello listed "reclaim" breaks (Broke; not Close, after
// which the daemon ends the leases itself), its leases stay in held_,
// marked `reclaim` (reclaiming_ counts them), their copies still naming
// the dead connection's serial: a local acquire still takes a reference to
// one (its mapping is valid; the reclaim decides what backs it), and
// nothing is sent for them. The next connection is made by Connected, which,
// after hello and before it publishes the connection as conn_ (so before any
// other request goes out on it), sends a reclaim for each marked lease ("idle"
// for those with no reference) and reads the answers (ReclaimAndPublish): an
// adopted lease takes the new serial (its told_idle is what its reclaim said;
// one revived since it was asked "idle" is told "use" at publication) and is
// held as before; a refused one, or every one when the new daemon does not list
// "reclaim", is *unbacked*: forgotten (an idle one unmapped at once), while its
// references keep the mapping and their end sends nothing (the copy's serial is
// of a dead connection). Leases marked during a pass (an acquire granted on the
// dead connection and filed after the break) are reclaimed by another pass
// before the publication, which is atomic with the last look under mu_, so none
// is left behind. A lease forgotten while its reclaim was in flight is released
// on the new connection if adopted. Releases queued on the dead connection die
// with it (the lease was forgotten first: it is simply not reclaimed). While
// leases wait to be reclaimed and nothing else connects, the keeper reconnects
// in the background, backing off up to kReclaimBackoffMax, so that the reclaims
// reach a successor within its grace period even in a process making no
// calls; it stops when no lease waits or the core closes. A connection
// whose daemon did not list "reclaim" forgets its leases when it breaks, as
// before (no successor can adopt what such a daemon handed out), and so
// does every connection when ClientOptions::reclaim is false (the memfds
// are then closed once mapped).
//
// fork(): a child must not touch its parent's ClientCore, whose mutex may
// be held by a thread that does not exist in the child. An atfork handler
// bumps a global generation and closes every socket of every core (they are
// kept in a lock-free table for it). A Client whose core is of an older
// generation leaves it alone, leaked on purpose, and makes a new one. The
// memfds copies keep open are in a second table (kMemfdSlots), closed in the
// child too, so that a forked child does not pin its parent's copies. Grants,
// copies and connections of an older generation do nothing when destroyed:
// the child has no mapping at their addresses (MADV_DONTFORK) and must not
// close descriptor numbers it may have reused.
//
// A held lease's states (an entry of held_; refs: its local references,
// told: told_idle, i.e. the daemon counts it idle and may recall it):
//   in use        refs > 0, !told, !reclaim
//   idle          refs == 0, !told: kept mapped, the daemon still counts it
//                 in use until the idle notice goes
//   told idle     refs == 0, told
//   revived       refs > 0, told: the daemon still counts it idle; a recall
//                 is answered "use"
//   to reclaim    reclaim (any refs): its connection broke and a successor
//                 may adopt it; its copy names the dead connection's serial
//   gone          not in held_: forgotten (unmapped once its references end)
// Transitions:
//   acquire granted (Keep)        -> in use; -> to reclaim when granted on a
//                                    connection that broke and kept its
//                                    leases, before the next is published
//   local acquire (LocalAcquire)  idle -> in use; told idle -> revived
//   last reference ends (Unref)   in use -> idle (kept: keep_idle > 0, a
//                                    reachable name, a delegating live
//                                    connection), or -> told idle at once
//                                    when idle_notice_delay is 0; revived ->
//                                    told idle (nothing sent); to reclaim
//                                    stays while keep_idle > 0; otherwise
//                                    -> gone, released
//   keeper (IdleChores)           idle -> told idle after idle_notice_delay
//                                    ("idle"); revived -> in use after
//                                    idle_notice_delay ("use"); idle or told
//                                    idle past keep_idle -> gone, released
//   recall (AnswerRecalls)        refs == 0 -> gone, released; refs > 0 ->
//                                    in use ("use"); a retired one in use
//                                    loses its names (no local acquire
//                                    finds it) and goes at its last
//                                    reference's end, released
//   connection breaks (Broke)     -> to reclaim when it kept its leases,
//                                    else -> gone (nothing released)
//   reclaim (ReclaimAndPublish)   adopted -> in use, idle or told idle (as
//                                    the reclaim said; revived meanwhile:
//                                    "use" at publication), or -> gone,
//                                    released, when idle and the daemon does
//                                    not delegate; refused, or the daemon
//                                    does not reclaim -> gone (unbacked)
//   keeper while away             to reclaim with refs == 0 past keep_idle
//     (ReconnectForReclaims)         -> gone (nothing to release it to)
//   name taken by a newer lease   an unreachable idle lease -> gone,
//     (Keep)                         released; one in use goes at its end

#ifndef MODELCACHE_SRC_SERVE_CLIENT_CLIENT_INTERNAL_H_
#define MODELCACHE_SRC_SERVE_CLIENT_CLIENT_INTERNAL_H_

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
#include "modelcache/base/text.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/serve/client.h"
#include "modelcache/weights/memfd.h"
#include "protocol.h"
#include "socket.h"

namespace modelcache::serve::detail {

using Clock = std::chrono::steady_clock;

// Bumped in a forked child (client_fork.cc): what is of an older
// generation belongs to the parent.
extern std::atomic<uint64_t> g_fork_generation;
// Installs the atfork handler, once.
void InstallForkHandler();
// Files `fd` in the table the child handler closes; its slot, or -1 when
// the table is full (then the socket stays open in children).
int RegisterSocket(int fd);
// The same for a memfd a copy keeps (a table of kMemfdSlots); Unregister
// frees the slot (when it still holds `fd`) before the descriptor closes.
inline constexpr size_t kMemfdSlots = 4096;
int RegisterMemfd(int fd);
void UnregisterMemfd(int slot, int fd);

// The longest wait between the keeper's attempts to reconnect while leases
// wait to be reclaimed: a successor's grace period is a few seconds.
inline constexpr std::chrono::milliseconds kReclaimBackoffMax{200};

// The longest the keeper sleeps while a lease is told idle: a revival sends
// nothing, so the daemon hears "use" within about this much (plus
// idle_notice_delay) of it; meanwhile its recall is answered "use".
inline constexpr std::chrono::milliseconds kUseNoticeLag{100};

// Milliseconds to `deadline` for poll, at most 1000 (so that a waiter looks
// at the clock again), 0 when it has passed.
inline int MillisUntil(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return 1000;
  const auto left =
      std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000));
}

inline Clock::time_point After(std::chrono::milliseconds d) {
  if (d.count() < 0) d = std::chrono::milliseconds(0);
  const auto now = Clock::now();
  if (d >= std::chrono::duration_cast<std::chrono::milliseconds>(
               Clock::time_point::max() - now)) {
    return Clock::time_point::max();
  }
  return now + d;
}

[[noreturn]] inline void ThrowErrorOf(const protocol::Reply& reply) {
  // With a cause, UNAVAILABLE is about the model's files, not the daemon:
  // it answered.
  if (reply.code == ServeCode::kUnavailable && reply.cause.empty()) {
    throw DaemonUnavailableError(reply.message);
  }
  ErrorCode core = CoreCodeOf(reply.code);
  if (reply.code == ServeCode::kLoadFailed && reply.cause == "invalid_data") {
    core = ErrorCode::kInvalidData;
  }
  if (reply.code == ServeCode::kUnavailable) {
    core = reply.cause == "invalid_data" ? ErrorCode::kInvalidData
                                         : ErrorCode::kIo;
  }
  throw ServeError(reply.code, core, reply.message);
}

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
  // The daemon recalls idle leases (hello's limits had recall_timeout_ms).
  bool delegation = false;
  // This connection said "delegate": the daemon may recall its leases in
  // use too, so the keeper reads while any is held.
  bool delegates = false;
  // This connection said "drain": the daemon recalls its leases of a copy
  // that starts draining, in use too, so the keeper reads while any is held.
  bool heeds_drains = false;
  // The daemon adopts leases of its predecessor (hello's limits had
  // "reclaim"), so a successor of it may adopt this connection's.
  bool reclaim = false;
  // Set by Broke when the leases stayed in the table to be reclaimed
  // (core's mu_).
  bool kept = false;

  // Frees its socket's slot in the fork table (client_fork.cc).
  ~Connection();
};

// A lease's copy as this process maps it: one per lease, shared by every
// local reference (Grant) and, while the lease is kept, the core's table.
struct MappedCopy {
  // Of the connection that holds the lease: set before the copy is filed,
  // then changed (and read) under the core's mu_ only, by a reclaim.
  uint64_t serial = 0;
  uint64_t lease = 0;
  uint64_t generation = 0;
  std::string model;
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
  };
  std::vector<Mapping> mappings;
  std::vector<weights::WeightSet> files;
  std::vector<RemoteTensor> tensors;
  std::vector<size_t> first_tensor;  // of each file, in `tensors`
  uint64_t data_bytes = 0;
  // The memfds, kept for a reclaim (ClientOptions::reclaim): per file, in
  // file order, the header's then the data's; and their slots in the fork
  // table (-1: not filed).
  std::vector<base::UniqueFd> fds;
  std::vector<int> fd_slots;

  // Unmaps and closes the memfds (not in a forked child: it has no mapping
  // there, and the descriptor numbers may be others' now).
  ~MappedCopy();
};

// One local reference: what a RemoteWeights holds. Its end is the core's
// Unref, which keeps the lease idle or releases it.
struct Grant {
  std::shared_ptr<ClientCore> core;
  std::shared_ptr<MappedCopy> copy;
  std::string load;  // "local", or the reply's "load"
  uint64_t generation = 0;

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
  std::optional<RemoteWeights> AcquireLocal(std::string_view model)
      MC_EXCLUDES(mu_);
  void Ping(std::chrono::milliseconds timeout);
  void Close() MC_EXCLUDES(mu_);
  // Ends a lease of connection `serial`: nothing if that connection is gone.
  void Release(uint64_t serial, uint64_t lease) noexcept MC_EXCLUDES(mu_);
  // A local reference to `copy` ended (~Grant).
  void Unref(std::shared_ptr<MappedCopy> copy) noexcept MC_EXCLUDES(mu_);
  // Leases kept idle now: mapped, with no local reference (Client::
  // IdleLeases).
  size_t IdleLeases() const MC_EXCLUDES(mu_);
  ReclaimStats Reclaims() const MC_EXCLUDES(mu_);

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
  // Its request id; 0 when nothing went (the connection is gone).
  uint64_t SendRelease(const std::shared_ptr<Connection>& c, uint64_t lease)
      MC_REQUIRES(mu_);
  // Queues `datagram` (request `id`, not awaited) after c's unsent
  // messages and writes what the socket takes now; the flusher writes the
  // rest. Returns `id`, or 0 when the write broke the connection.
  uint64_t QueueAndFlush(const std::shared_ptr<Connection>& c, uint64_t id,
                         std::string datagram) MC_REQUIRES(mu_);
  // Returns once the message `id` queued on `c` is written to the socket,
  // or `c` broke (0: at once). Lets go of mu_ while it waits.
  void AwaitSent(const std::shared_ptr<Connection>& c, uint64_t id)
      MC_REQUIRES(mu_);
  // Sends what `c` has queued until the socket is full; false on a socket
  // error.
  bool FlushUnsent(Connection& c) MC_REQUIRES(mu_);
  void StartFlusher() MC_REQUIRES(mu_);
  // The same for messages waiting in a connection's queue: wakes a keeper
  // that only watches for the connection's end.
  void StartFlusherToSend() MC_REQUIRES(mu_);
  // Interrupts the keeper's poll (a new idle lease has chores due sooner).
  void WakeKeeper() MC_REQUIRES(mu_);
  void Flusher() MC_EXCLUDES(mu_);
  // Reads what the socket holds (waiting up to `wait_ms`) and files it.
  // Called by the reader, without mu_.
  void ReadAndFile(const std::shared_ptr<Connection>& c, int wait_ms)
      MC_EXCLUDES(mu_);
  // By value: the caller's may be conn_, which it resets. `keep_leases`:
  // the daemon may hand them to a successor (false for Close).
  void Broke(std::shared_ptr<Connection> c, bool keep_leases = true)
      MC_REQUIRES(mu_);
  // Reclaims, on `c` (hello done, not published yet), every lease waiting
  // for it, then publishes `c` as conn_ (design note). Recalls read meanwhile
  // go to `recalls`. Throws DaemonUnavailableError when `c` fails.
  void ReclaimAndPublish(const std::shared_ptr<Connection>& c,
                         Clock::time_point deadline,
                         std::vector<protocol::Recall>* recalls)
      MC_EXCLUDES(mu_);
  // The keeper's reconnection while leases wait to be reclaimed. Called and
  // returns with mu_ held; false when it should stop.
  bool ReconnectForReclaims(Clock::time_point* retry_at,
                            std::chrono::milliseconds* backoff)
      MC_REQUIRES(mu_);
  // Sends `op` ("idle", "use") of `lease` on `c` without awaiting the reply,
  // after the queued releases (as SendRelease).
  // Its request id; 0 when nothing went (the connection is gone).
  uint64_t SendNotice(const std::shared_ptr<Connection>& c, protocol::Op op,
                      uint64_t lease) MC_REQUIRES(mu_);
  // A local acquire: a new reference to a lease held as `name`, or null.
  std::shared_ptr<Grant> LocalAcquire(const std::string& name) MC_EXCLUDES(mu_);
  // Files a new lease's copy, granted on `from`, in the table, under
  // `names`.
  void Keep(const std::shared_ptr<MappedCopy>& copy,
            const std::vector<std::string>& names, const Connection& from)
      MC_EXCLUDES(mu_);
  // Takes `lease` out of the table; its copy, for the caller to drop
  // (unmapping) outside mu_.
  std::shared_ptr<MappedCopy> Forget(uint64_t lease) MC_REQUIRES(mu_);
  // Takes `lease`'s names out of by_name_ (those still mapping to it), so
  // that no local acquire finds it; it stays in the table.
  void Unname(uint64_t lease) MC_REQUIRES(mu_);
  // Gives up every lease waiting to be reclaimed (unbacked), counting them
  // in `*count`; their copies, for the caller to drop outside mu_.
  std::vector<std::shared_ptr<MappedCopy>> GiveUpReclaims(uint64_t* count)
      MC_REQUIRES(mu_);
  // Whether a local acquire can find `lease`: some name of it still maps
  // to it (a later lease of the name may have taken it over).
  bool Reachable(uint64_t lease) const MC_REQUIRES(mu_);
  // The keeper's chores: idle notices due, idle leases past keep_idle
  // (forgotten into `expired`). Returns when the next one is due.
  Clock::time_point IdleChores(
      const std::shared_ptr<Connection>& c,
      std::vector<std::shared_ptr<MappedCopy>>* expired) MC_REQUIRES(mu_);
  // Answers the recalls read: releases (after unmapping) or "use"; a
  // retired lease in use loses its names, so no new local reference finds
  // it and its last reference's end releases it.
  void AnswerRecalls(const std::shared_ptr<Connection>& c,
                     const std::vector<protocol::Recall>& recalls)
      MC_EXCLUDES(mu_);

  const std::string path_;
  const ClientOptions options_;
  const uint64_t generation_;

  mutable base::Mutex mu_;
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

  // The leases this process holds, by lease id: their copy, the local
  // references alive, and whether the daemon was told they are idle; and
  // the names they were acquired as (a name may also be the model's id).
  // `reclaim`: its connection broke and it waits for the next one's
  // reclaim (its copy's serial is the dead connection's).
  struct Held {
    std::shared_ptr<MappedCopy> copy;
    int refs = 0;
    bool told_idle = false;
    bool reclaim = false;
    Clock::time_point idle_since;
    // When its first reference came back while the daemon counted it idle
    // (told_idle and refs > 0): the keeper says "use" idle_notice_delay
    // after it, if it is still used then.
    Clock::time_point used_since;
    std::vector<std::string> names;
  };
  std::unordered_map<uint64_t, Held> held_ MC_GUARDED_BY(mu_);
  std::unordered_map<std::string, uint64_t> by_name_ MC_GUARDED_BY(mu_);
  size_t idle_ MC_GUARDED_BY(mu_) = 0;        // entries of held_ with refs == 0
  size_t reclaiming_ MC_GUARDED_BY(mu_) = 0;  // entries with `reclaim`
  ReclaimStats reclaim_stats_ MC_GUARDED_BY(mu_);
  // When the keeper wakes next, as it last went to sleep.
  Clock::time_point keeper_wakes_ MC_GUARDED_BY(mu_) = Clock::time_point::max();
  // The keeper polls the socket for its end only (nothing to read): a
  // release that has to wait for room wakes it, and so does a lease's end
  // that leaves it idle (it may be recalled).
  bool keeper_watching_ MC_GUARDED_BY(mu_) = false;

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

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_CLIENT_CLIENT_INTERNAL_H_
