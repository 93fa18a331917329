// The reports' chart kit (svg_chart.h).
#include "svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <sstream>

#include "report_format.h"

namespace modelcache::replay {
namespace {

constexpr double kChartWidth = 1100;

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

std::string Num(double v) { return Fixed(v, 1); }

double Clamp(double v, const Axis& a) { return std::clamp(v, a.lo, a.hi); }

// A round step for about five ticks over `span`: 1, 2, 2.5 or 5 times a
// power of ten (of the unit the values are in).
double RoundStep(double span) {
  const double raw = span / 5;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double f : {1.0, 2.0, 2.5, 5.0}) {
    if (f * power >= raw) return f * power;
  }
  return 10 * power;
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

}  // namespace

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

Axis LinearAxis(double lo, double hi,
                std::function<std::string(double)> label) {
  if (!(hi > lo)) hi = lo + 1;
  const double step = RoundStep(hi - lo);
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

std::string BarChart(const std::string& title, const std::string& y_label,
                     const std::vector<std::string>& groups,
                     const std::vector<BarSeries>& series,
                     const std::function<std::string(double)>& y_tick) {
  const double width = 1080, height = 340, left = 80, right = 200, top = 36,
               bottom = 80;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  double most = 0;
  for (const BarSeries& s : series) {
    for (const double v : s.values) most = std::max(most, v);
  }
  if (most <= 0) most = 1;
  const double step = RoundStep(most);
  const int ticks = static_cast<int>(std::ceil(most / step - 1e-9));
  const double hi = step * ticks;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 " << width
      << " " << height << "\">\n";
  svg << "<text x=\"" << left << "\" y=\"22\" class=\"title\">" << Escape(title)
      << "</text>\n";
  for (int i = 0; i <= ticks; ++i) {
    const double v = step * i;
    const double y = top + plot_h - plot_h * i / ticks;
    svg << "<line x1=\"" << left << "\" y1=\"" << y << "\" x2=\""
        << left + plot_w << "\" y2=\"" << y << "\" class=\"grid\"/>\n";
    svg << "<text x=\"" << left - 6 << "\" y=\"" << y + 4
        << "\" text-anchor=\"end\" class=\"tick\">" << Escape(y_tick(v))
        << "</text>\n";
  }
  const double group_w =
      plot_w / static_cast<double>(std::max<size_t>(groups.size(), 1));
  const double bar_w =
      group_w * 0.8 / static_cast<double>(std::max<size_t>(series.size(), 1));
  // 11 px labels: about 6.5 px a character.
  size_t longest = 0;
  for (const std::string& g : groups) longest = std::max(longest, g.size());
  const bool slant = static_cast<double>(longest) * 6.5 > group_w * 0.95;
  for (size_t g = 0; g < groups.size(); ++g) {
    const double x0 = left + group_w * static_cast<double>(g) + group_w * 0.1;
    for (size_t s = 0; s < series.size(); ++s) {
      const double v = g < series[s].values.size() ? series[s].values[g] : 0;
      const double h = plot_h * v / hi;
      svg << "<rect x=\"" << x0 + bar_w * static_cast<double>(s) << "\" y=\""
          << top + plot_h - h << "\" width=\"" << bar_w * 0.92 << "\" height=\""
          << h << "\" fill=\"" << ColorOf(s) << "\"><title>"
          << Escape(groups[g] + ", " + series[s].name + ": " + y_tick(v))
          << "</title></rect>\n";
    }
    const double lx = x0 + group_w * 0.4, ly = top + plot_h + 18;
    svg << "<text x=\"" << lx << "\" y=\"" << ly << "\" text-anchor=\""
        << (slant ? "end" : "middle") << "\" class=\"tick\"";
    if (slant) svg << " transform=\"rotate(-30 " << lx << " " << ly << ")\"";
    svg << ">" << Escape(groups[g]) << "</text>\n";
  }
  svg << "<line x1=\"" << left << "\" y1=\"" << top + plot_h << "\" x2=\""
      << left + plot_w << "\" y2=\"" << top + plot_h << "\" class=\"axis\"/>\n";
  svg << "<text transform=\"translate(18," << top + plot_h / 2
      << ") rotate(-90)\" text-anchor=\"middle\" class=\"label\">"
      << Escape(y_label) << "</text>\n";
  for (size_t s = 0; s < series.size(); ++s) {
    const double ly = top + 14 + 18 * static_cast<double>(s);
    svg << "<rect x=\"" << left + plot_w + 16 << "\" y=\"" << ly - 10
        << "\" width=\"12\" height=\"12\" fill=\"" << ColorOf(s)
        << "\"/>\n<text x=\"" << left + plot_w + 34 << "\" y=\"" << ly
        << "\" class=\"legend\">" << Escape(series[s].name) << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace modelcache::replay
