// The replay reports' shared helpers (report_format.h).
#include "report_format.h"

#include <cmath>
#include <cstdio>
#include <iterator>
#include <numeric>
#include <utility>

namespace modelcache::replay {

std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, value);
  return buf;
}

std::string FormatMs(double ms) {
  if (ms < 1000) return Fixed(ms, 0) + "ms";
  if (ms < 60000) return Fixed(ms / 1000, ms < 10000 ? 2 : 1) + "s";
  if (ms < 3600000) return Fixed(ms / 60000, 1) + "min";
  return Fixed(ms / 3600000, 1) + "h";
}

uint64_t TotalModelBytes(const std::vector<uint64_t>& sizes) {
  return std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
}

std::string TraceLine(uint64_t requests, size_t models, uint64_t model_bytes) {
  return "trace: " + std::to_string(requests) + " requests, " +
         std::to_string(models) + " models, " + FormatBytes(model_bytes) +
         " of models in all";
}

std::string LoadPathText(const TimeModel& time) {
  return Fixed(time.bandwidth_bytes_per_second / 1e9, 2) +
         " GB/s shared by at most " +
         (time.slots ? std::to_string(time.slots) : "unlimited") + " loads, " +
         FormatMs(time.latency_ms) + " latency each";
}

std::string HtmlRow(const std::vector<std::string>& cells) {
  std::string row = "<tr>";
  for (const std::string& cell : cells) row += "<td>" + cell + "</td>";
  return row + "</tr>\n";
}

double UnservedRatio(const RunResult& r) {
  return r.requests ? static_cast<double>(UnservedRequests(r)) /
                          static_cast<double>(r.requests)
                    : 0.0;
}

double UnservedPercent(const RunResult& r) {
  return r.requests ? 100 * static_cast<double>(UnservedRequests(r)) /
                          static_cast<double>(r.requests)
                    : 0;
}

std::string RowFlags(const RunResult& r) {
  std::string flags;
  if (UnservedRequests(r) > 0) flags += "  UNSERVED";
  if (r.overloaded) flags += "  OVERLOADED";
  return flags;
}

std::string WaitText(const RunResult& r, double ms) {
  return UnservedRequests(r) >= r.requests ? "-" : FormatMs(ms);
}

std::string PolicyLabel(const RunResult& r) {
  return r.offline ? r.policy + " (offline)" : r.policy;
}

std::string DrainAfterText(const RunResult& r) {
  if (!r.timed) return "-";
  if (!r.drain_after_ms) return "default";
  if (std::isinf(*r.drain_after_ms)) return "inf";
  return FormatMs(*r.drain_after_ms);
}

nlohmann::json WaitsJson(const WaitSummary& w) {
  return {{"p50", w.p50},
          {"p95", w.p95},
          {"p99", w.p99},
          {"p999", w.p999},
          {"max", w.max}};
}

nlohmann::json TimeModelJson(const TimeModel& time) {
  return {{"bandwidth_bytes_per_second", time.bandwidth_bytes_per_second},
          {"latency_ms", time.latency_ms},
          {"slots", time.slots}};
}

nlohmann::json RunJson(const RunResult& r) {
  nlohmann::json run = {
      {"policy", r.policy},
      {"capacity_bytes", r.capacity_bytes},
      {"hits", r.hits},
      {"misses", r.misses},
      {"too_large", r.too_large},
      {"unserved", UnservedRequests(r)},
      {"unserved_ratio", UnservedRatio(r)},
      {"bytes_loaded", r.bytes_loaded},
      {"evictions", r.evictions},
      {"hit_ratio", r.hit_ratio},
      {"byte_miss_ratio", r.byte_miss_ratio},
      {"peak_resident_bytes", r.peak_resident_bytes},
      {"requests_per_second", r.requests_per_second},
      {"cold_starts", r.cold_starts},
      {"cold_start_ratio", r.cold_start_ratio},
      {"wait_ms", WaitsJson(r.wait_ms)},
      {"rejected", r.rejected},
      {"prewarms", r.prewarms},
      {"load_seconds", r.load_seconds},
      {"disk_busy_ratio", r.disk_busy_ratio},
      {"load_queue_peak", r.load_queue_peak},
      {"load_queue_mean", r.load_queue_mean},
      {"idle_gib_hours", r.idle_gib_hours},
      {"p75_model_cold_start_ratio", r.p75_model_cold_start_ratio},
      {"overloaded", r.overloaded}};
  // The drain: drain_after as the table writes it, and in ms when it is one
  // finite value (null for the default, which depends on each waiter's
  // load, and for inf); the longest wait beside it.
  run["drain_after"] = DrainAfterText(r);
  run["drain_after_ms"] = r.drain_after_ms && std::isfinite(*r.drain_after_ms)
                              ? nlohmann::json(*r.drain_after_ms)
                              : nlohmann::json(nullptr);
  run["drains"] = r.drains;
  run["drain_queued"] = r.drain_queued;
  run["max_wait_ms"] = r.wait_ms.max;
  return run;
}

