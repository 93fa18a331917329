// Stateful, model-based property tests of the whole ModelCache API.
//
// rapidcheck generates random sequences of public calls (acquire with
// expected sizes below, equal to and above the real one and above the
// capacity, some growing the capacity as they reserve (grow_capacity);
// lookup; prefetch; release; remove; invalidate; pin; unpin; alias
// calls; capacity changes; prune; expiry with an injected clock; loaders and
// unloaders that throw; event callbacks that throw) and runs each sequence
// against the cache. A failing sequence is shrunk to a minimal one, which
// rapidcheck prints with the seed that reproduces it.
//
//  * ExactAgainstAReferenceModel: one cache, LRU, one shard. A small
//    reference model predicts every outcome (value, error code, exception),
//    the resident and retired records with their sizes, leases and pins, the
//    aliases, every counter, the bytes in use and the capacity, checked
//    after every step.
//  * TwoCachesOnOneBudgetKeepTheInvariants: two caches sharing a budget,
//    under LRU and GDSF, with several shards. Eviction order is not predicted;
//    what must hold whatever the policy is: the budget's bytes equal the
//    caches' books, no admission over capacity, no eviction or unload of a
//    leased or pinned record, and Resolve, Lookup, TryAcquire and Acquire
//    agree.
//
//  * Regression*: the shrunk counterexamples the properties have found,
//    replayed as fixed sequences through the same model and checks.
//
// `make test` runs a bounded number of cases with a fixed seed (RC_PARAMS in
// tests/core/CMakeLists.txt: tens of thousands in the release build);
// `make property` runs many more with a random seed.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"
#include "rc_util.h"

namespace modelcache::property {

enum class Kind {
  kAcquire,
  kLookup,
  kTryAcquire,
  kPrefetch,
  kRelease,
  kRemove,
  kInvalidate,
  kPin,
  kUnpin,
  kAddAlias,
  kRemoveAlias,
  kResolve,
  kSetCapacity,
  kPrune,
  kEvictExpired,
  kAdvanceClock,
  kThrowingCallback,
  kCount,
};

constexpr std::array<const char*, static_cast<int>(Kind::kCount)> kKindNames = {
    "Acquire",         "Lookup",   "TryAcquire",   "Prefetch",
    "Release",         "Remove",   "Invalidate",   "Pin",
    "Unpin",           "AddAlias", "RemoveAlias",  "Resolve",
    "SetCapacity",     "Prune",    "EvictExpired", "AdvanceClock",
    "ThrowingCallback"};

constexpr int kNames = 6;  // "m0".."m5": model keys and alias names alike
constexpr std::array<uint64_t, 6> kSizes = {5, 10, 20, 35, 50, 120};
constexpr std::array<uint64_t, 5> kCapacities = {0, 40, 80, 100, 150};
constexpr std::array<int64_t, 5> kSteps = {1, 10, 29, 31, 60};  // seconds
constexpr int64_t kTtlSeconds = 30;
constexpr uint64_t kOverAnyCapacity = 1000;
constexpr int kNoThrow = 8;  // ThrowingCallback's "stop throwing"

// One public call and its arguments. Fields a kind does not use are ignored.
struct Op {
  int kind = 0;
  int cache = 0;   // which cache, in the two-cache property
  int name = 0;    // the key, or the alias
  int other = 0;   // alias target, lease index, capacity, step or event type
  int size = 0;    // index into kSizes: the real size
  int expect = 0;  // expected bytes: 0 below, 1 equal, 2 above, 3 over all
  int fault = 0;   // 0: the loader throws; 1, 2: the unloader throws so often

  Kind k() const { return static_cast<Kind>(kind); }
  uint64_t Real() const { return kSizes[size]; }
  uint64_t Expected() const {
    switch (expect) {
      case 0:
        return Real() / 2;
      case 1:
        return Real();
      case 2:
        return Real() + 15;
      default:
        return kOverAnyCapacity;
    }
  }
  bool LoaderThrows() const { return fault == 0; }
  // Acquire's AcquireOptions::grow_capacity: none, a little, or more than
  // any reservation (the budget counts at most the reservation's bytes).
  uint64_t Grow() const {
    return other % 3 == 0 ? 0 : other % 3 == 1 ? 15 : kOverAnyCapacity;
  }
  int UnloadFailures() const { return fault == 1 ? 1 : fault == 2 ? 2 : 0; }
};

std::string Name(int i) { return "m" + std::to_string(i); }

std::ostream& operator<<(std::ostream& os, const Op& op) {
  os << kKindNames[op.kind] << "(";
  if (op.cache) os << "cache " << op.cache << ", ";
  switch (op.k()) {
    case Kind::kAcquire:
    case Kind::kPrefetch:
      os << Name(op.name) << ", expected " << op.Expected() << ", real "
         << op.Real();
      if (op.LoaderThrows()) os << ", loader throws";
      if (op.UnloadFailures())
        os << ", unloader throws " << op.UnloadFailures() << "x";
      if (op.k() == Kind::kAcquire && op.Grow())
        os << ", grows the capacity by up to " << op.Grow();
      break;
    case Kind::kRelease:
      os << "lease #" << op.other;
      break;
    case Kind::kAddAlias:
      os << Name(op.name) << " -> " << Name(op.other);
      break;
    case Kind::kSetCapacity:
      os << kCapacities[op.other % kCapacities.size()];
      break;
    case Kind::kAdvanceClock:
      os << "+" << kSteps[op.other % kSteps.size()] << "s";
      break;
    case Kind::kThrowingCallback:
      if (op.other % 9 == kNoThrow) {
        os << "none";
      } else {
        os << EventTypeName(static_cast<EventType>(op.other % 9));
      }
      break;
    case Kind::kPrune:
    case Kind::kEvictExpired:
      break;
    default:
      os << Name(op.name);
  }
  return os << ")";
}

}  // namespace modelcache::property

