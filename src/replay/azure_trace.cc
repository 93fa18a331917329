// The Azure Functions trace (ReadAzureFunctionsTrace,
// OpenAzureFunctionsTrace), with its memory and durations files. One parser:
// the source reads the invocations file once, keeping its non-zero counts,
// and expands them a minute at a time on each pass; the in-memory reader is
// one such pass, collected.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string_view>
#include <unordered_map>

#include "csv.h"
#include "input.h"
#include "modelcache/replay/replay.h"
#include "trace_internal.h"

namespace modelcache::replay {
namespace {

using csv::Fail;
using csv::FieldSplitter;
using csv::kMaxMs;
using csv::kMaxWholeMs;
using csv::ParseInteger;
using csv::ParseNumber;
using csv::SplitCsv;
using csv::TooLarge;
using csv::Trim;

// Reads a per-function CSV keyed by the column `key`, returning for each
// function the numbers in `columns` (whole-field, from 0 to kMaxMs).
std::unordered_map<std::string, std::vector<double>> ReadPerFunction(
    const std::string& path, const std::string& key,
    const std::vector<std::string>& columns) {
  LineReader in(path);
  std::unordered_map<std::string, std::vector<double>> out;
  std::string_view line;
  std::vector<std::string> fields;
  size_t line_no = 0;
  int key_col = -1;
  std::vector<int> cols;
  size_t needed = 0;
  while (in.Next(&line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    SplitCsv(line, &fields);
    if (key_col < 0) {
      for (size_t i = 0; i < fields.size(); ++i) {
        if (Trim(fields[i]) == key) key_col = static_cast<int>(i);
      }
      if (key_col < 0) {
        Fail(path, line_no, "the header must name the column '" + key + "'");
      }
      for (const std::string& c : columns) {
        auto it =
            std::find_if(fields.begin(), fields.end(),
                         [&](const std::string& f) { return Trim(f) == c; });
        if (it == fields.end()) {
          Fail(path, line_no, "the header must name the column '" + c + "'");
        }
        cols.push_back(static_cast<int>(it - fields.begin()));
      }
      needed = static_cast<size_t>(std::max(
                   key_col, *std::max_element(cols.begin(), cols.end()))) +
               1;
      continue;
    }
    if (fields.size() < needed) {
      Fail(path, line_no,
           "expected at least " + std::to_string(needed) + " fields, found " +
               std::to_string(fields.size()));
    }
    std::vector<double> values;
    for (size_t k = 0; k < cols.size(); ++k) {
      double v = 0;
      const std::string_view text = Trim(fields[cols[k]]);
      if (!ParseNumber(text, &v)) {
        Fail(path, line_no,
             columns[k] + " '" + std::string(text) + "' is not a number");
      }
      if (v < 0) {
        Fail(path, line_no, "negative " + columns[k] + " " + std::string(text));
      }
      if (v > kMaxMs) {
        Fail(path, line_no, TooLarge(columns[k], text));
      }
      values.push_back(v);
    }
    out[std::string(Trim(fields[key_col]))] = std::move(values);
  }
  if (key_col < 0) {
    Fail(path, 1, "empty file: expected a header naming '" + key + "'");
  }
  return out;
}

// The models of an Azure Functions trace whose kept functions (those with a
// request) have `hashes`, in file order: "model-<i>", sized by
// options.sizes, else by the memory file, else by DefaultModelSize. Throws
// TraceError as ReadAzureFunctionsTrace documents.
void AzureModels(const std::string& path, const AzureOptions& options,
                 const std::vector<std::string>& hashes,
                 std::vector<std::string>* names,
                 std::vector<uint64_t>* sizes) {
  const uint32_t function = static_cast<uint32_t>(hashes.size());
  const uint32_t models = options.num_models == 0
                              ? std::max<uint32_t>(function, 1)
                              : options.num_models;
  std::unordered_map<std::string, std::vector<double>> memory;
  if (!options.memory_path.empty()) {
    memory = ReadPerFunction(options.memory_path, "HashFunction",
                             {"AverageAllocatedMb_pct50"});
  }
  for (uint32_t m = 0; m < models; ++m) {
    names->push_back("model-" + std::to_string(m));
    uint64_t size = DefaultModelSize(m, options.seed);
    if (options.sizes) {
      auto it = options.sizes->find(names->back());
      if (it != options.sizes->end()) {
        size = it->second;
      } else {
        throw TraceError(
            path + ": the sizes file " +
            (options.sizes_path.empty() ? std::string()
                                        : options.sizes_path + " ") +
            "has no size for '" + names->back() + "' (add '" + names->back() +
            ",SIZE_BYTES' there: the trace's models are model-0 to model-" +
            std::to_string(models - 1) + ")");
      }
    } else if (!options.memory_path.empty() && m < function) {
      auto it = memory.find(hashes[m]);
      if (it == memory.end()) {
        throw TraceError(options.memory_path + ":1: no row for function " +
                         hashes[m]);
      }
      const double bytes = it->second[0] * options.memory_scale * 1048576.0;
      if (!(bytes < 0x1p63)) {
        throw TraceError(options.memory_path + ": function " + hashes[m] +
                         ": AverageAllocatedMb_pct50 times the memory scale "
                         "is more than 2^63 bytes");
      }
      size = static_cast<uint64_t>(std::llround(bytes));
    }
    sizes->push_back(size);
  }
}

// Service times from options.durations_path: one seeded draw per request,
// taken in the trace's order, from its function's duration percentiles.
class AzureDurations {
 public:
  // Reads the durations file; throws TraceError for a bad file or a function
  // it has no row for.
  AzureDurations(const AzureOptions& options,
                 const std::vector<std::string>& hashes);
  // The next request's service time, for a request of `function`.
  float Draw(uint32_t function);

 private:
  std::vector<std::vector<double>> per_function_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> uniform_{0, 1};
};

constexpr double kDurationAt[] = {0, 0.01, 0.25, 0.5, 0.75, 0.99, 1};

AzureDurations::AzureDurations(const AzureOptions& options,
                               const std::vector<std::string>& hashes)
    : rng_(options.seed ^ 0xD0A710ULL) {
  const std::vector<std::string> columns = {
      "percentile_Average_0",  "percentile_Average_1",  "percentile_Average_25",
      "percentile_Average_50", "percentile_Average_75", "percentile_Average_99",
      "percentile_Average_100"};
  auto durations =
      ReadPerFunction(options.durations_path, "HashFunction", columns);
  per_function_.reserve(hashes.size());
  for (const std::string& hash : hashes) {
    auto it = durations.find(hash);
    if (it == durations.end()) {
      throw TraceError(options.durations_path + ":1: no row for function " +
                       hash);
    }
    per_function_.push_back(it->second);
  }
}

float AzureDurations::Draw(uint32_t function) {
  // The inverse of the CDF the percentiles sketch, linear between them.
  const std::vector<double>& p = per_function_[function];
  const double u = uniform_(rng_);
  size_t k = 1;
  while (k + 1 < std::size(kDurationAt) && u > kDurationAt[k]) ++k;
  const double f =
      (u - kDurationAt[k - 1]) / (kDurationAt[k] - kDurationAt[k - 1]);
  return static_cast<float>(p[k - 1] + f * (p[k] - p[k - 1]));
}

// A random bit generator that counts the numbers it draws, so that a draw's
// place in the generator's sequence is known.
struct CountingEngine {
  using result_type = std::mt19937_64::result_type;
  static constexpr result_type min() { return std::mt19937_64::min(); }
  static constexpr result_type max() { return std::mt19937_64::max(); }
  result_type operator()() {
    ++*calls;
    return (*engine)();
  }
  std::mt19937_64* engine;
  uint64_t* calls;
};

// Offsets within a minute, in ms: [0, 60000).
constexpr int64_t kMinuteMs = 60000;

// A minute's c evenly spread requests: the j-th comes at this offset
// (ReadAzureFunctionsTrace's formula, in its unsigned arithmetic).
int64_t EvenOffset(uint64_t j, uint64_t count) {
  return static_cast<int64_t>(((2 * j + 1) * 60000) / (2 * count));
}

// Poisson arrivals: `count` uniform draws in the minute.
template <typename Sink>
void DrawOffsets(CountingEngine engine, uint64_t count, Sink sink) {
  std::uniform_int_distribution<int64_t> within(0, kMinuteMs - 1);
  for (uint64_t j = 0; j < count; ++j) sink(within(engine));
}

class AzureSource : public TraceSource {
 public:
  AzureSource(const std::string& path, const AzureOptions& options,
              const StreamOptions& stream);

  const TraceHeader& header() const override { return header_; }
  std::unique_ptr<RequestReader> Read() const override;

 private:
  class Reader;

  // A function's non-zero count in one minute column.
  struct Cell {
    uint32_t function;
    uint64_t count;
    // Poisson: how many numbers the function's generator has drawn, since
    // its first draw, when this cell's draws begin.
    uint64_t position;
  };

  TraceHeader header_;
  bool poisson_ = false;
  std::vector<int64_t> minutes_;          // per column
  std::vector<std::vector<Cell>> cells_;  // per column, by function
  // The columns in order of their minute, those of one minute together.
  std::vector<std::vector<size_t>> groups_;
  // Poisson: per function, the arrivals generator at its first draw.
  std::vector<std::mt19937_64> first_draw_;
  std::optional<AzureDurations> durations_;
};

AzureSource::AzureSource(const std::string& path, const AzureOptions& options,
                         const StreamOptions& stream)
    : poisson_(options.poisson) {
  if (!options.memory_path.empty() &&
      !(options.memory_scale > 0 && std::isfinite(options.memory_scale))) {
    throw Error(ErrorCode::kInvalidArgument,
                "the memory scale must be a positive number, not " +
                    std::to_string(options.memory_scale));
  }
  std::mt19937_64 arrivals_rng(options.seed ^ 0x5DEECE66DULL);
  LineReader in(path);
  FieldSplitter splitter;
  std::string_view line;
  std::vector<std::string> hashes;  // per kept function
  uint32_t function = 0;
  uint64_t total = 0;  // requests so far, at most options.max_requests
  int64_t t_first = std::numeric_limits<int64_t>::max(), t_last = -1;
  std::vector<std::pair<size_t, Cell>> row;  // (column, cell)
  while (in.Next(&line)) {
    const size_t line_no = in.line_number();
    if (Trim(line).empty()) continue;
    const std::vector<std::string_view>& fields = splitter.Split(line);
    if (minutes_.empty()) {
      static const char* const kLeading[] = {"HashOwner", "HashApp",
                                             "HashFunction", "Trigger"};
      for (size_t i = 0; i < 4; ++i) {
        if (fields.size() <= i || Trim(fields[i]) != kLeading[i]) {
          Fail(path, line_no,
               std::string("expected the Azure Functions header "
                           "'HashOwner,HashApp,HashFunction,Trigger,<minutes>.."
                           ".', column ") +
                   std::to_string(i + 1) + " should be '" + kLeading[i] + "'");
        }
      }
      for (size_t i = 4; i < fields.size(); ++i) {
        int64_t minute = 0;
        if (!ParseInteger(fields[i], &minute) || minute < 0) {
          Fail(path, line_no,
               "minute column '" + std::string(Trim(fields[i])) +
                   "' is not a whole minute number");
        }
        if (static_cast<double>(minute) > kMaxMs / 60000 - 1) {
          Fail(path, line_no,
               "minute column '" + std::string(Trim(fields[i])) +
                   "' is too large (its requests would come after " +
                   std::to_string(kMaxWholeMs) + " ms)");
        }
        minutes_.push_back(minute);
      }
      if (minutes_.empty())
        Fail(path, line_no, "no minute columns after 'Trigger'");
      cells_.resize(minutes_.size());
      continue;
    }
    if (fields.size() != minutes_.size() + 4) {
      Fail(path, line_no,
           "expected " + std::to_string(minutes_.size() + 4) +
               " fields, found " + std::to_string(fields.size()));
    }
    row.clear();
    uint64_t position = 0;
    for (size_t c = 0; c < minutes_.size(); ++c) {
      const std::string_view text = Trim(fields[c + 4]);
      if (!text.empty() && text.front() == '-') {
        Fail(path, line_no,
             "negative invocation count in minute " +
                 std::to_string(minutes_[c]));
      }
      uint64_t count = 0;
      if (!text.empty() && !ParseInteger(text, &count)) {
        Fail(path, line_no,
             "invocation count '" + std::string(text) +
                 "' is not a whole number");
      }
      if (count > options.max_requests - total) {
        Fail(path, line_no,
             "the invocation counts add up to more than " +
                 std::to_string(options.max_requests) + " requests by minute " +
                 std::to_string(minutes_[c]) + " (AzureOptions::max_requests)");
      }
      total += count;
      if (count == 0) continue;
      if (row.empty() && poisson_) first_draw_.push_back(arrivals_rng);
      row.emplace_back(c, Cell{function, count, position});
      int64_t least, most;
      if (poisson_) {
        least = kMinuteMs, most = -1;
        DrawOffsets(CountingEngine{&arrivals_rng, &position}, count,
                    [&](int64_t offset) {
                      least = std::min(least, offset);
                      most = std::max(most, offset);
                    });
      } else {
        least = EvenOffset(0, count), most = EvenOffset(count - 1, count);
      }
      t_first = std::min(t_first, minutes_[c] * kMinuteMs + least);
      t_last = std::max(t_last, minutes_[c] * kMinuteMs + most);
    }
    if (row.empty()) continue;  // never invoked: dropped
    for (const auto& [c, cell] : row) cells_[c].push_back(cell);
    hashes.emplace_back(Trim(fields[2]));
    ++function;
    if (function % 1024 == 0 && stream.progress) {
      stream.progress(in.input().bytes_read(), in.input().file_bytes());
    }
  }
  if (minutes_.empty())
    Fail(path, 1, "empty file: expected the Azure Functions header");
  AzureModels(path, options, hashes, &header_.models, &header_.sizes);
  if (!options.durations_path.empty()) durations_.emplace(options, hashes);
  header_.requests = total;
  header_.service_times = durations_.has_value() && total > 0;
  if (total > 0) {
    header_.t_first_ms = t_first;
    header_.t_last_ms = t_last;
  }
  std::vector<size_t> order(minutes_.size());
  for (size_t c = 0; c < order.size(); ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return minutes_[a] < minutes_[b];
  });
  for (size_t k = 0; k < order.size(); ++k) {
    if (k == 0 || minutes_[order[k]] != minutes_[order[k - 1]]) {
      groups_.emplace_back();
    }
    if (!cells_[order[k]].empty()) groups_.back().push_back(order[k]);
  }
  std::erase_if(groups_, [](const auto& g) { return g.empty(); });
  if (stream.progress) {
    stream.progress(in.input().bytes_read(), in.input().file_bytes());
  }
}

// Expands the counts a minute at a time. Within a minute, each cell's
// requests come in time order (evenly spread, or its sorted draws); a heap
// merges the cells by (time, function), the order ReadAzureFunctionsTrace
// documents.
// Requests equal in both are the same request, so their order is moot.
class AzureSource::Reader : public RequestReader {
 public:
  explicit Reader(const AzureSource& source)
      : source_(source),
        models_(static_cast<uint32_t>(source.header_.models.size())),
        engines_(source.first_draw_),
        drawn_(source.first_draw_.size(), 0),
        durations_(source.durations_) {}

