// Traces read as a stream: the CSV and Azure Functions sources, and an
// in-memory trace as a source.
//
// Each source reads its file once when opened, with the in-memory reader's
// checks in the same order (so the same first error), to learn the header;
// each pass (RequestReader) opens the file again. The fuzzer
// (fuzz/trace_fuzzer.cc) checks on arbitrary input that a source and the
// in-memory reader agree: the same error, or the same models, sizes and
// requests.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string_view>

#include "csv.h"
#include "input.h"
#include "modelcache/replay/replay.h"
#include "trace_internal.h"

namespace modelcache::replay {
namespace {

using csv::Fail;
using csv::kMaxMs;
using csv::kMaxWholeMs;
using csv::ParseInteger;
using csv::ParseNumber;
using csv::ParseSize;
using csv::TooLarge;
using csv::Trim;

// How often (in lines) opening a file reports its progress.
constexpr uint64_t kProgressLines = uint64_t{1} << 16;

// A line's fields as views: into the line itself when it has no quotes,
// else into SplitCsv's unquoted copies.
class FieldSplitter {
 public:
  const std::vector<std::string_view>& Split(std::string_view line) {
    if (!csv::SplitPlain(line, &views_)) {
      csv::SplitCsv(line, &storage_);
      views_.assign(storage_.begin(), storage_.end());
    }
    return views_;
  }

 private:
  std::vector<std::string_view> views_;
  std::vector<std::string> storage_;
};

// The models' names and their numbers, looked up once per request in every
// pass: an open-addressing table (linear probing, a power-of-two size at
// most half full) of 32-bit hash tags and numbers, the names side by side in
// one string. A std::unordered_map's lookup (a modulo, then a node and its
// string elsewhere in memory) was the largest cost of a streamed pass.
class NameIndex {
 public:
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

  // The number of `name`, or kNone.
  uint32_t Find(std::string_view name) const {
    if (slots_.empty()) return kNone;
    const uint64_t hash = Hash(name);
    const uint32_t tag = static_cast<uint32_t>(hash >> 32);
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.model == kNone) return kNone;
      if (slot.tag == tag && NameOf(slot.model) == name) return slot.model;
    }
  }

  // Numbers `name` (not yet in the index) as the next model.
  // REQUIRES: Find(name) == kNone.
  uint32_t Add(std::string_view name) {
    const auto model = static_cast<uint32_t>(ends_.size());
    names_.append(name);
    ends_.push_back(names_.size());
    if (2 * ends_.size() > slots_.size()) {
      slots_.assign(std::bit_ceil(std::max<size_t>(16, 4 * ends_.size())),
                    Slot{});
      mask_ = slots_.size() - 1;
      for (uint32_t m = 0; m < ends_.size(); ++m) Place(m);
    } else {
      Place(model);
    }
    return model;
  }

 private:
  struct Slot {
    uint32_t tag = 0;
    uint32_t model = kNone;
  };

  // 8 bytes at a time, each multiplied in, then mixed (MurmurHash3's
  // finaliser): names are short, and this is not a defence against names
  // chosen to collide.
  static uint64_t Hash(std::string_view name) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ name.size();
    size_t i = 0;
    for (; i + 8 <= name.size(); i += 8) {
      uint64_t word;
      std::memcpy(&word, name.data() + i, 8);
      h = (h ^ word) * 0xFF51AFD7ED558CCDull;
    }
    uint64_t rest = 0;
    std::memcpy(&rest, name.data() + i, name.size() - i);
    h = (h ^ rest) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    return h;
  }

  std::string_view NameOf(uint32_t model) const {
    const size_t begin = model == 0 ? 0 : ends_[model - 1];
    return std::string_view(names_).substr(begin, ends_[model] - begin);
  }

  void Place(uint32_t model) {
    const uint64_t hash = Hash(NameOf(model));
    size_t i = hash & mask_;
    while (slots_[i].model != kNone) i = (i + 1) & mask_;
    slots_[i] = Slot{static_cast<uint32_t>(hash >> 32), model};
  }

  std::string names_;         // every name, in the order of their numbers
  std::vector<size_t> ends_;  // per model, where its name ends in names_
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

