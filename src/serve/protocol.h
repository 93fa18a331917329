// The lease protocol between `modelcache serve` and its clients: message
// formats, the parsers of both sides, and the encoders.
//
// Transport: a SOCK_SEQPACKET UNIX socket. One datagram is one message: a
// JSON object of at most kMaxMessageBytes, with the file descriptors that
// travel with it (SCM_RIGHTS). Requests, client to daemon:
//
//   {"op":"hello","id":1,"version":1}
//   {"op":"acquire","id":2,"model":"sdxl","timeout_ms":30000,"when_full":"wait"}
//   {"op":"release","id":3,"lease":17}
//   {"op":"ping","id":4}
//   {"op":"idle","id":5,"lease":17}
//   {"op":"use","id":6,"lease":17}
//   {"op":"reclaim","id":7,"lease":17,"model":"sdxl","use":"in_use"}
//     with 2 descriptors per file, in file order, as an acquire's reply
//     gave them: the header memfd, then the data memfd
//   {"op":"takeover","id":8,"handover":1,"catalog":"<sha256 hex>"}
//   {"op":"commit","id":9}
//   {"op":"delegate","id":10}
//   {"op":"drain","id":11}
//
// `id` is the client's, >= 1, echoed in the reply; replies may come in any
// order. `timeout_ms` (default kDefaultTimeoutMs) bounds the whole acquire:
// the wait for a load and for room. `when_full` is what a load the acquire
// starts does when nothing can be evicted: "wait" for room (the default) or
// "fail" at once with CAPACITY. An acquire that joins a load already under
// way waits for that load. A request has exactly the fields of its op: an
// unknown or misplaced field is INVALID, as is a duplicate one.
//
// Replies, daemon to client; exactly one per request:
//
//   {"id":1,"ok":true,"version":1,"server":"modelcache 0.1.0",
//    "limits":{"max_requests_in_flight":64,...}}
//   {"id":2,"ok":true,"lease":17,"model":"sdxl","load":"miss",
//    "files":[{"name":"unet.safetensors","data_bytes":N,"header_bytes":H}]}
//     with 2 descriptors per file, in file order: the header memfd (the
//     validated header as JSON text, H bytes) and the data memfd (the data
//     buffer, N bytes, rounded up to pages), both sealed
//   {"id":3,"ok":true}
//   {"id":4,"ok":true}
//   {"id":5,"ok":false,"error":{"code":"NOT_FOUND","message":"..."}}
//
// Delegation (a daemon whose hello limits list "recall_timeout_ms"):
// "idle" tells the daemon that no reference of this process uses the lease
// any more, though the process keeps it mapped: the daemon may then count
// the copy as evictable and, when it wants the room, sends the daemon's own
// message
//
//   {"id":0,"ok":true,"recall":17}
//
// which the client answers with "release" (it unmapped the copy first) or
// "use" (busy: a reference came back; the lease is in use again). "use"
// sent unasked says the same of an idle lease revived locally. A recall not
// answered within recall_timeout_ms is taken as "use". Both ops are
// answered {"id":N,"ok":true} (NOT_FOUND for a lease this connection does
// not hold), and a client need not wait for that answer.
//
// Retirement: when a reload or an HTTP unload retires a model, the daemon
// recalls every lease of it that a connection holds, in use or idle, with
//
//   {"id":0,"ok":true,"recall":17,"retired":true}
//
// answered as any recall ("release" or "use"). A client takes no new local
// reference to a retired lease: its references in use keep the copy, and
// the next acquire of the model asks the daemon. A client that does not
// know "retired" answers it as a plain recall.
//
// Recalls of leases in use (a daemon whose hello limits list
// "recall_in_use"): a client that keeps leases after their last local
// reference ends (it delegates) says so with "delegate", right after hello
// and before any other request; answered {"id":N,"ok":true}, and a client
// need not wait for that answer. When an acquire under when_full "fail"
// finds no room, and the copies of such a connection's leases would cover
// what is missing (with the free and the evictable bytes), the daemon
// recalls those leases too, whether or not they were said "idle": a client
// answers "release" when no local reference uses the lease (it may have
// ended before its idle notice went), else "use". The lease keeps its
// copy's bytes in use until "release" arrives. No recall goes out for an
// acquire that their room would not save.
//
// Drains (a daemon whose hello limits list "drain"): when a copy in the
// daemon's store starts draining (an older request for room has waited
// drain_after: docs/serve.md, "Swap scheduling"), a client that reuses
// leases locally must stop, or its new local references would keep the copy
// in use past the drain. A client that does so says "drain", right after
// hello and before any other request but "delegate"; answered
// {"id":N,"ok":true}, and a client need not wait for that answer. The daemon
// then recalls every lease of a draining copy that such a connection holds,
// in use or idle, with
//
//   {"id":0,"ok":true,"recall":17,"drain":true}
//
// answered as a retired recall: "release" when no local reference uses the
// lease, else "use", and then the client takes no new local reference to
// it (its next acquire of the model asks the daemon, where it queues behind
// the drain) and releases it when its last reference ends. Unanswered within
// recall_timeout_ms is "use", as any recall. A connection that did not say
// "drain" never gets one: its local reuse goes on, and the drain waits for
// its lease as for any lease in use.
//
// What a "fail" acquire waits for before it answers CAPACITY: the recalls
// it started (of idle or delegated leases; each bounded by
// recall_timeout_ms, unanswered is "use"), and one more pass of the
// daemon's reads over every connection, so that a release a client had
// sent before this acquire was sent (on its own connection) is read first.
// Then it looks for room again. So an acquire made after another
// process's release call returned finds that room.
//
// Reclaim (a daemon whose hello limits list "reclaim"): after a reconnect
// to a successor (a crash, a takeover), a client re-asserts each lease it
// still maps, with the copy's memfds it kept open. The successor adopts the
// copy when its predecessor created those memfds (its record, or the
// handover, names their device and inode numbers), they are sealed and of
// the recorded sizes, and the header's bytes match; the lease keeps its id
// and its use ("in_use" or "idle") and now belongs to this connection. The
// reply is {"id":7,"ok":true}; anything else is refused, and the
// descriptors are closed: INVALID (not the predecessor's copy, or a lease
// held by another), NOT_FOUND (a lease id this daemon handed out and does
// not hold), CAPACITY (no room to adopt it), BUSY (the connection's lease
// limit), UNAVAILABLE (shutting down). A refused lease is gone: the client
// keeps its mapping, which the successor books as orphaned bytes until it ends.
//
// Takeover (docs/serve.md, handover.h): a new daemon of the daemon's own
// uid asks the running one to hand over. The reply is the handover itself,
// one or more messages {"id":8,"ok":true,"part":K,"more":true|false,
// "chunk":"..."} with descriptors; a refused takeover is an error reply
// (its message says why) and changes nothing. "commit" says the new daemon
// took everything: the old one answers {"id":9,"ok":true}, closes its
// clients (they reconnect and reclaim) and exits. A takeover connection
// that ends before its commit leaves the old daemon serving as before.
//
// An acquire reply's "load" says how the copy was found: "hit" (resident),
// "miss" (this acquire started its load) or "joined" (it waited for a load
// already under way or queued). Optional: a client takes a reply without
// it (an older daemon) as an unknown kind.
//
// An error may carry "cause", the core's code name (weights errors: "io",
// "invalid_data"). UNAVAILABLE carries one when it is the model that is
// unavailable (its files cannot be opened or are not valid; the message
// names the file), and none when it is the daemon (shutting down). A message
// with id 0 is the daemon's own error, not the reply to a request: sent at
// accept before it closes the connection (too many clients, a peer not
// allowed), and for a datagram too large to read or too broken to carry an id,
// after which the connection stays open. A client leaving more than
// max_queued_replies unread is disconnected with no message at all (it would
// not read one). A client takes an id-0 error as news, not as the end: the end
// is EOF.
//
// Both parsers take untrusted bytes and never throw: a request parser
// returns the error reply to send, the reply parser the reason the reply is
// malformed. Neither recurses over the input's nesting.
#ifndef MODELCACHE_SRC_SERVE_PROTOCOL_H_
#define MODELCACHE_SRC_SERVE_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/serve/errors.h"

