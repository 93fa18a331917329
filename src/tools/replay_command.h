// `modelcache replay [TRACE] [options]`: predict a request mix under budgets.
//
// With no TRACE, replays an embedded default: a generated model zoo and an
// eight-hour request trace, several policies and capacities, and writes an
// HTML report. The flags are those of the command line, as parsed there.
#ifndef MODELCACHE_TOOLS_REPLAY_COMMAND_H_
#define MODELCACHE_TOOLS_REPLAY_COMMAND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cluster_command.h"

namespace modelcache::tools {

struct ReplayFlags {
  std::string trace;
  std::string format = "csv";
  std::string sizes;
  uint32_t models = 0;
  bool models_given = false;  // --models was on the command line
  std::vector<std::string> policies;
  std::vector<std::string> capacities;
  double hold_ms = 0;
  bool no_time = false;
  std::string load_bandwidth = "2GB/s";
  std::string load_latency = "100ms";
  uint32_t load_slots = 4;
  std::string max_wait;
  // --drain-after: durations, "inf" or "default" (SimulateOptions::
  // drain_after_ms), each replayed; empty: {"default"}.
  std::vector<std::string> drain_after;
  std::string arrivals = "even";
  std::string memory;
  double memory_scale = 1;
  std::string durations;
  // The SLO whose capacity is searched, per policy: a duration ("1000",
  // "1s"), the percentile of the waits ("p99", "99.9", "max"), and the
  // resolution ("1%", "512MiB"; empty: 1% of the answer or 256 MiB,
  // whichever is larger). slo_given: --slo-ms was on the command line.
  std::string slo_ms = "1000";
  bool slo_given = false;
  std::string slo_percentile = "p99";
  std::string slo_resolution;
  // The policies whose time series the report draws (empty: all).
  std::vector<std::string> report_policies;
  bool json = false;
  std::string report;
  uint64_t seed = 42;
  unsigned threads = 0;
  // --nodes and the flags that go with it: the multi-node replay.
  ClusterFlags cluster;
  // Read the trace as a stream (also when its file is kStreamFromBytes or
  // larger): memory in proportion to the models, not to the requests.
  bool stream = false;
  // Progress on stderr also when it is not a terminal.
  bool progress = false;
  // An offline policy's next-use index may take at most this much ("4GiB").
  std::string max_index_memory;
};

// The policies replayed on a trace file when --policy is not given: the
// baseline, the classic size-aware policy, and the one docs/replay.md
// recommends.
inline const std::vector<std::string> kDefaultPolicies = {"lru", "gdsf",
                                                          "next-use"};

// A trace file this large or larger is read as a stream.
inline constexpr uint64_t kStreamFromBytes = uint64_t{256} << 20;

// Runs the subcommand; returns the exit status. Prints the table (or JSON)
// on stdout. Throws modelcache::Error (kInvalidArgument for a bad flag,
// TraceError for a bad trace, kIo when the report cannot be written).
// With --nodes: the multi-node replay instead (RunClusterReplay).
int RunReplay(ReplayFlags flags);

}  // namespace modelcache::tools

#endif  // MODELCACHE_TOOLS_REPLAY_COMMAND_H_
