// Reclaim after a crash: a SIGKILLed daemon's successor adopts the copies
// live processes still map when they bring the memfds back, refuses any
// other memfd, and holds acquires back for the grace period
// (daemon_reclaim.cc). The leases here are raw protocol connections of the
// test process, which maps the data memfds as a worker does.
#include <gmock/gmock.h>
#include <sys/mman.h>

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

TEST_F(Reclaim, AForgedMemfdIsRefusedAndNoOtherClientEverReceivesIt) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB");
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  Crash();
  first->Close();
  daemon_->Start();

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

TEST_F(Reclaim, AnAcquireInTheGracePeriodWaitsForTheReclaimAndLoadsNothing) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB", {"--reclaim-grace", "120s"});
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  Crash();
  first->Close();
  daemon_->Start();

  auto waiting = Connect();
  ASSERT_TRUE(waiting->Send(protocol::EncodeAcquire(2, "a", 60000, false)));
  Eventually(
      [&] { return daemon_->Metric("modelcache_waiting_acquires") == 1; },
      "the acquire waits");
  auto holder = Connect();
  auto reply = SendReclaim(*holder, a, 3);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(reply->ok) << reply->message;
  reply = waiting->Reply();
  ASSERT_TRUE(reply);
  ASSERT_TRUE(reply->ok) << reply->message;
  ASSERT_EQ(waiting->last_fds().size(), 2u);
  struct stat st;
  ::fstat(waiting->last_fds()[1].get(), &st);
  EXPECT_EQ(std::make_pair(static_cast<uint64_t>(st.st_dev),
                           static_cast<uint64_t>(st.st_ino)),
            a.DataId());
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 0);
}

TEST_F(Reclaim, WithoutAReclaimTheGracePeriodEndsAndTheModelLoads) {
  AddModel("a", 2 * kMiB, 1);
  StartDaemon("16MiB", {"--reclaim-grace", "1ms"});
  auto first = Connect();
  Held a = Acquire(*first, "a", 2);
  Crash();
  first->Close();
  daemon_->Start();
  auto raw = Connect();
  std::string load;
  Held loaded = Acquire(*raw, "a", 2, &load);
  EXPECT_EQ(load, "miss");
  EXPECT_NE(loaded.DataId(), a.DataId());
  EXPECT_EQ(daemon_->Metric("modelcache_loads_total"), 1);
  ExpectWithinBudget(*daemon_);
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