namespace rc {
template <>
struct Arbitrary<modelcache::property::Op> {
  static Gen<modelcache::property::Op> arbitrary() {
    using modelcache::property::Op;
    // Uniform choices (AnyBelow), with acquires and releases most often: they
    // fill and drain the cache, and without releases every record would stay
    // leased.
    const auto any = modelcache::rc_util::AnyBelow;
    const int kinds = static_cast<int>(modelcache::property::Kind::kCount);
    const int acquire = static_cast<int>(modelcache::property::Kind::kAcquire);
    const int release = static_cast<int>(modelcache::property::Kind::kRelease);
    return gen::build<Op>(
        gen::set(&Op::kind, gen::weightedOneOf<int>({{5, gen::just(acquire)},
                                                     {4, gen::just(release)},
                                                     {8, any(kinds)}})),
        gen::set(&Op::cache, any(2)),
        gen::set(&Op::name, any(modelcache::property::kNames)),
        gen::set(&Op::other, any(9)), gen::set(&Op::size, any(6)),
        gen::set(&Op::expect,
                 gen::weightedOneOf<int>({{6, any(3)}, {1, gen::just(3)}})),
        gen::set(&Op::fault, any(8)));
  }
};
}  // namespace rc

namespace modelcache::property {
namespace {

// What a call did: "ok", a value, or the error it threw.
std::string Outcome(const std::function<std::string()>& call) {
  try {
    return call();
  } catch (const Error& e) {
    return std::string("Error ") + ErrorCodeName(e.code());
  } catch (const std::runtime_error& e) {
    return std::string("exception: ") + e.what();
  }
}

void Expect(bool condition, const std::string& what) {
  if (!condition) RC_FAIL(what);
}

template <typename T>
void ExpectEq(const T& actual, const T& expected, const std::string& what) {
  if (!(actual == expected)) {
    std::ostringstream os;
    os << what << ": got " << ::testing::PrintToString(actual)
       << ", the model says " << ::testing::PrintToString(expected);
    RC_FAIL(os.str());
  }
}

// ---- The system under test's side: models, leases, faults. ----

// A loaded value. Its unloader fails `failures_left` times, then succeeds,
// and flags any unload while the test holds a lease on it.
struct Value {
  std::string key;
  int failures_left = 0;
  int failures = 0;     // unloads that threw
  int leases_held = 0;  // by the test
  bool unloaded_while_leased = false;
};

struct HeldLease {
  Lease lease;
  std::shared_ptr<Value> value;
};

struct EventThrower {
  int throw_on = kNoThrow;
  void operator()(const CacheEvent& event) const {
    if (static_cast<int>(event.type) == throw_on) {
      throw std::runtime_error("callback failed");
    }
  }
};

Loader MakeLoader(const Op& op, const std::string& key,
                  std::vector<std::shared_ptr<Value>>* values) {
  return [op, key, values] {
    if (op.LoaderThrows()) throw std::runtime_error("load failed");
    auto value = std::make_shared<Value>();
    value->key = key;
    value->failures_left = op.UnloadFailures();
    values->push_back(value);
    Value* raw = value.get();
    return Loaded{value, op.Real(), [raw] {
                    if (raw->leases_held > 0) raw->unloaded_while_leased = true;
                    if (raw->failures_left > 0) {
                      --raw->failures_left;
                      ++raw->failures;
                      throw std::runtime_error("unload failed");
                    }
                  }};
  };
}

// ---- The reference model: one cache, exact LRU. ----

struct ModelRecord {
  uint64_t id = 0;
  std::string key;
  uint64_t bytes = 0;
  int leases = 0;
  bool pinned = false;
  uint64_t touched = 0;  // LRU order
  int64_t last_use = 0;  // seconds
  int failures_left = 0;
  bool unload_failed = false;  // retired, unloader threw
};

struct ModelStats {
  uint64_t hits = 0, misses = 0, refused = 0, loads = 0, load_failures = 0,
           evictions = 0, expirations = 0, failed_unloads = 0, removals = 0;
};

class ReferenceModel {
 public:
  uint64_t capacity = 100;
  uint64_t used = 0;
  int64_t now = 1000;
  std::map<std::string, ModelRecord> resident;
  std::vector<ModelRecord> retired;
  std::map<std::string, std::string> aliases;
  std::vector<uint64_t> leases;  // record ids, in the order the test holds them
  ModelStats stats;