  size_t Read(Request* requests, float* hold_ms, size_t max) override {
    size_t k = 0;
    while (k < max) {
      if (heap_.empty()) {
        if (group_ == source_.groups_.size()) break;
        LoadGroup(source_.groups_[group_++]);
        continue;
      }
      std::pop_heap(heap_.begin(), heap_.end(), Later{this});
      Cursor& cursor = cursors_[heap_.back()];
      requests[k] = Request{cursor.t, cursor.function % models_};
      if (durations_) hold_ms[k] = durations_->Draw(cursor.function);
      ++k;
      if (Advance(cursor)) {
        std::push_heap(heap_.begin(), heap_.end(), Later{this});
      } else {
        heap_.pop_back();
      }
    }
    return k;
  }

 private:
  // Above this many requests, a cell's Poisson draws are counted per
  // offset (60000 counters) rather than kept and sorted.
  static constexpr uint64_t kCountFrom = 8192;

  struct Cursor {
    uint32_t function;
    int64_t base;                  // the minute's first ms
    uint64_t count;                // requests in the cell
    uint64_t j = 0;                // the current one's rank
    int64_t t = 0;                 // the current one's time
    std::vector<int64_t> offsets;  // Poisson, few: sorted draws
    std::vector<uint64_t> per_ms;  // Poisson, many: draws per offset
    int64_t offset = 0;            // ... the current one's offset
    uint64_t left_at_offset = 0;   // ... and how many more come there
    bool poisson = false;
  };

