// Budget: bytes shared by several caches.
//
// State: capacity_, used_ (every reserved byte: resident, retired, and
// reservations of loads in flight), and the member list. Reserve() and the
// shrink path (SetCapacity, NotifyEvictable over capacity) are the only
// places that evict; they never hold mu_ while calling a member, and members
// never call Reserve() while holding their own locks, so the budget's mutex
// is a leaf in the lock order.
//
// A reservation's round: under mu_, take the bytes if they fit; otherwise
// note the shortfall (used + bytes - capacity) and, without mu_, ask every
// member what it could evict now (each keeps a running count, so asking
// costs the same however many records are resident; only a round with
// victims whose unloaders failed, or a ranked bar, makes a member look at
// its records). Evict one victim only when that total
// covers the shortfall, then start the round again; when it cannot, evict
// nothing and fail or wait. Members are asked afresh before every victim, so
// a reservation that a concurrent lease makes hopeless stops after the
// victim in progress; what it evicted is counted in wasted_evictions_.
// (The shrink path evicts whatever it can: it has no all-or-nothing goal.)
//
// A reservation that brings room from outside (grow_capacity) is judged
// against the capacity with that room, but adds it to capacity_ only in the
// critical section that takes its bytes: every other call, and the shrink
// path's over_capacity_ in particular, only ever sees the real capacity.
//
// Waiting for capacity without lost wake-ups: a waiter registers in waiters_
// and notes change_count_ under mu_ *before* it asks members for victims.
// Anything that could create room afterwards (Release, NotifyEvictable,
// SetCapacity) bumps change_count_ under mu_, so the waiter either saw the
// room during its scan or sees the count move and scans again.
#include "modelcache/core/budget.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "budget_waiter.h"
#include "format.h"
#include "modelcache/base/errors.h"
#include "test_hooks.h"

namespace modelcache {
using detail::BudgetMember;
using detail::EvictOutcome;
using detail::FormatBytes;
using detail::VictimCandidate;

Budget::Budget(uint64_t capacity_bytes, std::string name, BudgetOptions options)
    : name_(std::move(name)),
      capacity_(capacity_bytes),
      now_(std::move(options.now)),
      drain_after_ns_(options.drain_after == kDrainAfterAuto
                          ? kDrainAfterAuto.count()
                          : std::max<int64_t>(0, options.drain_after.count())) {
}

Budget::~Budget() {
  base::MutexLock lock(&mu_);
  assert(
      std::none_of(members_.begin(), members_.end(),
                   [](const MemberSlot& m) { return !m.member.expired(); }) &&
      "a cache still uses this budget");
}

uint64_t Budget::capacity() const {
  base::MutexLock lock(&mu_);
  return capacity_;
}

uint64_t Budget::used() const {
  base::MutexLock lock(&mu_);
  return used_;
}

uint64_t Budget::high_water() const {
  base::MutexLock lock(&mu_);
  return high_water_;
}

void Budget::Register(std::weak_ptr<BudgetMember> member) {
  base::MutexLock lock(&mu_);
  const BudgetMember* id = member.lock().get();
  members_.push_back(MemberSlot{id, std::move(member)});
}

void Budget::Unregister(const BudgetMember* member) {
  base::MutexLock lock(&mu_);
  std::erase_if(members_,
                [member](const MemberSlot& m) { return m.id == member; });
}

std::vector<std::shared_ptr<BudgetMember>> Budget::Members() {
  std::vector<std::shared_ptr<BudgetMember>> members;
  base::MutexLock lock(&mu_);
  members.reserve(members_.size());
  for (const MemberSlot& slot : members_) {
    if (auto member = slot.member.lock()) members.push_back(std::move(member));
  }
  return members;
}

Budget::EvictStep Budget::EvictOne(std::unordered_set<uint64_t>* skip,
                                   double evict_below) {
  for (;;) {
    std::shared_ptr<BudgetMember> best_member;
    VictimCandidate best;
    for (auto& member : Members()) {
      VictimCandidate candidate;
      if (!member->BestVictim(*skip, &candidate)) continue;
      if (!best_member || candidate.priority < best.priority ||
          (candidate.priority == best.priority && candidate.seq < best.seq)) {
        best = std::move(candidate);
        best_member = member;
      }
    }
    if (!best_member) return EvictStep::kNone;
    // The lowest-ranked victim is not below the bar: neither is any other.
    if (!(best.priority < evict_below)) return EvictStep::kNone;
    switch (best_member->TryEvict(best)) {
      case EvictOutcome::kEvicted:
        return EvictStep::kEvicted;
      case EvictOutcome::kUnloadFailed:
        // The victim stays resident; move on to the next one.
        skip->insert(best.record_id);
        return EvictStep::kUnloadFailed;
      case EvictOutcome::kChanged:
        continue;  // someone leased or removed it meanwhile: choose again
    }
  }
}

uint64_t Budget::EvictableBytes(const std::unordered_set<uint64_t>& skip,
                                double evict_below) {
  uint64_t total = 0;
  for (auto& member : Members()) {
    const uint64_t bytes = member->EvictableBytes(skip, evict_below);
    total = bytes > UINT64_MAX - total ? UINT64_MAX : total + bytes;
  }
  return total;
}

std::string Budget::HoldersMessage(uint64_t exclude) {
  std::vector<std::string> holders;
  for (auto& member : Members()) member->DescribeHolders(&holders, exclude);
  if (holders.empty()) return "nothing resident";
  std::string out;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (i > 0) out += ", ";
    out += holders[i];
  }
  return out;
}

