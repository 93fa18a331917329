// The daemon's facade, its event loop (Run, DrainEvents), shutdown and
// reload. The design note is at the top of daemon_internal.h; each concern
// has a file of its own (daemon_*.cc).
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
#include "modelcache/base/text.h"
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

void Daemon::Impl::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::cerr << "modelcache serve: " + line + "\n" << std::flush;
  }
}

std::string Daemon::Impl::LogRefusedReclaim(const protocol::Request& r,
                                            const std::string& why) const {
  std::string text = "reclaim of lease " + std::to_string(r.lease) + " ('" +
                     r.model + "') refused: " + why;
  Log(text);
  return text;
}

std::shared_ptr<const Catalog> Daemon::Impl::catalog() const {
  base::MutexLock lock(&catalog_mu_);
  return catalog_;
}

void Daemon::Impl::OnEvent(const CacheEvent& event) {
  if (event.type == EventType::kLoaded && detail::g_adopting) return;
  if (event.type == EventType::kLoaded) {
    load_seconds_.Observe(event.seconds);
    base::MutexLock lock(&stats_mu_);
    detail::ModelStats& s = model_stats_[event.key];
    ++s.loads;
    s.last_load_seconds = event.seconds;
    s.last_error.clear();
  } else if (event.type == EventType::kLoadFailed) {
    base::MutexLock lock(&stats_mu_);
    model_stats_[event.key].last_error = event.error;
  } else if (event.type == EventType::kDrainStarted) {
    RecallDraining(event.key);
  }
}

void Daemon::Impl::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n =
      ::write(event_fd_.get(), &one, sizeof(one));
}

void Daemon::Impl::RequestShutdown() {
  shutdown_requested_ = true;
  Wake();
}

void Daemon::Impl::RequestReload() {
  reload_requested_ = true;
  Wake();
}

