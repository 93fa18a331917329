// The daemon's state, shared by the files of its concerns:
//   daemon.cc              the facade, the loop (Run), shutdown and reload
//   daemon_setup.cc        setup and listening, teardown
//   daemon_connections.cc  accept, credentials, read, write, doom, close
//   daemon_leases.cc       leases and orphan groups
//   daemon_waiters.cc      the waiters and the load queue, load slots
//   daemon_unavailable.cc  models whose files fail the checks
//   daemon_orphans.cc      a predecessor's copies (restart orphans), capacity;
//                          the leases held for other mappers of an adopted
//                          copy
//   daemon_record.cc       the record of copies made (and systemd's fd store)
//   daemon_reclaim.cc      reclaim and adoption of a predecessor's copies,
//                          the grace period
//   daemon_handover.cc     takeover: both the old and the new daemon's side
//   handover.h             the record's and the handover's formats
//   daemon_threads.cc      the pool, expiry and background threads
//   daemon_entries.h       leases, connections, waiters, tasks (their states)
//   daemon_lease_books.h   Impl's books of leases, delegations and recalls
//   daemon_reclaim_books.h Impl's record, reclaim, fd store, takeover state
//   daemon_loop_books.h    Impl's loop state, its inbox, its threads' state
//   lock_ranks.h           the mutexes' lock ranks (the order below)
//   daemon_metrics.h/.cc   the histogram, metric names, Impl's counters and
//                          /metrics
//   event_loop.h           the epoll, pidfd and errno wrappers
//   http_api.cc            the HTTP API
//
// Design note (states and who owns what).
//
// The states of a request, a lease (delegation included), a restart
// orphan and an unavailable model: daemon_entries.h, with their entries.
//
// Lifecycle.
//   starting (the constructor): options and catalog checked, root opened,
//     every catalog file checked (as --check-catalog: a model whose files
//     fail is unavailable; with --strict-catalog the first failure is
//     fatal), the store made, the whole machine's /proc/*/maps scanned
//     once for a predecessor's copies (booked as orphaned bytes, their pids
//     watched), the socket bound, then the background thread, the pool and
//     the expiry thread started, and the loads of the pinned models that
//     are available queued (they run before Run()).
//   serving (Run()): the loop answers clients; the pool loads; the
//     background thread frees copies, reads the orphan holders'
//     /proc/PID/maps every orphan_rescan and SIGHUP's catalog (and checks
//     its files), handing results back through the eventfd (completed_,
//     rechecked_, reloaded_, adopted_).
//   stopping (SIGTERM, Shutdown()): the socket is unlinked, waiters get
//     UNAVAILABLE, slot waits and throttle holds end, and every load in
//     flight stops at its next interrupt check or file; Run() returns once
//     none runs. The destructor joins the pool and expiry threads, drops
//     every lease and the store, then drains and joins the background
//     thread (the last copies are freed there).
//
// The prewarm path: a keep-alive policy's thread in the store (never the
// loop) asks prewarm_source for a model, and the store runs its loader:
// it takes a load slot (TakeSlotForPrewarm, shared with the loop's tasks
// through slots_mu_), reads the copy (ReadingMark: "its load is still
// running") and takes the throttle like any load, then gives the slot back
// and wakes the loop, which starts what waited for the slot.
//
// Ownership: loop-only members have no lock; everything another thread
// reads is atomic or under one of these mutexes:
//   capacity_mu_      the store's capacity and orphaned_, changed together
//                     (ApplyCapacity: PUT /v1/budget's HTTP thread, the
//                     background thread, the constructor; Adopt: the
//                     background thread, the constructor). Never taken on
//                     the loop: a reclaim's adoption leaves it (Adoption,
//                     daemon_entries.h). No thread holds it across the
//                     evictions of a shrink: ApplyCapacity only resizes
//                     (Budget::Resize) and its caller evicts after letting
//                     go. Adopt holds it across its reservation, which may
//                     evict.
//   leases_mu_        leases_, uncovered_, to_recall_, the recall counts and
//                     delegating_ (the connections that said "delegate").
//   catalog_mu_       the catalog, its digest, the last reload's error.
//   orphans_mu_       restart_orphans_ and the unreadable count.
//   live_mu_          live_: the memfds of the copies held now.
//   record_write_mu_  one writer of the record at a time, snapshot to rename
//                     (taken on the loop only by HandleCommit, once, as a
//                     barrier: its writes go through Later).
//   record_mu_        record_, in_fd_store_.
//   handover_mu_      the listeners a takeover hands over, or took.
//   inbox_mu_         what other threads hand the loop (completed_,
//                     rechecked_, reloaded_, adopted_), and the loop
//                     passes a "fail" load waits for (passes_done_,
//                     AwaitLoopPass).
//   pool_mu_          the pool's queue of tasks.
//   expiry_mu_        the expiry thread's next wake-up.
//   background_mu_    the background thread's chores (Later).
//   slots_mu_         the load slots, shared with prewarms.
//   reading_mu_       the models whose loads are reading their files.
//   stats_mu_         per-model counts (the store's event callback).
//   unavailable_mu_   unavailable_: the models whose files failed (written
//                     on the loop; read by the HTTP threads and the
//                     store's prewarm source).
// Order: a mutex on the left may be held while one on its right is taken,
// never the reverse.
//   capacity_mu_ -> the store's locks (Resize, Adopt's reservation)
//   capacity_mu_ -> leases_mu_, live_mu_, record_mu_, background_mu_,
//                   stats_mu_
//     (the evictions of Adopt's reservation run the store's user code with
//     capacity_mu_ held: the unloader, GateUnload, takes leases_mu_; a freed
//     copy's observer takes live_mu_; ForgetRecorded takes record_mu_ and
//     queues with Later; the event callback takes stats_mu_)
//   record_write_mu_ -> record_mu_
//   handover_mu_ -> the HTTP servers' own locks (disowning the listeners)
// Every other mutex is a leaf: nothing is taken while it is held. The
// orders within one function are declared (MC_ACQUIRED_BEFORE), so clang's
// -Wthread-safety-beta checks them (plain -Wthread-safety ignores them).
// Those through calls (the store's user code) are beyond it, so each mutex
// has a lock rank (base::LockRank), which debug builds check at every lock:
// kOuterLockRank for capacity_mu_, record_write_mu_ and handover_mu_,
// kLeafLockRank for the rest. A thread that takes a leaf while holding
// one, or an outer mutex while holding any, aborts naming both; the daemon
// tests run the daemon so in the debug and sanitizer builds.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_INTERNAL_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_INTERNAL_H_

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "copy.h"
#include "daemon_entries.h"
#include "daemon_lease_books.h"
#include "daemon_loop_books.h"
#include "daemon_metrics.h"
#include "daemon_reclaim_books.h"
#include "handover.h"
#include "lock_ranks.h"
#include "modelcache/base/mutex.h"
#include "modelcache/base/unique_fd.h"
#include "modelcache/core/cache.h"
#include "modelcache/serve/catalog.h"
#include "modelcache/serve/daemon.h"
#include "modelcache/serve/errors.h"
#include "protocol.h"
#include "systemd.h"
#include "throttle.h"

