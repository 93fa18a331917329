// The waiters and the load queue: a miss waits on its model, one task per
// model runs on a load slot, its completion answers the waiters (design
// note: daemon_internal.h).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <utility>

#include "daemon_internal.h"
#include "event_loop.h"
#include "files.h"
#include "modelcache/base/bytes.h"
#include "modelcache/core/policy.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"
#include "proc_maps.h"
#include "socket.h"

namespace modelcache::serve {

using detail::Connection;
using detail::Disconnect;
using detail::Result;
using detail::Task;

void Daemon::Impl::AddWaiter(Connection& c, const protocol::Request& r,
                             const CatalogModel& model) {
  detail::Waiter w;
  w.seq = next_waiter_++;
  w.connection = c.id;
  w.request_id = r.id;
  w.model = model.id;
  w.start = Clock::now();
  w.deadline = w.start + std::chrono::milliseconds(r.timeout_ms);
  w.fail_when_full = r.fail_when_full;
  deadlines_.emplace(w.deadline, w.seq);
  c.waiters.insert(w.seq);
  detail::ModelQueue& q = queues_[model.id];
  w.joined = q.task != nullptr || q.queued;
  q.waiters.push_back(w.seq);
  waiters_.emplace(w.seq, std::move(w));
  ++waiting_;
  if (q.task) {
    q.task->cancel = false;
  } else if (!q.queued) {
    Dispatch(model.id);
  }
}

void Daemon::Impl::RemoveWaiter(uint64_t seq, const ServeCode* code,
                                const std::string& message, bool in_queue) {
  const auto it = waiters_.find(seq);
  if (it == waiters_.end()) return;
  detail::Waiter w = std::move(it->second);
  waiters_.erase(it);
  --waiting_;
  for (auto [d, end] = deadlines_.equal_range(w.deadline); d != end; ++d) {
    if (d->second == seq) {
      deadlines_.erase(d);
      break;
    }
  }
  const auto c = conns_.find(w.connection);
  if (c != conns_.end()) {
    c->second->waiters.erase(seq);
    if (code != nullptr) {
      ++acquires_[static_cast<size_t>(detail::ResultOf(*code))];
      SendError(*c->second, w.request_id, *code, message);
    }
  }
  if (!in_queue) return;  // the caller rebuilds the model's list
  const auto q = queues_.find(w.model);
  if (q == queues_.end()) return;
  auto& list = q->second.waiters;
  if (!list.empty() && list.front() == seq) {
    list.pop_front();  // first come, first served: the usual case
  } else {
    list.erase(std::remove(list.begin(), list.end(), seq), list.end());
  }
  if (!list.empty()) return;
  if (q->second.task) {
    q->second.task->cancel = true;  // its check ends the wait
  } else {
    if (q->second.queued) {
      for (auto s = slot_queue_.begin(); s != slot_queue_.end(); ++s) {
        if (!s->second.prefetch && s->second.model == w.model) {
          slot_queue_.erase(s);
          break;
        }
      }
    }
    queues_.erase(q);
  }
}

void Daemon::Impl::Dispatch(const std::string& model) {
  detail::ModelQueue& q = queues_[model];
  if (q.task || q.queued) return;
  // Its copy may come back (daemon_reclaim.cc): EndGrace dispatches it.
  if (AwaitsReclaim(model)) return;
  // During a handover nothing new starts (it waits in the slot queue).
  if (handover_conn_ == 0 && TryTakeSlot()) {
    StartTask(model);
    return;
  }
  const CatalogModel* spec = catalog()->Find(model);
  const int priority = spec != nullptr ? spec->priority : 0;
  slot_queue_.emplace(std::make_pair(-priority, next_order_++),
                      Queued{model, nullptr, OldestArrival(q)});
  q.queued = true;
}

Daemon::Impl::Clock::time_point Daemon::Impl::OldestArrival(
    const detail::ModelQueue& q) const {
  Clock::time_point oldest = Clock::now();
  for (const uint64_t seq : q.waiters) {
    const auto w = waiters_.find(seq);
    if (w != waiters_.end()) oldest = std::min(oldest, w->second.start);
  }
  return oldest;
}

std::vector<uint64_t> Daemon::Impl::OrphanedStoreLeases() const {
  std::vector<uint64_t> ids;
  base::MutexLock lock(&leases_mu_);
  for (const auto& [id, e] : leases_) {
    if (e.orphaned && e.lease) ids.push_back(e.lease.id());
  }
  return ids;
}

std::map<std::pair<int, uint64_t>, Daemon::Impl::Queued>::iterator
Daemon::Impl::NextQueued(Clock::time_point now) {
  auto next = slot_queue_.begin();
  const std::chrono::nanoseconds drain_after = store_->budget().drain_after();
  if (drain_after == kDrainNever) return next;
  auto overdue = slot_queue_.end();
  for (auto it = slot_queue_.begin(); it != slot_queue_.end(); ++it) {
    if (now - it->second.arrival < drain_after) continue;
    if (overdue == slot_queue_.end() ||
        std::make_pair(it->second.arrival, it->first.second) <
            std::make_pair(overdue->second.arrival, overdue->first.second)) {
      overdue = it;
    }
  }
  return overdue != slot_queue_.end() ? overdue : next;
}

void Daemon::Impl::StartTask(const std::string& model) {
  detail::ModelQueue& q = queues_[model];
  q.queued = false;
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* spec = cat->Find(model);
  if (spec == nullptr || spec->id != model) {
    // Gone from the catalog since the request came.
    GiveSlot();
    const ServeCode code = ServeCode::kNotFound;
    for (const uint64_t seq : std::deque<uint64_t>(q.waiters)) {
      RemoveWaiter(seq, &code, "no model '" + model + "' in the catalog");
    }
    return;
  }
  auto task = std::make_shared<Task>();
  task->seq = next_task_++;
  task->model = *spec;
  bool all_fail = !q.waiters.empty();
  for (const uint64_t seq : q.waiters) {
    all_fail = all_fail && waiters_.at(seq).fail_when_full;
  }
  task->when_full = all_fail ? WhenFull::kFail : WhenFull::kWait;
  task->arrival = OldestArrival(q);
  task->holds = OrphanedStoreLeases();
  q.task = task;
  ++running_;
  base::MutexLock lock(&pool_mu_);
  pool_queue_.push_back(std::move(task));
  pool_cv_.NotifyAll();
}

void Daemon::Impl::StartPrefetch(
    const CatalogModel& model, bool pin,
    std::shared_ptr<std::promise<detail::PrefetchResult>> done) {
  auto task = std::make_shared<Task>();
  task->seq = next_task_++;
  task->model = model;
  task->prefetch = true;
  task->pin = pin;
  task->done = std::move(done);
  task->holds = OrphanedStoreLeases();
  if (handover_conn_ != 0 || !TryTakeSlot()) {
    slot_queue_.emplace(std::make_pair(-model.priority, next_order_++),
                        Queued{model.id, std::move(task), Clock::now()});
    return;
  }
  ++running_;
  base::MutexLock lock(&pool_mu_);
  pool_queue_.push_back(std::move(task));
  pool_cv_.NotifyAll();
}

void Daemon::Impl::StartQueued() {
  while (handover_conn_ == 0 && !slot_queue_.empty() && TryTakeSlot()) {
    const auto at = NextQueued(Clock::now());
    Queued next = std::move(at->second);
    slot_queue_.erase(at);
    if (next.prefetch) {
      if (stopping_) {
        GiveSlot();
        if (next.prefetch->done) {
          next.prefetch->done->set_value({503, "the daemon is shutting down"});
        }
        continue;
      }
      ++running_;
      base::MutexLock lock(&pool_mu_);
      pool_queue_.push_back(std::move(next.prefetch));
      pool_cv_.NotifyAll();
    } else {
      StartTask(next.model);
    }
  }
}

bool Daemon::Impl::TryTakeSlot() {
  base::MutexLock lock(&slots_mu_);
  if (slots_used_ >= options_.limits.load_slots) return false;
  ++slots_used_;
  return true;
}

void Daemon::Impl::GiveSlot() {
  base::MutexLock lock(&slots_mu_);
  --slots_used_;
  slots_cv_.NotifyAll();
}

int Daemon::Impl::SlotsUsed() const {
  base::MutexLock lock(&slots_mu_);
  return slots_used_;
}

void Daemon::Impl::TakeSlotForPrewarm() {
  base::MutexLock lock(&slots_mu_);
  while (slots_used_ >= options_.limits.load_slots) {
    if (shutting_down_.load()) {
      throw Error(ErrorCode::kUnavailable, "the daemon is shutting down");
    }
    slots_cv_.Wait(&slots_mu_);
  }
  ++slots_used_;
}

void Daemon::Impl::StopSlotWaits() {
  base::MutexLock lock(&slots_mu_);
  slots_cv_.NotifyAll();
}

void Daemon::Impl::Complete(std::shared_ptr<Task> task) {
  --running_;
  GiveSlot();
  const std::string& model = task->model.id;
  if (task->prefetch) {
    detail::PrefetchResult result;
    if (task->error) {
      bool files = false;
      try {
        std::rethrow_exception(task->error);
      } catch (const detail::FilesUnavailable& e) {
        // Logged by MarkUnavailable (once), and shown as unavailable.
        files = true;
        MarkUnavailable(task->model, {e.what(), e.code()}, /*tried=*/true);
        result = {503, UnavailableMessage(model)};
      } catch (const Error& e) {
        result.error = e.what();
        switch (e.code()) {
          case ErrorCode::kTooLarge:
            result.status = 413;
            if (TooLargeForOrphansOnly(task->expected_bytes)) {
              result.status = 409;
              result.error += OrphanNote();
            }
            break;
          case ErrorCode::kCapacity:
          case ErrorCode::kTimeout:
            result.status = 409;
            result.error += OrphanNote();
            break;
          case ErrorCode::kUnavailable:
            result.status = 503;
            break;
          default:
            result.status = 500;
            break;
        }
      } catch (const std::exception& e) {
        result = {500, e.what()};
      } catch (const detail::Cancelled&) {
        result = {503, "the daemon is shutting down"};
      }
      if (!files) Log("loading '" + model + "' failed: " + result.error);
      if (result.status != 503) {
        // Shown as the model's reason (and /readyz's, when pinned).
        base::MutexLock lock(&stats_mu_);
        model_stats_[model].last_error = result.error;
      }
    } else if (task->loaded) {
      MarkAvailable(model);
    }
    task->lease.Release();
    if (task->done) task->done->set_value(result);
    StartQueued();
    return;
  }
  const auto qit = queues_.find(model);
  if (qit == queues_.end()) {  // every waiter went
    task->lease.Release();
    StartQueued();
    return;
  }
  detail::ModelQueue& q = qit->second;
  if (q.task == task) q.task = nullptr;
  // The model's waiters are answered in one pass, O(waiters): each answered
  // one leaves the indexes (RemoveWaiter, not from the list), and the list
  // becomes the ones left.
  std::deque<uint64_t> waiting;
  waiting.swap(q.waiters);
  std::deque<uint64_t> left;
  // Its files made a copy: whatever they were before, they are valid.
  if (task->lease && task->loaded) MarkAvailable(model);
  if (task->lease) {
    Lease first = std::move(task->lease);
    for (size_t i = 0; i < waiting.size(); ++i) {
      const uint64_t seq = waiting[i];
      const auto w = waiters_.find(seq);
      if (w == waiters_.end()) continue;
      const auto c = conns_.find(w->second.connection);
      if (c == conns_.end() || c->second->doomed) {
        left.push_back(seq);  // its close removes it
        continue;
      }
      Lease lease;
      if (first) {
        lease = std::move(first);
      } else if (std::optional<Lease> hit = store_->TryAcquire(model)) {
        lease = std::move(*hit);
      } else {
        // Retired meanwhile: the rest wait for a new load.
        left.insert(left.end(), waiting.begin() + static_cast<ptrdiff_t>(i),
                    waiting.end());
        break;
      }
      const detail::Waiter waiter = w->second;
      RemoveWaiter(seq, nullptr, "", /*in_queue=*/false);
      Grant(*c->second, waiter.request_id, model, std::move(lease),
            Result::kLoaded, waiter.joined ? "joined" : "miss", waiter.start);
    }
  } else if (task->error) {
    ServeCode code = ServeCode::kLoadFailed;
    std::string message;
    std::string cause;
    bool cancelled = false;
    try {
      std::rethrow_exception(task->error);
    } catch (const detail::Cancelled&) {
      cancelled = true;
    } catch (const detail::FilesUnavailable& e) {
      // The try an acquire made after the back-off (or a model whose files
      // went since it was last loaded): unavailable, until a longer wait.
      MarkUnavailable(task->model, {e.what(), e.code()}, /*tried=*/true);
      code = ServeCode::kUnavailable;
      cause = ErrorCodeName(e.code());
      message = UnavailableMessage(model);
    } catch (const Error& e) {
      message = e.what();
      switch (e.code()) {
        case ErrorCode::kTooLarge:
          code = ServeCode::kTooLarge;
          if (TooLargeForOrphansOnly(task->expected_bytes)) {
            // It fits once the orphans go: those who wait for room do.
            code = ServeCode::kCapacity;
            message += OrphanNote();
            q.blocked_by_orphans = true;
          }
          break;
        case ErrorCode::kCapacity:
          code = ServeCode::kCapacity;
          message += OrphanNote();
          break;
        case ErrorCode::kTimeout:
          code = ServeCode::kTimeout;
          break;
        default:
          code = ServeCode::kLoadFailed;
          cause = ErrorCodeName(e.code());
          message = "loading '" + model + "' failed: " + message;
          break;
      }
    } catch (const std::exception& e) {
      message = "loading '" + model + "' failed: " + e.what();
    } catch (...) {
      message = "loading '" + model + "' failed";
    }
    if (cancelled) {
      left.swap(waiting);
    } else {
      for (const uint64_t seq : waiting) {
        const auto w = waiters_.find(seq);
        if (w == waiters_.end()) continue;
        // After CAPACITY, those who asked to wait for room still do.
        if (code == ServeCode::kCapacity && !w->second.fail_when_full) {
          left.push_back(seq);
          continue;
        }
        ++acquires_[static_cast<size_t>(detail::ResultOf(code))];
        const auto c = conns_.find(w->second.connection);
        const uint64_t request = w->second.request_id;
        RemoveWaiter(seq, nullptr, "", /*in_queue=*/false);
        if (c != conns_.end()) {
          SendError(*c->second, request, code, message, cause);
        }
      }
    }
  } else {
    left.swap(waiting);
  }
  queues_[model].waiters = std::move(left);
  const auto again = queues_.find(model);
  if (again != queues_.end()) {
    if (again->second.waiters.empty() && !again->second.task &&
        !again->second.queued) {
      queues_.erase(again);
    } else if (!again->second.waiters.empty() &&
               !again->second.blocked_by_orphans) {
      Dispatch(model);
    }
  }
  StartQueued();
}

void Daemon::Impl::ExpireWaiters(Clock::time_point now) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const uint64_t seq = deadlines_.begin()->second;
    const auto w = waiters_.find(seq);
    if (w == waiters_.end()) {
      deadlines_.erase(deadlines_.begin());
      continue;
    }
    const std::string model = w->second.model;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        w->second.deadline - w->second.start)
                        .count();
    std::string why;
    const auto q = queues_.find(model);
    if (ReadingNow(model)) {
      why = "its load is still running";
    } else if (q != queues_.end() && q->second.queued) {
      why = "it waits for a load slot (" + std::to_string(SlotsUsed()) +
            " loads running, the limit is " +
            std::to_string(options_.limits.load_slots) + ")";
    } else {
      // Its load waits for room (or has not started): say who holds it.
      why = "waiting for room: " + FormatBytes(store_->budget().used()) +
            " of " + FormatBytes(store_->budget().capacity()) +
            " in use; held by: " + HoldersNote(model) + OrphanNote();
    }
    const ServeCode code = ServeCode::kTimeout;
    RemoveWaiter(seq, &code,
                 "no copy of '" + model + "' within " + std::to_string(ms) +
                     " ms: " + why);
  }
}