  std::string Resolve(const std::string& key) const {
    auto it = aliases.find(key);
    return it == aliases.end() ? key : it->second;
  }

  // Applies `op`; returns its outcome as Outcome() would print it.
  std::string Apply(const Op& op) {
    const std::string key = Name(op.name);
    switch (op.k()) {
      case Kind::kAcquire:
      case Kind::kPrefetch:
        return Acquire(op, op.k() == Kind::kPrefetch);
      case Kind::kLookup:
      case Kind::kTryAcquire: {
        // TryAcquire is Lookup that leaves the miss to the Acquire after.
        auto it = resident.find(Resolve(key));
        if (it == resident.end()) {
          if (op.k() == Kind::kLookup) ++stats.misses;
          return "miss";
        }
        Touch(it->second);
        ++it->second.leases;
        ++stats.hits;
        leases.push_back(it->second.id);
        return "hit " + it->first;
      }
      case Kind::kRelease:
        if (!leases.empty()) Release(op.other % leases.size());
        return "ok";
      case Kind::kRemove:
      case Kind::kInvalidate: {
        auto it = resident.find(Resolve(key));
        if (it == resident.end()) return "not found";
        if (it->second.leases > 0) {
          retired.push_back(it->second);
          resident.erase(it);
          ++stats.removals;
          return "retired";
        }
        if (!TryUnload(it->second)) return "exception: unload failed";
        used -= it->second.bytes;
        resident.erase(it);
        ++stats.removals;
        return "removed";
      }
      case Kind::kPin:
      case Kind::kUnpin: {
        auto it = resident.find(Resolve(key));
        if (it == resident.end()) return "Error not_found";
        const bool now_evictable = it->second.pinned &&
                                   op.k() == Kind::kUnpin &&
                                   it->second.leases == 0;
        it->second.pinned = op.k() == Kind::kPin;
        if (now_evictable) EvictToCapacity();
        return "ok";
      }
      case Kind::kAddAlias: {
        const std::string target = Name(op.other % kNames);
        if (key == target || aliases.count(target) ||
            std::any_of(aliases.begin(), aliases.end(),
                        [&](const auto& a) { return a.second == key; }) ||
            resident.count(key)) {
          return "Error invalid_argument";
        }
        aliases[key] = target;
        return "ok";
      }
      case Kind::kRemoveAlias:
        return aliases.erase(key) ? "true" : "false";
      case Kind::kResolve:
        return Resolve(key);
      case Kind::kSetCapacity:
        capacity = kCapacities[op.other % kCapacities.size()];
        return std::to_string(EvictToCapacity());
      case Kind::kPrune: {
        size_t evicted = 0;
        for (auto it = resident.begin(); it != resident.end();) {
          if (Evictable(it->second) && TryUnload(it->second)) {
            used -= it->second.bytes;
            ++stats.evictions;
            ++evicted;
            it = resident.erase(it);
          } else {
            ++it;
          }
        }
        for (auto it = retired.begin(); it != retired.end();) {
          if (it->unload_failed && it->leases == 0 && TryUnload(*it)) {
            used -= it->bytes;
            it = retired.erase(it);
          } else {
            ++it;
          }
        }
        return std::to_string(evicted);
      }
      case Kind::kEvictExpired:
        return std::to_string(EvictExpired());
      case Kind::kAdvanceClock:
        now += kSteps[op.other % kSteps.size()];
        return "ok";
      case Kind::kThrowingCallback:
      case Kind::kCount:
        return "ok";
    }
    return "ok";
  }

