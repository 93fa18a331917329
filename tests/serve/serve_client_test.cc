// The client alone (client_connect.cc, client_mux.cc, client_reclaim.cc,
// client_leases.cc, client_keeper.cc, client_mapping.cc), against a fake
// daemon in this process: a listening SOCK_SEQPACKET socket whose one
// connection the test answers by hand, so that every byte the client sends
// is seen and every reply is the test's. Synchronised on the socket itself:
// the fake reads what the client sent, blocking, with a bound. A "crash" is
// the fake closing its connection; the client's next connection is the
// successor's.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "modelcache/serve/client.h"
#include "modelcache/weights/memfd.h"
#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"
#include "protocol.h"
#include "socket.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int kBoundMs = 60'000;

class FakeDaemon {
 public:
  FakeDaemon() {
    std::string pattern = (fs::temp_directory_path() / "mcclient_XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    dir_ = pattern;
    path_ = (dir_ / "serve.sock").string();
    listen_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path_.c_str(), sizeof(address.sun_path) - 1);
    if (::bind(listen_, reinterpret_cast<sockaddr*>(&address),
               sizeof(address)) != 0 ||
        ::listen(listen_, 8) != 0) {
      std::abort();
    }
  }
  ~FakeDaemon() {
    if (conn_ >= 0) ::close(conn_);
    ::close(listen_);
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  const std::string& path() const { return path_; }

  // Whether a connection waits to be accepted.
  bool Pending() {
    pollfd p{listen_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  // Accepts the next connection (the previous one is closed).
  void Accept() {
    pollfd p{listen_, POLLIN, 0};
    ASSERT_GT(::poll(&p, 1, kBoundMs), 0) << "no connection";
    if (conn_ >= 0) ::close(conn_);
    conn_ = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    ASSERT_GE(conn_, 0);
  }
  // The next request the client sent; its descriptors into `fds` when
  // given (else closed).
  protocol::Request Next(std::vector<base::UniqueFd>* fds = nullptr) {
    pollfd p{conn_, POLLIN, 0};
    EXPECT_GT(::poll(&p, 1, kBoundMs), 0) << "the client sent nothing";
    detail::Datagram d;
    EXPECT_GT(detail::ReceiveDatagram(conn_, protocol::kMaxMessageBytes,
                                      2 * protocol::kMaxFilesPerModel, 0, &d),
              0);
    if (fds != nullptr) *fds = std::move(d.fds);
    const protocol::ParsedRequest parsed = protocol::ParseRequest(d.bytes);
    EXPECT_TRUE(parsed.request) << parsed.error << ": " << d.bytes;
    return parsed.request.value_or(protocol::Request{});
  }
  // The daemon dies: its end of the connection closes.
  void Crash() {
    if (conn_ >= 0) ::close(conn_);
    conn_ = -1;
  }
  void Send(const std::string& bytes, std::span<const int> fds = {}) {
    ASSERT_EQ(detail::SendDatagram(conn_, bytes, fds, 0), 0);
  }
  // Accepts and answers hello, announcing `max_queued_replies` and `more`
  // limits.
  void Handshake(uint64_t max_queued_replies = 256,
                 const std::map<std::string, uint64_t>& more = {}) {
    Accept();
    const protocol::Request hello = Next();
    ASSERT_EQ(hello.op, protocol::Op::kHello);
    std::map<std::string, uint64_t> limits = {
        {"max_queued_replies", max_queued_replies},
        {"max_message_bytes", protocol::kMaxMessageBytes}};
    limits.insert(more.begin(), more.end());
    Send(protocol::EncodeHelloReply(hello.id, "fake", limits));
  }

 private:
  fs::path dir_;
  std::string path_;
  int listen_ = -1;
  int conn_ = -1;
};

// A model's one file as the daemon hands it out: a sealed memfd of its
// header's JSON and one of its data.
struct Copy {
  weights::WeightSet file;
  base::UniqueFd header;
  base::UniqueFd data;
  protocol::FileReply reply;
};

Copy MakeCopy(const fs::path& dir, const std::string& name = "m.safetensors",
              uint64_t seed = 7) {
  const std::string path = (dir / name).string();
  weights::SafetensorsWriter writer;
  writer.AddTensor("w", weights::Dtype::kF32, {1024},
                   weights::PatternFill(seed));
  writer.Write(path);
  Copy c{weights::WeightSet::Open(path), {}, {}, {}};
  const std::string json = weights::SafetensorsHeaderJson(c.file.header());
  c.header = weights::CreateSealedMemfd(
      "test:header", std::as_bytes(std::span(json.data(), json.size())));
  c.data = weights::CreateSealedMemfd("test:data", c.file.data());
  c.reply = {name, c.file.data().size(), json.size()};
  return c;
}

// What a descriptor is: its file's (device, inode).
std::pair<uint64_t, uint64_t> IdOf(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

std::vector<uint8_t> BytesOf(std::span<const std::byte> data) {
  std::vector<uint8_t> out(data.size());
  if (!data.empty()) std::memcpy(out.data(), data.data(), data.size());
  return out;
}

// A daemon whose successor may adopt its leases; and one that delegates.
const std::map<std::string, uint64_t> kReclaim = {{"reclaim", 1}};
const std::map<std::string, uint64_t> kReclaimAndRecall = {
    {"reclaim", 1}, {"recall_timeout_ms", 60'000}};

TEST(ClientTest, AGrantedCopyIsMappedReadOnlyAndItsReleaseReachesTheDaemon) {
  FakeDaemon daemon;
  std::thread fake([&] {
    daemon.Handshake();
    const protocol::Request acquire = daemon.Next();
    EXPECT_EQ(acquire.op, protocol::Op::kAcquire);
    EXPECT_EQ(acquire.model, "m");
    Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 77, "m", "hit", {c.reply}),
        fds);
    const protocol::Request release = daemon.Next();
    EXPECT_EQ(release.op, protocol::Op::kRelease);
    EXPECT_EQ(release.lease, 77u);
    daemon.Send(protocol::EncodeOk(release.id));
  });
  {
    Client client = Client::Connect(daemon.path());
    RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
    EXPECT_EQ(w.lease(), 77u);
    EXPECT_EQ(w.load(), "hit");
    ASSERT_NE(w.Find("w"), nullptr);
    EXPECT_EQ(w.data("w").size(), 4096u);
    w.Release();  // unmapped, then released
    fake.join();  // the connection lives until the fake has answered
  }
}

TEST(ClientTest, AnUnsealedMemfdIsRefusedAndItsLeaseReleased) {
  FakeDaemon daemon;
  std::thread fake([&] {
    daemon.Handshake();
    const protocol::Request acquire = daemon.Next();
    Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
    // The same bytes in a memfd nobody sealed: another process could
    // change them under the client.
    const int open = ::memfd_create("test:open", MFD_CLOEXEC);
    ASSERT_EQ(::write(open, c.file.data().data(), c.file.data().size()),
              static_cast<ssize_t>(c.file.data().size()));
    const int fds[] = {c.header.get(), open};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 78, "m", "hit", {c.reply}),
        fds);
    ::close(open);
    const protocol::Request release = daemon.Next();
    EXPECT_EQ(release.op, protocol::Op::kRelease);
    EXPECT_EQ(release.lease, 78u);
    daemon.Send(protocol::EncodeOk(release.id));
  });
  Client client = Client::Connect(daemon.path());
  try {
    client.Acquire("m", std::chrono::seconds(60));
    ADD_FAILURE() << "an unsealed copy was mapped";
  } catch (const ServeError& e) {
    EXPECT_EQ(e.serve_code(), ServeCode::kInvalid);
    EXPECT_THAT(e.what(), HasSubstr("not sealed"));
  }
  fake.join();
}

// protocol.h: an id-0 message is the daemon's news, not the end of the
// connection; the end is EOF.
TEST(ClientTest, AnIdZeroErrorDoesNotBreakTheConnection) {
  FakeDaemon daemon;
  std::thread fake([&] {
    daemon.Handshake();
    daemon.Send(protocol::EncodeError(0, ServeCode::kInvalid,
                                      "message of 70000 bytes exceeds the "
                                      "limit (dropped)"));
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(ping.id));
  });
  Client client = Client::Connect(daemon.path());
  client.Ping(std::chrono::seconds(60));
  fake.join();
  EXPECT_FALSE(daemon.Pending()) << "the client connected again";
}

// A crash under a request: the successor's first request on the new
// connection is the reclaim of the lease held, with the copy's memfds (the
// very files the acquire's reply gave, two per file, in file order); then
// the request that was in flight; the lease is held on the new connection,
// and its release goes there.
TEST(ClientTest, ALostConnectionsLeaseIsReclaimedFirstWithItsMemfds) {
  FakeDaemon daemon;
  const fs::path dir = fs::path(daemon.path()).parent_path();
  Copy a = MakeCopy(dir, "a.safetensors", 7);
  Copy b = MakeCopy(dir, "b.safetensors", 9);
  const std::vector<int> sent = {a.header.get(), a.data.get(), b.header.get(),
                                 b.data.get()};
  std::thread fake([&] {
    daemon.Handshake(256, kReclaim);
    const protocol::Request acquire = daemon.Next();
    daemon.Send(protocol::EncodeAcquireReply(acquire.id, 77, "m", "miss",
                                             {a.reply, b.reply}),
                sent);
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Crash();  // with the ping unanswered
    daemon.Handshake(256, kReclaim);
    std::vector<base::UniqueFd> fds;
    const protocol::Request reclaim = daemon.Next(&fds);
    EXPECT_EQ(reclaim.op, protocol::Op::kReclaim);
    EXPECT_EQ(reclaim.lease, 77u);
    EXPECT_EQ(reclaim.model, "m");
    EXPECT_FALSE(reclaim.idle) << "a reference uses it";
    ASSERT_EQ(fds.size(), sent.size());
    for (size_t i = 0; i < fds.size(); ++i) {
      EXPECT_EQ(IdOf(fds[i].get()), IdOf(sent[i])) << "descriptor " << i;
    }
    daemon.Send(protocol::EncodeOk(reclaim.id));
    const protocol::Request again = daemon.Next();
    EXPECT_EQ(again.op, protocol::Op::kPing) << "sent again, after the reclaim";
    daemon.Send(protocol::EncodeOk(again.id));
    const protocol::Request release = daemon.Next();
    EXPECT_EQ(release.op, protocol::Op::kRelease);
    EXPECT_EQ(release.lease, 77u);
    daemon.Send(protocol::EncodeOk(release.id));
  });
  Client client = Client::Connect(daemon.path());
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  client.Ping(std::chrono::seconds(60));
  const ReclaimStats stats = client.Reclaims();
  EXPECT_EQ(stats.reclaimed, 1u);
  EXPECT_EQ(stats.reclaim_refused, 0u);
  EXPECT_EQ(stats.pending, 0u);
  EXPECT_EQ(w.lease(), 77u);
  ASSERT_EQ(w.files().size(), 2u);
  EXPECT_EQ(BytesOf(w.files()[1].data()), BytesOf(b.file.data()));
  w.Release();
  fake.join();
}

// A refused reclaim: the reference keeps reading the copy, a local acquire
// of its model asks the daemon, and the reference's end sends nothing.
TEST(ClientTest, ARefusedReclaimKeepsTheMappingAndItsEndSendsNoRelease) {
  FakeDaemon daemon;
  const fs::path dir = fs::path(daemon.path()).parent_path();
  Copy first = MakeCopy(dir, "m.safetensors", 7);
  Copy second = MakeCopy(dir, "n.safetensors", 8);
  std::thread fake([&] {
    daemon.Handshake(256, kReclaim);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {first.header.get(), first.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 80, "m", "hit", {first.reply}),
        fds);
    EXPECT_EQ(daemon.Next().op, protocol::Op::kPing);
    daemon.Crash();
    daemon.Handshake(256, kReclaim);
    const protocol::Request reclaim = daemon.Next();
    EXPECT_EQ(reclaim.op, protocol::Op::kReclaim);
    EXPECT_EQ(reclaim.lease, 80u);
    daemon.Send(
        protocol::EncodeError(reclaim.id, ServeCode::kNotFound, "no lease 80"));
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(ping.id));
    const protocol::Request again = daemon.Next();
    EXPECT_EQ(again.op, protocol::Op::kAcquire) << "not the unbacked copy";
    const int more[] = {second.header.get(), second.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(again.id, 81, "m", "hit", {second.reply}),
        more);
    const protocol::Request release = daemon.Next();
    EXPECT_EQ(release.op, protocol::Op::kRelease);
    EXPECT_EQ(release.lease, 81u);
    daemon.Send(protocol::EncodeOk(release.id));
    // Nothing for lease 80 in between.
    const protocol::Request last = daemon.Next();
    EXPECT_EQ(last.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(last.id));
  });
  Client client = Client::Connect(daemon.path());
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  client.Ping(std::chrono::seconds(60));
  const ReclaimStats stats = client.Reclaims();
  EXPECT_EQ(stats.reclaimed, 0u);
  EXPECT_EQ(stats.reclaim_refused, 1u);
  EXPECT_EQ(stats.pending, 0u);
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(first.file.data()));
  RemoteWeights fresh = client.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(fresh.lease(), 81u);
  EXPECT_EQ(fresh.load(), "hit");
  fresh.Release();
  w.Release();
  client.Ping(std::chrono::seconds(60));
  fake.join();
}

