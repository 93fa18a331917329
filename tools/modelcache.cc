// The `modelcache` command.
//
//   modelcache replay [TRACE] [options]   predict a request mix under a budget
//   modelcache inspect FILE [--json]      list a safetensors file's tensors
//   modelcache ring --nodes N --models F  each model's HAProxy node
//   modelcache serve --catalog F --model-root D --socket S [options]
//                                         the node daemon (docs/serve.md)
//
// With no TRACE, replay runs an embedded default: a generated model zoo and
// an eight-hour request trace, several policies and capacities. This file is
// only the command line; the commands are in src/tools (modelcache_tools),
// which their tests link too.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <exception>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "inspect_command.h"
#include "modelcache/core/policy.h"
#include "modelcache/replay/replay.h"
#include "replay_command.h"
#include "ring_command.h"
#include "serve_command.h"

namespace {

std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// A whole number of at most `max`, for an option whose conversion error
// would otherwise read "Could not convert". `hint` says what to give.
CLI::Validator WholeNumber(uint64_t max, const std::string& hint) {
  return CLI::Validator(
      [max, hint](std::string& text) -> std::string {
        uint64_t value = 0;
        const auto [end, ec] =
            std::from_chars(text.data(), text.data() + text.size(), value);
        if (text.empty() || ec == std::errc::invalid_argument ||
            end != text.data() + text.size()) {
          return "not a whole number of 0 or more: '" + text + "' (" + hint +
                 ")";
        }
        if (ec == std::errc::result_out_of_range || value > max) {
          return "'" + text + "' is more than the most, " +
                 std::to_string(max) + " (" + hint + ")";
        }
        return "";
      },
      "N");
}

// A number of milliseconds, 0 or more and finite.
CLI::Validator Milliseconds(const std::string& hint) {
  return CLI::Validator(
      [hint](std::string& text) -> std::string {
        double value = 0;
        const auto [end, ec] =
            std::from_chars(text.data(), text.data() + text.size(), value);
        if (text.empty() || ec != std::errc() ||
            end != text.data() + text.size() || !(value >= 0) ||
            !std::isfinite(value)) {
          return "not a duration of 0 ms or more: '" + text + "' (" + hint +
                 ")";
        }
        return "";
      },
      "MS");
}

// Levenshtein distance, for "did you mean".
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                         diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// For arguments a subcommand does not take: each unknown option, with the
// closest one it has when that is close, and where to see them all. Empty
// when every option was known (the extra arguments are positional).
std::string UnknownOptions(const CLI::App& app, int argc, char** argv) {
  const CLI::App* command = nullptr;
  for (int i = 1; i < argc && command == nullptr; ++i) {
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (sub->get_name() == argv[i]) command = sub;
    }
  }
  if (command == nullptr) return "";
  std::vector<std::string> known;
  for (const CLI::Option* option : command->get_options()) {
    for (const std::string& name : option->get_lnames()) {
      known.push_back("--" + name);
    }
  }
  std::string out;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0 || arg == "--") continue;
    arg = arg.substr(0, arg.find('='));
    if (std::find(known.begin(), known.end(), arg) != known.end()) continue;
    std::string best;
    size_t best_distance = 3;  // at most two edits away
    for (const std::string& name : known) {
      const size_t d = EditDistance(arg, name);
      if (d < best_distance) best = name, best_distance = d;
    }
    out += std::string(out.empty() ? "" : "; ") + "unknown option " + arg +
           (best.empty() ? "" : " (did you mean " + best + "?)");
  }
  if (out.empty()) return "";
  return out + "; modelcache " + command->get_name() +
         " --help lists the options";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"modelcache: keep ML models resident within memory budgets"};
  app.require_subcommand(1);

  modelcache::tools::ReplayFlags replay_flags;
  CLI::App* replay_cmd = app.add_subcommand(
      "replay",
      "Replay a request trace through the cache under one or more budgets");
  replay_cmd->footer(
      "On a TRACE, the default is --policy " +
      JoinNames(modelcache::tools::kDefaultPolicies) +
      " at 10%, 25% and 50% of all model bytes, none below the largest "
      "model.\nThe waits (p50 to max_wait) are over the requests served; "
      "'unserved' is the share of all requests too large for the capacity "
      "or rejected (--max-wait), and a row with any says UNSERVED and meets "
      "no SLO.");
  replay_cmd->add_option("trace", replay_flags.trace,
                         "Trace file; without one, an embedded default runs");
  replay_cmd->add_option("--format", replay_flags.format, "Trace format")
      ->check(CLI::IsMember({"csv", "azure-functions"}));
  replay_cmd->add_option("--sizes", replay_flags.sizes,
                         "CSV of model,size_bytes");
  CLI::Option* models_option =
      replay_cmd
          ->add_option("--models", replay_flags.models,
                       "azure-functions: map function i to model i % N "
                       "(default 0: one model per function)")
          ->check(WholeNumber(std::numeric_limits<uint32_t>::max(),
                              "0 for one model per function"));
  replay_cmd
      ->add_option(
          "--policy", replay_flags.policies,
          "Policies, comma-separated: " + JoinNames(modelcache::PolicyNames()) +
              "; offline: " + JoinNames(modelcache::OfflinePolicyNames()) +
              " (default on a TRACE: " +
              JoinNames(modelcache::tools::kDefaultPolicies) +
              "; the embedded default runs eight)")
      ->delimiter(',');
  replay_cmd
      ->add_option("--capacity", replay_flags.capacities,
                   "Capacities, e.g. 16GiB,32GiB (default on a TRACE: 10%, "
                   "25% and 50% of all model bytes, none below the largest "
                   "model; the embedded default: 16, 32, 48 and 64 GiB)")
      ->delimiter(',');
  replay_cmd
      ->add_option("--hold-ms", replay_flags.hold_ms,
                   "Keep each lease this long in trace time, for requests "
                   "without a service time (default 0)")
      ->check(Milliseconds("use 0 or more milliseconds, as in 250"));
  replay_cmd->add_flag("--no-time", replay_flags.no_time,
                       "Untimed replay: loads take no time, nothing waits");
  replay_cmd->add_option("--load-bandwidth", replay_flags.load_bandwidth,
                         "Bytes per second shared by the loads in flight, or "
                         "inf (default 2GB/s)");
  replay_cmd->add_option("--load-latency", replay_flags.load_latency,
                         "Fixed time per load before its bytes move (default "
                         "100ms)");
  replay_cmd
      ->add_option("--load-slots", replay_flags.load_slots,
                   "Loads in flight at most; more queue in arrival order; 0 "
                   "for unlimited (default 4)")
      ->check(WholeNumber(std::numeric_limits<uint32_t>::max(),
                          "use 0 for unlimited, or 1 or more"));
  replay_cmd
      ->add_option(
          "--drain-after", replay_flags.drain_after,
          "How long the oldest wait for room lets requests for the models "
          "holding it overtake it before they drain, comma-separated to "
          "compare (e.g. 0,1s,10s,inf); 0: strict arrival order; inf: never "
          "drain (default: default, the library's rule)")
      ->delimiter(',');
  replay_cmd->add_option("--max-wait", replay_flags.max_wait,
                         "A request still waiting this long leaves, counted as "
                         "rejected (default: none)");
  replay_cmd
      ->add_option("--arrivals", replay_flags.arrivals,
                   "azure-functions: spread each minute's requests evenly, "
                   "or as a seeded Poisson process (default even)")
      ->check(CLI::IsMember({"even", "poisson"}));
  replay_cmd->add_option("--memory", replay_flags.memory,
                         "azure-functions: size models from this memory file "
                         "(50th-percentile MB x --memory-scale MiB)");
  replay_cmd
      ->add_option("--memory-scale", replay_flags.memory_scale,
                   "MiB per MB of --memory (default 1)")
      ->check(CLI::PositiveNumber);
  replay_cmd->add_option("--durations", replay_flags.durations,
                         "azure-functions: draw each request's service time "
                         "from this durations file");
  CLI::Option* slo_ms = replay_cmd->add_option(
      "--slo-ms", replay_flags.slo_ms,
      "Find, per policy, the smallest capacity whose wait at "
      "--slo-percentile is within this (default 1000 ms), or off: no "
      "search, the table's runs only");
  replay_cmd->add_option("--slo-percentile", replay_flags.slo_percentile,
                         "The SLO's percentile of the waits: p50, p99, "
                         "p99.9, max, ... (default p99)");
  replay_cmd->add_option("--slo-resolution", replay_flags.slo_resolution,
                         "How close the SLO's answer is: a share of it (1%) "
                         "or a size (256MiB) (default: the larger of 1% and "
                         "256MiB)");
  replay_cmd
      ->add_option("--report-policies", replay_flags.report_policies,
                   "The policies whose time series the report draws "
                   "(default: all; needs --report)")
      ->delimiter(',');
  replay_cmd->add_flag("--json", replay_flags.json,
                       "Print JSON instead of a table");
  replay_cmd->add_option("--report", replay_flags.report,
                         "Write an HTML report here");
  replay_cmd
      ->add_option("--seed", replay_flags.seed,
                   "Seed for generated sizes and the embedded trace "
                   "(default 42)")
      ->check(WholeNumber(std::numeric_limits<uint64_t>::max(),
                          "any whole number, as in 7"));
  replay_cmd
      ->add_option("--threads", replay_flags.threads,
                   "Runs in parallel (default: one per core)")
      ->check(WholeNumber(std::numeric_limits<unsigned>::max(),
                          "0 or none for one per core"));
  // Several nodes behind HAProxy (modelcache/replay/cluster.h).
  modelcache::tools::ClusterFlags& cluster = replay_flags.cluster;
  replay_cmd->add_option("--nodes", cluster.nodes,
                         "Replay N nodes behind HAProxy: a count, or its "
                         "servers as name:id:weight,...; --capacity is each "
                         "node's");
  replay_cmd
      ->add_option("--route", cluster.routes,
                   "With --nodes: roundrobin, random, p2c, leastconn, chash, "
                   "chash-bl:F, chash-map (default: all, chash-bl:150)")
      ->delimiter(',');
  replay_cmd->add_option("--concurrency", cluster.concurrency,
                         "With --nodes: requests out at once at most "
                         "(closed-loop clients; default: none)");
  replay_cmd->add_option("--event", cluster.events,
                         "With --nodes: kill:NODE@TIME or join:NODE@TIME, "
                         "after the trace's first request (repeatable)");
  replay_cmd->add_option("--detect-after", cluster.detect_after,
                         "With --nodes: from a node's death to HAProxy "
                         "marking it down, inter x fall (default 6s)");
  replay_cmd->add_option("--retry-delay", cluster.retry_delay,
                         "With --nodes: before a refused connection is "
                         "retried, min(timeout connect, 1s) (default 1s)");
  replay_cmd->add_option("--retries", cluster.retries,
                         "With --nodes: HAProxy's retries (default 3)");
  replay_cmd->add_flag("--spill-on-full", cluster.spill_on_full,
                       "With --nodes: a node without room answers 503 and "
                       "the request moves on (retry-on 503)");
  replay_cmd->add_flag("--stream", replay_flags.stream,
                       "Read the trace as a stream, once per run (always for "
                       "a file of 256 MiB or more): memory for the models, "
                       "not the requests");
  replay_cmd->add_flag("--progress", replay_flags.progress,
                       "Show progress on stderr even when it is not a "
                       "terminal");
  replay_cmd->add_option("--max-index-memory", replay_flags.max_index_memory,
                         "Memory an offline policy's next-use index may take, "
                         "4 bytes a request (default 4GiB)");

  std::string inspect_file;
  bool inspect_json = false;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "List the tensors, metadata and sizes of a safetensors file");
  // Not CLI::ExistingFile: a missing file is reported like any bad file.
  inspect_cmd->add_option("file", inspect_file, "A .safetensors file")
      ->required();
  inspect_cmd->add_flag("--json", inspect_json, "Print one JSON object");

  modelcache::tools::RingFlags ring_flags;
  CLI::App* ring_cmd = app.add_subcommand(
      "ring", "Print the node HAProxy 2.6's hash sends each model to");
  ring_cmd
      ->add_option("--nodes", ring_flags.nodes,
                   "HAProxy servers in declaration order: name:id:weight,...")
      ->required();
  ring_cmd
      ->add_option("--models", ring_flags.models,
                   "Model ids, one per line, or a CSV with a 'model' column")
      ->required();
  ring_cmd
      ->add_option("--kill", ring_flags.kill,
                   "Print the models that move when these nodes go down")
      ->delimiter(',');
  ring_cmd->add_option("--hash-type", ring_flags.hash_type,
                       "HAProxy's hash-type: consistent (default), "
                       "'consistent sdbm', map-based, ...");
  modelcache::tools::ServeFlags serve_flags;
  CLI::App* serve_cmd = app.add_subcommand(
      "serve",
      "Run the node daemon: one host copy of each model for every worker "
      "process, leased over a UNIX socket; HTTP API and metrics");
  modelcache::tools::AddServeOptions(*serve_cmd, serve_flags);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    const std::string unknown = UnknownOptions(app, argc, argv);
    std::cerr << "error: " << (unknown.empty() ? e.what() : unknown) << "\n";
    return 1;
  } catch (const CLI::ParseError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }

  try {
    if (*replay_cmd) {
      replay_flags.slo_given = slo_ms->count() > 0;
      replay_flags.models_given = models_option->count() > 0;
      return modelcache::tools::RunReplay(replay_flags);
    }
    if (*ring_cmd) {
      return modelcache::tools::RunRing(ring_flags, std::cout, std::cerr);
    }
    if (*serve_cmd) {
      return modelcache::tools::RunServe(serve_flags, std::cout, std::cerr);
    }
    if (*inspect_cmd) {
      return modelcache::tools::RunInspect(inspect_file, inspect_json,
                                           std::cout, std::cerr);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 1;
}
