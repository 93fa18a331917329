// The client of `modelcache serve`: leases of a node daemon's shared,
// read-only copies of models.
//
//   auto client =
//   modelcache::serve::Client::Connect("/run/modelcache/serve.sock");
//   modelcache::serve::RemoteWeights unet =
//       client.Acquire("sdxl-unet", std::chrono::seconds(30));
//   for (const auto& t : unet.tensors()) Use(t.name(), t.dtype(), t.shape(),
//   t.data);
//   // ~RemoteWeights ends the reference; the lease is kept idle, mapped,
//   // until the daemon recalls it or keep_idle passes.
//
// A lease's copy is mapped read-only and shared: N processes on the node map
// one copy, which stays valid while this process maps it, even if the
// daemon dies. The daemon's memfds are sealed: nothing can change their
// bytes. Its header arrives as validated text and is parsed here with the
// same strict parser; no byte of the model file is read by the client.
//
// Errors are ServeError (serve/errors.h) with the protocol's code;
// DaemonUnavailableError when the daemon cannot be reached.
//
// Reconnection: when the connection is lost (the daemon restarted), the
// next call connects again, backing off (ClientOptions) until its own
// deadline. Leases of the lost connection stay mapped and valid.
//
// Reclaim: with a daemon whose hello lists "reclaim" (one whose successor,
// after a crash or a takeover, can adopt its copies), the leases this
// process holds when the connection is lost, in use or idle, are kept: the
// Client reconnects at once in the background (backing off up to 200 ms
// while nobody answers, for as long as such a lease is held) and, on the
// new connection, before any other request, re-asserts each one with the
// copy's memfds, which a Client keeps open for this (2 per file of each
// lease held; ClientOptions::reclaim). A lease the successor adopts is held
// as before: same id, same mapping, its release and idle notices go to the
// new connection, an idle one stays idle. A lease it refuses (it was gone),
// or every one when the new daemon does not list "reclaim", is *unbacked*:
// its references keep the mapping, their end unmaps it and sends nothing,
// an idle one is unmapped at once, and the next Acquire of its model asks
// the daemon. Until the new connection's reclaims are answered, an Acquire
// of a model held takes another local reference to its mapping (load()
// "local"), which the reclaim backs or not as it does the lease. Releases not
// yet sent on the lost connection are dropped (their leases were not
// reclaimed). A lease waiting to be reclaimed stays mapped whatever
// keep_idle says, and one whose last reference ends meanwhile is kept idle
// (keep_idle 0 too): while the daemon is away nothing could free its copy,
// the successor books the mapping as orphaned either way, and adopts it;
// keep_idle applies again once it is reclaimed. Close() reclaims nothing (the
// daemon ends the leases of a closed connection). Reclaims() counts what
// happened. With a daemon that does not list "reclaim", the leases of a lost
// connection are unbacked at once (the idle ones unmapped), as the daemon they
// came from is gone and a new one counts their copies as orphaned until they
// are unmapped.
//
// fork(): mappings are made with MADV_DONTFORK, so a child has none of its
// parent's copies (its RemoteWeights objects are hollow: their spans must
// not be read, and destroying them does nothing), and holds none of its
// parent's leases; the parent's leases are untouched. The child's first
// call on a Client connects afresh (the first call after fork() must not
// race another call on the same Client). The parent's socket is closed in
// the child at fork when it is one of the first 256 connections alive in
// the process (a table of that size, lock-free for the atfork handler);
// past that, the child keeps the descriptor open, unused, so that the
// daemon sees the parent's connection end only once both have closed it.
// Likewise the memfds kept for reclaim are closed in the child when they
// are among the first 4096 alive; past that the child keeps them open (so
// keeps those copies in memory) until it exits or execs (they are
// close-on-exec).
//
// Local reuse and delegation: a process maps a copy once. An Acquire of a
// model this process already holds a lease on (as the same name) takes
// another local reference to that mapping, with no round trip (load() is
// "local"); the daemon sees one lease. When the last reference ends the
// lease is kept, mapped, for ClientOptions::keep_idle, and the daemon is
// told it is idle (after idle_notice_delay), so that its copy counts as
// evictable: the node's budget stays honest while the process keeps what it
// uses. An Acquire revives it locally with no message: when the daemon had
// been told "idle", a thread of the Client tells it "use" once the lease has
// been used for idle_notice_delay (within about 100 ms more), and a lease
// revived and released sooner sends nothing. Meanwhile the daemon counts the
// copy as evictable and, should it pick it, its recall is answered "use".
// When the daemon wants the room it
// recalls the lease: a thread of the Client answers "release" (after
// unmapping) when no reference came back, else "use". So a copy is never
// unmapped under a reference, and the daemon frees none that this process
// maps. A Client keeps idle leases only with a daemon that recalls them
// (hello's limits list recall_timeout_ms); with another, the last
// reference's end releases the lease as before. A lost connection drops
// every idle lease (they are unmapped) unless the leases are reclaimed (see
// "Reclaim" above); references in use keep their mapping. A model
// retired by a SIGHUP reload (or an HTTP unload) is recalled from every
// holder: an idle lease is released, and references in use keep their
// copy, but once the recall is read no Acquire (AcquireLocal included, and
// not while the daemon is away either) takes a new reference to it: the
// next Acquire is a round trip for the current copy, and the last
// reference's end releases the retired one. (A local Acquire before the
// recall is read still gets the retired copy.) A copy that starts draining
// for an older request for room is recalled the same way from a Client with
// local_reuse (it tells a daemon whose hello limits list "drain" that it
// heeds drains): its next Acquire asks the daemon and queues behind the
// drain, so local reuse does not keep the copy past it.
//
// Releases: ~RemoteWeights never waits for the daemon's answer, but it
// returns only once its release (or, with idle_notice_delay 0, its idle
// notice) is on the socket: a release the socket has no room for now (the
// daemon is slow to read) is sent, in order, by a thread of the Client's
// own as the socket becomes writable, and the call waits for that (or for
// the connection's end). So an acquire that another process makes after
// this call returns finds the room (the daemon reads every socket before it
// refuses a "fail" acquire, and recalls a delegated lease it still counts
// in use). It is never dropped while the connection lives, and a request
// made after it is sent after it. A daemon that lists "recall_in_use" is
// told, at connection, that this Client delegates (local_reuse with
// keep_idle > 0), so that it may recall a lease whose last reference ended
// before its idle notice went.
//
// Thread safety: a Client may be used from any number of threads at once;
// replies are matched to requests by id, so a long acquire does not hold up
// a hit or a release on another thread. A RemoteWeights is immutable; it
// may be read from any thread and destroyed on any thread.
#ifndef MODELCACHE_SERVE_CLIENT_H_
#define MODELCACHE_SERVE_CLIENT_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/core/budget.h"
#include "modelcache/serve/errors.h"
#include "modelcache/weights/host_store.h"
#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::serve {

