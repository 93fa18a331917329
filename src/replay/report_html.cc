// The replay's HTML report (HtmlReport in replay.h): one self-contained
// page, the SLO's answers, the waits, the time series, the hits and bytes,
// with inline SVG charts (svg_chart.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "modelcache/replay/replay.h"
#include "report_format.h"
#include "svg_chart.h"

namespace modelcache::replay {

namespace {

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

// The tail of the waits: (t, fraction of the requests served that waited
// longer than t), one point per distinct wait among the 0.1% quantiles, so
// down to 0.1% (p99.9); nothing for a run in which no request waited.
std::vector<std::pair<double, double>> WaitTail(const RunResult& r) {
  std::vector<std::pair<double, double>> points;
  const auto& q = r.wait_quantiles;
  const double n = static_cast<double>(q.size());
  for (size_t k = 0; k + 1 < q.size(); ++k) {
    if (q[k] <= 0) continue;
    if (k + 1 < q.size() && q[k + 1] == q[k]) continue;  // the last of a tie
    points.emplace_back(std::log10(q[k]),
                        std::log10(1 - static_cast<double>(k + 1) / n));
  }
  return points;
}

// The charts of a timed replay: the SLO's curve, the waits' tail, p99
// against capacity and against idle memory.
struct ReportContext {
  const TraceHeader& trace;
  const std::vector<RunResult>& results;
  const RunInfo& info;
  std::vector<std::string> policies;  // labels, in the table's order
  std::vector<uint64_t> capacities;
  uint64_t middle = 0;  // the capacity of the time charts

