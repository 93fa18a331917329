// Rendering replay results: a text table, JSON, and a self-contained HTML
// report with inline SVG charts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

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

// The share of all requests a run did not serve, in percent (0 for none).
double UnservedPercent(const RunResult& r) {
  return r.requests ? 100 * static_cast<double>(UnservedRequests(r)) /
                          static_cast<double>(r.requests)
                    : 0;
}

// "  UNSERVED", "  OVERLOADED", both or nothing: what a row must not be
// read without.
std::string RowFlags(const RunResult& r) {
  std::string flags;
  if (UnservedRequests(r) > 0) flags += "  UNSERVED";
  if (r.overloaded) flags += "  OVERLOADED";
  return flags;
}

// A wait of the run's, or "-" when it served no request (there is no wait
// to show, and 0 would read as none waited).
std::string WaitText(const RunResult& r, double ms) {
  return UnservedRequests(r) >= r.requests ? "-" : FormatMs(ms);
}

std::string PolicyLabel(const RunResult& r) {
  return r.offline ? r.policy + " (offline)" : r.policy;
}

// ---- charts: inline SVG sized by a viewBox, so they take the page's width

constexpr double kGiB = 1073741824.0;
constexpr double kChartWidth = 1100;

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                               "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

// A policy's colour is fixed by its place in the table, in every chart.
std::string ColorOf(size_t policy_index) {
  return kColors[policy_index % std::size(kColors)];
}

struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  std::function<std::string(double)> label;
};

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;
  // Optional, one per point: a band drawn from low to high behind the line.
  std::vector<double> low, high;
  // Optional, one per point: the run it stands for was overloaded or left
  // requests unserved; the point is ringed in red.
  std::vector<bool> flagged;
};

// Series whose points are exactly those of an earlier one: the earlier
// (the first in the table's order, the baseline when it is one of them)
// stays solid, and each copy is drawn dashed over it, offset so that every
// member of the group shows along the line. Per series: its group's size
// and its place in the group (0 for the solid one).
struct Coincidence {
  size_t group_size = 1, place = 0;
  size_t leader = 0;  // the series it coincides with
};

std::vector<Coincidence> Coincidences(const std::vector<Series>& series) {
  std::vector<Coincidence> out(series.size());
  for (size_t i = 0; i < series.size(); ++i) {
    out[i].leader = i;
    for (size_t j = 0; j < i; ++j) {
      if (out[j].place == 0 && !series[i].points.empty() &&
          series[j].points == series[i].points &&
          series[j].low == series[i].low && series[j].high == series[i].high) {
        out[i].leader = j;
        out[i].place = out[j].group_size++;
        break;
      }
    }
  }
  for (Coincidence& c : out) c.group_size = out[c.leader].group_size;
  return out;
}

// The dash of a coinciding copy: 8 units of each 8 x group_size, its own.
std::string DashOf(const Coincidence& c) {
  if (c.place == 0) return "";
  const double dash = 8, period = dash * static_cast<double>(c.group_size);
  return " stroke-dasharray=\"" + std::to_string(static_cast<int>(dash)) + " " +
         std::to_string(static_cast<int>(period - dash)) +
         "\" stroke-dashoffset=\"" +
         std::to_string(
             -static_cast<int>(dash * static_cast<double>(c.place))) +
         "\"";
}

// A labelled reference line across the plot.
struct Mark {
  double at;
  std::string label;
};

struct Chart {
  std::string id, title, caption, x_label, y_label;
  Axis x, y;
  std::vector<Series> series;  // in the table's order: the legend's
  std::vector<Mark> x_marks, y_marks;
  std::vector<std::string> legend_notes;  // below the series' entries
};

std::string Num(double v) { return Fixed(v, 1); }

double Clamp(double v, const Axis& a) { return std::clamp(v, a.lo, a.hi); }

