// HAProxy 2.6's consistent hash ring and map-based hash (see ring.h for what
// is reproduced and where it was read).
//
// Invariants of ConsistentHashRing:
// - ring_ holds exactly the points of the servers up now, 16·weight each,
//   sorted by key; keys are distinct (ValidateRingServers refuses ids equal
//   modulo 2^20, and full_hash is a bijection).
// - total_weight_ is the sum of 16·weight over the servers up now.
// - cumulative_ never changes after construction.
// The arithmetic is HAProxy's, in 32 bits: its counters and weights are
// `int` and `unsigned`, and it builds with -fwrapv, so where a product
// overflows it wraps, and so does ours.
#include "modelcache/replay/ring.h"

#include <algorithm>
#include <cassert>
#include <numeric>
#include <string>
#include <unordered_map>

#include "modelcache/base/errors.h"

namespace modelcache::replay {

namespace {

// HAProxy's SRV_EWGHT_RANGE: SRV_UWGHT_RANGE (256) × BE_WEIGHT_SCALE (16).
constexpr uint32_t kIdStride = 256 * kPointsPerWeight;

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

size_t FindByName(const std::vector<RingServer>& servers,
                  std::string_view name) {
  for (size_t i = 0; i < servers.size(); ++i) {
    if (servers[i].name == name) return i;
  }
  return ConsistentHashRing::kNone;
}

}  // namespace

uint32_t HaproxyFullHash(uint32_t a) {
  a = (a + 0x7ed55d16u) + (a << 12);
  a = (a ^ 0xc761c23cu) ^ (a >> 19);
  a = (a + 0x165667b1u) + (a << 5);
  a = (a + 0xd3a2646cu) ^ (a << 9);
  a = (a + 0xfd7046c5u) + (a << 3);
  a = (a ^ 0xb55a4f09u) ^ (a >> 16);
  // "ensure values are better spread all around the tree by multiplying by
  // a large prime close to 3/4 of the tree" (an odd factor: still a
  // bijection).
  return a * 3221225473u;
}

uint32_t HaproxySdbm(std::string_view bytes) {
  uint32_t hash = 0;
  for (const char ch : bytes) {
    const uint32_t c = static_cast<unsigned char>(ch);
    hash = c + (hash << 6) + (hash << 16) - hash;
  }
  return hash;
}

uint32_t HaproxySampleKey(std::string_view sample, bool avalanche) {
  const uint32_t hash = HaproxySdbm(sample);
  return avalanche ? HaproxyFullHash(hash) : hash;
}

void ValidateRingServers(const std::vector<RingServer>& servers) {
  if (servers.empty()) Invalid("no servers");
  std::unordered_map<std::string_view, size_t> names;
  // id modulo 2^20 -> index: equal residues give equal points.
  std::unordered_map<uint32_t, size_t> residues;
  for (size_t i = 0; i < servers.size(); ++i) {
    const RingServer& s = servers[i];
    if (s.name.empty()) {
      Invalid("server " + std::to_string(i + 1) + " has an empty name");
    }
    if (!names.emplace(s.name, i).second) {
      Invalid("server name '" + s.name + "' is used twice");
    }
    if (s.id < 1 || s.id > kMaxRingServerId) {
      Invalid("server '" + s.name + "' has id " + std::to_string(s.id) +
              ", outside HAProxy's 1-" + std::to_string(kMaxRingServerId));
    }
    if (s.weight < kMinRingWeight || s.weight > kMaxRingWeight) {
      Invalid("server '" + s.name + "' has weight " + std::to_string(s.weight) +
              ", outside " + std::to_string(kMinRingWeight) + "-" +
              std::to_string(kMaxRingWeight));
    }
    const uint32_t residue = static_cast<uint32_t>(s.id) & ((1u << 20) - 1);
    auto [it, inserted] = residues.emplace(residue, i);
    if (!inserted) {
      const RingServer& other = servers[it->second];
      if (other.id == s.id) {
        Invalid("server id " + std::to_string(s.id) + " is used by '" +
                other.name + "' and '" + s.name + "'");
      }
      Invalid("servers '" + other.name + "' (id " + std::to_string(other.id) +
              ") and '" + s.name + "' (id " + std::to_string(s.id) +
              ") would share their ring points: HAProxy places point j at "
              "id*4096+j in 32 bits, so ids must differ modulo 1048576");
    }
  }
}

void ValidateBalanceFactor(int64_t hash_balance_factor) {
  if (hash_balance_factor == 0) return;
  if (hash_balance_factor <= 100 || hash_balance_factor > 2147483647) {
    Invalid("hash-balance-factor " + std::to_string(hash_balance_factor) +
            " must be 0 (off) or more than 100 (and at most 2147483647)");
  }
}

// ---- ConsistentHashRing ----

ConsistentHashRing::ConsistentHashRing(std::vector<RingServer> servers,
                                       int64_t hash_balance_factor)
    : servers_(std::move(servers)), balance_factor_(hash_balance_factor) {
  ValidateRingServers(servers_);
  ValidateBalanceFactor(balance_factor_);
  up_.resize(servers_.size());
  cumulative_.resize(servers_.size(), 0);
  // recount_servers() at start-up, in declaration order; a server down then
  // keeps the 0 it was allocated with.
  uint32_t running = 0;
  for (size_t i = 0; i < servers_.size(); ++i) {
    up_[i] = !servers_[i].down_at_start;
    if (!up_[i]) continue;
    cumulative_[i] = running;
    running += static_cast<uint32_t>(servers_[i].weight) * kPointsPerWeight;
  }
  Rebuild();
}

size_t ConsistentHashRing::IndexOf(std::string_view name) const {
  return FindByName(servers_, name);
}

size_t ConsistentHashRing::up_count() const {
  return static_cast<size_t>(std::count(up_.begin(), up_.end(), true));
}

void ConsistentHashRing::SetDown(size_t index) {
  assert(index < servers_.size());
  if (!up_[index]) return;
  up_[index] = false;
  Rebuild();
}

void ConsistentHashRing::SetUp(size_t index) {
  assert(index < servers_.size());
  if (up_[index]) return;
  up_[index] = true;
  Rebuild();
}

void ConsistentHashRing::Rebuild() {
  ring_.clear();
  total_weight_ = 0;
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (!up_[i]) continue;
    const uint32_t points =
        static_cast<uint32_t>(servers_[i].weight) * kPointsPerWeight;
    total_weight_ += points;  // the effective weight equals the points
    const uint32_t base = static_cast<uint32_t>(servers_[i].id) * kIdStride;
    for (uint32_t j = 0; j < points; ++j) {
      ring_.push_back({HaproxyFullHash(base + j), static_cast<uint32_t>(i)});
    }
  }
  std::sort(ring_.begin(), ring_.end(),
            [](const Point& a, const Point& b) { return a.key < b.key; });
  assert(std::adjacent_find(ring_.begin(), ring_.end(),
                            [](const Point& a, const Point& b) {
                              return a.key == b.key;
                            }) == ring_.end());
}