// An idle lease of a process making no call: the keeper reconnects on its
// own and reclaims it as "idle"; it stays idle, and a local acquire revives
// it on the new connection.
TEST(ClientTest, AnIdleLeaseIsReclaimedAsIdleWithoutACall) {
  FakeDaemon daemon;
  const fs::path dir = fs::path(daemon.path()).parent_path();
  Copy c = MakeCopy(dir);
  int answered[2];
  ASSERT_EQ(::pipe2(answered, O_CLOEXEC), 0);
  std::thread fake([&] {
    daemon.Handshake(256, kReclaimAndRecall);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 90, "m", "hit", {c.reply}),
        fds);
    const protocol::Request idle = daemon.Next();
    EXPECT_EQ(idle.op, protocol::Op::kIdle);
    EXPECT_EQ(idle.lease, 90u);
    daemon.Send(protocol::EncodeOk(idle.id));
    daemon.Crash();
    daemon.Handshake(256, kReclaimAndRecall);  // the keeper's doing
    std::vector<base::UniqueFd> got;
    const protocol::Request reclaim = daemon.Next(&got);
    EXPECT_EQ(reclaim.op, protocol::Op::kReclaim);
    EXPECT_EQ(reclaim.lease, 90u);
    EXPECT_EQ(reclaim.model, "m");
    EXPECT_TRUE(reclaim.idle);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(IdOf(got[0].get()), IdOf(c.header.get()));
    EXPECT_EQ(IdOf(got[1].get()), IdOf(c.data.get()));
    daemon.Send(protocol::EncodeOk(reclaim.id));
    EXPECT_EQ(::write(answered[1], "r", 1), 1);
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(ping.id));
    const protocol::Request use = daemon.Next();
    EXPECT_EQ(use.op, protocol::Op::kUse) << "told idle by the reclaim";
    EXPECT_EQ(use.lease, 90u);
    daemon.Send(protocol::EncodeOk(use.id));
  });
  ClientOptions options;
  options.keep_idle = std::chrono::minutes(10);
  options.idle_notice_delay = std::chrono::microseconds(0);
  Client client = Client::Connect(daemon.path(), options);
  client.Acquire("m", std::chrono::seconds(60)).Release();
  // No call until the fake has answered the reclaim.
  pollfd p{answered[0], POLLIN, 0};
  ASSERT_GT(::poll(&p, 1, kBoundMs), 0) << "never reclaimed";
  client.Ping(std::chrono::seconds(60));  // after the reclaim's answer
  const ReclaimStats stats = client.Reclaims();
  EXPECT_EQ(stats.reclaimed, 1u);
  EXPECT_EQ(stats.pending, 0u);
  EXPECT_EQ(client.IdleLeases(), 1u);
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(w.load(), "local");
  EXPECT_EQ(w.lease(), 90u);
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(c.file.data()));
  fake.join();
  ::close(answered[0]);
  ::close(answered[1]);
}

