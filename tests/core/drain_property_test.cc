// Stateful property test of swap scheduling (budget.h, "Who waits"): random
// sequences of calls against one cache whose budget drains after a
// drain_after drawn per case from {0, 2 s, kDrainNever}, under a fake clock
// that only an AdvanceClock step moves.
//
// Requests that wait for room (WhenFull::kWait) run on threads of their own,
// so that waiters exist while the other steps run: hits, releases, clock
// advances, pins, capacity changes, loaders and unloaders that throw, and
// cancellations of a waiter (through its WaitInterrupt). After every step the
// test settles: it wakes the budget's waiters (ClockAdvanced) and waits,
// through the core's test hooks (reservation_waits_for_room,
// acquire_waits_behind_drain), until every waiter has finished or has looked
// again and gone back to waiting, and nothing changed in a whole round. No
// sleeps: a waiter whose turn has come and that never finishes fails the
// case after a generous real-time limit.
//
// The model tracks the waiters' arrival order, the leases the test holds and
// the clock, and checks after every step:
//   * the bound: once the oldest waiter has waited drain_after and the
//     leases out when its drain began have ended, it is served by the end of
//     that step (outside the bound: pinned room, unloaders that throw);
//   * who drains: only models of an overtaken waiter's drain (one that has
//     waited drain_after), never with kDrainNever, never pinned, and no more
//     than its shortfall needs;
//   * a draining model takes no lease: TryAcquire and Lookup miss it, an
//     Acquire of it queues, and its lease count never grows;
//   * arrival order: the budget's oldest waiter is the model's, and a
//     request queued behind a drain keeps its arrival when it waits for room
//     afterwards;
//   * a waiter that evicting idle models could serve does not wait (when no
//     drain runs);
//   * every old invariant: a lease in use is never unloaded, one load per
//     key, the budget's bytes are the cache's books and every loaded value
//     not unloaded is in the cache, a refused request evicts nothing, and a
//     failed unload keeps its record resident.
#include "drain_property.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"
#include "rc_util.h"

namespace modelcache::drain_property {
namespace {

using std::chrono::seconds;

void Expect(bool condition, const std::string& what) {
  if (!condition) RC_FAIL(what);
}

// Real time a step may take to settle before the case fails: generous, for
// the sanitizer builds; only a waiter that never gets its turn reaches it.
constexpr auto kSettleLimit = seconds(30);

// ---- One case. ----

class DrainCase {
 public:
  explicit DrainCase(int drain_after_choice)
      : drain_after_s_(kDrainAfterSeconds[drain_after_choice]),
        cache_(
            {.name = "property",
             .capacity_bytes = 100,
             .now = [this] { return Clock::time_point(seconds(now_.load())); },
             .shard_bits = 0,
             .drain_after =
                 drain_after_s_ < 0
                     ? kDrainNever
                     : std::chrono::nanoseconds(seconds(drain_after_s_))}) {}

  ~DrainCase() {
    // Ends every wait, then lets go of every lease.
    for (auto& w : waiters_) w->cancel = true;
    for (auto& w : waiters_) {
      if (w->thread.joinable()) w->thread.join();
    }
    waiters_.clear();
    held_.clear();
  }

