#include "modelcache/base/bytes.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <utility>

#include "modelcache/base/errors.h"

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

namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) {
    s.remove_suffix(1);
  }
  return s;
}

}  // namespace

uint64_t ParseBytes(std::string_view text) {
  const std::string_view s = Trim(text);
  double value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end == s.data() || value < 0 ||
      !std::isfinite(value)) {
    throw Error(ErrorCode::kInvalidArgument,
                "not a byte size: '" + std::string(text) + "'");
  }
  const std::string_view unit =
      Trim(s.substr(static_cast<size_t>(end - s.data())));
  static constexpr std::pair<std::string_view, double> kUnits[] = {
      {"", 1},         {"B", 1},        {"KiB", 0x1p10}, {"MiB", 0x1p20},
      {"GiB", 0x1p30}, {"TiB", 0x1p40}, {"KB", 1e3},     {"MB", 1e6},
      {"GB", 1e9},     {"TB", 1e12}};
  for (const auto& [name, factor] : kUnits) {
    if (unit != name) continue;
    const double bytes = std::nearbyint(value * factor);
    if (bytes >= 0x1p64) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "byte size '" + std::string(text) + "' is 2^64 bytes or more");
    }
    return static_cast<uint64_t>(bytes);
  }
  throw Error(ErrorCode::kInvalidArgument,
              "not a byte size: '" + std::string(text) +
                  "' (use a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or "
                  "TB)");
}

}  // namespace modelcache
