// What the trace readers share: CSV fields (split as base/csv.h splits
// them), the numbers they hold, and the errors that name a file and a line.
#ifndef MODELCACHE_SRC_REPLAY_CSV_H_
#define MODELCACHE_SRC_REPLAY_CSV_H_

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/csv.h"

namespace modelcache::replay::csv {

using ::modelcache::csv::SplitCsv;
using ::modelcache::csv::SplitPlain;
using ::modelcache::csv::Trim;

// A line's fields as views: into the line itself when it has no quotes,
// else into SplitCsv's unquoted copies.
class FieldSplitter {
 public:
  const std::vector<std::string_view>& Split(std::string_view line) {
    if (!SplitPlain(line, &views_)) {
      SplitCsv(line, &storage_);
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

// Throws TraceError "PATH:LINE: PROBLEM".
[[noreturn]] void Fail(const std::string& path, size_t line,
                       const std::string& problem);

// A whole-field integer, or false.
template <typename T>
bool ParseInteger(std::string_view text, T* out) {
  text = Trim(text);
  auto [end, ec] =
      std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}

// A whole-field finite number, or false.
inline bool ParseNumber(std::string_view text, double* out) {
  text = Trim(text);
  auto [end, ec] =
      std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() &&
         !text.empty() && std::isfinite(*out);
}

// A size_bytes field; fails naming the line when it is not a whole number
// of bytes.
uint64_t ParseSize(const std::string& path, size_t line, std::string_view text);

// The largest time or service time, in ms, a trace may give: 2^53, about
// 285,000 years, which doubles hold exactly and which fits the int64 and
// float the replay keeps them in. A larger number is a malformed file.
constexpr int64_t kMaxWholeMs = int64_t{1} << 53;
constexpr double kMaxMs = static_cast<double>(kMaxWholeMs);

// "WHAT TEXT is too large (at most 2^53)".
std::string TooLarge(std::string_view what, std::string_view text);

}  // namespace modelcache::replay::csv

#endif  // MODELCACHE_SRC_REPLAY_CSV_H_
