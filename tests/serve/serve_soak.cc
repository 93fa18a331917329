// serve_soak: `modelcache serve` under every fault at once, for minutes
// (`make soak`; not a ctest entry).
//
//   serve_soak [--minutes N | --seconds N] [--seed S] [--no-takeover]
//              [--workers N] [--drain-after D] [--verbose]
//
// One daemon (loopback HTTP, a UNIX socket, in a fresh folder) serves a
// table of models of known checksums. Eight worker processes
// (serve_test_worker, one driver thread each) loop: acquire a random model
// (waiting for room or failing at once when full), check every byte read
// against the model's checksum, hold it a random while (holding up to three
// at once), check all they hold again, release. Half of them (the odd
// slots) reuse leases locally and keep them idle a while (delegation), so
// that they get the daemon's recalls, those of drains included. The daemon
// runs with a short --drain-after (picked from the seed: 0, 50ms, 250ms or
// 1s, or --drain-after D), so that under the budget shrinks below a
// waiter's room the busy models drain. Meanwhile a fault thread
// injects, at random intervals:
//   - client kills: SIGKILL a worker, start a new one in its place;
//   - daemon kills: SIGKILL the daemon, start it again on the same socket
//     (its successor books what the workers still map, and adopts the copies
//     the clients reclaim);
//   - takeovers: `modelcache serve <same flags> --takeover` beside the
//     running daemon; the old one must exit 0 (--no-takeover leaves them
//     out);
//   - reloads: the catalog file rewritten with a random subset of the table,
//     then SIGHUP, and the daemon's /v1/models awaited until it lists that
//     subset;
//   - floods: four fresh workers each acquire a burst of leases at once;
//   - capacity changes: PUT /v1/budget on the admin socket, shrinking the
//     budget below what the table needs, and back.
// A sampler thread checks, every 100 ms, what must never fail:
//   - no copy is freed under a live mapping: every memfd of the daemon's
//     instance a live process maps is in the daemon's books
//     (ExpectBooksCoverMaps);
//   - used + orphaned <= capacity (/v1/budget). A shrink below what leases
//     hold cannot free a leased copy, so right after one the books may
//     stand above the new capacity; then nothing can reserve until they are
//     back under it. The bound after a shrink to C is therefore
//     max(C, used + orphaned as the PUT's own answer reads them), tightened
//     to max(C, the lowest reading since) as they drain (orphaned bytes
//     only shrink after a start, and /v1/budget reads them before used, so
//     a reading is never below the true sum at its end);
//   - no lease id is ever handed out twice, across every daemon of the run
//     (the workers report each lease they get; a worker that reuses locally
//     may report its own lease again, never another process's);
//   - no descriptor leak in the daemon. Its open descriptors at a sample
//     (the lesser of a reading before and one after its books are read)
//     must stay within
//         baseline                 the first daemon's, at ready, no client
//       + memfds in its books      two per file of each copy it holds
//                                  (header, data), retired copies included
//       + 2 x clients              a connection: its socket and the peer's
//                                  pidfd
//       + orphan pids + orphaned leases
//                                  a pidfd per process mapping a
//                                  predecessor's copy, one per connection
//                                  gone whose process still maps a copy
//       + 3 x load slots           a load in flight: the file and the two
//                                  memfds it fills before they are booked
//       + 8                        the HTTP connections of this program's
//                                  own requests and a start's record files,
//                                  still closing
//     on three samples in a row (a leak stays; a connection being accepted
//     between two readings does not).
// Every request's failure is sorted: a documented refusal (NOT_FOUND for a
// model a reload removed while the request was out; CAPACITY, TIMEOUT or
// TOO_LARGE while the budget was shrunk; UNAVAILABLE or TIMEOUT while a
// daemon was dead or being taken over) or a failure outside them. The
// summary counts each fault injected and survived, the requests made, and
// the failures by kind, the drains (modelcache_drains_total, loads queued
// behind one) and recalls the daemons made, and the refused reclaims by the
// reason each daemon logged; the exit status is 1 on any failure outside the
// refusals, any sampler violation, any wrong byte, any failed write of a
// daemon's record (modelcache_record_write_failures_total), or a fault that
// could not be injected (a daemon that did not come back, a takeover
// refused).
//
// Every process is started by this program's threads and stopped by pid at
// the end (the workers by "exit" or SIGKILL, the daemon by SIGTERM), also
// on failure; they die with it (PR_SET_PDEATHSIG) if it is killed itself.
#include <getopt.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "modelcache/base/mutex.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

using base::Mutex;
using base::MutexLock;
using TimePoint = Clock::time_point;

constexpr auto kForever = TimePoint::max();

struct Options {
  std::chrono::seconds duration{30 * 60};
  uint64_t seed = 1;
  bool takeover = true;
  int workers = 8;
  // Empty: picked from the seed (kDrainAfters).
  std::string drain_after;
  bool verbose = false;
};

// The --drain-after of a run whose flag does not say: short, so that drains
// happen within a shrink, and 1s for the rule at the library's floor.
constexpr const char* kDrainAfters[] = {"0", "50ms", "250ms", "1s"};