 private:
  static bool Evictable(const ModelRecord& r) {
    return r.leases == 0 && !r.pinned;
  }
  void Touch(ModelRecord& r) {
    r.touched = ++touch_clock_;
    r.last_use = now;
  }
  bool TryUnload(ModelRecord& r) {
    if (r.failures_left > 0) {
      --r.failures_left;
      ++stats.failed_unloads;
      return false;
    }
    return true;
  }
  // Budget::Reserve's eviction: least recently used first, skipping victims
  // whose unload failed, until `bytes` fit. A reservation evicts only while
  // what is evictable can make the room: when it cannot, it returns false
  // and evicts nothing more (a victim whose unloader throws can still turn a
  // feasible reservation into one that fails after evicting).
  bool MakeRoom(uint64_t bytes) {
    std::set<uint64_t> skip;
    for (;;) {
      if (used <= capacity && bytes <= capacity - used) return true;
      uint64_t evictable = 0;
      for (auto& [k, r] : resident) {
        if (Evictable(r) && !skip.count(r.id)) evictable += r.bytes;
      }
      // Sizes here are small: the sum cannot wrap.
      const uint64_t shortfall = used + bytes - capacity;
      if (evictable < shortfall) return false;
      EvictLeastRecentlyUsed(&skip);
    }
  }
  // Budget::EvictToCapacity: evicts whatever it can, in the same order,
  // until usage fits the capacity; returns the bytes still over.
  uint64_t EvictToCapacity() {
    std::set<uint64_t> skip;
    while (used > capacity && EvictLeastRecentlyUsed(&skip)) {
    }
    return used > capacity ? used - capacity : 0;
  }
  // Evicts the least recently used evictable record not in `skip` (or adds
  // it to `skip` when its unloader throws); false when there is none.
  bool EvictLeastRecentlyUsed(std::set<uint64_t>* skip) {
    ModelRecord* victim = nullptr;
    for (auto& [k, r] : resident) {
      if (Evictable(r) && !skip->count(r.id) &&
          (!victim || r.touched < victim->touched)) {
        victim = &r;
      }
    }
    if (!victim) return false;
    if (TryUnload(*victim)) {
      used -= victim->bytes;
      ++stats.evictions;
      resident.erase(victim->key);
    } else {
      skip->insert(victim->id);
    }
    return true;
  }
  size_t EvictExpired() {
    size_t evicted = 0;
    for (auto it = resident.begin(); it != resident.end();) {
      if (Evictable(it->second) && it->second.last_use < now - kTtlSeconds &&
          TryUnload(it->second)) {
        used -= it->second.bytes;
        ++stats.expirations;
        ++evicted;
        it = resident.erase(it);
      } else {
        ++it;
      }
    }
    return evicted;
  }
  std::string Acquire(const Op& op, bool prefetch) {
    const std::string key = Resolve(Name(op.name));
    if (auto it = resident.find(key); it != resident.end()) {
      Touch(it->second);
      ++stats.hits;
      ++it->second.leases;
      leases.push_back(it->second.id);
      if (prefetch) Release(leases.size() - 1);  // Prefetch's own lease
      return prefetch ? "ok" : "hit " + key;
    }
    ++stats.misses;
    EvictExpired();
    const uint64_t expected = op.Expected();
    // grow_capacity: the capacity grows as the reservation is made, and is
    // as it was when the reservation fails (not when the load does).
    const uint64_t grown = prefetch ? 0 : std::min(op.Grow(), expected);
    capacity += grown;
    if (expected > capacity) {
      capacity -= grown;
      ++stats.refused;
      return "Error too_large";
    }
    if (!MakeRoom(expected)) {
      capacity -= grown;
      ++stats.refused;
      return "Error capacity";
    }
    used += expected;
    if (op.LoaderThrows()) {
      used -= expected;
      ++stats.load_failures;
      return "exception: load failed";
    }
    const uint64_t real = op.Real();
    if (real > expected) {
      const uint64_t extra = real - expected;
      if (extra > capacity || expected > capacity - extra) {
        used -= expected;
        ++stats.refused;
        return "Error too_large";
      }
      if (!MakeRoom(extra)) {
        used -= expected;
        ++stats.refused;
        return "Error capacity";
      }
      used += extra;
    } else {
      used -= expected - real;
    }
    ModelRecord r;
    r.id = next_id_++;
    r.key = key;
    r.bytes = real;
    r.failures_left = op.UnloadFailures();
    Touch(r);
    ++stats.loads;
    r.leases = 1;
    leases.push_back(r.id);
    resident[key] = r;
    if (prefetch) {
      Release(leases.size() - 1);
      return "ok";
    }
    return "loaded " + key;
  }
  void Release(size_t index) {
    const uint64_t id = leases[index];
    leases.erase(leases.begin() + index);
    for (auto& [k, r] : resident) {
      if (r.id != id) continue;
      if (--r.leases == 0) {
        r.last_use = now;
        if (!r.pinned) EvictToCapacity();
      }
      return;
    }
    for (auto it = retired.begin(); it != retired.end(); ++it) {
      if (it->id != id) continue;
      if (--it->leases == 0) {
        if (TryUnload(*it)) {
          used -= it->bytes;
          retired.erase(it);
        } else {
          it->unload_failed = true;
        }
        // The end of a last lease, retired or not, is when a budget over a
        // shrunken capacity evicts again (Budget::SetCapacity).
        EvictToCapacity();
      }
      return;
    }
    RC_FAIL("the model lost a leased record");
  }

