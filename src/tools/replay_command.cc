#include "replay_command.h"

#include <unistd.h>

#include <algorithm>
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

#include "modelcache/base/errors.h"
#include "modelcache/replay/replay.h"

namespace modelcache::tools {
namespace {

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
  throw Error(ErrorCode::kInvalidArgument,
              "--load-bandwidth: not a bandwidth: '" + text +
                  "' (use bytes per second, as in 2GB/s, or inf)");
}

double ParseDurationFlag(const std::string& flag, const std::string& text) {
  try {
    return replay::ParseDurationMs(text);
  } catch (const Error& e) {
    throw Error(ErrorCode::kInvalidArgument, flag + ": " + e.what());
  }
}

}  // namespace

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
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("--capacity: ") + e.what());
    }
  }
  if (embedded) {
    trace = replay::GenerateDefaultTrace(flags.seed);
    if (flags.policies.empty()) {
      flags.policies = {"lru",
                        "gdsf",
                        "faascache",
                        "ttl-10m",
                        "hybrid-histogram",
                        "next-use",
                        "next-use-prewarm",
                        "belady"};
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
        throw Error(ErrorCode::kInvalidArgument,
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
      throw Error(ErrorCode::kIo, "cannot write the report to " + flags.report);
    (flags.json ? std::cerr : std::cout)
        << "\nreport: " << flags.report << "\n";
  }
  return 0;
}

}  // namespace modelcache::tools