// "100 ms", "2 s", "1 min", "2 h": tick labels for durations.
std::string ShortMs(double ms) {
  char buf[32];
  if (ms < 1000) {
    std::snprintf(buf, sizeof(buf), "%g ms", ms);
  } else if (ms < 60000) {
    std::snprintf(buf, sizeof(buf), "%g s", ms / 1000);
  } else if (ms < 3600000) {
    std::snprintf(buf, sizeof(buf), "%g min", ms / 60000);
  } else {
    std::snprintf(buf, sizeof(buf), "%g h", ms / 3600000);
  }
  return buf;
}

// Ticks on a log10 axis of durations: values people read (1-2-5 steps, then
// minutes and hours) from the first at or below `lo_ms` to the first at or
// above `hi_ms`; the axis spans them. Fewer, powers of ten and whole
// minutes and hours, when that would be more than nine.
Axis DurationAxis(double lo_ms, double hi_ms) {
  static const double kFine[] = {
      1,   2,     5,     10,    20,    50,     100,    200,   500,
      1e3, 2e3,   5e3,   1e4,   2e4,   3e4,    6e4,    1.2e5, 3e5,
      6e5, 1.2e6, 1.8e6, 3.6e6, 7.2e6, 1.44e7, 2.88e7, 8.64e7};
  static const double kCoarse[] = {1,   10,  100,   1e3,   1e4,
                                   6e4, 6e5, 3.6e6, 3.6e7, 8.64e7};
  auto pick = [&](const auto& list) {
    std::vector<double> ticks;
    const double* first = std::begin(list);
    const double* last = std::end(list) - 1;
    const double* a = first;
    while (a < last && *(a + 1) <= lo_ms) ++a;
    const double* b = a;
    while (b < last && *b < hi_ms) ++b;
    for (const double* t = a; t <= b; ++t) ticks.push_back(std::log10(*t));
    return ticks;
  };
  Axis axis;
  axis.ticks = pick(kFine);
  if (axis.ticks.size() > 9) axis.ticks = pick(kCoarse);
  if (axis.ticks.size() < 2) axis.ticks.push_back(axis.ticks.back() + 1);
  axis.lo = axis.ticks.front();
  axis.hi = axis.ticks.back();
  axis.label = [](double e) { return ShortMs(std::pow(10.0, e)); };
  return axis;
}

// A linear axis from `lo` (or 0) up to a round number at or above `hi`, with
// about five ticks at 1, 2, 2.5 or 5 times a power of ten.
Axis LinearAxis(double lo, double hi,
                std::function<std::string(double)> label) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / 5;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  double step = power;
  for (double f : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    step = f * power;
    if (step >= raw) break;
  }
  Axis axis;
  axis.lo = std::floor(lo / step) * step;
  axis.hi = std::ceil(hi / step - 1e-9) * step;
  for (double t = axis.lo; t <= axis.hi + step / 2; t += step)
    axis.ticks.push_back(t);
  axis.label = std::move(label);
  return axis;
}

std::string GibLabel(double gib) {
  return Fixed(gib, gib < 10 && gib != std::floor(gib) ? 1 : 0) + " GiB";
}

std::string PointsOf(const std::vector<std::pair<double, double>>& points,
                     const std::function<double(double)>& px,
                     const std::function<double(double)>& py) {
  std::ostringstream out;
  for (auto [x, y] : points) out << Num(px(x)) << "," << Num(py(y)) << " ";
  return out.str();
}

