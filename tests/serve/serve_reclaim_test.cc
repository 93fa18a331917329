// Reclaim after a crash: a SIGKILLed daemon's successor adopts the copies
// live processes still map when they bring the memfds back, refuses any
// other memfd, and holds acquires back for the grace period
// (daemon_reclaim.cc). The leases here are raw protocol connections of the
// test process, which maps the data memfds as a worker does.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <cstring>
#include <thread>

#include "handover.h"
#include "modelcache/weights/memfd.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

// A lease held by hand: its descriptors (header, data per file) and the
// data mapped.
struct Held {
  uint64_t lease = 0;
  std::string model;
  std::vector<base::UniqueFd> fds;
  void* map = nullptr;
  size_t bytes = 0;
  uint64_t checksum = 0;

  Held() = default;
  Held(Held&& other) noexcept { *this = std::move(other); }
  Held& operator=(Held&& other) noexcept {
    std::swap(lease, other.lease);
    std::swap(model, other.model);
    std::swap(fds, other.fds);
    std::swap(map, other.map);
    std::swap(bytes, other.bytes);
    std::swap(checksum, other.checksum);
    return *this;
  }
  ~Held() {
    if (map != nullptr) ::munmap(map, bytes);
  }
  std::vector<int> Fds() const {
    std::vector<int> out;
    for (const base::UniqueFd& fd : fds) out.push_back(fd.get());
    return out;
  }
  std::pair<uint64_t, uint64_t> DataId() const {
    struct stat st;
    ::fstat(fds[1].get(), &st);
    return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  }
};

// systemd's side of the notify socket, as much as the daemon uses: a
// datagram socket that keeps the descriptors FDSTORE=1 sends under their
// FDNAME, forgets a name on FDSTOREREMOVE=1, and notes READY=1.
class FakeManager {
 public:
  explicit FakeManager(const std::string& path) : path_(path) {
    fd_.reset(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    if (!fd_ || ::bind(fd_.get(), reinterpret_cast<sockaddr*>(&address),
                       sizeof(address)) != 0) {
      throw std::runtime_error("cannot bind " + path);
    }
  }
  const std::string& path() const { return path_; }

  // Reads notifications until `done` holds; false after the bound.
  bool ReadUntil(const std::function<bool()>& done) {
    while (!done()) {
      pollfd p{fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(kBound.count() * 1000)) <= 0) {
        return false;
      }
      detail::Datagram d;
      if (detail::ReceiveDatagram(fd_.get(), 4096, 253, MSG_DONTWAIT, &d) <=
          0) {
        continue;
      }
      std::map<std::string, std::string> vars;
      std::istringstream lines(d.bytes);
      std::string line;
      while (std::getline(lines, line)) {
        const size_t eq = line.find('=');
        if (eq != std::string::npos)
          vars[line.substr(0, eq)] = line.substr(eq + 1);
      }
      if (vars["READY"] == "1") ready = true;
      if (vars["FDSTORE"] == "1") {
        for (base::UniqueFd& fd : d.fds) {
          store[vars["FDNAME"]].push_back(std::move(fd));
        }
      }
      if (vars["FDSTOREREMOVE"] == "1") {
        store.erase(vars["FDNAME"]);
        removed.insert(vars["FDNAME"]);
      }
    }
    return true;
  }

  bool ready = false;
  std::map<std::string, std::vector<base::UniqueFd>> store;
  std::set<std::string> removed;

 private:
  std::string path_;
  base::UniqueFd fd_;
};

class Reclaim : public ServeTest {
 protected:
  // A connection that said hello.
  std::unique_ptr<Raw> Connect() {
    auto raw = std::make_unique<Raw>(socket_);
    EXPECT_TRUE(raw->Send(protocol::EncodeHello(1)));
    const auto hello = raw->Reply();
    EXPECT_TRUE(hello && hello->ok);
    if (hello) {
      EXPECT_EQ(hello->limits.count("reclaim"), 1u);
    }
    return raw;
  }

  Held Acquire(Raw& raw, const std::string& model, uint64_t id,
               std::string* load = nullptr) {
    EXPECT_TRUE(raw.Send(protocol::EncodeAcquire(id, model, 60000, false)));
    const auto reply = raw.Reply();
    Held held;
    if (!reply || !reply->ok) {
      ADD_FAILURE() << "acquire " << model << ": "
                    << (reply ? reply->message : "no reply");
      return held;
    }
    if (load != nullptr) *load = reply->load;
    held.lease = reply->lease;
    held.model = model;
    held.fds = std::move(raw.last_fds());
    EXPECT_EQ(held.fds.size(), 2u);
    struct stat st;
    ::fstat(held.fds[1].get(), &st);
    held.bytes = static_cast<size_t>(st.st_size);
    held.map = ::mmap(nullptr, held.bytes, PROT_READ, MAP_SHARED,
                      held.fds[1].get(), 0);
    EXPECT_NE(held.map, MAP_FAILED);
    held.checksum = Checksum(std::span<const std::byte>(
        static_cast<const std::byte*>(held.map), reply->files[0].data_bytes));
    return held;
  }

