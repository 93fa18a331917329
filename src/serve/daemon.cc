// The daemon: setup, the event loop, leases, waiters, tasks and orphans.
// The design note is at the top of daemon_internal.h.
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
#include "files.h"
#include "modelcache/base/bytes.h"
#include "modelcache/core/policy.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"
#include "proc_maps.h"
#include "socket.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77  // Linux 6.5
#endif

namespace modelcache::serve {

using detail::Connection;
using detail::Disconnect;
using detail::Result;
using detail::Task;

namespace detail {

const char* ResultName(Result result) {
  switch (result) {
    case Result::kHit:
      return "hit";
    case Result::kLoaded:
      return "loaded";
    case Result::kNotFound:
      return "not_found";
    case Result::kTooLarge:
      return "too_large";
    case Result::kCapacity:
      return "capacity";
    case Result::kTimeout:
      return "timeout";
    case Result::kLoadFailed:
      return "load_failed";
    case Result::kBusy:
      return "busy";
    case Result::kInvalid:
      return "invalid";
    case Result::kUnavailable:
    case Result::kCount:
      break;
  }
  return "unavailable";
}

Result ResultOf(ServeCode code) {
  switch (code) {
    case ServeCode::kNotFound:
      return Result::kNotFound;
    case ServeCode::kTooLarge:
      return Result::kTooLarge;
    case ServeCode::kCapacity:
      return Result::kCapacity;
    case ServeCode::kTimeout:
      return Result::kTimeout;
    case ServeCode::kLoadFailed:
      return Result::kLoadFailed;
    case ServeCode::kBusy:
      return Result::kBusy;
    case ServeCode::kInvalid:
      return Result::kInvalid;
    case ServeCode::kUnavailable:
      return Result::kUnavailable;
  }
  return Result::kInvalid;
}

const char* DisconnectName(Disconnect reason) {
  switch (reason) {
    case Disconnect::kClosed:
      return "closed";
    case Disconnect::kProcessExit:
      return "process_exit";
    case Disconnect::kSlowReader:
      return "slow_reader";
    case Disconnect::kRefused:
      return "refused";
    case Disconnect::kError:
      return "error";
    case Disconnect::kShutdown:
    case Disconnect::kCount:
      break;
  }
  return "shutdown";
}

}  // namespace detail

namespace {

// epoll tags: the kind in the top byte, an id below.
enum Tag : uint64_t {
  kListenTag = 1,
  kEventTag = 2,
  kSignalTag = 3,
  kConnTag = 4,        // id: connection
  kConnPidTag = 5,     // id: connection
  kOrphanPidTag = 6,   // id: orphan group
  kRestartPidTag = 7,  // id: pid
  kPauseHookTag = 8
};
constexpr int kTagShift = 56;
uint64_t Tagged(uint64_t kind, uint64_t id) { return (kind << kTagShift) | id; }

// Datagrams read from one connection per wakeup: a flooding client waits
// its turn behind the others.
constexpr int kReadsPerWakeup = 16;
constexpr int kAcceptsPerWakeup = 64;
constexpr std::chrono::milliseconds kInterruptEvery{10};

std::string ErrnoText(int error) {
  char buffer[256];
  return ::strerror_r(error, buffer, sizeof(buffer));
}

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

uint64_t Fnv1a(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

void EpollAdd(int epoll, int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
    const int e = errno;
    throw Error(ErrorCode::kIo, "epoll_ctl: " + ErrnoText(e));
  }
}

void EpollMod(int epoll, int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  ::epoll_ctl(epoll, EPOLL_CTL_MOD, fd, &ev);
}

void EpollDel(int epoll, int fd) {
  if (fd >= 0) ::epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nullptr);
}

// Whether the process behind `pidfd` has exited.
bool PeerGone(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
}

int PidfdOpen(pid_t pid) {
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

}  // namespace

// ---------------------------------------------------------------- setup ----

Daemon::Impl::Impl(DaemonOptions options)
    : options_(std::move(options)),
      load_seconds_(
          {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}),
      acquire_wait_seconds_({0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5,
                             1, 5, 10, 30, 60}),
      loop_iteration_seconds_({0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005,
                               0.01, 0.05, 0.1, 0.5, 1, 5}) {
  const Limits& l = options_.limits;
  if (l.max_clients < 1 || l.max_requests_per_client < 1 ||
      l.max_leases_per_client < 1 || l.max_queued_replies < 1 ||
      l.load_slots < 1 || l.max_waiters < 1) {
    Invalid("every limit must be at least 1");
  }
  if (options_.load_threads < 1) Invalid("load threads must be at least 1");
  if (options_.host_capacity_bytes == 0) {
    Invalid("the host capacity must be more than 0 bytes");
  }
  if (!(options_.throttle_load_bytes_per_second > 0)) {
    Invalid("the throttle's load bandwidth must be above 0 bytes per second");
  }
  if (options_.throttle_load_latency.count() < 0) {
    Invalid("the throttle's load latency must be 0 or more");
  }
  if (std::isfinite(options_.throttle_load_bytes_per_second) ||
      options_.throttle_load_latency.count() > 0) {
    throttle_ = std::make_unique<detail::LoadThrottle>(
        options_.throttle_load_bytes_per_second,
        std::chrono::duration_cast<Clock::duration>(
            options_.throttle_load_latency));
  }
  if (options_.catalog_path.empty()) Invalid("a catalog is needed");
  if (options_.model_root.empty()) Invalid("a model root is needed");

  // Catalog and root first: nothing else is worth setting up without them.
  // What `--check-catalog` refuses is refused here, with its message.
  {
    auto catalog = std::make_shared<const Catalog>(
        Catalog::FromFile(options_.catalog_path));
    root_fd_ = detail::OpenRoot(options_.model_root);
    detail::CheckCatalogFiles(*catalog, root_fd_.get(), nullptr);
    base::MutexLock lock(&catalog_mu_);
    catalog_ = std::move(catalog);
  }

  // Descriptors: two per connection (socket, pidfd) and two per file copy.
  rlimit limit;
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 &&
      limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }

