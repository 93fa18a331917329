// The client alone (client_core.cc, client_mapping.cc), against a fake
// daemon in this process: a listening SOCK_SEQPACKET socket whose one
// connection the test answers by hand, so that every byte the client sends
// is seen and every reply is the test's. Synchronised on the socket itself:
// the fake reads what the client sent, blocking, with a bound.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
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
  // The next request the client sent.
  protocol::Request Next() {
    pollfd p{conn_, POLLIN, 0};
    EXPECT_GT(::poll(&p, 1, kBoundMs), 0) << "the client sent nothing";
    detail::Datagram d;
    EXPECT_GT(
        detail::ReceiveDatagram(conn_, protocol::kMaxMessageBytes, 0, 0, &d),
        0);
    const protocol::ParsedRequest parsed = protocol::ParseRequest(d.bytes);
    EXPECT_TRUE(parsed.request) << parsed.error;
    return parsed.request.value_or(protocol::Request{});
  }
  void Send(const std::string& bytes, std::span<const int> fds = {}) {
    ASSERT_EQ(detail::SendDatagram(conn_, bytes, fds, 0), 0);
  }
  // Accepts and answers hello, announcing `max_queued_replies`.
  void Handshake(uint64_t max_queued_replies = 256) {
    Accept();
    const protocol::Request hello = Next();
    ASSERT_EQ(hello.op, protocol::Op::kHello);
    Send(protocol::EncodeHelloReply(
        hello.id, "fake",
        {{"max_queued_replies", max_queued_replies},
         {"max_message_bytes", protocol::kMaxMessageBytes}}));
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

Copy MakeCopy(const fs::path& dir) {
  const std::string path = (dir / "m.safetensors").string();
  weights::SafetensorsWriter writer;
  writer.AddTensor("w", weights::Dtype::kF32, {1024}, weights::PatternFill(7));
  writer.Write(path);
  Copy c{weights::WeightSet::Open(path), {}, {}, {}};
  const std::string json = weights::SafetensorsHeaderJson(c.file.header());
  c.header = weights::CreateSealedMemfd(
      "test:header", std::as_bytes(std::span(json.data(), json.size())));
  c.data = weights::CreateSealedMemfd("test:data", c.file.data());
  c.reply = {"m.safetensors", c.file.data().size(), json.size()};
  return c;
}

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

}  // namespace
}  // namespace modelcache::serve
