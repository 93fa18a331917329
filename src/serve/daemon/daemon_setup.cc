// The daemon's setup and teardown: options, catalog, root, the store, the
// socket and its folder, the threads (design note: daemon_internal.h).
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

Daemon::Impl::Impl(DaemonOptions options) : options_(std::move(options)) {
  // Before anything else starts a thread or a descriptor is opened: they
  // are descriptors 3 and up (and the LISTEN_ variables are unset).
  if (!options_.takeover) TakeStored();
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

  if (options_.unavailable_retry.count() < 0) {
    Invalid("the unavailable models' retry must be 0 or more");
  }

  // Catalog and root first: nothing else is worth setting up without them.
  // A file that `--check-catalog` refuses costs its model (unavailable),
  // not the daemon: a restart, a takeover or systemd's Restart= must not
  // fail for one model replaced on disk or a mount that blinks. With
  // --strict-catalog it is refused here, with the check's message.
  std::map<std::string, detail::FileProblem> problems;
  {
    auto catalog = std::make_shared<const Catalog>(
        Catalog::FromFile(options_.catalog_path));
    root_fd_ = detail::OpenRoot(options_.model_root);
    if (options_.strict_catalog) {
      detail::CheckCatalogFiles(*catalog, root_fd_.get(), nullptr);
    } else {
      problems = detail::FindFileProblems(*catalog, root_fd_.get());
    }
    const std::string digest = detail::CatalogDigest(
        detail::ReadSmallFile(options_.catalog_path).value_or(""));
    base::MutexLock lock(&catalog_mu_);
    catalog_ = std::move(catalog);
    catalog_digest_ = digest;
  }
  for (const CatalogModel& m : catalog()->models()) {
    const auto p = problems.find(m.id);
    if (p != problems.end()) MarkUnavailable(m, p->second, /*tried=*/false);
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
    {
      base::MutexLock lock(&live_mu_);
      if (live) {
        live_.insert(id);
      } else {
        live_.erase(id);
      }
    }
    if (!live) ForgetRecorded(id);
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

  first_lease_ = next_lease_ + 1;

  CreateStore();

  epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  event_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epoll_fd_ || !event_fd_) {
    const int e = errno;
    throw Error(ErrorCode::kIo,
                "cannot create the event loop: " + base::ErrnoText(e));
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
      throw Error(ErrorCode::kIo, "signalfd: " + base::ErrnoText(e));
    }
    EpollAdd(epoll_fd_.get(), signal_fd_.get(), EPOLLIN, Tagged(kSignalTag, 0));
  }
  if (options_.test_pause_reads_fd >= 0) {
    EpollAdd(epoll_fd_.get(), options_.test_pause_reads_fd, EPOLLIN,
             Tagged(kPauseHookTag, 0));
  }

  Log(weights::DescribeShmemHugePages(weights::ShmemHugePageMode()));
  if (options_.takeover) {
    TakeOver();  // the old daemon's sockets, copies and leases
  } else {
    ReadPredecessorRecord();
    AdoptStored();  // systemd's fd store
  }
  RescanOrphans();
  StartGrace();
  if (!options_.takeover) Listen();

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
  // Pinned models load first, by priority; an unavailable one once its
  // files are valid (MarkAvailable).
  std::vector<CatalogModel> pinned;
  for (const CatalogModel& m : catalog()->models()) {
    if (m.pinned && !IsUnavailable(m.id)) pinned.push_back(m);
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
  // Swap scheduling (DaemonOptions::drain_after). A drained copy takes no
  // store lease, so the loop's TryAcquire reads it as none: an acquire
  // becomes a waiter whose load queues behind the drain; a lease in use
  // that is uncovered is covered again once the drain ends (CoverOnce); a
  // reclaim of it is refused as one of a copy being unloaded is; and a
  // handover waits until no reservation waits for room (ContinueHandover).
  // A worker's local reuse of a delegated lease is invisible to the store:
  // its copy drains once that use ends (DaemonOptions::drain_after).
  cache.drain_after = options_.drain_after;
  cache.on_event = [this](const CacheEvent& event) { OnEvent(event); };
  // A keep-alive policy's prewarms load like any load of the daemon: on the
  // store's keep-alive thread, they take a load slot (waiting for one) and
  // the throttle, as replay's model of them does.
  cache.prewarm_source =
      [this](std::string_view key) -> std::optional<PrewarmSource> {
    const std::shared_ptr<const Catalog> cat = catalog();
    const CatalogModel* model = cat->Find(key);
    if (model == nullptr || model->id != key) return std::nullopt;
    // Its files failed the checks: only an acquire or a reload tries them.
    if (IsUnavailable(model->id)) return std::nullopt;
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
      return LoadForStore(spec);
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
              base::ErrnoText(e));
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
                "cannot bind " + socket_path_ + ": " + base::ErrnoText(e));
  }
  if (::chmod(socket_path_.c_str(), 0660) != 0 ||
      ::listen(listen_fd_.get(), SOMAXCONN) != 0 ||
      ::stat(socket_path_.c_str(), &st) != 0) {
    const int e = errno;
    ::unlink(socket_path_.c_str());
    throw Error(ErrorCode::kIo,
                "cannot listen on " + socket_path_ + ": " + base::ErrnoText(e));
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
  // Completed tasks and adoptions never collected hold leases; adoptions
  // still queued on the background thread use the store.
  {
    base::MutexLock lock(&inbox_mu_);
    while (adoptions_queued_ > 0) adoptions_cv_.Wait(&inbox_mu_);
    completed_.clear();
    adopted_.clear();
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

}  // namespace modelcache::serve