  socket_path_ = options_.socket_path;
  if (socket_path_.empty()) Invalid("a socket path is needed");
  if (socket_path_[0] == '@' || socket_path_[0] == '\0') {
    Invalid("abstract sockets are not allowed: give a path");
  }
  socket_path_ = std::filesystem::absolute(socket_path_).lexically_normal();
  const std::string instance =
      options_.instance.empty()
          ? [&] {
              char hex[17];
              std::snprintf(hex, sizeof(hex), "%08llx",
                            static_cast<unsigned long long>(
                                Fnv1a(socket_path_) & 0xffffffffull));
              return std::string(hex);
            }()
          : options_.instance;
  if (!protocol::IsValidModelId(instance) || instance.size() > 32) {
    Invalid("instance name '" + instance +
            "' must be 1 to 32 characters of [A-Za-z0-9._-]");
  }
  memfd_prefix_ = "modelcache:" + instance + ":";

  copy_options_.root_fd = root_fd_.get();
  copy_options_.memfd_prefix = memfd_prefix_;
  copy_options_.threads = options_.load_threads;
  copy_options_.use_openat2 = !options_.test_per_component_open;
  copy_options_.observer = [this](const detail::MemfdId& id, bool live) {
    base::MutexLock lock(&live_mu_);
    if (live) {
      live_.insert(id);
    } else {
      live_.erase(id);
    }
  };
  copy_options_.before_read = [this](uint64_t) { BeforeRead(); };
  copy_options_.free_later = [this](std::vector<detail::FileCopy> files) {
    auto held =
        std::make_shared<std::vector<detail::FileCopy>>(std::move(files));
    Later([held] { held->clear(); });
  };

  {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    next_lease_ = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(now).count());
  }

  CreateStore();

  epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  event_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epoll_fd_ || !event_fd_) {
    const int e = errno;
    throw Error(ErrorCode::kIo,
                "cannot create the event loop: " + ErrnoText(e));
  }
  EpollAdd(epoll_fd_.get(), event_fd_.get(), EPOLLIN, Tagged(kEventTag, 0));
  if (options_.handle_signals) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    signal_fd_.reset(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
    if (!signal_fd_) {
      const int e = errno;
      throw Error(ErrorCode::kIo, "signalfd: " + ErrnoText(e));
    }
    EpollAdd(epoll_fd_.get(), signal_fd_.get(), EPOLLIN, Tagged(kSignalTag, 0));
  }
  if (options_.test_pause_reads_fd >= 0) {
    EpollAdd(epoll_fd_.get(), options_.test_pause_reads_fd, EPOLLIN,
             Tagged(kPauseHookTag, 0));
  }

  Log(weights::DescribeShmemHugePages(weights::ShmemHugePageMode()));
  RescanOrphans();
  Listen();

  {
    base::MutexLock lock(&background_mu_);
    background_running_ = true;
  }
  background_ = std::thread([this] { BackgroundThread(); });
  for (int i = 0; i < options_.limits.load_slots; ++i) {
    pool_.emplace_back([this] { PoolThread(); });
  }
  if (expiry_period_.count() > 0) {
    expiry_ = std::thread([this] { ExpiryThread(); });
  }
  // Pinned models load first, by priority.
  std::vector<CatalogModel> pinned;
  for (const CatalogModel& m : catalog()->models()) {
    if (m.pinned) pinned.push_back(m);
  }
  std::stable_sort(pinned.begin(), pinned.end(),
                   [](const CatalogModel& a, const CatalogModel& b) {
                     return a.priority > b.priority;
                   });
  for (const CatalogModel& m : pinned) StartPrefetch(m, true, nullptr);
}

void Daemon::Impl::CreateStore() {
  // The registry's names (PolicyByName throws listing them for an unknown
  // one); an offline policy needs the future and cannot serve.
  const NamedPolicy named = PolicyByName(options_.policy);
  if (named.offline) {
    std::string known;
    for (const std::string& name : PolicyNames()) {
      known += (known.empty() ? "" : ", ") + name;
    }
    Invalid("policy '" + options_.policy +
            "' needs the future: it is for replays only (online policies: " +
            known + ")");
  }
  {
    base::MutexLock lock(&capacity_mu_);
    configured_ = options_.host_capacity_bytes;
  }
  CacheOptions cache;
  cache.name = "serve";
  cache.capacity_bytes = options_.host_capacity_bytes;
  cache.WithPolicy(named);
  if (named.idle_ttl.count() > 0) {
    // A model idle past the TTL goes within a quarter of it more (at most a
    // second more).
    expiry_period_ = std::clamp<std::chrono::nanoseconds>(
        named.idle_ttl / 4, std::chrono::milliseconds(1),
        std::chrono::seconds(1));
  }
  cache.shard_bits = 2;
  cache.on_event = [this](const CacheEvent& event) { OnEvent(event); };
  // A keep-alive policy's prewarms load like any load of the daemon: on the
  // store's keep-alive thread, they take a load slot (waiting for one) and
  // the throttle, as replay's model of them does.
  cache.prewarm_source =
      [this](std::string_view key) -> std::optional<PrewarmSource> {
    const std::shared_ptr<const Catalog> cat = catalog();
    const CatalogModel* model = cat->Find(key);
    if (model == nullptr || model->id != key) return std::nullopt;
    CatalogModel spec = *model;
    PrewarmSource source;
    source.expected_bytes = detail::ExpectedCopyBytes(copy_options_, spec);
    source.loader = [this, spec] {
      TakeSlotForPrewarm();
      struct SlotBack {
        Impl* impl;
        ~SlotBack() {
          impl->GiveSlot();
          impl->Wake();  // the loop starts what waited for the slot
        }
      } slot_back{this};
      const ReadingMark reading(this, spec.id);
      const Clock::time_point start = Clock::now();
      std::shared_ptr<detail::ModelCopy> copy =
          detail::LoadCopy(copy_options_, spec);
      const uint64_t bytes = copy->bytes();
      if (throttle_) throttle_->Hold(start, bytes);
      return Loaded{std::move(copy), bytes, {}};
    };
    return source;
  };
  store_ = std::make_unique<ModelCache>(std::move(cache));
}

