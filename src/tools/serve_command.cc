// `modelcache serve`: flags to DaemonOptions, the HTTP listeners on
// cpp-httplib, the ready line, then the daemon's event loop on this thread.
//
// Order matters for signals: SIGTERM, SIGINT and SIGHUP are blocked before
// any thread starts (the daemon's pool, httplib's workers), so that only the
// daemon's signalfd sees them.
#include "serve_command.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "modelcache/base/bytes.h"
#include "modelcache/base/duration.h"
#include "modelcache/base/errors.h"
#include "modelcache/core/policy.h"
#include "modelcache/serve/catalog.h"
#include "modelcache/serve/daemon.h"

namespace modelcache::tools {
namespace {

constexpr size_t kMaxBodyBytes = size_t{64} << 10;
// What httplib reads at most; a body past kMaxBodyBytes is read, dropped
// and answered 413.
constexpr size_t kMaxReadBytes = size_t{1} << 20;

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

std::chrono::milliseconds Duration(const std::string& flag,
                                   const std::string& text) {
  try {
    return std::chrono::milliseconds(
        static_cast<int64_t>(ParseDurationMs(text)));
  } catch (const Error& e) {
    Invalid(flag + ": " + e.what());
  }
}

// "50MB/s", "500MiB/s" or "inf": bytes per second above 0.
double Bandwidth(const std::string& flag, const std::string& text) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  std::string_view bytes = text;
  if (bytes.size() > 2 && bytes.substr(bytes.size() - 2) == "/s") {
    bytes.remove_suffix(2);
  }
  try {
    const uint64_t b = ParseBytes(bytes);
    if (b > 0) return static_cast<double>(b);
  } catch (const Error&) {
    // Reported below with what a bandwidth looks like.
  }
  Invalid(flag + ": not a bandwidth: '" + text +
          "' (use bytes per second above 0, as in 50MB/s, or inf)");
}

// A duration of 0 or more, to the nanosecond, at most a day.
std::chrono::nanoseconds LongDuration(const std::string& flag,
                                      const std::string& text) {
  double ms = 0;
  try {
    ms = ParseDurationMs(text);
  } catch (const Error& e) {
    Invalid(flag + ": " + e.what());
  }
  if (ms > 24 * 3600e3) Invalid(flag + ": '" + text + "' is over a day");
  return std::chrono::nanoseconds(static_cast<int64_t>(std::llround(ms * 1e6)));
}

// --drain-after, read as replay reads its own (ParseDrainAfterMs).
std::chrono::nanoseconds DrainAfter(const std::string& text) {
  std::optional<double> ms;
  try {
    ms = ParseDrainAfterMs(text);
  } catch (const Error& e) {
    Invalid(std::string("--drain-after: ") + e.what());
  }
  if (!ms) return kDefaultDrainAfter;
  // Past what nanoseconds hold (about 292 years) is never, as inf is.
  if (*ms * 1e6 >= static_cast<double>(kDrainNever.count())) {
    return kDrainNever;
  }
  return std::chrono::nanoseconds(std::llround(*ms * 1e6));
}

uint64_t HalfOfMemory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024 / 2;
  }
  return uint64_t{1} << 30;
}

// httplib's server, whose listening socket can be one handed over by a
// daemon taken over (and handed over to a successor in turn).
class HandoverServer : public httplib::Server {
 public:
  void Adopt(int fd) { svr_sock_ = fd; }
  int fd() const { return svr_sock_; }
  // The accept loop lets go of the descriptor: it ends at its next failed
  // accept without closing it (httplib closes it only while it is its).
  void Disown() { svr_sock_ = INVALID_SOCKET; }
};

