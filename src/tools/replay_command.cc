#include "replay_command.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/base/duration.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"
#include "modelcache/replay/replay.h"

namespace modelcache::tools {
namespace {

// Progress on stderr, on a terminal (or when asked): the trace's first
// read, then the requests replayed over all runs, their rate and the time
// left, then the SLO search's rounds, and one final line. On a terminal one
// line is rewritten, once the run has taken a second, and the final line
// stays; otherwise (--progress) a line is written every five seconds, and
// the first of each phase at once.
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

  // The table's runs start now: their rate is measured from here.
  void StartReplay() { replay_start_ = Clock::now(); }

  // The table's runs are over: `runs` of them replayed `requests`.
  void Replayed(size_t runs, uint64_t requests) {
    runs_ = runs;
    replayed_ = requests;
    replay_rate_ = Rate(requests, replay_start_);
  }

  void Replaying(size_t runs_done, size_t runs, uint64_t done, uint64_t total) {
    runs_ = runs;
    replayed_ = done;
    if (!Due(/*new_phase=*/!replay_shown_)) return;
    replay_shown_ = true;
    const double rate = Rate(done, replay_start_);
    char line[160];
    std::snprintf(
        line, sizeof line,
        "replaying: %.1fM/%.1fM requests (%d%%), %.2fM requests/s",
        static_cast<double>(done) / 1e6, static_cast<double>(total) / 1e6,
        static_cast<int>(total ? done * 100 / total : 100), rate / 1e6);
    std::string text = line;
    if (rate > 0 && total > done) {
      text += ", ETA " + Duration(static_cast<double>(total - done) / rate);
    }
    text +=
        ", " + std::to_string(runs_done) + "/" + std::to_string(runs) + " runs";
    Show(text);
  }

  // The SLO search: its rounds, and how many more it can take at most.
  void Searching(const replay::SloProgress& p) {
    if (!search_started_) {
      search_started_ = true;
      search_start_ = Clock::now();
    }
    search_ = p;
    if (!Due(/*new_phase=*/!search_shown_)) return;
    search_shown_ = true;
    std::string text = "searching for the SLO's capacity: " +
                       (p.round == 0 ? std::string("the sweep")
                                     : "bisection " + std::to_string(p.round)) +
                       ", " + std::to_string(p.round_done) + "/" +
                       std::to_string(p.round_probes) + " replays";
    text += p.rounds_left == 0
                ? ", the last round"
                : ", at most " + std::to_string(p.rounds_left) + " more round" +
                      (p.rounds_left == 1 ? "" : "s");
    text += " (" + std::to_string(p.probes_done) + " replays so far)";
    Show(text);
  }

  // The last line: what ran and how fast. Shown when anything was (or
  // progress was asked for), and kept on a terminal.
  void Finish() {
    if (!shown_at_all_ || (tty_ && !shown_)) return;
    const double seconds =
        std::chrono::duration<double>(Clock::now() - start_).count();
    char line[200];
    std::snprintf(line, sizeof line,
                  "done in %s: %zu runs, %.1fM requests, %.2fM requests/s",
                  Duration(seconds).c_str(), runs_,
                  static_cast<double>(replayed_) / 1e6, replay_rate_ / 1e6);
    std::string text = line;
    if (search_started_) {
      text +=
          "; the SLO search: " + std::to_string(search_.probes_done) +
          " replays in " + std::to_string(search_.round) + " round" +
          (search_.round == 1 ? "" : "s") + ", " +
          Duration(std::chrono::duration<double>(Clock::now() - search_start_)
                       .count());
    }
    Show(text);
    if (tty_) std::fprintf(stderr, "\n");
    shown_ = false;  // kept: Clear leaves it
  }

  // Takes the line off a terminal, before the results are printed.
  void Clear() {
    if (shown_ && tty_) std::fprintf(stderr, "\r%*s\r", width_, "");
    shown_ = false;
  }
  ~Progress() { Clear(); }

 private:
  using Clock = std::chrono::steady_clock;

