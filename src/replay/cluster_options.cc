// The cluster replay's options (cluster.h): the numbered nodes, the events
// of --event, and the checks of a run's options against its trace.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/replay/cluster.h"

namespace modelcache::replay {
namespace {

constexpr size_t kNone = Router::kNone;

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// A duration in whole milliseconds, for messages.
std::string Ms(double ms) {
  return std::to_string(static_cast<int64_t>(std::llround(ms))) + "ms";
}

}  // namespace

std::vector<RingServer> NumberedNodes(uint32_t count) {
  std::vector<RingServer> nodes;
  for (uint32_t i = 1; i <= count; ++i) {
    nodes.push_back(RingServer{"n" + std::to_string(i), i, 1, false});
  }
  return nodes;
}

ClusterEvent ParseClusterEvent(std::string_view text) {
  const auto bad = [&](const std::string& why) {
    Invalid("event '" + std::string(text) + "': " + why +
            " (events are kill:NODE@TIME and join:NODE@TIME, TIME after the "
            "trace's first request, as in 30m)");
  };
  ClusterEvent event;
  const size_t colon = text.find(':');
  const size_t at = text.rfind('@');
  if (colon == std::string_view::npos || at == std::string_view::npos ||
      at < colon) {
    bad("not kind:node@time");
  }
  const std::string_view kind = text.substr(0, colon);
  if (kind == "kill") {
    event.kind = ClusterEvent::Kind::kKill;
  } else if (kind == "join") {
    event.kind = ClusterEvent::Kind::kJoin;
  } else {
    bad("unknown kind '" + std::string(kind) + "'");
  }
  event.node = std::string(text.substr(colon + 1, at - colon - 1));
  if (event.node.empty()) bad("no node");
  try {
    event.at_ms = ParseDurationMs(text.substr(at + 1));
  } catch (const Error& e) {
    bad(e.what());
  }
  return event;
}

void ValidateClusterOptions(const ClusterOptions& options, double span_ms) {
  if (options.nodes.empty()) Invalid("--nodes: no nodes");
  try {
    ValidateRingServers(options.nodes);
  } catch (const Error& e) {
    Invalid(std::string("--nodes: ") + e.what());
  }
  ValidateBalanceFactor(options.route.balance_factor);
  for (const double d : {options.detect_ms, options.retry_delay_ms}) {
    if (!(d >= 0) || !std::isfinite(d)) {
      Invalid("a delay must be a finite duration of 0 or more");
    }
  }
  // Each node's state through its events, in time order: a node whose
  // first event is a join starts down.
  std::vector<const ClusterEvent*> events;
  for (const ClusterEvent& e : options.events) events.push_back(&e);
  std::stable_sort(events.begin(), events.end(),
                   [](const ClusterEvent* a, const ClusterEvent* b) {
                     return a->at_ms < b->at_ms;
                   });
  std::vector<int> state(options.nodes.size(), -1);  // -1: no event yet
  for (const ClusterEvent* e : events) {
    const std::string what =
        std::string(e->kind == ClusterEvent::Kind::kKill ? "kill" : "join") +
        ":" + e->node;
    size_t node = kNone;
    for (size_t i = 0; i < options.nodes.size(); ++i) {
      if (options.nodes[i].name == e->node) node = i;
    }
    if (node == kNone) {
      Invalid("--event " + what + ": no node named '" + e->node +
              "' in --nodes");
    }
    if (!(e->at_ms >= 0) || e->at_ms > span_ms) {
      Invalid("--event " + what + "@" + Ms(e->at_ms) +
              ": outside the trace, whose last request comes " + Ms(span_ms) +
              " after its first");
    }
    const bool kill = e->kind == ClusterEvent::Kind::kKill;
    // Before its first event a node is up, unless it is declared down at
    // the start or that event is a join (then it is down from the start).
    const bool up_before = state[node] == -1
                               ? kill && !options.nodes[node].down_at_start
                               : static_cast<bool>(state[node]);
    if (kill && !up_before) {
      Invalid("--event " + what + ": the node is already down then");
    }
    if (!kill && up_before) {
      Invalid("--event " + what + ": the node is already up then");
    }
    state[node] = kill ? 0 : 1;
  }
}

}  // namespace modelcache::replay