// One HTTP listener: the daemon's handler behind httplib, on a loopback
// address or a UNIX socket.
class Listener {
 public:
  Listener(serve::Daemon& daemon, bool admin) {
    server_.set_payload_max_length(kMaxReadBytes);
    const auto handler = [&daemon, admin](const httplib::Request& request,
                                          httplib::Response& response) {
      serve::HttpRequest r;
      r.method = request.method;
      r.path = request.path;
      r.body = request.body;
      r.admin = admin;
      const serve::HttpResponse out = daemon.HandleHttp(r);
      response.status = out.status;
      response.set_content(out.body, out.content_type.c_str());
    };
    // Methods with a body take a content reader: httplib then answers a
    // body-less POST (`curl -X POST`) instead of refusing it with 400.
    const auto with_body = [&daemon, admin](
                               const httplib::Request& request,
                               httplib::Response& response,
                               const httplib::ContentReader& read) {
      serve::HttpRequest r;
      r.method = request.method;
      r.path = request.path;
      r.admin = admin;
      bool too_large = false;
      if (request.has_header("Content-Length") ||
          request.get_header_value("Transfer-Encoding") == "chunked") {
        read([&](const char* data, size_t length) {
          if (too_large || r.body.size() + length > kMaxBodyBytes) {
            too_large = true;
            r.body.clear();
          } else {
            r.body.append(data, length);
          }
          return true;
        });
      }
      if (too_large) {
        response.status = 413;
        response.set_content(
            "{\"error\": \"request bodies are at most 64 KiB\"}\n",
            "application/json");
        return;
      }
      const serve::HttpResponse out = daemon.HandleHttp(r);
      response.status = out.status;
      response.set_content(out.body, out.content_type.c_str());
    };
    server_.Get(".*", handler);
    server_.Post(".*", with_body);
    server_.Put(".*", with_body);
    server_.Delete(".*", with_body);
    server_.Patch(".*", with_body);
  }
  ~Listener() { Stop(); }

  // Returns the address bound, port included.
  std::string BindTcp(const std::string& host, int port) {
    if (port == 0) {
      port = server_.bind_to_any_port(host);
      if (port < 0) Invalid("cannot listen on " + host + ": port in use?");
    } else if (!server_.bind_to_port(host, port)) {
      Invalid("cannot listen on " + host + ":" + std::to_string(port) +
              " (in use?)");
    }
    return (host.find(':') != std::string::npos ? "[" + host + "]" : host) +
           ":" + std::to_string(port);
  }

  void BindUnix(const std::string& path) {
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) Invalid(path + " exists and is not a socket");
      ::unlink(path.c_str());
    }
    server_.set_address_family(AF_UNIX);
    if (!server_.bind_to_port(path, 80)) Invalid("cannot listen on " + path);
    if (::chmod(path.c_str(), 0660) != 0) Invalid("cannot chmod " + path);
    unix_path_ = path;
  }

  // Serves on `fd`, a listening socket taken over (bound by a predecessor
  // to `address`, which is returned: a TCP address with its port, or the
  // UNIX path).
  std::string Adopt(int fd, const std::string& unix_path) {
    server_.Adopt(fd);
    unix_path_ = unix_path;
    if (!unix_path.empty()) return unix_path;
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    char host[INET6_ADDRSTRLEN] = {};
    int port = 0;
    if (address.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&address);
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      port = ntohs(a->sin6_port);
      return "[" + std::string(host) + "]:" + std::to_string(port);
    }
    const auto* a = reinterpret_cast<const sockaddr_in*>(&address);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  int fd() const { return server_.fd(); }

  // A takeover committed: the accept thread stops taking the descriptor
  // for its own; Stop(true) closes it once the thread is done.
  void Disown() {
    disowned_fd_ = server_.fd();
    server_.Disown();
  }

  void Start() {
    thread_ = std::thread([this] {
      server_.listen_after_bind();
      done_ = true;
    });
  }

  // `handed_over`: a successor serves the socket now (the daemon made our
  // descriptor number name a socket that listens on nothing); its path
  // stays. The thread may still be blocked in accept() on the listening
  // socket itself, which only a signal interrupts (shutting the socket
  // down would end it for the successor too): its next accept, on the dead
  // socket, fails and ends it.
  void Stop(bool handed_over = false) {
    if (!thread_.joinable()) return;
    if (handed_over) {
      while (!done_.load()) {
        ::pthread_kill(thread_.native_handle(), SIGUSR2);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      server_.stop();
    }
    thread_.join();
    if (disowned_fd_ >= 0) ::close(disowned_fd_);  // the dead socket
    if (!unix_path_.empty() && !handed_over) ::unlink(unix_path_.c_str());
  }

 private:
  HandoverServer server_;
  int disowned_fd_ = -1;
  std::atomic<bool> done_{false};
  std::thread thread_;
  std::string unix_path_;
};

}  // namespace