  void Step(const Op& op, const std::string& where) {
    where_ = where;
    const std::string key = Name(op.name);
    const std::optional<EntryInfo> before = cache_.Entry(key);
    const CacheStats stats_before = cache_.Stats();
    const uint64_t drains_before = cache_.budget().drains();
    std::string outcome = "skipped";

    switch (op.k()) {
      case Kind::kAcquire: {
        // On the test's thread: only where it cannot block (a draining
        // model queues its acquires; a key a waiter loads joins that load).
        if (HasWaiter(op.name) ||
            (before &&
             (before->draining || before->state != EntryState::kResident))) {
          break;
        }
        outcome = Outcome([&]() -> std::string {
          Lease lease =
              cache_.Acquire(key, op.Bytes(), MakeLoader(op, &values_));
          Hold(std::move(lease));
          return "ok";
        });
        break;
      }
      case Kind::kWait:
        if (HasWaiter(op.name) || waiters_.size() >= kMaxWaiters ||
            (before && before->state != EntryState::kResident)) {
          break;
        }
        StartWaiter(op);
        outcome = "started";
        break;
      case Kind::kTryAcquire:
      case Kind::kLookup: {
        auto lease = op.k() == Kind::kLookup ? cache_.Lookup(key)
                                             : cache_.TryAcquire(key);
        outcome = lease ? "hit" : "miss";
        if (lease) Hold(std::move(*lease));
        if (before && before->draining) {
          Expect(!lease, where + ": a draining model took a lease");
        }
        if (before && before->state == EntryState::kResident &&
            !before->draining) {
          Expect(lease.has_value(),
                 where + ": missed a resident model that does not drain");
        }
        break;
      }
      case Kind::kRelease:
        if (!held_.empty()) {
          const size_t i = op.other % held_.size();
          HeldLease h = std::move(held_[i]);
          held_.erase(held_.begin() + i);
          --h.value->leases_held;
          h.lease.Release();
          outcome = "ok";
        }
        break;
      case Kind::kAdvanceClock:
        now_ += kSteps[op.other % kSteps.size()];
        cache_.budget().ClockAdvanced();
        outcome = "ok";
        break;
      case Kind::kPin:
      case Kind::kUnpin:
        if (HasWaiter(op.name)) break;  // a record loading: Pin may wait
        outcome = Outcome([&]() -> std::string {
          if (op.k() == Kind::kPin) {
            cache_.Pin(key);
          } else {
            cache_.Unpin(key);
          }
          return "ok";
        });
        break;
      case Kind::kSetCapacity:
        outcome = std::to_string(
            cache_.SetCapacity(kCapacities[op.other % kCapacities.size()]));
        break;
      case Kind::kCancel:
        if (!waiters_.empty()) {
          // It ends at its next check (or is served first): wait for that,
          // so that what its end changes belongs to this step.
          Waiter& w = *waiters_[op.other % waiters_.size()];
          w.cancel = true;
          const auto give_up = std::chrono::steady_clock::now() + kSettleLimit;
          while (!w.done) {
            if (std::chrono::steady_clock::now() > give_up) {
              RC_FAIL(where + ": a cancelled waiter never ended");
            }
            std::this_thread::yield();
          }
          outcome = "ok";
        }
        break;
      case Kind::kPrune:
        outcome = std::to_string(cache_.Prune());
        break;
      case Kind::kCount:
        break;
    }

    // The arrivals of the waiters this step began with or started: a drain
    // may begin for one that is served before the step ends.
    std::vector<int64_t> arrivals;
    for (const auto& w : waiters_) arrivals.push_back(w->arrival);
    Settle();
    const CacheStats stats = cache_.Stats();
    // A request refused for capacity evicted nothing (waiters were asleep
    // meanwhile, and an unloader that throws can still waste an eviction).
    if (op.k() == Kind::kAcquire && outcome == "Error capacity" &&
        stats.failed_unloads == stats_before.failed_unloads) {
      Expect(stats.evictions == stats_before.evictions,
             where + ": a refused request evicted");
    }
    CheckInvariants();
    CheckDrains(drains_before, arrivals,
                (op.k() == Kind::kWait || op.k() == Kind::kAdvanceClock) &&
                    stats.load_failures == stats_before.load_failures);
    CheckBound();
  }

  // For the case's classification: how much of the rule it exercised.
  uint64_t drains() { return cache_.budget().drains(); }
  uint64_t queued_behind_drain() {
    return cache_.budget().queued_behind_drain();
  }
  int bound_met() const { return bound_met_; }

 private:
  bool HasWaiter(int name) const {
    return std::any_of(waiters_.begin(), waiters_.end(),
                       [&](const auto& w) { return w->op.name == name; });
  }

  void Hold(Lease lease) {
    std::shared_ptr<Value> value = values_.Find(lease.value());
    if (!value) RC_FAIL(where_ + ": a lease on a value no loader made");
    ++value->leases_held;
    held_.push_back({next_serial_++, std::move(lease), std::move(value)});
  }

