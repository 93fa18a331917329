// Rendering replay results: a text table, JSON, and a self-contained HTML
// report with inline SVG charts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <sstream>

#include "modelcache/replay/replay.h"
#include "nlohmann/json.hpp"

namespace modelcache::replay {
namespace {

uint64_t TotalModelBytes(const TraceHeader& trace) {
  return std::accumulate(trace.sizes.begin(), trace.sizes.end(), uint64_t{0});
}

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

// "850ms", "12.3s", "4.5min", "2.1h".
std::string FormatMs(double ms) {
  if (ms < 1000) return Fixed(ms, 0) + "ms";
  if (ms < 60000) return Fixed(ms / 1000, ms < 10000 ? 2 : 1) + "s";
  if (ms < 3600000) return Fixed(ms / 60000, 1) + "min";
  return Fixed(ms / 3600000, 1) + "h";
}

std::string PolicyLabel(const RunResult& r) {
  return r.offline ? r.policy + " (offline)" : r.policy;
}

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                               "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
  // Optional, one per point: a band drawn from low to high behind the line.
  std::vector<double> low, high;
};

// A line chart as an inline SVG element.
std::string LineChart(const std::string& title, const std::string& x_label,
                      const std::string& y_label,
                      const std::vector<Series>& series,
                      const std::function<std::string(double)>& x_tick,
                      const std::function<std::string(double)>& y_tick,
                      const std::vector<double>& x_ticks,
                      bool fit_y_to_data = false) {
  const double width = 720, height = 340, left = 80, right = 170, top = 36,
               bottom = 56;
  double x_min = 1e300, x_max = -1e300, y_max = 0, y_low = 1e300;
  for (const auto& s : series) {
    for (auto [x, y] : s.points) {
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_max = std::max(y_max, y);
      y_low = std::min(y_low, y);
    }
    for (double y : s.high) y_max = std::max(y_max, y);
  }
  if (x_min > x_max) x_min = 0, x_max = 1;
  if (x_max == x_min) x_max = x_min + 1;
  if (y_max <= 0) y_max = 1;
  // Zero-based unless asked to zoom in on the data (ratios bunched near the
  // top would otherwise look identical).
  const double y_min =
      fit_y_to_data && y_low < y_max ? std::floor(y_low / 5) * 5 : 0.0;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  auto px = [&](double x) {
    return left + (x - x_min) / (x_max - x_min) * plot_w;
  };
  auto py = [&](double y) {
    return top + plot_h - (y - y_min) / (y_max - y_min) * plot_h;
  };
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width
      << "\" height=\"" << height << "\" role=\"img\" aria-label=\""
      << Escape(title) << "\">\n";
  svg << "<text x=\"" << left << "\" y=\"20\" class=\"title\">" << Escape(title)
      << "</text>\n";
  svg << "<line x1=\"" << left << "\" y1=\"" << top + plot_h << "\" x2=\""
      << left + plot_w << "\" y2=\"" << top + plot_h << "\" class=\"axis\"/>\n";
  svg << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left
      << "\" y2=\"" << top + plot_h << "\" class=\"axis\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double y = y_min + (y_max - y_min) * i / 4;
    svg << "<line x1=\"" << left << "\" y1=\"" << py(y) << "\" x2=\""
        << left + plot_w << "\" y2=\"" << py(y) << "\" class=\"grid\"/>\n";
    svg << "<text x=\"" << left - 6 << "\" y=\"" << py(y) + 4
        << "\" class=\"tick\" text-anchor=\"end\">" << Escape(y_tick(y))
        << "</text>\n";
  }
  for (double x : x_ticks) {
    svg << "<text x=\"" << px(x) << "\" y=\"" << top + plot_h + 18
        << "\" class=\"tick\" text-anchor=\"middle\">" << Escape(x_tick(x))
        << "</text>\n";
  }
  svg << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 12
      << "\" class=\"label\" text-anchor=\"middle\">" << Escape(x_label)
      << "</text>\n";
  svg << "<text x=\"16\" y=\"" << top + plot_h / 2
      << "\" class=\"label\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
      << top + plot_h / 2 << ")\">" << Escape(y_label) << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % std::size(kColors)];
    if (!series[i].low.empty()) {
      std::ostringstream band;
      for (size_t k = 0; k < series[i].points.size(); ++k)
        band << px(series[i].points[k].first) << "," << py(series[i].high[k])
             << " ";
      for (size_t k = series[i].points.size(); k-- > 0;)
        band << px(series[i].points[k].first) << "," << py(series[i].low[k])
             << " ";
      svg << "<polygon fill=\"" << color
          << "\" fill-opacity=\"0.18\" stroke=\"none\" points=\"" << band.str()
          << "\"/>\n";
    }
    std::ostringstream points;
    for (auto [x, y] : series[i].points) points << px(x) << "," << py(y) << " ";
    svg << "<polyline fill=\"none\" stroke=\"" << color
        << "\" stroke-width=\"2\" points=\"" << points.str() << "\"/>\n";
    if (series[i].points.size() <= 24) {
      for (auto [x, y] : series[i].points) {
        svg << "<circle cx=\"" << px(x) << "\" cy=\"" << py(y)
            << "\" r=\"3.5\" fill=\"" << color << "\"/>\n";
      }
    }
    const double ly = top + 14 + 20.0 * static_cast<double>(i);
    svg << "<line x1=\"" << left + plot_w + 14 << "\" y1=\"" << ly - 4
        << "\" x2=\"" << left + plot_w + 34 << "\" y2=\"" << ly - 4
        << "\" stroke=\"" << color << "\" stroke-width=\"3\"/>\n";
    svg << "<text x=\"" << left + plot_w + 40 << "\" y=\"" << ly
        << "\" class=\"legend\">" << Escape(series[i].name) << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