  uint64_t touch_clock_ = 0;
  uint64_t next_id_ = 1;
};

// Runs `op` against `cache`, holding the leases it returns in `held`.
// With `ranked_prefetches`, every other Prefetch may evict only entries ranked
// below its key (AcquireOptions::evict_only_lower_ranked).
std::string RunOp(const Op& op, ModelCache& cache, std::vector<HeldLease>* held,
                  std::vector<std::shared_ptr<Value>>* values,
                  EventThrower* thrower, std::atomic<int64_t>* now,
                  bool ranked_prefetches = false) {
  const std::string key = Name(op.name);
  auto hold = [&](Lease lease) {
    std::shared_ptr<Value> value;
    for (const auto& v : *values) {
      if (v.get() == lease.value()) value = v;
    }
    if (!value) RC_FAIL("a lease on a value no loader made");
    ++value->leases_held;
    held->push_back({std::move(lease), value});
  };
  return Outcome([&]() -> std::string {
    switch (op.k()) {
      case Kind::kAcquire: {
        AcquireOptions options;
        options.grow_capacity = op.Grow();
        Lease lease =
            cache.Acquire(key, op.Expected(),
                          MakeLoader(op, cache.Resolve(key), values), options);
        const std::string k = lease.key();
        hold(std::move(lease));
        return k;
      }
      case Kind::kPrefetch: {
        AcquireOptions options;
        options.evict_only_lower_ranked = ranked_prefetches && op.other % 2;
        cache.Prefetch(key, op.Expected(),
                       MakeLoader(op, cache.Resolve(key), values), options);
        return "ok";
      }
      case Kind::kLookup:
      case Kind::kTryAcquire: {
        auto lease =
            op.k() == Kind::kLookup ? cache.Lookup(key) : cache.TryAcquire(key);
        if (!lease) return "miss";
        const std::string k = lease->key();
        hold(std::move(*lease));
        return "hit " + k;
      }
      case Kind::kRelease:
        if (!held->empty()) {
          const size_t index = op.other % held->size();
          HeldLease h = std::move((*held)[index]);
          held->erase(held->begin() + index);
          --h.value->leases_held;
          h.lease.Release();
        }
        return "ok";
      case Kind::kRemove:
      case Kind::kInvalidate: {
        const RemoveOutcome outcome =
            op.k() == Kind::kRemove ? cache.Remove(key) : cache.Invalidate(key);
        switch (outcome) {
          case RemoveOutcome::kNotFound:
            return "not found";
          case RemoveOutcome::kRemoved:
            return "removed";
          case RemoveOutcome::kRetired:
            return "retired";
        }
        return "?";
      }
      case Kind::kPin:
        cache.Pin(key);
        return "ok";
      case Kind::kUnpin:
        cache.Unpin(key);
        return "ok";
      case Kind::kAddAlias:
        cache.AddAlias(key, Name(op.other % kNames));
        return "ok";
      case Kind::kRemoveAlias:
        return cache.RemoveAlias(key) ? "true" : "false";
      case Kind::kResolve:
        return cache.Resolve(key);
      case Kind::kSetCapacity:
        return std::to_string(
            cache.SetCapacity(kCapacities[op.other % kCapacities.size()]));
      case Kind::kPrune:
        return std::to_string(cache.Prune());
      case Kind::kEvictExpired:
        return std::to_string(cache.EvictExpired());
      case Kind::kAdvanceClock:
        *now += kSteps[op.other % kSteps.size()];
        return "ok";
      case Kind::kThrowingCallback:
        thrower->throw_on = op.other % 9;
        return "ok";
      case Kind::kCount:
        break;
    }
    return "ok";
  });
}

// The model's outcome in RunOp's words: RunOp reports an acquire by its key.
std::string Normalise(const Op& op, const std::string& outcome) {
  if (op.k() == Kind::kAcquire) {
    if (outcome.rfind("hit ", 0) == 0) return outcome.substr(4);
    if (outcome.rfind("loaded ", 0) == 0) return outcome.substr(7);
  }
  return outcome;
}

std::string Describe(const EntryInfo& e) {
  std::ostringstream os;
  os << e.key << ":" << EntryStateName(e.state) << ":" << e.bytes
     << "B:" << e.leases << "L" << (e.pinned ? ":pinned" : "");
  return os.str();
}

// ---- Property 1: exact against the reference model. ----

void RunAgainstReferenceModel(const std::vector<Op>& ops) {
  std::atomic<int64_t> now{1000};
  auto thrower = std::make_shared<EventThrower>();
  std::vector<std::shared_ptr<Value>> values;
  std::vector<HeldLease> held;
  ReferenceModel model;
  {
    ModelCache cache(
        {.name = "property",
         .capacity_bytes = model.capacity,
         .idle_ttl = std::chrono::seconds(kTtlSeconds),
         .now =
             [&now] {
               return Clock::time_point(std::chrono::seconds(now.load()));
             },
         .shard_bits = 0,
         .on_event = [thrower](const CacheEvent& e) { (*thrower)(e); }});
    for (size_t step = 0; step < ops.size(); ++step) {
      const Op& op = ops[step];
      const std::string where =
          "step " + std::to_string(step) + " " + ::testing::PrintToString(op);
      const std::string actual =
          RunOp(op, cache, &held, &values, thrower.get(), &now);
      const std::string expected = Normalise(op, model.Apply(op));
      ExpectEq(actual, expected, where + ": outcome");

      // Records, leases and pins.
      std::vector<std::string> sut_entries, model_entries;
      for (const EntryInfo& e : cache.Entries())
        sut_entries.push_back(Describe(e));
      for (const auto& [k, r] : model.resident) {
        model_entries.push_back(Describe(EntryInfo{
            k, EntryState::kResident, r.bytes, r.leases, 0, r.pinned}));
      }
      for (const ModelRecord& r : model.retired) {
        model_entries.push_back(Describe(EntryInfo{
            r.key, EntryState::kRetired, r.bytes, r.leases, 0, r.pinned}));
      }
      std::sort(sut_entries.begin(), sut_entries.end());
      std::sort(model_entries.begin(), model_entries.end());
      ExpectEq(sut_entries, model_entries, where + ": entries");
      ExpectEq(held.size(), model.leases.size(), where + ": leases held");

      // Bytes: the budget, the cache's own books and the model agree.
      ExpectEq(cache.budget().used(), model.used, where + ": budget used");
      ExpectEq(cache.CheckInvariants(), model.used, where + ": books");
      ExpectEq(cache.budget().capacity(), model.capacity, where + ": capacity");

      // Counters.
      const CacheStats s = cache.Stats();
      const ModelStats& m = model.stats;
      ExpectEq(
          std::vector<uint64_t>{s.hits, s.misses, s.refused, s.loads,
                                s.load_failures, s.evictions, s.expirations,
                                s.failed_unloads, s.removals},
          std::vector<uint64_t>{m.hits, m.misses, m.refused, m.loads,
                                m.load_failures, m.evictions, m.expirations,
                                m.failed_unloads, m.removals},
          where +
              ": stats (hits, misses, refused, loads, load_failures, "
              "evictions, expirations, failed_unloads, removals)");

      // Names.
      for (int i = 0; i < kNames; ++i) {
        ExpectEq(cache.Resolve(Name(i)), model.Resolve(Name(i)),
                 where + ": Resolve(" + Name(i) + ")");
      }
      for (const auto& v : values) {
        Expect(!v->unloaded_while_leased,
               where + ": '" + v->key + "' was unloaded while leased");
      }
    }
    for (HeldLease& h : held) h.lease.Release();
    held.clear();
  }
}

RC_GTEST_PROP(CacheProperty, ExactAgainstAReferenceModel,
              (const std::vector<Op>& ops)) {
  RunAgainstReferenceModel(ops);
}

// ---- Property 2: two caches on one budget, any policy. ----

class TwoCaches {
 public:
  TwoCaches(std::shared_ptr<const EvictionPolicy> policy,
            std::atomic<int64_t>* now, EventThrower* thrower)
      : budget_(std::make_shared<Budget>(100, "shared")) {
    for (int i = 0; i < 2; ++i) {
      caches_.push_back(std::make_unique<ModelCache>(CacheOptions{
          .name = "cache" + std::to_string(i),
          .budget = budget_,
          .policy = policy,
          .idle_ttl = std::chrono::seconds(kTtlSeconds),
          .now =
              [now] {
                return Clock::time_point(std::chrono::seconds(now->load()));
              },
          .shard_bits = 2,
          .on_event = [thrower](const CacheEvent& e) { (*thrower)(e); }}));
    }
  }
  ~TwoCaches() {
    for (auto& h : held_) h.clear();
    caches_.clear();
  }