void Daemon::Impl::Listen() {
  namespace fs = std::filesystem;
  sockaddr_un address{};
  if (socket_path_.size() >= sizeof(address.sun_path)) {
    Invalid("socket path '" + socket_path_ + "' is longer than " +
            std::to_string(sizeof(address.sun_path) - 1) + " bytes");
  }
  const fs::path folder = fs::path(socket_path_).parent_path();
  struct stat st;
  if (::stat(folder.c_str(), &st) != 0) {
    if (::mkdir(folder.c_str(), 0750) != 0) {
      const int e = errno;
      Invalid("cannot create the socket's folder " + folder.string() + ": " +
              ErrnoText(e));
    }
    ::chmod(folder.c_str(), 0750);  // whatever the umask
  } else if (!S_ISDIR(st.st_mode)) {
    Invalid("the socket's folder " + folder.string() + " is not a folder");
  } else if ((st.st_mode & 0007) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", st.st_mode & 07777);
    Invalid("the socket's folder " + folder.string() +
            " is open to others (mode " + mode +
            "); use a folder of mode 0750 or tighter (one that does "
            "not exist is created so)");
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path_.c_str(), socket_path_.size() + 1);

  if (::lstat(socket_path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      Invalid(socket_path_ + " exists and is not a socket");
    }
    // A socket nobody answers on is a predecessor's; one that answers is
    // another daemon's.
    base::UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (probe && ::connect(probe.get(), reinterpret_cast<sockaddr*>(&address),
                           sizeof(address)) == 0) {
      throw Error(ErrorCode::kUnavailable,
                  "another daemon listens on " + socket_path_);
    }
    ::unlink(socket_path_.c_str());
  }
  listen_fd_.reset(
      ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listen_fd_ ||
      ::bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&address),
             sizeof(address)) != 0) {
    const int e = errno;
    throw Error(ErrorCode::kIo,
                "cannot bind " + socket_path_ + ": " + ErrnoText(e));
  }
  if (::chmod(socket_path_.c_str(), 0660) != 0 ||
      ::listen(listen_fd_.get(), SOMAXCONN) != 0 ||
      ::stat(socket_path_.c_str(), &st) != 0) {
    const int e = errno;
    ::unlink(socket_path_.c_str());
    throw Error(ErrorCode::kIo,
                "cannot listen on " + socket_path_ + ": " + ErrnoText(e));
  }
  socket_inode_ = st.st_ino;
  EpollAdd(epoll_fd_.get(), listen_fd_.get(), EPOLLIN, Tagged(kListenTag, 0));
  Log("listening on " + socket_path_ + " (memfds " + memfd_prefix_ + "*)");
}

Daemon::Impl::~Impl() {
  {
    base::MutexLock lock(&pool_mu_);
    pool_stop_ = true;
    pool_cv_.NotifyAll();
  }
  shutting_down_ = true;
  StopSlotWaits();
  if (throttle_) throttle_->Stop();
  for (std::thread& t : pool_) t.join();
  {
    base::MutexLock lock(&expiry_mu_);
    expiry_stop_ = true;
    expiry_cv_.NotifyAll();
  }
  if (expiry_.joinable()) expiry_.join();
  conns_.clear();
  orphan_groups_.clear();
  // Completed tasks never collected hold leases.
  {
    base::MutexLock lock(&inbox_mu_);
    completed_.clear();
  }
  std::map<uint64_t, detail::LeaseEntry> leases;
  {
    base::MutexLock lock(&leases_mu_);
    leases.swap(leases_);
  }
  leases.clear();
  store_.reset();
  // Last: what the store freed is queued for it.
  {
    base::MutexLock lock(&background_mu_);
    background_stop_ = true;
    background_cv_.NotifyAll();
  }
  if (background_.joinable()) background_.join();
  if (listen_fd_) {
    struct stat st;
    if (::stat(socket_path_.c_str(), &st) == 0 && st.st_ino == socket_inode_) {
      ::unlink(socket_path_.c_str());
    }
  }
}

void Daemon::Impl::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::cerr << "modelcache serve: " + line + "\n" << std::flush;
  }
}

std::shared_ptr<const Catalog> Daemon::Impl::catalog() const {
  base::MutexLock lock(&catalog_mu_);
  return catalog_;
}

void Daemon::Impl::OnEvent(const CacheEvent& event) {
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
  }
}

