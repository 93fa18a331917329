// Small formatting helpers shared by the core's error messages.
#ifndef MODELCACHE_SRC_CORE_FORMAT_H_
#define MODELCACHE_SRC_CORE_FORMAT_H_

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

namespace modelcache::detail {

// "1.50 GiB", "12.0 MiB", "512 B".
inline std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B",
                  static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  }
  return buf;
}

// The message of an exception, for events and error text.
inline std::string DescribeException(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_FORMAT_H_
