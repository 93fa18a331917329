// Rendering the multi-node replay's results (cluster.h): a text table, JSON,
// and a self-contained HTML page with inline SVG bar charts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "modelcache/replay/cluster.h"
#include "nlohmann/json.hpp"
#include "report_format.h"
#include "svg_chart.h"

namespace modelcache::replay {
namespace {

std::string EventName(const ClusterEvent& e) {
  return std::string(e.kind == ClusterEvent::Kind::kKill ? "kill:" : "join:") +
         e.node + "@" + FormatMs(e.at_ms);
}

std::string Copies(const ClusterResult& r) {
  return Fixed(r.copies_mean, 2) + "/" + std::to_string(r.copies_hottest) +
         "/" + std::to_string(r.copies_median);
}

// The run's set-up, in words: nodes, load path, events, clients.
std::vector<std::string> SetUp(const Trace& trace, const ClusterInfo& info) {
  std::vector<std::string> lines;
  lines.push_back(TraceLine(trace.requests.size(), trace.models.size(),
                            TotalModelBytes(trace.sizes)));
  std::string nodes = "nodes (name:id:weight): ";
  for (size_t i = 0; i < info.options.nodes.size(); ++i) {
    const RingServer& s = info.options.nodes[i];
    nodes += (i ? ", " : "") + s.name + ":" + std::to_string(s.id) + ":" +
             std::to_string(s.weight);
  }
  lines.push_back(nodes);
  lines.push_back("each node: the capacity of its row and its own load path, " +
                  LoadPathText(info.time));
  std::string clients =
      info.options.concurrency
          ? "clients: at most " + std::to_string(info.options.concurrency) +
                " requests out at once"
          : std::string("clients: open loop (each request sent at its time)");
  clients += "; retries " + std::to_string(info.options.retries) +
             (info.options.spill_on_full
                  ? "; a full node answers 503 and the request moves on"
                  : "");
  lines.push_back(clients);
  if (!info.options.events.empty()) {
    std::string events = "events:";
    for (const ClusterEvent& e : info.options.events) {
      events += " " + EventName(e);
    }
    events += " (a dead node leaves the ring " +
              FormatMs(info.options.detect_ms) + " after it dies)";
    lines.push_back(events);
  }
  lines.push_back(
      "waits from when a request is sent to when it takes its lease, retries "
      "included");
  return lines;
}

// The routes in order of first appearance, and the (policy, capacity) runs.
std::vector<std::string> Routes(const std::vector<ClusterResult>& results) {
  std::vector<std::string> routes;
  for (const ClusterResult& r : results) {
    const std::string name = r.route.name();
    if (std::find(routes.begin(), routes.end(), name) == routes.end()) {
      routes.push_back(name);
    }
  }
  return routes;
}

// The first cells of a run's rows in the page: route, policy, capacity.
std::vector<std::string> RunCells(const ClusterResult& r) {
  return {Escape(r.route.name()), Escape(r.total.policy),
          Escape(FormatBytes(r.total.capacity_bytes))};
}

std::string RunLabel(const ClusterResult& r) {
  return r.total.policy + " " + FormatBytes(r.total.capacity_bytes);
}

std::vector<BarSeries> PerRoute(
    const std::vector<ClusterResult>& results,
    const std::vector<std::string>& routes,
    const std::function<double(const ClusterResult&)>& value) {
  std::vector<BarSeries> series;
  for (const ClusterResult& r : results) {
    const std::string label = RunLabel(r);
    auto it = std::find_if(series.begin(), series.end(),
                           [&](const BarSeries& s) { return s.name == label; });
    if (it == series.end()) {
      series.push_back(BarSeries{label, std::vector<double>(routes.size(), 0)});
      it = series.end() - 1;
    }
    const size_t g = static_cast<size_t>(
        std::find(routes.begin(), routes.end(), r.route.name()) -
        routes.begin());
    it->values[g] = value(r);
  }
  return series;
}

}  // namespace

std::string ClusterTable(const Trace& trace,
                         const std::vector<ClusterResult>& results,
                         const ClusterInfo& info) {
  std::ostringstream out;
  for (const std::string& line : SetUp(trace, info)) out << line << "\n";
  out << "waits are over the requests served; unserved: too large or "
         "rejected, % of all requests (a row with any says UNSERVED)\n";
  out << "\n";
  char line[640];
  std::snprintf(line, sizeof(line),
                "%-14s %-18s %10s %8s %6s %7s %7s %7s %8s %7s %7s %9s %11s "
                "%7s %6s %13s\n",
                "route", "policy", "capacity", "unserved", "cold%", "p50",
                "p99", "p99.9", "max_wait", "reject", "refused", "idle_GiBh",
                "loaded", "loads", "spills", "copies m/h/md");
  out << line;
  for (const ClusterResult& r : results) {
    const RunResult& t = r.total;
    std::snprintf(
        line, sizeof(line),
        "%-14s %-18s %10s %7.2f%% %6.2f %7s %7s %7s %8s %7llu %7llu %9.1f "
        "%11s %7llu %6llu %13s%s\n",
        r.route.name().c_str(), t.policy.c_str(),
        FormatBytes(t.capacity_bytes).c_str(), UnservedPercent(t),
        100 * t.cold_start_ratio, FormatMs(t.wait_ms.p50).c_str(),
        FormatMs(t.wait_ms.p99).c_str(), FormatMs(t.wait_ms.p999).c_str(),
        FormatMs(t.wait_ms.max).c_str(),
        static_cast<unsigned long long>(t.rejected),
        static_cast<unsigned long long>(r.refused), t.idle_gib_hours,
        FormatBytes(t.bytes_loaded).c_str(),
        static_cast<unsigned long long>(r.loads),
        static_cast<unsigned long long>(r.spills), Copies(r).c_str(),
        RowFlags(t).c_str());
    out << line;
  }
  out << "\ncopies: per model, the nodes that loaded it; the mean over "
         "models, the hottest model's, the median model's\n";

  out << "\nper node: share of the requests served, loads, p99 wait\n";
  std::snprintf(line, sizeof(line), "%-14s %-18s %10s", "route", "policy",
                "capacity");
  out << line;
  for (const RingServer& s : info.options.nodes) {
    std::snprintf(line, sizeof(line), " %22s", s.name.c_str());
    out << line;
  }
  out << "\n";
  for (const ClusterResult& r : results) {
    std::snprintf(line, sizeof(line), "%-14s %-18s %10s",
                  r.route.name().c_str(), r.total.policy.c_str(),
                  FormatBytes(r.total.capacity_bytes).c_str());
    out << line;
    for (const NodeResult& n : r.nodes) {
      const std::string cell = Fixed(100 * n.request_share, 1) + "% " +
                               std::to_string(n.loads) + " " +
                               FormatMs(n.wait_ms.p99);
      std::snprintf(line, sizeof(line), " %22s", cell.c_str());
      out << line;
    }
    out << "\n";
  }
  if (!info.options.events.empty()) {
    out << "\nevents: models whose owner moved, and in the 10 minutes after: "
           "loads and the models loaded\n";
    std::snprintf(line, sizeof(line),
                  "%-14s %-18s %10s %-16s %6s %7s %7s %8s\n", "route", "policy",
                  "capacity", "event", "moved", "loads", "models", "retried");
    out << line;
    for (const ClusterResult& r : results) {
      for (const ClusterEventResult& e : r.events) {
        std::snprintf(
            line, sizeof(line),
            "%-14s %-18s %10s %-16s %6s %7llu %7llu %8llu\n",
            r.route.name().c_str(), r.total.policy.c_str(),
            FormatBytes(r.total.capacity_bytes).c_str(),
            EventName(e.event).c_str(),
            r.route.hashed() ? std::to_string(e.moved.size()).c_str() : "-",
            static_cast<unsigned long long>(e.loads_after),
            static_cast<unsigned long long>(e.models_loaded_after),
            static_cast<unsigned long long>(e.requests_retried));
        out << line;
      }
    }
  }
  return out.str();
}

std::string ClusterJson(const Trace& trace,
                        const std::vector<ClusterResult>& results,
                        const ClusterInfo& info) {
  nlohmann::json doc;
  doc["requests"] = trace.requests.size();
  doc["models"] = trace.models.size();
  doc["model_bytes"] = TotalModelBytes(trace.sizes);
  doc["time_model"] = TimeModelJson(info.time);
  nlohmann::json nodes = nlohmann::json::array();
  for (const RingServer& s : info.options.nodes) {
    nodes.push_back({{"name", s.name}, {"id", s.id}, {"weight", s.weight}});
  }
  nlohmann::json events = nlohmann::json::array();
  for (const ClusterEvent& e : info.options.events) {
    events.push_back(
        {{"kind", e.kind == ClusterEvent::Kind::kKill ? "kill" : "join"},
         {"node", e.node},
         {"at_ms", e.at_ms}});
  }
  doc["cluster"] = {{"nodes", nodes},
                    {"concurrency", info.options.concurrency},
                    {"events", events},
                    {"detect_ms", info.options.detect_ms},
                    {"retry_delay_ms", info.options.retry_delay_ms},
                    {"retries", info.options.retries},
                    {"spill_on_full", info.options.spill_on_full}};
  doc["results"] = nlohmann::json::array();
  for (const ClusterResult& r : results) {
    const RunResult& t = r.total;
    nlohmann::json per_node = nlohmann::json::array();
    for (const NodeResult& n : r.nodes) {
      per_node.push_back(
          {{"name", n.name},
           {"requests", n.requests},
           {"request_share", n.request_share},
           {"loads", n.loads},
           {"bytes_loaded", n.bytes_loaded},
           {"refused", n.refused},
           {"wait_ms", WaitsJson(n.wait_ms)},
           {"peak_in_flight", n.peak_in_flight},
           {"evictions", n.detail.evictions},
           {"idle_gib_hours", n.detail.idle_gib_hours},
           {"disk_busy_ratio", n.detail.disk_busy_ratio},
           {"peak_resident_bytes", n.detail.peak_resident_bytes}});
    }
    nlohmann::json per_event = nlohmann::json::array();
    for (const ClusterEventResult& e : r.events) {
      nlohmann::json moved = nlohmann::json::array();
      for (const uint32_t m : e.moved) moved.push_back(trace.models[m]);
      per_event.push_back(
          {{"kind",
            e.event.kind == ClusterEvent::Kind::kKill ? "kill" : "join"},
           {"node", e.event.node},
           {"at_ms", e.event.at_ms},
           {"moved", r.route.hashed() ? moved : nlohmann::json(nullptr)},
           {"loads_after", e.loads_after},
           {"models_loaded_after", e.models_loaded_after},
           {"requests_retried", e.requests_retried}});
    }
    nlohmann::json owners = nullptr;
    if (!r.owners.empty()) {
      owners = nlohmann::json::object();
      for (size_t m = 0; m < r.owners.size(); ++m) {
        owners[trace.models[m]] =
            r.owners[m] < r.nodes.size()
                ? nlohmann::json(r.nodes[r.owners[m]].name)
                : nlohmann::json(nullptr);
      }
    }
    const auto model_json = [&](uint32_t m, uint32_t copies) {
      return nlohmann::json{
          {"model", m < trace.models.size() ? trace.models[m] : ""},
          {"copies", copies}};
    };
    // The total's counters, as the one-node JSON writes a run's, and the
    // cluster's own.
    nlohmann::json run = RunJson(t);
    run["route"] = r.route.name();
    run["requests"] = t.requests;
    run["refused"] = r.refused;
    run["loads"] = r.loads;
    run["spills"] = r.spills;
    run["retries"] = r.retries;
    run["peak_in_flight"] = r.peak_in_flight;
    run["copies"] = {{"mean", r.copies_mean},
                     {"hottest", model_json(r.hottest_model, r.copies_hottest)},
                     {"median", model_json(r.median_model, r.copies_median)}};
    run["client_wait_ms"] = WaitsJson(r.client_wait_ms);
    run["client_waited"] = r.client_waited;
    run["nodes"] = per_node;
    run["events"] = per_event;
    run["owners"] = owners;
    doc["results"].push_back(std::move(run));
  }
  return doc.dump(2) + "\n";
}

std::string ClusterHtmlReport(const Trace& trace, const std::string& title,
                              const std::vector<ClusterResult>& results,
                              const ClusterInfo& info) {
  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta "
          "charset=\"utf-8\">\n<title>"
       << Escape(title) << "</title>\n<style>\n"
       << "body{font-family:system-ui,sans-serif;margin:2em "
          "auto;max-width:1080px;color:#222}\n"
       << "table{border-collapse:collapse;margin:1em 0}td,th{padding:3px 8px;"
          "border-bottom:1px solid #ddd;text-align:right}th{background:#f4f4f4}"
          "td:first-child,th:first-child{text-align:left}td{white-space:nowrap}"
          "\n"
       << ".axis{stroke:#444}.grid{stroke:#e4e4e4}.tick{font-size:11px;fill:#"
          "444}.label{font-size:12px;fill:#222}.legend{font-size:12px}"
          ".title{font-size:14px;font-weight:600}\n"
          "h1{font-size:1.5em;margin-bottom:0.2em}p.trace{margin-top:0;"
          "font-family:ui-monospace,monospace;overflow-wrap:anywhere}"
          "svg{width:100%;height:auto;display:block;margin:1em 0}\n"
       << "</style>\n</head>\n<body>\n";
  // "modelcache replay --nodes: PATH": the command as the heading, the
  // trace's path below it (a long path would wrap the heading).
  const size_t colon = title.find(": ");
  if (colon == std::string::npos) {
    html << "<h1>" << Escape(title) << "</h1>\n";
  } else {
    html << "<h1>" << Escape(title.substr(0, colon))
         << "</h1>\n<p class=\"trace\">" << Escape(title.substr(colon + 2))
         << "</p>\n";
  }
  html << "<ul>\n";
  for (const std::string& line : SetUp(trace, info)) {
    html << "<li>" << Escape(line) << "</li>\n";
  }
  html << "</ul>\n<table>\n<tr><th>route</th><th>policy</th><th>capacity per "
          "node</th><th>cold starts</th><th>p50 wait</th><th>p99 wait</th>"
          "<th>p99.9 wait</th><th>max wait</th><th>rejected</th>"
          "<th>refused</th><th>idle GiB&middot;h</th><th>bytes loaded</th>"
          "<th>loads</th><th>spills</th><th>copies: mean / hottest / "
          "median</th></tr>\n";
  for (const ClusterResult& r : results) {
    const RunResult& t = r.total;
    std::vector<std::string> cells = RunCells(r);
    for (std::string cell :
         {Fixed(100 * t.cold_start_ratio, 2) + "%", FormatMs(t.wait_ms.p50),
          FormatMs(t.wait_ms.p99), FormatMs(t.wait_ms.p999),
          FormatMs(t.wait_ms.max), std::to_string(t.rejected),
          std::to_string(r.refused), Fixed(t.idle_gib_hours, 1),
          Escape(FormatBytes(t.bytes_loaded)), std::to_string(r.loads),
          std::to_string(r.spills), Escape(Copies(r))}) {
      cells.push_back(std::move(cell));
    }
    html << HtmlRow(cells);
  }
  html << "</table>\n";

  const std::vector<std::string> routes = Routes(results);
  html << BarChart("Loads per route (all nodes)", "loads", routes,
                   PerRoute(results, routes,
                            [](const ClusterResult& r) {
                              return static_cast<double>(r.loads);
                            }),
                   [](double v) { return Fixed(v, 0); });
  html << BarChart(
      "p99 wait per route", "p99 wait", routes,
      PerRoute(results, routes,
               [](const ClusterResult& r) { return r.total.wait_ms.p99; }),
      [](double v) { return FormatMs(v); });

  html << "<h2>Per node</h2>\n<table>\n<tr><th>route</th><th>policy</th>"
          "<th>capacity</th><th>node</th><th>share of requests</th>"
          "<th>loads</th><th>bytes loaded</th><th>p99 wait</th>"
          "<th>503s</th><th>peak in flight</th></tr>\n";
  for (const ClusterResult& r : results) {
    for (const NodeResult& n : r.nodes) {
      std::vector<std::string> cells = RunCells(r);
      for (std::string cell :
           {Escape(n.name), Fixed(100 * n.request_share, 1) + "%",
            std::to_string(n.loads), Escape(FormatBytes(n.bytes_loaded)),
            FormatMs(n.wait_ms.p99), std::to_string(n.refused),
            std::to_string(n.peak_in_flight)}) {
        cells.push_back(std::move(cell));
      }
      html << HtmlRow(cells);
    }
  }
  html << "</table>\n";
  if (!info.options.events.empty()) {
    html << "<h2>Events</h2>\n<p>Moved: the models whose owner changes "
            "(hashed routes). Loads and models loaded: in the 10 minutes "
            "after the event, on every node.</p>\n<table>\n<tr><th>route</th>"
            "<th>policy</th><th>capacity</th><th>event</th><th>moved</th>"
            "<th>loads</th><th>models loaded</th><th>requests retried</th>"
            "</tr>\n";
    for (const ClusterResult& r : results) {
      for (const ClusterEventResult& e : r.events) {
        std::vector<std::string> cells = RunCells(r);
        for (std::string cell :
             {Escape(EventName(e.event)),
              r.route.hashed() ? std::to_string(e.moved.size()) : "-",
              std::to_string(e.loads_after),
              std::to_string(e.models_loaded_after),
              std::to_string(e.requests_retried)}) {
          cells.push_back(std::move(cell));
        }
        html << HtmlRow(cells);
      }
    }
    html << "</table>\n";
  }
  html << "</body>\n</html>\n";
  return html.str();
}

}  // namespace modelcache::replay
