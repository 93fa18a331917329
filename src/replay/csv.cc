#include "csv.h"

#include <cstring>

#include "modelcache/replay/replay.h"

namespace modelcache::replay::csv {

void SplitCsv(std::string_view line, std::vector<std::string>* fields) {
  fields->clear();
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"' && field.empty()) {
      quoted = true;
    } else if (c == ',') {
      fields->push_back(std::move(field));
      field.clear();
    } else {
      field += c;
    }
  }
  fields->push_back(std::move(field));
}

bool SplitPlain(std::string_view line, std::vector<std::string_view>* fields) {
  if (std::memchr(line.data(), '"', line.size())) return false;
  fields->clear();
  for (;;) {
    const size_t comma = line.find(',');
    if (comma == std::string_view::npos) {
      fields->push_back(line);
      return true;
    }
    fields->push_back(line.substr(0, comma));
    line.remove_prefix(comma + 1);
  }
}

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