// The gtest checks of the kit (ExpectBooksCoverMaps, Process's bounds)
// report here: this program runs no test, and counts what they find.
class FailureCounter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) count_.fetch_add(1);
  }
  int count() const { return count_.load(); }

 private:
  std::atomic<int> count_{0};
};

struct Model {
  std::string id;
  uint64_t checksum = 0;
};

// What happened when: the windows in which a refusal is documented.
class History {
 public:
  // A daemon dead or being taken over, from `begin` until End().
  size_t BeginOutage() {
    MutexLock lock(&mu_);
    outages_.push_back({Clock::now(), kForever});
    return outages_.size() - 1;
  }
  void EndOutage(size_t i) {
    MutexLock lock(&mu_);
    outages_[i].second = Clock::now();
  }
  void SetShrunk(bool shrunk) {
    MutexLock lock(&mu_);
    if (shrunk && !shrunk_) shrinks_.push_back({Clock::now(), kForever});
    if (!shrunk && shrunk_) shrinks_.back().second = Clock::now();
    shrunk_ = shrunk;
  }
  bool shrunk() {
    MutexLock lock(&mu_);
    return shrunk_;
  }
  // A catalog version: sent (the file written, SIGHUP) and confirmed (the
  // daemon lists it).
  size_t Catalog(std::set<std::string> models) {
    MutexLock lock(&mu_);
    versions_.push_back({Clock::now(), kForever, std::move(models)});
    return versions_.size() - 1;
  }
  void Confirm(size_t i) {
    MutexLock lock(&mu_);
    versions_[i].confirmed = Clock::now();
  }

  // The catalog last sent.
  std::vector<std::string> Latest() {
    MutexLock lock(&mu_);
    return {versions_.back().models.begin(), versions_.back().models.end()};
  }

  bool Outage(TimePoint from, TimePoint to) {
    MutexLock lock(&mu_);
    return Overlaps(outages_, from, to);
  }
  bool Shrunk(TimePoint from, TimePoint to) {
    MutexLock lock(&mu_);
    return Overlaps(shrinks_, from, to);
  }
  // Whether the daemon may have been without `model` at some moment of
  // [from, to]: a version without it was in effect from its sending until
  // the next version was confirmed.
  bool MaybeAbsent(const std::string& model, TimePoint from, TimePoint to) {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < versions_.size(); ++i) {
      if (versions_[i].models.count(model) != 0) continue;
      const TimePoint begin = versions_[i].sent;
      const TimePoint end =
          i + 1 < versions_.size() ? versions_[i + 1].confirmed : kForever;
      if (begin <= to && from <= end) return true;
    }
    return false;
  }

 private:
  using Windows = std::vector<std::pair<TimePoint, TimePoint>>;
  static bool Overlaps(const Windows& windows, TimePoint from, TimePoint to) {
    for (const auto& [begin, end] : windows) {
      if (begin <= to && from <= end) return true;
    }
    return false;
  }
  struct Version {
    TimePoint sent;
    TimePoint confirmed;
    std::set<std::string> models;
  };

  Mutex mu_;
  Windows outages_ MC_GUARDED_BY(mu_);
  Windows shrinks_ MC_GUARDED_BY(mu_);
  bool shrunk_ MC_GUARDED_BY(mu_) = false;
  std::vector<Version> versions_ MC_GUARDED_BY(mu_);
};

// Counts for the summary, and the first messages of what went wrong.
class Tally {
 public:
  void Add(const std::string& key, int64_t n = 1) {
    MutexLock lock(&mu_);
    counts_[key] += n;
  }
  int64_t Get(const std::string& key) {
    MutexLock lock(&mu_);
    return counts_[key];
  }
  // A failure outside the documented refusals, or a violation.
  void Bad(const std::string& key, const std::string& what) {
    MutexLock lock(&mu_);
    counts_[key] += 1;
    if (messages_.size() < 40) messages_.push_back(key + ": " + what);
    std::fprintf(stderr, "soak: %s: %s\n", key.c_str(), what.c_str());
  }
  std::vector<std::string> messages() {
    MutexLock lock(&mu_);
    return messages_;
  }

 private:
  Mutex mu_;
  std::map<std::string, int64_t> counts_ MC_GUARDED_BY(mu_);
  std::vector<std::string> messages_ MC_GUARDED_BY(mu_);
};

// "error CODE message" -> "CODE".
std::string Code(const std::string& reply) {
  std::istringstream in(reply);
  std::string word;
  std::string code;
  in >> word >> code;
  return word == "error" ? code : "";
}

class Soak {
 public:
  explicit Soak(const Options& options)
      : options_(options),
        drain_after_(options.drain_after.empty()
                         ? kDrainAfters[options.seed % std::size(kDrainAfters)]
                         : options.drain_after),
        random_(options.seed) {}

  int Run() {
    Setup();
    std::vector<std::thread> threads;
    for (int k = 0; k < options_.workers; ++k) {
      slots_.push_back(std::make_unique<Slot>());
      slots_.back()->reuse = k % 2 == 1;
    }
    for (int k = 0; k < options_.workers; ++k) {
      threads.emplace_back([this, k] { Drive(k); });
    }
    std::thread sampler([this] { Sample(); });
    try {
      Inject();
    } catch (const std::exception& e) {
      tally_.Bad("fault_not_injected", e.what());
    }
    stop_ = true;
    for (std::thread& t : threads) t.join();
    sampler.join();
    return Finish();
  }