// ------------------------------------------------------------ the loop ----

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
    if (next != Clock::time_point::max()) {
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - now);
      timeout = static_cast<int>(std::clamp<int64_t>(ms.count(), 0, 60'000));
    }
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
      Log("epoll_wait failed: " + ErrnoText(e) + "; shutting down");
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
              !c.doomed && !reads_paused_) {
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
    if (after >= next_rescan_) {
      next_rescan_ = Clock::time_point::max();
      StartRecheck();
    }
    CloseDoomed();
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

void Daemon::Impl::DrainEvents() {
  uint64_t count;
  while (::read(event_fd_.get(), &count, sizeof(count)) > 0) {
  }
  std::vector<std::shared_ptr<Task>> completed;
  std::vector<Command> commands;
  std::vector<std::vector<detail::PidMemfds>> rechecked;
  std::vector<detail::Reloaded> reloaded;
  {
    base::MutexLock lock(&inbox_mu_);
    reloaded.swap(reloaded_);
    completed.swap(completed_);
    commands.swap(commands_);
    rechecked.swap(rechecked_);
    if (health_answered_ != health_asked_) {
      health_answered_ = health_asked_;
      health_cv_.NotifyAll();
    }
  }
  for (auto& task : completed) Complete(std::move(task));
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

void Daemon::Impl::Accept() {
  for (int i = 0; i < kAcceptsPerWakeup && !stopping_; ++i) {
    base::UniqueFd fd(::accept4(listen_fd_.get(), nullptr, nullptr,
                                SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      const int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) return;
      if (e == EMFILE || e == ENFILE) {
        Log("accept: " + ErrnoText(e) + "; a connection waits");
        return;
      }
      continue;  // ECONNABORTED and the like: that peer is gone
    }
    ucred cred{};
    socklen_t length = sizeof(cred);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
      ++disconnects_[static_cast<size_t>(Disconnect::kRefused)];
      continue;
    }
    const auto refuse = [&](ServeCode code, const std::string& why) {
      const std::string message = protocol::EncodeError(0, code, why);
      detail::SendDatagram(fd.get(), message, {}, MSG_DONTWAIT);
      // Closing a socket with unread data makes the peer's next read fail
      // (ECONNRESET) before it reads why: drop what it sent so far.
      detail::Datagram ignored;
      while (detail::ReceiveDatagram(fd.get(), 0, 0, MSG_DONTWAIT, &ignored) >
             0) {
      }
      ++disconnects_[static_cast<size_t>(Disconnect::kRefused)];
    };
    if (!options_.allow_uids.empty() || !options_.allow_gids.empty()) {
      const bool allowed =
          cred.uid == ::geteuid() ||
          std::find(options_.allow_uids.begin(), options_.allow_uids.end(),
                    cred.uid) != options_.allow_uids.end() ||
          std::find(options_.allow_gids.begin(), options_.allow_gids.end(),
                    cred.gid) != options_.allow_gids.end();
      if (!allowed) {
        Log("refused pid " + std::to_string(cred.pid) + ": uid " +
            std::to_string(cred.uid) + " and gid " + std::to_string(cred.gid) +
            " are not allowed");
        refuse(ServeCode::kInvalid, "uid " + std::to_string(cred.uid) +
                                        " is not allowed to connect");
        continue;
      }
    }
    if (static_cast<int>(conns_.size()) >= options_.limits.max_clients) {
      refuse(ServeCode::kBusy, "too many clients (the limit is " +
                                   std::to_string(options_.limits.max_clients) +
                                   ")");
      continue;
    }
    // The pidfd says when the process exits. SO_PEERPIDFD names the very
    // process that connected; pidfd_open of its pid is the fallback on
    // kernels before 6.5.
    int pidfd = -1;
    socklen_t pidfd_length = sizeof(pidfd);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERPIDFD, &pidfd,
                     &pidfd_length) != 0) {
      pidfd = PidfdOpen(cred.pid);
    }
    if (pidfd < 0) {
      ++disconnects_[static_cast<size_t>(Disconnect::kProcessExit)];
      continue;  // the process is already gone
    }
    auto c = std::make_unique<Connection>();
    c->id = next_connection_++;
    c->fd = std::move(fd);
    c->pidfd.reset(pidfd);
    ::fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    c->pid = cred.pid;
    c->uid = cred.uid;
    c->gid = cred.gid;
    EpollAdd(epoll_fd_.get(), c->fd.get(), ConnectionEvents(*c),
             Tagged(kConnTag, c->id));
    EpollAdd(epoll_fd_.get(), c->pidfd.get(), EPOLLIN,
             Tagged(kConnPidTag, c->id));
    conns_.emplace(c->id, std::move(c));
    ++clients_;
  }
}

void Daemon::Impl::Readable(Connection& c) {
  detail::Datagram datagram;
  for (int i = 0; i < kReadsPerWakeup && !c.doomed; ++i) {
    const int r =
        detail::ReceiveDatagram(c.fd.get(), protocol::kMaxMessageBytes,
                                /*max_fds=*/4, MSG_DONTWAIT, &datagram);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      Doom(c, Disconnect::kError);
      return;
    }
    if (r == 0) {
      Doom(c, Disconnect::kClosed);
      return;
    }
    const bool had_fds = !datagram.fds.empty() || datagram.fds_truncated;
    datagram.fds.clear();  // never kept: closed at once
    HandleDatagram(c, datagram.bytes, datagram.truncated, datagram.real_bytes,
                   had_fds);
  }
}

void Daemon::Impl::HandleDatagram(Connection& c, std::string_view bytes,
                                  bool truncated, size_t real_bytes,
                                  bool had_fds) {
  if (truncated) {
    ++protocol_errors_;
    SendError(c, 0, ServeCode::kInvalid,
              "message of " + std::to_string(real_bytes) +
                  " bytes exceeds the limit of " +
                  std::to_string(protocol::kMaxMessageBytes) + " (dropped)");
    return;
  }
  const protocol::ParsedRequest parsed = protocol::ParseRequest(bytes);
  if (had_fds) {
    ++protocol_errors_;
    SendError(c, parsed.id, ServeCode::kInvalid,
              "the daemon accepts no file descriptors (closed them, dropped "
              "the request)");
    return;
  }
  if (!parsed.request) {
    ++protocol_errors_;
    ++acquires_[static_cast<size_t>(Result::kInvalid)];
    SendError(c, parsed.id, ServeCode::kInvalid, parsed.error);
    return;
  }
  const protocol::Request& r = *parsed.request;
  switch (r.op) {
    case protocol::Op::kHello: {
      if (r.version != protocol::kVersion) {
        ++protocol_errors_;
        SendError(c, r.id, ServeCode::kInvalid,
                  "protocol version " + std::to_string(r.version) +
                      " is not supported (this daemon speaks " +
                      std::to_string(protocol::kVersion) + ")");
        return;
      }
      const Limits& l = options_.limits;
      const std::map<std::string, uint64_t> limits = {
          {"max_requests_in_flight",
           static_cast<uint64_t>(l.max_requests_per_client)},
          {"max_leases", static_cast<uint64_t>(l.max_leases_per_client)},
          {"max_queued_replies", static_cast<uint64_t>(l.max_queued_replies)},
          {"max_message_bytes", protocol::kMaxMessageBytes},
      };
      Send(c, {protocol::EncodeHelloReply(r.id, "modelcache 0.1.0", limits),
               {},
               nullptr,
               0});
      return;
    }
    case protocol::Op::kPing:
      Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      return;
    case protocol::Op::kRelease:
      if (c.leases.erase(r.lease) == 0) {
        SendError(c, r.id, ServeCode::kNotFound,
                  "lease " + std::to_string(r.lease) +
                      " is not held by this connection");
        return;
      }
      ReleaseLease(r.lease);
      Send(c, {protocol::EncodeOk(r.id), {}, nullptr, 0});
      return;
    case protocol::Op::kAcquire:
      HandleAcquire(c, r);
      return;
  }
}