  double Rate(uint64_t done, Clock::time_point since) const {
    const double seconds =
        std::chrono::duration<double>(Clock::now() - since).count();
    return seconds > 0 ? static_cast<double>(done) / seconds : 0;
  }

  // "0:01:05".
  static std::string Duration(double seconds) {
    const auto s = static_cast<unsigned long long>(std::max(0.0, seconds));
    char text[48];
    std::snprintf(text, sizeof text, "%llu:%02llu:%02llu", s / 3600,
                  s / 60 % 60, s % 60);
    return text;
  }

  // Whether to show a line now; the first of a phase (reading, replaying,
  // searching) is never held back by the last one.
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
  bool replay_shown_ = false, search_started_ = false, search_shown_ = false;
  Clock::time_point replay_start_ = start_, search_start_;
  size_t runs_ = 0;
  uint64_t replayed_ = 0;
  double replay_rate_ = 0;
  replay::SloProgress search_;
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

// --slo-ms: a positive, finite duration.
double ParseSloMs(const std::string& text) {
  try {
    const double ms = replay::ParseDurationMs(text);
    if (ms > 0) return ms;
  } catch (const Error&) {
    // Reported below, with what is expected.
  }
  throw Error(ErrorCode::kInvalidArgument,
              "--slo-ms: not a positive, finite duration: '" + text +
                  "' (use milliseconds, as in 1000, or a unit, as in 1s)");
}

// --slo-percentile: "p99", "99.9", "max"; in (0, 100] in steps of 0.1.
double ParsePercentile(const std::string& text) {
  if (text == "max") return 100;
  std::string_view number = text;
  if (!number.empty() && (number[0] == 'p' || number[0] == 'P'))
    number.remove_prefix(1);
  double value = 0;
  const auto [end, ec] =
      std::from_chars(number.data(), number.data() + number.size(), value);
  const double tenths = value * 10;
  if (ec == std::errc() && end == number.data() + number.size() &&
      !number.empty() && value > 0 && value <= 100 &&
      std::abs(tenths - std::round(tenths)) < 1e-9) {
    return value;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "--slo-percentile: not a percentile: '" + text +
                  "' (use p50, p99, p99.9, max, or any of 0.1 to 100 in "
                  "steps of 0.1)");
}

// --slo-resolution: "2%" of the answer, or a byte size ("512MiB").
void ParseResolution(const std::string& text, replay::SloSearchOptions* slo) {
  const std::string bad =
      "--slo-resolution: not a positive, finite "
      "resolution: '" +
      text +
      "' (use a share of the answer, as in 1%, or a "
      "size, as in 256MiB)";
  if (!text.empty() && text.back() == '%') {
    double percent = 0;
    const auto [end, ec] =
        std::from_chars(text.data(), text.data() + text.size() - 1, percent);
    if (ec != std::errc() || end != text.data() + text.size() - 1 ||
        !(percent > 0) || !std::isfinite(percent)) {
      throw Error(ErrorCode::kInvalidArgument, bad);
    }
    slo->resolution_fraction = percent / 100;
    slo->resolution_bytes = 0;
    return;
  }
  uint64_t bytes = 0;
  try {
    bytes = replay::ParseBytes(text);
  } catch (const Error&) {
    throw Error(ErrorCode::kInvalidArgument, bad);
  }
  if (bytes == 0) throw Error(ErrorCode::kInvalidArgument, bad);
  slo->resolution_fraction = 0;
  slo->resolution_bytes = bytes;
}

// The items of a comma-separated flag ("lru, gdsf"), without the spaces
// around them; empty items ("lru,") are dropped.
std::vector<std::string> TrimmedItems(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const std::string& item : items) {
    const size_t first = item.find_first_not_of(" \t");
    if (first == std::string::npos) continue;
    const size_t last = item.find_last_not_of(" \t");
    out.push_back(item.substr(first, last - first + 1));
  }
  return out;
}

// The report's file can be written: checked before any replay, so that a
// bad path costs nothing. Opened for appending (an existing report is not
// truncated yet) and removed again when it did not exist.
void CheckReportWritable(const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    const int error = errno;
    throw Error(ErrorCode::kIo,
                "--report: cannot write " + path + ": " +
                    base::ErrnoText(error) +
                    " (give a file in a directory that exists and that you "
                    "may write)");
  }
  std::fclose(file);
  if (!existed) std::filesystem::remove(path, ec);
}