std::vector<std::string> Policies(const std::vector<RunResult>& results) {
  std::vector<std::string> names;
  for (const auto& r : results) {
    if (std::find(names.begin(), names.end(), PolicyLabel(r)) == names.end()) {
      names.push_back(PolicyLabel(r));
    }
  }
  return names;
}

std::vector<uint64_t> Capacities(const std::vector<RunResult>& results) {
  std::vector<uint64_t> caps;
  for (const auto& r : results) caps.push_back(r.capacity_bytes);
  std::sort(caps.begin(), caps.end());
  caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
  return caps;
}

// Waits are drawn on log10 axes: they span a millisecond to hours. A wait
// below 1 ms (a hit) is drawn at 1 ms.
double LogMs(double ms) { return std::log10(std::max(ms, 1.0)); }

std::vector<double> LogTicks(double low, double high) {
  std::vector<double> ticks;
  for (double e = std::floor(low); e <= std::ceil(high); e += 1) {
    ticks.push_back(e);
  }
  if (ticks.size() < 2) ticks.push_back(ticks.empty() ? 1 : ticks.back() + 1);
  return ticks;
}

std::string TimeCharts(const std::vector<RunResult>& results,
                       const std::vector<uint64_t>& capacities) {
  const double gib = 1073741824.0;
  const std::vector<std::string> policies = Policies(results);
  const uint64_t middle =
      capacities.empty() ? 0 : capacities[capacities.size() / 2];
  auto ms_tick = [](double e) { return FormatMs(std::pow(10.0, e)); };
  std::vector<Series> cdf, p99_by_capacity, p99_by_idle, queue;
  double wait_hi = 1;
  for (const RunResult& r : results)
    wait_hi = std::max(wait_hi, LogMs(r.wait_ms.max));
  for (const std::string& policy : policies) {
    Series by_cap{policy, {}}, by_idle{policy, {}};
    for (const RunResult& r : results) {
      if (PolicyLabel(r) != policy) continue;
      by_cap.points.emplace_back(static_cast<double>(r.capacity_bytes) / gib,
                                 LogMs(r.wait_ms.p99));
      by_idle.points.emplace_back(r.idle_gib_hours, LogMs(r.wait_ms.p99));
      if (r.capacity_bytes != middle) continue;
      Series c{policy, {}};
      for (size_t q = 0; q < r.wait_quantiles.size(); ++q) {
        c.points.emplace_back(LogMs(r.wait_quantiles[q]),
                              100.0 * static_cast<double>(q + 1) /
                                  static_cast<double>(r.wait_quantiles.size()));
      }
      cdf.push_back(std::move(c));
      Series ql{policy, {}};
      for (const RunResult::Bin& b : r.bins) {
        ql.points.emplace_back(static_cast<double>(b.t_ms) / 3.6e6, b.queue);
      }
      queue.push_back(std::move(ql));
    }
    std::sort(by_cap.points.begin(), by_cap.points.end());
    std::sort(by_idle.points.begin(), by_idle.points.end());
    p99_by_capacity.push_back(std::move(by_cap));
    p99_by_idle.push_back(std::move(by_idle));
  }
  std::vector<double> cap_ticks;
  for (uint64_t c : capacities)
    cap_ticks.push_back(static_cast<double>(c) / gib);
  double idle_max = 0;
  for (const RunResult& r : results)
    idle_max = std::max(idle_max, r.idle_gib_hours);
  std::vector<double> idle_ticks;
  for (int i = 0; i <= 4; ++i) idle_ticks.push_back(idle_max * i / 4);
  double t_lo = 1e300, t_hi = 0;
  for (const auto& s : queue) {
    for (auto [x, y] : s.points)
      t_lo = std::min(t_lo, x), t_hi = std::max(t_hi, x);
  }
  std::vector<double> t_ticks;
  if (t_hi > t_lo) {
    for (int i = 0; i <= 4; ++i)
      t_ticks.push_back(t_lo + (t_hi - t_lo) * i / 4);
  }
  // A log axis's ticks label powers of ten; the y axis gets its five evenly
  // spaced ticks in log space, labelled back in time units.
  std::string out;
  out += LineChart(
      "Request wait CDF at " + FormatBytes(middle),
      "wait (log scale; hits drawn at 1 ms)", "requests (%)", cdf, ms_tick,
      [](double y) { return Fixed(y, 0) + "%"; }, LogTicks(0, wait_hi),
      /*fit_y_to_data=*/true);
  out += LineChart(
      "p99 wait by capacity", "capacity", "p99 wait (log scale)",
      p99_by_capacity,
      [](double x) { return Fixed(x, x < 10 ? 1 : 0) + " GiB"; }, ms_tick,
      cap_ticks);
  out += LineChart(
      "p99 wait against idle memory-time (one point per capacity)",
      "idle GiB·h (memory held with no lease)", "p99 wait (log scale)",
      p99_by_idle, [](double x) { return Fixed(x, 0); }, ms_tick, idle_ticks);
  out += LineChart(
      "Load queue length over trace time at " + FormatBytes(middle) +
          " (most in each bin)",
      "trace time (hours)", "loads queued", queue,
      [](double x) { return Fixed(x, 1) + " h"; },
      [](double y) { return Fixed(y, 0); }, t_ticks);
  return out;
}

}  // namespace

