// HAProxy 2.6's choice of server for `balance hash <sample>`: the consistent
// hash ring (`hash-type consistent`, with or without `hash-balance-factor`)
// and the map-based hash (`hash-type map-based`), reproduced exactly, so that
// a replay's placement can be compared request by request with what HAProxy
// does in front of real nodes.
//
// What HAProxy 2.6 does, as read in its src/lb_chash.c, src/lb_map.c,
// src/backend.c (recount_servers, get_server_expr), src/hash.c,
// include/haproxy/intops.h and src/cfgparse*.c, and as checked against
// Debian's 2.6.12 binary by tests/replay/haproxy_ring_test.cc:
//
// - Key. `balance hash path,field(4,/)` hashes the raw bytes of `{id}` in
//   `/v1/models/{id}/infer` (no decoding) with sdbm. The bare
//   `hash-type consistent` then applies the avalanche step (full_hash: Bob
//   Jenkins' 32-bit integer hash, then a product with 3221225473);
//   `hash-type consistent sdbm` does not, nor does `hash-type map-based`
//   unless `avalanche` is written after the function.
// - Points. A server with id p (its `id`, or the position HAProxy numbered it
//   with) and weight w has 16·w points, point j at full_hash(p·4096 + j) in
//   32-bit arithmetic. full_hash is a bijection, so two servers share a point
//   only when their ids are equal modulo 2^20; ValidateRingServers refuses
//   that.
// - Lookup. The first point >= the key and its predecessor, both wrapping
//   around the ring; the nearer one (32-bit distances) wins, a tie goes to the
//   predecessor.
// - Bounded load (F = hash-balance-factor, 0 or more than 100). With P the
//   backend's requests in flight (on every server, down ones included; not
//   counting this one), tot = ((P+1)·F + 99) / 100. Server s gets floor((c_s +
//   e_s)·tot / T) - floor(c_s·tot / T) slots, at least 1, where e_s is its
//   effective weight (16·w), T the sum of the effective weights of the servers
//   up now, and c_s its cumulative weight: the sum of e over the servers
//   declared before it that were up when HAProxy started. s is eligible while
//   its requests in flight are fewer than its slots. The lookup's point is kept
//   if its server is eligible; otherwise the walk goes clockwise, point by
//   point, to the first point whose server is eligible (and is not the server
//   to avoid). When it passes the end of the ring a second time (every point
//   seen, none fit), it stops at the highest point of the ring, whose server is
//   chosen whatever its load, even the server to avoid. The arithmetic is
//   HAProxy's 32 bits, which wrap for very large backends (ring.cc).
// - Staleness. HAProxy computes the cumulative weights once, at start-up;
//   a server that goes down or comes back afterwards (a health check, the
//   stats socket) changes T and the points, never c. A server down at
//   start-up (`disabled`) has c = 0 for good.
// - Map-based. The weights are divided by their greatest common divisor
//   (over all servers, once, at start-up). The map has one slot per unit of
//   the up servers' weight, T in all, filled in T rounds of a smooth
//   weighted round robin in declaration order (each round adds every up
//   server's weight to its score, takes the first server with the highest
//   (score + T) / T and subtracts T from its score). The key's server is
//   map[key % T]. A change of state rebuilds the map, so most keys move.
//
// Not modelled: backup servers, slowstart, `hash-key` (HAProxy 2.9+), weight
// changes at run time, and a server's maxconn queue.
#ifndef MODELCACHE_REPLAY_RING_H_
#define MODELCACHE_REPLAY_RING_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace modelcache::replay {

// ---- HAProxy's hash functions ----

// full_hash(): Bob Jenkins' 32-bit avalanche integer hash, times 3221225473.
uint32_t HaproxyFullHash(uint32_t a);

// hash_sdbm() over the raw bytes.
uint32_t HaproxySdbm(std::string_view bytes);

// The key HAProxy hashes a sample to with sdbm: full_hash(sdbm(sample)) with
// the avalanche step (the bare `hash-type consistent`), sdbm(sample) without
// (`hash-type consistent sdbm`, `hash-type map-based`).
uint32_t HaproxySampleKey(std::string_view sample, bool avalanche);

// ---- servers ----

// The range HAProxy accepts for a server's `weight` (0 too, which we refuse:
// such a server never receives a request) and its `id`.
inline constexpr int kMinRingWeight = 1;
inline constexpr int kMaxRingWeight = 256;
inline constexpr int64_t kMaxRingServerId = 2147483647;  // INT_MAX
// HAProxy's BE_WEIGHT_SCALE: points per unit of weight, and the effective
// weight per unit of weight.
inline constexpr uint32_t kPointsPerWeight = 16;