// While the daemon is down, a local acquire of an idle lease still takes a
// reference to its mapping; the successor then hears the lease is in use.
TEST(ClientTest, ALeaseRevivedWhileTheDaemonIsDownIsReclaimedInUse) {
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  int crashed[2];
  int revived[2];
  ASSERT_EQ(::pipe2(crashed, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(revived, O_CLOEXEC), 0);
  std::thread fake([&] {
    daemon.Handshake(256, kReclaimAndRecall);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 96, "m", "hit", {c.reply}),
        fds);
    const protocol::Request idle = daemon.Next();
    EXPECT_EQ(idle.op, protocol::Op::kIdle);
    daemon.Send(protocol::EncodeOk(idle.id));
    daemon.Crash();
    EXPECT_EQ(::write(crashed[1], "c", 1), 1);
    // The keeper may connect meanwhile: its hello waits for this answer.
    pollfd p{revived[0], POLLIN, 0};
    EXPECT_GT(::poll(&p, 1, kBoundMs), 0);
    daemon.Handshake(256, kReclaimAndRecall);
    const protocol::Request reclaim = daemon.Next();
    EXPECT_EQ(reclaim.op, protocol::Op::kReclaim);
    EXPECT_EQ(reclaim.lease, 96u);
    EXPECT_FALSE(reclaim.idle) << "revived before the reclaim";
    daemon.Send(protocol::EncodeOk(reclaim.id));
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(ping.id));
    const protocol::Request again = daemon.Next();
    EXPECT_EQ(again.op, protocol::Op::kIdle) << "idle again, on the new one";
    EXPECT_EQ(again.lease, 96u);
    daemon.Send(protocol::EncodeOk(again.id));
  });
  ClientOptions options;
  options.keep_idle = std::chrono::minutes(10);
  options.idle_notice_delay = std::chrono::microseconds(0);
  Client client = Client::Connect(daemon.path(), options);
  client.Acquire("m", std::chrono::seconds(60)).Release();
  pollfd p{crashed[0], POLLIN, 0};
  ASSERT_GT(::poll(&p, 1, kBoundMs), 0);
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(w.load(), "local");
  EXPECT_EQ(w.lease(), 96u);
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(c.file.data()));
  ASSERT_EQ(::write(revived[1], "r", 1), 1);
  client.Ping(std::chrono::seconds(60));
  EXPECT_EQ(client.Reclaims().reclaimed, 1u);
  w.Release();
  fake.join();
  for (const int fd : {crashed[0], crashed[1], revived[0], revived[1]}) {
    ::close(fd);
  }
}

