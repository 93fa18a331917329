// The replay's JSON (ResultsJson in replay.h): the trace, the time model,
// the SLO's search, and one object per run.
#include <string>
#include <utility>
#include <vector>

#include "modelcache/replay/replay.h"
#include "nlohmann/json.hpp"
#include "report_format.h"

namespace modelcache::replay {

std::string ResultsJson(const TraceHeader& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info) {
  nlohmann::json doc;
  doc["requests"] = trace.requests;
  doc["models"] = trace.models.size();
  doc["model_bytes"] = TotalModelBytes(trace.sizes);
  if (info.timed) {
    doc["time_model"] = TimeModelJson(info.time);
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
    nlohmann::json run = RunJson(r);
    run["offline"] = r.offline;
    run["blocked"] = r.blocked;
    doc["results"].push_back(std::move(run));
  }
  return doc.dump(2) + "\n";
}

std::string ResultsJson(const Trace& trace,
                        const std::vector<RunResult>& results,
                        const RunInfo& info) {
  return ResultsJson(HeaderOf(trace), results, info);
}

}  // namespace modelcache::replay