 private:
  // A worker's place: its process, and whether the fault thread killed it.
  struct Slot {
    Mutex mu;
    pid_t pid MC_GUARDED_BY(mu) = -1;
    bool killed MC_GUARDED_BY(mu) = false;
    // Its driver's alone: whether its workers reuse leases locally, and
    // which worker process it has now (AddLease).
    bool reuse = false;
    uint64_t owner = 0;
  };

  void Setup() {
    // 10 models of 1 to 2.5 MiB: 17.5 MiB for the whole table, far within
    // the normal budget even with a dead daemon's copies orphaned beside a
    // fresh load of each.
    for (int i = 0; i < 10; ++i) {
      Model m;
      m.id = "m" + std::to_string(i);
      m.checksum = WriteModel(root_ + "/" + m.id + "/model.safetensors",
                              kMiB + static_cast<uint64_t>(i % 4) * kMiB / 2,
                              100 + static_cast<uint64_t>(i));
      table_.push_back(m);
    }
    std::set<std::string> first;
    for (int i = 0; i < 8; ++i) first.insert(table_[i].id);
    WriteCatalogOf(first);
    history_.Confirm(history_.Catalog(first));
    DaemonOptions d;
    d.catalog = catalog_;
    d.root = root_;
    d.socket = socket_;
    d.capacity = std::to_string(kNormalCapacity);
    d.args = {"--reclaim-grace", "2s",        "--load-slots", "2",
              "--drain-after",   drain_after_};
    // Read at the end for the reasons of refused reclaims (and shown when
    // the run fails).
    d.log_file = log_;
    daemon_ = std::make_unique<Daemon>(d);
    baseline_ = daemon_->baseline_fds();
    {
      MutexLock bound(&bound_mu_);
      capacity_bound_ = kNormalCapacity;
    }
  }

  void WriteCatalogOf(const std::set<std::string>& ids) {
    std::vector<ModelSpec> specs;
    for (const std::string& id : ids) {
      ModelSpec s;
      s.id = id;
      s.files = {id + "/model.safetensors"};
      specs.push_back(s);
    }
    // Whole or not at all: a daemon started meanwhile reads one version.
    WriteCatalog(catalog_ + ".next", specs);
    fs::rename(catalog_ + ".next", catalog_);
  }

  uint64_t Rand(uint64_t n) {
    MutexLock lock(&random_mu_);
    return random_() % n;
  }

  // ---- workers ----

  // One driver per slot: its worker's whole life, and its replacements.
  void Drive(int k) {
    Slot& slot = *slots_[k];
    std::unique_ptr<Worker> worker;
    std::deque<std::string> held;
    while (!stop_) {
      try {
        Step(slot, &worker, &held);
      } catch (const std::exception& e) {
        tally_.Bad("driver_error", e.what());
        if (worker) Replace(slot, &worker);
      }
    }
    Retire(slot, &worker);
  }

