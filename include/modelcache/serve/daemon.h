// The node daemon behind `modelcache serve`: one host budget and one host
// copy of each model for every worker process of a node.
//
// Workers connect over a SOCK_SEQPACKET UNIX socket and lease models by id
// (serve::Client). A lease's reply carries sealed memfds (weights/memfd.h)
// that the worker maps read-only, so N workers hold one copy. The store is a
// ModelCache keyed by catalog id, so single flight, the budget, the policy,
// pins and retirement are the core's; the daemon keeps a table of leases
// (lease -> connection, model, core lease) around it.
//
// Leases belong to connections. When a connection ends, the leases it never
// received are released, and so are all of them if its process is gone. A
// process can close its socket and keep mapping a copy, so if the process
// still lives its leases become *orphaned*: still counted and never evicted,
// they end when the process's pidfd (opened from the peer's credentials at
// accept) says it exited, or once the process neither maps their copy nor
// holds a descriptor of it (its /proc/PID entries, read every orphan_rescan
// off the event loop). A
// connection also ends when its process exits while the socket stays open
// (inherited by a child, say). So no copy a live process was given is freed
// under it, and no dead process holds memory.
//
// Mappings outlive the daemon. At start it looks in /proc/*/maps for memfds
// of its own instance name that processes still map (copies its predecessor
// handed out), books them as orphaned bytes outside the store (the store's
// capacity is the configured one minus those bytes, so used + orphaned never
// exceeds it), and from then on watches the processes that map them (their
// pidfds, and their own /proc/PID/maps every orphan_rescan) until they are
// gone; the whole machine is scanned only at start.
//
// Threads: Run() is the event loop (epoll over the listening socket, the
// connections, their pidfds, a signalfd and an eventfd). A hit is served on
// the loop (ModelCache::TryAcquire never waits). A miss queues the request
// on its model; one pool task per model runs the blocking acquire, at most
// Limits::load_slots at a time, and the loop hands every request waiting on
// that model a lease when it completes. A client is never waited for: its
// replies are sent without blocking, queued when its socket is full, and the
// connection is closed when the queue passes its limit. Nothing that scans,
// frees, parses or waits on a lock held across evictions runs on the loop:
// copies are freed, orphans' /proc entries and SIGHUP's catalog read, and
// capacity changes applied on a background thread, whose results come back
// through the eventfd. HandleHttp is thread-safe: the HTTP API reads the
// store and the lease table under their locks and asks the loop for loads.
#ifndef MODELCACHE_SERVE_DAEMON_H_
#define MODELCACHE_SERVE_DAEMON_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/core/budget.h"

