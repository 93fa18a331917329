// The HTML report's structure: the page is parsed (it must be well formed),
// and every chart must be there, with a series for each policy that has
// data, in the table's order, drawn inside its chart; the time series are
// small multiples, one panel per policy or per policy picked. Also the
// command's report and the SLO lines of the table and the JSON.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelcache/replay/replay.h"
#include "nlohmann/json.hpp"

namespace modelcache::replay {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// ---- a strict parser for the report's HTML: every element closed in
// order, except HTML's void elements; attributes quoted.

struct Element {
  std::string tag;
  std::map<std::string, std::string> attributes;
  std::string text;  // the text directly inside, concatenated
  std::vector<Element> children;

  std::string Attr(const std::string& name) const {
    auto it = attributes.find(name);
    return it == attributes.end() ? "" : it->second;
  }
  bool HasClass(const std::string& name) const {
    std::istringstream classes(Attr("class"));
    for (std::string c; classes >> c;) {
      if (c == name) return true;
    }
    return false;
  }
  // Every descendant (not this) with `tag`, in document order.
  void FindAll(const std::string& t, std::vector<const Element*>* out) const {
    for (const Element& c : children) {
      if (c.tag == t) out->push_back(&c);
      c.FindAll(t, out);
    }
  }
  std::vector<const Element*> All(const std::string& t) const {
    std::vector<const Element*> out;
    FindAll(t, &out);
    return out;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& html) : s_(html) {}

  // The document's root element; a parse error is a test failure.
  Element Parse() {
    Element document;
    document.tag = "#document";
    std::vector<Element*> open{&document};
    while (at_ < s_.size()) {
      if (s_.compare(at_, 2, "<!") == 0) {  // the doctype
        at_ = s_.find('>', at_) + 1;
        continue;
      }
      if (s_[at_] != '<') {
        const size_t end = s_.find('<', at_);
        open.back()->text += s_.substr(at_, end - at_);
        at_ = end == std::string::npos ? s_.size() : end;
        continue;
      }
      if (s_.compare(at_, 2, "</") == 0) {
        const size_t end = s_.find('>', at_);
        const std::string tag = s_.substr(at_ + 2, end - at_ - 2);
        if (open.size() < 2 || open.back()->tag != tag) {
          ADD_FAILURE() << "</" << tag << "> closes <" << open.back()->tag
                        << "> at offset " << at_;
          return document;
        }
        open.pop_back();
        at_ = end + 1;
        continue;
      }
      Element e;
      ++at_;
      while (at_ < s_.size() &&
             std::isalnum(static_cast<unsigned char>(s_[at_])))
        e.tag += s_[at_++];
      bool self_closed = false;
      while (true) {
        while (std::isspace(static_cast<unsigned char>(s_[at_]))) ++at_;
        if (s_[at_] == '>') {
          ++at_;
          break;
        }
        if (s_.compare(at_, 2, "/>") == 0) {
          at_ += 2;
          self_closed = true;
          break;
        }
        const size_t eq = s_.find('=', at_);
        const std::string name = s_.substr(at_, eq - at_);
        if (s_[eq + 1] != '"') {
          ADD_FAILURE() << "unquoted attribute " << name << " at " << at_;
          return document;
        }
        const size_t close = s_.find('"', eq + 2);
        e.attributes[name] = s_.substr(eq + 2, close - eq - 2);
        at_ = close + 1;
      }
      static const char* const kVoid[] = {"meta", "br",    "hr",
                                          "img",  "input", "link"};
      const bool is_void = std::find(std::begin(kVoid), std::end(kVoid),
                                     e.tag) != std::end(kVoid);
      open.back()->children.push_back(std::move(e));
      if (!self_closed && !is_void)
        open.push_back(&open.back()->children.back());
    }
    EXPECT_EQ(open.size(), 1u) << "unclosed <" << open.back()->tag << ">";
    return document;
  }