std::string ResultsTable(const TraceHeader& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info) {
  std::ostringstream out;
  out << "trace: " << trace.requests << " requests, " << trace.models.size()
      << " models, " << FormatBytes(TotalModelBytes(trace))
      << " of models in all\n";
  if (info.timed) {
    out << "load path: " << Fixed(info.time.bandwidth_bytes_per_second / 1e9, 2)
        << " GB/s shared by at most "
        << (info.time.slots ? std::to_string(info.time.slots) : "unlimited")
        << " loads, " << FormatMs(info.time.latency_ms)
        << " latency each; waits over the requests served\n";
  }
  out << "\n";
  char line[512];
  if (!info.timed) {
    std::snprintf(line, sizeof(line),
                  "%-20s %11s %9s %9s %9s %9s %7s %12s %10s %11s\n", "policy",
                  "capacity", "hits", "misses", "too_large", "evictions",
                  "hit%", "loaded", "byte_miss%", "req/s");
    out << line;
    for (const RunResult& r : results) {
      std::snprintf(
          line, sizeof(line),
          "%-20s %11s %9llu %9llu %9llu %9llu %7.2f %12s %10.2f %11.3g\n",
          PolicyLabel(r).c_str(), FormatBytes(r.capacity_bytes).c_str(),
          static_cast<unsigned long long>(r.hits),
          static_cast<unsigned long long>(r.misses),
          static_cast<unsigned long long>(r.too_large),
          static_cast<unsigned long long>(r.evictions), 100 * r.hit_ratio,
          FormatBytes(r.bytes_loaded).c_str(), 100 * r.byte_miss_ratio,
          r.requests_per_second);
      out << line;
    }
    return out.str();
  }
  std::snprintf(line, sizeof(line),
                "%-20s %10s %7s %8s %8s %8s %8s %8s %9s %11s %7s %6s %7s %9s\n",
                "policy", "capacity", "cold%", "p50", "p99", "p99.9",
                "max_wait", "rejected", "idle_GiBh", "loaded", "busy%", "queue",
                "p75cold", "req/s");
  out << line;
  for (const RunResult& r : results) {
    std::snprintf(
        line, sizeof(line),
        "%-20s %10s %7.2f %8s %8s %8s %8s %8llu %9.1f %11s %7.1f %6llu %7.3f "
        "%9.3g%s\n",
        PolicyLabel(r).c_str(), FormatBytes(r.capacity_bytes).c_str(),
        100 * r.cold_start_ratio, FormatMs(r.wait_ms.p50).c_str(),
        FormatMs(r.wait_ms.p99).c_str(), FormatMs(r.wait_ms.p999).c_str(),
        FormatMs(r.wait_ms.max).c_str(),
        static_cast<unsigned long long>(r.rejected), r.idle_gib_hours,
        FormatBytes(r.bytes_loaded).c_str(), 100 * r.disk_busy_ratio,
        static_cast<unsigned long long>(r.load_queue_peak),
        r.p75_model_cold_start_ratio, r.requests_per_second,
        r.overloaded ? "  OVERLOADED" : "");
    out << line;
  }
  out << "\n";
  for (const auto& [policy, capacity] : SloAnswers(results, info.slo_ms)) {
    if (capacity) {
      out << policy << ": " << FormatBytes(capacity)
          << " keeps p99 wait <= " << FormatMs(info.slo_ms) << "\n";
    } else {
      out << policy
          << ": no capacity tried keeps p99 wait <= " << FormatMs(info.slo_ms)
          << "\n";
    }
  }
  return out.str();
}

