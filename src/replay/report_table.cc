// The replay's text table (ResultsTable in replay.h): the set-up, one row
// per run, and the SLO's answers.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "modelcache/replay/replay.h"
#include "report_format.h"

namespace modelcache::replay {

std::string ResultsTable(const TraceHeader& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info) {
  std::ostringstream out;
  out << TraceLine(trace.requests, trace.models.size(),
                   TotalModelBytes(trace.sizes))
      << "\n";
  if (info.timed) {
    out << "load path: " << LoadPathText(info.time) << "\n"
        << "waits are over the requests served; unserved: too large or "
           "rejected, % of all requests (a row with any says UNSERVED and "
           "meets no SLO)\n";
  }
  for (const std::string& note : info.notes) out << note << "\n";
  out << "\n";
  char line[512];
  if (!info.timed) {
    std::snprintf(line, sizeof(line),
                  "%-20s %11s %8s %9s %9s %9s %9s %7s %12s %10s %11s\n",
                  "policy", "capacity", "unserved", "hits", "misses",
                  "too_large", "evictions", "hit%", "loaded", "byte_miss%",
                  "req/s");
    out << line;
    for (const RunResult& r : results) {
      std::snprintf(
          line, sizeof(line),
          "%-20s %11s %7.2f%% %9llu %9llu %9llu %9llu %7.2f %12s %10.2f "
          "%11.3g%s\n",
          PolicyLabel(r).c_str(), FormatBytes(r.capacity_bytes).c_str(),
          UnservedPercent(r), static_cast<unsigned long long>(r.hits),
          static_cast<unsigned long long>(r.misses),
          static_cast<unsigned long long>(r.too_large),
          static_cast<unsigned long long>(r.evictions), 100 * r.hit_ratio,
          FormatBytes(r.bytes_loaded).c_str(), 100 * r.byte_miss_ratio,
          r.requests_per_second, RowFlags(r).c_str());
      out << line;
    }
    return out.str();
  }
  std::snprintf(
      line, sizeof(line),
      "%-20s %10s %11s %6s %8s %7s %8s %8s %8s %8s %8s %9s %11s %7s %6s %7s "
      "%9s\n",
      "policy", "capacity", "drain_after", "drains", "unserved", "cold%", "p50",
      "p99", "p99.9", "max_wait", "rejected", "idle_GiBh", "loaded", "busy%",
      "queue", "p75cold", "req/s");
  out << line;
  for (const RunResult& r : results) {
    std::snprintf(
        line, sizeof(line),
        "%-20s %10s %11s %6llu %7.2f%% %7.2f %8s %8s %8s %8s %8llu %9.1f %11s "
        "%7.1f %6llu %7.3f %9.3g%s\n",
        PolicyLabel(r).c_str(), FormatBytes(r.capacity_bytes).c_str(),
        DrainAfterText(r).c_str(), static_cast<unsigned long long>(r.drains),
        UnservedPercent(r), 100 * r.cold_start_ratio,
        WaitText(r, r.wait_ms.p50).c_str(), WaitText(r, r.wait_ms.p99).c_str(),
        WaitText(r, r.wait_ms.p999).c_str(), WaitText(r, r.wait_ms.max).c_str(),
        static_cast<unsigned long long>(r.rejected), r.idle_gib_hours,
        FormatBytes(r.bytes_loaded).c_str(), 100 * r.disk_busy_ratio,
        static_cast<unsigned long long>(r.load_queue_peak),
        r.p75_model_cold_start_ratio, r.requests_per_second,
        RowFlags(r).c_str());
    out << line;
  }
  if (!info.slo_answers.empty()) {
    out << "\nmemory for " << SloText(info.slo, info.slo.slo_ms)
        << ", found by replaying (to "
        << ResolutionText(info.slo.resolution_fraction,
                          info.slo.resolution_bytes)
        << "):\n";
    for (const std::string& l : SloLines(trace, info)) out << l << "\n";
  }
  return out.str();
}

std::string ResultsTable(const Trace& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info) {
  return ResultsTable(HeaderOf(trace), results, info);
}

}  // namespace modelcache::replay