[[noreturn]] void Changed(const std::string& path, size_t line) {
  Fail(path, line,
       "the file changed since it was first read (a trace read as a stream "
       "is read once for its header and once more for each pass)");
}

// ---- CSV ----

// One request row of a CSV trace.
struct CsvRow {
  double t = 0;
  int64_t t_ms = 0;  // t rounded to the nearest ms, as std::llround rounds
  std::string_view name;
  bool has_size = false;
  uint64_t size = 0;
};

// The rows of a CSV trace, with ReadCsvTrace's checks of each row in its
// order; the caller checks a model's sizes against each other, then asks
// for the row's service time. With `read_sizes` false, size_bytes is
// neither parsed nor checked (has_size is false): a pass after the first,
// which has checked them all, does not use them.
class CsvRows {
 public:
  CsvRows(const std::string& path, bool read_sizes)
      : lines_(path), read_sizes_(read_sizes) {}

  // The next request row (its views live until the next call); false at
  // the end of the file.
  bool Next(CsvRow* row) {
    std::string_view line;
    while (lines_.Next(&line)) {
      if (Trim(line).empty()) continue;
      fields_ = &splitter_.Split(line);
      const std::vector<std::string_view>& fields = *fields_;
      if (t_col_ < 0) {
        Header(fields);
        continue;
      }
      if (fields.size() < needed_) {
        Fail(path(), this->line(),
             "expected at least " + std::to_string(needed_) +
                 " fields, found " + std::to_string(fields.size()));
      }
      const std::string_view t_text = Trim(fields[t_col_]);
      if (ParseWholeMs(t_text, &row->t_ms)) {
        row->t = static_cast<double>(row->t_ms);
      } else if (ParseNumber(t_text, &row->t)) {
        // Out of range, it fails below.
        if (row->t >= 0 && row->t <= kMaxMs) {
          row->t_ms = static_cast<int64_t>(std::llround(row->t));
        }
      } else {
        Fail(path(), this->line(),
             "t_ms '" + std::string(t_text) + "' is not a number");
      }
      if (row->t < 0) {
        Fail(path(), this->line(), "negative t_ms " + std::string(t_text));
      }
      if (row->t > kMaxMs) {
        Fail(path(), this->line(), TooLarge("t_ms", t_text));
      }
      if (row->t < previous_t_) {
        Fail(path(), this->line(),
             "t_ms " + std::string(t_text) +
                 " is earlier than the previous request's; the trace must "
                 "be sorted by time");
      }
      previous_t_ = row->t;
      row->name = Trim(fields[model_col_]);
      if (row->name.empty()) Fail(path(), this->line(), "empty model name");
      row->has_size =
          read_sizes_ && size_col_ >= 0 && !Trim(fields[size_col_]).empty();
      if (row->has_size) {
        row->size = ParseSize(path(), this->line(), fields[size_col_]);
      }
      return true;
    }
    if (t_col_ < 0) {
      Fail(path(), 1,
           "empty file: expected a header naming 't_ms' and 'model'");
    }
    return false;
  }

  // The service time of the row Next gave last (0 when the trace has no
  // duration_ms column or the field is empty).
  float Duration() const {
    if (duration_col_ < 0) return 0;
    double duration = 0;
    const std::string_view text = Trim((*fields_)[duration_col_]);
    if (!text.empty() && !ParseNumber(text, &duration)) {
      Fail(path(), line(),
           "duration_ms '" + std::string(text) + "' is not a number");
    }
    if (duration < 0) {
      Fail(path(), line(), "negative duration_ms " + std::string(text));
    }
    if (duration > kMaxMs) {
      Fail(path(), line(), TooLarge("duration_ms", text));
    }
    return static_cast<float>(duration);
  }

