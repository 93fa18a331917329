// Trace replay: how a request mix behaves under a memory budget.
//
// A trace is a time-ordered list of (time, model) requests with a size per
// model. A replay runs it through the real core cache (ModelCache with one
// shard, so the eviction order is exact), with a policy from the core's
// registry (PolicyByName), once per (policy, capacity) pair, and reports
// hits, misses, bytes loaded again and evictions. There are two:
//   * Simulate: in trace time. Loads take time on a modelled load path
//     (TimeModel: latency, shared bandwidth, slots), requests wait for them
//     and hold their leases for their service time, keep-alive policies
//     unload and prewarm on the trace's clock; it reports waits, cold
//     starts, idle memory and the load queue besides.
//   * ReplayUntimed: every load instantaneous, each lease given back before
//     the next request unless a hold time keeps it; the counts alone.
// ReplayAll runs either for many (policy, capacity) pairs on several
// threads.
//
// This header gathers the replay's headers, one per concern:
//   trace.h         traces in memory and their readers
//   trace_source.h  traces read as a stream
//   simulate.h      the replays and their results
//   slo.h           the capacity an SLO needs
//   report.h        the table, the JSON and the HTML report
#ifndef MODELCACHE_REPLAY_REPLAY_H_
#define MODELCACHE_REPLAY_REPLAY_H_

#include "modelcache/replay/report.h"
#include "modelcache/replay/simulate.h"
#include "modelcache/replay/slo.h"
#include "modelcache/replay/trace.h"
#include "modelcache/replay/trace_source.h"

#endif  // MODELCACHE_REPLAY_REPLAY_H_
