// The CSV trace (ReadCsvTrace, OpenCsvTrace): one parser, CsvRows, and one
// pass over the file, ScanCsv, which checks every row and learns the models
// and their sizes. The in-memory reader is that pass keeping the requests;
// the stream's source is that pass when opened, then CsvRows again for each
// pass over the requests.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "csv.h"
#include "input.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {
namespace {

using csv::Fail;
using csv::FieldSplitter;
using csv::kMaxMs;
using csv::ParseNumber;
using csv::ParseSize;
using csv::TooLarge;
using csv::Trim;

// How often (in lines) opening a file reports its progress.
constexpr uint64_t kProgressLines = uint64_t{1} << 16;

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

// The message for a model of a CSV trace that has no size: where to give
// one (a size_bytes column, --sizes, or the sizes file `sizes_path` that
// lacks it when `sizes` is given).
inline std::string NoSizeMessage(const std::string& model,
                                 const SizeTable* sizes,
                                 const std::string& sizes_path) {
  if (sizes == nullptr) {
    return "model '" + model +
           "' has no size: give a size_bytes column or --sizes FILE";
  }
  return "model '" + model + "' has no size: no size_bytes here, and the " +
         (sizes_path.empty() ? std::string("sizes file")
                             : "sizes file " + sizes_path) +
         " has no row for it (add '" + model + ",SIZE_BYTES' there)";
}

// The message for a CSV trace's header that lacks 't_ms' or 'model';
// `azure_like`: the header names HashFunction, as the Azure Functions
// trace's does.
inline std::string MissingColumnsMessage(bool has_t_ms, bool azure_like) {
  std::string message =
      std::string("the header must name the columns 't_ms' and 'model'") +
      (has_t_ms ? " (no 'model')" : " (no 't_ms')");
  if (azure_like) {
    message +=
        ": it looks like an Azure Functions trace (HashOwner, HashApp, "
        "HashFunction, then a count per minute); give --format "
        "azure-functions";
  }
  return message;
}

// One request row of a CSV trace.
struct CsvRow {
  double t = 0;
  int64_t t_ms = 0;  // t rounded to the nearest ms, as std::llround rounds
  std::string_view name;
  bool has_size = false;
  uint64_t size = 0;
};

// The rows of a CSV trace, each checked as it is read; the caller checks a
// model's sizes against each other, then asks for the row's service time. With
// `read_sizes` false, size_bytes is neither parsed nor checked (has_size is
// false): a pass after the first, which has checked them all, does not use
// them.
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

// The one pass that reads a CSV trace whole: every row's checks, its models
// numbered in the order of their first request into `index`, their sizes
// (a size_bytes field, else `sizes`, whose file is `sizes_path`), and the
// requests' count and span. Keeps each request in `requests` and its
// service time in `hold_ms` (when the trace has them) unless these are
// null. Calls `progress` now and then, if set.
TraceHeader ScanCsv(const std::string& path, const SizeTable* sizes,
                    const std::string& sizes_path,
                    const std::function<void(uint64_t, uint64_t)>& progress,
                    NameIndex* index, std::vector<Request>* requests,
                    std::vector<float>* hold_ms) {
  CsvRows rows(path, /*read_sizes=*/true);
  TraceHeader header;
  std::vector<bool> sized;
  std::vector<size_t> first_line;  // per model, for errors
  CsvRow row;
  uint64_t n = 0;
  while (rows.Next(&row)) {
    uint32_t m = index->Find(row.name);
    if (m == NameIndex::kNone) {
      m = index->Add(row.name);
      header.models.emplace_back(row.name);
      header.sizes.push_back(0);
      sized.push_back(false);
      first_line.push_back(rows.line());
    }
    if (row.has_size) {
      if (sized[m] && header.sizes[m] != row.size) {
        Fail(path, rows.line(),
             "model '" + std::string(row.name) + "' has size_bytes " +
                 std::to_string(row.size) + " here but " +
                 std::to_string(header.sizes[m]) + " earlier");
      }
      header.sizes[m] = row.size;
      sized[m] = true;
    }
    const float duration = rows.Duration();
    if (requests) requests->push_back(Request{row.t_ms, m});
    if (hold_ms && rows.has_durations()) hold_ms->push_back(duration);
    if (n == 0) header.t_first_ms = row.t_ms;
    header.t_last_ms = row.t_ms;
    if (++n % kProgressLines == 0 && progress) {
      progress(rows.input().bytes_read(), rows.input().file_bytes());
    }
  }
  header.requests = n;
  header.service_times = rows.has_durations() && n > 0;
  for (uint32_t m = 0; m < header.models.size(); ++m) {
    if (sized[m]) continue;
    const std::string& name = header.models[m];
    auto it = sizes ? sizes->find(name) : SizeTable::const_iterator{};
    if (!sizes || it == sizes->end()) {
      Fail(path, first_line[m], NoSizeMessage(name, sizes, sizes_path));
    }
    header.sizes[m] = it->second;
  }
  if (progress) {
    progress(rows.input().bytes_read(), rows.input().file_bytes());
  }
  return header;
}

class CsvSource : public TraceSource {
 public:
  CsvSource(const std::string& path, const SizeTable* sizes,
            const StreamOptions& stream)
      : path_(path),
        header_(ScanCsv(path, sizes, stream.sizes_path, stream.progress,
                        &index_, nullptr, nullptr)) {}

  const TraceHeader& header() const override { return header_; }
  std::unique_ptr<RequestReader> Read() const override;

 private:
  class Reader;

  const std::string path_;
  NameIndex index_;  // before header_, which ScanCsv fills with it
  TraceHeader header_;
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

}  // namespace

Trace ReadCsvTrace(const std::string& path, const SizeTable* sizes,
                   const std::string& sizes_path) {
  Trace trace;
  NameIndex index;
  TraceHeader header = ScanCsv(path, sizes, sizes_path, {}, &index,
                               &trace.requests, &trace.hold_ms);
  trace.models = std::move(header.models);
  trace.sizes = std::move(header.sizes);
  return trace;
}

std::unique_ptr<TraceSource> OpenCsvTrace(const std::string& path,
                                          const SizeTable* sizes,
                                          const StreamOptions& stream) {
  return std::make_unique<CsvSource>(path, sizes, stream);
}

}  // namespace modelcache::replay