  bool has_durations() const { return duration_col_ >= 0; }
  size_t line() const { return lines_.line_number(); }
  const std::string& path() const { return lines_.path(); }
  const InputFile& input() const { return lines_.input(); }

 private:
  void Header(const std::vector<std::string_view>& fields) {
    bool azure_like = false;
    for (size_t i = 0; i < fields.size(); ++i) {
      const std::string_view name = Trim(fields[i]);
      if (name == "t_ms") t_col_ = static_cast<int>(i);
      if (name == "model") model_col_ = static_cast<int>(i);
      if (name == "size_bytes") size_col_ = static_cast<int>(i);
      if (name == "duration_ms") duration_col_ = static_cast<int>(i);
      if (name == "HashFunction") azure_like = true;
    }
    if (t_col_ < 0 || model_col_ < 0) {
      Fail(path(), line(), MissingColumnsMessage(t_col_ >= 0, azure_like));
    }
    needed_ = static_cast<size_t>(
                  std::max({t_col_, model_col_, size_col_, duration_col_})) +
              1;
  }

  // Up to 15 decimal digits and nothing else (how times are mostly
  // written): their value, which a double holds exactly, so ParseNumber
  // would give it too; else false, for ParseNumber to decide.
  static bool ParseWholeMs(std::string_view text, int64_t* out) {
    if (text.empty() || text.size() > 15) return false;
    int64_t value = 0;
    for (const char c : text) {
      const auto digit = static_cast<unsigned char>(c - '0');
      if (digit > 9) return false;
      value = value * 10 + digit;
    }
    *out = value;
    return true;
  }

  LineReader lines_;
  const bool read_sizes_;
  FieldSplitter splitter_;
  const std::vector<std::string_view>* fields_ = nullptr;
  int t_col_ = -1, model_col_ = -1, size_col_ = -1, duration_col_ = -1;
  size_t needed_ = 0;
  double previous_t_ = -std::numeric_limits<double>::infinity();
};

class CsvSource : public TraceSource {
 public:
  CsvSource(const std::string& path, const SizeTable* sizes,
            const StreamOptions& stream)
      : path_(path) {
    CsvRows rows(path, /*read_sizes=*/true);
    std::vector<bool> sized;
    std::vector<size_t> first_line;  // per model, for errors
    CsvRow row;
    uint64_t n = 0;
    while (rows.Next(&row)) {
      uint32_t m = index_.Find(row.name);
      if (m == NameIndex::kNone) {
        m = index_.Add(row.name);
        header_.models.emplace_back(row.name);
        header_.sizes.push_back(0);
        sized.push_back(false);
        first_line.push_back(rows.line());
      }
      if (row.has_size) {
        if (sized[m] && header_.sizes[m] != row.size) {
          Fail(path, rows.line(),
               "model '" + std::string(row.name) + "' has size_bytes " +
                   std::to_string(row.size) + " here but " +
                   std::to_string(header_.sizes[m]) + " earlier");
        }
        header_.sizes[m] = row.size;
        sized[m] = true;
      }
      rows.Duration();
      if (n == 0) header_.t_first_ms = row.t_ms;
      header_.t_last_ms = row.t_ms;
      if (++n % kProgressLines == 0 && stream.progress) {
        stream.progress(rows.input().bytes_read(), rows.input().file_bytes());
      }
    }
    header_.requests = n;
    header_.service_times = rows.has_durations() && n > 0;
    for (uint32_t m = 0; m < header_.models.size(); ++m) {
      if (sized[m]) continue;
      const std::string& name = header_.models[m];
      auto it = sizes ? sizes->find(name) : SizeTable::const_iterator{};
      if (!sizes || it == sizes->end()) {
        Fail(path, first_line[m],
             NoSizeMessage(name, sizes, stream.sizes_path));
      }
      header_.sizes[m] = it->second;
    }
    if (stream.progress) {
      stream.progress(rows.input().bytes_read(), rows.input().file_bytes());
    }
  }

