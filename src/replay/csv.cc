#include "csv.h"

#include "modelcache/replay/replay.h"

namespace modelcache::replay::csv {

void Fail(const std::string& path, size_t line, const std::string& problem) {
  throw TraceError(path + ":" + std::to_string(line) + ": " + problem);
}

uint64_t ParseSize(const std::string& path, size_t line,
                   std::string_view text) {
  text = Trim(text);
  if (!text.empty() && text.front() == '-') {
    Fail(path, line, "negative size_bytes '" + std::string(text) + "'");
  }
  uint64_t size = 0;
  if (!ParseInteger(text, &size)) {
    Fail(path, line,
         "size_bytes '" + std::string(text) +
             "' is not a whole number of bytes");
  }
  return size;
}

std::string TooLarge(std::string_view what, std::string_view text) {
  return std::string(what) + " " + std::string(text) +
         " is too large (at most " + std::to_string(kMaxWholeMs) + ")";
}

}  // namespace modelcache::replay::csv
