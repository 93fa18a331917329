// The fields of a CSV line, as every reader of a CSV file here splits them
// (the traces, sizes, memory and durations files of replay; `modelcache
// ring --models`).
#ifndef MODELCACHE_BASE_CSV_H_
#define MODELCACHE_BASE_CSV_H_

#include <string>
#include <string_view>
#include <vector>

namespace modelcache::csv {

// Splits one CSV line into `fields` (reused across lines); double-quoted
// fields may contain commas and doubled quotes.
void SplitCsv(std::string_view line, std::vector<std::string>* fields);

// `line` split at its commas, as SplitCsv splits a line with no '"' (the
// views point into `line`); false, and nothing split, if it has a '"'.
bool SplitPlain(std::string_view line, std::vector<std::string_view>* fields);

// Without leading blanks and tabs, nor trailing blanks, tabs and '\r'.
inline std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t'))
    s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

}  // namespace modelcache::csv

#endif  // MODELCACHE_BASE_CSV_H_