namespace modelcache::serve {

// Each limit's reply past it is BUSY, except the reply queue's: a client
// that does not read its replies is disconnected.
struct Limits {
  int max_clients = 1024;            // connections at once
  int max_requests_per_client = 64;  // acquires waiting per connection
  int max_leases_per_client = 4096;  // leases held per connection
  int max_queued_replies = 256;      // replies the client has not read
  int load_slots = 2;                // loads running at once
  int max_waiters = 4096;            // acquires waiting, all clients together
};

struct DaemonOptions {
  std::string catalog_path;
  std::string model_root;
  // A model whose files cannot be opened beneath the root or are not valid
  // safetensors files (what --check-catalog refuses) is *unavailable*: the
  // daemon starts, restarts, takes over and reloads without it, says why
  // once in its log, in /v1/models, /readyz and /metrics, and answers its
  // acquires UNAVAILABLE at once, naming the file, unless a copy of it is
  // resident (taken over or reclaimed: a hit is a hit). Its files are
  // checked again by every reload and by the load of an acquire that comes
  // unavailable_retry after it was found so, a wait that doubles (to 60 s
  // at most) each time that load finds them failing still; a load that
  // succeeds makes it available. The catalog itself (unparseable) and the
  // model root (missing) stay fatal. strict_catalog: any such file is fatal
  // at start (the constructor throws its error) and refuses a reload, as
  // --check-catalog does.
  bool strict_catalog = false;
  // 0: every acquire of an unavailable model tries its files again.
  std::chrono::milliseconds unavailable_retry{1000};
  // The socket's folder is created with mode 0750 when missing and must not
  // be open to others when present; the socket gets mode 0660. No abstract
  // sockets.
  std::string socket_path;
  uint64_t host_capacity_bytes = 0;
  // A name of the policy registry (PolicyByName, PolicyNames): an eviction
  // order, with an idle TTL or a keep-alive plan for some; an offline one
  // (Belady's) is refused.
  std::string policy = "next-use";
  // Swap scheduling (modelcache/core/budget.h, "Who waits"): an acquire
  // whose load waits for room may be overtaken by acquires of the models
  // that hold the room for at most this long; then those models drain (they
  // take no new lease, and the loads queued behind them wait for the drain
  // to end), and the waiter gets the room once their leases out end. Zero:
  // strict arrival order; kDrainNever: models in use never drain (a waiter
  // waits for them to fall idle). The same bound holds for the load queue:
  // a load queued for a slot longer than this goes before loads of a higher
  // catalog priority, oldest first. A copy held by an orphaned lease is
  // never drained (it counts as pinned for the drain, as of the load's
  // start). Local reuse of a delegated lease (client.h) is invisible to the
  // store: a copy a client keeps in use locally drains only once that use
  // ends (docs/serve.md).
  std::chrono::nanoseconds drain_after = kDefaultDrainAfter;
  Limits limits;
  int load_threads = 4;  // pread threads per file
  // Names this daemon's memfds ("modelcache:<instance>:<model>#<file>"), so
  // that a restarted daemon finds its predecessor's copies and no other
  // daemon's. Default: a hash of the socket's absolute path.
  std::string instance;
  // When either list is not empty, only peers whose uid or gid is listed
  // (or whose uid is the daemon's) may connect.
  std::vector<uid_t> allow_uids;
  std::vector<gid_t> allow_gids;
  // /readyz stays 503 this long after start, so that clients reconnecting
  // after a restart settle before a balancer sends traffic.
  std::chrono::milliseconds ready_grace{2000};
  // How often the processes that map a predecessor's orphaned copies, and
  // those holding orphaned leases, have their /proc/PID entries read again
  // while any remain (an exit is seen at once, through its pidfd).
  std::chrono::milliseconds orphan_rescan{1000};
  // Delegated leases: a client tells the daemon when a lease it keeps
  // mapped is idle (protocol.h); the store then counts the copy as
  // evictable. When the store picks it as a victim, the daemon recalls it
  // from its holders instead of unloading it, and moves on to the next
  // victim; the copy goes once every holder answered "release". A holder
  // that does not answer within recall_timeout is taken to use the lease
  // again (the daemon waits on nobody). A copy a live process maps is never
  // freed: its unloader refuses while any such lease is outstanding.
  std::chrono::milliseconds recall_timeout{100};
  // Reclaim after a crash: the daemon writes down each copy it makes (the
  // record, socket_path + ".state", mode 0640), and a successor adopts a
  // copy its predecessor made when a client that still maps it brings its
  // memfds back (protocol.h, "reclaim"): the copy is resident again, with
  // no byte loaded. For this long after start, an acquire of a model whose
  // copy the record names and a live process still maps waits for that
  // reclaim before it loads the model again; /readyz says so. 0: no wait.
  std::chrono::milliseconds reclaim_grace{5000};
  // Takeover: instead of binding the socket, ask the daemon serving on it
  // to hand over its listening sockets, its copies and its leases
  // (docs/serve.md). The constructor throws modelcache::Error (kUnavailable)
  // naming why when that daemon refuses, is not there, or does not finish
  // within takeover_timeout; the old daemon then serves on, unchanged.
  bool takeover = false;
  std::chrono::milliseconds takeover_timeout{30000};
  // systemd's file descriptor store (examples/systemd/): when systemd runs
  // the daemon ($NOTIFY_SOCKET set, a unit with FileDescriptorStoreMax=),
  // each copy's memfds are also stored there (FDSTORE=1, under the name
  // "copy-<dev>-<inode>" of its first header memfd) and removed when the
  // copy is freed; at start the descriptors systemd passes back
  // ($LISTEN_FDS, $LISTEN_FDNAMES) are adopted when they are copies the
  // predecessor's record names, checked as a reclaim is, and the rest
  // removed from the store. So after a crash or a restart even the copies
  // no worker maps are resident again, with no byte loaded. The
  // constructor reads (and unsets) the LISTEN_ variables: REQUIRES no other
  // thread reads or changes the environment then. Without systemd (no
  // $NOTIFY_SOCKET, no $LISTEN_PID of this process) it does nothing.
  bool systemd = false;
  // Per-model series in /metrics (a label per model: the operator's choice
  // of cardinality).
  bool per_model_metrics = false;
  // SIGTERM and SIGINT shut down, SIGHUP reloads the catalog, through a
  // signalfd. REQUIRES: the signals are blocked in every thread
  // (BlockSignals() before any thread starts).
  bool handle_signals = false;
  // Where log lines go; standard error when empty.
  std::function<void(const std::string&)> log;

