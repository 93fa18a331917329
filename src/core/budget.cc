// Budget: bytes shared by several caches.
//
// State: capacity_, used_ (every reserved byte: resident, retired, and
// reservations of loads in flight), and the member list. Reserve() is the
// only place that evicts; it never holds mu_ while calling a member, and
// members never call Reserve() while holding their own locks, so the budget's
// mutex is a leaf in the lock order.
//
// Waiting for capacity without lost wake-ups: a waiter registers in waiters_
// and notes change_count_ under mu_ *before* it asks members for victims.
// Anything that could create room afterwards (Release, NotifyEvictable,
// SetCapacity) bumps change_count_ under mu_, so the waiter either saw the
// room during its scan or sees the count move and scans again.
#include "modelcache/core/budget.h"

#include <algorithm>
#include <cassert>
#include <string>
#include <utility>

#include "format.h"
#include "modelcache/base/errors.h"

namespace modelcache {

using detail::BudgetMember;
using detail::EvictOutcome;
using detail::FormatBytes;
using detail::VictimCandidate;

Budget::Budget(uint64_t capacity_bytes, std::string name)
    : name_(std::move(name)), capacity_(capacity_bytes) {}

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

bool Budget::EvictOne(std::unordered_set<uint64_t>* skip, double evict_below) {
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
    if (!best_member) return false;
    // The lowest-ranked victim is not below the bar: neither is any other.
    if (!(best.priority < evict_below)) return false;
    switch (best_member->TryEvict(best)) {
      case EvictOutcome::kEvicted:
        return true;
      case EvictOutcome::kUnloadFailed:
        // The victim stays resident; move on to the next one.
        skip->insert(best.record_id);
        return true;
      case EvictOutcome::kChanged:
        continue;  // someone leased or removed it meanwhile: choose again
    }
  }
}

std::string Budget::HoldersMessage() {
  std::vector<std::string> holders;
  for (auto& member : Members()) member->DescribeHolders(&holders);
  if (holders.empty()) return "nothing resident";
  std::string out;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (i > 0) out += ", ";
    out += holders[i];
  }
  return out;
}

void Budget::Reserve(uint64_t bytes, WhenFull when_full,
                     std::chrono::steady_clock::time_point deadline,
                     uint64_t already_reserved, const WaitInterrupt* interrupt,
                     double evict_below) {
  const bool interruptible = interrupt != nullptr && interrupt->check;
  std::unordered_set<uint64_t> skip;  // victims whose unload failed
  bool registered = false;
  auto leave = [&] {
    if (registered) waiters_.fetch_sub(1);
    registered = false;
  };
  for (;;) {
    uint64_t seen_changes = 0;
    uint64_t capacity = 0, used = 0;
    {
      base::MutexLock lock(&mu_);
      // Written so that no sum can wrap: already_reserved + bytes may pass
      // 2^64, and used_ may exceed capacity_ after a shrink.
      if (bytes > capacity_ || already_reserved > capacity_ - bytes) {
        const uint64_t cap = capacity_;
        leave();
        const std::string needs =
            already_reserved == 0
                ? FormatBytes(bytes)
                : FormatBytes(already_reserved) + " + " + FormatBytes(bytes);
        throw Error(ErrorCode::kTooLarge, "needs " + needs + " but budget '" +
                                              name_ + "' has a capacity of " +
                                              FormatBytes(cap));
      }
      if (used_ <= capacity_ && bytes <= capacity_ - used_) {
        used_ += bytes;
        high_water_ = std::max(high_water_, used_);
        leave();
        return;
      }
      if (!registered) {
        waiters_.fetch_add(1);
        registered = true;
      }
      seen_changes = change_count_;
      capacity = capacity_;
      used = used_;
    }
    if (EvictOne(&skip, evict_below)) continue;

    if (when_full == WhenFull::kFail) {
      leave();
      const bool ranked =
          evict_below != std::numeric_limits<double>::infinity();
      throw Error(ErrorCode::kCapacity,
                  "cannot reserve " + FormatBytes(bytes) + " in budget '" +
                      name_ + "' (capacity " + FormatBytes(capacity) + ", " +
                      FormatBytes(used) + " in use) and nothing" +
                      (ranked ? " ranked below it" : "") +
                      " is evictable; held by: " + HoldersMessage());
    }
    bool timed_out = false;
    bool check_interrupt = false;
    {
      base::MutexLock lock(&mu_);
      while (change_count_ == seen_changes) {
        // An interruptible wait wakes every `every` to run the check, which
        // must run without the budget's lock.
        const auto wake =
            interruptible
                ? std::min(deadline,
                           std::chrono::steady_clock::now() + interrupt->every)
                : deadline;
        if (!changed_.WaitUntil(&mu_, wake) && change_count_ == seen_changes) {
          if (wake < deadline) {
            check_interrupt = true;
          } else {
            timed_out = true;
          }
          break;
        }
      }
    }
    if (check_interrupt) {
      try {
        interrupt->check();
      } catch (...) {
        leave();
        throw;
      }
      continue;  // look again: room may have appeared meanwhile
    }
    if (timed_out) {
      leave();
      throw Error(ErrorCode::kTimeout, "timed out waiting for " +
                                           FormatBytes(bytes) + " in budget '" +
                                           name_ +
                                           "'; held by: " + HoldersMessage());
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
    if (!EvictOne(&skip)) break;
  }
  base::MutexLock lock(&mu_);
  return used_ > capacity_ ? used_ - capacity_ : 0;
}

uint64_t Budget::SetCapacity(uint64_t capacity_bytes) {
  {
    base::MutexLock lock(&mu_);
    capacity_ = capacity_bytes;
    over_capacity_.store(used_ > capacity_);
    ++change_count_;
  }
  changed_.NotifyAll();
  return EvictToCapacity();
}

}  // namespace modelcache