void AddServeOptions(CLI::App& c, ServeFlags& f) {
  // A flag given twice takes its last value (a script may add to defaults).
  c.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  c.add_option("--catalog", f.catalog,
               "The catalog: JSON {\"models\": [{\"id\", \"files\", "
               "\"aliases\", \"pinned\", \"priority\"}]}");
  c.add_option("--model-root", f.model_root,
               "The folder the catalog's files are relative to");
  c.add_option("--socket", f.socket,
               "The lease socket (its folder: mode 0750, created if missing)");
  c.add_option("--http", f.http,
               "HTTP API and /metrics on a loopback ADDRESS:PORT, or off "
               "(default 127.0.0.1:9464)");
  c.add_option("--admin-socket", f.admin_socket,
               "UNIX socket of the HTTP API with changes allowed (default: "
               "the socket's path + .admin), or off");
  c.add_option("--http-admin", f.http_admin,
               "Also allow changes on this loopback ADDRESS:PORT");
  c.add_option("--host-capacity", f.host_capacity,
               "The host budget, e.g. 24GiB (default: half of the RAM)");
  std::string names;
  for (const std::string& name : PolicyNames()) {
    names += (names.empty() ? "" : ", ") + name;
  }
  c.add_option("--policy", f.policy,
               "Policy: " + names + " (default next-use)");
  c.add_option("--max-clients", f.max_clients, "Connections at once (1024)")
      ->check(CLI::PositiveNumber);
  c.add_option("--max-requests-per-client", f.max_requests_per_client,
               "Acquires waiting per connection (64)")
      ->check(CLI::PositiveNumber);
  c.add_option("--max-leases-per-client", f.max_leases_per_client,
               "Leases per connection (4096)")
      ->check(CLI::PositiveNumber);
  c.add_option("--max-queued-replies", f.max_queued_replies,
               "Replies a client may leave unread before it is "
               "disconnected (256)")
      ->check(CLI::PositiveNumber);
  c.add_option("--load-slots", f.load_slots, "Loads at once (2)")
      ->check(CLI::PositiveNumber);
  c.add_option("--max-waiters", f.max_waiters,
               "Acquires waiting, all clients together (4096)")
      ->check(CLI::PositiveNumber);
  c.add_option("--load-threads", f.load_threads, "pread threads per file (4)")
      ->check(CLI::PositiveNumber);
  c.add_option("--instance", f.instance,
               "Names this daemon's memfds (default: from the socket path)");
  c.add_option("--allow-uid", f.allow_uids,
               "Only these uids (and --allow-gid's gids) may connect");
  c.add_option("--allow-gid", f.allow_gids, "See --allow-uid");
  c.add_option("--ready-grace", f.ready_grace,
               "/readyz stays 503 this long after start (2s)");
  c.add_option("--orphan-rescan", f.orphan_rescan,
               "How often the processes mapping orphaned copies have their "
               "/proc/PID/maps read again while any remain (1s)");
  c.add_option("--recall-timeout", f.recall_timeout,
               "How long a client has to answer the recall of an idle "
               "delegated lease before it is taken to use it (100ms)");
  c.add_option("--drain-after", f.drain_after,
               "How long an acquire waiting for room may be overtaken by "
               "acquires of the models that hold it before they drain: a "
               "duration, 0 (strict arrival order), inf or never (they never "
               "drain), or default (the library's: max(1 s, 4 x the last load, "
               "8 x the recent drains))");
  c.add_option("--reclaim-grace", f.reclaim_grace,
               "After a crash: how long an acquire of a model whose copy "
               "live workers still map waits for them to reclaim it before "
               "it loads the model again (5s; 0: no wait)");
  c.add_flag("--takeover", f.takeover,
             "Take over from the daemon serving on --socket (an upgrade or "
             "a restart): its sockets, copies and leases, with no byte "
             "loaded again; it exits 0 when done");
  c.add_option("--takeover-timeout", f.takeover_timeout,
               "How long a takeover may take before it is abandoned and the "
               "old daemon serves on (30s)");
  c.add_flag("--per-model-metrics", f.per_model_metrics,
             "Per-model series in /metrics");
  c.add_flag("--strict-catalog", f.strict_catalog,
             "A catalog file that is missing or not valid is fatal at start "
             "and refuses a reload (as --check-catalog refuses it); without "
             "it, only its model is unavailable");
  c.add_option("--unavailable-retry", f.unavailable_retry,
               "How long after a model's files were found missing or not "
               "valid an acquire tries them again; doubled by each failed "
               "try, to 60s at most (1s; 0: every acquire tries)");
  c.add_flag("--check-catalog", f.check_catalog,
             "Validate the catalog (and, with --model-root, every file's "
             "header) and exit");
  c.add_flag("--json", f.json,
             "With --check-catalog: print {\"summary\", \"models\": "
             "[{\"id\", \"bytes\"}]}, bytes being each model's copy in "
             "the budget (replay's size_bytes; needs --model-root)");
  c.add_option("--ready-fd", f.ready_fd,
               "Write one JSON line to this descriptor once serving, then "
               "close it");
  c.add_option("--throttle-load-bandwidth", f.throttle_load_bandwidth,
               "Testing and sizing knob: loads move their copy's bytes (the "
               "model's \"bytes\" in /v1/models) at this many bytes per "
               "second, shared equally by the loads moving bytes at once, "
               "as replay's --load-bandwidth (e.g. 50MB/s, or inf)");
  c.add_option("--throttle-load-latency", f.throttle_load_latency,
               "Testing and sizing knob: a load's bytes start to move this "
               "long after it got its slot and its room (or once its real "
               "read ends, if later), as replay's --load-latency (e.g. "
               "20ms; default 0)");
  // For tests: a gate on loads.
  c.add_option("--test-load-gate-fd", f.test_load_gate_fd)->group("");
  c.add_option("--test-pause-reads-fd", f.test_pause_reads_fd)->group("");
  c.add_option("--test-capacity-hold-fd", f.test_capacity_hold_fd)->group("");
  c.add_flag("--test-per-component-open", f.test_per_component_open)->group("");
}

