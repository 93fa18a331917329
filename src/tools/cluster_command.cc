// `modelcache replay --nodes ...`: the flags of the multi-node replay, and
// its run and output (see cluster_command.h).
#include "cluster_command.h"

#include <fstream>
#include <iostream>

#include "modelcache/base/errors.h"
#include "ring_command.h"

namespace modelcache::tools {
namespace {

[[noreturn]] void InvalidFlag(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

double Duration(const std::string& flag, const std::string& text) {
  try {
    return replay::ParseDurationMs(text);
  } catch (const Error& e) {
    InvalidFlag(flag + ": " + e.what());
  }
}

// Nodes enough for any real backend, few enough to stay a replay.
constexpr uint32_t kMaxNodes = 1024;

}  // namespace

std::vector<std::string> DefaultRoutes() {
  return {"roundrobin", "random",       "p2c",      "leastconn",
          "chash",      "chash-bl:150", "chash-map"};
}

bool AnyClusterFlag(const ClusterFlags& flags) {
  const ClusterFlags defaults;
  return !flags.routes.empty() || flags.concurrency != 0 ||
         !flags.events.empty() || flags.detect_after != defaults.detect_after ||
         flags.retry_delay != defaults.retry_delay ||
         flags.retries != defaults.retries || flags.spill_on_full;
}

replay::ClusterOptions ParseClusterFlags(const ClusterFlags& flags,
                                         std::vector<replay::Route>* routes) {
  replay::ClusterOptions options;
  const std::string& nodes = flags.nodes;
  if (!nodes.empty() &&
      nodes.find_first_not_of("0123456789") == std::string::npos) {
    if (nodes.size() > 4 || std::stoul(nodes) == 0 ||
        std::stoul(nodes) > kMaxNodes) {
      InvalidFlag("--nodes: " + nodes + " nodes: give 1 to " +
                  std::to_string(kMaxNodes) +
                  ", or the list name:id:weight,...");
    }
    options.nodes =
        replay::NumberedNodes(static_cast<uint32_t>(std::stoul(nodes)));
  } else {
    options.nodes = ParseNodeList(nodes);  // "--nodes: ..." errors
    if (options.nodes.size() > kMaxNodes) {
      InvalidFlag("--nodes: more than " + std::to_string(kMaxNodes) + " nodes");
    }
  }
  routes->clear();
  for (const std::string& name :
       flags.routes.empty() ? DefaultRoutes() : flags.routes) {
    try {
      routes->push_back(replay::ParseRoute(name));
    } catch (const Error& e) {
      InvalidFlag(std::string("--route: ") + e.what());
    }
  }
  for (const std::string& text : flags.events) {
    try {
      options.events.push_back(replay::ParseClusterEvent(text));
    } catch (const Error& e) {
      InvalidFlag(std::string("--event: ") + e.what());
    }
  }
  options.concurrency = flags.concurrency;
  options.detect_ms = Duration("--detect-after", flags.detect_after);
  options.retry_delay_ms = Duration("--retry-delay", flags.retry_delay);
  options.retries = flags.retries;
  options.spill_on_full = flags.spill_on_full;
  return options;
}

int RunClusterReplay(const ClusterFlags& flags, const replay::Trace& trace,
                     const std::vector<std::string>& policies,
                     const std::vector<uint64_t>& capacities,
                     const replay::SimulateOptions& options, unsigned threads,
                     const ClusterOutput& output) {
  std::vector<replay::Route> routes;
  replay::ClusterInfo info;
  info.options = ParseClusterFlags(flags, &routes);
  info.time = options.time;
  const std::vector<replay::ClusterResult> results = replay::ReplayClusterAll(
      trace, routes, policies, capacities, info.options, options, threads);
  if (output.json) {
    std::cout << replay::ClusterJson(trace, results, info);
  } else {
    std::cout << replay::ClusterTable(trace, results, info);
  }
  if (!output.report.empty()) {
    std::ofstream out(output.report);
    out << replay::ClusterHtmlReport(trace, output.title, results, info);
    if (!out) {
      throw Error(ErrorCode::kIo,
                  "cannot write the report to " + output.report);
    }
    (output.json ? std::cerr : std::cout)
        << "\nreport: " << output.report << "\n";
  }
  return 0;
}

}  // namespace modelcache::tools
