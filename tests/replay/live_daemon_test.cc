// The replay's prediction of swap scheduling checked against live runs of
// the daemon: the cases of live_agreement_test.cc (the starvation scenario
// at each kind of drain_after, the Zipf mix with service times), each
// played in real time against a real `modelcache serve` process
// (serve_test_util.h's kit starts it and stops it by pid) and replayed with
// the same time model, within the same bounds (live_harness.h,
// ExpectAgreement).
//
// The daemon plays the library's part as the replay's time model needs:
// the trace's models are real safetensors files of the workload's sizes;
// `--policy lru` (the replay's order; the daemon's store has 4 lock
// shards, so its LRU is the order of each shard's own); `--drain-after` as
// the case says (left out for the default); `--load-slots` as many as the
// models, so that loads are never limited in number (a model has at most
// one load at a time); and `--throttle-load-latency <load_ms>`, with the
// bandwidth left at its default, inf, so that every load takes the
// workload's load time: the throttle holds a load until max(start +
// latency, the end of its real read), and a real read of these files takes
// well under a millisecond. What the read and the copy's setup add after
// the hold is in the loads' measured mean (modelcache_load_duration_seconds),
// which the replay of the trace as played uses, as for the library.
//
// The budget is in the daemon's bytes: a copy is charged its data and
// header memfds in pages, so each model's size in the workload is replaced
// by its copy's bytes (`modelcache serve --check-catalog --json`), and the
// capacity is scaled alike (the same number of copies fit).
//
// Requests: one protocol connection per request in flight, from this
// process (DaemonTarget keeps a pool of connections, each carrying one
// request at a time). Each acquire is an acquire message to the daemon, so
// the daemon's scheduling is what is measured: a raw connection has no
// local reuse (it never says "delegate" or "drain", and never "idle"), and
// the daemon sees one client per request in flight (all of one pid, which
// its scheduling does not look at). Worker processes (serve_test_worker) would
// put a pipe round trip and another process's wake-up on each request's path,
// which on a busy machine would be measured as waits, and add nothing the
// daemon's scheduling sees: it tells clients apart by connection. A request's
// wait is from its ask (taking an idle connection, sending the acquire) to the
// reply's arrival; its release is sent when its hold ends, and its answer
// is read before the connection's next request (the pool hands out the
// connection idle longest, whose answer is the likeliest to be in).
//
// Real time: release build only, run alone (the Makefile's
// RELEASE_ONLY_TESTS names the ctest test LiveReplay.Daemon).
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "live_harness.h"
#include "serve_test_util.h"

namespace modelcache::replay::live {
namespace {

namespace st = serve::testing;
namespace protocol = serve::protocol;

// Connections opened before the first request, so that opening one is
// rarely on a request's path.
constexpr int kPrestartedConnections = 64;

// The daemon as a LiveTarget: each Acquire takes an idle connection of the
// pool (or opens one), sends an acquire and waits for its reply; the handle
// sends the release. Counts from the daemon's /metrics.
class DaemonTarget : public LiveTarget {
 public:
  explicit DaemonTarget(st::Daemon& daemon) : daemon_(daemon) {
    for (int i = 0; i < kPrestartedConnections; ++i) idle_.push_back(Open());
    base_ = Read();
  }

  std::shared_ptr<void> Acquire(const std::string& model,
                                uint64_t /*bytes*/) override {
    std::unique_ptr<Connection> c = Take();
    Settle(*c);
    const uint64_t id = c->next_id++;
    if (!c->raw.Send(protocol::EncodeAcquire(id, model, /*timeout_ms=*/60000,
                                             /*fail_when_full=*/false))) {
      throw Error(ErrorCode::kUnavailable, "send acquire");
    }
    const std::optional<protocol::Reply> reply = ReplyTo(*c, id);
    // The copy's memfds: this process does not map the copy; the lease is
    // the connection's until its release.
    c->raw.last_fds().clear();
    if (!reply || !reply->ok) {
      const std::string why = reply ? reply->message : "no reply";
      Give(std::move(c));
      throw Error(ErrorCode::kUnavailable, "acquire " + model + ": " + why);
    }
    const uint64_t lease = reply->lease;
    Connection* held = c.release();
    return std::shared_ptr<void>(held, [this, lease](void* p) {
      std::unique_ptr<Connection> c(static_cast<Connection*>(p));
      if (c->raw.Send(protocol::EncodeRelease(c->next_id++, lease))) {
        ++c->unanswered;
      }
      Give(std::move(c));
    });
  }

  Outcome Totals() override {
    const Outcome now = Read();
    Outcome out;
    out.loads = now.loads - base_.loads;
    out.bytes_loaded = now.bytes_loaded - base_.bytes_loaded;
    out.drains = now.drains - base_.drains;
    const double loads = static_cast<double>(out.loads);
    out.load_ms = loads == 0 ? 0 : (now.load_ms - base_.load_ms) / loads;
    return out;
  }

 private:
  struct Connection {
    explicit Connection(const std::string& socket) : raw(socket) {}
    st::Raw raw;
    uint64_t next_id = 1;
    int unanswered = 0;  // releases whose answers are unread
  };

  std::unique_ptr<Connection> Open() {
    auto c = std::make_unique<Connection>(daemon_.socket());
    const uint64_t id = c->next_id++;
    if (!c->raw.Send(protocol::EncodeHello(id))) {
      throw Error(ErrorCode::kUnavailable, "send hello");
    }
    const std::optional<protocol::Reply> hello = ReplyTo(*c, id);
    if (!hello || !hello->ok) {
      throw Error(ErrorCode::kUnavailable, "hello refused");
    }
    return c;
  }

