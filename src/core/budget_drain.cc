// The drain scheduler: who waits for room, in what order, and when the
// models that hold it stop taking leases (budget.h, "Who waits").
//
// Design note
// -----------
// Waiters. Every reservation that must wait for room (WhenFull::kWait) is
// filed in queue_ by (arrival, ticket) from its first look that falls short
// until it leaves (served, timed out, interrupted, too large). The queue
// decides who may drain: the oldest waiter that has waited drain_after and
// that a drain can serve. A waiter no drain can serve (its room is pinned,
// held by its own leases, or still loading) is marked refused, and does not
// hold back younger waiters until something a drain could use changes:
// bytes freed, a capacity change, a record evictable or drainable again (a
// load that ends leased, an unpin, a drain that held records ending). The
// clock, a drain's start and another refusal are quiet changes
// (quiet_changes_): were they not, two refused waiters would expire each
// other's refusal and retry for as long as they wait. A set is marked only
// once its whole extension covers the waiter, so a waiter that is refused
// stops no record from taking leases, not even for a moment.
//
// A waiter's states:
//
//   overtaken --age >= drain_after, no drain runs, every older waiter
//       refused--> draining (drain_ = it, owed_ = its bytes)
//   draining --set covers its bytes and every lease of it ended--> evicts
//       the set --its bytes fit--> served (leaves; the drain ends)
//   draining --idle records outside the set cover its shortfall--> evicts
//       those (as any reservation would) --> served (the drain ends; the
//       set takes leases again, never having been evicted)
//   draining --the set's idle members and idle records outside it cover
//       its shortfall--> evicts those members, then the records outside as
//       needed --> served (the rest of the set takes leases again)
//   draining --what it needs is pinned or its own--> overtaken, refused
//       (the drain ends; the set takes leases again)
//   any --deadline, interrupt--> gone (leaves; a drain of its ends)
//
// A record's drain states (cache side: Record::draining, drain.cc):
//
//   resident --chosen into a set (SetDraining(true))--> draining: no new
//       lease; acquires queue on the record, Lookup and TryAcquire miss
//   draining --its drain ends--> resident (the queued acquires take leases
//       in the order the shard's waiters wake, each with its arrival)
//   draining, no lease --the whole set idle--> unloading (evicted by the
//       waiter) --> gone (the queued acquires load it again, keeping their
//       arrival) or, if the unloader threw, resident (left out of the set)
//
// Bytes. While a drain runs, owed_ = its waiter's bytes: every other
// reservation must fit with those bytes set aside, so what the drain frees
// (and any free room the waiter needs) goes only to the waiter. Other
// reservations still evict idle records outside the set for themselves.
//
// Why the set is evicted only when all of it is idle: a waiter that times
// out first must have evicted nothing (a refused request evicts nothing).
// No lease can be taken on a draining record, so once every record of the
// set is idle it stays so until the waiter evicts it.
//
// Why the waiter still takes idle records, in its set or outside it, before
// the set's last lease ends: where leases last minutes, waiting for the
// set's longest one while room sits idle keeps the load path idle too, and
// the waiters queued behind the drain pile up (the replay of the Azure
// trace at 2 GiB: p99 18 min at drain_after 0 against 5.3 min with no drain
// at all; 7.4 min with this). Evicting idle records only when they cover
// the whole shortfall keeps the refused-request contract, as far as it
// holds for any reservation (a record leased between two evictions can
// still leave it short).
//
// Locking: the queue, drain_ and owed_ are under mu_, a leaf; members are
// called (selection, marking, eviction) without it, as everywhere in the
// budget.
#include <algorithm>
#include <cassert>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>

#include "budget_waiter.h"
#include "modelcache/core/budget.h"