 private:
  const std::string& s_;
  size_t at_ = 0;
};

std::vector<std::pair<double, double>> Coordinates(const std::string& points) {
  std::vector<std::pair<double, double>> out;
  std::istringstream in(points);
  for (std::string pair; in >> pair;) {
    const size_t comma = pair.find(',');
    out.emplace_back(std::stod(pair.substr(0, comma)),
                     std::stod(pair.substr(comma + 1)));
  }
  return out;
}

// What a chart shows, read back from the page.
struct ChartRead {
  std::string title;
  double width = 0, height = 0;
  std::vector<std::string> series;  // polylines' data-series, in order
  std::vector<std::string> legend;  // legend entries, in order
  std::vector<std::string> panels;  // small multiples' data-series
  bool has_caption = false;
};

// Checks what every chart must satisfy and returns what it shows, by id.
std::map<std::string, ChartRead> ReadCharts(const Element& page) {
  std::map<std::string, ChartRead> charts;
  for (const Element* figure : page.All("figure")) {
    const std::string id = figure->Attr("data-chart");
    EXPECT_FALSE(id.empty());
    EXPECT_EQ(charts.count(id), 0u) << "two charts " << id;
    ChartRead& read = charts[id];
    const auto svgs = figure->All("svg");
    EXPECT_EQ(svgs.size(), 1u) << id;
    if (svgs.empty()) continue;
    const Element& svg = *svgs[0];
    // Sized by its viewBox alone, so that it takes the page's width.
    EXPECT_EQ(svg.Attr("width"), "") << id;
    std::istringstream box(svg.Attr("viewBox"));
    double x0 = -1, y0 = -1;
    box >> x0 >> y0 >> read.width >> read.height;
    EXPECT_EQ(x0, 0) << id;
    EXPECT_GT(read.width, 0) << id;
    read.has_caption = !figure->All("figcaption").empty();
    for (const Element* text : svg.All("text")) {
      if (text->HasClass("title")) read.title = text->text;
      if (text->HasClass("legend")) read.legend.push_back(text->text);
      const double x = std::stod(text->Attr("x"));
      EXPECT_GE(x, 0) << id << ": " << text->text;
      EXPECT_LE(x, read.width) << id << ": " << text->text;
    }
    for (const Element* g : svg.All("g")) {
      if (g->HasClass("panel")) read.panels.push_back(g->Attr("data-series"));
    }
    for (const char* shape : {"polyline", "polygon"}) {
      for (const Element* line : svg.All(shape)) {
        const auto points = Coordinates(line->Attr("points"));
        EXPECT_FALSE(points.empty())
            << id << ": empty series " << line->Attr("data-series");
        for (auto [x, y] : points) {
          EXPECT_TRUE(std::isfinite(x) && std::isfinite(y)) << id;
          EXPECT_GE(x, 0) << id;
          EXPECT_LE(x, read.width) << id;
          EXPECT_GE(y, 0) << id;
          EXPECT_LE(y, read.height) << id;
        }
        if (line->HasClass("series"))
          read.series.push_back(line->Attr("data-series"));
      }
    }
    EXPECT_FALSE(read.series.empty()) << id << " draws nothing";
    // A title fits: 16 px bold is at most about 10 px a character.
    EXPECT_FALSE(read.title.empty()) << id;
    EXPECT_LE(read.title.size() * 10.0, read.width) << id << ": " << read.title;
  }
  return charts;
}

Element Body(const Element& document) {
  const auto bodies = document.All("body");
  EXPECT_EQ(bodies.size(), 1u);
  return bodies.empty() ? Element{} : *bodies[0];
}

// Requests drawn from a skewed popularity over 16 models of 50 MiB to 1 GiB,
// 0-300 ms apart, loads at 1 GB/s: loads queue and requests wait.
Trace Skewed(uint64_t seed, int requests) {
  std::mt19937_64 rng(seed);
  Trace trace;
  for (int m = 0; m < 16; ++m) {
    trace.models.push_back("m" + std::to_string(m));
    trace.sizes.push_back((uint64_t{50} + rng() % 974) << 20);
  }
  std::vector<double> weights;
  for (int m = 0; m < 16; ++m) weights.push_back(1.0 / (1 + m));
  std::discrete_distribution<uint32_t> pick(weights.begin(), weights.end());
  int64_t t = 0;
  for (int i = 0; i < requests; ++i) {
    t += static_cast<int64_t>(rng() % 300);
    trace.requests.push_back({t, pick(rng)});
  }
  return trace;
}

TEST(HtmlReport, EveryChartIsDrawnWithEveryPolicyInTheTablesOrder) {
  const Trace trace = Skewed(5, 4000);
  ReplayOptions options;
  options.time.bandwidth_bytes_per_second = 1e9;
  const std::vector<std::string> policies = {"lru", "gdsf", "next-use",
                                             "belady"};
  const std::vector<uint64_t> capacities = {
      uint64_t{2} << 30, uint64_t{4} << 30, uint64_t{6} << 30};
  const auto results = ReplayAll(trace, policies, capacities, options, 2);
  RunInfo info;
  info.timed = true;
  info.time = options.time;
  info.slo.curve_slo_ms = {100, 1000, 10000};
  info.slo_answers =
      FindSloCapacities(trace, policies, options, info.slo, 2, results);

  const std::string html = HtmlReport(trace, "a <report>", results, info);
  // Self-contained: nothing fetched from anywhere.
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  const Element document = Parser(html).Parse();
  const Element body = Body(document);
  EXPECT_EQ(body.All("h1").at(0)->text, "a &lt;report&gt;");
  const auto charts = ReadCharts(body);

  const std::vector<std::string> labels = {"lru", "gdsf", "next-use",
                                           "belady (offline)"};
  std::vector<std::string> ids;
  for (const auto& [id, chart] : charts) ids.push_back(id);
  EXPECT_THAT(ids, ::testing::UnorderedElementsAre(
                       "slo-capacity", "wait-tail", "p99-capacity", "p99-idle",
                       "load-queue", "resident", "hit-ratio", "bytes-loaded"));
  // The SLO's answers are named as searched ("belady"), the runs with their
  // label; every line chart's legend is its series, in the table's order.
  EXPECT_THAT(charts.at("slo-capacity").series, ElementsAreArray(policies));
  for (const char* id :
       {"wait-tail", "p99-capacity", "p99-idle", "hit-ratio", "bytes-loaded"}) {
    EXPECT_THAT(charts.at(id).series, ElementsAreArray(labels)) << id;
  }
  for (const auto& [id, chart] : charts) {
    if (chart.panels.empty()) {
      EXPECT_EQ(chart.legend, chart.series) << id;
    }
  }
  // Small multiples, one panel per policy and no legend.
  for (const char* id : {"load-queue", "resident"}) {
    EXPECT_THAT(charts.at(id).panels, ElementsAreArray(labels)) << id;
    EXPECT_TRUE(charts.at(id).legend.empty()) << id;
    EXPECT_TRUE(charts.at(id).has_caption) << id;
  }
  EXPECT_TRUE(charts.at("wait-tail").has_caption);

  // The tables' rows follow the same order: the first column of the SLO's
  // table and of the p99 table.
  std::vector<std::vector<std::string>> first_columns;
  for (const Element* table : body.All("table")) {
    std::vector<std::string> column;
    for (const Element* row : table->All("tr")) {
      const auto cells = row->All("td");
      if (!cells.empty()) column.push_back(cells[0]->text);
    }
    first_columns.push_back(column);
  }
  ASSERT_GE(first_columns.size(), 2u);
  EXPECT_THAT(first_columns[0], ElementsAreArray(policies));  // the SLO's
  EXPECT_THAT(first_columns[1], ElementsAreArray(labels));    // p99
  // One SLO line per policy.
  const auto items = body.All("li");
  ASSERT_EQ(items.size(), policies.size());
  EXPECT_THAT(items[0]->text, StartsWith("lru: "));
  EXPECT_THAT(items[1]->text, HasSubstr("(lru "));
}

// The part of the page that draws one chart.
std::string FigureOf(const std::string& html, const std::string& id) {
  const size_t begin = html.find("<figure class=\"chart\" id=\"chart-" + id);
  if (begin == std::string::npos) return "";
  return html.substr(begin, html.find("</figure>", begin) - begin);
}

// What an operator must not misread: a curve the same as the baseline's
// hides neither, a p99 of 0 is drawn as 0 (not at a made-up 1 ms), and runs
// that were overloaded or left requests unserved are marked.
TEST(HtmlReport, CoincidingCurvesZeroWaitsAndUnservedRunsAreShown) {
  const Trace trace = Skewed(5, 4000);
  uint64_t all = 0, largest = 0;
  for (uint64_t size : trace.sizes)
    all += size, largest = std::max(largest, size);
  ReplayOptions options;
  options.time.bandwidth_bytes_per_second = 1e9;
  // ttl-24h is lru on a trace shorter than a day: the same curves.
  const std::vector<std::string> policies = {"lru", "ttl-24h", "gdsf"};
  const auto results =
      ReplayAll(trace, policies, {largest / 2, largest * 4, all}, options, 2);
  RunInfo info;
  info.timed = true;
  info.time = options.time;
  const std::string html = HtmlReport(trace, "t", results, info);
  ReadCharts(Body(Parser(html).Parse()));  // every chart's own checks

  const std::string hits = FigureOf(html, "hit-ratio");
  EXPECT_THAT(hits, HasSubstr("ttl-24h = lru (dashed)"));
  const size_t copy = hits.find("class=\"series\" data-series=\"ttl-24h\"");
  ASSERT_NE(copy, std::string::npos);
  EXPECT_THAT(hits.substr(copy, hits.find('>', copy) - copy),
              HasSubstr("stroke-dasharray"));
  // The baseline drawn again over the others.
  EXPECT_THAT(hits, HasSubstr("class=\"overlay\" data-series=\"lru\""));

  // At the sum of all models only the 16 first loads wait: p99 is 0, drawn
  // on the tick labelled 0.
  const std::string p99 = FigureOf(html, "p99-capacity");
  std::smatch zero;
  ASSERT_TRUE(std::regex_search(
      p99, zero,
      std::regex("<text x=\"[0-9.]+\" y=\"([0-9.]+)\" class=\"tick\" "
                 "text-anchor=\"end\">0</text>")))
      << p99;
  std::smatch line;
  ASSERT_TRUE(std::regex_search(
      p99, line,
      std::regex(
          "class=\"series\" data-series=\"lru\"[^>]* points=\"([^\"]*)\"")));
  const auto points = Coordinates(line[1]);
  ASSERT_EQ(points.size(), 3u);
  EXPECT_NEAR(points.back().second, std::stod(zero[1]) - 4, 0.05);
  // Below the largest model some requests are too large: ringed.
  EXPECT_THAT(p99, HasSubstr("class=\"flagged\""));
  EXPECT_THAT(p99, HasSubstr("ringed: overloaded/unserved"));
  EXPECT_THAT(FigureOf(html, "hit-ratio"), HasSubstr("class=\"flagged\""));
}

TEST(HtmlReport, ReportPoliciesPicksThePanels) {
  const Trace trace = Skewed(6, 1500);
  ReplayOptions options;
  options.time.bandwidth_bytes_per_second = 1e9;
  const auto results = ReplayAll(trace, {"lru", "gdsf", "next-use"},
                                 {uint64_t{3} << 30}, options, 2);
  RunInfo info;
  info.timed = true;
  info.report_policies = {"next-use", "lru"};
  const auto charts =
      ReadCharts(Body(Parser(HtmlReport(trace, "t", results, info)).Parse()));
  // In the table's order, whatever the order asked.
  EXPECT_THAT(charts.at("load-queue").panels,
              ElementsAreArray({"lru", "next-use"}));
  EXPECT_THAT(charts.at("resident").panels,
              ElementsAreArray({"lru", "next-use"}));
  EXPECT_THAT(charts.at("wait-tail").series,
              ElementsAreArray({"lru", "gdsf", "next-use"}));
  EXPECT_EQ(charts.count("slo-capacity"), 0u);  // no SLO was searched
}

TEST(HtmlReport, UntimedReportsHitsBytesAndResidentMemory) {
  const Trace trace = Skewed(7, 1000);
  ReplayOptions untimed;
  untimed.timed = false;
  const auto results =
      ReplayAll(trace, {"lru", "belady"},
                {uint64_t{1} << 30, uint64_t{3} << 30}, untimed, 2);
  const auto charts =
      ReadCharts(Body(Parser(HtmlReport(trace, "t", results)).Parse()));
  std::vector<std::string> ids;
  for (const auto& [id, chart] : charts) ids.push_back(id);
  EXPECT_THAT(ids, ::testing::UnorderedElementsAre("resident", "hit-ratio",
                                                   "bytes-loaded"));
  EXPECT_THAT(charts.at("resident").panels,
              ElementsAreArray({"lru", "belady (offline)"}));
}

TEST(HtmlReport, AWaitlessPolicyIsNamedInTheTailsLegendNotDrawnEmpty) {
  // One model, requested every second: only the first request waits, and
  // 1 in 5000 is below the tail's 0.1% resolution.
  Trace trace;
  trace.models = {"a"};
  trace.sizes = {100};
  for (int i = 0; i < 5000; ++i) trace.requests.push_back({1000 * i, 0});
  ReplayOptions options;
  const auto results = ReplayAll(trace, {"lru"}, {1000}, options, 1);
  RunInfo info;
  info.timed = true;
  const std::string html = HtmlReport(trace, "t", results, info);
  const auto charts = ReadCharts(Body(Parser(html).Parse()));
  EXPECT_EQ(charts.count("wait-tail"), 0u);
  EXPECT_EQ(charts.count("p99-capacity"), 1u);
}

// ---- the command

using ::modelcache::testing::TempFile;

using Command = ::modelcache::testing::CommandResult;

Command RunCli(const std::string& args) {
  return ::modelcache::testing::RunShell(std::string(MODELCACHE_CLI) + " " +
                                         args);
}

// c (50 B) once, then a (300 B) and b (400 B) alternating 500 times, 10 s
// apart; loads take 1 s. Below 700 B a and b never both fit and every
// request for them waits 1 s; from 700 B only the first few wait: p99 wait
// is within 500 ms exactly from 700 B.
std::string HotPairCsv() {
  std::string csv = "t_ms,model,size_bytes\n0,c,50\n";
  int64_t t = 0;
  for (int i = 0; i < 500; ++i) {
    csv += std::to_string(t += 10000) + ",a,300\n";
    csv += std::to_string(t += 10000) + ",b,400\n";
  }
  return csv;
}
const char kOneSecondLoads[] =
    " --load-bandwidth inf --load-latency 1s --load-slots 0";

// slo_test's NotMonotone trace: gdsf's p60 wait meets 500 ms at 4 B, misses
// it at 5 and 6 B, and meets it at 7 B (the sum of all models).
std::string NotMonotoneCsv() {
  const std::map<char, int> size = {{'a', 1}, {'b', 2}, {'c', 3}, {'d', 1}};
  std::string csv = "t_ms,model,size_bytes\n";
  int64_t t = 0;
  for (char m : std::string("cccbabddda")) {
    csv +=
        std::to_string(t) + "," + m + "," + std::to_string(size.at(m)) + "\n";
    t += 10000;
  }
  return csv;
}

TEST(ReplayCliSlo, NamesACapacityThatMetItBelowOneThatFailed) {
  TempFile trace(NotMonotoneCsv());
  const std::string args = "replay " + trace.path() + kOneSecondLoads +
                           " --policy gdsf --capacity 4B,5B --slo-ms 500"
                           " --slo-percentile p60 --slo-resolution 1B";
  Command c = RunCli(args);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_THAT(c.out, HasSubstr("gdsf: 7 B for p60 wait \u2264 500ms "
                               "(not monotone: 4 B met it, 6 B did not)\n"));
  Command j = RunCli(args + " --json");
  ASSERT_EQ(j.status, 0) << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  const auto& gdsf = doc["slo"]["answers"][0];
  EXPECT_EQ(gdsf["capacity_bytes"], 7);
  EXPECT_EQ(gdsf["failing_bytes"], 6);
  EXPECT_EQ(gdsf["monotone"], false);
}

TEST(ReplayCliSlo, PrintsTheCapacityComputedByHand) {
  TempFile trace(HotPairCsv());
  Command c = RunCli("replay " + trace.path() + kOneSecondLoads +
                     " --policy lru,next-use --capacity 600B --slo-ms 500"
                     " --slo-resolution 1B --threads 2");
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_THAT(c.out, HasSubstr("memory for p99 wait \u2264 500ms, found by "
                               "replaying (to 1 B):\n"
                               "lru: 700 B for p99 wait \u2264 500ms\n"
                               "next-use: 700 B for p99 wait \u2264 500ms "
                               "(lru needs 700 B, the same)\n"));

  TempFile report("", ".html");
  Command j = RunCli("replay " + trace.path() + kOneSecondLoads +
                     " --policy lru --capacity 600B --slo-ms 0.5s"
                     " --slo-resolution 1B --json --report " +
                     report.path());
  ASSERT_EQ(j.status, 0) << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  const auto& slo = doc["slo"];
  EXPECT_EQ(slo["ms"], 500.0);
  EXPECT_EQ(slo["percentile"], 99.0);
  EXPECT_EQ(slo["resolution"]["bytes"], 1);
  EXPECT_EQ(slo["resolution"]["fraction"], 0.0);
  ASSERT_EQ(slo["answers"].size(), 1u);
  const auto& lru = slo["answers"][0];
  EXPECT_EQ(lru["policy"], "lru");
  EXPECT_EQ(lru["capacity_bytes"], 700);
  EXPECT_EQ(lru["failing_bytes"], 699);
  EXPECT_EQ(lru["monotone"], true);
  std::map<uint64_t, double> waits;
  for (const auto& p : lru["probes"]) waits[p["capacity_bytes"]] = p["wait_ms"];
  EXPECT_EQ(waits.at(600), 1000.0);  // the table's run is a probe
  EXPECT_EQ(waits.at(699), 1000.0);
  EXPECT_EQ(waits.at(700), 0.0);
  EXPECT_EQ(waits.at(750), 0.0);  // the sum of all models
  // With a report, the chart's SLOs are searched too.
  EXPECT_EQ(lru["curve"].size(), 9u);
  EXPECT_EQ(lru["curve"][0]["slo_ms"], 100.0);
  EXPECT_EQ(lru["curve"][0]["capacity_bytes"], 700);
  EXPECT_EQ(lru["curve"][8]["slo_ms"], 60000.0);
  // Any capacity that holds the largest model meets a minute; the curve's
  // resolution is coarser than the SLO's.
  EXPECT_GE(lru["curve"][8]["capacity_bytes"], 400);
  EXPECT_LE(lru["curve"][8]["capacity_bytes"], 700);

  std::ifstream in(report.path());
  const std::string html(std::istreambuf_iterator<char>(in), {});
  const auto charts = ReadCharts(Body(Parser(html).Parse()));
  EXPECT_EQ(charts.count("slo-capacity"), 1u);
  EXPECT_THAT(html, HasSubstr("lru: 700 B for p99 wait \u2264 500ms"));
}

TEST(ReplayCliSlo, NoneIsAnAnswer) {
  // Every request is for a model not seen before: every one waits 1 s.
  std::string csv = "t_ms,model,size_bytes\n";
  for (int m = 0; m < 10; ++m)
    csv += std::to_string(10000 * m) + ",m" + std::to_string(m) + ",1024\n";
  TempFile trace(csv);
  Command c = RunCli("replay " + trace.path() + kOneSecondLoads +
                     " --policy lru,gdsf --capacity 2KiB --slo-ms 999");
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_THAT(c.out, HasSubstr("lru: none up to 10.0 KiB for p99 wait \u2264 "
                               "999ms\ngdsf: none up to 10.0 KiB for p99 "
                               "wait \u2264 999ms\n"));
  Command j = RunCli("replay " + trace.path() + kOneSecondLoads +
                     " --policy lru --capacity 2KiB --slo-ms 999 --json");
  ASSERT_EQ(j.status, 0) << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  EXPECT_TRUE(doc["slo"]["answers"][0]["capacity_bytes"].is_null());
  EXPECT_EQ(doc["slo"]["answers"][0]["failing_bytes"], 10240);
}

TEST(ReplayCliSlo, OffReplaysTheTableOnly) {
  TempFile trace(HotPairCsv());
  const std::string args = "replay " + trace.path() + kOneSecondLoads +
                           " --policy lru,next-use --capacity 600B,700B";
  Command searched = RunCli(args + " --slo-ms 500 --json");
  Command off = RunCli(args + " --slo-ms off --json");
  ASSERT_EQ(searched.status, 0) << searched.err;
  ASSERT_EQ(off.status, 0) << off.err;
  auto with = nlohmann::json::parse(searched.out);
  auto without = nlohmann::json::parse(off.out);
  EXPECT_TRUE(with["slo"].is_object());
  EXPECT_TRUE(without["slo"].is_null());
  // The table's rows are the same runs, apart from how long they took.
  for (auto* doc : {&with, &without}) {
    for (auto& row : (*doc)["results"]) row.erase("requests_per_second");
  }
  EXPECT_EQ(with["results"], without["results"]);
  Command table = RunCli(args + " --slo-ms off");
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_THAT(table.out, Not(HasSubstr("memory for")));
  EXPECT_THAT(table.out, HasSubstr("next-use"));
  Command bad = RunCli(args + " --slo-ms off --slo-percentile p50");
  EXPECT_EQ(bad.status, 1);
  EXPECT_THAT(bad.err,
              StartsWith("error: --slo-percentile and --slo-resolution "
                         "need an SLO to search for: --slo-ms is off"));
}

TEST(ReplayCliSlo, BadSloFlagsAreClearErrors) {
  TempFile trace("t_ms,model,size_bytes\n1,a,10\n2,b,10\n");
  auto expect_error = [&](const std::string& flags,
                          const std::string& message) {
    Command c = RunCli("replay " + trace.path() + " --capacity 1KiB " + flags);
    EXPECT_EQ(c.status, 1) << flags;
    EXPECT_EQ(c.out, "") << flags;
    EXPECT_THAT(c.err, StartsWith("error: " + message)) << flags;
    EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << c.err;
  };
  for (const char* ms : {"0", "-5", "nan", "inf", "-inf", "soon", "0s"}) {
    expect_error(
        std::string("--slo-ms=") + ms,
        std::string("--slo-ms: not a positive, finite duration: '") + ms + "'");
  }
  for (const char* r :
       {"0", "0%", "-1%", "nan%", "inf%", "%", "lots", "0B", "-5MiB"}) {
    expect_error(std::string("--slo-resolution=") + r,
                 std::string("--slo-resolution: not a positive, finite "
                             "resolution: '") +
                     r + "'");
  }
  for (const char* p : {"p0", "101", "p99.95", "abc", "p", "-1"}) {
    expect_error(
        std::string("--slo-percentile=") + p,
        std::string("--slo-percentile: not a percentile: '") + p + "'");
  }
  expect_error("--no-time --slo-ms 500",
               "--slo-ms, --slo-percentile and --slo-resolution need the time "
               "model");
  TempFile report("", ".html");
  expect_error(
      "--policy lru,gdsf --report-policies lru,fifo --report " + report.path(),
      "--report-policies: 'fifo' is not a replayed policy (lru, "
      "gdsf)");
  // Without a report there is nothing for it to pick.
  expect_error("--policy lru,gdsf --report-policies lru",
               "--report-policies picks what the report draws: give --report "
               "FILE.html too");
}

}  // namespace
}  // namespace modelcache::replay