  struct Later {
    const Reader* reader;
    bool operator()(uint32_t a, uint32_t b) const {
      const Cursor& x = reader->cursors_[a];
      const Cursor& y = reader->cursors_[b];
      return x.t != y.t ? x.t > y.t : x.function > y.function;
    }
  };

  // Positions the function's generator at the cell's first draw.
  std::mt19937_64& EngineAt(const Cell& cell) {
    std::mt19937_64& engine = engines_[cell.function];
    uint64_t& drawn = drawn_[cell.function];
    if (drawn > cell.position) {
      // Its minute comes before one already drawn (minute columns out of
      // order): from the first draw again.
      engine = source_.first_draw_[cell.function];
      drawn = 0;
    }
    engine.discard(cell.position - drawn);
    drawn = cell.position;
    return engine;
  }

  void LoadGroup(const std::vector<size_t>& columns) {
    cursors_.clear();
    heap_.clear();
    for (size_t c : columns) {
      for (const Cell& cell : source_.cells_[c]) {
        Cursor cursor;
        cursor.function = cell.function;
        cursor.base = source_.minutes_[c] * kMinuteMs;
        cursor.count = cell.count;
        cursor.poisson = source_.poisson_;
        if (cursor.poisson) {
          CountingEngine engine{&EngineAt(cell), &drawn_[cell.function]};
          if (cell.count < kCountFrom) {
            cursor.offsets.reserve(cell.count);
            DrawOffsets(engine, cell.count, [&](int64_t offset) {
              cursor.offsets.push_back(offset);
            });
            std::sort(cursor.offsets.begin(), cursor.offsets.end());
          } else {
            cursor.per_ms.assign(kMinuteMs, 0);
            DrawOffsets(engine, cell.count,
                        [&](int64_t offset) { ++cursor.per_ms[offset]; });
            cursor.offset = -1;
          }
        }
        Start(cursor);
        cursors_.push_back(std::move(cursor));
        heap_.push_back(static_cast<uint32_t>(cursors_.size() - 1));
      }
    }
    std::make_heap(heap_.begin(), heap_.end(), Later{this});
  }

