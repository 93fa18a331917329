// HAProxy 2.6's choice of server per `balance` algorithm (see cluster.h for
// the routes and where they were read).
//
// Round robin (lb_fwrr.c) and leastconn (lb_fwlc.c) keep their servers in
// eb32 trees, which return equal keys in the order they were inserted; a
// Tree here is a set of (key, insertion number, server), so that its first
// element is the tree's eb32_first. A server has a tree it belongs to (the
// C code's lb_tree) and may be linked in it or not (the C code dequeues a
// server, then queues it again, sometimes into another tree): TreeNode
// keeps both, and Remove unlinks without forgetting the tree.
//
// The arithmetic follows the C types: fwrr's positions and weights of a
// server are unsigned, its group's counters int, and C converts an int to
// unsigned where the two meet; so does uint32_t arithmetic here.
#include <algorithm>
#include <cassert>
#include <string>

#include "modelcache/base/errors.h"
#include "modelcache/replay/cluster.h"

namespace modelcache::replay {
namespace {

// HAProxy's weights: a server's effective weight is 16 x its weight
// (BE_WEIGHT_SCALE), at most 4096 (SRV_EWGHT_MAX); user weights range over
// 256 (SRV_UWGHT_RANGE).
constexpr uint32_t kWeightScale = kPointsPerWeight;
constexpr uint32_t kEweightMax = 256 * kWeightScale;
constexpr uint32_t kUweightRange = 256;

[[noreturn]] void BadRoute(std::string_view text, const std::string& why) {
  throw Error(ErrorCode::kInvalidArgument,
              "route '" + std::string(text) + "': " + why +
                  " (routes: roundrobin, random, p2c, leastconn, chash, "
                  "chash-bl:F with F a whole number above 100, chash-map)");
}

}  // namespace

std::string Route::name() const {
  switch (kind) {
    case RouteKind::kRoundRobin:
      return "roundrobin";
    case RouteKind::kRandom:
      return "random";
    case RouteKind::kP2c:
      return "p2c";
    case RouteKind::kLeastConn:
      return "leastconn";
    case RouteKind::kChash:
      return "chash";
    case RouteKind::kChashBoundedLoad:
      return "chash-bl:" + std::to_string(balance_factor);
    case RouteKind::kChashMap:
      return "chash-map";
  }
  return "?";
}

bool Route::hashed() const {
  return kind == RouteKind::kChash || kind == RouteKind::kChashBoundedLoad ||
         kind == RouteKind::kChashMap;
}

Route ParseRoute(std::string_view text) {
  Route route;
  if (text == "roundrobin") {
    route.kind = RouteKind::kRoundRobin;
  } else if (text == "random") {
    route.kind = RouteKind::kRandom;
  } else if (text == "p2c") {
    route.kind = RouteKind::kP2c;
  } else if (text == "leastconn") {
    route.kind = RouteKind::kLeastConn;
  } else if (text == "chash") {
    route.kind = RouteKind::kChash;
  } else if (text == "chash-map") {
    route.kind = RouteKind::kChashMap;
  } else if (text.substr(0, 9) == "chash-bl:" || text == "chash-bl") {
    route.kind = RouteKind::kChashBoundedLoad;
    const std::string_view factor =
        text.size() > 9 ? text.substr(9) : std::string_view{};
    if (factor.empty()) BadRoute(text, "the balance factor F is missing");
    if (factor.size() > 10 ||
        !std::all_of(factor.begin(), factor.end(),
                     [](char c) { return c >= '0' && c <= '9'; })) {
      BadRoute(text, "the balance factor '" + std::string(factor) +
                         "' is not a whole number");
    }
    route.balance_factor = std::stoll(std::string(factor));
    try {
      ValidateBalanceFactor(route.balance_factor);
    } catch (const Error& e) {
      BadRoute(text, e.what());
    }
    if (route.balance_factor == 0) {
      BadRoute(text, "a balance factor of 0 is plain chash");
    }
  } else {
    BadRoute(text, "unknown route");
  }
  return route;
}

Router::Router(std::vector<RingServer> servers, Route route, uint64_t seed)
    : servers_(std::move(servers)), route_(route), random_(seed) {
  ValidateRingServers(servers_);
  ValidateBalanceFactor(route_.balance_factor);
  const size_t n = servers_.size();
  up_.resize(n);
  for (size_t i = 0; i < n; ++i) up_[i] = !servers_[i].down_at_start;
  in_flight_.assign(n, 0);
  nodes_.resize(n);
  switch (route_.kind) {
    case RouteKind::kChash:
    case RouteKind::kRandom:
    case RouteKind::kP2c:
      ring_.emplace(servers_, 0);
      break;
    case RouteKind::kChashBoundedLoad:
      ring_.emplace(servers_, route_.balance_factor);
      break;
    case RouteKind::kChashMap:
      map_.emplace(servers_);
      break;
    case RouteKind::kRoundRobin:
      FwrrInit();
      break;
    case RouteKind::kLeastConn:
      // fwlc_init_server_tree: the usable servers, in order.
      for (size_t i = 0; i < n; ++i) {
        if (up_[i]) Insert(0, static_cast<uint32_t>(i), FwlcKey(i));
      }
      break;
  }
}

size_t Router::IndexOf(std::string_view name) const {
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (servers_[i].name == name) return i;
  }
  return kNone;
}