  // The load throttle, a testing and sizing knob (src/serve/throttle.h):
  // each load takes at least the time `modelcache replay`'s time model
  // gives it with --load-bandwidth, --load-latency and --load-slots (the
  // latter is limits.load_slots). A load starts when it has its slot and its
  // bytes are reserved (when the store runs its loader). It then waits out
  // the latency, and its copy's bytes (ModelCopy::bytes(), what the budget
  // charges, the "bytes" of /v1/models/{id}) move at an equal share of the
  // bandwidth among the loads moving bytes at that moment: n at once move
  // at bandwidth / n each. Its bytes start moving at max(start + latency,
  // the end of its real read), so the model holds as long as a real read
  // takes no longer than the latency. Loads of every kind share it and the
  // load slots: acquires' loads, HTTP loads and pins, pinned models at
  // start, and a keep-alive policy's prewarms (replay lets its prewarms
  // move only while no demand load does; the store's keep-alive thread
  // starts one only then). +inf
  // bandwidth and 0 latency: no throttle.
  double throttle_load_bytes_per_second =
      std::numeric_limits<double>::infinity();
  std::chrono::nanoseconds throttle_load_latency{0};
  // Each file's read first takes one byte from this descriptor (-1: none),
  // so that a test decides when loads proceed; end of file lets all pass.
  int test_load_gate_fd = -1;
  // Open files one component at a time with O_NOFOLLOW instead of openat2.
  bool test_per_component_open = false;
  // A socket (-1: none) through which a test stops the loop reading its
  // clients: each byte read from it, 'p' (pause) or 'r' (resume), is
  // answered with one byte once in effect. While paused, requests stay
  // unread in the sockets (replies already queued are still sent); end of
  // file resumes.
  int test_pause_reads_fd = -1;
  // A socket (-1: none) through which a test holds the lock of the store's
  // capacity as a slow holder would: PUT /v1/budget, once it holds it,
  // writes 'h' to it and reads one byte (or the end of file) before it
  // goes on.
  int test_capacity_hold_fd = -1;
};

struct HttpRequest {
  std::string method;  // "GET", "POST", "PUT", ...
  std::string path;    // without the query
  std::string body;
  // Whether it came through the admin listener: mutations need it.
  bool admin = false;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};

class Daemon {
 public:
  // Validates the options and the catalog, opens the model root, checks
  // every catalog file as CheckCatalog does (a model whose files fail is
  // unavailable; with strict_catalog, the first failure throws), creates
  // and listens on the socket, books the orphaned copies of a predecessor,
  // and starts the load pool (and the expiry thread of a TTL policy): the
  // pinned models' loads start now, before Run() (an unavailable one's
  // does not: it loads once its files are valid), and a keep-alive
  // policy's thread may prewarm. No client is answered (nor accepted)
  // until Run(). Throws modelcache::Error: CatalogError, weights::IoError
  // (the root; with strict_catalog, a catalog's file) or
  // weights::FormatError (with strict_catalog, a catalog's file),
  // kInvalidArgument (options, the socket's path or folder), kUnavailable
  // (another daemon listens on the socket).
  explicit Daemon(DaemonOptions options);
  // Releases every lease and frees every copy; clients' mappings stay
  // valid. REQUIRES: Run() is not running.
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Serves until Shutdown() (or SIGTERM/SIGINT with handle_signals): then
  // stops accepting, answers every waiting acquire with UNAVAILABLE,
  // abandons the loads in flight (each stops before its next file, or at
  // once when it waits for room, a slot or the throttle; a file being read
  // is read to its end), waits for them to have stopped, closes every
  // connection and returns. A copy is a cache: nothing is lost, and a
  // prompt exit is what a supervisor's stop timeout wants.
  void Run();
  // Thread-safe; async-signal-safe.
  void Shutdown();
  // Reloads the catalog (as SIGHUP does), checking every file again: an
  // unavailable model whose files are valid now is available again.
  // Thread-safe.
  void Reload();

  // The HTTP control API (docs/serve.md). Thread-safe.
  HttpResponse HandleHttp(const HttpRequest& request);

  // "modelcache:<instance>:", the start of every memfd name of this daemon.
  const std::string& memfd_prefix() const;

  // Listening sockets of the caller's (the HTTP listeners of `modelcache
  // serve`), by name, handed over with the daemon's own in a takeover. The
  // daemon does not own them; after a takeover it commits, `disown` is
  // called (on the loop: the caller's accept threads must stop taking the
  // descriptors for theirs, and must not close them), then each is
  // replaced in this process (dup2) by a socket that accepts nothing, so
  // that only the successor serves them; the caller closes them once its
  // threads are done. Thread-safe.
  void SetHandoverListeners(std::vector<std::pair<std::string, int>> fds,
                            std::function<void()> disown = nullptr);
  // After a takeover (DaemonOptions::takeover): the listening socket the
  // old daemon handed over under `name`, now the caller's, or -1.
  int TakeHandedOverListener(const std::string& name);
  // Whether Run() returned because a successor took over (the process
  // should exit 0 and leave the socket's path alone).
  bool HandedOver() const;
  // With DaemonOptions::systemd under systemd: tells it the service is
  // ready ("READY=1", with `status` as its STATUS= line); a Type=notify
  // unit waits for it. Returns whether it was sent. Thread-safe.
  bool NotifyReady(const std::string& status);

  // Blocks SIGTERM, SIGINT and SIGHUP in the calling thread, and so in the
  // threads it starts from now on.
  static void BlockSignals();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace modelcache::serve

#endif  // MODELCACHE_SERVE_DAEMON_H_
