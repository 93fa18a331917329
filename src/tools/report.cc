// Rendering replay results: a text table, JSON, and a self-contained HTML
// report with inline SVG charts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <sstream>

#include "modelcache/tools/replay.h"
#include "nlohmann/json.hpp"

namespace modelcache::replay {
namespace {

uint64_t TotalModelBytes(const Trace& trace) {
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

std::string PolicyLabel(const RunResult& r) {
  return r.offline ? r.policy + " (offline)" : r.policy;
}

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                               "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
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

}  // namespace

std::string ResultsTable(const Trace& trace,
                         const std::vector<RunResult>& results) {
  std::ostringstream out;
  out << "trace: " << trace.requests.size() << " requests, "
      << trace.models.size() << " models, "
      << FormatBytes(TotalModelBytes(trace)) << " of models in all\n\n";
  char line[256];
  std::snprintf(line, sizeof(line),
                "%-20s %11s %9s %9s %9s %9s %7s %12s %10s %11s\n", "policy",
                "capacity", "hits", "misses", "too_large", "evictions", "hit%",
                "loaded", "byte_miss%", "req/s");
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

std::string ResultsJson(const Trace& trace,
                        const std::vector<RunResult>& results) {
  nlohmann::json doc;
  doc["requests"] = trace.requests.size();
  doc["models"] = trace.models.size();
  doc["model_bytes"] = TotalModelBytes(trace);
  doc["results"] = nlohmann::json::array();
  for (const RunResult& r : results) {
    doc["results"].push_back({{"policy", r.policy},
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
                              {"requests_per_second", r.requests_per_second}});
  }
  return doc.dump(2) + "\n";
}

std::string HtmlReport(const Trace& trace, const std::string& title,
                       const std::vector<RunResult>& results) {
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
    for (auto [t, bytes] : r.resident_over_time) {
      const double hours = static_cast<double>(t) / 3.6e6;
      t_max = std::max(t_max, hours);
      s.points.emplace_back(hours, static_cast<double>(bytes) / gib);
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
          "td:first-child,th:first-child{text-align:left}\n"
       << ".axis{stroke:#444}.grid{stroke:#e4e4e4}.tick{font-size:11px;fill:#"
          "444}"
          ".label{font-size:12px;fill:#222}.legend{font-size:12px}"
          ".title{font-size:14px;font-weight:600}\n"
       << "</style>\n</head>\n<body>\n";
  html << "<h1>" << Escape(title) << "</h1>\n";
  html
      << "<p>" << trace.requests.size() << " requests for "
      << trace.models.size() << " models ("
      << Escape(FormatBytes(TotalModelBytes(trace)))
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
  html << LineChart(
      "Hit ratio by capacity", "capacity", "hit ratio (%)", hit_series,
      gib_tick, [](double y) { return Fixed(y, 1) + "%"; }, cap_ticks,
      /*fit_y_to_data=*/true);
  html << LineChart(
      "Bytes loaded by capacity", "capacity", loaded_label, loaded_series,
      gib_tick, [](double y) { return Fixed(y, 0); }, cap_ticks);
  html << LineChart(
      "Resident bytes over trace time at " + FormatBytes(middle),
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

}  // namespace modelcache::replay