uint32_t Router::Key(std::string_view model) const {
  return HaproxySampleKey(model,
                          /*avalanche=*/route_.kind != RouteKind::kChashMap);
}

uint64_t Router::total_in_flight() const {
  uint64_t total = 0;
  for (const uint32_t n : in_flight_) total += n;
  return total;
}

size_t Router::up_count() const {
  return static_cast<size_t>(std::count(up_.begin(), up_.end(), true));
}

uint32_t Router::Eweight(size_t index) const {
  return static_cast<uint32_t>(servers_[index].weight) * kWeightScale;
}

size_t Router::Pick(uint32_t key, size_t avoid) {
  if (up_count() == 0) return kNone;
  switch (route_.kind) {
    case RouteKind::kChash:
    case RouteKind::kChashBoundedLoad:
      return ring_->Select(key, in_flight_, avoid);
    case RouteKind::kChashMap:
      // map_get_server_hash takes no server to avoid: a retry goes to the
      // same server.
      return map_->Select(key);
    case RouteKind::kRandom:
      return RandomNext(avoid, 1);
    case RouteKind::kP2c:
      return RandomNext(avoid, 2);
    case RouteKind::kRoundRobin:
      return FwrrNext(avoid);
    case RouteKind::kLeastConn:
      return FwlcNext(avoid);
  }
  return kNone;
}

size_t Router::Owner(uint32_t key) const {
  switch (route_.kind) {
    case RouteKind::kChash:
    case RouteKind::kChashBoundedLoad:
      return ring_->Owner(key);
    case RouteKind::kChashMap:
      return map_->Select(key);
    default:
      return kNone;
  }
}

void Router::Took(size_t index) {
  ++in_flight_[index];
  if (route_.kind == RouteKind::kLeastConn) {
    FwlcReposition(static_cast<uint32_t>(index));
  }
}

void Router::Released(size_t index) {
  assert(in_flight_[index] > 0);
  --in_flight_[index];
  if (route_.kind == RouteKind::kLeastConn) {
    FwlcReposition(static_cast<uint32_t>(index));
  }
}

void Router::SetDown(size_t index) {
  if (!up_[index]) return;
  up_[index] = false;
  const auto s = static_cast<uint32_t>(index);
  switch (route_.kind) {
    case RouteKind::kChash:
    case RouteKind::kChashBoundedLoad:
    case RouteKind::kRandom:
    case RouteKind::kP2c:
      ring_->SetDown(index);
      break;
    case RouteKind::kChashMap:
      map_->SetDown(index);
      break;
    case RouteKind::kRoundRobin:
      FwrrDown(s);
      break;
    case RouteKind::kLeastConn:
      // fwlc_set_server_status_down: dequeued, out of the tree.
      Remove(s);
      nodes_[s].tree = -1;
      break;
  }
}

