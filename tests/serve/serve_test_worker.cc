// A worker process for the serve tests: it runs commands read from stdin,
// one per line, and answers each with one line on stdout ("ok ..." or
// "error CODE message"), so that a test drives real processes step by step
// through pipes.
//
//   connect PATH [KEY=VALUE...]  a serve::Client; by default each acquire
//                                a lease of its own, released at its end
//                                (reuse=0 keep_idle_ms=0); keys: reuse,
//                                keep_idle_ms, notice_us, reclaim
//                                (ClientOptions),
//                                recall_gate=1 (the test_on_recall hook
//                                waits for recall-go)
//   recall-wait                  -> ok LEASE once a recall reached the hook
//   recall-go                    lets the waiting recall be handled
//   recall-open                  lets every later recall through unheld
//   idle                         -> ok N: leases kept idle (IdleLeases)
//   release MODEL                ends the oldest reference held of MODEL
//   acquire MODEL [MS] [fail]    -> ok LEASE CHECKSUM BYTES
//   acquire-local MODEL          Client::AcquireLocal: held -> ok LEASE
//                                CHECKSUM BYTES LOAD, or ok none
//   acquire-many MODEL N         N leases of MODEL, held -> ok N
//   burst MODEL N MS             up to N acquires of MODEL (timeout MS
//                                each), one after another, held; stops at
//                                the first error -> ok K LEASE,CHECKSUM...
//                                for the K it got, then "| error CODE
//                                message" when one failed (for floods: the
//                                leases are reported even so)
//   ping                         Client::Ping -> ok
//   reclaims                     -> ok RECLAIMED REFUSED UNSUPPORTED PENDING
//                                (Client::Reclaims)
//   checksum                     -> ok CHECKSUM of every copy held, in order
//   cycle-start MS MODEL...      a thread acquires (timeout MS), checksums and
//                                releases the MODELs in turn until cycle-stop
//   cycle-wait N                 -> ok DONE once N more cycles ended
//   cycle-stop                   -> ok DONE FAILED MODEL=CHECKSUM... (each
//                                checksum seen) [| the first failure]
//   release-all                  unmaps and releases every copy held
//   close                        Client::Close(): the socket goes, the
//                                mappings stay
//   maps PREFIX                  -> ok N: memfd mappings named PREFIX...
//   fork PREFIX MODEL            fork(); the child counts its PREFIX
//                                mappings, acquires MODEL through the same
//                                Client and reports; the parent checks its
//                                own copies -> ok CHILD_MAPS CHILD_LEASE
//                                CHILD_SUM PARENT_SUM
//   storm PATH MODEL N MS        N raw connections, each hello + acquire ->
//                                ok SERVED BUSY OTHER LEASES... (kept open)
//   storm-close                  closes them
//   flood PATH N                 a raw connection sending N pings and never
//                                reading -> ok SENT, once the daemon hung up
//   noread PATH MODEL N          the same with N acquires -> ok SENT
//   pid                          -> ok PID
//   exit
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/serve/client.h"
#include "protocol.h"
#include "socket.h"

namespace {

// The recall gate (connect recall_gate=1): the hook says a recall arrived
// and waits for recall-go, until recall-open.
struct RecallGate {
  std::mutex mu;
  std::condition_variable cv;
  bool arrived = false;
  bool go = false;
  bool open = false;
  uint64_t lease = 0;
} g_recall;

using modelcache::serve::Client;
using modelcache::serve::RemoteWeights;

// The cycle (cycle-start): a thread that acquires, checksums and releases
// the given models in turn until cycle-stop.
struct Cycle {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  uint64_t done = 0;
  uint64_t failed = 0;
  std::string first_failure;
  std::map<std::string, std::set<uint64_t>> sums;  // per model, each seen
  std::thread thread;
} g_cycle;

void StopCycle() {
  {
    std::lock_guard lock(g_cycle.mu);
    g_cycle.stop = true;
  }
  if (g_cycle.thread.joinable()) g_cycle.thread.join();
}

uint64_t Checksum(const RemoteWeights& w, uint64_t h = 1469598103934665603ull) {
  for (const modelcache::weights::WeightSet& file : w.files()) {
    for (const std::byte b : file.data()) {
      h ^= static_cast<unsigned char>(b);
      h *= 1099511628211ull;
    }
  }
  return h;
}

int CountMaps(const std::string& prefix) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    if (line.find("/memfd:" + prefix) != std::string::npos) ++n;
  }
  return n;
}