std::string ResultsJson(const TraceHeader& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info) {
  nlohmann::json doc;
  doc["requests"] = trace.requests;
  doc["models"] = trace.models.size();
  doc["model_bytes"] = TotalModelBytes(trace);
  if (info.timed) {
    doc["time_model"] = {
        {"bandwidth_bytes_per_second", info.time.bandwidth_bytes_per_second},
        {"latency_ms", info.time.latency_ms},
        {"slots", info.time.slots}};
  } else {
    doc["time_model"] = nullptr;
  }
  nlohmann::json answers = nlohmann::json::array();
  for (const auto& [policy, capacity] : SloAnswers(results, info.slo_ms)) {
    answers.push_back({{"policy", policy},
                       {"capacity_bytes", capacity ? nlohmann::json(capacity)
                                                   : nlohmann::json(nullptr)}});
  }
  doc["slo"] = {{"ms", info.slo_ms}, {"answers", answers}};
  doc["results"] = nlohmann::json::array();
  for (const RunResult& r : results) {
    doc["results"].push_back(
        {{"policy", r.policy},
         {"offline", r.offline},
         {"capacity_bytes", r.capacity_bytes},
         {"hits", r.hits},
         {"misses", r.misses},
         {"too_large", r.too_large},
         {"blocked", r.blocked},
         {"bytes_loaded", r.bytes_loaded},
         {"evictions", r.evictions},
         {"hit_ratio", r.hit_ratio},
         {"byte_miss_ratio", r.byte_miss_ratio},
         {"peak_resident_bytes", r.peak_resident_bytes},
         {"requests_per_second", r.requests_per_second},
         {"cold_starts", r.cold_starts},
         {"cold_start_ratio", r.cold_start_ratio},
         {"wait_ms",
          {{"p50", r.wait_ms.p50},
           {"p95", r.wait_ms.p95},
           {"p99", r.wait_ms.p99},
           {"p999", r.wait_ms.p999},
           {"max", r.wait_ms.max}}},
         {"rejected", r.rejected},
         {"prewarms", r.prewarms},
         {"load_seconds", r.load_seconds},
         {"disk_busy_ratio", r.disk_busy_ratio},
         {"load_queue_peak", r.load_queue_peak},
         {"load_queue_mean", r.load_queue_mean},
         {"idle_gib_hours", r.idle_gib_hours},
         {"p75_model_cold_start_ratio", r.p75_model_cold_start_ratio},
         {"overloaded", r.overloaded}});
  }
  return doc.dump(2) + "\n";
}