void Router::SetUp(size_t index) {
  if (up_[index]) return;
  up_[index] = true;
  const auto s = static_cast<uint32_t>(index);
  switch (route_.kind) {
    case RouteKind::kChash:
    case RouteKind::kChashBoundedLoad:
    case RouteKind::kRandom:
    case RouteKind::kP2c:
      ring_->SetUp(index);
      break;
    case RouteKind::kChashMap:
      map_->SetUp(index);
      break;
    case RouteKind::kRoundRobin:
      FwrrUp(s);
      break;
    case RouteKind::kLeastConn:
      Insert(0, s, FwlcKey(s));
      break;
  }
}

// ---- eb32 trees ----

void Router::Insert(int tree, uint32_t server, uint32_t key) {
  TreeNode& node = nodes_[server];
  assert(node.tree < 0 ||
         !TreeAt(node.tree).count({node.key, node.order, server}));
  node.tree = tree;
  node.key = key;
  node.order = ++inserted_;
  TreeAt(tree).insert({key, node.order, server});
}

void Router::Remove(uint32_t server) {
  TreeNode& node = nodes_[server];
  if (node.tree < 0) return;
  TreeAt(node.tree).erase({node.key, node.order, server});
}

std::optional<uint32_t> Router::First(int tree) const {
  const Tree& t = trees_[static_cast<size_t>(tree)];
  if (t.empty()) return std::nullopt;
  return std::get<2>(*t.begin());
}

// ---- fwrr: lb_fwrr.c ----

void Router::FwrrInit() {
  fwrr_.assign(servers_.size(), FwrrServer{});
  int32_t total = 0;
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (up_[i]) total += static_cast<int32_t>(Eweight(i));
  }
  curr_pos_ = curr_weight_ = next_weight_ = total;
  fwrr_init_ = 0;
  fwrr_next_ = 1;
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (up_[i]) FwrrQueueByWeight(fwrr_init_, static_cast<uint32_t>(i));
  }
}

void Router::FwrrQueueByWeight(int tree, uint32_t s) {
  Insert(tree, s, kEweightMax - Eweight(s));
}

void Router::FwrrQueue(uint32_t s) {
  FwrrServer& f = fwrr_[s];
  const uint32_t eweight = Eweight(s);
  if (!up_[s]) {
    nodes_[s].tree = -1;
  } else if (f.npos >= 2 * static_cast<uint32_t>(curr_weight_) ||
             f.npos >= static_cast<uint32_t>(curr_weight_ + next_weight_)) {
    // Beyond this window: into the next tree.
    f.npos -= static_cast<uint32_t>(curr_weight_);
    FwrrQueueByWeight(fwrr_next_, s);
  } else {
    const uint32_t key = kUweightRange * f.npos +
                         (kEweightMax + f.rweight - eweight) / kWeightScale;
    Insert(kCurr, s, key);
  }
}

void Router::FwrrGetSrv(uint32_t s) {
  FwrrServer& f = fwrr_[s];
  const int tree = nodes_[s].tree;
  if (tree == fwrr_init_) {
    f.npos = f.rweight = 0;
  } else if (tree == fwrr_next_) {
    f.npos += static_cast<uint32_t>(curr_weight_);
  } else if (tree < 0) {
    f.npos = static_cast<uint32_t>(curr_pos_);
  }
}

void Router::FwrrSwitchTrees() {
  std::swap(fwrr_init_, fwrr_next_);
  curr_weight_ = next_weight_;
  curr_pos_ = curr_weight_;
}

std::optional<uint32_t> Router::FwrrFromGroup() {
  const std::optional<uint32_t> s1 = First(kCurr);
  if (s1 && fwrr_[*s1].npos <= static_cast<uint32_t>(curr_pos_)) return s1;
  // A hole, or nothing left: a server waiting to be placed, if any.
  if (const std::optional<uint32_t> s2 = First(fwrr_init_)) {
    fwrr_[*s2].npos = fwrr_[*s2].rweight = 0;
    return s2;
  }
  return s1;
}

