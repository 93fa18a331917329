// `modelcache replay ... --nodes N|name:id:weight,... [--route r1,r2,...]
//  [--concurrency C] [--event kill:n2@30m] [--event join:n2@50m]
//  [--detect-after 6s] [--retry-delay 1s] [--retries 3] [--spill-on-full]`:
// the replay of several nodes behind HAProxy (modelcache/replay/cluster.h),
// run by `modelcache replay` once it has its trace, policies and capacities.
#ifndef MODELCACHE_TOOLS_CLUSTER_COMMAND_H_
#define MODELCACHE_TOOLS_CLUSTER_COMMAND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "modelcache/replay/cluster.h"
#include "modelcache/replay/replay.h"

namespace modelcache::tools {

struct ClusterFlags {
  // "4" (n1..n4, ids 1..4, weight 1) or HAProxy's server lines as
  // name:id:weight,... (as `modelcache ring --nodes`). Empty: one node.
  std::string nodes;
  std::vector<std::string> routes;  // empty: every route
  uint32_t concurrency = 0;
  std::vector<std::string> events;
  std::string detect_after = "6s";
  std::string retry_delay = "1s";
  uint32_t retries = 3;
  bool spill_on_full = false;
};

// The routes run when --route is not given.
std::vector<std::string> DefaultRoutes();

// Whether a flag that needs --nodes was given.
bool AnyClusterFlag(const ClusterFlags& flags);

// The options, without the events' check against the trace (the replay
// makes it). Throws modelcache::Error kInvalidArgument naming the flag: a
// malformed or duplicate node, a weight outside 1-256, an unknown route or a
// malformed F, a malformed event or duration.
replay::ClusterOptions ParseClusterFlags(const ClusterFlags& flags,
                                         std::vector<replay::Route>* routes);

struct ClusterOutput {
  bool json = false;
  std::string report;  // an HTML file to write, or empty
  std::string title;
};

// Replays `trace` on the nodes for every route, policy and capacity, and
// prints the table or JSON on stdout (and writes the report). Returns the
// exit status; throws modelcache::Error as ParseClusterFlags does, for an
// event outside the trace or for an unknown node, an offline policy, and
// kIo when the report cannot be written.
int RunClusterReplay(const ClusterFlags& flags, const replay::Trace& trace,
                     const std::vector<std::string>& policies,
                     const std::vector<uint64_t>& capacities,
                     const replay::SimulateOptions& options, unsigned threads,
                     const ClusterOutput& output);

}  // namespace modelcache::tools

#endif  // MODELCACHE_TOOLS_CLUSTER_COMMAND_H_