// Close ends the leases on the daemon's side: none is reclaimed after it.
TEST(ClientTest, CloseReclaimsNothing) {
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  std::thread fake([&] {
    daemon.Handshake(256, kReclaim);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 97, "m", "hit", {c.reply}),
        fds);
    daemon.Handshake(256, kReclaim);
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing) << "no reclaim after Close";
    daemon.Send(protocol::EncodeOk(ping.id));
  });
  Client client = Client::Connect(daemon.path());
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  client.Close();
  client.Ping(std::chrono::seconds(60));
  const ReclaimStats stats = client.Reclaims();
  EXPECT_EQ(stats.reclaimed + stats.reclaim_refused + stats.pending, 0u);
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(c.file.data()));
  fake.join();
}

// ThreadSanitizer cannot follow a child forked by a process with threads.
#if defined(__SANITIZE_THREAD__)
#define MODELCACHE_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MODELCACHE_UNDER_TSAN 1
#endif
#endif

// Descriptors of this process open on a file of `ids`, among the first
// 4096 numbers; async-signal-safe (fstat only), for a forked child.
int CountOpen(const std::pair<uint64_t, uint64_t> (&ids)[2]) {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0) continue;
    for (const auto& id : ids) {
      if (static_cast<uint64_t>(st.st_dev) == id.first &&
          static_cast<uint64_t>(st.st_ino) == id.second) {
        ++n;
      }
    }
  }
  return n;
}

