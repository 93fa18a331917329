// The daemon's threads off the loop: the load pool, the TTL expiry thread
// and the background thread (lazyfree and chores) (design note:
// daemon_internal.h).
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

void Daemon::Impl::PoolThread() {
  for (;;) {
    std::shared_ptr<Task> task;
    {
      base::MutexLock lock(&pool_mu_);
      while (pool_queue_.empty() && !pool_stop_) pool_cv_.Wait(&pool_mu_);
      if (pool_queue_.empty()) return;
      task = std::move(pool_queue_.front());
      pool_queue_.pop_front();
    }
    RunTask(*task);
    {
      base::MutexLock lock(&inbox_mu_);
      completed_.push_back(std::move(task));
    }
    Wake();
  }
}

void Daemon::Impl::RunTask(Task& task) {
  AcquireOptions options;
  options.when_full = task.prefetch ? WhenFull::kWait : task.when_full;
  options.request = !task.prefetch;
  options.arrival = task.arrival;
  options.holds = task.holds;
  options.interrupt.every = kInterruptEvery;
  options.interrupt.check = [this, &task] {
    if (task.cancel.load() || shutting_down_.load()) throw detail::Cancelled{};
  };
  const CatalogModel& model = task.model;
  try {
    const uint64_t expected = detail::ExpectedCopyBytes(copy_options_, model);
    task.expected_bytes = expected;
    const Loader loader = [&] {
      Loaded loaded = LoadForStore(model);
      task.loaded = true;
      return loaded;
    };
    // Under "fail", CAPACITY is answered only once nothing on its way
    // could make the room (protocol.h): after each refusal, in turn,
    //   - the recalls of idle leases that the look started (GateUnload):
    //     their answers, bounded by the recall timeout;
    //   - one pass of the loop over every socket, so that a release sent
    //     before this acquire was is read (it may come on another
    //     connection, read after this one's acquire);
    //   - the recalls of leases in use of delegating holders, when their
    //     room would be enough (RecallInUse), and their answers.
    // Each is followed by another look; each is tried once but the first,
    // which follows every look that started recalls.
    const Clock::time_point began = Clock::now();
    bool passed = false;
    bool recalled_in_use = false;
    for (int attempt = 0;; ++attempt) {
      const uint64_t recalls = RecallsStarted();
      try {
        task.lease = store_->Acquire(model.id, expected, loader, options);
        break;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kCapacity || task.prefetch || attempt >= 6) {
          throw;
        }
        const Clock::time_point answers_by =
            Clock::now() + 2 * options_.recall_timeout;
        if (WaitForRecalls(recalls, answers_by)) continue;
        if (!passed) {
          passed = true;
          AwaitLoopPass();
          continue;
        }
        if (!recalled_in_use && RecallInUse(model.id, expected, began)) {
          recalled_in_use = true;
          WaitForRecalls(recalls, answers_by);
          continue;
        }
        throw;
      }
    }
    if (task.pin) store_->Pin(model.id);
  } catch (...) {
    task.lease.Release();
    task.error = std::current_exception();
  }
}

Loaded Daemon::Impl::LoadForStore(const CatalogModel& model) {
  const ReadingMark reading(this, model.id);
  const Clock::time_point start = Clock::now();
  std::shared_ptr<detail::ModelCopy> copy =
      detail::LoadCopy(copy_options_, model);
  const uint64_t bytes = copy->bytes();
  // Off every lock: only this load (and those joining it) waits.
  if (throttle_) throttle_->Hold(start, bytes);
  // Written down before any client can map it (daemon_reclaim.cc).
  RecordCopy(*copy);
  const void* id = copy.get();
  return Loaded{std::move(copy), bytes, [this, id] { GateUnload(id); }};
}

void Daemon::Impl::ExpiryThread() {
  for (;;) {
    {
      base::MutexLock lock(&expiry_mu_);
      const Clock::time_point next = Clock::now() + expiry_period_;
      while (!expiry_stop_ && Clock::now() < next) {
        expiry_cv_.WaitUntil(&expiry_mu_, next);
      }
      if (expiry_stop_) return;
    }
    store_->EvictExpired();
  }
}

void Daemon::Impl::Later(std::function<void()> chore) {
  {
    base::MutexLock lock(&background_mu_);
    if (background_running_) {
      chores_.push_back(std::move(chore));
      background_cv_.NotifyAll();
      return;
    }
  }
  chore();
}

void Daemon::Impl::BackgroundThread() {
  background_mu_.Lock();
  for (;;) {
    while (chores_.empty() && !background_stop_) {
      background_cv_.Wait(&background_mu_);
    }
    if (chores_.empty()) break;  // stopped, and every chore done
    std::function<void()> chore = std::move(chores_.front());
    chores_.pop_front();
    background_mu_.Unlock();
    chore();
    chore = nullptr;  // what it holds goes here too
    background_mu_.Lock();
  }
  background_running_ = false;
  background_mu_.Unlock();
}

void Daemon::Impl::BeforeRead() {
  if (options_.test_load_gate_fd >= 0) {
    char byte;
    ssize_t n;
    do {
      n = ::read(options_.test_load_gate_fd, &byte, 1);
    } while (n < 0 && errno == EINTR);
  }
  if (shutting_down_.load()) {
    throw Error(ErrorCode::kUnavailable, "the daemon is shutting down");
  }
}

}  // namespace modelcache::serve
