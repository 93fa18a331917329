// The reports of a replay: the table, the JSON and the HTML page
// (report_table.cc, report_json.cc, report_html.cc).
#ifndef MODELCACHE_REPLAY_REPORT_H_
#define MODELCACHE_REPLAY_REPORT_H_

#include <string>
#include <vector>

#include "modelcache/replay/simulate.h"
#include "modelcache/replay/slo.h"
#include "modelcache/replay/trace.h"
#include "modelcache/replay/trace_source.h"

namespace modelcache::replay {

struct RunInfo {
  bool timed = false;
  TimeModel time;
  // The SLO and its answers (none searched when empty).
  SloSearchOptions slo;
  std::vector<SloAnswer> slo_answers;
  // The policies whose time series the report draws (all when empty).
  std::vector<std::string> report_policies;
  // Lines the table prints above its header (how its capacities were
  // chosen, say).
  std::vector<std::string> notes;
};

// Each reads only the trace's models, sizes and request count: a
// TraceHeader (a streamed trace's) or a Trace.
std::string ResultsTable(const TraceHeader& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info = {});
std::string ResultsJson(const TraceHeader& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info = {});
// One self-contained HTML page (inline SVG, no scripts, no network).
std::string HtmlReport(const TraceHeader& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info = {});
std::string ResultsTable(const Trace& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info = {});
std::string ResultsJson(const Trace& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info = {});
std::string HtmlReport(const Trace& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info = {});

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_REPORT_H_