std::string ErrorLine(const std::exception& e) {
  std::string code = "OTHER";
  if (const auto* s = dynamic_cast<const modelcache::serve::ServeError*>(&e)) {
    code = modelcache::serve::ServeCodeName(s->serve_code());
  }
  std::string message = e.what();
  for (char& c : message) {
    if (c == '\n') c = ' ';
  }
  return "error " + code + " " + message;
}

// A raw connection: hello, then acquire, replies read later.
int RawConnect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

int main() {
  std::optional<Client> client;
  std::vector<RemoteWeights> held;
  std::vector<int> storm;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    std::string reply;
    try {
      if (command == "connect") {
        std::string path;
        in >> path;
        modelcache::serve::ClientOptions options;
        options.connect_timeout = std::chrono::seconds(30);
        options.local_reuse = false;
        options.keep_idle = std::chrono::milliseconds(0);
        std::string setting;
        while (in >> setting) {
          const size_t eq = setting.find('=');
          const std::string key = setting.substr(0, eq);
          const int64_t value = std::stoll(setting.substr(eq + 1));
          if (key == "reuse") {
            options.local_reuse = value != 0;
          } else if (key == "keep_idle_ms") {
            options.keep_idle = std::chrono::milliseconds(value);
          } else if (key == "reclaim") {
            options.reclaim = value != 0;
          } else if (key == "notice_us") {
            options.idle_notice_delay = std::chrono::microseconds(value);
          } else if (key == "recall_gate" && value != 0) {
            options.test_on_recall = [](uint64_t lease) {
              std::unique_lock lock(g_recall.mu);
              if (g_recall.open) return;
              g_recall.lease = lease;
              g_recall.arrived = true;
              g_recall.cv.notify_all();
              g_recall.cv.wait(lock, [] { return g_recall.go; });
              g_recall.go = false;
              g_recall.arrived = false;
            };
          } else {
            throw std::runtime_error("unknown setting " + setting);
          }
        }
        client.emplace(Client::Connect(path, options));
        reply = "ok";
      } else if (command == "recall-wait") {
        std::unique_lock lock(g_recall.mu);
        g_recall.cv.wait(lock, [] { return g_recall.arrived; });
        reply = "ok " + std::to_string(g_recall.lease);
      } else if (command == "recall-go") {
        std::lock_guard lock(g_recall.mu);
        g_recall.go = true;
        g_recall.cv.notify_all();
        reply = "ok";
      } else if (command == "recall-open") {
        std::lock_guard lock(g_recall.mu);
        g_recall.open = true;
        g_recall.go = true;
        g_recall.cv.notify_all();
        reply = "ok";
      } else if (command == "idle") {
        reply = "ok " + std::to_string(client->IdleLeases());
      } else if (command == "release") {
        std::string model;
        in >> model;
        reply = "error NOT_FOUND no reference of " + model;
        for (auto it = held.begin(); it != held.end(); ++it) {
          if (it->model() == model) {
            held.erase(it);
            reply = "ok";
            break;
          }
        }
      } else if (command == "acquire") {
        std::string model;
        int64_t ms = 60000;
        std::string mode;
        in >> model >> ms >> mode;
        modelcache::serve::RemoteAcquireOptions options;
        options.timeout = std::chrono::milliseconds(ms);
        if (mode == "fail") options.when_full = modelcache::WhenFull::kFail;
        RemoteWeights w = client->Acquire(model, options);
        reply = "ok " + std::to_string(w.lease()) + " " +
                std::to_string(Checksum(w)) + " " +
                std::to_string(w.data_bytes());
        held.push_back(std::move(w));
      } else if (command == "acquire-local") {
        // Client::AcquireLocal: "ok none", or as acquire, with its load.
        std::string model;
        in >> model;
        std::optional<RemoteWeights> w = client->AcquireLocal(model);
        if (!w) {
          reply = "ok none";
        } else {
          reply = "ok " + std::to_string(w->lease()) + " " +
                  std::to_string(Checksum(*w)) + " " +
                  std::to_string(w->data_bytes()) + " " + w->load();
          held.push_back(std::move(*w));
        }
      } else if (command == "acquire-many") {
        std::string model;
        int n = 0;
        in >> model >> n;
        for (int i = 0; i < n; ++i) {
          held.push_back(client->Acquire(model, std::chrono::seconds(60)));
        }
        reply = "ok " + std::to_string(n);
      } else if (command == "burst") {
        std::string model;
        int n = 0;
        int64_t ms = 60000;
        in >> model >> n >> ms;
        std::string got;
        std::string failure;
        int k = 0;
        for (; k < n; ++k) {
          try {
            RemoteWeights w =
                client->Acquire(model, std::chrono::milliseconds(ms));
            got += " " + std::to_string(w.lease()) + "," +
                   std::to_string(Checksum(w));
            held.push_back(std::move(w));
          } catch (const std::exception& e) {
            failure = " | " + ErrorLine(e);
            break;
          }
        }
        reply = "ok " + std::to_string(k) + got + failure;
      } else if (command == "ping") {
        client->Ping(std::chrono::seconds(60));
        reply = "ok";
      } else if (command == "reclaims") {
        const modelcache::serve::ReclaimStats r = client->Reclaims();
        reply = "ok " + std::to_string(r.reclaimed) + " " +
                std::to_string(r.reclaim_refused) + " " +
                std::to_string(r.reclaim_unsupported) + " " +
                std::to_string(r.pending);
      } else if (command == "checksum") {
        reply = "ok";
        for (const RemoteWeights& w : held) {
          reply += " " + std::to_string(Checksum(w));
        }
      } else if (command == "release-all") {
        held.clear();
        reply = "ok";
      } else if (command == "close") {
        client->Close();
        reply = "ok";
      } else if (command == "maps") {
        std::string prefix;
        in >> prefix;
        reply = "ok " + std::to_string(CountMaps(prefix));
      } else if (command == "fork") {
        std::string prefix;
        std::string model;
        in >> prefix >> model;
        int pipe_fds[2];
        if (::pipe(pipe_fds) != 0) throw std::runtime_error("pipe");
        std::cout << std::flush;
        const pid_t child = ::fork();
        if (child == 0) {
          ::close(pipe_fds[0]);
          std::string report = std::to_string(CountMaps(prefix));
          try {
            RemoteWeights w = client->Acquire(model, std::chrono::seconds(60));
            report += " " + std::to_string(w.lease()) + " " +
                      std::to_string(Checksum(w));
          } catch (const std::exception& e) {
            report += " " + ErrorLine(e);
          }
          [[maybe_unused]] ssize_t n =
              ::write(pipe_fds[1], report.data(), report.size());
          ::_exit(0);
        }
        ::close(pipe_fds[1]);
        std::string report;
        char buffer[512];
        ssize_t n;
        while ((n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0) {
          report.append(buffer, static_cast<size_t>(n));
        }
        ::close(pipe_fds[0]);
        int status = 0;
        ::waitpid(child, &status, 0);
        std::string parent;
        for (const RemoteWeights& w : held) {
          parent += " " + std::to_string(Checksum(w));
        }
        reply = "ok " + report + " |" + parent;
      } else if (command == "storm") {
        std::string path;
        std::string model;
        int n = 0;
        uint64_t ms = 60000;
        in >> path >> model >> n >> ms;
        namespace p = modelcache::serve::protocol;
        for (int i = 0; i < n; ++i) {
          const int fd = RawConnect(path);
          if (fd < 0) throw std::runtime_error("connect failed");
          storm.push_back(fd);
          modelcache::serve::detail::SendDatagram(fd, p::EncodeHello(1), {}, 0);
          modelcache::serve::detail::SendDatagram(
              fd, p::EncodeAcquire(2, model, ms, false), {}, 0);
        }
        int served = 0;
        int busy = 0;
        int other = 0;
        std::string leases;
        for (const int fd : storm) {
          for (;;) {
            modelcache::serve::detail::Datagram d;
            if (modelcache::serve::detail::ReceiveDatagram(
                    fd, p::kMaxMessageBytes, 8, 0, &d) <= 0) {
              ++other;
              break;
            }
            const p::ParsedReply r = p::ParseReply(d.bytes);
            if (!r.reply) {
              ++other;
              break;
            }
            if (r.reply->id == 1 && r.reply->ok) continue;  // hello
            if (r.reply->ok && r.reply->lease != 0) {
              ++served;
              leases += " " + std::to_string(r.reply->lease);
            } else if (!r.reply->ok &&
                       r.reply->code == modelcache::serve::ServeCode::kBusy) {
              ++busy;
            } else {
              ++other;
            }
            break;
          }
        }
        reply = "ok " + std::to_string(served) + " " + std::to_string(busy) +
                " " + std::to_string(other) + leases;
      } else if (command == "flood" || command == "noread") {
        std::string path;
        std::string model;
        int n = 0;
        in >> path;
        if (command == "noread") in >> model;
        in >> n;
        namespace p = modelcache::serve::protocol;
        const int fd = RawConnect(path);
        if (fd < 0) throw std::runtime_error("connect failed");
        int sent = 0;
        for (int i = 0; i < n; ++i) {
          const std::string message =
              command == "flood"
                  ? p::EncodePing(static_cast<uint64_t>(i) + 1)
                  : p::EncodeAcquire(static_cast<uint64_t>(i) + 1, model, 1000,
                                     false);
          if (modelcache::serve::detail::SendDatagram(fd, message, {}, 0) !=
              0) {
            break;  // the daemon hung up
          }
          ++sent;
        }
        // Never read: wait for the hang-up itself.
        for (;;) {
          pollfd p{fd, POLLRDHUP, 0};
          p.events = POLLRDHUP;
          if (::poll(&p, 1, -1) > 0 && (p.revents & (POLLHUP | POLLRDHUP))) {
            break;
          }
        }
        ::close(fd);
        reply = "ok " + std::to_string(sent);
      } else if (command == "storm-close") {
        for (const int fd : storm) ::close(fd);
        storm.clear();
        reply = "ok";
      } else if (command == "pid") {
        reply = "ok " + std::to_string(::getpid());
      } else if (command == "cycle-start") {
        int64_t ms = 60000;
        in >> ms;
        std::vector<std::string> models;
        std::string model;
        while (in >> model) models.push_back(model);
        if (models.empty() || g_cycle.thread.joinable()) {
          throw std::runtime_error("cycle-start MS MODEL...");
        }
        Client* c = &*client;
        g_cycle.thread = std::thread([c, ms, models] {
          for (size_t i = 0;; ++i) {
            {
              std::lock_guard lock(g_cycle.mu);
              if (g_cycle.stop) return;
            }
            const std::string& m = models[i % models.size()];
            std::string failure;
            uint64_t sum = 0;
            try {
              RemoteWeights w = c->Acquire(m, std::chrono::milliseconds(ms));
              sum = Checksum(w);
            } catch (const std::exception& e) {
              failure = ErrorLine(e);
            }
            std::lock_guard lock(g_cycle.mu);
            ++g_cycle.done;
            if (failure.empty()) {
              g_cycle.sums[m].insert(sum);
            } else if (g_cycle.failed++ == 0) {
              g_cycle.first_failure = m + ": " + failure;
            }
            g_cycle.cv.notify_all();
          }
        });
        reply = "ok";
      } else if (command == "cycle-wait") {
        uint64_t more = 0;
        in >> more;
        std::unique_lock lock(g_cycle.mu);
        const uint64_t until = g_cycle.done + more;
        g_cycle.cv.wait(lock, [&] { return g_cycle.done >= until; });
        reply = "ok " + std::to_string(g_cycle.done);
      } else if (command == "cycle-stop") {
        StopCycle();
        std::lock_guard lock(g_cycle.mu);
        reply = "ok " + std::to_string(g_cycle.done) + " " +
                std::to_string(g_cycle.failed);
        for (const auto& [m, sums] : g_cycle.sums) {
          for (const uint64_t sum : sums) {
            reply += " " + m + "=" + std::to_string(sum);
          }
        }
        if (g_cycle.failed != 0) reply += " | " + g_cycle.first_failure;
      } else if (command == "exit") {
        StopCycle();
        std::cout << "ok" << std::endl;
        return 0;
      } else {
        reply = "error OTHER unknown command '" + command + "'";
      }
    } catch (const std::exception& e) {
      reply = ErrorLine(e);
    }
    std::cout << reply << std::endl;
  }
  StopCycle();
  return 0;
}
