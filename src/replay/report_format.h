// What the replay's reports share (report_table.cc, report_json.cc,
// report_html.cc, and the multi-node replay's cluster_report.cc): numbers and
// durations in words, HTML escaping, the set-up lines every report starts
// with, a run's flags, the SLO's answers in words, and the colours of the
// charts. Written once, so that the one-node and the multi-node reports write
// a value the same way.
#ifndef MODELCACHE_SRC_REPLAY_REPORT_FORMAT_H_
#define MODELCACHE_SRC_REPLAY_REPORT_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "modelcache/replay/replay.h"
#include "nlohmann/json.hpp"

namespace modelcache::replay {

constexpr double kGiB = 1073741824.0;

// `text` with &, <, > and " as HTML entities.
std::string Escape(const std::string& text);

// `value` with `digits` digits after the point: Fixed(2.345, 2) is "2.35".
std::string Fixed(double value, int digits);

// A duration in ms, as the tables write it: "850ms", "12.3s", "4.5min",
// "2.1h".
std::string FormatMs(double ms);

// The sum of a trace's model sizes.
uint64_t TotalModelBytes(const std::vector<uint64_t>& sizes);

// "trace: 200000 requests, 60 models, 130.13 GiB of models in all".
std::string TraceLine(uint64_t requests, size_t models, uint64_t model_bytes);

// The load path of a time model in words: "2.00 GB/s shared by at most 4
// loads, 100ms latency each".
std::string LoadPathText(const TimeModel& time);

// A table row of `cells`, HTML already: "<tr><td>a</td><td>b</td></tr>\n".
std::string HtmlRow(const std::vector<std::string>& cells);

// The share of all requests a run did not serve: as a ratio, and in percent
// (0 for a run of no requests).
double UnservedRatio(const RunResult& r);
double UnservedPercent(const RunResult& r);

// "  UNSERVED", "  OVERLOADED", both or nothing: what a row must not be
// read without.
std::string RowFlags(const RunResult& r);

// A wait of the run's, or "-" when it served no request (there is no wait
// to show, and 0 would read as none waited).
std::string WaitText(const RunResult& r, double ms);

// The run's policy, with " (offline)" for a policy that knows the future.
std::string PolicyLabel(const RunResult& r);

// A run's drain_after as rows name it: "default", "0ms", "1.00s", "inf";
// "-" for an untimed run.
std::string DrainAfterText(const RunResult& r);

// A wait summary as the JSON writes it: {"p50", "p95", "p99", "p999", "max"}.
nlohmann::json WaitsJson(const WaitSummary& w);

// {"bandwidth_bytes_per_second", "latency_ms", "slots"}.
nlohmann::json TimeModelJson(const TimeModel& time);

// What the JSON of a one-node run and of a multi-node run's total share: the
// policy, the capacity, the counters, the waits, the load path's books.
nlohmann::json RunJson(const RunResult& r);

// The colour of the `index`th series (a policy by its place in the table, a
// run by its place in a bar chart), the same in every chart.
std::string ColorOf(size_t index);

// ---- the SLO's answers in words

// Binary units to three significant digits, rounded up: a capacity printed
// is never less than the one found. "52.3 GiB", "130 GiB", "1.25 GiB".
std::string CapacityText(uint64_t bytes);

// How close the search's answer is: "1% of the answer or 256 MiB,
// whichever is larger".
std::string ResolutionText(double fraction, uint64_t bytes);

// "p99 wait ≤ 1.00s".
std::string SloText(const SloSearchOptions& slo, double ms);

// One line per policy: "next-use: 52.3 GiB for p99 wait ≤ 1.00s (lru
// needs 61.0 GiB, 17% more)", compared with lru's answer (or the first
// policy's when lru was not searched).
std::vector<std::string> SloLines(const TraceHeader& trace,
                                  const RunInfo& info);

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_REPORT_FORMAT_H_