// The memfds kept for a reclaim are closed in a forked child: it must not
// keep its parent's copies in memory.
TEST(ClientTest, AForkedChildHoldsNoneOfTheMemfdsKeptForAReclaim) {
#ifdef MODELCACHE_UNDER_TSAN
  GTEST_SKIP() << "ThreadSanitizer stops a child forked by a threaded parent";
#endif
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  const std::pair<uint64_t, uint64_t> ids[2] = {IdOf(c.header.get()),
                                                IdOf(c.data.get())};
  std::thread fake([&] {
    daemon.Handshake(256, kReclaim);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 98, "m", "hit", {c.reply}),
        fds);
    // Only the client's descriptors of these files are left.
    c.header.reset();
    c.data.reset();
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(ping.id));
    const protocol::Request release = daemon.Next();
    EXPECT_EQ(release.op, protocol::Op::kRelease);
    daemon.Send(protocol::EncodeOk(release.id));
  });
  Client client = Client::Connect(daemon.path());
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  client.Ping(std::chrono::seconds(60));  // after the fake closed its own
  EXPECT_EQ(CountOpen(ids), 2) << "kept by the client";
  const pid_t child = ::fork();
  if (child == 0) ::_exit(CountOpen(ids));
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child holds its parent's memfds";
  w.Release();
  EXPECT_EQ(CountOpen(ids), 0) << "closed with the copy";
  fake.join();
}