  // The cursor's first request.
  static void Start(Cursor& cursor) {
    cursor.j = 0;
    if (!cursor.poisson) {
      cursor.t = cursor.base + EvenOffset(0, cursor.count);
    } else if (cursor.per_ms.empty()) {
      cursor.t = cursor.base + cursor.offsets[0];
    } else {
      NextOffset(cursor);
    }
  }

  static void NextOffset(Cursor& cursor) {
    do {
      ++cursor.offset;
    } while (cursor.per_ms[cursor.offset] == 0);
    cursor.left_at_offset = cursor.per_ms[cursor.offset];
    cursor.t = cursor.base + cursor.offset;
  }

  // On to the cursor's next request; false when it has none.
  static bool Advance(Cursor& cursor) {
    if (++cursor.j == cursor.count) return false;
    if (!cursor.poisson) {
      cursor.t = cursor.base + EvenOffset(cursor.j, cursor.count);
    } else if (cursor.per_ms.empty()) {
      cursor.t = cursor.base + cursor.offsets[cursor.j];
    } else if (--cursor.left_at_offset == 0) {
      NextOffset(cursor);
    }
    return true;
  }

  const AzureSource& source_;
  const uint32_t models_;
  std::vector<std::mt19937_64> engines_;
  std::vector<uint64_t> drawn_;  // per function, since its first draw
  std::optional<AzureDurations> durations_;
  size_t group_ = 0;
  std::vector<Cursor> cursors_;
  std::vector<uint32_t> heap_;
};

std::unique_ptr<RequestReader> AzureSource::Read() const {
  return std::make_unique<Reader>(*this);
}

}  // namespace

Trace ReadAzureFunctionsTrace(const std::string& path, uint32_t num_models,
                              const SizeTable* sizes, uint64_t seed) {
  AzureOptions options;
  options.num_models = num_models;
  options.sizes = sizes;
  options.seed = seed;
  return ReadAzureFunctionsTrace(path, options);
}

Trace ReadAzureFunctionsTrace(const std::string& path,
                              const AzureOptions& options) {
  return CollectTrace(AzureSource(path, options, {}));
}

std::unique_ptr<TraceSource> OpenAzureFunctionsTrace(
    const std::string& path, const AzureOptions& options,
    const StreamOptions& stream) {
  return std::make_unique<AzureSource>(path, options, stream);
}

}  // namespace modelcache::replay