namespace detail {
class ClientCore;
struct Grant;
}  // namespace detail

struct ClientOptions {
  // How long Connect keeps trying to reach the daemon; 0 tries once.
  std::chrono::milliseconds connect_timeout{0};
  // Waits between attempts to connect: from `backoff_initial`, doubling up
  // to `backoff_max`.
  std::chrono::milliseconds backoff_initial{10};
  std::chrono::milliseconds backoff_max{1000};
  // How much longer than its timeout a call waits for the daemon's answer
  // (which is TIMEOUT when the daemon's clock ran out first).
  std::chrono::milliseconds reply_margin{2000};
  // Delegated leases (see "Local reuse and delegation" above): how long a
  // lease no reference uses any more is kept, mapped, for a local acquire
  // to revive; 0 releases it when its last reference ends. A lease waiting
  // to be reclaimed (the daemon is away) is kept whatever this says.
  std::chrono::milliseconds keep_idle{60'000};
  // False: every Acquire is a round trip and a lease of its own, and the
  // last reference's end releases it (no table, no delegation).
  bool local_reuse = true;
  // How soon after its last reference ends the daemon is told the lease is
  // idle (and may recall it). Until then the daemon counts it as in use; an
  // acquire within the delay revives it with no message at all. Likewise a
  // lease told idle and revived is told "use" only once it has been used for
  // this long (checked at least every 100 ms). A delay makes a thread of
  // the Client send the notice, woken at the reference's end; 0: the thread
  // that ends the last reference sends it, and wakes that thread only when
  // it is not due to look within those 100 ms.
  std::chrono::microseconds idle_notice_delay{1000};
  // Keep each copy's memfds open so that, after a lost connection, the
  // leases can be reclaimed from a successor daemon (see "Reclaim" above).
  // False: the memfds are closed once mapped, and the leases of a lost
  // connection are unbacked at once.
  bool reclaim = true;
  // For tests: runs on the thread that read a recall of `lease`, before the
  // client handles it (a test blocks here to order a recall and a revival).
  std::function<void(uint64_t lease)> test_on_recall;
};

// What became of the leases of lost connections (see "Reclaim" above),
// since the Client was made.
struct ReclaimStats {
  // Re-asserted on a new connection and adopted by its daemon.
  uint64_t reclaimed = 0;
  // Re-asserted and refused (the lease was gone): unbacked.
  uint64_t reclaim_refused = 0;
  // Not asked: the new daemon does not list "reclaim" (unbacked).
  uint64_t reclaim_unsupported = 0;
  // Waiting now for a connection to be reclaimed on.
  size_t pending = 0;
};

struct RemoteAcquireOptions {
  // Bounds the whole call: reconnecting, waiting for the load, for room.
  std::chrono::milliseconds timeout{60'000};
  // What a load this acquire starts does when nothing can be evicted: wait
  // for room, or fail at once with CAPACITY (naming what holds the memory).
  WhenFull when_full = WhenFull::kWait;
  // Lets the caller end the wait early (the Python binding's Ctrl-C): the
  // check runs about every `every` while the call waits, and what it throws
  // leaves the call. A lease granted after that is released.
  WaitInterrupt interrupt;
};

// One tensor of a remote copy.
struct RemoteTensor {
  const weights::TensorInfo* info = nullptr;  // owned by the RemoteWeights
  std::span<const std::byte> data;            // read-only shared memory
  size_t file = 0;                            // index into files()