  void StartWaiter(const Op& op) {
    auto w = std::make_unique<Waiter>();
    w->id = next_waiter_++;
    w->op = op;
    w->arrival = now_.load();
    Waiter* raw = w.get();
    AcquireOptions options;
    options.when_full = WhenFull::kWait;
    options.interrupt.check = [raw] {
      if (raw->cancel) throw Cancelled();
    };
    options.interrupt.every = std::chrono::milliseconds(1);
    Loader loader = MakeLoader(op, &values_);
    w->thread = std::thread([this, raw, options, loader] {
      this_waiter = raw;
      raw->outcome = Outcome([&]() -> std::string {
        raw->lease = cache_.Acquire(Name(raw->op.name), raw->op.Bytes(), loader,
                                    options);
        return "ok";
      });
      this_waiter = nullptr;
      raw->done = true;
    });
    waiters_.push_back(std::move(w));
  }

  // Where a waiter stands once it went back to waiting after `mark`: for
  // room, or behind a model that still drains.
  bool Waits(const Waiter& w, uint64_t mark) {
    if (w.hooked_at.load() <= mark) return false;
    switch (w.where.load()) {
      case Waiter::kForRoom:
        return true;
      case Waiter::kBehindDrain: {
        auto e = cache_.Entry(Name(w.op.name));
        return e && e->draining;
      }
      default:
        return false;
    }
  }

  std::string Fingerprint() {
    std::ostringstream os;
    const CacheStats s = cache_.Stats();
    os << cache_.budget().used() << "/" << cache_.budget().drains() << "/"
       << s.loads << "/" << s.evictions << "/" << s.failed_unloads << "/"
       << s.hits << ":";
    for (const auto& w : waiters_) os << w->done.load();
    for (const EntryInfo& e : cache_.Entries()) {
      os << "|" << e.key << EntryStateName(e.state) << e.leases << e.pinned
         << e.draining;
    }
    return os.str();
  }

  // Waits until every waiter has finished or gone back to waiting after a
  // wake-up of all of them, twice in a row with nothing changed between.
  void Settle() {
    const auto give_up = std::chrono::steady_clock::now() + kSettleLimit;
    std::string last;
    for (int round = 0;; ++round) {
      const uint64_t mark = hook_seq.load();
      cache_.budget().ClockAdvanced();
      for (;;) {
        bool all = true;
        for (const auto& w : waiters_) {
          if (!w->done && !Waits(*w, mark)) all = false;
        }
        if (all) break;
        if (std::chrono::steady_clock::now() > give_up) {
          RC_FAIL(where_ +
                  ": a waiter neither finished nor went back to waiting");
        }
        std::this_thread::yield();
      }
      const std::string now = Fingerprint();
      if (round > 0 && now == last) break;
      if (std::chrono::steady_clock::now() > give_up) {
        RC_FAIL(where_ + ": the cache never settled");
      }
      last = now;
    }
    // Collect the finished waiters' leases.
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      Waiter& w = **it;
      if (!w.done) {
        ++it;
        continue;
      }
      w.thread.join();
      if (w.lease) {
        Expect(w.lease->key() == Name(w.op.name),
               where_ + ": a waiter got a lease on another key");
        Hold(std::move(*w.lease));
      }
      finished_.push_back(w.outcome);
      it = waiters_.erase(it);
    }
  }

  bool Aged(const Waiter& w) const {
    return drain_after_s_ >= 0 && now_.load() - w.arrival >= drain_after_s_;
  }

  void CheckInvariants() {
    const std::vector<EntryInfo> entries = cache_.Entries();
    ExpectEq(cache_.budget().used(), cache_.CheckInvariants(),
             "budget used vs the cache's books");
    Expect(!values_.concurrent_loads, where_ + ": two loads of one key");
    // Leases the test holds are on records still there, counted exactly
    // (waiters hold none until they finish).
    std::map<std::string, int> leases, expected;
    for (const EntryInfo& e : entries) leases[e.key] += e.leases;
    for (const HeldLease& h : held_) ++expected[h.lease.key()];
    for (const auto& [k, n] : leases) {
      ExpectEq(n, expected[k], "leases on '" + k + "'");
    }
    for (const auto& [k, n] : expected) {
      ExpectEq(leases[k], n, "leases on '" + k + "'");
    }
    // Every value loaded and not unloaded is in the cache (a failed unload
    // keeps its record), and nothing leased was unloaded.
    std::map<std::string, int> alive;
    for (const auto& v : values_.Snapshot()) {
      Expect(!v->unloaded_while_leased,
             where_ + ": '" + v->key + "' was unloaded while leased");
      if (!v->unloaded) ++alive[v->key];
    }
    std::map<std::string, int> records;
    for (const EntryInfo& e : entries) {
      if (e.state == EntryState::kResident || e.state == EntryState::kRetired)
        ++records[e.key];
    }
    ExpectEq(records, alive, "records in the cache vs values not unloaded");
  }