// The series of one plot area: bands first, then lines, then markers.
void DrawSeries(std::ostringstream& svg, const std::vector<Series>& series,
                const std::function<double(double)>& px,
                const std::function<double(double)>& py) {
  for (const Series& s : series) {
    if (s.low.empty()) continue;
    std::vector<std::pair<double, double>> outline;
    for (size_t k = 0; k < s.points.size(); ++k)
      outline.emplace_back(s.points[k].first, s.high[k]);
    for (size_t k = s.points.size(); k-- > 0;)
      outline.emplace_back(s.points[k].first, s.low[k]);
    svg << "<polygon class=\"band\" data-series=\"" << Escape(s.name)
        << "\" fill=\"" << s.color
        << "\" fill-opacity=\"0.25\" stroke=\"none\" points=\""
        << PointsOf(outline, px, py) << "\"/>\n";
  }
  const std::vector<Coincidence> same = Coincidences(series);
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    svg << "<polyline class=\"series\" data-series=\"" << Escape(s.name)
        << "\" fill=\"none\" stroke=\"" << s.color
        << "\" stroke-width=\"2\" stroke-linejoin=\"round\"" << DashOf(same[i])
        << " points=\"" << PointsOf(s.points, px, py) << "\"/>\n";
    // A copy's markers would hide the solid line's.
    if (s.points.size() <= 24 && same[i].place == 0) {
      for (auto [x, y] : s.points) {
        svg << "<circle cx=\"" << Num(px(x)) << "\" cy=\"" << Num(py(y))
            << "\" r=\"3.5\" fill=\"" << s.color << "\"/>\n";
      }
    }
  }
  // The first series (the baseline, lru, when the table starts with it)
  // again over every other, so that a curve running close to it never hides
  // it; then its dashed copies again, over it.
  if (series.size() > 1) {
    for (size_t i = 0; i < series.size(); ++i) {
      if (same[i].leader != 0) continue;
      svg << "<polyline class=\"overlay\" data-series=\""
          << Escape(series[i].name) << "\" fill=\"none\" stroke=\""
          << series[i].color
          << "\" stroke-width=\"2\" stroke-linejoin=\"round\""
          << DashOf(same[i]) << " points=\""
          << PointsOf(series[i].points, px, py) << "\"/>\n";
    }
  }
  // Runs that were overloaded or left requests unserved: ringed, over
  // every line.
  for (const Series& s : series) {
    for (size_t k = 0; k < s.flagged.size() && k < s.points.size(); ++k) {
      if (!s.flagged[k]) continue;
      svg << "<circle class=\"flagged\" data-series=\"" << Escape(s.name)
          << "\" cx=\"" << Num(px(s.points[k].first)) << "\" cy=\""
          << Num(py(s.points[k].second))
          << "\" r=\"7\" fill=\"none\" stroke=\"#d62728\" "
             "stroke-width=\"2\"/>\n";
    }
  }
}

// The legend's notes for coinciding series ("ttl-10m = lru (dashed)") and
// ringed points.
std::vector<std::string> SeriesNotes(const std::vector<Series>& series) {
  std::vector<std::string> notes;
  const std::vector<Coincidence> same = Coincidences(series);
  for (size_t i = 0; i < series.size(); ++i) {
    if (same[i].place != 0 || same[i].group_size < 2) continue;
    // One short line each: the legend is 210 units wide.
    for (size_t j = i + 1; j < series.size(); ++j) {
      if (same[j].leader == i && same[j].place != 0)
        notes.push_back(series[j].name + " = " + series[i].name + " (dashed)");
    }
  }
  for (const Series& s : series) {
    if (std::find(s.flagged.begin(), s.flagged.end(), true) !=
        s.flagged.end()) {
      notes.push_back("ringed: overloaded/unserved");
      break;
    }
  }
  return notes;
}

void OpenFigure(std::ostringstream& out, const std::string& id,
                const std::string& title, double height) {
  out << "<figure class=\"chart\" id=\"chart-" << id << "\" data-chart=\"" << id
      << "\">\n<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 "
      << kChartWidth << " " << height << "\" role=\"img\" aria-label=\""
      << Escape(title) << "\">\n<text x=\"0\" y=\"20\" class=\"title\">"
      << Escape(title) << "</text>\n";
}

void CloseFigure(std::ostringstream& out, const std::string& caption) {
  out << "</svg>\n";
  if (!caption.empty())
    out << "<figcaption>" << Escape(caption) << "</figcaption>\n";
  out << "</figure>\n";
}

