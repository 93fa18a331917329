// The system side of the drain property (drain_property_test.cc): the calls
// it generates, the values its loaders make, the waiters that run on threads
// of their own, and the core's test hooks that tell where a waiter waits.
#ifndef MODELCACHE_TESTS_CORE_DRAIN_PROPERTY_H_
#define MODELCACHE_TESTS_CORE_DRAIN_PROPERTY_H_

#include <rapidcheck.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../src/core/test_hooks.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"
#include "rc_util.h"

namespace modelcache::drain_property {

enum class Kind {
  kAcquire,  // on the test's thread, WhenFull::kFail
  kWait,     // on a thread of its own, WhenFull::kWait
  kTryAcquire,
  kLookup,
  kRelease,
  kAdvanceClock,
  kPin,
  kUnpin,
  kSetCapacity,
  kCancel,  // interrupts a waiter
  kPrune,
  kCount,
};

constexpr std::array<const char*, static_cast<int>(Kind::kCount)> kKindNames = {
    "Acquire", "Wait",  "TryAcquire",  "Lookup", "Release", "AdvanceClock",
    "Pin",     "Unpin", "SetCapacity", "Cancel", "Prune"};

constexpr int kNames = 4;  // "m0".."m3"
constexpr std::array<uint64_t, 4> kSizes = {20, 40, 60, 110};
constexpr std::array<uint64_t, 3> kCapacities = {60, 100, 140};
constexpr std::array<int64_t, 3> kSteps = {1, 2, 5};               // seconds
constexpr std::array<int64_t, 3> kDrainAfterSeconds = {0, 2, -1};  // -1: never
constexpr size_t kMaxWaiters = 3;

struct Op {
  int kind = 0;
  int name = 0;
  int size = 0;
  int other = 0;  // lease or waiter index, capacity, step
  int fault = 0;  // 0: the loader throws; 1: the unloader throws once

  Kind k() const { return static_cast<Kind>(kind); }
  uint64_t Bytes() const { return kSizes[size]; }
  bool LoaderThrows() const { return fault == 0; }
  bool UnloaderThrows() const { return fault == 1; }
};

inline std::string Name(int i) { return "m" + std::to_string(i); }

inline std::ostream& operator<<(std::ostream& os, const Op& op) {
  os << kKindNames[op.kind] << "(";
  switch (op.k()) {
    case Kind::kAcquire:
    case Kind::kWait:
      os << Name(op.name) << ", " << op.Bytes();
      if (op.LoaderThrows()) os << ", loader throws";
      if (op.UnloaderThrows()) os << ", unloader throws once";
      break;
    case Kind::kRelease:
      os << "lease #" << op.other;
      break;
    case Kind::kCancel:
      os << "waiter #" << op.other;
      break;
    case Kind::kSetCapacity:
      os << kCapacities[op.other % kCapacities.size()];
      break;
    case Kind::kAdvanceClock:
      os << "+" << kSteps[op.other % kSteps.size()] << "s";
      break;
    case Kind::kPrune:
      break;
    default:
      os << Name(op.name);
  }
  return os << ")";
}

}  // namespace modelcache::drain_property

namespace rc {
template <>
struct Arbitrary<modelcache::drain_property::Op> {
  static Gen<modelcache::drain_property::Op> arbitrary() {
    using modelcache::drain_property::Kind;
    using modelcache::drain_property::Op;
    const auto any = modelcache::rc_util::AnyBelow;
    auto kind = [](Kind k) { return gen::just(static_cast<int>(k)); };
    // Waits, hits, releases and clock advances most often: they make
    // waiters, keep the models they need in use, and let drain_after pass.
    return gen::build<Op>(
        gen::set(&Op::kind, gen::weightedOneOf<int>(
                                {{4, kind(Kind::kAcquire)},
                                 {4, kind(Kind::kWait)},
                                 {4, kind(Kind::kTryAcquire)},
                                 {5, kind(Kind::kRelease)},
                                 {3, kind(Kind::kAdvanceClock)},
                                 {4, any(static_cast<int>(Kind::kCount))}})),
        gen::set(&Op::name, any(modelcache::drain_property::kNames)),
        gen::set(&Op::size,
                 gen::weightedOneOf<int>({{8, any(3)}, {1, gen::just(3)}})),
        gen::set(&Op::other, any(9)), gen::set(&Op::fault, any(8)));
  }
};
}  // namespace rc