  void Step(const Op& op, const std::string& where, std::atomic<int64_t>* now,
            EventThrower* thrower) {
    ModelCache& cache = *caches_[op.cache];
    const std::string key = Name(op.name);
    const std::string resolved = cache.Resolve(key);
    std::vector<HeldLease>& held = held_[op.cache];
    auto unload_failures = [&] {
      int n = 0;
      for (const auto& v : values_) n += v->failures;
      return n;
    };
    auto loads = [&] {
      uint64_t n = 0;
      for (auto& c : caches_) n += c->Stats().loads;
      return n;
    };
    auto evictions = [&] {
      uint64_t n = 0;
      for (auto& c : caches_) n += c->Stats().evictions;
      return n;
    };
    const int failures_before = unload_failures();
    const uint64_t loads_before = loads();
    const uint64_t evictions_before = evictions();
    // The record a Release lets go of: if that ends its last lease while
    // usage is over capacity, usage must come back within capacity (unless
    // the record is resident and pinned, which makes nothing evictable).
    // Keys name records only while they are resident: a retired record
    // shares its key with the resident one loaded after it, so the lease's
    // value says which record it is.
    std::string released_key;
    bool ends_last_lease = false;
    if (op.k() == Kind::kRelease && !held.empty()) {
      const HeldLease& h = held[op.other % held.size()];
      released_key = h.lease.key();
      ends_last_lease =
          std::count_if(held.begin(), held.end(), [&](const HeldLease& o) {
            return o.value == h.value;
          }) == 1;
    }
    const std::string outcome = RunOp(op, cache, &held, &values_, thrower, now,
                                      /*ranked_prefetches=*/true);

    // Resolve, Lookup and Acquire agree on the key a name stands for.
    if (op.k() == Kind::kAcquire && outcome.rfind("Error", 0) != 0 &&
        outcome.rfind("exception", 0) != 0) {
      ExpectEq(outcome, resolved, where + ": Acquire's key vs Resolve");
    }
    const bool lookup = op.k() == Kind::kLookup || op.k() == Kind::kTryAcquire;
    if (lookup && outcome != "miss") {
      ExpectEq(outcome, "hit " + resolved, where + ": Lookup's key vs Resolve");
    }
    if (lookup && outcome == "miss") {
      auto entry = cache.Entry(key);
      Expect(!entry || entry->state != EntryState::kResident,
             where + ": Lookup missed a resident record");
    }
    if (op.k() == Kind::kPin && outcome == "ok")
      pinned_[op.cache].insert(resolved);
    if (op.k() == Kind::kUnpin && outcome == "ok")
      pinned_[op.cache].erase(resolved);
    if ((op.k() == Kind::kRemove || op.k() == Kind::kInvalidate) &&
        (outcome == "removed" || outcome == "retired")) {
      pinned_[op.cache].erase(resolved);
    }

    // The budget's bytes are exactly the caches' books.
    uint64_t books = 0;
    for (auto& c : caches_) books += c->CheckInvariants();
    ExpectEq(budget_->used(), books, where + ": budget used vs books");

    // Leases and pins hold their records; nothing leased was unloaded.
    bool evictable = false;
    for (int c = 0; c < 2; ++c) {
      std::map<std::string, int> leases_by_key, expected_by_key;
      for (const EntryInfo& e : caches_[c]->Entries()) {
        leases_by_key[e.key] += e.leases;
        if (e.state == EntryState::kResident && e.leases == 0 && !e.pinned) {
          evictable = true;
        }
      }
      for (const HeldLease& h : held_[c]) ++expected_by_key[h.lease.key()];
      ExpectEq(leases_by_key.size() >= expected_by_key.size(), true,
               where + ": a leased record is gone");
      for (const auto& [k, n] : expected_by_key) {
        ExpectEq(leases_by_key[k], n, where + ": leases on '" + k + "'");
      }
      for (const std::string& k : pinned_[c]) {
        auto entry = caches_[c]->Entry(k);
        Expect(entry && entry->pinned,
               where + ": pinned '" + k + "' is no longer resident");
      }
    }
    // After a call that must bring usage back within capacity (SetCapacity,
    // or a release that made a record evictable), it is over only if nothing
    // was evictable, or an unload failed on the way.
    bool must_fit = op.k() == Kind::kSetCapacity;
    if (ends_last_lease) {
      const auto entry = cache.Entry(released_key);
      must_fit = !(entry && entry->state == EntryState::kResident &&
                   entry->leases == 0 && entry->pinned);
    }
    if (must_fit && budget_->used() > budget_->capacity() && evictable) {
      Expect(unload_failures() > failures_before,
             where + ": over capacity with an evictable record");
    }
    for (const auto& v : values_) {
      Expect(!v->unloaded_while_leased,
             where + ": '" + v->key + "' was unloaded while leased");
    }
    // A request refused for capacity evicted nothing, in either cache. (An
    // unloader that throws midway can still leave a reservation short; and a
    // model larger than expected is refused by its second reservation, after
    // the first one made room for the expected size.)
    if ((op.k() == Kind::kAcquire || op.k() == Kind::kPrefetch) &&
        outcome == "Error capacity" && op.Real() <= op.Expected() &&
        unload_failures() == failures_before) {
      ExpectEq(evictions(), evictions_before,
               where + ": evictions by a refused request");
    }
    // Admission never overshoots: after a load, usage is within capacity.
    if (loads() > loads_before) {
      Expect(budget_->used() <= budget_->capacity(),
             where + ": a load was admitted over capacity");
    }
  }