  // One step of a driver: a fresh worker when it has none, then an acquire,
  // or a check and a release.
  void Step(Slot& slot, std::unique_ptr<Worker>* worker_ptr,
            std::deque<std::string>* held_ptr) {
    std::unique_ptr<Worker>& worker = *worker_ptr;
    std::deque<std::string>& held = *held_ptr;
    if (!worker) {
      worker = std::make_unique<Worker>();
      {
        MutexLock lock(&slot.mu);
        slot.pid = worker->pid();
        slot.killed = false;
      }
      slot.owner = next_owner_.fetch_add(1) + 1;
      held.clear();
      if (!Connect(*worker, slot)) {
        Replace(slot, &worker);
        return;
      }
    }
    bool alive = true;
    if (held.size() < 1 + Rand(3) || held.empty()) {
      alive = AcquireOne(*worker, slot, &held);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(Rand(150)));
      alive = CheckHeld(*worker, slot, held) &&
              Expect(*worker, slot, "release " + held.front(), "release");
      if (alive) held.pop_front();
    }
    if (!alive) Replace(slot, &worker);
  }

  void Retire(Slot& slot, std::unique_ptr<Worker>* worker_ptr) {
    std::unique_ptr<Worker>& worker = *worker_ptr;
    if (worker) {
      {
        MutexLock lock(&slot.mu);
        slot.pid = -1;
      }
      if (!worker->process().Exited()) {
        try {
          worker->Send("release-all");
          worker->Receive();
        } catch (const std::exception&) {
        }
      }
      worker.reset();  // "exit", then reaped
    }
  }

  // The reply of `command`, or nullopt when the worker died (killed by the
  // fault thread, or not: that is a failure).
  std::optional<std::string> Do(Worker& worker, Slot& slot,
                                const std::string& command) {
    std::string reply;
    try {
      reply = worker.Do(command);
    } catch (const std::exception&) {
      reply.clear();
    }
    if (!reply.empty()) return reply;
    MutexLock lock(&slot.mu);
    if (!slot.killed) {
      tally_.Bad("worker_died", "worker pid " + std::to_string(slot.pid) +
                                    " ended unasked during '" + command + "'");
    }
    return std::nullopt;
  }

  void Replace(Slot& slot, std::unique_ptr<Worker>* worker) {
    {
      MutexLock lock(&slot.mu);
      slot.pid = -1;
    }
    (*worker)->process().Signal(SIGKILL);
    (*worker)->process().Wait();
    worker->reset();
  }

  bool Connect(Worker& worker, Slot& slot) {
    for (;;) {
      const TimePoint start = Clock::now();
      const auto reply = Do(
          worker, slot,
          "connect " + socket_ +
              (slot.reuse ? " reuse=1 keep_idle_ms=1000 notice_us=1000" : ""));
      if (!reply) return false;
      if (*reply == "ok") return true;
      if (history_.Outage(start, Clock::now()) && !stop_) continue;
      tally_.Bad("connect_failed", *reply);
      if (stop_) return false;
    }
  }

  // A command whose answer must be "ok" (any failure is outside the
  // documented refusals).
  bool Expect(Worker& worker, Slot& slot, const std::string& command,
              const std::string& key) {
    const auto reply = Do(worker, slot, command);
    if (!reply) return false;
    if (*reply != "ok") tally_.Bad(key + "_failed", command + " -> " + *reply);
    return true;
  }

  bool CheckHeld(Worker& worker, Slot& slot,
                 const std::deque<std::string>& held) {
    const auto reply = Do(worker, slot, "checksum");
    if (!reply) return false;
    std::string want = "ok";
    for (const std::string& m : held) {
      want += " " + std::to_string(Checksum(m));
    }
    if (*reply != want) {
      tally_.Bad("wrong_bytes", "held " + want + ", read " + *reply);
    }
    return true;
  }

  uint64_t Checksum(const std::string& id) const {
    for (const Model& m : table_) {
      if (m.id == id) return m.checksum;
    }
    return 0;
  }

  bool AcquireOne(Worker& worker, Slot& slot, std::deque<std::string>* held) {
    // Mostly what the catalog holds now; now and then anything, for the
    // refusals of what a reload removed.
    std::string model = table_[Rand(table_.size())].id;
    if (Rand(5) != 0) {
      const std::vector<std::string> now = history_.Latest();
      model = now[Rand(now.size())];
    }
    const bool fail = Rand(3) == 0;
    const std::string command =
        "acquire " + model + (fail ? " 3000 fail" : " 10000");
    const TimePoint start = Clock::now();
    tally_.Add("requests");
    const auto reply = Do(worker, slot, command);
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        Clock::now() - start);
    if (!reply) {
      tally_.Add("requests_cut_by_kill");
      return false;
    }
    if (reply->rfind("ok ", 0) == 0) {
      std::istringstream in(reply->substr(3));
      std::string lease;
      uint64_t sum = 0;
      in >> lease >> sum;
      AddLease(lease, slot.owner, slot.reuse);
      if (!fail) {
        MutexLock lock(&leases_mu_);
        longest_served_wait_ = std::max(longest_served_wait_, waited);
      }
      if (sum != Checksum(model)) {
        tally_.Bad("wrong_bytes", model + ": " + *reply);
      }
      held->push_back(model);
      tally_.Add("requests_served");
      return true;
    }
    Classify(model, *reply, start, Clock::now());
    return true;
  }

  // Sorts a failed request's reply.
  void Classify(const std::string& model, const std::string& reply,
                TimePoint start, TimePoint end) {
    const std::string code = Code(reply);
    const bool outage = history_.Outage(start, end);
    const bool shrunk = history_.Shrunk(start, end);
    std::string why;
    if (code == "NOT_FOUND" && history_.MaybeAbsent(model, start, end)) {
      why = "not_found_removed";
    } else if ((code == "CAPACITY" || code == "TIMEOUT" ||
                code == "TOO_LARGE") &&
               shrunk) {
      why = "capacity_shrunk_" + code;
    } else if ((code == "UNAVAILABLE" || code == "TIMEOUT") && outage) {
      why = "daemon_gone_" + code;
    }
    if (!why.empty()) {
      tally_.Add("refused:" + why);
      tally_.Add("requests_refused");
      return;
    }
    tally_.Add("requests_failed_outside");
    tally_.Bad("failed_outside", "acquire " + model + " -> " + reply);
  }

  // A lease a worker process (`owner`) reported: new, or one this same
  // process got before when it reuses locally (a local reference, an idle
  // delegation revived, a lease it reclaimed after a daemon's end).
  void AddLease(const std::string& lease, uint64_t owner, bool reuse) {
    MutexLock lock(&leases_mu_);
    const auto [it, fresh] = lease_ids_.emplace(lease, owner);
    if (fresh) return;
    if (reuse && it->second == owner) {
      tally_.Add("requests_local");
      return;
    }
    tally_.Bad("lease_id_reused", lease);
  }

  // ---- faults ----

  void Inject() {
    const TimePoint end = Clock::now() + options_.duration;
    while (Clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500 + Rand(2500)));
      if (Clock::now() >= end || failed_faults_ > 0) break;
      const uint64_t pick = Rand(100);
      if (pick < 28) {
        KillWorker();
      } else if (pick < 40) {
        KillDaemon();
      } else if (pick < 50) {
        if (options_.takeover) {
          Takeover();
        } else {
          KillWorker();
        }
      } else if (pick < 65) {
        Reload();
      } else if (pick < 80) {
        Flood();
      } else {
        ChangeCapacity();
      }
    }
  }

  void KillWorker() {
    Slot& slot = *slots_[Rand(slots_.size())];
    MutexLock lock(&slot.mu);
    if (slot.pid <= 0 || slot.killed) return;
    slot.killed = true;
    ::kill(slot.pid, SIGKILL);
    tally_.Add("fault:worker_kills");
  }

  // The reclaims this daemon accepted, its drains and recalls, and the
  // writes of its record that failed (each one a violation: a successor
  // reclaims nothing made since), added once per daemon at its end.
  void CountDaemon() MC_REQUIRES(daemon_mu_) {
    const json budget = daemon_->Budget();
    if (!budget.is_object()) return;
    const auto record_failures = static_cast<int64_t>(
        daemon_->Metric("modelcache_record_write_failures_total"));
    tally_.Add("record_writes_failed", record_failures);
    if (record_failures > 0) {
      tally_.Bad("record_write_failed",
                 std::to_string(record_failures) +
                     " writes of the daemon's record failed (its log says "
                     "why)");
    }
    tally_.Add("reclaims_accepted",
               static_cast<int64_t>(daemon_->Metric(
                   "modelcache_reclaims_total{result=\"accepted\"}")));
    tally_.Add("reclaims_refused",
               static_cast<int64_t>(daemon_->Metric(
                   "modelcache_reclaims_total{result=\"refused\"}")));
    for (const char* metric :
         {"modelcache_drains_total", "modelcache_queued_behind_drain_total",
          "modelcache_refused_unloads_total",
          "modelcache_recalls_total{answer=\"release\"}",
          "modelcache_recalls_total{answer=\"busy\"}",
          "modelcache_recalls_total{answer=\"unanswered\"}"}) {
      tally_.Add(metric, static_cast<int64_t>(daemon_->Metric(metric)));
    }
  }

  void KillDaemon() {
    MutexLock lock(&daemon_mu_);
    CountDaemon();
    const size_t outage = history_.BeginOutage();
    daemon_->process().Signal(SIGKILL);
    daemon_->process().Wait();
    try {
      daemon_->Start();
    } catch (const std::exception& e) {
      ++failed_faults_;
      tally_.Bad("daemon_not_restarted", e.what());
      history_.EndOutage(outage);
      return;
    }
    history_.EndOutage(outage);
    // A fresh daemon has the flags' capacity.
    history_.SetShrunk(false);
    {
      MutexLock bound(&bound_mu_);
      capacity_bound_ = kNormalCapacity;
    }
    tally_.Add("fault:daemon_kills");
  }

  void Takeover() {
    MutexLock lock(&daemon_mu_);
    CountDaemon();
    const size_t outage = history_.BeginOutage();
    int status = 0;
    try {
      status = daemon_->Takeover();
    } catch (const std::exception& e) {
      history_.EndOutage(outage);
      ++failed_faults_;
      tally_.Bad("takeover_refused", e.what());
      return;
    }
    history_.EndOutage(outage);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      tally_.Bad("takeover_old_exit",
                 "the old daemon's wait status " + std::to_string(status));
    }
    // Whatever the handover kept of the budget, the normal one again.
    const HttpResult put = daemon_->Send(
        "PUT", "/v1/budget", json{{"capacity_bytes", kNormalCapacity}}.dump());
    if (put.status != 200) tally_.Bad("capacity_change_failed", put.body);
    history_.SetShrunk(false);
    {
      MutexLock bound(&bound_mu_);
      capacity_bound_ = kNormalCapacity;
    }
    tally_.Add("fault:takeovers");
  }

  void Reload() {
    std::set<std::string> next;
    while (next.size() < 3) {
      next.clear();
      for (const Model& m : table_) {
        if (Rand(10) < 7) next.insert(m.id);
      }
    }
    MutexLock lock(&daemon_mu_);
    WriteCatalogOf(next);
    const size_t version = history_.Catalog(next);
    ::kill(daemon_->pid(), SIGHUP);
    const bool applied = Eventually(
        [&] {
          const json list = daemon_->GetJson("/v1/models");
          if (!list.is_object()) return false;
          std::set<std::string> ids;
          for (const json& m : list["models"]) {
            ids.insert(m["id"].get<std::string>());
          }
          return ids == next;
        },
        "the daemon lists the reloaded catalog");
    history_.Confirm(version);
    if (!applied) {
      tally_.Bad("reload_not_applied", "the daemon never listed it");
      return;
    }
    tally_.Add("fault:reloads");
  }

  void Flood() {
    std::vector<std::unique_ptr<Worker>> flood;
    for (int i = 0; i < 4; ++i) {
      flood.push_back(std::make_unique<Worker>());
      const std::string r = flood.back()->Do("connect " + socket_);
      if (r != "ok") {
        // No daemon dies during a flood (this thread kills them).
        tally_.Bad("connect_failed", "flood: " + r);
        flood.pop_back();
      }
    }
    std::vector<std::string> models;
    std::vector<int> counts;
    std::vector<uint64_t> owners;
    const TimePoint start = Clock::now();
    for (auto& w : flood) {
      models.push_back(table_[Rand(table_.size())].id);
      owners.push_back(next_owner_.fetch_add(1) + 1);
      counts.push_back(4 + static_cast<int>(Rand(13)));
      w->Send("burst " + models.back() + " " + std::to_string(counts.back()) +
              " 10000");
    }
    for (size_t i = 0; i < flood.size(); ++i) {
      const std::string reply = flood[i]->Receive();
      std::istringstream in(reply);
      std::string word;
      int got = 0;
      in >> word >> got;
      if (word != "ok") {
        tally_.Bad("flood_failed", reply);
        continue;
      }
      tally_.Add("requests", got);
      tally_.Add("requests_served", got);
      tally_.Add("flood_leases", got);
      for (int j = 0; j < got; ++j) {
        in >> word;
        const size_t comma = word.find(',');
        AddLease(word.substr(0, comma), owners[i], /*reuse=*/false);
        if (word.substr(comma + 1) != std::to_string(Checksum(models[i]))) {
          tally_.Bad("wrong_bytes", "flood " + models[i] + ": " + word);
        }
      }
      const size_t bar = reply.find(" | ");
      if (bar != std::string::npos) {
        tally_.Add("requests");
        Classify(models[i], reply.substr(bar + 3), start, Clock::now());
      }
    }
    for (auto& w : flood) w->Do("release-all");
    flood.clear();  // each "exit", reaped
    tally_.Add("fault:floods");
  }

  void ChangeCapacity() {
    MutexLock lock(&daemon_mu_);
    uint64_t capacity = kNormalCapacity;
    if (!history_.shrunk() || Rand(10) < 3) {
      // Below the table's 17.5 MiB: some acquires must wait or fail.
      capacity = 3 * kMiB + Rand(10) * kMiB;
    }
    const bool shrink = capacity < kNormalCapacity;
    if (shrink) history_.SetShrunk(true);
    const HttpResult put = daemon_->Send(
        "PUT", "/v1/budget", json{{"capacity_bytes", capacity}}.dump());
    if (put.status != 200) {
      tally_.Bad("capacity_change_failed", put.body);
      return;
    }
    const json b = put.Json();
    const uint64_t books =
        b["used_bytes"].get<uint64_t>() + b["orphaned_bytes"].get<uint64_t>();
    {
      MutexLock bound(&bound_mu_);
      capacity_bound_ = std::max(capacity, books);
    }
    if (!shrink) history_.SetShrunk(false);
    tally_.Add("fault:capacity_changes");
  }

  // ---- the sampler ----

  void Sample() {
    TimePoint next = Clock::now();
    int over_fds = 0;
    while (!stop_) {
      next += std::chrono::milliseconds(100);
      try {
        MutexLock lock(&daemon_mu_);
        SampleOnce(&over_fds);
      } catch (const std::exception& e) {
        tally_.Bad("sampler_no_books", e.what());
      }
      tally_.Add("samples");
      std::this_thread::sleep_until(next);
      if (Clock::now() > next + std::chrono::seconds(1)) next = Clock::now();
    }
  }

  void SampleOnce(int* over_fds) MC_REQUIRES(daemon_mu_) {
    Daemon& d = *daemon_;
    const int before = failures_->count();
    ExpectBooksCoverMaps(d);
    if (failures_->count() > before) {
      tally_.Bad("freed_under_mapping", "ExpectBooksCoverMaps failed");
    }

    const int fds_before = d.OpenFds();
    const json copies = d.GetJson("/v1/copies");
    const json budget = d.Budget();
    const double clients = d.Metric("modelcache_clients");
    const int fds_after = d.OpenFds();
    if (!copies.is_object() || !budget.is_object()) {
      tally_.Bad("sampler_no_books", "no /v1/copies or /v1/budget");
      return;
    }

    const uint64_t used = budget["used_bytes"].get<uint64_t>();
    const uint64_t orphaned = budget["orphaned_bytes"].get<uint64_t>();
    const uint64_t capacity = budget["capacity_bytes"].get<uint64_t>();
    {
      MutexLock bound(&bound_mu_);
      const uint64_t allowed = std::max(capacity, capacity_bound_);
      if (used + orphaned > allowed) {
        tally_.Bad("over_budget",
                   budget.dump() + " allowed " + std::to_string(allowed));
      }
      capacity_bound_ =
          std::max(capacity, std::min(capacity_bound_, used + orphaned));
    }

    std::set<pid_t> orphan_pids;
    for (const json& o : copies["orphans"]) {
      for (const json& pid : o["pids"]) orphan_pids.insert(pid.get<pid_t>());
    }
    const int64_t bound =
        baseline_ + static_cast<int64_t>(copies["memfds"].size()) +
        2 * static_cast<int64_t>(clients) +
        static_cast<int64_t>(orphan_pids.size()) +
        budget["orphaned_leases"].get<int64_t>() + 3 * kLoadSlots + 8;
    const int fds = std::min(fds_before, fds_after);
    max_fds_ = std::max(max_fds_, fds);
    if (fds > bound) {
      if (++*over_fds == 3) {
        tally_.Bad("fd_leak", std::to_string(fds) +
                                  " descriptors open, bound " +
                                  std::to_string(bound) + " (baseline " +
                                  std::to_string(baseline_) + ")");
      }
    } else {
      *over_fds = 0;
    }
  }

  // ---- the end ----

  int Finish() {
    {
      MutexLock lock(&daemon_mu_);
      CountDaemon();
    }
    daemon_.reset();  // SIGTERM, reaped
    const auto n = [&](const std::string& key) {
      return static_cast<long long>(tally_.Get(key));
    };
    std::printf(
        "serve_soak summary (seed %" PRIu64 ", %lld s, --drain-after %s%s)\n",
        options_.seed, static_cast<long long>(options_.duration.count()),
        drain_after_.c_str(), options_.takeover ? "" : ", no takeovers");
    std::printf("faults injected and survived:\n");
    std::printf("  worker kills        %lld\n", n("fault:worker_kills"));
    std::printf("  daemon kills        %lld\n", n("fault:daemon_kills"));
    std::printf("  reclaims accepted   %lld (refused %lld)\n",
                n("reclaims_accepted"), n("reclaims_refused"));
    for (const auto& [why, count] : RefusedReclaims()) {
      std::printf("    refused: %-40s %lld\n", why.c_str(), count);
    }
    std::printf("  record writes failed %lld\n", n("record_writes_failed"));
    std::printf("  takeovers           %lld\n", n("fault:takeovers"));
    std::printf("  reloads             %lld\n", n("fault:reloads"));
    std::printf("  floods              %lld (%lld leases)\n", n("fault:floods"),
                n("flood_leases"));
    std::printf("  capacity changes    %lld\n", n("fault:capacity_changes"));
    std::printf("requests              %lld\n", n("requests"));
    std::printf("  served              %lld\n", n("requests_served"));
    std::printf("  cut by a worker kill %lld\n", n("requests_cut_by_kill"));
    std::printf("  documented refusals %lld\n", n("requests_refused"));
    for (const char* why :
         {"not_found_removed", "capacity_shrunk_CAPACITY",
          "capacity_shrunk_TIMEOUT", "capacity_shrunk_TOO_LARGE",
          "daemon_gone_UNAVAILABLE", "daemon_gone_TIMEOUT"}) {
      std::printf("    %-26s %lld\n", why, n(std::string("refused:") + why));
    }
    std::printf("  failed outside them %lld\n", n("requests_failed_outside"));
    std::printf("  local reuses        %lld (a lease id its own worker had)\n",
                n("requests_local"));
    {
      MutexLock lock(&leases_mu_);
      std::printf("  longest served wait %lld ms\n",
                  static_cast<long long>(longest_served_wait_.count()));
    }
    std::printf("drains                %lld (loads queued behind one %lld)\n",
                n("modelcache_drains_total"),
                n("modelcache_queued_behind_drain_total"));
    std::printf(
        "recalls answered      release %lld, busy %lld, unanswered %lld "
        "(evictions refused for delegated leases %lld)\n",
        n("modelcache_recalls_total{answer=\"release\"}"),
        n("modelcache_recalls_total{answer=\"busy\"}"),
        n("modelcache_recalls_total{answer=\"unanswered\"}"),
        n("modelcache_refused_unloads_total"));
    size_t lease_ids = 0;
    {
      MutexLock lock(&leases_mu_);
      lease_ids = lease_ids_.size();
    }
    std::printf(
        "sampler: %lld samples; daemon descriptors at most %d "
        "(baseline %d); %zu lease ids, none reused unless below\n",
        n("samples"), max_fds_, baseline_, lease_ids);
    const char* const bad[] = {
        "failed_outside",         "wrong_bytes",        "lease_id_reused",
        "freed_under_mapping",    "over_budget",        "fd_leak",
        "sampler_no_books",       "worker_died",        "connect_failed",
        "release_failed",         "flood_failed",       "daemon_not_restarted",
        "takeover_refused",       "takeover_old_exit",  "reload_not_applied",
        "capacity_change_failed", "fault_not_injected", "driver_error",
        "record_write_failed"};
    int64_t violations = 0;
    for (const char* key : bad) {
      if (n(key) > 0) {
        std::printf("  FAILED %-24s %lld\n", key, n(key));
        violations += n(key);
      }
    }
    const int kit = failures_->count();
    if (kit > 0) std::printf("  FAILED kit checks (gtest) %d\n", kit);
    for (const std::string& m : tally_.messages()) {
      std::printf("    %s\n", m.c_str());
    }
    const bool ok = violations == 0 && kit == 0;
    if (!ok) PrintLogTail(40);
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  }

  // The daemons' logged reasons for refused reclaims ("reclaim of lease L
  // ('m') refused: WHY"), their numbers made N so that alike ones add up.
  std::map<std::string, long long> RefusedReclaims() const {
    std::map<std::string, long long> reasons;
    std::ifstream log(log_);
    std::string line;
    while (std::getline(log, line)) {
      if (line.find("reclaim of lease ") == std::string::npos) continue;
      const size_t at = line.find(") refused: ");
      if (at == std::string::npos) continue;
      std::string why;
      for (const char c : line.substr(at + 11)) {
        const bool digit = c >= '0' && c <= '9';
        if (!digit) why += c;
        if (digit && (why.empty() || why.back() != 'N')) why += 'N';
      }
      ++reasons[why.substr(0, 60)];
    }
    return reasons;
  }

  void PrintLogTail(size_t lines) const {
    std::ifstream log(log_);
    std::deque<std::string> tail;
    std::string line;
    while (std::getline(log, line)) {
      tail.push_back(line);
      if (tail.size() > lines) tail.pop_front();
    }
    std::printf("the daemons' log, its last %zu lines:\n", tail.size());
    for (const std::string& l : tail) std::printf("    %s\n", l.c_str());
  }

  static constexpr uint64_t kNormalCapacity = 64 * kMiB;
  static constexpr int64_t kLoadSlots = 2;

 public:
  FailureCounter* failures_ = nullptr;

 private:
  const Options options_;
  TempDir dir_;
  const std::string root_ = dir_ / "models";
  const std::string catalog_ = dir_ / "catalog.json";
  const std::string socket_ = dir_ / "run/serve.sock";
  const std::string log_ = dir_ / "daemon.log";  // every daemon's, appended
  const std::string drain_after_;
  std::vector<Model> table_;  // written before the threads start
  std::vector<std::unique_ptr<Slot>> slots_;

  Mutex random_mu_;
  std::mt19937_64 random_ MC_GUARDED_BY(random_mu_);

  // The daemon: restarted, taken over and signalled by the fault thread,
  // read by the sampler, never both at once. The workers know only its
  // socket.
  Mutex daemon_mu_;
  std::unique_ptr<Daemon> daemon_;
  int baseline_ = 0;  // the first daemon's, before the threads start
  int max_fds_ = 0;   // the sampler's

  Mutex bound_mu_;
  uint64_t capacity_bound_ MC_GUARDED_BY(bound_mu_) = 0;

  Mutex leases_mu_;
  // Each lease id reported, and the worker process (owner) that got it.
  std::map<std::string, uint64_t> lease_ids_ MC_GUARDED_BY(leases_mu_);
  std::chrono::milliseconds longest_served_wait_ MC_GUARDED_BY(leases_mu_){0};
  std::atomic<uint64_t> next_owner_{0};

  History history_;
  Tally tally_;
  std::atomic<bool> stop_{false};
  std::atomic<int> failed_faults_{0};
};