namespace modelcache::drain_property {

// ---- The system under test's side. ----

// A loaded value. Its unloader throws once when asked to, and flags any
// unload while the test holds a lease on it.
struct Value {
  std::string key;
  std::atomic<bool> fail_once{false};
  std::atomic<int> leases_held{0};  // by the test
  std::atomic<bool> unloaded{false};
  std::atomic<bool> unloaded_while_leased{false};
};

struct Values {
  std::mutex mu;
  std::vector<std::shared_ptr<Value>> all;
  std::array<std::atomic<int>, kNames> loading{};  // loads in flight per key
  std::atomic<bool> concurrent_loads{false};

  std::shared_ptr<Value> Find(const void* p) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& v : all) {
      if (v.get() == p) return v;
    }
    return nullptr;
  }
  std::vector<std::shared_ptr<Value>> Snapshot() {
    std::lock_guard<std::mutex> lock(mu);
    return all;
  }
};

inline Loader MakeLoader(const Op& op, Values* values) {
  return [op, values] {
    std::atomic<int>& loading = values->loading[op.name];
    if (loading.fetch_add(1) != 0) values->concurrent_loads = true;
    struct Done {
      std::atomic<int>* n;
      ~Done() { n->fetch_sub(1); }
    } done{&loading};
    if (op.LoaderThrows()) throw std::runtime_error("load failed");
    auto value = std::make_shared<Value>();
    value->key = Name(op.name);
    value->fail_once = op.UnloaderThrows();
    {
      std::lock_guard<std::mutex> lock(values->mu);
      values->all.push_back(value);
    }
    Value* raw = value.get();
    return Loaded{value, op.Bytes(), [raw] {
                    if (raw->leases_held > 0) raw->unloaded_while_leased = true;
                    if (raw->fail_once.exchange(false)) {
                      throw std::runtime_error("unload failed");
                    }
                    raw->unloaded = true;
                  }};
  };
}

struct Cancelled : std::runtime_error {
  Cancelled() : std::runtime_error("cancelled") {}
};

// A request waiting for room on a thread of its own. The hooks record, by
// a thread-local pointer, where it last went to wait.
struct Waiter {
  enum Where { kRunning = 0, kForRoom = 1, kBehindDrain = 2 };
  int id = 0;
  Op op;
  int64_t arrival = 0;  // fake seconds
  std::atomic<bool> cancel{false};
  std::atomic<bool> done{false};
  std::atomic<int> where{kRunning};
  std::atomic<uint64_t> hooked_at{0};  // the hook sequence number
  std::optional<Lease> lease;
  std::string outcome;
  std::thread thread;
};

inline std::atomic<uint64_t> hook_seq{0};
inline thread_local Waiter* this_waiter = nullptr;

inline void Hooked(int where) {
  if (Waiter* w = this_waiter) {
    w->where = where;
    w->hooked_at = hook_seq.fetch_add(1) + 1;
  }
}
inline void WaitsForRoom() { Hooked(Waiter::kForRoom); }
inline void WaitsBehindDrain() { Hooked(Waiter::kBehindDrain); }

// Installs the hooks for one case.
class HookGuard {
 public:
  HookGuard() {
    detail::reservation_waits_for_room = &WaitsForRoom;
    detail::acquire_waits_behind_drain = &WaitsBehindDrain;
  }
  ~HookGuard() {
    detail::reservation_waits_for_room = nullptr;
    detail::acquire_waits_behind_drain = nullptr;
  }
};

inline std::string Outcome(const std::function<std::string()>& call) {
  try {
    return call();
  } catch (const Error& e) {
    return std::string("Error ") + ErrorCodeName(e.code());
  } catch (const std::runtime_error& e) {
    return std::string("exception: ") + e.what();
  }
}

struct HeldLease {
  uint64_t serial = 0;  // the test's own numbering, for the bound
  Lease lease;
  std::shared_ptr<Value> value;
};

}  // namespace modelcache::drain_property

#endif  // MODELCACHE_TESTS_CORE_DRAIN_PROPERTY_H_