  std::optional<protocol::Reply> SendReclaim(Raw& raw, const Held& held,
                                             uint64_t id, bool idle = false) {
    EXPECT_TRUE(raw.Send(
        protocol::EncodeReclaim(id, held.lease, held.model, idle), held.Fds()));
    return raw.Reply();
  }

  void Crash() {
    daemon_->process().Signal(SIGKILL);
    daemon_->process().Wait();
  }

  // A lease of "a" (2 MiB) that a client holds from a daemon started with
  // capacity_hook, which then crashes; its successor is started, and `a`
  // is to be reclaimed from it. Sets `*copy_bytes` to the copy's bytes.
  Held CrashHoldingA(uint64_t* copy_bytes) {
    AddModel("a", 2 * kMiB, 1);
    DaemonOptions options;
    options.catalog = catalog_;
    options.root = root_;
    options.socket = socket_;
    options.capacity = "16MiB";
    options.capacity_hook = true;
    daemon_ = std::make_unique<Daemon>(options);
    return HoldThroughACrash("a", copy_bytes);
  }

  // A lease of `model` that a client holds from the running daemon, which
  // then crashes; the client's connection is closed and the successor
  // started. Sets `*copy_bytes`, when given, to the copy's bytes.
  Held HoldThroughACrash(const std::string& model,
                         uint64_t* copy_bytes = nullptr) {
    auto first = Connect();
    Held held = Acquire(*first, model, 2);
    if (copy_bytes != nullptr) *copy_bytes = CopyBytes(model);
    Crash();
    first->Close();
    daemon_->Start();
    return held;
  }

  // In the grace period: an acquire of `held`'s model on `waiting` waits,
  // `holder` reclaims `held`, and the acquire is answered with that very
  // copy. Returns the acquire's reply.
  std::optional<protocol::Reply> AcquireInTheGracePeriod(Raw& waiting,
                                                         Raw& holder,
                                                         const Held& held) {
    EXPECT_TRUE(
        waiting.Send(protocol::EncodeAcquire(2, held.model, 60000, false)));
    Eventually(
        [&] { return daemon_->Metric("modelcache_waiting_acquires") == 1; },
        "the acquire waits for the reclaim");
    const auto reclaimed = SendReclaim(holder, held, 3);
    EXPECT_TRUE(reclaimed && reclaimed->ok)
        << (reclaimed ? reclaimed->message : "no reply");
    std::optional<protocol::Reply> reply = waiting.Reply();
    EXPECT_TRUE(reply && reply->ok) << (reply ? reply->message : "no reply");
    EXPECT_EQ(waiting.last_fds().size(), 2u);
    if (reply && reply->ok && waiting.last_fds().size() == 2) {
      struct stat st;
      ::fstat(waiting.last_fds()[1].get(), &st);
      EXPECT_EQ(std::make_pair(static_cast<uint64_t>(st.st_dev),
                               static_cast<uint64_t>(st.st_ino)),
                held.DataId());
    }
    return reply;
  }

  std::set<std::string> Origins() {
    std::set<std::string> origins;
    const json books = daemon_->GetJson("/v1/copies");
    for (const json& c : books["copies"]) {
      origins.insert(c["model"].get<std::string>() + ":" +
                     c["origin"].get<std::string>());
    }
    return origins;
  }
};

TEST_F(Reclaim, ASigkilledDaemonsCopiesComeBackFromTheProcessesThatMapThem) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 3 * kMiB, 2);
  StartDaemon("16MiB");
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  Held b = Acquire(*first, "b", 3);
  EXPECT_EQ(a.checksum, checksums_["a"]);
  const uint64_t copy_a = CopyBytes("a");
  const uint64_t copy_b = CopyBytes("b");
  EXPECT_TRUE(fs::exists(socket_ + ".state"));
  EXPECT_EQ(
      fs::status(socket_ + ".state").permissions() & fs::perms::all,
      fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);

  Crash();
  first->Close();
  daemon_->Start();
  // The successor books what is mapped as orphaned until it comes back,
  // and says it waits for it.
  EXPECT_GT(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_reclaim_pending_models"), 2);
  EXPECT_EQ(daemon_->Get("/readyz").status, 503);
  EXPECT_THAT(daemon_->Get("/readyz").body, ::testing::HasSubstr("reclaim"));

  auto second = Connect();
  auto reply = SendReclaim(*second, a, 4);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  reply = SendReclaim(*second, b, 5, /*idle=*/true);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;

  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_reclaim_pending_models"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_reclaims_total{result=\"accepted\"}"),
            2);
  EXPECT_EQ(
      daemon_->Metric("modelcache_adopted_bytes_total{origin=\"reclaimed\"}"),
      static_cast<double>(copy_a + copy_b));
  EXPECT_EQ(daemon_->Budget()["used_bytes"].get<uint64_t>(), copy_a + copy_b);
  EXPECT_EQ(Origins(), (std::set<std::string>{"a:reclaimed", "b:reclaimed"}))
      << daemon_->GetJson("/v1/copies").dump();

  // A fresh process's acquire is a hit on the very same memfd.
  auto fresh = Connect();
  std::string load;
  Held again = Acquire(*fresh, "a", 2, &load);
  EXPECT_EQ(load, "hit");
  EXPECT_EQ(again.DataId(), a.DataId());
  EXPECT_EQ(again.checksum, checksums_["a"]);
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);

  // The reclaimed lease is released as any other.
  ASSERT_TRUE(second->Send(protocol::EncodeRelease(6, a.lease)));
  reply = second->Reply();
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  ExpectWithinBudget(*daemon_);
}