void ParseLoopbackAddress(const std::string& text, std::string* host,
                          int* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 == text.size()) {
    Invalid("'" + text + "' is not ADDRESS:PORT (e.g. 127.0.0.1:9464)");
  }
  std::string h = text.substr(0, colon);
  const std::string p = text.substr(colon + 1);
  int number = -1;
  try {
    size_t used = 0;
    number = std::stoi(p, &used);
    if (used != p.size()) number = -1;
  } catch (const std::exception&) {
    number = -1;
  }
  if (number < 0 || number > 65535) {
    Invalid("'" + p + "' is not a port (0 to 65535; 0 picks a free one)");
  }
  if (h == "localhost") h = "127.0.0.1";
  bool loopback = false;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
    in6_addr a6;
    loopback =
        ::inet_pton(AF_INET6, h.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
  } else {
    in_addr a4;
    loopback = ::inet_pton(AF_INET, h.c_str(), &a4) == 1 &&
               (ntohl(a4.s_addr) >> 24) == 127;
  }
  if (!loopback) {
    Invalid("'" + text +
            "': the HTTP API listens on loopback only (127.0.0.0/8 or [::1])");
  }
  *host = h;
  *port = number;
}

int RunServe(const ServeFlags& flags, std::ostream& out, std::ostream& err) {
  try {
    if (flags.check_catalog) {
      if (flags.catalog.empty()) Invalid("--check-catalog needs --catalog");
      const serve::CatalogCheck check =
          serve::CheckCatalog(flags.catalog, flags.model_root);
      if (!flags.json) {
        out << check.summary << "\n";
        return 0;
      }
      nlohmann::json models = nlohmann::json::array();
      if (flags.model_root.empty()) {
        const serve::Catalog catalog = serve::Catalog::FromFile(flags.catalog);
        for (const serve::CatalogModel& m : catalog.models()) {
          models.push_back({{"id", m.id}, {"bytes", nullptr}});
        }
      } else {
        for (const auto& [id, bytes] : check.copy_bytes) {
          models.push_back({{"id", id}, {"bytes", bytes}});
        }
      }
      out << nlohmann::json{{"summary", check.summary}, {"models", models}}
                 .dump()
          << "\n";
      return 0;
    }
    if (flags.json) Invalid("--json goes with --check-catalog");
    if (flags.catalog.empty() || flags.model_root.empty() ||
        flags.socket.empty()) {
      Invalid("serve needs --catalog, --model-root and --socket");
    }
    // Before any thread starts: see the top of this file.
    serve::Daemon::BlockSignals();
    ::signal(SIGPIPE, SIG_IGN);
    // Interrupts an HTTP listener's accept() after a takeover (Listener::
    // Stop): a handler that does nothing, without SA_RESTART.
    struct sigaction interrupt {};
    interrupt.sa_handler = [](int) {};
    sigemptyset(&interrupt.sa_mask);
    ::sigaction(SIGUSR2, &interrupt, nullptr);

    serve::DaemonOptions options;
    options.catalog_path = flags.catalog;
    options.model_root = flags.model_root;
    options.socket_path = flags.socket;
    options.host_capacity_bytes = flags.host_capacity.empty()
                                      ? HalfOfMemory()
                                      : ParseBytes(flags.host_capacity);
    options.policy = flags.policy;
    options.limits.max_clients = flags.max_clients;
    options.limits.max_requests_per_client = flags.max_requests_per_client;
    options.limits.max_leases_per_client = flags.max_leases_per_client;
    options.limits.max_queued_replies = flags.max_queued_replies;
    options.limits.load_slots = flags.load_slots;
    options.limits.max_waiters = flags.max_waiters;
    options.load_threads = flags.load_threads;
    options.instance = flags.instance;
    options.allow_uids.assign(flags.allow_uids.begin(), flags.allow_uids.end());
    options.allow_gids.assign(flags.allow_gids.begin(), flags.allow_gids.end());
    options.ready_grace = Duration("--ready-grace", flags.ready_grace);
    options.orphan_rescan = Duration("--orphan-rescan", flags.orphan_rescan);
    if (options.orphan_rescan.count() <= 0) {
      Invalid("--orphan-rescan must be above 0");
    }
    options.recall_timeout = Duration("--recall-timeout", flags.recall_timeout);
    if (options.recall_timeout.count() <= 0) {
      Invalid("--recall-timeout must be above 0");
    }
    options.drain_after = DrainAfter(flags.drain_after);
    options.reclaim_grace = Duration("--reclaim-grace", flags.reclaim_grace);
    options.takeover = flags.takeover;
    // Under systemd: READY=1, and the copies kept in its fd store.
    options.systemd = true;
    options.takeover_timeout =
        Duration("--takeover-timeout", flags.takeover_timeout);
    if (options.takeover_timeout.count() <= 0) {
      Invalid("--takeover-timeout must be above 0");
    }
    options.per_model_metrics = flags.per_model_metrics;
    options.strict_catalog = flags.strict_catalog;
    options.unavailable_retry =
        Duration("--unavailable-retry", flags.unavailable_retry);
    options.handle_signals = true;
    if (!flags.throttle_load_bandwidth.empty()) {
      options.throttle_load_bytes_per_second =
          Bandwidth("--throttle-load-bandwidth", flags.throttle_load_bandwidth);
    }
    if (!flags.throttle_load_latency.empty()) {
      options.throttle_load_latency =
          LongDuration("--throttle-load-latency", flags.throttle_load_latency);
    }
    options.test_load_gate_fd = flags.test_load_gate_fd;
    options.test_pause_reads_fd = flags.test_pause_reads_fd;
    options.test_capacity_hold_fd = flags.test_capacity_hold_fd;
    options.test_per_component_open = flags.test_per_component_open;

    std::string http_host;
    int http_port = 0;
    const bool http = flags.http != "off" && !flags.http.empty();
    if (http) ParseLoopbackAddress(flags.http, &http_host, &http_port);
    std::string admin_host;
    int admin_port = 0;
    if (!flags.http_admin.empty()) {
      ParseLoopbackAddress(flags.http_admin, &admin_host, &admin_port);
    }
    const std::string admin_socket = flags.admin_socket.empty()
                                         ? flags.socket + ".admin"
                                         : flags.admin_socket;

    serve::Daemon daemon(std::move(options));
    std::vector<std::unique_ptr<Listener>> listeners;
    nlohmann::json ready = {{"socket", flags.socket},
                            {"pid", ::getpid()},
                            {"memfd_prefix", daemon.memfd_prefix()},
                            {"http", nullptr},
                            {"admin_socket", nullptr},
                            {"http_admin", nullptr}};
    // Each listener under its name: taken over from the daemon before when
    // it handed one over, bound afresh otherwise.
    std::vector<std::pair<std::string, int>> handover;
    const auto add = [&](const char* name, bool admin,
                         const std::function<std::string(Listener&)>& bind,
                         const std::string& unix_path) {
      auto l = std::make_unique<Listener>(daemon, admin);
      const int taken = daemon.TakeHandedOverListener(name);
      ready[name] = taken >= 0 ? l->Adopt(taken, unix_path) : bind(*l);
      handover.emplace_back(name, l->fd());
      listeners.push_back(std::move(l));
    };
    if (http) {
      add(
          "http", false,
          [&](Listener& l) { return l.BindTcp(http_host, http_port); }, "");
    }
    if (admin_socket != "off") {
      add(
          "admin_socket", true,
          [&](Listener& l) {
            l.BindUnix(admin_socket);
            return admin_socket;
          },
          admin_socket);
    }
    if (!flags.http_admin.empty()) {
      add(
          "http_admin", true,
          [&](Listener& l) { return l.BindTcp(admin_host, admin_port); }, "");
    }
    daemon.SetHandoverListeners(std::move(handover), [&listeners] {
      for (auto& l : listeners) l->Disown();
    });
    for (auto& l : listeners) l->Start();
    const std::string line = ready.dump() + "\n";
    err << "modelcache serve: ready " << line << std::flush;
    if (flags.ready_fd >= 0) {
      [[maybe_unused]] const ssize_t n =
          ::write(flags.ready_fd, line.data(), line.size());
      ::close(flags.ready_fd);
    }
    daemon.NotifyReady("serving on " + flags.socket);
    daemon.Run();
    for (auto& l : listeners) l->Stop(daemon.HandedOver());
    return 0;
  } catch (const std::exception& e) {
    err << "error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace modelcache::tools