  std::string Color(const RunResult& r) const {
    return ColorOf(static_cast<size_t>(
        std::find(policies.begin(), policies.end(), PolicyLabel(r)) -
        policies.begin()));
  }
  // The runs at the middle capacity whose time series are drawn.
  std::vector<const RunResult*> Picked() const {
    std::vector<const RunResult*> picked;
    for (const RunResult& r : results) {
      if (r.capacity_bytes != middle) continue;
      const auto& only = info.report_policies;
      if (!only.empty() &&
          std::find(only.begin(), only.end(), r.policy) == only.end()) {
        continue;
      }
      picked.push_back(&r);
    }
    return picked;
  }
};

// One row per policy, in the table's order, and one column per capacity:
// the runs at a glance. `cell` gives a run's cell as HTML.
std::string PivotTable(
    const ReportContext& c, const std::string& caption,
    const std::function<std::string(const RunResult&)>& cell) {
  std::ostringstream html;
  html << "<table class=\"pivot\">\n<caption>" << Escape(caption)
       << "</caption>\n<tr><th>policy</th>";
  for (uint64_t capacity : c.capacities)
    html << "<th>" << Escape(FormatBytes(capacity)) << "</th>";
  html << "</tr>\n";
  for (const std::string& policy : c.policies) {
    html << "<tr><td>" << Escape(policy) << "</td>";
    for (uint64_t capacity : c.capacities) {
      html << "<td>";
      for (const RunResult& r : c.results) {
        if (PolicyLabel(r) == policy && r.capacity_bytes == capacity) {
          html << cell(r);
          break;
        }
      }
      html << "</td>";
    }
    html << "</tr>\n";
  }
  html << "</table>\n";
  return html.str();
}

// The capacity each SLO of the chart needs, per policy: the chart's values.
std::string SloTable(const ReportContext& c) {
  const SloSearchOptions& slo = c.info.slo;
  std::ostringstream html;
  html << "<table class=\"pivot\">\n<caption>Memory needed for a "
       << Escape(PercentileName(slo.percentile))
       << " wait within each SLO</caption>\n<tr><th>policy</th>";
  for (double ms : slo.curve_slo_ms)
    html << "<th>" << Escape(ShortMs(ms)) << "</th>";
  html << "</tr>\n";
  for (const SloAnswer& a : c.info.slo_answers) {
    html << "<tr><td>" << Escape(a.policy) << "</td>";
    for (const auto& capacity : a.curve) {
      html << "<td>"
           << (capacity ? Escape(CapacityText(*capacity)) : std::string("none"))
           << "</td>";
    }
    html << "</tr>\n";
  }
  html << "</table>\n";
  return html.str();
}

std::string SloChart(const ReportContext& c) {
  const SloSearchOptions& slo = c.info.slo;
  Chart chart("slo-capacity", "Memory needed against the SLO",
              PercentileName(slo.percentile) + " wait SLO (log scale)",
              "capacity needed (GiB)");
  double lo = slo.slo_ms, hi = slo.slo_ms, most = 0;
  for (double ms : slo.curve_slo_ms)
    lo = std::min(lo, ms), hi = std::max(hi, ms);
  for (size_t i = 0; i < c.info.slo_answers.size(); ++i) {
    const SloAnswer& a = c.info.slo_answers[i];
    Series s{a.policy, ColorOf(i), {}};
    std::vector<std::string> none;
    auto add = [&](double ms, const std::optional<uint64_t>& capacity) {
      if (!capacity) {
        none.push_back(ShortMs(ms));
        return;
      }
      const double gib = static_cast<double>(*capacity) / kGiB;
      most = std::max(most, gib);
      s.points.emplace_back(std::log10(ms), gib);
    };
    for (size_t k = 0; k < slo.curve_slo_ms.size(); ++k)
      add(slo.curve_slo_ms[k], a.curve[k]);
    if (std::find(slo.curve_slo_ms.begin(), slo.curve_slo_ms.end(),
                  slo.slo_ms) == slo.curve_slo_ms.end()) {
      add(slo.slo_ms, a.capacity_bytes);
    }
    std::sort(s.points.begin(), s.points.end());
    if (!none.empty()) {
      std::string note = a.policy + ": none at";
      for (const std::string& n : none) note += " " + n;
      chart.legend_notes.push_back(note);
    }
    if (!s.points.empty()) chart.series.push_back(std::move(s));
  }
  // The answers are colored as the table's policies are.
  for (Series& s : chart.series) {
    for (size_t i = 0; i < c.policies.size(); ++i) {
      if (c.policies[i] == s.name || c.policies[i] == s.name + " (offline)") {
        s.color = ColorOf(i);
      }
    }
  }
  chart.x = DurationAxis(lo, hi);
  chart.y = LinearAxis(0, most, GibLabel);
  chart.x_marks.push_back({std::log10(slo.slo_ms), "SLO"});
  chart.caption =
      "Per policy, the smallest capacity whose " +
      PercentileName(slo.percentile) +
      " wait meets each SLO, found by replaying: every capacity probed above "
      "it met the SLO too. The marked SLO is searched to " +
      ResolutionText(slo.resolution_fraction, slo.resolution_bytes) +
      ", the others to " +
      ResolutionText(slo.curve_resolution_fraction,
                     slo.curve_resolution_bytes) +
      ". A missing point: no capacity up to the sum of all models meets it. "
      "A curve the same as an earlier one is drawn dashed over it, so both "
      "show; the table below gives every value.";
  return RenderChart(chart);
}

std::string WaitCharts(const ReportContext& c) {
  std::string out;
  // The tail at the middle capacity.
  Chart tail("wait-tail",
             "Requests waiting longer than t, at " + FormatBytes(c.middle),
             "wait t (log scale)",
             "requests waiting longer than t (log scale)");
  double w_lo = 1e300, w_hi = 0;
  for (const RunResult& r : c.results) {
    if (r.capacity_bytes != c.middle) continue;
    Series s{PolicyLabel(r), c.Color(r), WaitTail(r)};
    if (s.points.empty()) {
      tail.legend_notes.push_back(PolicyLabel(r) + ": no request waited");
      continue;
    }
    for (auto [x, y] : s.points)
      w_lo = std::min(w_lo, x), w_hi = std::max(w_hi, x);
    tail.series.push_back(std::move(s));
  }
  if (!tail.series.empty()) {
    tail.x = DurationAxis(std::pow(10.0, w_lo), std::pow(10.0, w_hi));
    tail.y.lo = -3.25;
    tail.y.hi = 0;
    tail.y.ticks = {-3, -2, -1, 0};
    tail.y.label = [](double e) {
      return e <= -3 ? std::string("0.1%")
                     : Fixed(100 * std::pow(10.0, e), 0) + "%";
    };
    tail.y_marks = {{-2, "p99"}, {-3, "p99.9"}};
    tail.caption =
        "Log-log: where a curve crosses the p99 line is its p99 wait. Drawn "
        "from the replay's 0.1% quantiles of the requests served, so each "
        "curve ends at p99.9; the table gives the longest wait.";
    out += RenderChart(tail);
  }

  Chart by_capacity("p99-capacity", "p99 wait by capacity", "capacity",
                    "p99 wait (log scale)");
  Chart by_idle("p99-idle", "p99 wait against idle memory-time",
                "idle GiB\u00b7h (memory resident with no lease)",
                "p99 wait (log scale)");
  by_idle.caption =
      "One point per capacity; down and to the left is better. A ringed "
      "point is a run that was overloaded or left requests unserved.";
  double p99_lo = 1e300, p99_hi = 0, idle_max = 0;
  bool any_zero = false;
  for (const RunResult& r : c.results) {
    if (r.wait_ms.p99 <= 0) {
      any_zero = true;
    } else {
      p99_lo = std::min(p99_lo, std::max(r.wait_ms.p99, 1.0));
    }
    p99_hi = std::max(p99_hi, std::max(r.wait_ms.p99, 1.0));
  }
  if (c.info.slo.percentile == 99 && !c.info.slo_answers.empty()) {
    p99_lo = std::min(p99_lo, c.info.slo.slo_ms);
    p99_hi = std::max(p99_hi, c.info.slo.slo_ms);
    by_capacity.y_marks.push_back({std::log10(c.info.slo.slo_ms), "SLO"});
    by_idle.y_marks.push_back({std::log10(c.info.slo.slo_ms), "SLO"});
  }
  if (p99_lo > p99_hi) p99_lo = p99_hi;  // every p99 was 0
  Axis p99_axis = DurationAxis(p99_lo, p99_hi);
  // A p99 of 0 (fewer than 1% of the requests served waited) has no place
  // on a log scale: it is drawn on its own tick, "0", half a decade below
  // the scale, not at a made-up millisecond.
  const double zero_at = p99_axis.lo - 0.5;
  if (any_zero) {
    p99_axis.ticks.insert(p99_axis.ticks.begin(), zero_at);
    p99_axis.lo = zero_at;
    auto log_label = p99_axis.label;
    p99_axis.label = [log_label, zero_at](double e) {
      return e <= zero_at ? std::string("0") : log_label(e);
    };
  }
  auto p99_y = [&](double ms) { return ms <= 0 ? zero_at : LogMs(ms); };
  for (const std::string& policy : c.policies) {
    Series cap{policy, "", {}}, idle{policy, "", {}};
    std::vector<std::pair<std::pair<double, double>, bool>> cap_points,
        idle_points;
    for (const RunResult& r : c.results) {
      if (PolicyLabel(r) != policy) continue;
      cap.color = idle.color = c.Color(r);
      const bool flagged = r.overloaded || UnservedRequests(r) > 0;
      cap_points.push_back(
          {{static_cast<double>(r.capacity_bytes) / kGiB, p99_y(r.wait_ms.p99)},
           flagged});
      idle_points.push_back(
          {{r.idle_gib_hours, p99_y(r.wait_ms.p99)}, flagged});
      idle_max = std::max(idle_max, r.idle_gib_hours);
    }
    std::sort(cap_points.begin(), cap_points.end());
    std::sort(idle_points.begin(), idle_points.end());
    for (const auto& [point, flagged] : cap_points) {
      cap.points.push_back(point);
      cap.flagged.push_back(flagged);
    }
    for (const auto& [point, flagged] : idle_points) {
      idle.points.push_back(point);
      idle.flagged.push_back(flagged);
    }
    by_capacity.series.push_back(std::move(cap));
    by_idle.series.push_back(std::move(idle));
  }
  by_capacity.y = by_idle.y = p99_axis;
  by_capacity.x =
      LinearAxis(static_cast<double>(c.capacities.front()) / kGiB,
                 static_cast<double>(c.capacities.back()) / kGiB, GibLabel);
  by_capacity.caption =
      "A p99 of 0 (fewer than 1% of the requests served waited) is drawn on "
      "the line marked 0, below the log scale. A ringed point is a run that "
      "was overloaded or left requests unserved.";
  by_idle.x = LinearAxis(0, idle_max, [](double x) { return Fixed(x, 0); });
  out += RenderChart(by_capacity);
  out += RenderChart(by_idle);
  return out;
}

// Load queue and resident bytes over trace time, one panel per policy.
std::string TimeSeries(const ReportContext& c) {
  const std::vector<const RunResult*> picked = c.Picked();
  Panels queue("load-queue", "Loads queued (the most in each bin)",
               "trace time (hours)");
  Panels resident("resident",
                  "Resident GiB (band: least to most in each bin; line: mean)",
                  "trace time (hours)");
  double t_lo = 1e300, t_hi = 0, q_max = 0, bytes_max = 0;
  for (const RunResult* r : picked) {
    Series q{PolicyLabel(*r), c.Color(*r), {}};
    Series m{PolicyLabel(*r), c.Color(*r), {}};
    if (!r->bins.empty()) {
      for (const RunResult::Bin& b : r->bins) {
        const double hours = static_cast<double>(b.t_ms) / 3.6e6;
        q.points.emplace_back(hours, b.queue);
        q.low.push_back(0);  // drawn as an area: the spikes stay readable
        q.high.push_back(b.queue);
        m.points.emplace_back(hours, b.mean_bytes / kGiB);
        m.low.push_back(b.min_bytes / kGiB);
        m.high.push_back(b.max_bytes / kGiB);
        q_max = std::max(q_max, static_cast<double>(b.queue));
        bytes_max = std::max(bytes_max, b.max_bytes / kGiB);
      }
    } else {
      for (auto [t, bytes] : r->resident_over_time) {
        m.points.emplace_back(static_cast<double>(t) / 3.6e6,
                              static_cast<double>(bytes) / kGiB);
        bytes_max = std::max(bytes_max, static_cast<double>(bytes) / kGiB);
      }
    }
    for (auto [x, y] : m.points)
      t_lo = std::min(t_lo, x), t_hi = std::max(t_hi, x);
    if (!q.points.empty()) queue.panels.push_back(std::move(q));
    if (!m.points.empty()) resident.panels.push_back(std::move(m));
  }
  if (resident.panels.empty()) return "";
  const auto hours = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g h", x);
    return std::string(buf);
  };
  queue.x = resident.x = LinearAxis(t_lo, t_hi, hours);
  queue.y =
      LinearAxis(0, std::max(q_max, 1.0), [](double y) { return Fixed(y, 0); });
  const double capacity = static_cast<double>(c.middle) / kGiB;
  resident.y = LinearAxis(0, std::max(bytes_max, capacity),
                          [](double y) { return Fixed(y, 0); });
  resident.y_marks.push_back({capacity, "capacity"});
  const std::string which =
      c.info.report_policies.empty()
          ? "One panel per policy, on the same axes."
          : "The policies picked with --report-policies, one panel each, on "
            "the same axes.";
  queue.caption = which +
                  " Each point is the longest queue of loads waiting for a "
                  "slot or for room within one of 240 bins of trace time.";
  resident.caption =
      which + (c.results.front().bins.empty()
                   ? " Resident bytes at 240 evenly spaced times."
                   : " The band spans the least and the most resident in "
                     "each of 240 bins of trace time, the line is the "
                     "bin's mean; the dashed line is the capacity.");
  std::string out;
  if (!queue.panels.empty() && c.info.timed) out += RenderPanels(queue);
  out += RenderPanels(resident);
  return out;
}

// The drain_after values of `runs`, as DrainAfterText writes them, in the
// order they first appear.
std::vector<std::string> DrainAfterValues(const std::vector<RunResult>& runs) {
  std::vector<std::string> values;
  for (const RunResult& r : runs) {
    const std::string v = DrainAfterText(r);
    if (std::find(values.begin(), values.end(), v) == values.end()) {
      values.push_back(v);
    }
  }
  return values;
}

// The trade-off of drain_after (several compared in one run): p99 wait and
// bytes loaded against drain_after, one line per policy and capacity.
std::string DrainCharts(const std::vector<RunResult>& runs,
                        const std::vector<std::string>& values) {
  Chart wait("drain-p99", "p99 wait against drain_after", "drain_after",
             "p99 wait (log scale)");
  Chart loaded("drain-loaded", "Bytes loaded against drain_after",
               "drain_after", "bytes loaded (GiB)");
  const std::vector<std::string> policies = Policies(runs);
  const std::vector<uint64_t> capacities = Capacities(runs);
  double p99_hi = 1, gib_hi = 0;
  size_t line = 0;
  for (const std::string& policy : policies) {
    for (const uint64_t capacity : capacities) {
      const std::string name = policy + " " + FormatBytes(capacity);
      Series w{name, ColorOf(line), {}}, l{name, ColorOf(line), {}};
      for (const RunResult& r : runs) {
        if (PolicyLabel(r) != policy || r.capacity_bytes != capacity) continue;
        const double x = static_cast<double>(
            std::find(values.begin(), values.end(), DrainAfterText(r)) -
            values.begin());
        const double gib = static_cast<double>(r.bytes_loaded) / (1 << 30);
        w.points.emplace_back(x, LogMs(r.wait_ms.p99));
        l.points.emplace_back(x, gib);
        const bool flagged = UnservedRequests(r) > 0 || r.overloaded;
        w.flagged.push_back(flagged);
        l.flagged.push_back(flagged);
        p99_hi = std::max(p99_hi, r.wait_ms.p99);
        gib_hi = std::max(gib_hi, gib);
      }
      if (w.points.empty()) continue;
      ++line;
      wait.series.push_back(std::move(w));
      loaded.series.push_back(std::move(l));
    }
  }
  Axis x;
  x.lo = -0.25;
  x.hi = static_cast<double>(values.size()) - 0.75;
  for (size_t i = 0; i < values.size(); ++i) {
    x.ticks.push_back(static_cast<double>(i));
  }
  x.label = [values](double i) {
    const auto k = static_cast<size_t>(std::llround(i));
    return k < values.size() ? values[k] : std::string();
  };
  wait.x = loaded.x = x;
  wait.y = DurationAxis(1, p99_hi);
  loaded.y = LinearAxis(0, gib_hi, GibLabel);
  wait.caption =
      "drain_after in the order given: 0 is strict arrival order, inf lets "
      "requests for the models that hold the room overtake a wait for room "
      "for ever, default is the library's rule. A p99 under 1 ms is drawn at "
      "1 ms; a ringed point is a run that was overloaded or left requests "
      "unserved.";
  loaded.caption =
      "Every load counts, the first of each model included: a shorter "
      "drain_after swaps models more often.";
  return RenderChart(wait) + RenderChart(loaded);
}

}  // namespace