Daemon::Impl::ReadingMark::ReadingMark(Impl* impl, std::string model)
    : impl_(impl), model_(std::move(model)) {
  base::MutexLock lock(&impl_->reading_mu_);
  ++impl_->reading_[model_];
}

Daemon::Impl::ReadingMark::~ReadingMark() {
  base::MutexLock lock(&impl_->reading_mu_);
  const auto it = impl_->reading_.find(model_);
  if (--it->second == 0) impl_->reading_.erase(it);
}

bool Daemon::Impl::ReadingNow(const std::string& model) const {
  base::MutexLock lock(&reading_mu_);
  return reading_.count(model) != 0;
}

std::string Daemon::Impl::HoldersNote(const std::string& model) const {
  std::string out;
  for (const EntryInfo& e : store_->Entries()) {
    if (e.bytes == 0 || e.key == model) continue;
    std::string why;
    if (e.state == EntryState::kLoading) why = "loading";
    if (e.state == EntryState::kUnloading) why = "unloading";
    if (e.leases > 0) {
      why += (why.empty() ? "" : ", ") + std::to_string(e.leases) +
             (e.leases == 1 ? " lease" : " leases");
    }
    if (e.pinned) why += (why.empty() ? "" : ", ") + std::string("pinned");
    if (e.state == EntryState::kRetired) {
      why += (why.empty() ? "" : ", ") + std::string("retired");
    }
    if (why.empty()) why = "evictable";
    out += (out.empty() ? "" : ", ") +
           ("'" + e.key + "' (" + FormatBytes(e.bytes) + ", " + why + ")");
  }
  return out.empty() ? "nothing resident" : out;
}

}  // namespace modelcache::serve