void Daemon::Impl::HandleAcquire(Connection& c, const protocol::Request& r) {
  const auto refuse = [&](ServeCode code, const std::string& message) {
    ++acquires_[static_cast<size_t>(detail::ResultOf(code))];
    SendError(c, r.id, code, message);
  };
  if (stopping_) {
    refuse(ServeCode::kUnavailable, "the daemon is shutting down");
    return;
  }
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* model = cat->Find(r.model);
  if (model == nullptr) {
    refuse(ServeCode::kNotFound, "no model '" + r.model + "' in the catalog");
    return;
  }
  const Limits& limits = options_.limits;
  if (c.leases.size() + c.waiters.size() >=
      static_cast<size_t>(limits.max_leases_per_client)) {
    refuse(ServeCode::kBusy,
           "this connection holds " + std::to_string(c.leases.size()) +
               " leases and waits for " + std::to_string(c.waiters.size()) +
               " (the limit is " +
               std::to_string(limits.max_leases_per_client) + ")");
    return;
  }
  const Clock::time_point start = Clock::now();
  if (std::optional<Lease> hit = store_->TryAcquire(model->id)) {
    Grant(c, r.id, model->id, std::move(*hit), Result::kHit, "hit", start);
    return;
  }
  if (c.waiters.size() >= static_cast<size_t>(limits.max_requests_per_client)) {
    refuse(ServeCode::kBusy,
           "this connection has " + std::to_string(c.waiters.size()) +
               " acquires waiting (the limit is " +
               std::to_string(limits.max_requests_per_client) + ")");
    return;
  }
  if (waiters_.size() >= static_cast<size_t>(limits.max_waiters)) {
    refuse(ServeCode::kBusy, std::to_string(waiters_.size()) +
                                 " acquires are waiting (the limit is " +
                                 std::to_string(limits.max_waiters) + ")");
    return;
  }
  AddWaiter(c, r, *model);
}

void Daemon::Impl::Send(Connection& c, detail::Outgoing message) {
  if (c.doomed) return;
  if (c.out.empty()) {
    if (detail::SendDatagram(c.fd.get(), message.bytes, message.fds,
                             MSG_DONTWAIT) == 0) {
      if (message.lease != 0) {
        base::MutexLock lock(&leases_mu_);
        const auto it = leases_.find(message.lease);
        if (it != leases_.end()) it->second.delivered = true;
      }
      return;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      Doom(c, Disconnect::kError);
      return;
    }
  }
  c.out.push_back(std::move(message));
  if (c.out.size() > static_cast<size_t>(options_.limits.max_queued_replies)) {
    Log("pid " + std::to_string(c.pid) + " left " +
        std::to_string(c.out.size()) + " replies unread: disconnected");
    Doom(c, Disconnect::kSlowReader);
    return;
  }
  if (!c.writing) {
    c.writing = true;
    EpollMod(epoll_fd_.get(), c.fd.get(), ConnectionEvents(c),
             Tagged(kConnTag, c.id));
  }
}

void Daemon::Impl::Writable(Connection& c) {
  while (!c.out.empty() && !c.doomed) {
    detail::Outgoing& m = c.out.front();
    if (detail::SendDatagram(c.fd.get(), m.bytes, m.fds, MSG_DONTWAIT) != 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      Doom(c, Disconnect::kError);
      return;
    }
    if (m.lease != 0) {
      base::MutexLock lock(&leases_mu_);
      const auto it = leases_.find(m.lease);
      if (it != leases_.end()) it->second.delivered = true;
    }
    c.out.pop_front();
  }
  if (c.out.empty() && c.writing) {
    c.writing = false;
    EpollMod(epoll_fd_.get(), c.fd.get(), ConnectionEvents(c),
             Tagged(kConnTag, c.id));
  }
}

uint32_t Daemon::Impl::ConnectionEvents(const Connection& c) const {
  return (reads_paused_ ? 0u : static_cast<uint32_t>(EPOLLIN | EPOLLRDHUP)) |
         (c.writing ? static_cast<uint32_t>(EPOLLOUT) : 0u);
}

void Daemon::Impl::PauseHook() {
  const int fd = options_.test_pause_reads_fd;
  char command = 0;
  const ssize_t n = ::read(fd, &command, 1);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  const bool paused = n == 1 && command == 'p';
  if (n != 1) EpollDel(epoll_fd_.get(), fd);  // gone: read on for good
  if (paused != reads_paused_) {
    reads_paused_ = paused;
    for (const auto& [id, c] : conns_) {
      EpollMod(epoll_fd_.get(), c->fd.get(), ConnectionEvents(*c),
               Tagged(kConnTag, id));
    }
  }
  if (n == 1) {
    [[maybe_unused]] const ssize_t w = ::write(fd, &command, 1);
  }
}

void Daemon::Impl::SendError(Connection& c, uint64_t id, ServeCode code,
                             const std::string& message,
                             const std::string& cause) {
  Send(c, {protocol::EncodeError(id, code, message, cause), {}, nullptr, 0});
}

void Daemon::Impl::Doom(Connection& c, Disconnect reason) {
  if (c.doomed) return;
  c.doomed = true;
  c.doom_reason = reason;
  doomed_.push_back(c.id);
}

void Daemon::Impl::CloseDoomed() {
  while (!doomed_.empty()) {
    const uint64_t id = doomed_.back();
    doomed_.pop_back();
    const auto it = conns_.find(id);
    if (it != conns_.end()) Close(id, it->second->doom_reason);
  }
}