 private:
  std::shared_ptr<Budget> budget_;
  std::vector<std::shared_ptr<Value>> values_;
  std::vector<std::unique_ptr<ModelCache>> caches_;
  std::array<std::vector<HeldLease>, 2> held_;
  std::array<std::set<std::string>, 2> pinned_;
};

void RunTwoCaches(std::shared_ptr<const EvictionPolicy> policy,
                  const std::vector<Op>& ops) {
  std::atomic<int64_t> now{1000};
  auto thrower = std::make_shared<EventThrower>();
  TwoCaches caches(std::move(policy), &now, thrower.get());
  for (size_t step = 0; step < ops.size(); ++step) {
    caches.Step(ops[step],
                "step " + std::to_string(step) + " " +
                    ::testing::PrintToString(ops[step]),
                &now, thrower.get());
  }
}

RC_GTEST_PROP(CacheProperty, TwoCachesOnOneBudgetKeepTheInvariantsUnderLru,
              (const std::vector<Op>& ops)) {
  RunTwoCaches(NewLruPolicy(), ops);
}

RC_GTEST_PROP(CacheProperty, TwoCachesOnOneBudgetKeepTheInvariantsUnderGdsf,
              (const std::vector<Op>& ops)) {
  RunTwoCaches(NewGdsfPolicy(), ops);
}

// next-use ranks at eviction time from request histories kept across
// evictions: the same invariants must hold.
RC_GTEST_PROP(CacheProperty, TwoCachesOnOneBudgetKeepTheInvariantsUnderNextUse,
              (const std::vector<Op>& ops)) {
  RunTwoCaches(NewNextUsePolicy(), ops);
}

// ---- Regressions: counterexamples `make property` found, replayed. ----

// Each sequence is a shrunk counterexample exactly as rapidcheck printed it;
// the comments give the printed form and the step that failed.

int K(Kind kind) { return static_cast<int>(kind); }
constexpr int kNoFault = 3;  // neither the loader nor the unloader throws

using rc_util::ExpectPasses;

// SetCapacity(0), Acquire(m5, expected 10, real 10, unloader throws 2x, grows
// the capacity by up to 15), Release(lease #5), Acquire(m2, expected 5, real
// 5, unloader throws 2x, grows the capacity by up to 1000), Prefetch(m0,
// expected 10, real 20), Release(lease #7), SetCapacity(cache 1, 0),
// Acquire(cache 1, m0, expected 1000, real 10, grows the capacity by up to
// 1000), Acquire(m2, expected 20, real 5, unloader throws 2x, grows the
// capacity by up to 15), Release(lease #3)
// -> step 9: m2 stayed resident over a capacity of 0: the failed growing
// reservation at step 7 had let a release judge usage against its room.
TEST(CacheProperty, RegressionFailedGrowingReservationThenRelease) {
  ExpectPasses([] {
    RunAgainstReferenceModel({
        {.kind = K(Kind::kSetCapacity), .other = 0},
        {.kind = K(Kind::kAcquire),
         .name = 5,
         .other = 1,
         .size = 1,
         .expect = 1,
         .fault = 2},
        {.kind = K(Kind::kRelease), .other = 5},
        {.kind = K(Kind::kAcquire),
         .name = 2,
         .other = 2,
         .size = 0,
         .expect = 1,
         .fault = 2},
        {.kind = K(Kind::kPrefetch),
         .name = 0,
         .size = 2,
         .expect = 0,
         .fault = kNoFault},
        {.kind = K(Kind::kRelease), .other = 7},
        {.kind = K(Kind::kSetCapacity), .cache = 1, .other = 0},
        {.kind = K(Kind::kAcquire),
         .cache = 1,
         .name = 0,
         .other = 2,
         .size = 1,
         .expect = 3,
         .fault = kNoFault},
        {.kind = K(Kind::kAcquire),
         .name = 2,
         .other = 1,
         .size = 0,
         .expect = 2,
         .fault = 2},
        {.kind = K(Kind::kRelease), .other = 3},
    });
  });
}

// Acquire(cache 1, m2, expected 17, real 35, grows the capacity by up to 15),
// Invalidate(cache 1, m2), Acquire(cache 1, m2, expected 5, real 5, unloader
// throws 1x, grows the capacity by up to 1000), Release(cache 1, lease #3),
// Acquire(m5, expected 135, real 120, unloader throws 1x, grows the capacity
// by up to 1000), SetCapacity(100), Release(cache 1, lease #4)
// -> step 6: over capacity with an evictable record: the retired m2's last
// lease ended, and the idle m2 whose unloader threw at step 5 stayed.
std::vector<Op> RetiredReleaseOverCapacity() {
  return {
      {.kind = K(Kind::kAcquire),
       .cache = 1,
       .name = 2,
       .other = 1,
       .size = 3,
       .expect = 0,
       .fault = kNoFault},
      {.kind = K(Kind::kInvalidate), .cache = 1, .name = 2},
      {.kind = K(Kind::kAcquire),
       .cache = 1,
       .name = 2,
       .other = 2,
       .size = 0,
       .expect = 1,
       .fault = 1},
      {.kind = K(Kind::kRelease), .cache = 1, .other = 3},
      {.kind = K(Kind::kAcquire),
       .name = 5,
       .other = 2,
       .size = 5,
       .expect = 2,
       .fault = 1},
      {.kind = K(Kind::kSetCapacity), .other = 3},
      {.kind = K(Kind::kRelease), .cache = 1, .other = 4},
  };
}

TEST(CacheProperty, RegressionRetiredReleaseOverCapacityUnderLru) {
  ExpectPasses(
      [] { RunTwoCaches(NewLruPolicy(), RetiredReleaseOverCapacity()); });
}
TEST(CacheProperty, RegressionRetiredReleaseOverCapacityUnderGdsf) {
  ExpectPasses(
      [] { RunTwoCaches(NewGdsfPolicy(), RetiredReleaseOverCapacity()); });
}
TEST(CacheProperty, RegressionRetiredReleaseOverCapacityUnderNextUse) {
  ExpectPasses(
      [] { RunTwoCaches(NewNextUsePolicy(), RetiredReleaseOverCapacity()); });
}

// The same sequence against the reference model, where both caches are one.
TEST(CacheProperty, RegressionRetiredReleaseOverCapacityExact) {
  ExpectPasses([] { RunAgainstReferenceModel(RetiredReleaseOverCapacity()); });
}

}  // namespace
}  // namespace modelcache::property
