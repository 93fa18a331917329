// SplitCsv and SplitPlain (modelcache/base/csv.h).
#include "modelcache/base/csv.h"

#include <cstring>

namespace modelcache::csv {

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

}  // namespace modelcache::csv
