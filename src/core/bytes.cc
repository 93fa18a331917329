#include "modelcache/core/bytes.h"

#include <cstdio>

namespace modelcache {

std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  constexpr int kLastUnit = 5;
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < kLastUnit) {
    value /= 1024.0;
    ++unit;
  }
  char buf[48];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B",
                  static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  }
  return buf;
}

}  // namespace modelcache