void Budget::Reserve(uint64_t bytes, const ReserveOptions& options) {
  const uint64_t already_reserved = options.already_reserved;
  const WaitInterrupt* interrupt = options.interrupt;
  const bool interruptible = interrupt != nullptr && interrupt->check;
  const bool waits = options.when_full == WhenFull::kWait;
  std::unordered_set<uint64_t> skip;  // victims whose unload failed
  // change_count_ when the first of them failed: a wait for room ends at
  // any change since (NotifyEvictable, say, even one that came before the
  // wait began), and then they are tried again, since an unloader may
  // refuse until the model's holders let go (a store that recalls them).
  uint64_t skipped_at = 0;
  Waiter me;
  me.waits = waits;
  me.bytes = bytes;
  me.holds = &options.holds;
  me.expected_load = options.expected_load;
  me.for_what = options.for_what.empty()
                    ? FormatBytes(bytes) + " in budget '" + name_ + "'"
                    : options.for_what;
  me.arrival = options.arrival ? *options.arrival : Now();
  uint64_t& evicted = me.evicted;
  // When an interruptible wait next runs its check.
  auto next_check =
      std::chrono::steady_clock::now() +
      (interruptible ? interrupt->every : std::chrono::milliseconds(0));
  auto leave = [&](bool failed) {
    bool was_draining = false;
    {
      base::MutexLock lock(&mu_);
      was_draining = LeaveLocked(&me, failed);
    }
    if (was_draining) FinishDrain(&me);
  };
  for (;;) {
    const auto now = waits ? Now() : std::chrono::steady_clock::time_point{};
    uint64_t seen_changes = 0;
    uint64_t capacity = 0, used = 0, shortfall = 0, free_bytes = 0;
    bool draining = false;
    bool finish_drain = false;
    std::optional<Error> too_large;
    {
      base::MutexLock lock(&mu_);
      // The bytes moving in from outside (ReserveOptions::grow_capacity)
      // count only in the step that makes the reservation: until then the
      // capacity is what it was, so no other reservation can take that room,
      // no release can judge usage against it, and a reservation that fails
      // has nothing to give back.
      const uint64_t grow =
          std::min({options.grow_capacity, bytes,
                    std::numeric_limits<uint64_t>::max() - capacity_});
      const uint64_t grown_capacity = capacity_ + grow;
      // Written so that no sum can wrap: already_reserved + bytes may pass
      // 2^64, and used_ may exceed capacity_ after a shrink.
      if (bytes > grown_capacity || already_reserved > grown_capacity - bytes) {
        const std::string needs =
            already_reserved == 0
                ? FormatBytes(bytes)
                : FormatBytes(already_reserved) + " + " + FormatBytes(bytes);
        too_large.emplace(
            ErrorCode::kTooLarge,
            "needs " + needs + " but budget '" + name_ +
                "' has a capacity of " + FormatBytes(capacity_) +
                (grow == 0 ? std::string()
                           : " (" + FormatBytes(grown_capacity) + " with the " +
                                 FormatBytes(grow) + " moving in)"));
        finish_drain = LeaveLocked(&me, /*failed=*/true);
      }
      // The room another's drain is owed is not this call's to take.
      draining = drain_ == &me;
      const uint64_t owed = drain_ != nullptr && !draining ? owed_ : 0;
      // used_ + owed + bytes against the capacity, written so that no sum
      // can wrap (used_ may exceed capacity_ after a shrink).
      const uint64_t room = grown_capacity > used_ ? grown_capacity - used_ : 0;
      const uint64_t room_not_owed = room > owed ? room - owed : 0;
      if (too_large) {
        // Refused above.
      } else if (bytes <= room_not_owed) {
        capacity_ = grown_capacity;
        used_ += bytes;
        high_water_ = std::max(high_water_, used_);
        // over_capacity_ is already false: usage was within the capacity
        // before (the growth is at most `bytes`), and the release or resize
        // that made it so cleared the flag.
        finish_drain = LeaveLocked(&me, /*failed=*/false);
      } else {
        if (!me.registered) {
          waiters_.fetch_add(1);
          me.registered = true;
          if (waits) EnqueueLocked(&me);
        }
        seen_changes = change_count_;
        capacity = grown_capacity;
        used = used_;
        // What evicting must free: the bytes beyond the room, plus what
        // usage is over the capacity, plus what is owed beyond the room.
        const uint64_t over_capacity =
            used_ > grown_capacity ? used_ - grown_capacity : 0;
        const uint64_t owed_beyond_room = owed > room ? owed - room : 0;
        shortfall =
            SaturatingAdd(SaturatingAdd(bytes - room_not_owed, over_capacity),
                          owed_beyond_room);
        free_bytes = grown_capacity > used_ ? grown_capacity - used_ : 0;
      }
    }
    if (!me.registered) {
      if (finish_drain) FinishDrain(&me);
      if (too_large) throw *too_large;
      return;
    }
    // Evict only when evicting can make the room: never for a reservation
    // that would fall short anyway. The check repeats before every victim.
    // A drain's waiter too: idle records outside its set that cover its
    // shortfall serve it at once (draining ones are not evictable), since
    // waiting for the set's leases then would only keep the load path idle.
    uint64_t evictable = EvictableBytes(skip, options.evict_below);
    if (evictable >= shortfall) {
      switch (EvictOne(&skip, options.evict_below)) {
        case EvictStep::kEvicted:
          ++evicted;
          continue;
        case EvictStep::kUnloadFailed:
          if (skip.size() == 1) skipped_at = seen_changes;
          continue;  // look again without it
        case EvictStep::kNone:
          // What was counted was leased, pinned or evicted meanwhile.
          evictable = 0;
          break;
      }
    }
    if (draining) {
      // This call's drain: else its set's evictions are its room.
      switch (DrainStep(&me, free_bytes, &evicted)) {
        case DrainProgress::kAgain:
          continue;
        case DrainProgress::kWait:
        case DrainProgress::kCannot:
          break;
      }
    } else {
      if (!waits) {
        leave(/*failed=*/true);
        const bool ranked =
            options.evict_below != std::numeric_limits<double>::infinity();
        throw Error(ErrorCode::kCapacity,
                    "cannot reserve " + FormatBytes(bytes) + " in budget '" +
                        name_ + "' (capacity " + FormatBytes(capacity) + ", " +
                        FormatBytes(used) + " in use) and " +
                        (evictable == 0 ? std::string("nothing")
                                        : "only " + FormatBytes(evictable)) +
                        (ranked ? " ranked below it" : "") +
                        " is evictable; held by: " +
                        HoldersMessage(options.for_record));
      }
      // Room only leased models can give: overtaken until drain_after has
      // passed, then their drain, if no older waiter is owed one first.
      bool start = false;
      {
        base::MutexLock lock(&mu_);
        if (options.evict_below == std::numeric_limits<double>::infinity() &&
            MayStartDrainLocked(me, now)) {
          drain_ = &me;
          drain_started_ = now;
          owed_ = bytes;
          me.refused = false;
          // The others' room shrank by what is owed; no refused waiter's
          // room became drainable (its set is taken only as it covers).
          ++change_count_;
          ++quiet_changes_;
          start = true;
        }
      }
      if (start) continue;
    }
    bool timed_out = false;
    bool check_interrupt = false;
    {
      // Until drain_after has passed, wake when it does (with the real
      // clock; an injected one calls ClockAdvanced).
      auto wake_at = options.deadline;
      const std::chrono::nanoseconds drain_after = DrainAfterOf(me);
      if (!draining && !now_ && drain_after != kDrainNever &&
          now - me.arrival < drain_after &&
          drain_after <
              std::chrono::steady_clock::time_point::max() - me.arrival) {
        wake_at = std::min(
            wake_at,
            me.arrival +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    drain_after));
      }
      // The deadline and the interrupt's turn are checked here too, not only
      // when a wait times out: under a stream of changes (drains starting
      // and ending, leases ending) a waiter may never sleep long enough.
      const auto real_now = std::chrono::steady_clock::now();
      if (real_now >= options.deadline) {
        timed_out = true;
      } else if (interruptible && real_now >= next_check) {
        check_interrupt = true;
      }
      base::MutexLock lock(&mu_);
      uint64_t since = skip.empty() ? seen_changes : skipped_at;
      if (!me.failed.empty()) since = std::min(since, me.failed_at);
      if (!timed_out && !check_interrupt && change_count_ == since) {
        // About to sleep, with no change since it looked.
        if (auto hook = detail::reservation_waits_for_room.load(
                std::memory_order_acquire)) {
          hook();
        }
      }
      while (!timed_out && !check_interrupt && change_count_ == since) {
        // An interruptible wait wakes every `every` to run the check, which
        // must run without the budget's lock.
        const auto wake =
            interruptible ? std::min(wake_at, std::chrono::steady_clock::now() +
                                                  interrupt->every)
                          : wake_at;
        if (!changed_.WaitUntil(&mu_, wake) && change_count_ == since) {
          if (wake >= options.deadline) {
            timed_out = true;
          } else {
            // The interrupt's turn, or drain_after has passed.
            check_interrupt = interruptible;
          }
          break;
        }
      }
    }
    if (check_interrupt && !timed_out) {
      next_check = std::chrono::steady_clock::now() + interrupt->every;
      try {
        interrupt->check();
      } catch (...) {
        leave(/*failed=*/true);
        throw;
      }
      continue;  // look again: room may have appeared meanwhile
    }
    if (timed_out) {
      leave(/*failed=*/true);
      throw Error(ErrorCode::kTimeout,
                  "timed out waiting for " + FormatBytes(bytes) +
                      " in budget '" + name_ +
                      "'; held by: " + HoldersMessage(options.for_record));
    }
    skip.clear();  // something changed: the refused victims may go now
    me.failed.clear();
  }
}