namespace modelcache {

using detail::BudgetMember;
using detail::DrainState;
using detail::EvictOutcome;
using detail::VictimCandidate;

void Budget::set_drain_after(std::chrono::nanoseconds drain_after) {
  drain_after_ns_.store(drain_after == kDrainAfterAuto
                            ? kDrainAfterAuto.count()
                            : std::max<int64_t>(0, drain_after.count()),
                        std::memory_order_relaxed);
  ClockAdvanced();  // waiters judge their age against the new value
}

void Budget::ClockAdvanced() {
  {
    base::MutexLock lock(&mu_);
    ++change_count_;
    ++quiet_changes_;  // time makes no pinned room drainable
  }
  changed_.NotifyAll();
}

std::optional<std::chrono::steady_clock::time_point> Budget::OldestWaitArrival()
    const {
  base::MutexLock lock(&mu_);
  if (queue_.empty()) return std::nullopt;
  return queue_.front()->arrival;
}

void Budget::EnqueueLocked(Waiter* waiter) {
  waiter->ticket = next_ticket_++;
  auto later = [](const Waiter* a, const Waiter* b) {
    return a->arrival != b->arrival ? a->arrival < b->arrival
                                    : a->ticket < b->ticket;
  };
  queue_.insert(std::upper_bound(queue_.begin(), queue_.end(), waiter, later),
                waiter);
}

bool Budget::DequeueLocked(Waiter* waiter) {
  std::erase(queue_, waiter);
  if (drain_ != waiter) return false;
  drain_ = nullptr;
  owed_ = 0;
  // The drain ends with its waiter: how long it stopped its set is what
  // kDrainAfterAuto weighs next.
  recent_drains_ns_.store(
      NextRecentDrains(recent_drains(), Now() - drain_started_).count(),
      std::memory_order_relaxed);
  ++change_count_;  // the room it was owed is anyone's now
  return true;
}

bool Budget::LeaveLocked(Waiter* waiter, bool failed) {
  bool was_draining = false;
  if (waiter->registered) {
    waiters_.fetch_sub(1);
    if (waiter->waits) was_draining = DequeueLocked(waiter);
  }
  waiter->registered = false;
  if (failed && waiter->evicted > 0) {
    wasted_evictions_.fetch_add(waiter->evicted);
  }
  return was_draining;
}

bool Budget::RefusedLocked(const Waiter& waiter) const {
  if (!waiter.refused) return false;
  return waiter.refused_over_failed
             ? waiter.refused_at_raw == change_count_
             : waiter.refused_at == change_count_ - quiet_changes_;
}

std::chrono::nanoseconds Budget::DrainAfterOf(const Waiter& waiter) const {
  const std::chrono::nanoseconds drain_after(
      drain_after_ns_.load(std::memory_order_relaxed));
  return drain_after == kDrainAfterAuto
             ? DefaultDrainAfter(waiter.expected_load, recent_drains())
             : drain_after;
}

bool Budget::MayStartDrainLocked(
    const Waiter& waiter, std::chrono::steady_clock::time_point now) const {
  if (drain_ != nullptr || RefusedLocked(waiter)) return false;
  const std::chrono::nanoseconds drain_after = DrainAfterOf(waiter);
  if (drain_after == kDrainNever || now - waiter.arrival < drain_after) {
    return false;
  }
  // The oldest waiter a drain can serve goes first.
  for (const Waiter* older : queue_) {
    if (older == &waiter) return true;
    if (!RefusedLocked(*older)) return false;
  }
  return true;
}

Budget::DrainProgress Budget::DrainStep(Waiter* waiter, uint64_t free_bytes,
                                        uint64_t* evicted) {
  // Where the set stands: what it will free, and whether any lease is out.
  uint64_t covered = free_bytes;
  uint64_t idle = 0;  // of the set's members, those whose last lease ended
  bool leased = false;
  std::erase_if(waiter->set, [&](auto& entry) {
    auto& [member, victim] = entry;
    if (waiter->failed.count(victim.record_id) != 0) {
      member->SetDraining(victim, false, waiter->for_what);
      return true;
    }
    switch (member->DrainStateOf(victim)) {
      case DrainState::kGone:
        return true;
      case DrainState::kBlocked:
        member->SetDraining(victim, false, waiter->for_what);
        return true;
      case DrainState::kLeased:
        leased = true;
        break;
      case DrainState::kIdle:
        idle = SaturatingAdd(idle, victim.bytes);
        break;
    }
    covered = SaturatingAdd(covered, victim.bytes);
    return false;
  });
  if (covered < waiter->bytes) {
    // Extend the set in policy order, leased and idle alike, leaving out
    // what the waiter holds itself.
    std::unordered_set<uint64_t> skip(waiter->failed);
    if (waiter->holds != nullptr) {
      skip.insert(waiter->holds->begin(), waiter->holds->end());
    }
    for (const auto& [member, victim] : waiter->set) {
      skip.insert(victim.record_id);
    }
    const auto members = Members();
    // Choose the whole extension before marking any of it: a set that
    // cannot cover the waiter never stops taking leases, not even for the
    // moment between marking and giving up (a hit then would miss for
    // nothing).
    std::vector<std::pair<std::shared_ptr<BudgetMember>, VictimCandidate>>
        chosen;
    uint64_t would_cover = covered;
    while (would_cover < waiter->bytes) {
      std::shared_ptr<BudgetMember> best_member;
      VictimCandidate best;
      for (const auto& member : members) {
        VictimCandidate candidate;
        if (!member->BestDrainVictim(skip, &candidate)) continue;
        if (!best_member || candidate.priority < best.priority ||
            (candidate.priority == best.priority && candidate.seq < best.seq)) {
          best = std::move(candidate);
          best_member = member;
        }
      }
      if (!best_member) break;
      skip.insert(best.record_id);
      would_cover = SaturatingAdd(would_cover, best.bytes);
      chosen.emplace_back(std::move(best_member), std::move(best));
    }
    if (would_cover >= waiter->bytes) {
      for (auto& [member, victim] : chosen) {
        // A record pinned, retired, removed or taken by another drain since
        // it was chosen is left out; the next look chooses again.
        if (!member->SetDraining(victim, true, waiter->for_what)) continue;
        covered = SaturatingAdd(covered, victim.bytes);
        waiter->set.emplace_back(member, std::move(victim));
      }
      if (covered < waiter->bytes) return DrainProgress::kAgain;
    } else {
      // Pinned, or held by the waiter itself: no drain serves it. It waits
      // as before drains existed, and younger waiters may drain meanwhile.
      bool end = false;
      const bool had_set = !waiter->set.empty();
      {
        base::MutexLock lock(&mu_);
        if (drain_ == waiter) {
          drain_ = nullptr;
          owed_ = 0;
          end = true;
        }
      }
      // Its set takes leases again (which wakes the waiters) before it is
      // marked refused, so that those wake-ups do not make it try again.
      if (end) FinishDrain(waiter);
      {
        base::MutexLock lock(&mu_);
        // Wakes the younger waiters, which may drain now. A refusal alone
        // changes nothing a drain could use, so it does not expire other
        // refusals (two refused waiters would retry each other for ever);
        // the end of a drain that held records does: they may drain again.
        ++change_count_;
        if (!(end && had_set)) ++quiet_changes_;
        waiter->refused = true;
        waiter->refused_over_failed = !waiter->failed.empty();
        waiter->refused_at = change_count_ - quiet_changes_;
        waiter->refused_at_raw = change_count_;
      }
      changed_.NotifyAll();
      return DrainProgress::kCannot;
    }
    // A drain has begun once its set first covers the waiter.
    if (!waiter->drain_counted) {
      waiter->drain_counted = true;
      drains_.fetch_add(1, std::memory_order_relaxed);
    }
    return DrainProgress::kAgain;  // look at the new members' leases
  }
  if (leased) {
    // The set's idle members with the idle records outside it may cover the
    // waiter already: then they are its room, as for any reservation (the
    // caller evicts outside the set), and the rest of the set waits for
    // nothing. Else it waits for the set's last lease.
    const uint64_t short_of =
        waiter->bytes > free_bytes ? waiter->bytes - free_bytes : 0;
    const uint64_t outside =
        EvictableBytes(waiter->failed, std::numeric_limits<double>::infinity());
    if (idle == 0 || outside >= short_of || idle + outside < short_of) {
      return DrainProgress::kWait;
    }
  }
  // Every lease of the set ended (none can be taken), or its idle members
  // are enough: evict them.
  bool failed = false;
  for (const auto& [member, victim] : waiter->set) {
    if (leased && member->DrainStateOf(victim) != DrainState::kIdle) continue;
    switch (member->EvictDrained(victim)) {
      case EvictOutcome::kEvicted:
        ++*evicted;
        break;
      case EvictOutcome::kUnloadFailed:
        // It stays resident at its place; the set goes on without it.
        waiter->failed.insert(victim.record_id);
        failed = true;
        break;
      case EvictOutcome::kChanged:
        break;  // removed meanwhile: its bytes are back already
    }
  }
  if (failed) {
    base::MutexLock lock(&mu_);
    waiter->failed_at = change_count_;
  }
  return DrainProgress::kAgain;
}

void Budget::FinishDrain(Waiter* waiter) {
  for (const auto& [member, victim] : waiter->set) {
    member->SetDraining(victim, false, waiter->for_what);
  }
  waiter->set.clear();
  waiter->drain_counted = false;
  changed_.NotifyAll();
  // What the set held may be evictable again, over a shrunken capacity too.
  if (over_capacity_.load()) EvictToCapacity();
}

}  // namespace modelcache