  // The reply to request `id`; the daemon's own messages (id 0) are none
  // of ours and skipped.
  static std::optional<protocol::Reply> ReplyTo(Connection& c, uint64_t id) {
    for (;;) {
      std::optional<protocol::Reply> r = c.raw.Reply();
      if (!r || r->id == id) return r;
    }
  }

  // Reads the answers of the releases sent on `c`.
  static void Settle(Connection& c) {
    for (; c.unanswered > 0; --c.unanswered) {
      std::optional<protocol::Reply> r = c.raw.Reply();
      while (r && r->id == 0) r = c.raw.Reply();
      EXPECT_TRUE(r && r->ok) << "a release was refused";
    }
  }

  std::unique_ptr<Connection> Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The one idle longest: the answer to its release is the likeliest
      // to be in already, so that Settle does not wait for it.
      if (!idle_.empty()) {
        std::unique_ptr<Connection> c = std::move(idle_.front());
        idle_.pop_front();
        return c;
      }
    }
    return Open();
  }
  void Give(std::unique_ptr<Connection> c) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(c));
  }

  // The daemon's counters; load_ms is the loads' total time, in ms.
  Outcome Read() {
    Outcome out;
    out.loads = static_cast<uint64_t>(daemon_.Metric("modelcache_loads_total"));
    out.bytes_loaded =
        static_cast<uint64_t>(daemon_.Metric("modelcache_loaded_bytes_total"));
    out.drains =
        static_cast<uint64_t>(daemon_.Metric("modelcache_drains_total"));
    out.load_ms =
        1000.0 * daemon_.Metric("modelcache_load_duration_seconds_sum");
    return out;
  }

  st::Daemon& daemon_;
  Outcome base_;
  std::mutex mu_;
  std::deque<std::unique_ptr<Connection>> idle_;
};

// A duration flag's value: `ms` milliseconds, to the microsecond.
std::string Ms(double ms) { return std::to_string(ms) + "ms"; }

// A `--drain-after` value; empty for the default.
std::optional<std::string> DrainFlag(const std::optional<double>& ms) {
  if (!ms) return std::nullopt;
  if (std::isinf(*ms)) return "inf";
  return Ms(*ms);
}

class LiveDaemonReplay : public st::ServeTest {
 protected:
  // Writes `w`'s models, starts the daemon for it, plays it live against
  // the daemon and checks the agreement with the replay.
  void ExpectAgreement(const std::string& name, Workload w) {
    const size_t models = w.trace.models.size();
    for (size_t m = 0; m < models; ++m) {
      AddModel(w.trace.models[m], w.trace.sizes[m], m + 1);
    }
    // The workload in the daemon's bytes: each model its copy's, the
    // capacity scaled alike (the same copies fit).
    const auto [status, out] =
        st::RunCli(dir_, "serve --check-catalog --json --catalog " + catalog_ +
                             " --model-root " + root_);
    ASSERT_EQ(status, 0) << out;
    const st::json check = st::json::parse(out, nullptr, false);
    ASSERT_TRUE(check.is_object()) << out;
    std::map<std::string, uint64_t> copy_bytes;
    for (const st::json& m : check["models"]) {
      copy_bytes[m["id"].get<std::string>()] = m["bytes"].get<uint64_t>();
    }
    const double scale = static_cast<double>(copy_bytes[w.trace.models[0]]) /
                         static_cast<double>(w.trace.sizes[0]);
    for (size_t m = 0; m < models; ++m) {
      const uint64_t bytes = copy_bytes[w.trace.models[m]];
      ASSERT_EQ(bytes, static_cast<uint64_t>(std::llround(
                           scale * static_cast<double>(w.trace.sizes[m]))))
          << "the copies do not scale alike: " << out;
      w.trace.sizes[m] = bytes;
    }
    w.capacity = static_cast<uint64_t>(
        std::llround(scale * static_cast<double>(w.capacity)));

    std::vector<std::string> args = {"--policy",
                                     "lru",
                                     "--load-slots",
                                     std::to_string(models),
                                     "--throttle-load-latency",
                                     Ms(w.load_ms)};
    if (const std::optional<std::string> drain = DrainFlag(w.drain_after_ms)) {
      args.push_back("--drain-after");
      args.push_back(*drain);
    }
    st::Daemon& daemon = StartDaemon(std::to_string(w.capacity), args);
    DaemonTarget target(daemon);
    live::ExpectAgreement(name, "daemon", w, target);
  }
};

TEST_F(LiveDaemonReplay, StarvationAtZero) {
  ExpectAgreement("starvation", Starvation(0.0));
}

TEST_F(LiveDaemonReplay, StarvationAtAFiniteValue) {
  ExpectAgreement("starvation", Starvation(300.0));
}

TEST_F(LiveDaemonReplay, StarvationAtTheDefault) {
  ExpectAgreement("starvation", Starvation(std::nullopt));
}

TEST_F(LiveDaemonReplay, StarvationAtInfinity) {
  ExpectAgreement("starvation", Starvation(kNeverDrain));
}

// Through the daemon the live p99 and max wait run above the replay's in
// most runs (the p99 by up to 61 ms so far, within the bound but near it in
// one run of twenty): its waits for room are not served in arrival order,
// where the replay's are. A waiter takes the room when it next looks after
// a change (Budget::Reserve), and through the daemon a later waiter often
// looks first (docs/benchmarks.md, "Replay against live runs").
TEST_F(LiveDaemonReplay, ZipfMixWithServiceTimesAtTheDefault) {
  ExpectAgreement("zipf", ZipfMix(std::nullopt));
}

}  // namespace
}  // namespace modelcache::replay::live