void Daemon::Impl::Close(uint64_t id, Disconnect reason) {
  const auto it = conns_.find(id);
  if (it == conns_.end()) return;
  std::unique_ptr<Connection> c = std::move(it->second);
  conns_.erase(it);
  --clients_;
  ++disconnects_[static_cast<size_t>(reason)];
  EpollDel(epoll_fd_.get(), c->fd.get());
  EpollDel(epoll_fd_.get(), c->pidfd.get());
  c->fd.reset();
  c->out.clear();
  for (const uint64_t seq :
       std::vector<uint64_t>(c->waiters.begin(), c->waiters.end())) {
    RemoveWaiter(seq);
  }
  // Leases: released unless a live process may map them.
  const bool dead = reason == Disconnect::kProcessExit ||
                    reason == Disconnect::kShutdown || PeerGone(c->pidfd.get());
  std::vector<uint64_t> release;
  std::vector<uint64_t> orphan;
  {
    base::MutexLock lock(&leases_mu_);
    for (const uint64_t lease : c->leases) {
      const auto l = leases_.find(lease);
      if (l == leases_.end()) continue;
      if (dead || !l->second.delivered) {
        release.push_back(lease);
      } else {
        l->second.connection = 0;
        l->second.orphaned = true;
        orphan.push_back(lease);
      }
    }
  }
  for (const uint64_t lease : release) ReleaseLease(lease);
  if (!orphan.empty()) {
    const uint64_t group = next_group_++;
    detail::OrphanGroup g;
    g.pidfd = std::move(c->pidfd);
    g.pid = c->pid;
    g.leases = orphan;
    orphaned_leases_ += static_cast<int>(orphan.size());
    EpollAdd(epoll_fd_.get(), g.pidfd.get(), EPOLLIN,
             Tagged(kOrphanPidTag, group));
    Log("pid " + std::to_string(c->pid) + " closed its connection holding " +
        std::to_string(orphan.size()) +
        " leases: orphaned until the process exits");
    orphan_groups_.emplace(group, std::move(g));
    ScheduleRescan();
  }
}

void Daemon::Impl::ScheduleRescan() {
  next_rescan_ = std::min(next_rescan_, Clock::now() + options_.orphan_rescan);
}

void Daemon::Impl::CheckOrphanGroups(
    const std::vector<detail::PidMemfds>& found) {
  std::map<pid_t, const detail::PidMemfds*> by_pid;
  for (const detail::PidMemfds& f : found) {
    if (f.known) by_pid[f.pid] = &f;
  }
  std::vector<uint64_t> emptied;
  for (auto& [id, group] : orphan_groups_) {
    const auto f = by_pid.find(group.pid);
    if (f == by_pid.end()) continue;  // not read: nothing is known
    const std::set<std::pair<uint64_t, uint64_t>>& set = f->second->held;
    std::vector<uint64_t> keep;
    std::vector<uint64_t> release;
    {
      base::MutexLock lock(&leases_mu_);
      for (const uint64_t lease : group.leases) {
        const auto it = leases_.find(lease);
        if (it == leases_.end()) continue;
        bool used = false;
        for (const detail::MemfdId& m : it->second.memfds) {
          used = used || set.count({m.dev, m.inode}) != 0;
        }
        (used ? keep : release).push_back(lease);
      }
    }
    if (release.empty()) continue;
    Log("pid " + std::to_string(group.pid) + " no longer maps " +
        std::to_string(release.size()) + " orphaned leases: released");
    orphaned_leases_ -= static_cast<int>(group.leases.size() - keep.size());
    group.leases = std::move(keep);
    for (const uint64_t lease : release) ReleaseLease(lease);
    if (group.leases.empty()) emptied.push_back(id);
  }
  for (const uint64_t id : emptied) {
    EpollDel(epoll_fd_.get(), orphan_groups_.at(id).pidfd.get());
    orphan_groups_.erase(id);
  }
}

void Daemon::Impl::ReleaseOrphanGroup(uint64_t group) {
  const auto it = orphan_groups_.find(group);
  if (it == orphan_groups_.end()) return;
  detail::OrphanGroup g = std::move(it->second);
  orphan_groups_.erase(it);
  EpollDel(epoll_fd_.get(), g.pidfd.get());
  orphaned_leases_ -= static_cast<int>(g.leases.size());
  for (const uint64_t lease : g.leases) ReleaseLease(lease);
}

void Daemon::Impl::Grant(Connection& c, uint64_t request_id,
                         const std::string& model, Lease lease, Result result,
                         const char* load, Clock::time_point start) {
  auto* copy = lease.get<detail::ModelCopy>();
  std::shared_ptr<const detail::ModelCopy> keep = copy->shared_from_this();
  const uint64_t id = ++next_lease_;
  detail::LeaseEntry entry;
  entry.connection = c.id;
  entry.model = model;
  entry.pid = c.pid;
  entry.uid = c.uid;
  entry.bytes = lease.bytes();
  entry.lease = std::move(lease);
  for (const detail::FileCopy& f : keep->files()) {
    entry.memfds.push_back(f.data_id);
    entry.memfds.push_back(f.header_id);
  }
  {
    base::MutexLock lock(&leases_mu_);
    leases_.emplace(id, std::move(entry));
  }
  c.leases.insert(id);
  std::vector<protocol::FileReply> files;
  std::vector<int> fds;
  files.reserve(keep->files().size());
  for (const detail::FileCopy& f : keep->files()) {
    files.push_back({f.name, f.weights.data_bytes(), f.header_bytes});
    fds.push_back(f.header.get());
    fds.push_back(f.data_fd());
  }
  ++acquires_[static_cast<size_t>(result)];
  acquire_wait_seconds_.Observe(
      std::chrono::duration<double>(Clock::now() - start).count());
  Send(c, {protocol::EncodeAcquireReply(request_id, id, model, load, files),
           std::move(fds), std::move(keep), id});
}