bool Budget::EvictLowestRanked() {
  std::unordered_set<uint64_t> skip;
  for (;;) {
    switch (EvictOne(&skip)) {
      case EvictStep::kEvicted:
        return true;
      case EvictStep::kUnloadFailed:
        continue;
      case EvictStep::kNone:
        return false;
    }
  }
}

uint64_t Budget::ObtainableBytes() {
  uint64_t unevictable = 0;
  for (auto& member : Members()) unevictable += member->UnevictableBytes();
  base::MutexLock lock(&mu_);
  return capacity_ > unevictable ? capacity_ - unevictable : 0;
}

void Budget::Release(uint64_t bytes) {
  if (bytes == 0) return;
  {
    base::MutexLock lock(&mu_);
    assert(used_ >= bytes && "released more bytes than reserved");
    used_ -= bytes;
    if (used_ <= capacity_) over_capacity_.store(false);
    ++change_count_;
  }
  changed_.NotifyAll();
}

void Budget::NotifyEvictable() {
  if (waiters_.load() != 0) {
    {
      base::MutexLock lock(&mu_);
      ++change_count_;
    }
    changed_.NotifyAll();
  }
  // Usage is over a capacity that shrank under leases or pins: what just
  // became evictable goes now, in policy order, rather than lingering until
  // the next reservation.
  if (over_capacity_.load()) EvictToCapacity();
}

void Budget::NotifyDrainable() {
  if (waiters_.load() == 0) return;
  {
    base::MutexLock lock(&mu_);
    ++change_count_;
  }
  changed_.NotifyAll();
}

uint64_t Budget::EvictToCapacity() {
  std::unordered_set<uint64_t> skip;
  for (;;) {
    {
      base::MutexLock lock(&mu_);
      if (used_ <= capacity_) {
        over_capacity_.store(false);
        return 0;
      }
    }
    if (EvictOne(&skip) == EvictStep::kNone) break;
  }
  base::MutexLock lock(&mu_);
  return used_ > capacity_ ? used_ - capacity_ : 0;
}

uint64_t Budget::SetCapacity(uint64_t capacity_bytes) {
  Resize(capacity_bytes);
  return EvictToCapacity();
}

void Budget::Resize(uint64_t capacity_bytes) {
  {
    base::MutexLock lock(&mu_);
    capacity_ = capacity_bytes;
    over_capacity_.store(used_ > capacity_);
    ++change_count_;
  }
  changed_.NotifyAll();
}

uint64_t Budget::EvictOverCapacity() { return EvictToCapacity(); }

}  // namespace modelcache