std::string HtmlReport(const TraceHeader& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info) {
  const std::vector<std::string> policies = Policies(results);
  const std::vector<uint64_t> capacities = Capacities(results);
  const double gib = 1073741824.0;
  std::vector<double> cap_ticks;
  for (uint64_t c : capacities)
    cap_ticks.push_back(static_cast<double>(c) / gib);
  auto gib_tick = [](double x) { return Fixed(x, x < 10 ? 1 : 0) + " GiB"; };

  uint64_t most_loaded = 0;
  for (const RunResult& r : results)
    most_loaded = std::max(most_loaded, r.bytes_loaded);
  const bool in_tib = most_loaded >= (uint64_t{1} << 40);
  const double loaded_unit = in_tib ? gib * 1024 : gib;
  const std::string loaded_label = in_tib ? "TiB loaded" : "GiB loaded";
  std::vector<Series> hit_series, loaded_series;
  for (const std::string& policy : policies) {
    Series hit{policy, {}}, loaded{policy, {}};
    for (const RunResult& r : results) {
      if (PolicyLabel(r) != policy) continue;
      const double x = static_cast<double>(r.capacity_bytes) / gib;
      hit.points.emplace_back(x, 100 * r.hit_ratio);
      loaded.points.emplace_back(
          x, static_cast<double>(r.bytes_loaded) / loaded_unit);
    }
    std::sort(hit.points.begin(), hit.points.end());
    std::sort(loaded.points.begin(), loaded.points.end());
    hit_series.push_back(std::move(hit));
    loaded_series.push_back(std::move(loaded));
  }

  // Resident bytes over time and the most reloaded models, at the middle
  // capacity, where the policies differ most visibly.
  const uint64_t middle =
      capacities.empty() ? 0 : capacities[capacities.size() / 2];
  std::vector<Series> resident_series;
  std::vector<const RunResult*> at_middle;
  double t_max = 0;
  for (const RunResult& r : results) {
    if (r.capacity_bytes != middle) continue;
    at_middle.push_back(&r);
    Series s{PolicyLabel(r), {}};
    if (!r.bins.empty()) {
      // Binned: the band spans each bin's least and most, the line its mean.
      for (const RunResult::Bin& b : r.bins) {
        const double hours = static_cast<double>(b.t_ms) / 3.6e6;
        t_max = std::max(t_max, hours);
        s.points.emplace_back(hours, b.mean_bytes / gib);
        s.low.push_back(b.min_bytes / gib);
        s.high.push_back(b.max_bytes / gib);
      }
    } else {
      for (auto [t, bytes] : r.resident_over_time) {
        const double hours = static_cast<double>(t) / 3.6e6;
        t_max = std::max(t_max, hours);
        s.points.emplace_back(hours, static_cast<double>(bytes) / gib);
      }
    }
    resident_series.push_back(std::move(s));
  }
  std::vector<double> t_ticks;
  double t_min = t_max;
  for (const auto& s : resident_series) {
    for (auto [x, y] : s.points) t_min = std::min(t_min, x);
  }
  for (int i = 0; i <= 4; ++i)
    t_ticks.push_back(t_min + (t_max - t_min) * i / 4);

  std::vector<uint32_t> reloaded(trace.models.size());
  std::iota(reloaded.begin(), reloaded.end(), 0);
  if (!at_middle.empty()) {
    const RunResult* first = at_middle.front();
    std::sort(reloaded.begin(), reloaded.end(), [&](uint32_t a, uint32_t b) {
      const double ba = static_cast<double>(first->loads_per_model[a]) *
                        static_cast<double>(trace.sizes[a]);
      const double bb = static_cast<double>(first->loads_per_model[b]) *
                        static_cast<double>(trace.sizes[b]);
      return ba != bb ? ba > bb : a < b;
    });
    if (reloaded.size() > 12) reloaded.resize(12);
  }

  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta "
          "charset=\"utf-8\">\n"
       << "<title>" << Escape(title) << "</title>\n<style>\n"
       << "body{font-family:system-ui,sans-serif;margin:2em "
          "auto;max-width:980px;color:#222}\n"
       << "table{border-collapse:collapse;margin:1em 0}td,th{padding:3px 10px;"
          "border-bottom:1px solid #ddd;text-align:right}th{background:#f4f4f4}"
          "td:first-child,th:first-child{text-align:left}td{white-space:nowrap}"
          "\n"
       << ".axis{stroke:#444}.grid{stroke:#e4e4e4}.tick{font-size:11px;fill:#"
          "444}"
          ".label{font-size:12px;fill:#222}.legend{font-size:12px}"
          ".title{font-size:14px;font-weight:600}\n"
       << "</style>\n</head>\n<body>\n";
  html << "<h1>" << Escape(title) << "</h1>\n";
  if (info.timed) {
    html << "<p>Load path: "
         << Fixed(info.time.bandwidth_bytes_per_second / 1e9, 2)
         << " GB/s shared by at most "
         << (info.time.slots ? std::to_string(info.time.slots) : "unlimited")
         << " loads, " << Escape(FormatMs(info.time.latency_ms))
         << " latency each. SLO: p99 wait &le; "
         << Escape(FormatMs(info.slo_ms)) << ".</p>\n<ul>\n";
    for (const auto& [policy, capacity] : SloAnswers(results, info.slo_ms)) {
      html << "<li>" << Escape(policy) << ": "
           << (capacity ? Escape(FormatBytes(capacity)) +
                              " keeps p99 wait within the SLO"
                        : std::string("no capacity tried keeps p99 wait "
                                      "within the SLO"))
           << "</li>\n";
    }
    html << "</ul>\n";
  }
  html
      << "<p>" << trace.requests << " requests for " << trace.models.size()
      << " models (" << Escape(FormatBytes(TotalModelBytes(trace)))
      << " in all), replayed through modelcache's core cache. Offline policies "
         "know the future and bound what any online policy can do.</p>\n";
  html << "<table>\n<tr><th>policy</th><th>capacity</th><th>hit ratio</th>"
          "<th>bytes loaded</th><th>byte miss ratio</th><th>evictions</th>"
          "<th>too large</th><th>requests/s</th></tr>\n";
  for (const RunResult& r : results) {
    html << "<tr><td>" << Escape(PolicyLabel(r)) << "</td><td>"
         << Escape(FormatBytes(r.capacity_bytes)) << "</td><td>"
         << Fixed(100 * r.hit_ratio, 2) << "%</td><td>"
         << Escape(FormatBytes(r.bytes_loaded)) << "</td><td>"
         << Fixed(100 * r.byte_miss_ratio, 2) << "%</td><td>" << r.evictions
         << "</td><td>" << r.too_large << "</td><td>"
         << Fixed(r.requests_per_second / 1e6, 2) << " M</td></tr>\n";
  }
  html << "</table>\n";
  if (info.timed) {
    html << "<table>\n<tr><th>policy</th><th>capacity</th><th>cold "
            "starts</th><th>p50 wait</th><th>p99 wait</th><th>p99.9 wait</th>"
            "<th>max wait</th><th>rejected</th><th>idle GiB&middot;h</th>"
            "<th>disk busy</th><th>queue peak</th><th>load</th></tr>\n";
    for (const RunResult& r : results) {
      html << "<tr><td>" << Escape(PolicyLabel(r)) << "</td><td>"
           << Escape(FormatBytes(r.capacity_bytes)) << "</td><td>"
           << Fixed(100 * r.cold_start_ratio, 2) << "%</td><td>"
           << FormatMs(r.wait_ms.p50) << "</td><td>" << FormatMs(r.wait_ms.p99)
           << "</td><td>" << FormatMs(r.wait_ms.p999) << "</td><td>"
           << FormatMs(r.wait_ms.max) << "</td><td>" << r.rejected
           << "</td><td>" << Fixed(r.idle_gib_hours, 1) << "</td><td>"
           << Fixed(100 * r.disk_busy_ratio, 1) << "%</td><td>"
           << r.load_queue_peak << "</td><td>"
           << (r.overloaded ? "<b style=\"color:#d62728\">overloaded</b>"
                            : "ok")
           << "</td></tr>\n";
    }
    html << "</table>\n";
    html << TimeCharts(results, capacities);
  }
  html << LineChart(
      "Hit ratio by capacity", "capacity", "hit ratio (%)", hit_series,
      gib_tick, [](double y) { return Fixed(y, 1) + "%"; }, cap_ticks,
      /*fit_y_to_data=*/true);
  html << LineChart(
      "Bytes loaded by capacity", "capacity", loaded_label, loaded_series,
      gib_tick, [](double y) { return Fixed(y, 0); }, cap_ticks);
  html << LineChart(
      "Resident bytes over trace time at " + FormatBytes(middle) +
          (info.timed ? " (band: least to most per bin; line: mean)" : ""),
      "trace time (hours)", "resident GiB", resident_series,
      [](double x) { return Fixed(x, 1) + " h"; },
      [](double y) { return Fixed(y, 1); }, t_ticks);
  if (!at_middle.empty()) {
    html << "<h2>Most reloaded models at " << Escape(FormatBytes(middle))
         << "</h2>\n"
         << "<table>\n<tr><th>model</th><th>size</th>";
    for (const RunResult* r : at_middle) {
      html << "<th>loads: " << Escape(PolicyLabel(*r)) << "</th>";
    }
    html << "</tr>\n";
    for (uint32_t m : reloaded) {
      html << "<tr><td>" << Escape(trace.models[m]) << "</td><td>"
           << Escape(FormatBytes(trace.sizes[m])) << "</td>";
      for (const RunResult* r : at_middle)
        html << "<td>" << r->loads_per_model[m] << "</td>";
      html << "</tr>\n";
    }
    html << "</table>\n";
  }
  html << "</body>\n</html>\n";
  return html.str();
}

std::string ResultsTable(const Trace& trace,
                         const std::vector<RunResult>& results,
                         const RunInfo& info) {
  return ResultsTable(HeaderOf(trace), results, info);
}

std::string ResultsJson(const Trace& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info) {
  return ResultsJson(HeaderOf(trace), results, info);
}

std::string HtmlReport(const Trace& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info) {
  return HtmlReport(HeaderOf(trace), title, results, info);
}

}  // namespace modelcache::replay