namespace modelcache::serve::protocol {

inline constexpr uint64_t kVersion = 1;
inline constexpr size_t kMaxMessageBytes = size_t{64} << 10;
inline constexpr size_t kMaxModelIdBytes = 128;
// Two descriptors per file; SCM_MAX_FD is 253.
inline constexpr size_t kMaxFilesPerModel = 100;
inline constexpr uint64_t kDefaultTimeoutMs = 60'000;
// A day: longer waits are surely mistakes.
inline constexpr uint64_t kMaxTimeoutMs = 86'400'000;

// Whether `id` is a model id or alias: 1 to 128 bytes of [A-Za-z0-9._-],
// starting with a letter or digit, without "..". Never a path: no '/'.
bool IsValidModelId(std::string_view id);

// Whether the JSON `text` nests brackets (outside strings) at most
// `max_depth` deep; checked before parsing, so that no parser recurses
// deeper. Does not check that `text` is JSON.
bool NestingAtMost(std::string_view text, int max_depth);

enum class Op {
  kHello,
  kAcquire,
  kRelease,
  kPing,
  kIdle,
  kUse,
  kReclaim,
  kTakeover,
  kCommit,
  kDelegate,
  kDrain
};
const char* OpName(Op op);

struct Request {
  Op op = Op::kPing;
  uint64_t id = 0;
  uint64_t version = kVersion;  // hello
  std::string model;            // acquire
  uint64_t timeout_ms = kDefaultTimeoutMs;
  bool fail_when_full = false;  // acquire: when_full "fail"
  uint64_t lease = 0;           // release, idle, use, reclaim
  bool idle = false;            // reclaim: use "idle"
  uint64_t handover = 0;        // takeover: the handover format's version
  std::string catalog;          // takeover: the catalog's digest
};

struct ParsedRequest {
  std::optional<Request> request;  // set when valid
  // When invalid: the id to answer (0 when none could be read), and why.
  uint64_t id = 0;
  std::string error;
};

// Parses one datagram's bytes. Never throws (std::bad_alloc aside).
ParsedRequest ParseRequest(std::string_view message);

// ---- replies ----

struct FileReply {
  std::string name;
  uint64_t data_bytes = 0;
  uint64_t header_bytes = 0;
};

struct Reply {
  uint64_t id = 0;
  bool ok = false;
  // When !ok:
  ServeCode code = ServeCode::kInvalid;
  std::string message;
  std::string cause;  // the core's code name, when given
  // hello:
  uint64_t version = 0;
  std::string server;
  std::map<std::string, uint64_t> limits;
  // acquire:
  uint64_t lease = 0;
  std::string model;
  std::string load;  // "hit", "miss", "joined"; empty when not given
  std::vector<FileReply> files;
  // The daemon's own message (id 0): recall this lease; 0 when absent.
  uint64_t recall = 0;
  // With a recall: the lease's model was retired (a reload, an unload).
  bool retired = false;
  // With a recall: the lease's copy is draining (said "drain").
  bool drain = false;
};

// A recall as a client reads it (Reply::recall, retired, drain).
struct Recall {
  uint64_t lease = 0;
  bool retired = false;
  bool drain = false;
};

struct ParsedReply {
  std::optional<Reply> reply;
  std::string error;  // when the bytes are not a well-formed reply
};

// Parses one datagram's bytes as a reply. Never throws (bad_alloc aside).
ParsedReply ParseReply(std::string_view message);

// ---- encoders ----

std::string EncodeHello(uint64_t id);
std::string EncodeAcquire(uint64_t id, std::string_view model,
                          uint64_t timeout_ms, bool fail_when_full);
std::string EncodeRelease(uint64_t id, uint64_t lease);
std::string EncodePing(uint64_t id);
std::string EncodeIdle(uint64_t id, uint64_t lease);
std::string EncodeUse(uint64_t id, uint64_t lease);
std::string EncodeReclaim(uint64_t id, uint64_t lease, std::string_view model,
                          bool idle);
std::string EncodeTakeover(uint64_t id, uint64_t handover,
                           std::string_view catalog_digest);
std::string EncodeCommit(uint64_t id);
std::string EncodeDelegate(uint64_t id);
std::string EncodeDrain(uint64_t id);
// The daemon's recall of `lease` (an id-0 message), saying "retired" when
// its model was retired and "drain" when its copy is draining.
std::string EncodeRecall(uint64_t lease, bool retired = false,
                         bool drain = false);

std::string EncodeOk(uint64_t id);
std::string EncodeHelloReply(uint64_t id, std::string_view server,
                             const std::map<std::string, uint64_t>& limits);
// `load`: "hit", "miss" or "joined".
std::string EncodeAcquireReply(uint64_t id, uint64_t lease,
                               std::string_view model, std::string_view load,
                               const std::vector<FileReply>& files);
// `message` may hold any bytes: what is not UTF-8 is replaced.
std::string EncodeError(uint64_t id, ServeCode code, std::string_view message,
                        std::string_view cause = {});

}  // namespace modelcache::serve::protocol

#endif  // MODELCACHE_SRC_SERVE_PROTOCOL_H_
