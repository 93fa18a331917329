// Durations as people write them, for flags and files.
#ifndef MODELCACHE_BASE_DURATION_H_
#define MODELCACHE_BASE_DURATION_H_

#include <string_view>

namespace modelcache {

// "100ms", "2s", "10m", "1.5h", or a bare number of milliseconds; also
// "min" for minutes, and blanks around the number and its unit. Throws
// Error kInvalidArgument on anything else, negative and infinite values
// included.
double ParseDurationMs(std::string_view text);

}  // namespace modelcache

#endif  // MODELCACHE_BASE_DURATION_H_