// A successor that does not reclaim: nothing is re-asserted, the lease is
// unbacked, and the first request on the new connection is the caller's.
// A daemon that delegates (no reclaim).
const std::map<std::string, uint64_t> kRecall = {{"recall_timeout_ms", 60'000}};

// Writes one byte to `fd`, the other side's go.
void Signal(int fd) { ASSERT_EQ(::write(fd, "x", 1), 1); }
// Waits for Signal on `fd`.
void AwaitSignal(int fd) {
  pollfd p{fd, POLLIN, 0};
  ASSERT_GT(::poll(&p, 1, kBoundMs), 0) << "no signal";
  char byte;
  ASSERT_EQ(::read(fd, &byte, 1), 1);
}

// A local acquire of a lease the daemon was told is idle sends nothing: one
// released at once stays idle in the daemon's books with no message at all,
// and one that stays in use is told "use" after idle_notice_delay.
TEST(ClientTest, ARevivalOfAToldIdleLeaseSendsNothingUntilItStaysInUse) {
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  int told[2];
  int used[2];
  ASSERT_EQ(::pipe2(told, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(used, O_CLOEXEC), 0);
  std::thread fake([&] {
    daemon.Handshake(256, kRecall);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 91, "m", "hit", {c.reply}),
        fds);
    const protocol::Request idle = daemon.Next();
    EXPECT_EQ(idle.op, protocol::Op::kIdle);
    EXPECT_EQ(idle.lease, 91u);
    daemon.Send(protocol::EncodeOk(idle.id));
    Signal(told[1]);
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing)
        << "a revival released at once sends nothing";
    daemon.Send(protocol::EncodeOk(ping.id));
    const protocol::Request use = daemon.Next();
    EXPECT_EQ(use.op, protocol::Op::kUse) << "in use past the delay";
    EXPECT_EQ(use.lease, 91u);
    daemon.Send(protocol::EncodeOk(use.id));
    Signal(used[1]);
    const protocol::Request last = daemon.Next();
    EXPECT_EQ(last.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(last.id));
  });
  ClientOptions options;
  options.keep_idle = std::chrono::minutes(10);
  // Long enough that nothing falls due between a revival and its release.
  options.idle_notice_delay = std::chrono::seconds(1);
  Client client = Client::Connect(daemon.path(), options);
  client.Acquire("m", std::chrono::seconds(60)).Release();
  AwaitSignal(told[0]);
  {
    RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
    EXPECT_EQ(w.load(), "local");
  }
  client.Ping(std::chrono::seconds(60));
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(w.load(), "local");
  AwaitSignal(used[0]);  // told "use", by the Client's own thread
  client.Ping(std::chrono::seconds(60));
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(c.file.data()));
  fake.join();
  for (const int fd : {told[0], told[1], used[0], used[1]}) ::close(fd);
}

// A recall that meets such a revival before the Client said "use" is
// answered "use": the daemon frees nothing the process maps.
TEST(ClientTest, ARecallOfARevivedLeaseBeforeItsUseNoticeIsAnsweredUse) {
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  int told[2];
  int revived[2];
  ASSERT_EQ(::pipe2(told, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(revived, O_CLOEXEC), 0);
  std::thread fake([&] {
    daemon.Handshake(256, kRecall);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 92, "m", "hit", {c.reply}),
        fds);
    const protocol::Request idle = daemon.Next();
    EXPECT_EQ(idle.op, protocol::Op::kIdle);
    daemon.Send(protocol::EncodeOk(idle.id));
    Signal(told[1]);
    AwaitSignal(revived[0]);
    daemon.Send(protocol::EncodeRecall(92));
    // The answer, and the ping that read the recall, in either order.
    bool answered = false;
    for (int i = 0; i < 2; ++i) {
      const protocol::Request r = daemon.Next();
      if (r.op == protocol::Op::kUse) {
        EXPECT_EQ(r.lease, 92u);
        answered = true;
      } else {
        EXPECT_EQ(r.op, protocol::Op::kPing) << "busy, not released";
      }
      daemon.Send(protocol::EncodeOk(r.id));
    }
    EXPECT_TRUE(answered);
  });
  ClientOptions options;
  options.keep_idle = std::chrono::minutes(10);
  options.idle_notice_delay = std::chrono::seconds(1);
  Client client = Client::Connect(daemon.path(), options);
  client.Acquire("m", std::chrono::seconds(60)).Release();
  AwaitSignal(told[0]);
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  EXPECT_EQ(w.load(), "local");
  Signal(revived[1]);
  // No lease is idle now, so the Client's own thread does not read: the
  // ping's caller reads the recall and answers it. The answer may follow
  // the ping; the reply to the ping is read after the recall.
  client.Ping(std::chrono::seconds(60));
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(c.file.data()));
  fake.join();
  for (const int fd : {told[0], told[1], revived[0], revived[1]}) ::close(fd);
}