// Two processes map one copy when the daemon dies. The first reclaim brings
// the copy back into the store for both: until the other process reclaims
// its own lease, lets go or exits, the copy stays in use for it, so it is
// never freed under its mapping (an unload cannot take it), and its bytes
// are in the books exactly once. (The soak found a copy evicted after the
// first holder released it while another worker still mapped it, and then
// adopted a second time when that worker reclaimed.)
TEST_F(Reclaim, ACopyTwoProcessesMapStaysInUseUntilTheOtherLetsGo) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB");
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  const uint64_t copy_a = CopyBytes("a");
  // A second process that maps the same copy: a child forked now inherits
  // the mapping, and holds it until it reads a byte (or the pipe closes).
  int go[2];
  ASSERT_EQ(::pipe2(go, O_CLOEXEC), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(go[1]);
    char byte;
    const ssize_t n = ::read(go[0], &byte, 1);
    ::_exit(n == 1 ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  ::close(go[0]);
  // Stops the child by pid however the test ends.
  struct Child {
    pid_t pid;
    int go;
    void Stop() {
      if (pid <= 0) return;
      ::close(go);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
    ~Child() { Stop(); }
  } holder{child, go[1]};

  Crash();
  first->Close();
  daemon_->Start();
  auto second = Connect();
  auto reply = SendReclaim(*second, a, 4);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  // This process's lease, and one held for the child.
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_leases"), 1);
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Budget()["used_bytes"].get<uint64_t>(), copy_a);

  // This process lets go (unmaps, then releases); an unload now must leave
  // the child's mapping in the books.
  ::munmap(a.map, a.bytes);
  a.map = nullptr;
  ASSERT_TRUE(second->Send(protocol::EncodeRelease(5, a.lease)));
  reply = second->Reply();
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  daemon_->Send("POST", "/v1/models/a/unload");
  ExpectBooksCoverMaps(*daemon_);
  ExpectWithinBudget(*daemon_);
  EXPECT_EQ(daemon_->Budget()["used_bytes"].get<uint64_t>(), copy_a);
  EXPECT_EQ(
      daemon_->Metric("modelcache_adopted_bytes_total{origin=\"reclaimed\"}"),
      static_cast<double>(copy_a));

  // The child exits: its hold ends with it, and the copy may go.
  holder.Stop();
  Eventually([&] { return daemon_->Metric("modelcache_orphaned_leases") == 0; },
             "the child's hold ends when it exits");
  daemon_->Send("POST", "/v1/models/a/unload");
  Eventually(
      [&] { return daemon_->Budget()["used_bytes"].get<uint64_t>() == 0; },
      "the copy is freed once no process maps it");
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
}

// Loads on several pool threads at once each write the record: one writer
// at a time, so none fails (two writers shared the temporary file, and the
// second's rename found it gone: "cannot write <socket>.state: No such file
// or directory", which the soak logged), and the record ends with every
// copy, also after the unloads that take them out again.
TEST_F(Reclaim, ConcurrentLoadsAndUnloadsKeepTheRecordWhole) {
  constexpr int kModels = 8;
  for (int i = 0; i < kModels; ++i) {
    AddModel("m" + std::to_string(i), 256 * kKiB, 20 + i);
  }
  StartDaemon("64MiB", {"--load-slots", std::to_string(kModels)});
  const auto recorded = [&] {
    const std::optional<std::string> text =
        detail::ReadSmallFile(socket_ + ".state");
    detail::Record record;
    if (!text || !detail::ParseRecord(*text, &record).empty()) return -1;
    return static_cast<int>(record.copies.size());
  };
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<Raw>> conns;
    for (int i = 0; i < kModels; ++i) {
      conns.push_back(Connect());
      ASSERT_TRUE(conns.back()->Send(
          protocol::EncodeAcquire(2, "m" + std::to_string(i), 60000, false)));
    }
    for (auto& raw : conns) {
      const auto reply = raw->Reply();
      ASSERT_TRUE(reply && reply->ok) << (reply ? reply->message : "none");
      ASSERT_TRUE(raw->Send(protocol::EncodeRelease(3, reply->lease)));
      ASSERT_TRUE(raw->Reply());
    }
    EXPECT_EQ(recorded(), kModels) << "round " << round;
    for (int i = 0; i < kModels; ++i) {
      daemon_->Send("POST", "/v1/models/m" + std::to_string(i) + "/unload");
    }
    Eventually([&] { return recorded() == 0; },
               "the record loses the unloaded copies");
  }
  EXPECT_EQ(daemon_->Metric("modelcache_record_write_failures_total"), 0);
}