  const TraceHeader& header() const override { return header_; }
  std::unique_ptr<RequestReader> Read() const override;

 private:
  class Reader;

  const std::string path_;
  TraceHeader header_;
  NameIndex index_;
};

class CsvSource::Reader : public RequestReader {
 public:
  explicit Reader(const CsvSource& source)
      : source_(source), rows_(source.path_, /*read_sizes=*/false) {}

  size_t Read(Request* requests, float* hold_ms, size_t max) override {
    const TraceHeader& header = source_.header_;
    size_t k = 0;
    CsvRow row;
    while (k < max && rows_.Next(&row)) {
      const uint32_t model = source_.index_.Find(row.name);
      if (model == NameIndex::kNone || read_ == header.requests) {
        Changed(rows_.path(), rows_.line());
      }
      requests[k] = Request{row.t_ms, model};
      if (header.service_times) hold_ms[k] = rows_.Duration();
      ++k;
      ++read_;
    }
    if (k == 0 && read_ != header.requests) {
      Changed(rows_.path(), rows_.line());
    }
    return k;
  }

 private:
  const CsvSource& source_;
  CsvRows rows_;
  uint64_t read_ = 0;
};

std::unique_ptr<RequestReader> CsvSource::Read() const {
  return std::make_unique<Reader>(*this);
}

// ---- Azure Functions ----

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

// A minute's c evenly spread requests: the j-th comes at this offset (the
// in-memory reader's formula, in its unsigned arithmetic).
int64_t EvenOffset(uint64_t j, uint64_t count) {
  return static_cast<int64_t>(((2 * j + 1) * 60000) / (2 * count));
}

// Poisson arrivals: `count` uniform draws in the minute, as the in-memory
// reader draws them.
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
  // The in-memory reader's checks, in its order.
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
// merges the cells by (time, function), the in-memory reader's order.
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

// ---- in memory ----

class MemorySource : public TraceSource {
 public:
  explicit MemorySource(const Trace& trace)
      : trace_(trace), header_(HeaderOf(trace)) {}
  const TraceHeader& header() const override { return header_; }
  std::unique_ptr<RequestReader> Read() const override {
    return std::make_unique<Reader>(trace_);
  }

 private:
  class Reader : public RequestReader {
   public:
    explicit Reader(const Trace& trace) : trace_(trace) {}
    size_t Read(Request* requests, float* hold_ms, size_t max) override {
      const size_t n =
          std::min(max, trace_.requests.size() - static_cast<size_t>(next_));
      std::copy_n(trace_.requests.data() + next_, n, requests);
      if (!trace_.hold_ms.empty()) {
        std::copy_n(trace_.hold_ms.data() + next_, n, hold_ms);
      }
      next_ += n;
      return n;
    }

   private:
    const Trace& trace_;
    size_t next_ = 0;
  };

  const Trace& trace_;
  const TraceHeader header_;
};

}  // namespace

TraceHeader HeaderOf(const Trace& trace) {
  TraceHeader header;
  header.models = trace.models;
  header.sizes = trace.sizes;
  header.requests = trace.requests.size();
  if (!trace.requests.empty()) {
    header.t_first_ms = trace.requests.front().t_ms;
    header.t_last_ms = trace.requests.back().t_ms;
  }
  header.service_times = !trace.hold_ms.empty();
  return header;
}

std::unique_ptr<TraceSource> OpenCsvTrace(const std::string& path,
                                          const SizeTable* sizes,
                                          const StreamOptions& stream) {
  return std::make_unique<CsvSource>(path, sizes, stream);
}

std::unique_ptr<TraceSource> OpenAzureFunctionsTrace(
    const std::string& path, const AzureOptions& options,
    const StreamOptions& stream) {
  return std::make_unique<AzureSource>(path, options, stream);
}

std::unique_ptr<TraceSource> SourceOf(const Trace& trace) {
  return std::make_unique<MemorySource>(trace);
}

}  // namespace modelcache::replay