std::string HtmlReport(const TraceHeader& trace, const std::string& title,
                       const std::vector<RunResult>& all_results,
                       const RunInfo& info) {
  // With several drain_after values, the drain's section compares them, and
  // every other section draws the runs of the first.
  const std::vector<std::string> drain_values = DrainAfterValues(all_results);
  std::vector<RunResult> first_drain;
  for (const RunResult& r : all_results) {
    if (DrainAfterText(r) == drain_values.front()) first_drain.push_back(r);
  }
  const std::vector<RunResult>& results =
      drain_values.size() > 1 ? first_drain : all_results;
  ReportContext c{trace, results, info, Policies(results), Capacities(results)};
  if (!c.capacities.empty()) c.middle = c.capacities[c.capacities.size() / 2];

  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta "
          "charset=\"utf-8\">\n<meta name=\"viewport\" "
          "content=\"width=device-width, initial-scale=1\">\n"
       << "<title>" << Escape(title) << "</title>\n<style>\n"
       << "body{font-family:system-ui,sans-serif;margin:1.5em auto;"
          "max-width:1200px;padding:0 16px;color:#222;line-height:1.4}\n"
          "h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.8em;"
          "border-bottom:1px solid #ddd;padding-bottom:3px}\n"
          "table{border-collapse:collapse;margin:1em 0;font-size:13px}"
          "td,th{padding:3px 9px;border-bottom:1px solid #ddd;"
          "text-align:right}th{background:#f4f4f4}"
          "td:first-child,th:first-child{text-align:left}td,th{white-space:"
          "nowrap}caption{text-align:left;font-weight:600;padding:4px 0}"
          "details{margin:1em 0}summary{cursor:pointer;color:#1f5fa0}"
          ".bad{color:#d62728}\n"
          "figure{margin:1.2em 0}figure svg{width:100%;height:auto;"
          "display:block}figcaption{font-size:13px;color:#555;margin-top:"
          "2px}\n"
          "ul.slo{font-family:ui-monospace,monospace;font-size:14px}\n"
          ".axis{stroke:#444}.grid{stroke:#e8e8e8}.frame{fill:none;stroke:"
          "#bbb}.mark{stroke:#666;stroke-dasharray:5 4}"
          ".tick{font-size:12px;fill:#444}.label{font-size:13px;fill:#222}"
          ".legend{font-size:13px}.note{font-size:12px;fill:#666}"
          ".marklabel{font-size:12px;fill:#444}"
          ".title{font-size:16px;font-weight:600}"
          ".paneltitle{font-size:13px;font-weight:600}\n"
       << "</style>\n</head>\n<body>\n";
  html << "<h1>" << Escape(title) << "</h1>\n";
  html << "<p>" << trace.requests << " requests for " << trace.models.size()
       << " models (" << Escape(FormatBytes(TotalModelBytes(trace.sizes)))
       << " in all), replayed through modelcache's core cache.";
  if (info.timed) {
    html << " Load path: " << Escape(LoadPathText(info.time)) << ".";
  }
  html << " Offline policies know the future and bound what any online "
          "policy can do.</p>\n";

  if (info.timed && !info.slo_answers.empty()) {
    html << "<h2>Memory for the SLO</h2>\n<p>The smallest capacity whose "
         << Escape(SloText(info.slo, info.slo.slo_ms))
         << ", found by replaying to "
         << Escape(ResolutionText(info.slo.resolution_fraction,
                                  info.slo.resolution_bytes))
         << "; every capacity probed above it met the SLO too.</p>\n"
            "<ul class=\"slo\">\n";
    for (const std::string& line : SloLines(trace, info))
      html << "<li>" << Escape(line) << "</li>\n";
    html << "</ul>\n";
    if (!info.slo.curve_slo_ms.empty()) html << SloChart(c) << SloTable(c);
  }

  if (info.timed) {
    html << "<h2>Waits</h2>\n"
         << PivotTable(c, "p99 wait over the requests served",
                       [](const RunResult& r) {
                         std::string cell = Escape(WaitText(r, r.wait_ms.p99));
                         if (UnservedRequests(r) > 0) {
                           cell += " <b class=\"bad\">" +
                                   Fixed(UnservedPercent(r), 2) +
                                   "% unserved</b>";
                         }
                         if (r.overloaded)
                           cell += " <b class=\"bad\">overloaded</b>";
                         return cell;
                       })
         << "<details>\n<summary>Every run: cold starts, waits, idle memory, "
            "disk</summary>\n<table>\n<tr><th>policy</th><th>capacity</th>"
            "<th>unserved</th><th>cold starts</th><th>p50 wait</th><th>p99 "
            "wait</th>"
            "<th>p99.9 wait</th><th>max wait</th><th>rejected</th>"
            "<th>idle GiB&middot;h</th><th>disk busy</th><th>queue peak</th>"
            "<th>load</th></tr>\n";
    for (const RunResult& r : results) {
      html << HtmlRow(
          {Escape(PolicyLabel(r)), Escape(FormatBytes(r.capacity_bytes)),
           Fixed(UnservedPercent(r), 2) + "%",
           Fixed(100 * r.cold_start_ratio, 2) + "%", WaitText(r, r.wait_ms.p50),
           WaitText(r, r.wait_ms.p99), WaitText(r, r.wait_ms.p999),
           WaitText(r, r.wait_ms.max), std::to_string(r.rejected),
           Fixed(r.idle_gib_hours, 1), Fixed(100 * r.disk_busy_ratio, 1) + "%",
           std::to_string(r.load_queue_peak),
           r.overloaded ? "<b class=\"bad\">overloaded</b>" : "ok"});
    }
    html << "</table>\n</details>\n";
    if (!results.empty()) html << WaitCharts(c);
  }

  if (drain_values.size() > 1) {
    html << "<h2>drain_after</h2>\n<p>Each value of drain_after replayed "
            "(the other sections draw drain_after "
         << Escape(drain_values.front()) << "). A shorter drain_after bounds "
         << "the wait for room sooner, at the price of more swaps.</p>\n"
         << DrainCharts(all_results, drain_values);
  }

  if (!results.empty()) {
    html << "<h2>Over trace time at " << Escape(FormatBytes(c.middle))
         << "</h2>\n"
         << TimeSeries(c);
  }

  html << "<h2>Hits and bytes loaded</h2>\n"
       << PivotTable(c,
                     "Bytes loaded (every load, the first of each model "
                     "included)",
                     [](const RunResult& r) {
                       return Escape(FormatBytes(r.bytes_loaded));
                     })
       << "<details>\n<summary>Every run: hits, bytes, evictions, replay "
          "speed</summary>\n<table>\n<tr><th>policy</th>"
          "<th>capacity</th><th>hit ratio</th><th>bytes loaded</th>"
          "<th>byte miss ratio</th><th>evictions</th><th>too large</th>"
          "<th>requests/s</th></tr>\n";
  for (const RunResult& r : results) {
    html << HtmlRow(
        {Escape(PolicyLabel(r)), Escape(FormatBytes(r.capacity_bytes)),
         Fixed(100 * r.hit_ratio, 2) + "%", Escape(FormatBytes(r.bytes_loaded)),
         Fixed(100 * r.byte_miss_ratio, 2) + "%", std::to_string(r.evictions),
         std::to_string(r.too_large),
         Fixed(r.requests_per_second / 1e6, 2) + " M"});
  }
  html << "</table>\n</details>\n";
  if (!results.empty()) {
    uint64_t most_loaded = 0;
    double hit_lo = 100, hit_hi = 0;
    for (const RunResult& r : results) {
      most_loaded = std::max(most_loaded, r.bytes_loaded);
      hit_lo = std::min(hit_lo, 100 * r.hit_ratio);
      hit_hi = std::max(hit_hi, 100 * r.hit_ratio);
    }
    const bool in_tib = most_loaded >= (uint64_t{1} << 40);
    const double unit = in_tib ? kGiB * 1024 : kGiB;
    Chart hit("hit-ratio", "Hit ratio by capacity", "capacity",
              "hit ratio (%)");
    Chart loaded("bytes-loaded", "Bytes loaded by capacity", "capacity",
                 in_tib ? "TiB loaded" : "GiB loaded");
    loaded.caption = "Every load, the first of each model included.";
    for (const std::string& policy : c.policies) {
      Series h{policy, "", {}}, l{policy, "", {}};
      std::vector<const RunResult*> runs;
      for (const RunResult& r : results) {
        if (PolicyLabel(r) == policy) runs.push_back(&r);
      }
      std::sort(runs.begin(), runs.end(),
                [](const RunResult* a, const RunResult* b) {
                  return a->capacity_bytes < b->capacity_bytes;
                });
      for (const RunResult* r : runs) {
        h.color = l.color = c.Color(*r);
        const double x = static_cast<double>(r->capacity_bytes) / kGiB;
        const bool flagged = r->overloaded || UnservedRequests(*r) > 0;
        h.points.emplace_back(x, 100 * r->hit_ratio);
        l.points.emplace_back(x, static_cast<double>(r->bytes_loaded) / unit);
        h.flagged.push_back(flagged);
        l.flagged.push_back(flagged);
      }
      hit.series.push_back(std::move(h));
      loaded.series.push_back(std::move(l));
    }
    hit.x = loaded.x =
        LinearAxis(static_cast<double>(c.capacities.front()) / kGiB,
                   static_cast<double>(c.capacities.back()) / kGiB, GibLabel);
    hit.y = LinearAxis(hit_lo, std::min(hit_hi, 100.0),
                       [](double y) { return Fixed(y, 0) + "%"; });
    hit.y.hi = std::min(hit.y.hi, 100.0);
    loaded.y = LinearAxis(0, static_cast<double>(most_loaded) / unit,
                          [](double y) { return Fixed(y, 0); });
    html << RenderChart(hit) << RenderChart(loaded);
  }

  // The most reloaded models at the middle capacity, ranked by the first
  // policy's bytes.
  std::vector<const RunResult*> at_middle;
  for (const RunResult& r : results) {
    if (r.capacity_bytes == c.middle) at_middle.push_back(&r);
  }
  if (!at_middle.empty()) {
    std::vector<uint32_t> reloaded(trace.models.size());
    std::iota(reloaded.begin(), reloaded.end(), 0);
    const RunResult* first = at_middle.front();
    std::sort(reloaded.begin(), reloaded.end(), [&](uint32_t a, uint32_t b) {
      const double ba = static_cast<double>(first->loads_per_model[a]) *
                        static_cast<double>(trace.sizes[a]);
      const double bb = static_cast<double>(first->loads_per_model[b]) *
                        static_cast<double>(trace.sizes[b]);
      return ba != bb ? ba > bb : a < b;
    });
    if (reloaded.size() > 12) reloaded.resize(12);
    html << "<h2>Most reloaded models at " << Escape(FormatBytes(c.middle))
         << "</h2>\n"
         << "<table class=\"pivot\">\n<caption>Loads of each model, the 12 "
            "that cost "
         << Escape(PolicyLabel(*first)) << " the most bytes</caption>\n"
         << "<tr><th>model</th><th>size</th>";
    for (const RunResult* r : at_middle) {
      html << "<th>" << Escape(PolicyLabel(*r)) << "</th>";
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

std::string HtmlReport(const Trace& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info) {
  return HtmlReport(HeaderOf(trace), title, results, info);
}

}  // namespace modelcache::replay