// The same through the client, in real worker processes: three workers map
// two copies; after the SIGKILL each client notices the lost connection by
// itself (no call), reconnects and reclaims its leases, and the successor
// loads nothing.
TEST_F(Reclaim, WorkersThatMapTheCopiesReclaimThemThroughTheClient) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 3 * kMiB, 2);
  StartDaemon("16MiB");
  Worker one(socket_);
  Worker two(socket_);
  Worker three(socket_);
  for (const auto& [worker, model] :
       std::vector<std::pair<Worker*, std::string>>{
           {&one, "a"}, {&two, "a"}, {&two, "b"}, {&three, "b"}}) {
    const std::vector<std::string> got = worker->Ok("acquire " + model);
    ASSERT_EQ(got.size(), 3u);
    leases_.Add(got[0]);
  }
  const uint64_t copies = CopyBytes("a") + CopyBytes("b");

  Crash();
  daemon_->Start();
  // No call: each client's keeper sees the connection end and reclaims.
  Eventually(
      [&] {
        return daemon_->Metric(
                   "modelcache_reclaims_total{result=\"accepted\"}") == 4;
      },
      "the four leases reclaimed");
  // The daemon counts a reclaim before its answer reaches the client, which
  // counts it once it has read every answer and published the connection.
  for (const auto& expected : std::vector<std::pair<Worker*, std::string>>{
           {&one, "1"}, {&two, "2"}, {&three, "1"}}) {
    Worker* worker = expected.first;
    const std::vector<std::string> done{expected.second, "0", "0", "0"};
    Eventually([&] { return worker->Ok("reclaims") == done; },
               "a client counts its reclaims");
  }
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_reclaim_pending_models"), 0);
  // The first reclaim of each copy held it for the other worker mapping it;
  // that worker's own reclaim took the hold's place.
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_leases"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_leases"), 4);
  EXPECT_EQ(daemon_->Budget()["used_bytes"].get<uint64_t>(), copies);
  EXPECT_EQ(Origins(), (std::set<std::string>{"a:reclaimed", "b:reclaimed"}));
  EXPECT_EQ(two.Ok("checksum"),
            (std::vector<std::string>{std::to_string(checksums_["a"]),
                                      std::to_string(checksums_["b"])}));

  // A fresh worker's acquire is a hit; the reclaimed leases end as any.
  Worker fresh(socket_);
  const std::vector<std::string> hit = fresh.Ok("acquire b");
  ASSERT_EQ(hit.size(), 3u);
  leases_.Add(hit[0]);
  EXPECT_EQ(hit[1], std::to_string(checksums_["b"]));
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  for (Worker* w : {&one, &two, &three, &fresh}) w->Ok("release-all");
  Eventually([&] { return daemon_->Metric("modelcache_leases") == 0; },
             "every lease released");
  ExpectWithinBudget(*daemon_);
}

// A stopping daemon leaves its record as it is: a plain restart (SIGTERM,
// then a new daemon) reclaims what the workers map, as after a crash.
TEST_F(Reclaim, AStoppedDaemonsSuccessorReclaimsToo) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB");
  Worker worker(socket_);
  const std::vector<std::string> got = worker.Ok("acquire a");
  ASSERT_EQ(got.size(), 3u);
  leases_.Add(got[0]);
  daemon_->process().Signal(SIGTERM);
  EXPECT_EQ(daemon_->process().Wait(), 0);
  daemon_->Start();
  Eventually(
      [&] {
        return daemon_->Metric(
                   "modelcache_reclaims_total{result=\"accepted\"}") == 1;
      },
      "the lease reclaimed after a clean stop");
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(Origins(), (std::set<std::string>{"a:reclaimed"}));
  EXPECT_EQ(worker.Ok("checksum"),
            std::vector<std::string>{std::to_string(checksums_["a"])});
  worker.Ok("release-all");
  Eventually([&] { return daemon_->Metric("modelcache_leases") == 0; },
             "the reclaimed lease released");
}