// One line on stderr for input that is legal but looks like a mistake.
void Warn(const std::string& text) {
  std::fprintf(stderr, "warning: %s\n", text.c_str());
}

// --drain-after's values: "default" (empty), "inf" or "never"
// (kNeverDrain), or a duration (ParseDrainAfterMs, as serve reads its own).
std::vector<std::optional<double>> ParseDrainAfter(
    const std::vector<std::string>& items) {
  std::vector<std::optional<double>> values;
  for (const std::string& item : items) {
    try {
      values.push_back(ParseDrainAfterMs(item));
    } catch (const Error& e) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("--drain-after: ") + e.what());
    }
    for (size_t i = 0; i + 1 < values.size(); ++i) {
      if (values[i] == values.back()) {
        throw Error(ErrorCode::kInvalidArgument,
                    "--drain-after: '" + item + "' is given twice");
      }
    }
  }
  return values;
}

// The SLOs the report's chart of capacity against SLO draws.
const std::vector<double> kCurveSloMs = {100,  200,   500,   1000, 2000,
                                         5000, 10000, 20000, 60000};

}  // namespace

int RunReplay(ReplayFlags flags) {
  const bool embedded = flags.trace.empty();
  const bool nodes = !flags.cluster.nodes.empty();
  flags.policies = TrimmedItems(flags.policies);
  flags.capacities = TrimmedItems(flags.capacities);
  flags.report_policies = TrimmedItems(flags.report_policies);
  flags.cluster.routes = TrimmedItems(flags.cluster.routes);
  const bool policies_given = !flags.policies.empty();
  if (!flags.report_policies.empty() && flags.report.empty() && !embedded) {
    throw Error(ErrorCode::kInvalidArgument,
                "--report-policies picks what the report draws: give "
                "--report FILE.html too");
  }
  if (flags.models_given && flags.format == "csv") {
    throw Error(ErrorCode::kInvalidArgument,
                "--models applies to --format azure-functions: a CSV trace "
                "names its models");
  }
  if (!nodes && AnyClusterFlag(flags.cluster)) {
    throw Error(ErrorCode::kInvalidArgument,
                "--route, --concurrency, --event, --detect-after, "
                "--retry-delay, --retries and --spill-on-full need --nodes");
  }
  if (nodes && flags.no_time) {
    throw Error(ErrorCode::kInvalidArgument,
                "--nodes: the replay of several nodes runs in trace time "
                "(without --no-time)");
  }
  if (nodes && flags.stream) {
    throw Error(ErrorCode::kInvalidArgument,
                "--stream: the replay of several nodes reads the trace into "
                "memory (without --stream)");
  }
  if (nodes) {
    std::vector<replay::Route> routes;
    ParseClusterFlags(flags.cluster, &routes);  // bad flags before the trace
  }
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
  flags.drain_after = TrimmedItems(flags.drain_after);
  const bool drain_after_given = !flags.drain_after.empty();
  if (!drain_after_given) flags.drain_after = {"default"};
  const std::vector<std::optional<double>> drain_after =
      ParseDrainAfter(flags.drain_after);
  if (drain_after_given && flags.no_time) {
    throw Error(ErrorCode::kInvalidArgument,
                "--drain-after is a rule of the replay in trace time: drop "
                "--no-time");
  }
  if (drain_after.size() > 1 && nodes) {
    throw Error(ErrorCode::kInvalidArgument,
                "--drain-after: give one value with --nodes");
  }
  options.drain_after_ms = drain_after.front();
  const bool max_wait_zero =
      !flags.max_wait.empty() && options.max_wait_ms == 0 && !flags.no_time;
  replay::RunInfo info;
  info.timed = options.timed;
  info.time = options.time;
  // The SLO's flags are checked before any replay runs. `--slo-ms off`
  // replays the table only: the search replays the trace again for each
  // probe, which a production-size trace read as a stream pays in passes.
  const bool slo_off = flags.slo_ms == "off";
  if (!slo_off) info.slo.slo_ms = ParseSloMs(flags.slo_ms);
  info.slo.percentile = ParsePercentile(flags.slo_percentile);
  if (!flags.slo_resolution.empty())
    ParseResolution(flags.slo_resolution, &info.slo);
  if (!options.timed &&
      ((flags.slo_given && !slo_off) || !flags.slo_resolution.empty() ||
       flags.slo_percentile != "p99")) {
    throw Error(ErrorCode::kInvalidArgument,
                "--slo-ms, --slo-percentile and --slo-resolution need the time "
                "model (without --no-time): the untimed replay never waits");
  }
  if (slo_off &&
      (!flags.slo_resolution.empty() || flags.slo_percentile != "p99")) {
    throw Error(ErrorCode::kInvalidArgument,
                "--slo-percentile and --slo-resolution need an SLO to search "
                "for: --slo-ms is off");
  }
  const bool search_slo = options.timed && !slo_off;
  if (!flags.max_index_memory.empty()) {
    try {
      options.max_next_use_index_bytes =
          replay::ParseBytes(flags.max_index_memory);
    } catch (const modelcache::Error& e) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("--max-index-memory: ") + e.what());
    }
  }
  // The report's path before any replay (the embedded default's is a
  // temporary file, checked too).
  if (!flags.report.empty()) CheckReportWritable(flags.report);
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
      CheckReportWritable(flags.report);
    }
  } else {
    std::error_code ec;
    const auto file_bytes = std::filesystem::file_size(flags.trace, ec);
    // The replay of several nodes reads the trace into memory.
    const bool stream =
        !nodes && (flags.stream || (!ec && file_bytes >= kStreamFromBytes));
    replay::StreamOptions stream_options;
    stream_options.progress = [&](uint64_t done, uint64_t total) {
      progress.Reading(flags.trace, done, total);
    };
    replay::SizeTable sizes;
    if (!flags.sizes.empty()) sizes = replay::ReadSizes(flags.sizes);
    stream_options.sizes_path = flags.sizes;
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
        trace = replay::ReadCsvTrace(flags.trace, size_table, flags.sizes);
      }
    } else {
      replay::AzureOptions azure;
      azure.num_models = flags.models;
      azure.sizes = size_table;
      azure.sizes_path = flags.sizes;
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
    const uint64_t requests =
        source ? source->header().requests : trace.requests.size();
    if (requests == 0) {
      throw replay::TraceError(flags.trace +
                               ": no requests: the trace has a header and "
                               "no request to replay");
    }
    if (flags.policies.empty()) flags.policies = kDefaultPolicies;
    if (capacities.empty()) {
      // A tenth, a quarter and a half of all the models' bytes, none below
      // the largest model (a capacity that cannot hold it serves none of
      // its requests).
      const std::vector<uint64_t>& model_sizes =
          source ? source->header().sizes : trace.sizes;
      const uint64_t total =
          std::accumulate(model_sizes.begin(), model_sizes.end(), uint64_t{0});
      const uint64_t largest =
          *std::max_element(model_sizes.begin(), model_sizes.end());
      bool raised = false;
      for (uint64_t c : {total / 10, total / 4, total / 2}) {
        if (c < largest) raised = true;
        c = std::max(c, largest);
        if (capacities.empty() || capacities.back() != c)
          capacities.push_back(c);
      }
      info.notes.push_back(
          "capacities: 10%, 25% and 50% of all model bytes (choose with "
          "--capacity)" +
          (raised ? std::string(", none below the largest model, ") +
                        replay::FormatBytes(largest)
                  : std::string()));
    }
  }
  {
    // Legal, but unlikely to be meant.
    const replay::TraceHeader& h =
        source ? source->header() : replay::HeaderOf(trace);
    uint32_t largest = 0;
    for (uint32_t m = 1; m < h.sizes.size(); ++m) {
      if (h.sizes[m] > h.sizes[largest]) largest = m;
    }
    std::string small;
    for (uint64_t c : capacities) {
      if (!h.sizes.empty() && c < h.sizes[largest]) {
        small += (small.empty() ? "" : ", ") + replay::FormatBytes(c);
      }
    }
    if (!small.empty()) {
      Warn("--capacity " + small + " is smaller than the largest model ('" +
           h.models[largest] + "', " + replay::FormatBytes(h.sizes[largest]) +
           "): its requests cannot be served there and count as unserved");
    }
    if (max_wait_zero) {
      Warn(
          "--max-wait 0: every request that has to wait for a load is "
          "rejected at once and counts as unserved");
    }
  }

  for (const std::string& p : flags.report_policies) {
    if (std::find(flags.policies.begin(), flags.policies.end(), p) ==
        flags.policies.end()) {
      std::string replayed;
      for (const std::string& q : flags.policies)
        replayed += (replayed.empty() ? "" : ", ") + q;
      throw Error(ErrorCode::kInvalidArgument,
                  "--report-policies: '" + p + "' is not a replayed policy (" +
                      replayed + ")");
    }
  }
  info.report_policies = flags.report_policies;
  if (!flags.report.empty() && search_slo) info.slo.curve_slo_ms = kCurveSloMs;

  const unsigned threads =
      flags.threads ? flags.threads
                    : std::max(1u, std::thread::hardware_concurrency());
  if (nodes) {
    // Every node runs what a `modelcache serve` runs by default.
    if (!policies_given) flags.policies = {"next-use"};
    progress.Clear();
    return RunClusterReplay(
        flags.cluster, trace, flags.policies, capacities, options, threads,
        {flags.json, flags.report,
         embedded ? "modelcache replay --nodes: embedded default trace"
                  : "modelcache replay --nodes: " + flags.trace});
  }
  if (!source) source = replay::SourceOf(trace);
  const replay::TraceHeader& header = source->header();
  std::atomic<uint64_t> requests_done{0};
  options.requests_done = &requests_done;
  const uint64_t requests_total = header.requests * flags.policies.size() *
                                  capacities.size() * drain_after.size();
  progress.StartReplay();
  // One ReplayAll per drain_after, compared in one table as the policies
  // are; results drain_after-major.
  std::vector<replay::RunResult> results;
  const size_t runs_each = flags.policies.size() * capacities.size();
  for (size_t d = 0; d < drain_after.size(); ++d) {
    replay::ReplayOptions run_options = options;
    run_options.drain_after_ms = drain_after[d];
    std::vector<replay::RunResult> some = replay::ReplayAll(
        *source, flags.policies, capacities, run_options, threads,
        [&](size_t done, size_t) {
          progress.Replaying(d * runs_each + done,
                             drain_after.size() * runs_each,
                             requests_done.load(), requests_total);
        });
    results.insert(results.end(), std::make_move_iterator(some.begin()),
                   std::make_move_iterator(some.end()));
  }
  if (search_slo) {
    // The table's runs of the first drain_after are the search's first
    // probes; the search replays with that drain_after.
    options.requests_done = nullptr;
    const std::vector<replay::RunResult> known(
        results.begin(), results.begin() + static_cast<ptrdiff_t>(runs_each));
    info.slo_answers = replay::FindSloCapacities(
        *source, flags.policies, options, info.slo, threads, known,
        [&](const replay::SloProgress& p) { progress.Searching(p); });
  }
  progress.Replayed(results.size(), requests_done.load());
  progress.Finish();
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
    errno = 0;
    std::ofstream out(flags.report);
    out << replay::HtmlReport(header, title, results, info);
    out.close();
    const int error = errno;
    if (!out) {
      throw Error(ErrorCode::kIo,
                  "cannot write the report to " + flags.report +
                      (error ? ": " + base::ErrnoText(error) : ""));
    }
    (flags.json ? std::cerr : std::cout)
        << "\nreport: " << flags.report << "\n";
  }
  return 0;
}

}  // namespace modelcache::tools