void Router::FwrrUpdatePosition(uint32_t s) {
  FwrrServer& f = fwrr_[s];
  const uint32_t eweight = Eweight(s);
  if (f.npos == 0) f.npos = static_cast<uint32_t>(curr_pos_);  // first time
  f.lpos = f.npos;
  f.npos += static_cast<uint32_t>(next_weight_) / eweight;
  f.rweight += static_cast<uint32_t>(next_weight_) % eweight;
  if (f.rweight >= eweight) {
    f.rweight -= eweight;
    ++f.npos;
  }
}

size_t Router::FwrrNext(size_t avoid) {
  bool switched = false;
  std::optional<uint32_t> avoided;
  std::vector<uint32_t> full;  // extracted and avoided, in order
  std::optional<uint32_t> srv;
  bool take = true;
  for (;;) {
    if (curr_weight_ == 0) curr_pos_ = curr_weight_ = next_weight_;
    for (;;) {
      srv = FwrrFromGroup();
      if (srv) break;
      if (switched) {
        if (avoided) {
          srv = avoided;
        } else {
          take = false;
        }
        goto done;
      }
      switched = true;
      FwrrSwitchTrees();
    }
    FwrrUpdatePosition(*srv);
    Remove(*srv);
    ++curr_pos_;
    if (*srv != avoid || avoided) break;
    avoided = srv;
    full.push_back(*srv);
  }
done:
  if (take) FwrrQueue(*srv);
  // Requeue what was extracted; the C code chains them newest first.
  for (auto it = full.rbegin(); it != full.rend(); ++it) {
    if (srv && *it == *srv) continue;
    if (switched) {
      FwrrQueueByWeight(fwrr_init_, *it);
    } else {
      FwrrQueue(*it);
    }
  }
  return take ? *srv : kNone;
}

void Router::FwrrDown(uint32_t s) {
  next_weight_ -= static_cast<int32_t>(Eweight(s));
  Remove(s);
  nodes_[s].tree = -1;
}

void Router::FwrrUp(uint32_t s) {
  const uint32_t eweight = Eweight(s);
  next_weight_ += static_cast<int32_t>(eweight);
  FwrrGetSrv(s);
  fwrr_[s].npos =
      static_cast<uint32_t>(curr_pos_) +
      static_cast<uint32_t>(next_weight_ + curr_weight_ - curr_pos_) / eweight;
  FwrrQueue(s);
}

// ---- fwlc: lb_fwlc.c ----

uint32_t Router::FwlcKey(uint32_t s) const {
  const uint32_t in_flight = in_flight_[s];
  return in_flight ? (in_flight + 1) * kEweightMax / Eweight(s) : 0;
}

void Router::FwlcReposition(uint32_t s) {
  TreeNode& node = nodes_[s];
  if (node.tree < 0) return;  // down: out of the tree
  const uint32_t key = FwlcKey(s);
  if (node.key == key) return;
  Remove(s);
  Insert(0, s, key);
}

size_t Router::FwlcNext(size_t avoid) {
  std::optional<uint32_t> avoided;
  for (const auto& [key, order, s] : trees_[0]) {
    if (s != avoid) return s;
    avoided = s;
  }
  return avoided ? *avoided : kNone;
}

// ---- random and p2c: get_server_rnd ----

size_t Router::RandomNext(size_t avoid, int draws) {
  size_t curr = kNone;
  do {
    const size_t prev = curr;
    const auto hash = static_cast<uint32_t>(random_() >> 32);
    curr = ring_->Select(hash, {}, avoid);
    if (curr == kNone) break;
    // The one with fewer requests in flight per weight; the new draw on a
    // tie (unsigned products, as in C).
    if (prev != kNone && prev != curr &&
        in_flight_[curr] * Eweight(prev) > in_flight_[prev] * Eweight(curr)) {
      curr = prev;
    }
  } while (--draws > 0);
  return curr;
}

}  // namespace modelcache::replay