std::string ColorOf(size_t index) {
  static const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c",
                                        "#9467bd", "#ff7f0e", "#8c564b",
                                        "#e377c2", "#17becf"};
  return kColors[index % std::size(kColors)];
}

std::string CapacityText(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return std::to_string(bytes) + " B";
  const int digits = value < 10 ? 2 : value < 100 ? 1 : 0;
  const double scale = std::pow(10.0, digits);
  return Fixed(std::ceil(value * scale - 1e-6) / scale, digits) + " " +
         kUnits[unit];
}

std::string ResolutionText(double fraction, uint64_t bytes) {
  char percent[32];
  std::snprintf(percent, sizeof(percent), "%g%%", 100 * fraction);
  if (fraction > 0 && bytes > 0) {
    return std::string(percent) + " of the answer or " + CapacityText(bytes) +
           ", whichever is larger";
  }
  return fraction > 0 ? std::string(percent) + " of the answer"
                      : CapacityText(bytes);
}

std::string SloText(const SloSearchOptions& slo, double ms) {
  return PercentileName(slo.percentile) + " wait \u2264 " + FormatMs(ms);
}

std::vector<std::string> SloLines(const TraceHeader& trace,
                                  const RunInfo& info) {
  const std::vector<SloAnswer>& answers = info.slo_answers;
  const SloAnswer* base = answers.empty() ? nullptr : &answers.front();
  for (const SloAnswer& a : answers) {
    if (a.policy == "lru") base = &a;
  }
  std::vector<std::string> lines;
  for (const SloAnswer& a : answers) {
    std::string line = a.policy + ": ";
    const std::string what = " for " + SloText(info.slo, info.slo.slo_ms);
    std::vector<std::string> notes;
    if (a.capacity_bytes) {
      line += CapacityText(*a.capacity_bytes) + what;
      if (base != &a) {
        if (base->capacity_bytes) {
          // What the baseline needs beside this policy: "lru needs 57.5
          // GiB, 8% more". No share of a capacity of 0 (models of 0 bytes).
          std::string note =
              base->policy + " needs " + CapacityText(*base->capacity_bytes);
          if (*a.capacity_bytes > 0) {
            const double ratio = static_cast<double>(*base->capacity_bytes) /
                                     static_cast<double>(*a.capacity_bytes) -
                                 1;
            char pct[32];
            std::snprintf(pct, sizeof(pct), "%.0f%%", 100 * std::abs(ratio));
            if (std::string(pct) == "0%") {
              note += ", the same";
            } else {
              note += std::string(", ") + pct + (ratio > 0 ? " more" : " less");
            }
          }
          notes.push_back(std::move(note));
        } else {
          notes.push_back(base->policy + " meets it at no capacity");
        }
      }
    } else {
      line += "none up to " + CapacityText(TotalModelBytes(trace.sizes)) + what;
    }
    if (!a.monotone) {
      // The largest probe below the failing one that met the SLO anyway.
      uint64_t met = 0;
      for (const SloProbe& p : a.probes) {
        if (p.capacity_bytes < a.failing_bytes && p.served_all &&
            p.wait_ms <= info.slo.slo_ms) {
          met = p.capacity_bytes;
        }
      }
      notes.push_back("not monotone: " + CapacityText(met) + " met it, " +
                      CapacityText(a.failing_bytes) + " did not");
    }
    for (size_t i = 0; i < notes.size(); ++i)
      line += (i ? "; " : " (") + notes[i] + (i + 1 == notes.size() ? ")" : "");
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace modelcache::replay