// Under systemd the copies' memfds are also in its fd store: after a
// SIGKILL, with no worker mapping anything, the successor adopts those the
// record names from what systemd passes back, loads nothing, and removes
// the rest (a forged one here) from the store; a copy freed leaves it.
TEST_F(Reclaim, SystemdsFdStoreBringsBackCopiesNoWorkerMaps) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 1 * kMiB, 2);
  FakeManager manager(dir_ / "notify.sock");
  DaemonOptions options;
  options.catalog = catalog_;
  options.root = root_;
  options.socket = socket_;
  options.capacity = "16MiB";
  options.env = {"NOTIFY_SOCKET=" + manager.path()};
  daemon_ = std::make_unique<Daemon>(options);
  ASSERT_TRUE(manager.ReadUntil([&] { return manager.ready; }));
  {
    Worker worker(socket_);
    for (const std::string model : {"a", "b"}) {
      const std::vector<std::string> got = worker.Ok("acquire " + model);
      ASSERT_EQ(got.size(), 3u);
      leases_.Add(got[0]);
    }
  }  // the worker exits: no process maps a copy now
  ASSERT_TRUE(manager.ReadUntil([&] { return manager.store.size() == 2; }));
  for (const auto& [name, fds] : manager.store) {
    EXPECT_EQ(fds.size(), 2u) << name;  // header and data
  }
  const uint64_t copies = CopyBytes("a") + CopyBytes("b");

  Crash();
  // A forged entry too: a sealed memfd the record does not name.
  const std::vector<std::byte> bytes(4096, std::byte{7});
  base::UniqueFd forged =
      weights::CreateSealedMemfd(daemon_->memfd_prefix() + "a", bytes);
  std::vector<std::pair<std::string, int>> passed;
  for (const auto& [name, fds] : manager.store) {
    for (const base::UniqueFd& fd : fds) passed.emplace_back(name, fd.get());
  }
  passed.emplace_back("copy-1-2", forged.get());
  daemon_->options().listen_fds = passed;
  daemon_->Start();

  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(Origins(), (std::set<std::string>{"a:reclaimed", "b:reclaimed"}))
      << daemon_->GetJson("/v1/copies").dump();
  EXPECT_EQ(
      daemon_->Metric("modelcache_adopted_bytes_total{origin=\"reclaimed\"}"),
      static_cast<double>(copies));
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_reclaim_pending_models"), 0);
  ASSERT_TRUE(manager.ReadUntil(
      [&] { return manager.ready && manager.removed.count("copy-1-2") != 0; }));
  EXPECT_EQ(manager.store.size(), 2u);  // the two copies stay stored

  Worker fresh(socket_);
  const std::vector<std::string> hit = fresh.Ok("acquire a");
  ASSERT_EQ(hit.size(), 3u);
  leases_.Add(hit[0]);
  EXPECT_EQ(hit[1], std::to_string(checksums_["a"]));
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  fresh.Ok("release-all");

  // A copy freed leaves the store.
  EXPECT_EQ(daemon_->Send("POST", "/v1/models/b/unload", "").status, 200);
  ASSERT_TRUE(manager.ReadUntil([&] { return manager.store.size() == 1; }));
}

TEST_F(Reclaim, AForgedMemfdIsRefusedAndNoOtherClientEverReceivesIt) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB");
  Held a = HoldThroughACrash("a");

  // The right name, a sealed copy of the right sizes, other bytes.
  Held forged;
  forged.lease = a.lease;
  forged.model = "a";
  for (int i = 0; i < 2; ++i) {
    struct stat st;
    ::fstat(a.fds[i].get(), &st);
    std::vector<std::byte> bytes(static_cast<size_t>(st.st_size),
                                 std::byte{0x5a});
    if (i == 0) {
      // The header's text, as it is (only the data is planted).
      [[maybe_unused]] const ssize_t n =
          ::pread(a.fds[0].get(), bytes.data(), bytes.size(), 0);
    }
    forged.fds.push_back(weights::CreateSealedMemfd(
        daemon_->memfd_prefix() + "a#0" + (i == 0 ? ":header" : ""), bytes));
  }
  auto raw = Connect();
  auto reply = SendReclaim(*raw, forged, 3);
  ASSERT_TRUE(reply);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->code, ServeCode::kInvalid);
  EXPECT_THAT(reply->message, ::testing::HasSubstr("refused"));
  EXPECT_EQ(daemon_->Metric("modelcache_reclaims_total{result=\"refused\"}"),
            1);

  // No one gets the forged bytes: a fresh acquire (after the grace, which
  // the real holder's reclaim ends) is the real copy.
  reply = SendReclaim(*raw, a, 4);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  auto fresh = Connect();
  Held got = Acquire(*fresh, "a", 2);
  EXPECT_EQ(got.checksum, checksums_["a"]);
  EXPECT_NE(got.DataId(), forged.DataId());
  EXPECT_EQ(got.DataId(), a.DataId());
}