  const std::string& name() const { return info->name; }
  weights::Dtype dtype() const { return info->dtype; }
  const std::vector<uint64_t>& shape() const { return info->shape; }
};

// A reference to a lease on a model's copy, mapped read-only. Move-only.
// Release() (or destruction) ends the reference; when it was the last, the
// lease is kept idle (delegated) or unmapped and released (see the note on
// local reuse and delegation above).
class RemoteWeights {
 public:
  RemoteWeights() = default;
  RemoteWeights(RemoteWeights&&) noexcept = default;
  RemoteWeights& operator=(RemoteWeights&& other) noexcept;
  ~RemoteWeights() { Release(); }

  explicit operator bool() const { return static_cast<bool>(grant_); }
  // The model's id (an alias given to Acquire resolves to it).
  const std::string& model() const;
  // The daemon's lease id: never reused by the daemon or a successor.
  // Local references to one mapping share it.
  uint64_t lease() const;
  // How the copy was found: "local" (this process held a lease on it: no
  // round trip), or as the daemon says: "hit" (it was resident), "miss"
  // (this acquire started its load) or "joined" (it waited for a load
  // already under way); empty from a daemon that does not say.
  const std::string& load() const;
  // One set per file of the catalog's model, in the catalog's order; each
  // views the shared mapping (path(): "<model>/<file>").
  const std::vector<weights::WeightSet>& files() const;
  // Every tensor of every file, in file order then data order.
  const std::vector<RemoteTensor>& tensors() const;
  // The tensor of that name, or null. (Names are the files' own; when two
  // files hold one name, the first file's.)
  const RemoteTensor* Find(std::string_view name) const;
  // Its bytes; throws modelcache::Error kNotFound when there is none.
  std::span<const std::byte> data(std::string_view name) const;
  // The data bytes of every file together.
  uint64_t data_bytes() const;

