#include "replay_command.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/replay/replay.h"

namespace modelcache::tools {
namespace {

// Progress on stderr, on a terminal (or when asked): the trace's first
// read, then the requests replayed over all runs, their rate and the time
// left. On a terminal one line is rewritten, once the run has taken a
// second; otherwise (--progress) a line is written every five seconds.
class Progress {
 public:
  explicit Progress(bool forced)
      : tty_(isatty(STDERR_FILENO) == 1),
        shown_at_all_(tty_ || forced),
        start_(Clock::now()) {}

  void Reading(const std::string& path, uint64_t done, uint64_t total) {
    if (!Due()) return;
    if (total > 0) {
      Show("reading " + path + ": " +
           std::to_string(std::min<uint64_t>(100, done * 100 / total)) +
           "% of " + FormatBytes(total));
    } else {
      Show("reading " + path + ": " + FormatBytes(done));
    }
  }

  void Replaying(size_t runs_done, size_t runs, uint64_t done, uint64_t total) {
    if (!Due(/*new_phase=*/!replay_started_)) return;
    if (!replay_started_) {
      replay_started_ = true;
      replay_start_ = Clock::now();
      replay_start_done_ = done;
    }
    const double seconds =
        std::chrono::duration<double>(Clock::now() - replay_start_).count();
    const double rate =
        seconds > 0 ? static_cast<double>(done - replay_start_done_) / seconds
                    : 0;
    char line[160];
    std::snprintf(
        line, sizeof line,
        "replaying: %.1fM/%.1fM requests (%d%%), %.2fM requests/s",
        static_cast<double>(done) / 1e6, static_cast<double>(total) / 1e6,
        static_cast<int>(total ? done * 100 / total : 100), rate / 1e6);
    std::string text = line;
    if (rate > 0 && total > done) {
      const auto left =
          static_cast<uint64_t>(static_cast<double>(total - done) / rate);
      std::snprintf(line, sizeof line, ", ETA %llu:%02llu:%02llu",
                    static_cast<unsigned long long>(left / 3600),
                    static_cast<unsigned long long>(left / 60 % 60),
                    static_cast<unsigned long long>(left % 60));
      text += line;
    }
    text +=
        ", " + std::to_string(runs_done) + "/" + std::to_string(runs) + " runs";
    Show(text);
  }

  // Takes the line off a terminal, before the results are printed.
  void Clear() {
    if (shown_ && tty_) std::fprintf(stderr, "\r%*s\r", width_, "");
    shown_ = false;
  }
  ~Progress() { Clear(); }

 private:
  using Clock = std::chrono::steady_clock;

  // Whether to show a line now; the first of a phase (reading, then
  // replaying) is never held back by the last one.
  bool Due(bool new_phase = false) {
    if (!shown_at_all_) return false;
    const auto now = Clock::now();
    // On a terminal, nothing for a run that ends within a second.
    if (tty_ && now - start_ < std::chrono::seconds(1)) return false;
    if (!tty_ && !new_phase && shown_ &&
        now - last_ < std::chrono::seconds(5)) {
      return false;
    }
    last_ = now;
    return true;
  }

  void Show(const std::string& text) {
    if (tty_) {
      const int pad = std::max(0, width_ - static_cast<int>(text.size()));
      std::fprintf(stderr, "\r%s%*s", text.c_str(), pad, "");
      width_ = std::max(width_, static_cast<int>(text.size()));
    } else {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
    shown_ = true;
  }

  const bool tty_;
  const bool shown_at_all_;
  const Clock::time_point start_;
  Clock::time_point last_;
  bool shown_ = false;
  int width_ = 0;
  bool replay_started_ = false;
  Clock::time_point replay_start_;
  uint64_t replay_start_done_ = 0;
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
  if (!flags.max_index_memory.empty()) {
    try {
      options.max_next_use_index_bytes =
          replay::ParseBytes(flags.max_index_memory);
    } catch (const modelcache::Error& e) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("--max-index-memory: ") + e.what());
    }
  }
  Progress progress(flags.progress);
  replay::Trace trace;  // when read into memory
  std::unique_ptr<replay::TraceSource> source;
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
    std::error_code ec;
    const auto file_bytes = std::filesystem::file_size(flags.trace, ec);
    const bool stream = flags.stream || (!ec && file_bytes >= kStreamFromBytes);
    replay::StreamOptions stream_options;
    stream_options.progress = [&](uint64_t done, uint64_t total) {
      progress.Reading(flags.trace, done, total);
    };
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
      if (stream) {
        source = replay::OpenCsvTrace(flags.trace, size_table, stream_options);
      } else {
        trace = replay::ReadCsvTrace(flags.trace, size_table);
      }
    } else {
      replay::AzureOptions azure;
      azure.num_models = flags.models;
      azure.sizes = size_table;
      azure.seed = flags.seed;
      azure.poisson = flags.arrivals == "poisson";
      azure.memory_path = flags.memory;
      azure.memory_scale = flags.memory_scale;
      azure.durations_path = flags.durations;
      if (stream) {
        source =
            replay::OpenAzureFunctionsTrace(flags.trace, azure, stream_options);
      } else {
        trace = replay::ReadAzureFunctionsTrace(flags.trace, azure);
      }
    }
    if (flags.policies.empty()) flags.policies = {"lru", "gdsf"};
    if (capacities.empty()) {
      // A tenth, a quarter and a half of all the models' bytes.
      const std::vector<uint64_t>& model_sizes =
          source ? source->header().sizes : trace.sizes;
      const uint64_t total =
          std::accumulate(model_sizes.begin(), model_sizes.end(), uint64_t{0});
      capacities = {total / 10, total / 4, total / 2};
    }
  }

  const unsigned threads =
      flags.threads ? flags.threads
                    : std::max(1u, std::thread::hardware_concurrency());
  if (!source) source = replay::SourceOf(trace);
  const replay::TraceHeader& header = source->header();
  std::atomic<uint64_t> requests_done{0};
  options.requests_done = &requests_done;
  const uint64_t requests_total =
      header.requests * flags.policies.size() * capacities.size();
  std::vector<replay::RunResult> results = replay::ReplayAll(
      *source, flags.policies, capacities, options, threads,
      [&](size_t done, size_t total) {
        progress.Replaying(done, total, requests_done.load(), requests_total);
      });
  progress.Clear();

  if (flags.json) {
    std::cout << replay::ResultsJson(header, results, info);
  } else {
    if (embedded) {
      std::cout
          << "modelcache replay: the embedded default (seed " << flags.seed
          << "): a zoo of " << header.models.size()
          << " models sized like a real serving mix, and an eight-hour trace "
             "whose\n"
             "popular models drift from morning to afternoon. Each row replays "
             "every request through the real\ncache with one policy and one "
             "memory budget. Try: modelcache replay TRACE.csv --capacity "
             "24GiB\n\n";
    }
    std::cout << replay::ResultsTable(header, results, info);
  }
  if (!flags.report.empty()) {
    const std::string title = embedded
                                  ? "modelcache replay: embedded default trace"
                                  : "modelcache replay: " + flags.trace;
    std::ofstream out(flags.report);
    out << replay::HtmlReport(header, title, results, info);
    if (!out)
      throw Error(ErrorCode::kIo, "cannot write the report to " + flags.report);
    (flags.json ? std::cerr : std::cout)
        << "\nreport: " << flags.report << "\n";
  }
  return 0;
}

}  // namespace modelcache::tools