// One plot with its legend on the right.
std::string RenderChart(const Chart& c) {
  const double height = 400, left = 78, right = 210, top = 40, bottom = 56;
  const double plot_w = kChartWidth - left - right;
  const double plot_h = height - top - bottom;
  auto px = [&](double x) {
    return left + (Clamp(x, c.x) - c.x.lo) / (c.x.hi - c.x.lo) * plot_w;
  };
  auto py = [&](double y) {
    return top + plot_h - (Clamp(y, c.y) - c.y.lo) / (c.y.hi - c.y.lo) * plot_h;
  };
  std::ostringstream svg;
  OpenFigure(svg, c.id, c.title, height);
  for (double y : c.y.ticks) {
    svg << "<line x1=\"" << left << "\" y1=\"" << Num(py(y)) << "\" x2=\""
        << left + plot_w << "\" y2=\"" << Num(py(y)) << "\" class=\"grid\"/>\n"
        << "<text x=\"" << left - 6 << "\" y=\"" << Num(py(y) + 4)
        << "\" class=\"tick\" text-anchor=\"end\">" << Escape(c.y.label(y))
        << "</text>\n";
  }
  for (double x : c.x.ticks) {
    svg << "<line x1=\"" << Num(px(x)) << "\" y1=\"" << top << "\" x2=\""
        << Num(px(x)) << "\" y2=\"" << top + plot_h << "\" class=\"grid\"/>\n"
        << "<text x=\"" << Num(px(x)) << "\" y=\"" << top + plot_h + 18
        << "\" class=\"tick\" text-anchor=\"middle\">" << Escape(c.x.label(x))
        << "</text>\n";
  }
  svg << "<line x1=\"" << left << "\" y1=\"" << top + plot_h << "\" x2=\""
      << left + plot_w << "\" y2=\"" << top + plot_h << "\" class=\"axis\"/>\n"
      << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left
      << "\" y2=\"" << top + plot_h << "\" class=\"axis\"/>\n";
  for (const Mark& m : c.y_marks) {
    // Labelled at the left, where the curves of these charts (waits that
    // fall with capacity or time) run above the line.
    svg << "<line x1=\"" << left << "\" y1=\"" << Num(py(m.at)) << "\" x2=\""
        << left + plot_w << "\" y2=\"" << Num(py(m.at))
        << "\" class=\"mark\"/>\n<text x=\"" << left + 6 << "\" y=\""
        << Num(py(m.at) - 4) << "\" class=\"marklabel\">" << Escape(m.label)
        << "</text>\n";
  }
  for (const Mark& m : c.x_marks) {
    svg << "<line x1=\"" << Num(px(m.at)) << "\" y1=\"" << top << "\" x2=\""
        << Num(px(m.at)) << "\" y2=\"" << top + plot_h
        << "\" class=\"mark\"/>\n<text x=\"" << Num(px(m.at) + 4) << "\" y=\""
        << top + 12 << "\" class=\"marklabel\">" << Escape(m.label)
        << "</text>\n";
  }
  DrawSeries(svg, c.series, px, py);
  svg << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 10
      << "\" class=\"label\" text-anchor=\"middle\">" << Escape(c.x_label)
      << "</text>\n<text x=\"16\" y=\"" << top + plot_h / 2
      << "\" class=\"label\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
      << top + plot_h / 2 << ")\">" << Escape(c.y_label) << "</text>\n";
  double ly = top + 10;
  const std::vector<Coincidence> same = Coincidences(c.series);
  for (size_t i = 0; i < c.series.size(); ++i) {
    const Series& s = c.series[i];
    svg << "<line x1=\"" << left + plot_w + 16 << "\" y1=\"" << ly - 4
        << "\" x2=\"" << left + plot_w + 38 << "\" y2=\"" << ly - 4
        << "\" stroke=\"" << s.color << "\" stroke-width=\"3\""
        << (same[i].place ? " stroke-dasharray=\"4 3\"" : "")
        << "/>\n<text x=\"" << left + plot_w + 44 << "\" y=\"" << ly
        << "\" class=\"legend\">" << Escape(s.name) << "</text>\n";
    ly += 20;
  }
  std::vector<std::string> notes = c.legend_notes;
  for (const std::string& note : SeriesNotes(c.series)) notes.push_back(note);
  for (const std::string& note : notes) {
    svg << "<text x=\"" << left + plot_w + 16 << "\" y=\"" << ly
        << "\" class=\"note\">" << Escape(note) << "</text>\n";
    ly += 18;
  }
  CloseFigure(svg, c.caption);
  return svg.str();
}

