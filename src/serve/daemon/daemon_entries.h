// The daemon's entries: leases, connections, waiters, tasks, orphan
// groups, unavailable models; Daemon::Impl (daemon_internal.h) keeps them,
// and says who owns what under which mutex.
//
// Design note (their states).
//
// A request of a connection is handled on the loop thread:
//   hello, ping, release: answered at once.
//   acquire: a hit (TryAcquire) is answered at once. A miss becomes a
//     *waiter* of its model: queued on the model, counted against its
//     connection and against max_waiters, filed by deadline.
// A model with waiters has one *task*: running on the pool (at most
// load_slots tasks run) or queued for a slot (by catalog priority, then
// first come; but one queued past drain_after goes first, the oldest
// first). A task is one blocking ModelCache::Acquire with an interrupt
// check that ends it when its model has no waiter left or the daemon shuts
// down. When it completes, the loop gives the task's lease to the first
// waiter and a TryAcquire lease to each other one; a failure answers them
// all, except that after CAPACITY under when_full "fail" the waiters that
// asked to wait get a task of their own. A waiter whose deadline passes gets
// TIMEOUT; one whose connection closes just goes.
//
// A lease (LeaseEntry) is granted on the loop and lives in leases_ until it
// is released: by its connection's release request, when its connection
// ends (at once if the reply with its descriptors was never sent or the
// process is dead; otherwise it is orphaned, owned by an OrphanGroup
// watching the process's pidfd), or at shutdown.
//
//   granted --release/close(dead peer, undelivered)--> released
//   granted --close(live peer)--> orphaned --pidfd readable, or the process
//                                            maps and holds none of its
//                                            memfds--> released
//
// Delegation (a lease's use, detail::Use; docs/design.md draws it):
//
//   in use --"idle"--> idle --store picks the copy--> recalled
//     ^                 |     (GateUnload refuses,      |  |
//     +------"use"------+      marks, loop sends)       |  +--"release"-->
//     released
//     +----------"use" (busy), or --recall-timeout------+
//
//   in use --a "fail" load needs its room (RecallInUse)--> recalled, keeping
//     its store lease (only of a connection that said "delegate", and only
//     when the recalls would make the room; not one that answered "use" to
//     a recall since that load began)
//
// An idle lease drops its store lease (the copy counts as evictable) and is
// *uncovered*: listed in uncovered_ under its copy. Every copy's unloader is
// GateUnload: it passes only when no lease of the copy is uncovered, so no
// copy is freed while a client may map it; otherwise it throws (the store
// keeps the record and moves on) after marking the idle ones recalled for
// the loop to send (to_recall_). It never waits, so it may run on any thread,
// the loop's included. An uncovered lease in use (revived while its copy was
// being refused), orphaned or retired takes a store lease again on the loop
// (CoverUncovered, TryAcquire); one that cannot for now is tried again
// (next_cover_). Every end of a recall wakes the store's waiters for room
// (Budget::NotifyEvictable) and WaitForRecalls (a "fail" load, an HTTP
// unload). Leases of a model being retired (reload, HTTP unload) keep their
// store lease while idle and are recalled at once, in use or idle, saying
// "retired" (RecallRetired).
//
// Copies a predecessor handed out (restart orphans) are not in the store:
// they are bytes taken off the store's capacity (capacity_ = configured_ -
// orphaned_), recomputed from /proc/*/maps at start, when a process that
// maps one exits, and every orphan_rescan while any remain. A reclaim that
// adopts one moves its bytes into the store for every process that maps
// it, so each other process that the scan saw mapping it gets an orphaned
// lease on it (HoldForMappers, owned by an OrphanGroup on its pidfd): the
// copy is never evicted while it is mapped, and never adopted twice. That
// lease ends when the process reclaims its own (DropMapperHolds), when the
// rescan finds it maps the copy no more, or when it exits.
//
// A reclaim that adopts a predecessor's copy (daemon_reclaim.cc) changes
// the store's capacity, which takes capacity_mu_; the loop never waits on
// it, so the adoption runs on the background thread (an Adoption):
//
//   checked on the loop --the copy's adoption queued (Later); its
//     connection's reads paused, so its next request is read after the
//     answer--> adopting
//   adopting --on the background thread: capacity_mu_, the reservation
//     grown by the copy's orphaned bytes in the same step (no other load
//     can take that room), the orphaned bytes less them; the result handed
//     to the loop (adopted_)--> adopted or refused
//   adopted --on the loop: the lease filed on its connection and answered
//     "ok" (the connection gone: an orphaned hold for its process, as for
//     any other mapper), the rest of the orphans booked again--> a lease
//   refused --on the loop: CAPACITY, the descriptors closed--> done
//
// A reclaim of a copy whose adoption is in flight waits for it (a
// DeferredReclaim, its connection paused too) and is handled again once it
// ends: it then finds the copy in the store and gets a lease on it, so a
// copy is never adopted twice. One adopted already that the store no longer
// leases under its model (retired) is found by a lease that holds it
// (ReclaimHeldCopy): the reclaimed lease is filed on it uncovered, as a
// mapper's hold is, so it goes only when every holder has let go. While any
// adoption is in flight, the orphan bookings change no capacity (what a rescan
// finds is applied after the last one ends), so the orphaned bytes an adoption
// moved into the store are never taken off the capacity a second time.
//
// Unavailable models (daemon_unavailable.cc). A model whose files fail the
// checks of --check-catalog (open beneath the root, stat, header length,
// header parse) is unavailable; it costs that model, not the daemon:
//
//   available --start or reload finds a file failing, or a load's
//     LoadCopy throws FilesUnavailable--> unavailable (logged once, with
//     the file's error)
//   unavailable --an acquire with no copy resident, before retry_at-->
//     UNAVAILABLE at once, naming the file; no load, no wait
//   unavailable --an acquire at or after retry_at--> its waiter and task as
//     for any miss: the load checks the files on the pool (never on the
//     loop); failing --> unavailable, retry_at = now + backoff, backoff
//     doubled (to kUnavailableRetryMax); a copy made --> available
//   unavailable --a reload finds every file valid--> available
//
// A resident copy (taken over, reclaimed, loaded before the files went) is
// a hit whatever its files are, and an acquire in the grace period waits
// for its reclaim as any other. A load failure that is not about the files
// (no room, no memory, a read that fails) is LOAD_FAILED or the like, as
// before, and changes nothing here. A pinned model that is unavailable is
// not loaded (nor does it hold /readyz at 503); it is pinned once it is
// available again. unavailable_ is written on the loop (and in the
// constructor) only, under unavailable_mu_ for the HTTP threads.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_ENTRIES_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_ENTRIES_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "copy.h"
#include "daemon_metrics.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/core/cache.h"
#include "modelcache/serve/catalog.h"
#include "modelcache/serve/daemon.h"
#include "modelcache/serve/errors.h"
#include "protocol.h"