TEST_F(Reclaim, ACopyOfAModelNoLongerInTheCatalogIsAdoptedRetired) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 2 * kMiB, 2);
  StartDaemon("16MiB");
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  Crash();
  first->Close();
  models_.erase(models_.begin());  // "a" leaves the catalog
  WriteCatalog(catalog_, models_);
  daemon_->Start();

  auto raw = Connect();
  auto reply = SendReclaim(*raw, a, 3);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_GT(daemon_->Metric("modelcache_retired_bytes"), 0);
  // Its holder is told it is retired (so that it lends it no more).
  reply = raw->Reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->id, 0u);
  EXPECT_EQ(reply->recall, a.lease);
  EXPECT_TRUE(reply->retired);
  // No one new gets it.
  ASSERT_TRUE(raw->Send(protocol::EncodeAcquire(4, "a", 1000, false)));
  reply = raw->Reply();
  ASSERT_TRUE(reply);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->code, ServeCode::kNotFound);
  // Its lease keeps it until released; then it is freed.
  ASSERT_TRUE(raw->Send(protocol::EncodeRelease(5, a.lease)));
  reply = raw->Reply();
  ASSERT_TRUE(reply && reply->ok);
  Eventually([&] { return daemon_->Metric("modelcache_retired_bytes") == 0; },
             "the retired copy is freed");
}

// Two leases on one copy of a model the catalog no longer holds, both
// reclaimed: the first adopts the copy retired (the store no longer leases
// it under its model), and the second must find it so, not adopt the same
// memfds a second time. (The soak did: the first copy, freed when its lease
// ended, took the memfds out of the books while the second still mapped
// them: "memfd inode ... is mapped by a live process but not in the
// daemon's books".)
TEST_F(Reclaim, TwoLeasesOnARetiredCopyAdoptItOnce) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 2 * kMiB, 2);
  StartDaemon("16MiB");
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  const uint64_t copy_a = CopyBytes("a");
  Crash();
  first->Close();
  models_.erase(models_.begin());  // "a" leaves the catalog
  WriteCatalog(catalog_, models_);
  daemon_->Start();

  // This process brings the copy back on two connections, as two leases
  // of one worker (or two processes) would.
  auto one = Connect();
  auto two = Connect();
  auto reply = SendReclaim(*one, a, 3);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  ASSERT_TRUE(
      two->Send(protocol::EncodeReclaim(3, a.lease - 1, "a", false), a.Fds()));
  reply = two->Reply();
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  EXPECT_EQ(daemon_->Metric("modelcache_reclaims_total{result=\"accepted\"}"),
            2);
  EXPECT_EQ(
      daemon_->Metric("modelcache_adopted_bytes_total{origin=\"reclaimed\"}"),
      static_cast<double>(copy_a));
  EXPECT_EQ(daemon_->Metric("modelcache_retired_bytes"),
            static_cast<double>(copy_a));

  // The first lease ends (the soak's order): the second keeps the copy,
  // in the books.
  ASSERT_TRUE(one->Send(protocol::EncodeRelease(4, a.lease)));
  reply = one->Reply();
  ASSERT_TRUE(reply && reply->ok);
  ExpectBooksCoverMaps(*daemon_);
  ExpectWithinBudget(*daemon_);
  EXPECT_EQ(daemon_->Metric("modelcache_retired_bytes"),
            static_cast<double>(copy_a));

  // The second ends: the copy goes (its store lease passed to the second).
  ::munmap(a.map, a.bytes);
  a.map = nullptr;
  ASSERT_TRUE(two->Send(protocol::EncodeRelease(5, a.lease - 1)));
  reply = two->Reply();
  ASSERT_TRUE(reply && reply->ok);
  Eventually([&] { return daemon_->Metric("modelcache_retired_bytes") == 0; },
             "the retired copy is freed once its last lease ends");
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
}

TEST_F(Reclaim, AnAcquireInTheGracePeriodWaitsForTheReclaimAndLoadsNothing) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB", {"--reclaim-grace", "120s"});
  Held a = HoldThroughACrash("a");

  auto waiting = Connect();
  auto holder = Connect();
  AcquireInTheGracePeriod(*waiting, *holder, a);
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
}

TEST_F(Reclaim, WithoutAReclaimTheGracePeriodEndsAndTheModelLoads) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB", {"--reclaim-grace", "1ms"});
  Held a = HoldThroughACrash("a");
  auto raw = Connect();
  std::string load;
  Held loaded = Acquire(*raw, "a", 2, &load);
  EXPECT_EQ(load, "miss");
  EXPECT_NE(loaded.DataId(), a.DataId());
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 1);
  ExpectWithinBudget(*daemon_);
}