// Small multiples: one panel per series, all on the same axes, four to a
// row; each panel is titled with its series' name.
struct Panels {
  std::string id, title, caption, x_label;
  Axis x, y;
  std::vector<Series> panels;
  std::vector<Mark> y_marks;
};

std::string RenderPanels(const Panels& p) {
  const size_t n = std::max<size_t>(p.panels.size(), 1);
  const size_t columns = std::min<size_t>(n, 4);
  const size_t rows = (n + columns - 1) / columns;
  const double top = 34, bottom = 28, cell_h = 178, gutter = 36;
  const double cell_w = kChartWidth / static_cast<double>(columns);
  const double height = top + static_cast<double>(rows) * cell_h + bottom;
  // Within a cell: room for the y ticks on the left, the panel's title
  // above, the x ticks below.
  const double in_left = 58, in_top = 24, in_bottom = 38;
  const double plot_w = cell_w - in_left - gutter / 2;
  const double plot_h = cell_h - in_top - in_bottom;
  std::ostringstream svg;
  OpenFigure(svg, p.id, p.title, height);
  for (size_t i = 0; i < p.panels.size(); ++i) {
    const Series& s = p.panels[i];
    const double x0 = static_cast<double>(i % columns) * cell_w + in_left;
    const double y0 = top + static_cast<double>(i / columns) * cell_h + in_top;
    auto px = [&](double x) {
      return x0 + (Clamp(x, p.x) - p.x.lo) / (p.x.hi - p.x.lo) * plot_w;
    };
    auto py = [&](double y) {
      return y0 + plot_h -
             (Clamp(y, p.y) - p.y.lo) / (p.y.hi - p.y.lo) * plot_h;
    };
    svg << "<g class=\"panel\" data-series=\"" << Escape(s.name) << "\">\n"
        << "<text x=\"" << x0 << "\" y=\"" << y0 - 8
        << "\" class=\"paneltitle\" fill=\"" << s.color << "\">"
        << Escape(s.name) << "</text>\n";
    for (double y : p.y.ticks) {
      svg << "<line x1=\"" << x0 << "\" y1=\"" << Num(py(y)) << "\" x2=\""
          << Num(x0 + plot_w) << "\" y2=\"" << Num(py(y))
          << "\" class=\"grid\"/>\n<text x=\"" << x0 - 5 << "\" y=\""
          << Num(py(y) + 4) << "\" class=\"tick\" text-anchor=\"end\">"
          << Escape(p.y.label(y)) << "</text>\n";
    }
    // The x axis is shared: its labels go under the lowest panel of each
    // column only.
    for (double x :
         i + columns >= p.panels.size() ? p.x.ticks : std::vector<double>{}) {
      svg << "<text x=\"" << Num(px(x)) << "\" y=\"" << Num(y0 + plot_h + 15)
          << "\" class=\"tick\" text-anchor=\"middle\">" << Escape(p.x.label(x))
          << "</text>\n";
    }
    for (const Mark& m : p.y_marks) {
      svg << "<line x1=\"" << x0 << "\" y1=\"" << Num(py(m.at)) << "\" x2=\""
          << Num(x0 + plot_w) << "\" y2=\"" << Num(py(m.at))
          << "\" class=\"mark\"/>\n";
    }
    svg << "<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << Num(plot_w)
        << "\" height=\"" << Num(plot_h) << "\" class=\"frame\"/>\n";
    DrawSeries(svg, {s}, px, py);
    svg << "</g>\n";
  }
  svg << "<text x=\"" << kChartWidth / 2 << "\" y=\"" << height - 6
      << "\" class=\"label\" text-anchor=\"middle\">" << Escape(p.x_label)
      << "</text>\n";
  CloseFigure(svg, p.caption);
  return svg.str();
}