void Daemon::Impl::Run() {
  std::vector<epoll_event> events(128);
  // modelcache_loop_iteration_seconds: from epoll_wait's return to the
  // next call.
  Clock::time_point iteration_start;
  bool iteration_started = false;
  for (;;) {
    if (stopping_ && running_ == 0) break;
    int timeout = -1;
    const Clock::time_point now = Clock::now();
    Clock::time_point next = next_rescan_;
    if (!deadlines_.empty()) next = std::min(next, deadlines_.begin()->first);
    if (!recall_deadlines_.empty()) {
      next = std::min(next, recall_deadlines_.begin()->first);
    }
    next = std::min(next, next_cover_);
    next = std::min(next, grace_end_);
    next = std::min(next, handover_deadline_);
    if (next != Clock::time_point::max()) {
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - now);
      timeout = static_cast<int>(std::clamp<int64_t>(ms.count(), 0, 60'000));
    }
    // A pass asked for (AwaitLoopPass) is this iteration: it must not
    // sleep, as the wake that asked may have been drained already.
    pass_serving_ = passes_asked_.load();
    if (pass_serving_ > passes_done_.load()) timeout = 0;
    capped_read_ = false;
    if (iteration_started) {
      loop_iteration_seconds_.Observe(
          std::chrono::duration<double>(Clock::now() - iteration_start)
              .count());
    }
    const int n = ::epoll_wait(epoll_fd_.get(), events.data(),
                               static_cast<int>(events.size()), timeout);
    iteration_start = Clock::now();
    iteration_started = true;
    if (n < 0 && errno != EINTR) {
      const int e = errno;
      Log("epoll_wait failed: " + base::ErrnoText(e) + "; shutting down");
      BeginShutdown();
      continue;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      const uint64_t kind = tag >> kTagShift;
      const uint64_t id = tag & ((uint64_t{1} << kTagShift) - 1);
      const uint32_t what = events[i].events;
      switch (kind) {
        case kListenTag:
          Accept();
          break;
        case kEventTag:
          DrainEvents();
          break;
        case kSignalTag: {
          signalfd_siginfo info;
          while (::read(signal_fd_.get(), &info, sizeof(info)) ==
                 static_cast<ssize_t>(sizeof(info))) {
            if (info.ssi_signo == SIGHUP) {
              DoReload();
            } else {
              Log(std::string("signal ") +
                  ::strsignal(static_cast<int>(info.ssi_signo)) +
                  ": shutting down");
              BeginShutdown();
            }
          }
          break;
        }
        case kConnTag: {
          const auto it = conns_.find(id);
          if (it == conns_.end()) break;
          Connection& c = *it->second;
          if ((what & EPOLLOUT) != 0) Writable(c);
          if ((what & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) != 0 &&
              !c.doomed && !ReadsPaused(c)) {
            Readable(c);
          }
          break;
        }
        case kConnPidTag:
          if (conns_.count(id) != 0) Close(id, Disconnect::kProcessExit);
          break;
        case kOrphanPidTag:
          ReleaseOrphanGroup(id);
          break;
        case kRestartPidTag:
          RestartPidExited(static_cast<pid_t>(id));
          break;
        case kPauseHookTag:
          PauseHook();
          break;
        default:
          break;
      }
      CloseDoomed();
    }
    const Clock::time_point after = Clock::now();
    ExpireWaiters(after);
    ExpireRecalls(after);
    if (after >= next_cover_) {
      next_cover_ = Clock::time_point::max();
      CoverUncovered();
    }
    if (after >= grace_end_) EndGrace(nullptr);
    if (handover_conn_ != 0) ContinueHandover(after);
    if (after >= next_rescan_) {
      next_rescan_ = Clock::time_point::max();
      StartRecheck();
    }
    CloseDoomed();
    FlushRoomChanged();
    if (pass_serving_ > passes_done_.load() && !capped_read_) {
      base::MutexLock lock(&inbox_mu_);
      passes_done_ = pass_serving_;
      health_cv_.NotifyAll();
    }
  }
  // Every load is over: close what is left.
  std::vector<uint64_t> ids;
  for (const auto& [id, c] : conns_) ids.push_back(id);
  for (uint64_t id : ids) Close(id, Disconnect::kShutdown);
  std::vector<Command> commands;
  {
    base::MutexLock lock(&inbox_mu_);
    loop_done_ = true;
    commands.swap(commands_);
  }
  for (Command& command : commands) {
    command.done->set_value({503, "the daemon is shutting down"});
  }
  Log("stopped");
}

void Daemon::Impl::AwaitLoopPass() {
  const uint64_t ticket = ++passes_asked_;
  Wake();
  // Bounded: before Run() (a pinned model's load) no loop answers.
  const Clock::time_point deadline = Clock::now() + options_.recall_timeout;
  base::MutexLock lock(&inbox_mu_);
  while (passes_done_.load() < ticket && !loop_done_ &&
         !shutting_down_.load() && Clock::now() < deadline) {
    health_cv_.WaitUntil(
        &inbox_mu_,
        std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
  }
}

void Daemon::Impl::DrainEvents() {
  uint64_t count;
  while (::read(event_fd_.get(), &count, sizeof(count)) > 0) {
  }
  std::vector<std::shared_ptr<Task>> completed;
  std::vector<Command> commands;
  std::vector<std::vector<detail::PidMemfds>> rechecked;
  std::vector<detail::Reloaded> reloaded;
  std::vector<detail::Adoption> adopted;
  {
    base::MutexLock lock(&inbox_mu_);
    reloaded.swap(reloaded_);
    adopted.swap(adopted_);
    completed.swap(completed_);
    commands.swap(commands_);
    rechecked.swap(rechecked_);
    if (health_answered_ != health_asked_) {
      health_answered_ = health_asked_;
      health_cv_.NotifyAll();
    }
  }
  ProcessRecalls();
  for (auto& task : completed) Complete(std::move(task));
  for (detail::Adoption& a : adopted) FinishReclaim(std::move(a));
  for (const auto& found : rechecked) ApplyRecheck(found);
  for (detail::Reloaded& r : reloaded) ApplyReload(std::move(r));
  if (capacity_applied_.exchange(false)) RetryBlockedByOrphans();
  for (Command& command : commands) {
    const std::shared_ptr<const Catalog> cat = catalog();
    const CatalogModel* model = cat->Find(command.model);
    if (stopping_) {
      command.done->set_value({503, "the daemon is shutting down"});
    } else if (model == nullptr) {
      command.done->set_value(
          {404, "no model '" + command.model + "' in the catalog"});
    } else {
      StartPrefetch(*model, command.pin, command.done);
    }
  }
  if (reload_requested_.exchange(false)) DoReload();
  if (shutdown_requested_.exchange(false)) BeginShutdown();
  StartQueued();
}

void Daemon::Impl::BeginShutdown() {
  if (stopping_) return;
  stopping_ = true;
  shutting_down_ = true;
  // What the copies freed from now on leave in the record and the fd
  // store stays there, for a successor to reclaim.
  keep_record_ = true;
  if (notifier_) notifier_->Stopping();
  StopSlotWaits();
  if (throttle_) throttle_->Stop();
  EpollDel(epoll_fd_.get(), listen_fd_.get());
  struct stat st;
  // Handed over: the socket is the successor's now.
  if (!handed_over_.load() && ::stat(socket_path_.c_str(), &st) == 0 &&
      st.st_ino == socket_inode_) {
    ::unlink(socket_path_.c_str());
  }
  listen_fd_.reset();
  const ServeCode code = ServeCode::kUnavailable;
  std::vector<uint64_t> seqs;
  for (const auto& [seq, w] : waiters_) seqs.push_back(seq);
  for (const uint64_t seq : seqs) {
    RemoveWaiter(seq, &code, "the daemon is shutting down");
  }
  for (auto& [key, queued] : slot_queue_) {
    if (queued.prefetch && queued.prefetch->done) {
      queued.prefetch->done->set_value({503, "the daemon is shutting down"});
    }
  }
  slot_queue_.clear();
  Log("shutting down: waiting for " + std::to_string(running_) +
      " loads in flight");
}

void Daemon::Impl::DoReload() {
  // Reading, parsing and checking the catalog (every file's header) is off
  // the loop: the background thread does it and hands the result back. A
  // file that fails costs its model (unavailable), not the reload, unless
  // --strict-catalog.
  if (reload_in_flight_) {
    reload_again_ = true;  // the file may have changed since it was read
    return;
  }
  reload_in_flight_ = true;
  Later([this] {
    detail::Reloaded result;
    try {
      const std::optional<std::string> text =
          detail::ReadSmallFile(options_.catalog_path);
      result.digest = detail::CatalogDigest(text.value_or(""));
      result.catalog = std::make_shared<const Catalog>(
          Catalog::FromFile(options_.catalog_path));
      if (options_.strict_catalog) {
        detail::CheckCatalogFiles(*result.catalog, root_fd_.get(), nullptr);
      } else {
        result.problems =
            detail::FindFileProblems(*result.catalog, root_fd_.get());
      }
    } catch (const std::exception& e) {
      result.catalog = nullptr;
      result.error = e.what();
    }
    {
      base::MutexLock lock(&inbox_mu_);
      reloaded_.push_back(std::move(result));
    }
    Wake();
  });
}

void Daemon::Impl::ApplyReload(detail::Reloaded result) {
  reload_in_flight_ = false;
  if (reload_again_) {
    reload_again_ = false;
    DoReload();
  }
  if (stopping_) return;
  if (!result.catalog) {
    Log("reload failed, keeping the catalog: " + result.error);
    base::MutexLock lock(&catalog_mu_);
    reload_error_ = result.error;
    return;
  }
  const std::shared_ptr<const Catalog> fresh = std::move(result.catalog);
  std::shared_ptr<const Catalog> old;
  {
    base::MutexLock lock(&catalog_mu_);
    old = catalog_;
    catalog_ = fresh;
    catalog_digest_ = result.digest;
    reload_error_.clear();
  }
  for (const CatalogModel& m : old->models()) {
    const CatalogModel* now = fresh->Find(m.id);
    if (now == nullptr || now->id != m.id || now->files != m.files) {
      // Retired: current leases keep their copy; all are recalled.
      RecallRetired(m.id);
      try {
        store_->Invalidate(m.id);
      } catch (const Error& e) {
        // Its unloader refused: a lease of it had no store lease for a
        // moment (being covered). Once more, covered now.
        CoverUncovered();
        try {
          store_->Invalidate(m.id);
        } catch (const Error& again) {
          Log("reload: retiring '" + m.id + "' failed: " + again.what());
        }
      }
    } else if (m.pinned && !now->pinned) {
      try {
        store_->Unpin(m.id);
      } catch (const Error& e) {
        // Not resident is not pinned: nothing to undo. Anything else is the
        // store's, and the operator hears of it (as over HTTP).
        if (e.code() != ErrorCode::kNotFound) {
          Log("reload: unpinning '" + m.id + "' failed: " + e.what());
        }
      }
    }
  }
  // Every file was checked again: what fails is unavailable, what passes
  // available (a pinned one that was not is pinned now, by MarkAvailable).
  std::vector<std::string> gone;
  for (const auto& [id, u] : UnavailableModels()) {
    const CatalogModel* now = fresh->Find(id);
    if (now == nullptr || now->id != id) gone.push_back(id);
  }
  if (!gone.empty()) {
    base::MutexLock lock(&unavailable_mu_);
    for (const std::string& id : gone) unavailable_.erase(id);
  }
  for (const CatalogModel& m : fresh->models()) {
    const auto p = result.problems.find(m.id);
    if (p != result.problems.end()) {
      MarkUnavailable(m, p->second, /*tried=*/false);
    } else if (IsUnavailable(m.id)) {
      MarkAvailable(m.id);
      continue;  // pinned there, if pinned
    }
    const CatalogModel* before = old->Find(m.id);
    const bool was_pinned = before != nullptr && before->id == m.id &&
                            before->files == m.files && before->pinned;
    if (m.pinned && !was_pinned && !stopping_ && !IsUnavailable(m.id)) {
      StartPrefetch(m, true, nullptr);
    }
  }
  Log("catalog reloaded: " + std::to_string(fresh->models().size()) +
      " models" +
      (result.problems.empty()
           ? std::string()
           : ", " + std::to_string(result.problems.size()) + " unavailable"));
}

Daemon::Daemon(DaemonOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Daemon::~Daemon() = default;
void Daemon::Run() { impl_->Run(); }
void Daemon::Shutdown() { impl_->RequestShutdown(); }
void Daemon::Reload() { impl_->RequestReload(); }
HttpResponse Daemon::HandleHttp(const HttpRequest& request) {
  return impl_->HandleHttp(request);
}

void Daemon::SetHandoverListeners(std::vector<std::pair<std::string, int>> fds,
                                  std::function<void()> disown) {
  impl_->SetHandoverListeners(std::move(fds), std::move(disown));
}

int Daemon::TakeHandedOverListener(const std::string& name) {
  return impl_->TakeHandedOverListener(name);
}

bool Daemon::HandedOver() const { return impl_->HandedOver(); }
bool Daemon::NotifyReady(const std::string& status) {
  return impl_->NotifyReady(status);
}

const std::string& Daemon::memfd_prefix() const {
  return impl_->memfd_prefix();
}

void Daemon::BlockSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

}  // namespace modelcache::serve