  template <typename T>
  void ExpectEq(const T& actual, const T& expected, const std::string& what) {
    if (!(actual == expected)) {
      RC_FAIL(where_ + ": " + what + ": got " +
              ::testing::PrintToString(actual) + ", expected " +
              ::testing::PrintToString(expected));
    }
  }

  bool Throwing() {
    for (const auto& v : values_.Snapshot()) {
      if (!v->unloaded && v->fail_once) return true;
    }
    return false;
  }

  void CheckDrains(uint64_t drains_before, const std::vector<int64_t>& arrivals,
                   bool plain_step) {
    const std::vector<EntryInfo> entries = cache_.Entries();
    Budget& budget = cache_.budget();
    // Waiters for room (filed in the budget's queue) and their ages.
    std::vector<const Waiter*> for_room;
    uint64_t aged_max_bytes = 0;
    for (const auto& w : waiters_) {
      if (w->where == Waiter::kForRoom) {
        for_room.push_back(w.get());
        if (Aged(*w)) aged_max_bytes = std::max(aged_max_bytes, w->op.Bytes());
      }
    }
    // Arrival order: the budget's oldest waiter is the model's, a queued
    // request keeping its arrival when it waits for room afterwards.
    std::optional<int64_t> oldest;
    for (const Waiter* w : for_room) {
      if (!oldest || w->arrival < *oldest) oldest = w->arrival;
    }
    const auto budget_oldest = budget.OldestWaitArrival();
    ExpectEq(budget_oldest.has_value(), oldest.has_value(),
             "someone waits for room");
    if (oldest) {
      ExpectEq(
          std::chrono::duration_cast<seconds>(budget_oldest->time_since_epoch())
              .count(),
          *oldest, "the oldest wait's arrival");
    }

    // Who drains.
    uint64_t draining_bytes = 0, largest = 0;
    for (const EntryInfo& e : entries) {
      if (!e.draining) continue;
      Expect(e.state == EntryState::kResident && !e.pinned,
             where_ + ": '" + e.key + "' drains while pinned or not resident");
      Expect(aged_max_bytes > 0, where_ + ": '" + e.key +
                                     "' drains with no waiter for room that "
                                     "has waited drain_after");
      draining_bytes += e.bytes;
      largest = std::max(largest, e.bytes);
      // Its lease count never grows while its drain runs. (A drain that
      // ends lets its queued requests take leases; the next one may take
      // the same model again, and counts as a new drain.)
      auto it = draining_leases_.find(e.key);
      if (it != draining_leases_.end() && budget.drains() == drains_before)
        Expect(e.leases <= it->second,
               where_ + ": draining '" + e.key + "' took a lease");
    }
    if (draining_bytes > 0) {
      Expect(draining_bytes - largest < aged_max_bytes,
             where_ + ": the drain takes more than its waiter needs");
    }
    // A drain that began in this step, with nothing pinned, no unloader that
    // throws, and the free bytes as they were when it began (no capacity
    // change, no failed load giving bytes back): it is the oldest waiter's,
    // and its set, with the free bytes, covers that waiter's bytes and no
    // more than the last victim's worth beyond.
    if (draining_bytes > 0 && budget.drains() > drains_before && plain_step &&
        !Throwing() &&
        std::none_of(entries.begin(), entries.end(),
                     [](const EntryInfo& e) { return e.pinned; }) &&
        budget.used() <= budget.capacity() && !for_room.empty()) {
      // Waiters that arrived at the same instant are ordered by when each
      // was first filed for room (its ticket), which the test cannot see: a
      // request queued behind a drain keeps its arrival but is filed later.
      // So the drain is for one of the waiters with the oldest arrival.
      const int64_t oldest_arrival =
          (*std::min_element(for_room.begin(), for_room.end(),
                             [](const Waiter* a, const Waiter* b) {
                               return a->arrival < b->arrival;
                             }))
              ->arrival;
      const uint64_t free = budget.capacity() - budget.used();
      bool covers_one = false, fits_one = false;
      for (const Waiter* w : for_room) {
        if (w->arrival != oldest_arrival) continue;
        const uint64_t bytes = w->op.Bytes();
        if (free + draining_bytes >= bytes) {
          covers_one = true;
          if (free + draining_bytes - largest < bytes) fits_one = true;
        }
      }
      Expect(covers_one,
             where_ + ": the drain does not cover the oldest waiter");
      Expect(fits_one, where_ +
                           ": the drain is not the oldest waiter's, or takes "
                           "more than it needs");
    }
    draining_leases_.clear();
    for (const EntryInfo& e : entries) {
      if (e.draining) draining_leases_[e.key] = e.leases;
    }
    if (budget.drains() > drains_before) {
      Expect(drain_after_s_ >= 0, where_ + ": a drain under kDrainNever");
      const bool aged =
          std::any_of(arrivals.begin(), arrivals.end(), [&](int64_t arrival) {
            return now_.load() - arrival >= drain_after_s_;
          });
      Expect(aged, where_ + ": a drain before drain_after passed");
    }

    // With no drain running and no unloader that throws, a waiter that
    // evicting idle models could serve does not wait.
    bool throwing = false;
    for (const auto& v : values_.Snapshot()) {
      if (!v->unloaded && v->fail_once) throwing = true;
    }
    if (draining_bytes == 0 && !throwing) {
      uint64_t idle = 0;
      for (const EntryInfo& e : entries) {
        if (e.state == EntryState::kResident && e.leases == 0 && !e.pinned)
          idle += e.bytes;
      }
      const uint64_t capacity = budget.capacity(), used = budget.used();
      const uint64_t room = capacity > used ? capacity - used : 0;
      const uint64_t over = used > capacity ? used - capacity : 0;
      for (const Waiter* w : for_room) {
        const uint64_t bytes = w->op.Bytes();
        if (bytes <= room) {
          RC_FAIL(where_ + ": a waiter for " + std::to_string(bytes) +
                  " B waits with " + std::to_string(room) + " B free");
        }
        Expect(idle < bytes - room + over,
               where_ + ": a waiter for " + std::to_string(bytes) +
                   " B waits while evicting idle models would serve it");
      }
    }
  }