// A restart with a model's file gone: the successor starts (the model is
// unavailable; it refused to start before), an acquire of the model in the
// grace period waits for the reclaim as any other, and the copy a process
// brings back serves without its file. Once that copy goes, its acquires
// are refused.
TEST_F(Reclaim, ARestartWithAFileGoneStartsAndTheReclaimedCopyServes) {
  AddModel("a", 2 * kMiB, 1);
  AddModel("b", 1 * kMiB, 2);
  StartDaemon("16MiB", {"--reclaim-grace", "120s"});
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  Crash();
  first->Close();
  fs::remove(root_ + "/a/model.safetensors");
  daemon_->Start();
  EXPECT_EQ(daemon_->Metric("modelcache_unavailable_models"), 1);
  EXPECT_THAT(daemon_->Model("a")["unavailable"]["error"].get<std::string>(),
              ::testing::HasSubstr("a/model.safetensors: cannot open"));
  const HttpResult ready = daemon_->Get("/readyz");
  EXPECT_EQ(ready.status, 503) << "the grace period, as before";
  EXPECT_THAT(ready.body, ::testing::HasSubstr("awaiting the reclaim"));
  EXPECT_TRUE(ready.Json()["unavailable"].contains("a")) << ready.body;

  // The other model loads and serves meanwhile.
  auto other = Connect();
  Held b = Acquire(*other, "b", 2);
  EXPECT_EQ(b.checksum, checksums_["b"]);

  auto waiting = Connect();
  auto holder = Connect();
  std::optional<protocol::Reply> reply =
      AcquireInTheGracePeriod(*waiting, *holder, a);
  ASSERT_TRUE(reply && reply->ok);

  // A hit is a hit, whatever its files.
  auto fresh = Connect();
  std::string load;
  Held again = Acquire(*fresh, "a", 4, &load);
  EXPECT_EQ(load, "hit");
  EXPECT_EQ(again.DataId(), a.DataId());
  EXPECT_EQ(again.checksum, checksums_["a"]);
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 1) << "b's";
  EXPECT_EQ(daemon_->Model("a")["state"], "READY");
  EXPECT_TRUE(daemon_->Model("a")["unavailable"].is_object());
  EXPECT_EQ(daemon_->Get("/readyz").status, 200);

  // Every lease of it released (unmapped first) and the copy unloaded:
  // refused, naming the file.
  for (Held* held : {&a, &again}) {
    ::munmap(held->map, held->bytes);
    held->map = nullptr;
  }
  for (auto [raw, lease] :
       std::vector<std::pair<Raw*, uint64_t>>{{holder.get(), a.lease},
                                              {waiting.get(), reply->lease},
                                              {fresh.get(), again.lease}}) {
    ASSERT_TRUE(raw->Send(protocol::EncodeRelease(9, lease)));
    const auto released = raw->Reply();
    ASSERT_TRUE(released && released->ok);
  }
  EXPECT_EQ(daemon_->Send("POST", "/v1/models/a/unload").Json()["outcome"],
            "removed");
  ASSERT_TRUE(fresh->Send(protocol::EncodeAcquire(10, "a", 60000, false)));
  reply = fresh->Reply();
  ASSERT_TRUE(reply);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->code, ServeCode::kUnavailable);
  EXPECT_EQ(reply->cause, "io");
  EXPECT_THAT(reply->message, ::testing::HasSubstr("a/model.safetensors"));
}

// Bytes sent on `raw` that the daemon has not read yet.
int Unread(const Raw& raw) {
  int bytes = -1;
  return ::ioctl(raw.fd(), SIOCOUTQ, &bytes) == 0 ? bytes : -1;
}

// Another thread's PUT /v1/budget, which takes the capacity's lock of a
// daemon started with capacity_hook and keeps it until the test lets it go
// (however the test ends).
class CapacityHeld {
 public:
  explicit CapacityHeld(Daemon& daemon)
      : daemon_(daemon), put_([this] {
          status_ =
              daemon_
                  .Send("PUT", "/v1/budget", R"({"capacity_bytes": "16MiB"})")
                  .status;
        }) {
    daemon_.AwaitCapacityHeld();
  }
  CapacityHeld(const CapacityHeld&) = delete;
  CapacityHeld& operator=(const CapacityHeld&) = delete;
  ~CapacityHeld() { LetGo(); }

  // Lets the lock go and waits for the PUT: its HTTP status.
  int LetGo() {
    if (put_.joinable()) {
      daemon_.LetCapacityGo();
      put_.join();
    }
    return status_;
  }

 private:
  Daemon& daemon_;
  int status_ = 0;
  std::thread put_;
};