int Main(int argc, char** argv) {
  Options options;
  static const option longs[] = {
      {"minutes", required_argument, nullptr, 'm'},
      {"seconds", required_argument, nullptr, 's'},
      {"seed", required_argument, nullptr, 'S'},
      {"workers", required_argument, nullptr, 'w'},
      {"no-takeover", no_argument, nullptr, 'n'},
      {"drain-after", required_argument, nullptr, 'd'},
      {"verbose", no_argument, nullptr, 'v'},
      {nullptr, 0, nullptr, 0}};
  options.seed = static_cast<uint64_t>(
      std::chrono::system_clock::now().time_since_epoch().count());
  int c;
  while ((c = getopt_long(argc, argv, "", longs, nullptr)) != -1) {
    switch (c) {
      case 'm':
        options.duration = std::chrono::seconds(60 * std::stoll(optarg));
        break;
      case 's':
        options.duration = std::chrono::seconds(std::stoll(optarg));
        break;
      case 'S':
        options.seed = std::stoull(optarg);
        break;
      case 'w':
        options.workers = std::max(1, std::stoi(optarg));
        break;
      case 'n':
        options.takeover = false;
        break;
      case 'd':
        options.drain_after = optarg;
        break;
      case 'v':
        options.verbose = true;
        break;
      default:
        std::fprintf(stderr,
                     "usage: serve_soak [--minutes N | --seconds N] "
                     "[--seed S] [--workers N] [--no-takeover] "
                     "[--drain-after D]\n");
        return 2;
    }
  }
  // A write to a killed worker's pipe is an error to handle, not a signal.
  ::signal(SIGPIPE, SIG_IGN);
  auto* failures = new FailureCounter;  // owned by gtest's listeners
  ::testing::UnitTest::GetInstance()->listeners().Append(failures);
  std::printf("serve_soak: seed %" PRIu64 ", %lld s\n", options.seed,
              static_cast<long long>(options.duration.count()));
  std::fflush(stdout);
  try {
    Soak soak(options);
    soak.failures_ = failures;
    return soak.Run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve_soak: %s\nFAIL\n", e.what());
    return 1;
  }
}

}  // namespace
}  // namespace modelcache::serve::testing

int main(int argc, char** argv) {
  return modelcache::serve::testing::Main(argc, argv);
}
