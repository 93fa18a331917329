// `modelcache serve`: the node daemon (serve::Daemon) behind its sockets,
// with the HTTP control API and metrics on cpp-httplib.
//
//   modelcache serve --catalog catalog.json --model-root DIR --socket PATH
//                    [--http 127.0.0.1:9464] [--admin-socket PATH]
//                    [--http-admin ADDRESS:PORT] [--host-capacity 24GiB]
//                    [--policy next-use] [limits...] [--ready-fd N]
//                    [--strict-catalog] [--unavailable-retry 1s]
//   modelcache serve --check-catalog --catalog catalog.json [--model-root DIR]
//                    [--json]
//
// The HTTP listeners take loopback addresses only (127.0.0.0/8, [::1]);
// port 0 picks a free port, which the log and the ready line name. Reads
// are served on --http; changes (load, unload, pin, unpin, PUT budget) only
// on the admin listeners: a UNIX socket (by default the lease socket's path
// + ".admin", mode 0660) and --http-admin when given.
#ifndef MODELCACHE_TOOLS_SERVE_COMMAND_H_
#define MODELCACHE_TOOLS_SERVE_COMMAND_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace modelcache::tools {

struct ServeFlags {
  std::string catalog;
  std::string model_root;
  std::string socket;
  std::string http = "127.0.0.1:9464";  // "off" for none
  std::string admin_socket;             // default: socket + ".admin"; "off"
  std::string http_admin;               // none unless given
  std::string host_capacity;            // default: half of MemTotal
  std::string policy = "next-use";
  int max_clients = 1024;
  int max_requests_per_client = 64;
  int max_leases_per_client = 4096;
  int max_queued_replies = 256;
  int load_slots = 2;
  int max_waiters = 4096;
  int load_threads = 4;
  std::string instance;
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  std::string ready_grace = "2s";
  std::string orphan_rescan = "1s";
  std::string recall_timeout = "100ms";
  // A duration, 0, "inf" or "never", or "default" (ParseDrainAfterMs).
  std::string drain_after = "default";
  std::string reclaim_grace = "5s";
  bool takeover = false;
  std::string takeover_timeout = "30s";
  bool per_model_metrics = false;
  // A catalog file that is missing or not valid: fatal at start, and a
  // refused reload (else only its model is unavailable).
  bool strict_catalog = false;
  std::string unavailable_retry = "1s";
  bool check_catalog = false;
  bool json = false;  // --check-catalog's output
  int ready_fd = -1;
  // The load throttle, a testing and sizing knob: empty for none.
  std::string throttle_load_bandwidth;
  std::string throttle_load_latency;
  // Tests only (hidden flags).
  int test_load_gate_fd = -1;
  int test_pause_reads_fd = -1;
  int test_capacity_hold_fd = -1;
  bool test_per_component_open = false;
};

// Adds the subcommand's options to `command`, writing into `flags`.
void AddServeOptions(CLI::App& command, ServeFlags& flags);

// Runs the subcommand and returns the exit status; errors are one line on
// `err` ("error: ...") and exit status 1. With check_catalog, validates the
// catalog (and, given a model root, every file's header) and prints one line
// on `out`: a summary, or with json an object whose "models" list each
// model's "id" and "bytes" (its copy in the budget; null without a root).
int RunServe(const ServeFlags& flags, std::ostream& out, std::ostream& err);

// "127.0.0.1:9464" or "[::1]:0" -> host and port. Throws Error
// kInvalidArgument for anything else, and for addresses not on loopback.
void ParseLoopbackAddress(const std::string& text, std::string* host,
                          int* port);

}  // namespace modelcache::tools

#endif  // MODELCACHE_TOOLS_SERVE_COMMAND_H_