// A reclaim's adoption changes the store's capacity, whose lock another
// thread may hold for long (PUT /v1/budget holds it; an adoption holds it
// across its evictions): the loop never waits for it. While the lock is
// held, the reclaim waits and another client is answered; once it goes,
// the reclaim is accepted, and the request sent after it on its connection
// is answered after it and sees its lease.
TEST_F(Reclaim, TheLoopAnswersOthersWhileAReclaimWaitsForTheCapacitysLock) {
  uint64_t copy_a = 0;
  Held a = CrashHoldingA(&copy_a);
  auto holder = Connect();
  auto other = Connect();

  CapacityHeld capacity(*daemon_);

  ASSERT_TRUE(
      holder->Send(protocol::EncodeReclaim(3, a.lease, "a", false), a.Fds()));
  Eventually([&] { return Unread(*holder) == 0; },
             "the daemon reads the reclaim");
  // Its connection's next request; and another client's.
  ::munmap(a.map, a.bytes);
  a.map = nullptr;
  ASSERT_TRUE(holder->Send(protocol::EncodeRelease(4, a.lease)));
  ASSERT_TRUE(other->Send(protocol::EncodePing(5)));
  const auto pong = other->Reply(std::chrono::seconds(30));
  ASSERT_TRUE(pong) << "the loop waits for the capacity's lock";
  EXPECT_TRUE(pong->ok);
  EXPECT_EQ(pong->id, 5u);

  EXPECT_EQ(capacity.LetGo(), 200);
  auto reply = holder->Reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->id, 3u);
  EXPECT_TRUE(reply->ok) << reply->message;
  reply = holder->Reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->id, 4u);
  EXPECT_TRUE(reply->ok) << reply->message;

  EXPECT_EQ(daemon_->Metric("modelcache_reclaims_total{result=\"accepted\"}"),
            1);
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Metric("modelcache_leases"), 0);
  EXPECT_EQ(daemon_->Budget()["used_bytes"].get<uint64_t>(), copy_a);
  EXPECT_EQ(Origins(), (std::set<std::string>{"a:reclaimed"}));
}

// Two processes bring the same copy back at once: the second reclaim comes
// while the first one's adoption waits for the capacity's lock. It waits
// for that adoption and gets a lease on the copy it adopted: one copy in
// the books, adopted once, both reclaims accepted.
TEST_F(Reclaim, TwoReclaimsOfOneCopyAtOnceAdoptItOnce) {
  uint64_t copy_a = 0;
  Held a = CrashHoldingA(&copy_a);
  auto one = Connect();
  auto two = Connect();

  CapacityHeld capacity(*daemon_);

  // This process reclaims the one lease on two connections, as two
  // processes that map the copy would reclaim theirs.
  ASSERT_TRUE(
      one->Send(protocol::EncodeReclaim(3, a.lease, "a", false), a.Fds()));
  Eventually([&] { return Unread(*one) == 0; }, "the daemon reads the first");
  ASSERT_TRUE(
      two->Send(protocol::EncodeReclaim(3, a.lease - 1, "a", false), a.Fds()));
  Eventually([&] { return Unread(*two) == 0; }, "the daemon reads the second");
  EXPECT_EQ(capacity.LetGo(), 200);
  for (Raw* raw : {one.get(), two.get()}) {
    const auto reply = raw->Reply();
    ASSERT_TRUE(reply);
    EXPECT_TRUE(reply->ok) << reply->message;
  }
  EXPECT_EQ(daemon_->Metric("modelcache_reclaims_total{result=\"accepted\"}"),
            2);
  EXPECT_EQ(
      daemon_->Metric("modelcache_adopted_bytes_total{origin=\"reclaimed\"}"),
      static_cast<double>(copy_a));
  EXPECT_EQ(daemon_->Metric("modelcache_leases"), 2);
  EXPECT_EQ(daemon_->Metric("modelcache_orphaned_bytes"), 0);
  EXPECT_EQ(daemon_->Budget()["used_bytes"].get<uint64_t>(), copy_a);
  for (auto [raw, lease] : std::vector<std::pair<Raw*, uint64_t>>{
           {one.get(), a.lease}, {two.get(), a.lease - 1}}) {
    ASSERT_TRUE(raw->Send(protocol::EncodeRelease(9, lease)));
    const auto released = raw->Reply();
    ASSERT_TRUE(released && released->ok);
  }
}

// An old daemon and its successor write the record at once across a
// takeover: each writes a temporary of its own, so neither renames the
// other's away (the soak's "cannot write <socket>.state: No such file or
// directory", logged by a successor).
TEST(RecordFile, AWriterLeavesAnotherProcesssTemporaryAlone) {
  const std::string dir = ::testing::TempDir() + "record_file_XXXXXX";
  std::vector<char> name(dir.begin(), dir.end());
  name.push_back('\0');
  ASSERT_NE(::mkdtemp(name.data()), nullptr);
  const std::string path = std::string(name.data()) + "/serve.sock.state";
  // What the shared temporary was: another writer's, half written.
  const std::string other = path + ".tmp";
  { std::ofstream(other) << "another writer's"; }
  detail::WriteFileAtomically(path, "this writer's");
  EXPECT_EQ(detail::ReadSmallFile(path), "this writer's");
  EXPECT_EQ(detail::ReadSmallFile(other), "another writer's");
  std::filesystem::remove_all(name.data());
}

TEST_F(Reclaim, ALeaseIdTheDaemonHandedOutItselfCannotBeReclaimedByAnother) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB");
  auto owner = Connect();
  Held a = Acquire(*owner, "a", 2);
  // Another connection brings the same descriptors and lease id.
  auto thief = Connect();
  auto reply = SendReclaim(*thief, a, 3);
  ASSERT_TRUE(reply);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(daemon_->Metric("modelcache_leases"), 1);
}

}  // namespace
}  // namespace modelcache::serve::testing