  // Unmaps and releases; later calls do nothing.
  void Release();

  // References to the files' weights for a runtime (HostWeightSource): each
  // keeps the copy mapped and the lease held until it and this object are
  // all released.
  std::vector<weights::HostWeights> ShareAsHostWeights() const;

 private:
  friend class detail::ClientCore;
  explicit RemoteWeights(std::shared_ptr<detail::Grant> grant)
      : grant_(std::move(grant)) {}
  std::shared_ptr<detail::Grant> grant_;
};

// What the daemon said when the connection was made.
struct ServerInfo {
  std::string server;
  uint64_t version = 0;
  std::map<std::string, uint64_t> limits;
};

class Client {
 public:
  // Connects to the daemon listening at `socket_path`, trying for up to
  // options.connect_timeout. Throws DaemonUnavailableError, or ServeError
  // kBusy (the daemon's client limit) or kInvalid (a peer not allowed, a
  // version the daemon does not speak).
  static Client Connect(const std::string& socket_path,
                        ClientOptions options = {});

  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  // The connection stays open while RemoteWeights of this client exist,
  // and closes with the last of them.
  ~Client();

  // A lease on `model` (an id or alias of the daemon's catalog), loading it
  // if needed. Throws ServeError: kNotFound, kTooLarge, kCapacity, kTimeout,
  // kLoadFailed (its core code says kIo or kInvalidData), kBusy, kInvalid;
  // DaemonUnavailableError; or what options.interrupt threw.
  RemoteWeights Acquire(std::string_view model,
                        const RemoteAcquireOptions& options = {});
  // The Acquire of `model` only where it is local: this process holds the
  // model (in use, or kept idle) as that name, so it takes another
  // reference with no message (load() "local"). Otherwise nullopt, having
  // sent nothing. Never waits for the daemon or for I/O, only for the
  // client's own lock (held briefly by every call), so it may be called
  // where blocking is not allowed: a Python binding holding the GIL, an
  // event loop (which then hands a nullopt to a thread that may wait).
  std::optional<RemoteWeights> AcquireLocal(std::string_view model);
  RemoteWeights Acquire(std::string_view model,
                        std::chrono::milliseconds timeout);

  // A round trip to the daemon. Throws like Acquire.
  void Ping(std::chrono::milliseconds timeout = std::chrono::seconds(5));

  // Of the current connection (connecting if there is none).
  ServerInfo Info();

  // Closes the connection now, as if the process had closed the socket.
  // Leases whose copies this process still maps stay orphaned in the daemon
  // until the process exits (releasing them does nothing any more); the
  // others end. None of them is reclaimed: the daemon ended them. The next
  // call connects again.
  void Close();

  const std::string& socket_path() const;

  // Leases this process keeps idle (delegated) now: mapped, with no
  // reference, revived by the next Acquire of their model.
  size_t IdleLeases();

  // What became of the leases of lost connections (ReclaimStats).
  ReclaimStats Reclaims();

 private:
  explicit Client(std::shared_ptr<detail::ClientCore> core);
  detail::ClientCore& Core();
  std::shared_ptr<detail::ClientCore> core_;
};

// The daemon's copies as the host copies of a runtime
// (runtime::RuntimeOptions::host_source): ModelRuntime and its device
// caches run unchanged on them. Models are named by the daemon's catalog
// ids; the runtime's list of files is not used.
class RemoteHostWeights final : public weights::HostWeightSource {
 public:
  // `defaults` apply where the runtime's AcquireOptions say nothing (no
  // deadline: defaults.timeout).
  explicit RemoteHostWeights(Client client, RemoteAcquireOptions defaults = {});

  std::vector<weights::HostWeights> AcquireModel(
      const std::string& model, const std::vector<std::string>& files,
      const AcquireOptions& options) override;

  Client& client() { return client_; }

 private:
  Client client_;
  const RemoteAcquireOptions defaults_;
};

}  // namespace modelcache::serve

#endif  // MODELCACHE_SERVE_CLIENT_H_
