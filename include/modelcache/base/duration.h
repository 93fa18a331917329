// Durations as people write them, for flags and files.
#ifndef MODELCACHE_BASE_DURATION_H_
#define MODELCACHE_BASE_DURATION_H_

#include <optional>
#include <string_view>

namespace modelcache {

// "100ms", "2s", "10m", "1.5h", or a bare number of milliseconds; also
// "min" for minutes, and blanks around the number and its unit. Throws
// Error kInvalidArgument on anything else, negative and infinite values
// included.
double ParseDurationMs(std::string_view text);

// A drain_after as the CLI takes it (`modelcache replay --drain-after`,
// `modelcache serve --drain-after`): "default" is nullopt (the library's
// kDefaultDrainAfter), "inf" or "never" is +infinity (models in use never
// drain), anything else a duration as ParseDurationMs reads it, 0 included
// (strict arrival order). Throws as ParseDurationMs does.
std::optional<double> ParseDrainAfterMs(std::string_view text);

}  // namespace modelcache

#endif  // MODELCACHE_BASE_DURATION_H_