// AcquireLocal takes a reference only where the process holds the model,
// in use or idle, and otherwise sends nothing: the daemon's next message is
// the ping after it.
TEST(ClientTest, AcquireLocalRevivesWhatTheProcessHoldsAndSendsNothing) {
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  std::thread fake([&] {
    daemon.Handshake(256, kRecall);
    const protocol::Request first = daemon.Next();
    EXPECT_EQ(first.op, protocol::Op::kPing)
        << "an AcquireLocal of a model not held sent something";
    daemon.Send(protocol::EncodeOk(first.id));
    const protocol::Request acquire = daemon.Next();
    EXPECT_EQ(acquire.op, protocol::Op::kAcquire);
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 93, "m", "hit", {c.reply}),
        fds);
    const protocol::Request last = daemon.Next();
    EXPECT_EQ(last.op, protocol::Op::kPing)
        << "a local acquire or its release sent something";
    daemon.Send(protocol::EncodeOk(last.id));
  });
  ClientOptions options;
  options.keep_idle = std::chrono::minutes(10);
  // Nothing falls due while the test runs: no idle notice.
  options.idle_notice_delay = std::chrono::seconds(60);
  Client client = Client::Connect(daemon.path(), options);
  EXPECT_FALSE(client.AcquireLocal("m").has_value());
  client.Ping(std::chrono::seconds(60));
  RemoteWeights held = client.Acquire("m", std::chrono::seconds(60));
  std::optional<RemoteWeights> again = client.AcquireLocal("m");
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->load(), "local");
  EXPECT_EQ(again->lease(), 93u);
  EXPECT_EQ(again->data("w").data(), held.data("w").data()) << "one mapping";
  held.Release();
  again.reset();
  EXPECT_EQ(client.IdleLeases(), 1u);
  std::optional<RemoteWeights> revived = client.AcquireLocal("m");
  ASSERT_TRUE(revived.has_value()) << "an idle lease is revived locally";
  EXPECT_EQ(revived->lease(), 93u);
  EXPECT_EQ(client.IdleLeases(), 0u);
  EXPECT_EQ(BytesOf(revived->data("w")), BytesOf(c.file.data()));
  EXPECT_FALSE(client.AcquireLocal("other").has_value());
  client.Ping(std::chrono::seconds(60));
  fake.join();
}

TEST(ClientTest, ASuccessorWithoutReclaimIsSentNone) {
  FakeDaemon daemon;
  Copy c = MakeCopy(fs::path(daemon.path()).parent_path());
  std::thread fake([&] {
    daemon.Handshake(256, kReclaim);
    const protocol::Request acquire = daemon.Next();
    const int fds[] = {c.header.get(), c.data.get()};
    daemon.Send(
        protocol::EncodeAcquireReply(acquire.id, 95, "m", "hit", {c.reply}),
        fds);
    EXPECT_EQ(daemon.Next().op, protocol::Op::kPing);
    daemon.Crash();
    daemon.Handshake();  // no "reclaim"
    const protocol::Request ping = daemon.Next();
    EXPECT_EQ(ping.op, protocol::Op::kPing);
    daemon.Send(protocol::EncodeOk(ping.id));
    const protocol::Request last = daemon.Next();
    EXPECT_EQ(last.op, protocol::Op::kPing) << "no release of lease 95";
    daemon.Send(protocol::EncodeOk(last.id));
  });
  Client client = Client::Connect(daemon.path());
  RemoteWeights w = client.Acquire("m", std::chrono::seconds(60));
  client.Ping(std::chrono::seconds(60));
  const ReclaimStats stats = client.Reclaims();
  EXPECT_EQ(stats.reclaim_unsupported, 1u);
  EXPECT_EQ(stats.reclaimed + stats.reclaim_refused + stats.pending, 0u);
  EXPECT_EQ(BytesOf(w.data("w")), BytesOf(c.file.data()));
  w.Release();
  client.Ping(std::chrono::seconds(60));
  fake.join();
}

}  // namespace
}  // namespace modelcache::serve