// A server of a backend, as its `server` line declares it.
struct RingServer {
  std::string name;  // `server <name>`
  int64_t id = 0;    // `id <id>`: 1..kMaxRingServerId
  int weight = 1;    // `weight <w>`: kMinRingWeight..kMaxRingWeight
  // `disabled`: down when HAProxy starts (so its cumulative weight is 0).
  bool down_at_start = false;
};

// Throws modelcache::Error kInvalidArgument naming the problem: no servers,
// an empty name, a duplicate name or id, an id or weight out of range, two
// ids equal modulo 2^20 (their points would coincide), or a
// hash_balance_factor that HAProxy refuses (1..100).
void ValidateRingServers(const std::vector<RingServer>& servers);
void ValidateBalanceFactor(int64_t hash_balance_factor);

// ---- the consistent hash ring (`hash-type consistent`) ----
//
// Servers are referred to by their index in the vector given at
// construction, which is their declaration order (the order of `server`
// lines; it decides the bounded-load shares). A ring is a value: copy it to
// branch a what-if. Not thread-safe for mutation; const calls may run
// concurrently.
class ConsistentHashRing {
 public:
  static constexpr size_t kNone = static_cast<size_t>(-1);

  // hash_balance_factor: 0 (off) or more than 100. Throws as
  // ValidateRingServers and ValidateBalanceFactor do.
  explicit ConsistentHashRing(std::vector<RingServer> servers,
                              int64_t hash_balance_factor = 0);

  size_t size() const { return servers_.size(); }
  const RingServer& server(size_t index) const { return servers_[index]; }
  const std::vector<RingServer>& servers() const { return servers_; }
  // The index of the server named `name`, or kNone.
  size_t IndexOf(std::string_view name) const;
  int64_t balance_factor() const { return balance_factor_; }

  bool is_up(size_t index) const { return up_[index]; }
  size_t up_count() const;
  // T: the effective weights of the servers up now.
  uint32_t total_effective_weight() const { return total_weight_; }
  // c_s: fixed at construction (see the top of this file).
  uint32_t cumulative_weight(size_t index) const { return cumulative_[index]; }

  // HAProxy's set_server_status_down / _up: the server's points leave or
  // rejoin the ring and T changes; cumulative weights do not. Idempotent.
  // REQUIRES: index < size().
  void SetDown(size_t index);
  void SetUp(size_t index);

  // The server a request with key `key` goes to, or kNone when every server
  // is down (HAProxy answers 503).
  //
  // in_flight: empty (no load), or one count per server index: the requests
  // each server is serving now, servers down included (their sum is the
  // backend's P). Used only when the balance factor is not 0.
  // avoid: a server to skip, as HAProxy's redispatch skips the server that
  // failed (it is still chosen when the walk finds nothing else), or kNone.
  // REQUIRES: in_flight is empty or has size() entries.
  size_t Select(uint32_t key, std::span<const uint32_t> in_flight = {},
                size_t avoid = kNone) const;

  // The server that owns `key` with no load and nothing avoided.
  size_t Owner(uint32_t key) const { return Select(key); }

  // chash_server_is_eligible: whether `index` may take one more request
  // given the requests in flight (as for Select), and its slot count.
  // REQUIRES: the server is up.
  bool IsEligible(size_t index, std::span<const uint32_t> in_flight) const;
  uint32_t Slots(size_t index, uint64_t total_in_flight) const;

  // The ring now: (point, server index) sorted by point, for tests and
  // reports.
  struct Point {
    uint32_t key;
    uint32_t server;
  };
  const std::vector<Point>& points() const { return ring_; }

 private:
  void Rebuild();

  std::vector<RingServer> servers_;
  int64_t balance_factor_;
  std::vector<bool> up_;
  std::vector<uint32_t> cumulative_;
  uint32_t total_weight_ = 0;
  std::vector<Point> ring_;
};

// ---- the map-based hash (`hash-type map-based`) ----
class MapBasedHash {
 public:
  static constexpr size_t kNone = ConsistentHashRing::kNone;

  // Throws as ValidateRingServers does.
  explicit MapBasedHash(std::vector<RingServer> servers);

  size_t size() const { return servers_.size(); }
  const RingServer& server(size_t index) const { return servers_[index]; }
  size_t IndexOf(std::string_view name) const;
  bool is_up(size_t index) const { return up_[index]; }

  // The map is rebuilt at every change of state. Idempotent.
  void SetDown(size_t index);
  void SetUp(size_t index);

  // map[key % T], or kNone when every server is down.
  size_t Select(uint32_t key) const;

  // The map: server indices, T entries.
  const std::vector<uint32_t>& table() const { return table_; }

 private:
  void Rebuild();

  std::vector<RingServer> servers_;
  std::vector<bool> up_;
  std::vector<uint32_t> effective_;  // weight / gcd of all weights
  std::vector<uint32_t> table_;
};

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_RING_H_