namespace modelcache::serve::detail {

// A lease's use as its client last told it (delegation, protocol.h).
enum class Use {
  kInUse,     // granted, or said "use" (or a recall went unanswered)
  kIdle,      // said "idle": the store may evict its copy, after a recall
  kRecalled,  // recalled (idle, delegated or retired): awaiting "release"
              // or "use"
};
// Its name in /v1/models and in modelcache_leases{use=...}.
const char* UseName(Use use);

struct LeaseEntry {
  // The store's lease: held unless the lease is idle (then the store counts
  // the copy as evictable). An entry without one is *uncovered* and listed
  // in uncovered_ under its copy, whose unloader then refuses.
  Lease lease;
  const void* copy = nullptr;  // its ModelCopy: an identity, never read
  Use use = Use::kInUse;
  // Its model was retired by a reload: it keeps the store's lease while
  // idle (a retired record is unloaded when its last store lease ends).
  bool retired = false;
  // Recalled because its copy started draining (RecallDraining): the recall
  // says "drain".
  bool draining = false;
  uint64_t connection = 0;  // 0 once orphaned
  std::string model;
  pid_t pid = 0;
  uid_t uid = 0;
  bool delivered = false;  // its reply (with the descriptors) was sent
  bool orphaned = false;
  // Made by HoldForMappers: held for a process that maps an adopted copy
  // of a predecessor's and has not reclaimed its own lease on it yet.
  bool held_for_mapper = false;
  // When a recall of it last ended with the lease in use (answered "use",
  // or unanswered): a "fail" load that saw that does not recall it again
  // (RecallInUse).
  Clock::time_point busy_since{};
  uint64_t bytes = 0;
  std::vector<MemfdId> memfds;  // of its copy: data and header per file
};

struct Outgoing {
  std::string bytes;
  std::vector<int> fds;
  std::shared_ptr<const ModelCopy> keep;  // keeps `fds` open until sent
  uint64_t lease = 0;                     // the lease it delivers, if any
};

struct Connection {
  uint64_t id = 0;
  base::UniqueFd fd;
  base::UniqueFd pidfd;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::deque<Outgoing> out;
  bool writing = false;  // EPOLLOUT is armed
  bool doomed = false;   // closes after the current event
  Disconnect doom_reason = Disconnect::kClosed;
  std::set<uint64_t> leases;
  std::set<uint64_t> waiters;  // waiter sequence numbers
  // A reclaim of its waits for an adoption (Adoption): its reads pause.
  bool adopting = false;
};

struct Waiter {
  uint64_t seq = 0;
  uint64_t connection = 0;
  uint64_t request_id = 0;
  std::string model;
  Clock::time_point start;
  Clock::time_point deadline;
  bool fail_when_full = false;
  // A load of its model was running or queued when it came: it joined that
  // load rather than starting one.
  bool joined = false;
};

// Thrown by a task's interrupt check.
struct Cancelled {};

// How a prefetch (an HTTP load or pin) ended: an HTTP status and, when it
// failed, why.
struct PrefetchResult {
  int status = 200;
  std::string error;
};

struct Task {
  uint64_t seq = 0;
  CatalogModel model;
  WhenFull when_full = WhenFull::kWait;
  // A prefetch (HTTP load or pin, a pinned model at start): no waiters; it
  // ends by reporting to `done` (when set) and pins when `pin`.
  bool prefetch = false;
  bool pin = false;
  std::shared_ptr<std::promise<PrefetchResult>> done;
  std::atomic<bool> cancel{false};
  uint64_t expected_bytes = 0;  // what the load reserves
  // Set on the loop when it starts: when its oldest waiter came (its place
  // in the store's arrival order, AcquireOptions::arrival; unset for a
  // prefetch), and the store leases of the orphaned leases then, which its
  // drain must not take (AcquireOptions::holds: they count as pinned).
  std::optional<Clock::time_point> arrival;
  std::vector<uint64_t> holds;
  // Filled by the pool thread.
  Lease lease;
  std::exception_ptr error;
  // Its loader ran and made a copy from the files (not a hit, a join or an
  // adoption): they are valid.
  bool loaded = false;
};

struct ModelQueue {
  std::deque<uint64_t> waiters;  // sequence numbers, first come first
  std::shared_ptr<Task> task;    // running
  bool queued = false;           // waiting for a load slot
  // Its copy fits the configured capacity but not what orphans leave of
  // it: the waiters wait for a rescan to free some.
  bool blocked_by_orphans = false;
};

struct OrphanGroup {
  base::UniqueFd pidfd;
  pid_t pid = 0;
  std::vector<uint64_t> leases;
};

// What one process maps or holds of the daemon's memfds (ProcessMemfds);
// `known` false when its /proc entries could not be read.
struct PidMemfds {
  pid_t pid = 0;
  bool known = false;
  std::set<std::pair<uint64_t, uint64_t>> held;
};

// A catalog read for a reload, or why it was refused.
struct Reloaded {
  std::shared_ptr<const Catalog> catalog;  // null when refused
  std::string digest;                      // CatalogDigest of its text
  std::string error;
  // The models whose files fail the checks (without --strict-catalog).
  std::map<std::string, FileProblem> problems;
};

// A model whose files failed the checks (unavailable): why, and when an
// acquire may try them again (its load checks them, on the pool).
struct Unavailable {
  FileProblem problem;
  Clock::time_point since;
  Clock::time_point retry_at;
  // The wait after the next failed try: unavailable_retry, doubled by each
  // failed try up to kUnavailableRetryMax.
  Clock::duration backoff{0};
};
inline constexpr std::chrono::seconds kUnavailableRetryMax{60};

struct RestartOrphan {
  uint64_t bytes = 0;
  std::string name;
  std::set<pid_t> pids;
};

// A reclaim whose copy is adopted off the loop (the note above).
struct Adoption {
  // Set on the loop.
  uint64_t connection = 0;
  protocol::Request request;
  pid_t pid = 0;
  size_t predecessor = 0;   // the copy's index in predecessor_
  std::set<pid_t> mappers;  // other processes that map it
  uint64_t booked = 0;      // its bytes booked as orphaned
  std::shared_ptr<AdoptedCopy> copy;
  // Set on the background thread: the lease, or why there is none.
  std::optional<Lease> lease;
  std::string why;
};

// A reclaim of a copy whose adoption is in flight: handled again after it.
struct DeferredReclaim {
  uint64_t connection = 0;
  protocol::Request request;
  std::vector<base::UniqueFd> fds;
};

// Per-model counts the HTTP API shows.
struct ModelStats {
  uint64_t loads = 0;
  double last_load_seconds = 0;
  std::string last_error;
};

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_ENTRIES_H_