  // The bound: once the oldest waiter for room has waited drain_after, what
  // it needs is neither pinned nor held by an unloader that throws, and every
  // lease out when its drain began has ended, it is served within the step.
  // The test cannot see which waiter a drain is for, so it counts from the
  // latest step at which a drain began, its set grew, or this waiter became
  // the one due (leases held then are a superset of those its drain waits
  // for).
  void CheckBound() {
    if (bound_waiter_ >= 0 &&
        std::none_of(waiters_.begin(), waiters_.end(),
                     [&](const auto& w) { return w->id == bound_waiter_; })) {
      ++bound_met_;  // served (or ended) while the bound applied
    }
    const Waiter* due = nullptr;
    for (const auto& w : waiters_) {
      if (w->where != Waiter::kForRoom) continue;
      if (!due || w->arrival < due->arrival) due = w.get();
    }
    Budget& budget = cache_.budget();
    bool eligible =
        due != nullptr && Aged(*due) && budget.used() <= budget.capacity();
    if (eligible) {
      uint64_t pinned = 0;
      for (const EntryInfo& e : cache_.Entries()) {
        if (e.pinned || e.state == EntryState::kRetired) pinned += e.bytes;
      }
      for (const auto& v : values_.Snapshot()) {
        if (!v->unloaded && v->fail_once) eligible = false;
      }
      if (budget.capacity() < pinned ||
          due->op.Bytes() > budget.capacity() - pinned) {
        eligible = false;
      }
    }
    if (!eligible) {
      bound_waiter_ = -1;
      return;
    }
    // A drain's set grows when what it had no longer covers its waiter (the
    // capacity shrank, a victim was pinned): the leases out on what joins it
    // then are the ones it waits for, so the bound counts from there too.
    std::set<std::string> draining;
    for (const EntryInfo& e : cache_.Entries()) {
      if (e.draining) draining.insert(e.key);
    }
    const bool grew =
        !std::includes(bound_draining_.begin(), bound_draining_.end(),
                       draining.begin(), draining.end());
    auto snapshot = [&] {
      bound_waiter_ = due->id;
      bound_drains_ = budget.drains();
      bound_draining_ = draining;
      bound_leases_.clear();
      for (const HeldLease& h : held_) bound_leases_.insert(h.serial);
    };
    if (bound_waiter_ != due->id || bound_drains_ != budget.drains() || grew) {
      snapshot();
      return;
    }
    const bool ended = std::none_of(
        held_.begin(), held_.end(),
        [&](const HeldLease& h) { return bound_leases_.count(h.serial) > 0; });
    if (ended) {
      RC_FAIL(where_ + ": waiter #" + std::to_string(due->id) + " (" +
              std::to_string(due->op.Bytes()) + " B, arrived at " +
              std::to_string(due->arrival) + " s, now " +
              std::to_string(now_.load()) +
              " s) still waits after drain_after, with every lease out when "
              "its drain began ended");
    }
  }

