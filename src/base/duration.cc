// ParseDurationMs (modelcache/base/duration.h).
#include "modelcache/base/duration.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "modelcache/base/csv.h"
#include "modelcache/base/errors.h"

namespace modelcache {

double ParseDurationMs(std::string_view text) {
  const std::string_view s = csv::Trim(text);
  double value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec == std::errc() && end != s.data() && value >= 0 &&
      std::isfinite(value)) {
    const std::string_view unit =
        csv::Trim(s.substr(static_cast<size_t>(end - s.data())));
    static const std::pair<std::string_view, double> kUnits[] = {
        {"", 1},      {"ms", 1},      {"s", 1000},
        {"m", 60000}, {"min", 60000}, {"h", 3600000}};
    for (const auto& [name, factor] : kUnits) {
      if (unit == name) return value * factor;
    }
  }
  throw Error(ErrorCode::kInvalidArgument,
              "not a duration: '" + std::string(text) +
                  "' (use a number with ms, s, m or h)");
}

std::optional<double> ParseDrainAfterMs(std::string_view text) {
  const std::string_view s = csv::Trim(text);
  if (s == "default") return std::nullopt;
  if (s == "inf" || s == "never") {
    return std::numeric_limits<double>::infinity();
  }
  return ParseDurationMs(text);
}

}  // namespace modelcache
