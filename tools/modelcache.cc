// The `modelcache` command.
//
//   modelcache replay [TRACE] [options]   predict a request mix under a budget
//   modelcache inspect FILE [--json]      list a safetensors file's tensors
//
// With no TRACE, replay runs an embedded default: a generated model zoo and
// an eight-hour request trace, several policies and capacities.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "inspect_command.h"
#include "modelcache/replay/replay.h"

namespace {

namespace replay = modelcache::replay;

struct ReplayFlags {
  std::string trace;
  std::string format = "csv";
  std::string sizes;
  uint32_t models = 0;
  std::vector<std::string> policies;
  std::vector<std::string> capacities;
  double hold_ms = 0;
  bool no_time = false;
  std::string load_bandwidth = "2GB/s";
  std::string load_latency = "100ms";
  uint32_t load_slots = 4;
  std::string max_wait;
  std::string arrivals = "even";
  std::string memory;
  double memory_scale = 1;
  std::string durations;
  double slo_ms = 1000;
  bool json = false;
  std::string report;
  uint64_t seed = 42;
  unsigned threads = 0;
};

// A progress bar on stderr, shown only on a terminal and only once the run
// has taken more than a second.
class Progress {
 public:
  Progress() : tty_(isatty(STDERR_FILENO) == 1), start_(Clock::now()) {}
  void Update(size_t done, size_t total) {
    if (!tty_ || Clock::now() - start_ < std::chrono::seconds(1)) return;
    if (shown_ && done == last_done_) return;
    last_done_ = done;
    constexpr int kWidth = 30;
    const int filled =
        static_cast<int>(kWidth * done / std::max<size_t>(total, 1));
    std::fprintf(stderr, "\rreplaying [%s%s] %zu/%zu runs",
                 std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, ' ').c_str(), done, total);
    shown_ = true;
  }
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\r%*s\r", 60, "");
  }

 private:
  using Clock = std::chrono::steady_clock;
  const bool tty_;
  const Clock::time_point start_;
  bool shown_ = false;
  size_t last_done_ = 0;
};

// "2GB/s", "500MiB/s", or "inf".
double ParseBandwidth(const std::string& text) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  std::string_view bytes = text;
  if (bytes.size() > 2 && bytes.substr(bytes.size() - 2) == "/s")
    bytes.remove_suffix(2);
  try {
    const uint64_t b = replay::ParseBytes(bytes);
    if (b > 0) return static_cast<double>(b);
  } catch (const modelcache::Error&) {
    // Reported below with what a bandwidth looks like.
  }
  throw std::invalid_argument("--load-bandwidth: not a bandwidth: '" + text +
                              "' (use bytes per second, as in 2GB/s, or inf)");
}