  const int64_t drain_after_s_;
  std::atomic<int64_t> now_{1000};
  Values values_;
  std::vector<HeldLease> held_;
  ModelCache cache_;
  std::vector<std::unique_ptr<Waiter>> waiters_;
  std::vector<std::string> finished_;
  std::map<std::string, int> draining_leases_;
  std::string where_;
  uint64_t next_serial_ = 0;
  int next_waiter_ = 0;
  int bound_waiter_ = -1;
  int bound_met_ = 0;
  uint64_t bound_drains_ = 0;
  std::set<uint64_t> bound_leases_;
  std::set<std::string> bound_draining_;
};

void RunDrainCase(int drain_after_choice, const std::vector<Op>& ops) {
  HookGuard hooks;
  DrainCase c(drain_after_choice);
  for (size_t step = 0; step < ops.size(); ++step) {
    c.Step(ops[step], "step " + std::to_string(step) + " " +
                          ::testing::PrintToString(ops[step]));
  }
  RC_CLASSIFY(c.drains() > 0, "drained");
  RC_CLASSIFY(c.queued_behind_drain() > 0, "queued behind a drain");
  RC_CLASSIFY(c.bound_met() > 0, "served under the bound's check");
}

RC_GTEST_PROP(DrainProperty, WaitersAreServedWithinTheBoundAndKeepTheInvariants,
              (const std::vector<Op>& ops)) {
  const int drain_after = *rc::gen::inRange(0, 3);
  RunDrainCase(drain_after, ops);
}

// ---- Regressions: counterexamples `make property` found, replayed. ----

int K(Kind kind) { return static_cast<int>(kind); }
constexpr int kNoFault = 3;  // neither the loader nor the unloader throws

using rc_util::ExpectPasses;

// drain_after 0: Wait(m2, 20), Wait(m3, 40), Wait(m0, 60), Acquire(m3, 20),
// Lookup(m3), SetCapacity(60), Release(lease #5), Release(lease #0)
// -> step 7: the bound counted from m0's drain of m2 alone; the shrink at
// step 5 made the drain take m3 too, with the two leases taken on m3 since.
TEST(DrainProperty, RegressionTheBoundCountsFromASetThatGrew) {
  ExpectPasses([] {
    RunDrainCase(
        0,
        {
            {.kind = K(Kind::kWait), .name = 2, .size = 0, .fault = kNoFault},
            {.kind = K(Kind::kWait), .name = 3, .size = 1, .fault = kNoFault},
            {.kind = K(Kind::kWait), .name = 0, .size = 2, .fault = kNoFault},
            {.kind = K(Kind::kAcquire),
             .name = 3,
             .size = 0,
             .fault = kNoFault},
            {.kind = K(Kind::kLookup), .name = 3},
            {.kind = K(Kind::kSetCapacity), .other = 0},
            {.kind = K(Kind::kRelease), .other = 5},
            {.kind = K(Kind::kRelease), .other = 0},
        });
  });
}

}  // namespace
}  // namespace modelcache::drain_property