uint32_t ConsistentHashRing::Slots(size_t index,
                                   uint64_t total_in_flight) const {
  assert(up_[index]);
  // tot_slots = ((px->served + 1) * hash_balance_factor + 99) / 100, in
  // `int` (wrapping), stored in an unsigned.
  const uint32_t served = static_cast<uint32_t>(total_in_flight);
  const int32_t product = static_cast<int32_t>(
      (served + 1u) * static_cast<uint32_t>(balance_factor_) + 99u);
  const uint32_t tot_slots = static_cast<uint32_t>(product / 100);
  const uint32_t tot_weight = total_weight_;
  const uint32_t slots_per_weight = tot_slots / tot_weight;
  const uint32_t remainder = tot_slots % tot_weight;
  const uint32_t eweight =
      static_cast<uint32_t>(servers_[index].weight) * kPointsPerWeight;
  const uint32_t cumulative = cumulative_[index];
  uint32_t slots = eweight * slots_per_weight;
  slots += ((cumulative + eweight) * remainder) / tot_weight -
           (cumulative * remainder) / tot_weight;
  return slots == 0 ? 1 : slots;
}

bool ConsistentHashRing::IsEligible(size_t index,
                                    std::span<const uint32_t> in_flight) const {
  assert(in_flight.empty() || in_flight.size() == servers_.size());
  uint64_t total = 0;
  for (const uint32_t n : in_flight) total += n;
  const uint32_t served = in_flight.empty() ? 0 : in_flight[index];
  return served < Slots(index, total);
}