void Daemon::Impl::ReleaseLease(uint64_t lease) {
  Lease core;
  {
    base::MutexLock lock(&leases_mu_);
    const auto it = leases_.find(lease);
    if (it == leases_.end()) return;
    core = std::move(it->second.lease);
    leases_.erase(it);
  }
  core.Release();  // outside the lock: may free a retired copy
}

// ------------------------------------------------------ waiters, tasks ----

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
  if (TryTakeSlot()) {
    StartTask(model);
    return;
  }
  const CatalogModel* spec = catalog()->Find(model);
  const int priority = spec != nullptr ? spec->priority : 0;
  slot_queue_.emplace(std::make_pair(-priority, next_order_++),
                      Queued{model, nullptr});
  q.queued = true;
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
  if (!TryTakeSlot()) {
    slot_queue_.emplace(std::make_pair(-model.priority, next_order_++),
                        Queued{model.id, std::move(task)});
    return;
  }
  ++running_;
  base::MutexLock lock(&pool_mu_);
  pool_queue_.push_back(std::move(task));
  pool_cv_.NotifyAll();
}

void Daemon::Impl::StartQueued() {
  while (!slot_queue_.empty() && TryTakeSlot()) {
    Queued next = std::move(slot_queue_.begin()->second);
    slot_queue_.erase(slot_queue_.begin());
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
      try {
        std::rethrow_exception(task->error);
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
      Log("loading '" + model + "' failed: " + result.error);
      if (result.status != 503) {
        // Shown as the model's reason (and /readyz's, when pinned).
        base::MutexLock lock(&stats_mu_);
        model_stats_[model].last_error = result.error;
      }
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

void Daemon::Impl::BeginShutdown() {
  if (stopping_) return;
  stopping_ = true;
  shutting_down_ = true;
  StopSlotWaits();
  if (throttle_) throttle_->Stop();
  EpollDel(epoll_fd_.get(), listen_fd_.get());
  struct stat st;
  if (::stat(socket_path_.c_str(), &st) == 0 && st.st_ino == socket_inode_) {
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
  // the loop: the background thread does it and hands the result back.
  if (reload_in_flight_) {
    reload_again_ = true;  // the file may have changed since it was read
    return;
  }
  reload_in_flight_ = true;
  Later([this] {
    detail::Reloaded result;
    try {
      result.catalog = std::make_shared<const Catalog>(
          Catalog::FromFile(options_.catalog_path));
      detail::CheckCatalogFiles(*result.catalog, root_fd_.get(), nullptr);
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
    reload_error_.clear();
  }
  for (const CatalogModel& m : old->models()) {
    const CatalogModel* now = fresh->Find(m.id);
    if (now == nullptr || now->id != m.id || now->files != m.files) {
      // Retired: current leases keep their copy.
      store_->Invalidate(m.id);
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
  for (const CatalogModel& m : fresh->models()) {
    const CatalogModel* before = old->Find(m.id);
    const bool was_pinned = before != nullptr && before->id == m.id &&
                            before->files == m.files && before->pinned;
    if (m.pinned && !was_pinned && !stopping_) StartPrefetch(m, true, nullptr);
  }
  Log("catalog reloaded: " + std::to_string(fresh->models().size()) +
      " models");
}

// ------------------------------------------------------------- orphans ----

void Daemon::Impl::RescanOrphans() {
  int unreadable = 0;
  const std::vector<detail::MemfdMapping> maps =
      detail::ScanMemfdMappings(memfd_prefix_, ::getpid(), &unreadable);
  std::map<detail::MemfdId, detail::RestartOrphan> found;
  {
    base::MutexLock lock(&live_mu_);
    for (const detail::MemfdMapping& m : maps) {
      const detail::MemfdId id{
          static_cast<uint64_t>(makedev(m.dev_major, m.dev_minor)), m.inode};
      if (live_.count(id) != 0) continue;
      detail::RestartOrphan& o = found[id];
      o.bytes = std::max(o.bytes, weights::PageRoundedBytes(m.reach()));
      o.name = m.name;
      o.pids.insert(m.pid);
    }
  }
  BookRestartOrphans(std::move(found), unreadable, /*now=*/true);
}

void Daemon::Impl::BookRestartOrphans(
    std::map<detail::MemfdId, detail::RestartOrphan> found, int unreadable,
    bool now) {
  uint64_t total = 0;
  std::set<pid_t> pids;
  for (const auto& [id, o] : found) {
    total += o.bytes;
    pids.insert(o.pids.begin(), o.pids.end());
  }
  for (auto it = restart_pids_.begin(); it != restart_pids_.end();) {
    if (pids.count(it->first) == 0) {
      EpollDel(epoll_fd_.get(), it->second.get());
      it = restart_pids_.erase(it);
    } else {
      ++it;
    }
  }
  for (const pid_t pid : pids) WatchPid(pid);
  const uint64_t before = orphaned_.exchange(total);
  if (before != total) {
    if (now) {
      base::MutexLock lock(&capacity_mu_);
      ApplyCapacity();
    } else {
      // Off the loop: it may wait for PUT /v1/budget's evictions. The
      // orphaned bytes only shrink after start, so the store's capacity
      // growing a little later keeps used + orphaned within the capacity.
      Later([this] {
        {
          base::MutexLock lock(&capacity_mu_);
          ApplyCapacity();
        }
        capacity_applied_ = true;  // the loop retries what orphans held up
        Wake();
      });
    }
  }
  if (total < before && now) RetryBlockedByOrphans();
  if (before != total) {
    Log("orphaned copies of a predecessor: " + FormatBytes(total) + " in " +
        std::to_string(found.size()) + " memfds mapped by " +
        std::to_string(pids.size()) + " processes");
  }
  {
    base::MutexLock lock(&orphans_mu_);
    restart_orphans_ = std::move(found);
    unreadable_maps_ = unreadable;
  }
  if (total > 0) ScheduleRescan();
}

void Daemon::Impl::RetryBlockedByOrphans() {
  // Room came back: loads held up by orphans try again.
  std::vector<std::string> blocked;
  for (auto& [model, q] : queues_) {
    if (q.blocked_by_orphans) {
      q.blocked_by_orphans = false;
      if (!q.waiters.empty()) blocked.push_back(model);
    }
  }
  for (const std::string& model : blocked) Dispatch(model);
}

void Daemon::Impl::RestartPidExited(pid_t pid) {
  std::map<detail::MemfdId, detail::RestartOrphan> orphans;
  int unreadable;
  {
    base::MutexLock lock(&orphans_mu_);
    orphans = restart_orphans_;
    unreadable = unreadable_maps_;
  }
  for (auto it = orphans.begin(); it != orphans.end();) {
    it->second.pids.erase(pid);
    it = it->second.pids.empty() ? orphans.erase(it) : std::next(it);
  }
  BookRestartOrphans(std::move(orphans), unreadable, /*now=*/false);
}

void Daemon::Impl::StartRecheck() {
  if (recheck_in_flight_) return;  // ApplyRecheck schedules the next
  std::set<pid_t> pids;
  for (const auto& [id, group] : orphan_groups_) pids.insert(group.pid);
  {
    base::MutexLock lock(&orphans_mu_);
    for (const auto& [id, o] : restart_orphans_) {
      pids.insert(o.pids.begin(), o.pids.end());
    }
  }
  if (pids.empty()) return;
  recheck_in_flight_ = true;
  Later([this, pids] {
    std::vector<detail::PidMemfds> found;
    for (const pid_t pid : pids) {
      std::vector<std::pair<uint64_t, uint64_t>> held;
      detail::PidMemfds f;
      f.pid = pid;
      f.known = detail::ProcessMemfds(pid, memfd_prefix_, &held);
      f.held.insert(held.begin(), held.end());
      found.push_back(std::move(f));
    }
    {
      base::MutexLock lock(&inbox_mu_);
      rechecked_.push_back(std::move(found));
    }
    Wake();
  });
}

void Daemon::Impl::ApplyRecheck(const std::vector<detail::PidMemfds>& found) {
  recheck_in_flight_ = false;
  CheckOrphanGroups(found);
  std::map<pid_t, const detail::PidMemfds*> by_pid;
  for (const detail::PidMemfds& f : found) {
    if (f.known) by_pid[f.pid] = &f;
  }
  std::map<detail::MemfdId, detail::RestartOrphan> orphans;
  int unreadable;
  {
    base::MutexLock lock(&orphans_mu_);
    orphans = restart_orphans_;
    unreadable = unreadable_maps_;
  }
  bool changed = false;
  for (auto it = orphans.begin(); it != orphans.end();) {
    for (auto p = it->second.pids.begin(); p != it->second.pids.end();) {
      const auto f = by_pid.find(*p);
      if (f != by_pid.end() &&
          f->second->held.count({it->first.dev, it->first.inode}) == 0) {
        p = it->second.pids.erase(p);  // it maps that copy no more
        changed = true;
      } else {
        ++p;
      }
    }
    it = it->second.pids.empty() ? orphans.erase(it) : std::next(it);
  }
  if (changed) {
    BookRestartOrphans(std::move(orphans), unreadable, /*now=*/false);
  } else if (!orphans.empty()) {
    ScheduleRescan();
  }
  if (!orphan_groups_.empty()) ScheduleRescan();
}

void Daemon::Impl::WatchPid(pid_t pid) {
  if (restart_pids_.count(pid) != 0) return;
  base::UniqueFd fd(PidfdOpen(pid));
  if (!fd) return;  // gone already: the next rescan sees it
  ::fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
  EpollAdd(epoll_fd_.get(), fd.get(), EPOLLIN,
           Tagged(kRestartPidTag, static_cast<uint64_t>(pid)));
  restart_pids_.emplace(pid, std::move(fd));
}

void Daemon::Impl::ApplyCapacity() {
  const uint64_t configured = configured_.load();
  const uint64_t orphaned = orphaned_.load();
  const uint64_t capacity = configured > orphaned ? configured - orphaned : 0;
  if (store_->budget().capacity() != capacity) store_->SetCapacity(capacity);
}

bool Daemon::Impl::TooLargeForOrphansOnly(uint64_t bytes) const {
  return orphaned_.load() > 0 && bytes <= configured_.load();
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

std::string Daemon::Impl::OrphanNote() const {
  const uint64_t orphaned = orphaned_.load();
  if (orphaned == 0) return "";
  return "; " + FormatBytes(orphaned) +
         " more are held by copies of a previous daemon that processes still "
         "map (orphaned)";
}

// ----------------------------------------------------------------- pool ----

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
  options.interrupt.every = kInterruptEvery;
  options.interrupt.check = [this, &task] {
    if (task.cancel.load() || shutting_down_.load()) throw detail::Cancelled{};
  };
  const CatalogModel& model = task.model;
  try {
    const uint64_t expected = detail::ExpectedCopyBytes(copy_options_, model);
    task.expected_bytes = expected;
    task.lease = store_->Acquire(
        model.id, expected,
        [&] {
          const ReadingMark reading(this, model.id);
          const Clock::time_point start = Clock::now();
          std::shared_ptr<detail::ModelCopy> copy =
              detail::LoadCopy(copy_options_, model);
          const uint64_t bytes = copy->bytes();
          // Off every lock: only this load (and those joining it) waits.
          if (throttle_) throttle_->Hold(start, bytes);
          return Loaded{std::move(copy), bytes, {}};
        },
        options);
    if (task.pin) store_->Pin(model.id);
  } catch (...) {
    task.lease.Release();
    task.error = std::current_exception();
  }
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

// --------------------------------------------------------------- Daemon ----

Daemon::Daemon(DaemonOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Daemon::~Daemon() = default;
void Daemon::Run() { impl_->Run(); }
void Daemon::Shutdown() { impl_->RequestShutdown(); }
void Daemon::Reload() { impl_->RequestReload(); }
HttpResponse Daemon::HandleHttp(const HttpRequest& request) {
  return impl_->HandleHttp(request);
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