namespace modelcache::serve {

namespace detail {

// Set while this thread adopts a copy into the store (daemon_reclaim.cc):
// the store's kLoaded event it emits is no load (OnEvent).
extern thread_local bool g_adopting;

}  // namespace detail

// The state is in the books it inherits, one header per concern:
// daemon_lease_books.h (leases, delegations, recalls),
// daemon_reclaim_books.h (the record, reclaims, the fd store, takeover),
// daemon_loop_books.h (the loop's connections and waiters, its inbox, the
// threads beside it) and daemon_metrics.h (the counters).
class Daemon::Impl : private detail::LeaseBooks,
                     private detail::ReclaimBooks,
                     private detail::LoopState,
                     private detail::LoopInbox,
                     private detail::Workers,
                     private detail::DaemonCounters {
 public:
  explicit Impl(DaemonOptions options);
  ~Impl();

  void Run();
  void RequestShutdown();
  void RequestReload();
  HttpResponse HandleHttp(const HttpRequest& request);
  const std::string& memfd_prefix() const { return memfd_prefix_; }
  bool NotifyReady(const std::string& status) const {
    return notifier_ && notifier_->Ready(status);
  }
  void SetHandoverListeners(std::vector<std::pair<std::string, int>> fds,
                            std::function<void()> disown)
      MC_EXCLUDES(handover_mu_);
  int TakeHandedOverListener(const std::string& name) MC_EXCLUDES(handover_mu_);
  bool HandedOver() const { return handed_over_.load(); }

 private:
  using Clock = modelcache::Clock;

  // ---- setup (daemon_setup.cc; Log: daemon.cc) ----
  void Log(const std::string& line) const;
  void Listen();
  void CreateStore();

  // ---- the loop (daemon.cc, daemon_connections.cc, daemon_leases.cc,
  // daemon_waiters.cc, daemon_orphans.cc) ----
  void Accept();
  void Readable(detail::Connection& c);
  void Writable(detail::Connection& c);
  void HandleDatagram(detail::Connection& c, std::string_view bytes,
                      bool truncated, size_t real_bytes,
                      std::vector<base::UniqueFd> fds);
  void HandleAcquire(detail::Connection& c, const protocol::Request& r);
  // Reclaim and takeover (daemon_reclaim.cc, daemon_handover.cc).
  void HandleReclaim(detail::Connection& c, const protocol::Request& r,
                     std::vector<base::UniqueFd> fds);
  // A refused reclaim's message, logged (so that an operator, and the
  // soak, learn why) before it goes to the client (daemon.cc).
  std::string LogRefusedReclaim(const protocol::Request& r,
                                const std::string& why) const;
  void HandleTakeover(detail::Connection& c, const protocol::Request& r);
  void HandleCommit(detail::Connection& c, const protocol::Request& r);
  void Send(detail::Connection& c, detail::Outgoing message);
  void SendError(detail::Connection& c, uint64_t id, ServeCode code,
                 const std::string& message, const std::string& cause = "");
  void Doom(detail::Connection& c, detail::Disconnect reason);
  void CloseDoomed();
  void Close(uint64_t id, detail::Disconnect reason);
  // `load`: how the copy was found, for the reply ("hit", "miss",
  // "joined").
  void Grant(detail::Connection& c, uint64_t request_id,
             const std::string& model, Lease lease, detail::Result result,
             const char* load, Clock::time_point start);
  // `answer`: the client's own release (which, for a recalled lease, is
  // the recall's answer), as opposed to its connection's end.
  void ReleaseLease(uint64_t lease, bool answer = false)
      MC_EXCLUDES(leases_mu_);
  // Delegation (daemon_leases.cc; design note above).
  void HandleIdle(detail::Connection& c, const protocol::Request& r)
      MC_EXCLUDES(leases_mu_);
  void HandleUse(detail::Connection& c, const protocol::Request& r)
      MC_EXCLUDES(leases_mu_);
  // The unloader of every copy in the store: returns when no lease of the
  // copy is uncovered; otherwise marks its idle ones recalled, wakes the
  // loop to send the recalls, and throws (the store keeps the copy and
  // moves on to its next victim). Any thread; never waits.
  void GateUnload(const void* copy) MC_EXCLUDES(leases_mu_);
  // On the loop: sends the recalls GateUnload asked for, and gives uncovered
  // leases that are in use (or orphaned) their store lease again.
  void ProcessRecalls() MC_EXCLUDES(leases_mu_);
  void CoverUncovered() MC_EXCLUDES(leases_mu_);
  // One pass of it, on any thread: true when some lease stayed uncovered.
  bool CoverOnce() MC_EXCLUDES(leases_mu_);
  // Takes the recalls unanswered by `now` as "use".
  void ExpireRecalls(Clock::time_point now) MC_EXCLUDES(leases_mu_);
  // Moves `id` into or out of uncovered_ after its store lease changed.
  void IndexCoverage(uint64_t id, detail::LeaseEntry& e)
      MC_REQUIRES(leases_mu_);
  // A recall ended (answered or not), or an uncovered lease was released:
  // at the end of this loop iteration (FlushRoomChanged), WaitForRecalls
  // and the store's waiters for room wake.
  void RecallEnded() MC_EXCLUDES(leases_mu_);
  void FlushRoomChanged() MC_EXCLUDES(leases_mu_);
  bool room_changed_ = false;  // loop-only
  // Keeps recalls_outstanding_ (the leases in kRecalled) exact.
  void SetUse(detail::LeaseEntry& e, detail::Use use) MC_REQUIRES(leases_mu_);
  // Sends the recall of `lease` to `c` and starts its clock.
  void SendRecall(detail::Connection& c, uint64_t lease, bool retired = false,
                  bool draining = false);
  // Recalls `lease`, in use on `c`, as retired (a reclaim adopted it
  // retired), so that its holder takes no new local reference to its copy.
  // On the loop.
  void RecallInUseRetired(detail::Connection& c, uint64_t lease)
      MC_EXCLUDES(leases_mu_);
  // Off the loop: when recalls started after RecallsStarted() said `since`,
  // waits until none is outstanding, or `deadline`, and returns true.
  uint64_t RecallsStarted() const MC_EXCLUDES(leases_mu_);
  bool WaitForRecalls(uint64_t since, Clock::time_point deadline)
      MC_EXCLUDES(leases_mu_);
  // Off the loop, for a "fail" load of `model` that found no room for
  // `needed` bytes: recalls leases in use of delegating connections
  // (delegating_) when their copies, with the free and the evictable bytes,
  // would cover it; the least recently used first, no more than it takes.
  // They keep their store leases until "release" arrives. Not those whose
  // recall ended in use at or after `since` (the load's start): their
  // holders use them. False when it recalled nothing (nothing would cover
  // it, or nothing to recall).
  bool RecallInUse(const std::string& model, uint64_t needed,
                   Clock::time_point since) MC_EXCLUDES(leases_mu_);
  // Off the loop: returns once the loop has finished an iteration whose
  // epoll_wait began after this call and that read every readable socket
  // to its end (so every request sent before this call is read), at
  // shutdown, or after the recall timeout (a loop that never drains).
  void AwaitLoopPass() MC_EXCLUDES(inbox_mu_);
  // Before a reload or an HTTP unload retires `model`: its leases are
  // marked retired, its idle ones take a store lease again, and every one a
  // connection holds is recalled ("retired": its holder takes no new local
  // reference; one in use answers "use"). Any thread.
  void RecallRetired(const std::string& model) MC_EXCLUDES(leases_mu_);
  // When the store's copy of `model` starts draining (an event of the
  // store): every lease of it that a connection which said "drain" holds,
  // in use or idle, is recalled saying "drain", so that its holder stops
  // reusing it locally and the drain waits only for the references under
  // way. Any thread.
  void RecallDraining(const std::string& model) MC_EXCLUDES(leases_mu_);
  void ReleaseOrphanGroup(uint64_t group);

  void AddWaiter(detail::Connection& c, const protocol::Request& r,
                 const CatalogModel& model);
  // Removes a waiter from every index; answers it with `code` when given.
  // `in_queue` false: not from its model's list, which the caller rebuilds
  // (and which then decides whether the model's queue goes).
  void RemoveWaiter(uint64_t seq, const ServeCode* code = nullptr,
                    const std::string& message = "", bool in_queue = true);
  void Dispatch(const std::string& model);
  void StartTask(const std::string& model);
  void StartPrefetch(
      const CatalogModel& model, bool pin,
      std::shared_ptr<std::promise<detail::PrefetchResult>> done);
  void StartQueued();
  // The slot queue's next: by catalog priority, then first come; but once
  // some entry has waited drain_after, the oldest such entry (arrival
  // order outranks priority, as in the store's waits for room).
  std::map<std::pair<int, uint64_t>, Queued>::iterator NextQueued(
      Clock::time_point now);
  // When the oldest waiter of `model` came (now when it has none).
  Clock::time_point OldestArrival(const detail::ModelQueue& q) const;
  // The store leases of the orphaned leases now (Task::holds).
  std::vector<uint64_t> OrphanedStoreLeases() const MC_EXCLUDES(leases_mu_);
  // Load slots (Limits::load_slots), shared by the loop's tasks and the
  // keep-alive prewarms of the store's thread.
  bool TryTakeSlot() MC_EXCLUDES(slots_mu_);
  void GiveSlot() MC_EXCLUDES(slots_mu_);
  int SlotsUsed() const MC_EXCLUDES(slots_mu_);
  // Blocks until a slot is free; throws kUnavailable at shutdown.
  void TakeSlotForPrewarm() MC_EXCLUDES(slots_mu_);
  void StopSlotWaits() MC_EXCLUDES(slots_mu_);
  void Complete(std::shared_ptr<detail::Task> task);
  void ExpireWaiters(Clock::time_point now);
  void DrainEvents();
  void BeginShutdown();
  // SIGHUP or Reload(): reads the catalog on the background thread...
  void DoReload();
  // ... and applies what it read, on the loop.
  void ApplyReload(detail::Reloaded result);

  // ---- unavailable models (daemon_unavailable.cc) ----
  // `model`'s files failed the checks: at start or on reload (`tried`
  // false: the back-off stays as it was), or in a load (`tried`: the next
  // try waits longer). Logs once when it becomes unavailable, and when its
  // error changes. Loop-only (or the constructor).
  void MarkUnavailable(const CatalogModel& model,
                       const detail::FileProblem& problem, bool tried)
      MC_EXCLUDES(unavailable_mu_);
  // `model`'s files passed (a reload) or made a copy (a load): available
  // again when it was not, and then, when the catalog pins it, its pin
  // starts. Loop-only.
  void MarkAvailable(const std::string& model) MC_EXCLUDES(unavailable_mu_);
  // On the loop, for an acquire that found no copy: whether `model` is
  // unavailable and its back-off has not passed (then `message` says why,
  // naming the file, and `cause` is the file error's code name).
  bool RefuseUnavailable(const std::string& model, std::string* message,
                         std::string* cause) const MC_EXCLUDES(unavailable_mu_);
  // What an acquire of unavailable `model` is answered.
  std::string UnavailableMessage(const std::string& model) const
      MC_EXCLUDES(unavailable_mu_);
  bool IsUnavailable(const std::string& model) const
      MC_EXCLUDES(unavailable_mu_);
  std::map<std::string, detail::Unavailable> UnavailableModels() const
      MC_EXCLUDES(unavailable_mu_);

  // At start only: the whole machine's /proc/*/maps, for a predecessor's
  // copies.
  void RescanOrphans() MC_EXCLUDES(orphans_mu_, capacity_mu_, live_mu_);
  // After start, orphans are watched by the pids that hold them: their
  // pidfds, and every orphan_rescan their own /proc/PID/maps, read on the
  // background thread (StartRecheck) and handed back through the eventfd
  // (ApplyRecheck).
  void StartRecheck() MC_EXCLUDES(orphans_mu_, inbox_mu_);
  void ApplyRecheck(const std::vector<detail::PidMemfds>& found)
      MC_EXCLUDES(orphans_mu_, leases_mu_);
  // A process mapping a predecessor's copy exited.
  void RestartPidExited(pid_t pid) MC_EXCLUDES(orphans_mu_);
  // Books `orphans` as the predecessor's copies still mapped: the orphaned
  // bytes, the pidfds watched, the store's capacity (now when `now`, else
  // on the background thread: after start the bytes only shrink; after the
  // last adoption in flight ends, while any is).
  void BookRestartOrphans(
      std::map<detail::MemfdId, detail::RestartOrphan> orphans, int unreadable,
      bool now) MC_EXCLUDES(orphans_mu_, capacity_mu_);
  // Releases the orphaned leases whose process maps none of their copy's
  // memfds and holds no descriptor of them any more.
  void CheckOrphanGroups(const std::vector<detail::PidMemfds>& found)
      MC_EXCLUDES(leases_mu_);
  void ScheduleRescan();
  // Sets the store's capacity to the configured one less `orphaned`, then
  // publishes `orphaned` (orphaned_). Evicts nothing (Budget::Resize): the
  // caller calls Budget::EvictOverCapacity after letting go of
  // capacity_mu_.
  void ApplyCapacity(uint64_t orphaned) MC_REQUIRES(capacity_mu_);
  void WatchPid(pid_t pid);
  // The epoll events a connection's socket is watched for now.
  uint32_t ConnectionEvents(const detail::Connection& c) const;
  // DaemonOptions::test_pause_reads_fd is readable.
  void PauseHook();
  // DaemonOptions::test_capacity_hold_fd: says it holds capacity_mu_, and
  // waits for the test's byte.
  void CapacityHoldHook() MC_REQUIRES(capacity_mu_);

  // ---- the record and reclaim (daemon_record.cc, daemon_reclaim.cc; design
  // notes there; the holds for other mappers: daemon_orphans.cc) ----
  // Writes `copy` down in the record: before its descriptors go out, or,
  // with `later` (on the loop, which waits on no write), on the background
  // thread.
  void RecordCopy(const detail::ModelCopy& copy, bool later = false)
      MC_EXCLUDES(record_write_mu_, record_mu_);
  // A memfd was freed: the copy it starts goes from the record.
  void ForgetRecorded(const detail::MemfdId& id) MC_EXCLUDES(record_mu_);
  void WriteRecord() MC_EXCLUDES(record_write_mu_, record_mu_);
  // At start: the predecessor's record, and the grace period when a live
  // process still maps a copy it names.
  void ReadPredecessorRecord();
  void StartGrace() MC_EXCLUDES(orphans_mu_);
  // Whether a load of `model` waits for a reclaim (the grace period).
  bool AwaitsReclaim(const std::string& model) const;
  // The grace period ends for `model` (reclaimed), or for all (null).
  void EndGrace(const std::string* model);
  // Puts an adopted copy in the store and returns a lease on it, or null
  // with `why`. `booked`: its bytes booked as orphaned, which move into the
  // store's capacity with its reservation. Takes capacity_mu_: never on the
  // loop (the constructor, the background thread).
  std::optional<Lease> Adopt(const detail::AdoptedCopy& adopted,
                             uint64_t booked, std::string* why)
      MC_EXCLUDES(capacity_mu_);
  // On the loop: queues a reclaim's adoption for the background thread,
  // pausing its connection's reads; FinishReclaim, on the loop, takes the
  // result (daemon_entries.h's note).
  void AdoptLater(detail::Connection& c, detail::Adoption adoption);
  void FinishReclaim(detail::Adoption adoption);
  // Files a reclaimed lease on `c` and answers the reclaim.
  void FileReclaimedLease(detail::Connection& c, const protocol::Request& r,
                          Lease lease, const std::set<pid_t>& mappers)
      MC_EXCLUDES(leases_mu_);
  void SetAdopting(detail::Connection& c, bool adopting);
  // On the loop, after a reclaim adopted `copy`: an orphaned lease on it
  // for each other process in `pids` that maps it (the start's scan saw
  // them), so that it stays in use, and in the books, until that process
  // reclaims its own lease (DropMapperHolds), stops mapping it (the
  // rescan) or exits (its pidfd).
  void HoldForMappers(const detail::ModelCopy& copy, const std::string& model,
                      bool retired, const std::set<pid_t>& pids)
      MC_EXCLUDES(leases_mu_);
  // Releases the leases HoldForMappers made for `pid` on `copy`.
  void DropMapperHolds(pid_t pid, const void* copy) MC_EXCLUDES(leases_mu_);
  // A reclaim of a copy some lease here holds already, which the store no
  // longer leases under its model (retired): files `r`'s lease on it,
  // uncovered, and answers. False when no lease holds those memfds.
  bool ReclaimHeldCopy(detail::Connection& c, const protocol::Request& r,
                       const std::vector<detail::MemfdId>& memfds)
      MC_EXCLUDES(leases_mu_);
  // ---- the fd store (systemd) ----
  // At start, before any thread: the descriptors systemd passed back.
  void TakeStored();
  // After the predecessor's record is read: adopts the passed copies it
  // names (resident, no lease), removes the rest from systemd's store.
  void AdoptStored() MC_EXCLUDES(record_mu_);

  // The new daemon's side, in the constructor: connects to the old one,
  // takes what it hands over, commits. Throws kUnavailable naming why.
  void TakeOver();
  // The old daemon's side, on the loop. handover_conn_ is the connection
  // that asked (0: none): while set, no other connection is read, nothing
  // new loads, and nothing is accepted. Once no load runs, the handover is
  // sent (handover_sent_); the commit ends this daemon, the connection's
  // end (or handover_deadline_) before it resumes serving as before.
  void ContinueHandover(Clock::time_point now);
  void SendHandover(detail::Connection& c);
  void AbandonHandover(const std::string& why);
  bool ReadsPaused(const detail::Connection& c) const {
    return reads_paused_ || c.adopting ||
           (handover_conn_ != 0 && c.id != handover_conn_);
  }

  // ---- the pool (daemon_threads.cc) ----
  void PoolThread();
  void RunTask(detail::Task& task);
  // The store's loader of every load (a task's, a prewarm's): reads the
  // copy (marked as reading), holds the throttle, and gives the copy its
  // unloader, GateUnload.
  Loaded LoadForStore(const CatalogModel& model);
  // The test gate (DaemonOptions::test_load_gate_fd), before each file.
  void BeforeRead();

  // ---- helpers for both ----
  std::shared_ptr<const Catalog> catalog() const MC_EXCLUDES(catalog_mu_);
  std::string OrphanNote() const;
  // What holds the store's memory, but `model`: "'a' (5 MiB, 1 lease), ...".
  std::string HoldersNote(const std::string& model) const;
  // Whether a load of `model` is reading its files (or held by the
  // throttle) now, rather than waiting for room or a slot.
  bool ReadingNow(const std::string& model) const MC_EXCLUDES(reading_mu_);
  // Marks a load of a model as reading for its lifetime (in a loader).
  class ReadingMark {
   public:
    ReadingMark(Impl* impl, std::string model);
    ~ReadingMark();
    ReadingMark(const ReadingMark&) = delete;
    ReadingMark& operator=(const ReadingMark&) = delete;

   private:
    Impl* const impl_;
    const std::string model_;
  };
  // Whether a copy of `bytes` is too large only because of orphans.
  bool TooLargeForOrphansOnly(uint64_t bytes) const;
  void OnEvent(const CacheEvent& event) MC_EXCLUDES(stats_mu_);

  // ---- HTTP (http_api.cc) ----
  HttpResponse Health();
  HttpResponse Ready();
  HttpResponse Models(const std::string& only);
  HttpResponse ModelAction(const std::string& id, const std::string& action);
  HttpResponse BudgetEndpoint(const HttpRequest& request);
  HttpResponse Copies();
  HttpResponse Metrics();

  const DaemonOptions options_;
  const Clock::time_point started_ = Clock::now();
  std::string memfd_prefix_;
  std::string socket_path_;  // absolute
  ino_t socket_inode_ = 0;
  base::UniqueFd root_fd_;
  base::UniqueFd listen_fd_;
  base::UniqueFd epoll_fd_;
  base::UniqueFd event_fd_;
  base::UniqueFd signal_fd_;
  detail::CopyLoadOptions copy_options_;

  std::unique_ptr<ModelCache> store_;

  mutable base::Mutex catalog_mu_{
      base::LockRank{detail::kLeafLockRank, "catalog_mu_"}};
  std::shared_ptr<const Catalog> catalog_ MC_GUARDED_BY(catalog_mu_);
  std::string reload_error_ MC_GUARDED_BY(catalog_mu_);
  std::string catalog_digest_ MC_GUARDED_BY(catalog_mu_);

  // capacity_mu_ serialises the store's capacity changes (ApplyCapacity,
  // Adopt; see the note at the top for who takes it and the order). The
  // two numbers it applies are read anywhere without it.
  mutable base::Mutex capacity_mu_ MC_ACQUIRED_BEFORE(
      leases_mu_, live_mu_, record_mu_, background_mu_,
      stats_mu_){base::LockRank{detail::kOuterLockRank, "capacity_mu_"}};
  std::atomic<uint64_t> configured_{0};
  std::atomic<uint64_t> orphaned_{0};

  mutable base::Mutex orphans_mu_{
      base::LockRank{detail::kLeafLockRank, "orphans_mu_"}};
  std::map<detail::MemfdId, detail::RestartOrphan> restart_orphans_
      MC_GUARDED_BY(orphans_mu_);
  int unreadable_maps_ MC_GUARDED_BY(orphans_mu_) = 0;

  // Memfds of the copies this daemon holds now.
  mutable base::Mutex live_mu_{
      base::LockRank{detail::kLeafLockRank, "live_mu_"}};
  std::set<detail::MemfdId> live_ MC_GUARDED_BY(live_mu_);

  mutable base::Mutex slots_mu_{
      base::LockRank{detail::kLeafLockRank, "slots_mu_"}};
  base::CondVar slots_cv_;
  int slots_used_ MC_GUARDED_BY(slots_mu_) = 0;

  mutable base::Mutex reading_mu_{
      base::LockRank{detail::kLeafLockRank, "reading_mu_"}};
  std::map<std::string, int> reading_ MC_GUARDED_BY(reading_mu_);

  mutable base::Mutex stats_mu_{
      base::LockRank{detail::kLeafLockRank, "stats_mu_"}};
  std::map<std::string, detail::ModelStats> model_stats_
      MC_GUARDED_BY(stats_mu_);

  // The unavailable models, by id: written on the loop (and in the
  // constructor), read by the HTTP threads and the store's prewarm source.
  // A leaf: nothing else is taken under it.
  mutable base::Mutex unavailable_mu_{
      base::LockRank{detail::kLeafLockRank, "unavailable_mu_"}};
  std::map<std::string, detail::Unavailable> unavailable_
      MC_GUARDED_BY(unavailable_mu_);

  void RetryBlockedByOrphans();
  void Wake();

  void ExpiryThread() MC_EXCLUDES(expiry_mu_);

  void BackgroundThread() MC_EXCLUDES(background_mu_);
  // Runs `chore` on the background thread (here, now, when it is stopped).
  void Later(std::function<void()> chore) MC_EXCLUDES(background_mu_);

  // The load throttle (null when off); its holds end early at shutdown.
  std::unique_ptr<detail::LoadThrottle> throttle_;
};

}  // namespace modelcache::serve

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_INTERNAL_H_
