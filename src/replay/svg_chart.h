// The reports' chart kit: inline SVG sized by a viewBox alone, so that a
// chart takes the page's width. Line charts with a legend on the right
// (RenderChart), small multiples on shared axes (RenderPanels), and grouped
// bars (BarChart); axes on round ticks, linear or log10 of durations.
//
// A chart is plain data (Chart, Panels, BarSeries) rendered by one function
// into a string; nothing here knows what a replay is.
#ifndef MODELCACHE_SRC_REPLAY_SVG_CHART_H_
#define MODELCACHE_SRC_REPLAY_SVG_CHART_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace modelcache::replay {

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

// A labelled reference line across the plot.
struct Mark {
  double at;
  std::string label;
};

// One plot with its legend on the right. Series whose points are exactly
// those of an earlier one are drawn dashed over it, so that both show, and
// the legend says so.
struct Chart {
  // `id` names the figure in the page (id="chart-<id>", data-chart).
  Chart(std::string id, std::string title, std::string x_label,
        std::string y_label)
      : id(std::move(id)),
        title(std::move(title)),
        x_label(std::move(x_label)),
        y_label(std::move(y_label)) {}

  std::string id, title, caption, x_label, y_label;
  Axis x, y;
  std::vector<Series> series;  // in the table's order: the legend's
  std::vector<Mark> x_marks, y_marks;
  std::vector<std::string> legend_notes;  // below the series' entries
};

// A <figure> holding the chart's SVG and its caption.
std::string RenderChart(const Chart& c);

// Small multiples: one panel per series, all on the same axes, four to a
// row; each panel is titled with its series' name.
struct Panels {
  Panels(std::string id, std::string title, std::string x_label)
      : id(std::move(id)),
        title(std::move(title)),
        x_label(std::move(x_label)) {}

  std::string id, title, caption, x_label;
  Axis x, y;
  std::vector<Series> panels;
  std::vector<Mark> y_marks;
};

std::string RenderPanels(const Panels& p);

// "100 ms", "2 s", "1 min", "2 h": tick labels for durations.
std::string ShortMs(double ms);

// Ticks on a log10 axis of durations: values people read (1-2-5 steps, then
// minutes and hours) from the first at or below `lo_ms` to the first at or
// above `hi_ms`; the axis spans them. Fewer, powers of ten and whole
// minutes and hours, when that would be more than nine.
Axis DurationAxis(double lo_ms, double hi_ms);

// A linear axis from `lo` (or 0) up to a round number at or above `hi`, with
// about five ticks at 1, 2, 2.5 or 5 times a power of ten.
Axis LinearAxis(double lo, double hi, std::function<std::string(double)> label);

// "2 GiB", "2.5 GiB", "16 GiB": tick labels for capacities in GiB.
std::string GibLabel(double gib);

// Grouped bars: one bar per series in each group.
struct BarSeries {
  std::string name;
  std::vector<double> values;  // one per group
};

// Groups along x, one bar per series in each group, coloured by the series'
// place, with a legend on the right. The y axis starts at 0 and ends on a
// round tick labelled by `y_tick`; group labels too long for their group
// are slanted so that they never run into each other. A bare <svg>.
std::string BarChart(const std::string& title, const std::string& y_label,
                     const std::vector<std::string>& groups,
                     const std::vector<BarSeries>& series,
                     const std::function<std::string(double)>& y_tick);

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_SVG_CHART_H_