// ---- what the report draws

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

// ---- the SLO's answers in words

// Binary units to three significant digits, rounded up: a capacity printed
// is never less than the one found. "52.3 GiB", "130 GiB", "1.25 GiB".
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

// "p99 wait ≤ 1.00s".
std::string SloText(const SloSearchOptions& slo, double ms) {
  return PercentileName(slo.percentile) + " wait \u2264 " + FormatMs(ms);
}

// One line per policy: "next-use: 52.3 GiB for p99 wait ≤ 1.00s (lru
// needs 61.0 GiB, 17% more)", compared with lru's answer (or the first policy's
// when lru was not searched).
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
      line += "none up to " + CapacityText(TotalModelBytes(trace)) + what;
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
        << " loads, " << FormatMs(info.time.latency_ms) << " latency each\n"
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
      "%-20s %10s %8s %7s %8s %8s %8s %8s %8s %9s %11s %7s %6s %7s %9s\n",
      "policy", "capacity", "unserved", "cold%", "p50", "p99", "p99.9",
      "max_wait", "rejected", "idle_GiBh", "loaded", "busy%", "queue",
      "p75cold", "req/s");
  out << line;
  for (const RunResult& r : results) {
    std::snprintf(
        line, sizeof(line),
        "%-20s %10s %7.2f%% %7.2f %8s %8s %8s %8s %8llu %9.1f %11s %7.1f %6llu "
        "%7.3f %9.3g%s\n",
        PolicyLabel(r).c_str(), FormatBytes(r.capacity_bytes).c_str(),
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
  if (info.slo_answers.empty()) {
    doc["slo"] = nullptr;
  } else {
    nlohmann::json answers = nlohmann::json::array();
    for (const SloAnswer& a : info.slo_answers) {
      nlohmann::json probes = nlohmann::json::array();
      for (const SloProbe& p : a.probes) {
        probes.push_back({{"capacity_bytes", p.capacity_bytes},
                          {"wait_ms", p.wait_ms},
                          {"served_all", p.served_all}});
      }
      nlohmann::json curve = nlohmann::json::array();
      for (size_t i = 0; i < a.curve.size(); ++i) {
        curve.push_back(
            {{"slo_ms", info.slo.curve_slo_ms[i]},
             {"capacity_bytes", a.curve[i] ? nlohmann::json(*a.curve[i])
                                           : nlohmann::json(nullptr)}});
      }
      answers.push_back({{"policy", a.policy},
                         {"capacity_bytes",
                          a.capacity_bytes ? nlohmann::json(*a.capacity_bytes)
                                           : nlohmann::json(nullptr)},
                         {"failing_bytes", a.failing_bytes},
                         {"monotone", a.monotone},
                         {"probes", probes},
                         {"curve", curve}});
    }
    doc["slo"] = {{"ms", info.slo.slo_ms},
                  {"percentile", info.slo.percentile},
                  {"resolution",
                   {{"fraction", info.slo.resolution_fraction},
                    {"bytes", info.slo.resolution_bytes}}},
                  {"answers", answers}};
  }
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
         {"unserved", UnservedRequests(r)},
         {"unserved_ratio", r.requests
                                ? static_cast<double>(UnservedRequests(r)) /
                                      static_cast<double>(r.requests)
                                : 0.0},
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

namespace {

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
  Chart chart;
  chart.id = "slo-capacity";
  chart.title = "Memory needed against the SLO";
  chart.x_label = PercentileName(slo.percentile) + " wait SLO (log scale)";
  chart.y_label = "capacity needed (GiB)";
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
  Chart tail;
  tail.id = "wait-tail";
  tail.title = "Requests waiting longer than t, at " + FormatBytes(c.middle);
  tail.x_label = "wait t (log scale)";
  tail.y_label = "requests waiting longer than t (log scale)";
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

  Chart by_capacity, by_idle;
  by_capacity.id = "p99-capacity";
  by_capacity.title = "p99 wait by capacity";
  by_capacity.x_label = "capacity";
  by_capacity.y_label = "p99 wait (log scale)";
  by_idle.id = "p99-idle";
  by_idle.title = "p99 wait against idle memory-time";
  by_idle.x_label = "idle GiB\u00b7h (memory resident with no lease)";
  by_idle.y_label = "p99 wait (log scale)";
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
  Panels queue, resident;
  queue.id = "load-queue";
  queue.title = "Loads queued (the most in each bin)";
  queue.x_label = "trace time (hours)";
  resident.id = "resident";
  resident.title = "Resident GiB (band: least to most in each bin; line: mean)";
  resident.x_label = "trace time (hours)";
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

}  // namespace

std::string HtmlReport(const TraceHeader& trace, const std::string& title,
                       const std::vector<RunResult>& results,
                       const RunInfo& info) {
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
       << " models (" << Escape(FormatBytes(TotalModelBytes(trace)))
       << " in all), replayed through modelcache's core cache.";
  if (info.timed) {
    html << " Load path: "
         << Fixed(info.time.bandwidth_bytes_per_second / 1e9, 2)
         << " GB/s shared by at most "
         << (info.time.slots ? std::to_string(info.time.slots) : "unlimited")
         << " loads, " << Escape(FormatMs(info.time.latency_ms))
         << " latency each.";
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
      html << "<tr><td>" << Escape(PolicyLabel(r)) << "</td><td>"
           << Escape(FormatBytes(r.capacity_bytes)) << "</td><td>"
           << Fixed(UnservedPercent(r), 2) << "%</td><td>"
           << Fixed(100 * r.cold_start_ratio, 2) << "%</td><td>"
           << WaitText(r, r.wait_ms.p50) << "</td><td>"
           << WaitText(r, r.wait_ms.p99) << "</td><td>"
           << WaitText(r, r.wait_ms.p999) << "</td><td>"
           << WaitText(r, r.wait_ms.max) << "</td><td>" << r.rejected
           << "</td><td>" << Fixed(r.idle_gib_hours, 1) << "</td><td>"
           << Fixed(100 * r.disk_busy_ratio, 1) << "%</td><td>"
           << r.load_queue_peak << "</td><td>"
           << (r.overloaded ? "<b class=\"bad\">overloaded</b>" : "ok")
           << "</td></tr>\n";
    }
    html << "</table>\n</details>\n";
    if (!results.empty()) html << WaitCharts(c);
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
    html << "<tr><td>" << Escape(PolicyLabel(r)) << "</td><td>"
         << Escape(FormatBytes(r.capacity_bytes)) << "</td><td>"
         << Fixed(100 * r.hit_ratio, 2) << "%</td><td>"
         << Escape(FormatBytes(r.bytes_loaded)) << "</td><td>"
         << Fixed(100 * r.byte_miss_ratio, 2) << "%</td><td>" << r.evictions
         << "</td><td>" << r.too_large << "</td><td>"
         << Fixed(r.requests_per_second / 1e6, 2) << " M</td></tr>\n";
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
    Chart hit, loaded;
    hit.id = "hit-ratio";
    hit.title = "Hit ratio by capacity";
    hit.x_label = "capacity";
    hit.y_label = "hit ratio (%)";
    loaded.id = "bytes-loaded";
    loaded.title = "Bytes loaded by capacity";
    loaded.x_label = "capacity";
    loaded.y_label = in_tib ? "TiB loaded" : "GiB loaded";
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