size_t ConsistentHashRing::Select(uint32_t key,
                                  std::span<const uint32_t> in_flight,
                                  size_t avoid) const {
  assert(in_flight.empty() || in_flight.size() == servers_.size());
  if (ring_.empty()) return kNone;
  // HAProxy hashes nothing when one server is up (the key becomes 0); every
  // point is then that server's, so the key does not matter.

  // The first point >= key (wrapping to the first), and its predecessor
  // (wrapping to the last).
  const auto ge =
      std::lower_bound(ring_.begin(), ring_.end(), key,
                       [](const Point& p, uint32_t k) { return p.key < k; });
  size_t next = ge == ring_.end() ? 0 : static_cast<size_t>(ge - ring_.begin());
  const size_t prev = next == 0 ? ring_.size() - 1 : next - 1;
  const uint32_t dp = key - ring_[prev].key;
  const uint32_t dn = ring_[next].key - key;
  if (dp <= dn) next = prev;
  size_t chosen = ring_[next].server;

  if (avoid == kNone && balance_factor_ == 0) return chosen;

  uint64_t total = 0;
  for (const uint32_t n : in_flight) total += n;
  const auto eligible = [&](size_t s) {
    if (balance_factor_ == 0) return true;
    const uint32_t served = in_flight.empty() ? 0 : in_flight[s];
    return served < Slots(s, total);
  };
  // chash_get_server_hash's walk: on to the next point until one's server
  // is neither avoided nor saturated; the second wrap-around ends it, with
  // the server of the last (highest) point kept.
  int wraps = 0;
  while (chosen == avoid || !eligible(chosen)) {
    ++next;
    if (next == ring_.size()) {
      next = 0;
      if (++wraps > 1) break;
    }
    chosen = ring_[next].server;
  }
  return chosen;
}

// ---- MapBasedHash ----

MapBasedHash::MapBasedHash(std::vector<RingServer> servers)
    : servers_(std::move(servers)) {
  ValidateRingServers(servers_);
  up_.resize(servers_.size());
  // init_server_map(): the weights over their gcd, once, all servers.
  int gcd = 0;
  for (const RingServer& s : servers_) gcd = std::gcd(gcd, s.weight);
  for (size_t i = 0; i < servers_.size(); ++i) {
    up_[i] = !servers_[i].down_at_start;
    effective_.push_back(static_cast<uint32_t>(servers_[i].weight / gcd));
  }
  Rebuild();
}

size_t MapBasedHash::IndexOf(std::string_view name) const {
  return FindByName(servers_, name);
}

void MapBasedHash::SetDown(size_t index) {
  assert(index < servers_.size());
  if (!up_[index]) return;
  up_[index] = false;
  Rebuild();
}

void MapBasedHash::SetUp(size_t index) {
  assert(index < servers_.size());
  if (up_[index]) return;
  up_[index] = true;
  Rebuild();
}

void MapBasedHash::Rebuild() {
  // recalc_server_map().
  int64_t tot = 0;
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (up_[i]) tot += effective_[i];
  }
  table_.assign(static_cast<size_t>(tot), 0);
  std::vector<int64_t> score(servers_.size(), 0);
  for (int64_t o = 0; o < tot; ++o) {
    size_t best = kNone;
    int64_t max = 0;
    for (size_t i = 0; i < servers_.size(); ++i) {
      if (!up_[i]) continue;
      if (tot == 1) {  // HAProxy avoids its division here
        best = i;
        break;
      }
      score[i] += effective_[i];
      const int64_t v = (score[i] + tot) / tot;  // truncates, as C does
      if (best == kNone || v > max) {
        max = v;
        best = i;
      }
    }
    table_[static_cast<size_t>(o)] = static_cast<uint32_t>(best);
    score[best] -= tot;
  }
}

size_t MapBasedHash::Select(uint32_t key) const {
  if (table_.empty()) return kNone;
  return table_[key % table_.size()];
}

}  // namespace modelcache::replay