double ParseDurationFlag(const std::string& flag, const std::string& text) {
  try {
    return replay::ParseDurationMs(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(flag + ": " + e.what());
  }
}

int RunReplay(ReplayFlags flags) {
  const bool embedded = flags.trace.empty();
  replay::ReplayOptions options;
  options.timed = !flags.no_time;
  options.hold_ms = flags.hold_ms;
  options.time.bandwidth_bytes_per_second =
      ParseBandwidth(flags.load_bandwidth);
  options.time.latency_ms =
      ParseDurationFlag("--load-latency", flags.load_latency);
  options.time.slots = flags.load_slots;
  if (!flags.max_wait.empty()) {
    options.max_wait_ms = ParseDurationFlag("--max-wait", flags.max_wait);
  }
  replay::RunInfo info;
  info.timed = options.timed;
  info.time = options.time;
  info.slo_ms = flags.slo_ms;
  replay::Trace trace;
  std::vector<uint64_t> capacities;
  for (const std::string& c : flags.capacities) {
    try {
      capacities.push_back(replay::ParseBytes(c));
    } catch (const modelcache::Error& e) {
      throw std::invalid_argument(std::string("--capacity: ") + e.what());
    }
  }
  if (embedded) {
    trace = replay::GenerateDefaultTrace(flags.seed);
    if (flags.policies.empty()) {
      flags.policies = {
          "lru",          "gdsf",  "faascache", "ttl-10m", "hybrid-histogram",
          "gdsf-prewarm", "belady"};
    }
    if (capacities.empty()) {
      for (const char* c : {"16GiB", "32GiB", "48GiB", "64GiB"}) {
        capacities.push_back(replay::ParseBytes(c));
      }
    }
    if (flags.report.empty()) {
      flags.report = (std::filesystem::temp_directory_path() /
                      "modelcache-replay-report.html")
                         .string();
    }
  } else {
    replay::SizeTable sizes;
    if (!flags.sizes.empty()) sizes = replay::ReadSizes(flags.sizes);
    const replay::SizeTable* size_table =
        flags.sizes.empty() ? nullptr : &sizes;
    if (flags.format == "csv") {
      if (!flags.memory.empty() || !flags.durations.empty() ||
          flags.arrivals != "even") {
        throw std::invalid_argument(
            "--memory, --durations and --arrivals apply to --format "
            "azure-functions");
      }
      trace = replay::ReadCsvTrace(flags.trace, size_table);
    } else {
      replay::AzureOptions azure;
      azure.num_models = flags.models;
      azure.sizes = size_table;
      azure.seed = flags.seed;
      azure.poisson = flags.arrivals == "poisson";
      azure.memory_path = flags.memory;
      azure.memory_scale = flags.memory_scale;
      azure.durations_path = flags.durations;
      trace = replay::ReadAzureFunctionsTrace(flags.trace, azure);
    }
    if (flags.policies.empty()) flags.policies = {"lru", "gdsf"};
    if (capacities.empty()) {
      // A tenth, a quarter and a half of all the models' bytes.
      const uint64_t total =
          std::accumulate(trace.sizes.begin(), trace.sizes.end(), uint64_t{0});
      capacities = {total / 10, total / 4, total / 2};
    }
  }

  const unsigned threads =
      flags.threads ? flags.threads
                    : std::max(1u, std::thread::hardware_concurrency());
  std::vector<replay::RunResult> results;
  {
    Progress progress;
    results = replay::ReplayAll(
        trace, flags.policies, capacities, options, threads,
        [&](size_t done, size_t total) { progress.Update(done, total); });
  }

  if (flags.json) {
    std::cout << replay::ResultsJson(trace, results, info);
  } else {
    if (embedded) {
      std::cout
          << "modelcache replay: the embedded default (seed " << flags.seed
          << "): a zoo of " << trace.models.size()
          << " models sized like a real serving mix, and an eight-hour trace "
             "whose\n"
             "popular models drift from morning to afternoon. Each row replays "
             "every request through the real\ncache with one policy and one "
             "memory budget. Try: modelcache replay TRACE.csv --capacity "
             "24GiB\n\n";
    }
    std::cout << replay::ResultsTable(trace, results, info);
  }
  if (!flags.report.empty()) {
    const std::string title = embedded
                                  ? "modelcache replay: embedded default trace"
                                  : "modelcache replay: " + flags.trace;
    std::ofstream out(flags.report);
    out << replay::HtmlReport(trace, title, results, info);
    if (!out)
      throw std::runtime_error("cannot write the report to " + flags.report);
    (flags.json ? std::cerr : std::cout)
        << "\nreport: " << flags.report << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"modelcache: keep ML models resident within memory budgets"};
  app.require_subcommand(1);

  ReplayFlags replay_flags;
  CLI::App* replay_cmd = app.add_subcommand(
      "replay",
      "Replay a request trace through the cache under one or more budgets");
  replay_cmd->add_option("trace", replay_flags.trace,
                         "Trace file; without one, an embedded default runs");
  replay_cmd->add_option("--format", replay_flags.format, "Trace format")
      ->check(CLI::IsMember({"csv", "azure-functions"}));
  replay_cmd->add_option("--sizes", replay_flags.sizes,
                         "CSV of model,size_bytes");
  replay_cmd->add_option("--models", replay_flags.models,
                         "azure-functions: map function i to model i % N");
  replay_cmd
      ->add_option("--policy", replay_flags.policies,
                   "Policies: " + replay::PolicyNames() + " (offline)")
      ->delimiter(',');
  replay_cmd
      ->add_option("--capacity", replay_flags.capacities,
                   "Capacities, e.g. 16GiB,32GiB")
      ->delimiter(',');
  replay_cmd
      ->add_option("--hold-ms", replay_flags.hold_ms,
                   "Keep each lease this long in trace time")
      ->check(CLI::NonNegativeNumber);
  replay_cmd->add_flag("--no-time", replay_flags.no_time,
                       "Untimed replay: loads take no time, nothing waits");
  replay_cmd->add_option("--load-bandwidth", replay_flags.load_bandwidth,
                         "Bytes per second shared by the loads in flight, or "
                         "inf (default 2GB/s)");
  replay_cmd->add_option("--load-latency", replay_flags.load_latency,
                         "Fixed time per load before its bytes move (default "
                         "100ms)");
  replay_cmd->add_option("--load-slots", replay_flags.load_slots,
                         "Loads in flight at most; more queue in FIFO order; 0 "
                         "for unlimited (default 4)");
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
  replay_cmd
      ->add_option("--slo-ms", replay_flags.slo_ms,
                   "Print the smallest capacity whose p99 wait is within "
                   "this, per policy (default 1000)")
      ->check(CLI::NonNegativeNumber);
  replay_cmd->add_flag("--json", replay_flags.json,
                       "Print JSON instead of a table");
  replay_cmd->add_option("--report", replay_flags.report,
                         "Write an HTML report here");
  replay_cmd->add_option("--seed", replay_flags.seed,
                         "Seed for generated sizes and the embedded trace");
  replay_cmd->add_option("--threads", replay_flags.threads,
                         "Runs in parallel (default: one per core)");

  std::string inspect_file;
  bool inspect_json = false;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "List the tensors, metadata and sizes of a safetensors file");
  // Not CLI::ExistingFile: a missing file is reported like any bad file.
  inspect_cmd->add_option("file", inspect_file, "A .safetensors file")
      ->required();
  inspect_cmd->add_flag("--json", inspect_json, "Print one JSON object");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }

  try {
    if (*replay_cmd) return RunReplay(replay_flags);
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
