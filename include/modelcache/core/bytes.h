// Byte counts as people read them, for messages, reports and tools.
#ifndef MODELCACHE_CORE_BYTES_H_
#define MODELCACHE_CORE_BYTES_H_

#include <cstdint>
#include <string>

namespace modelcache {

// Binary units with two decimals: "512 B", "1.50 KiB", "12.00 MiB",
// "1.50 GiB", up to PiB.
std::string FormatBytes(uint64_t bytes);

}  // namespace modelcache

#endif  // MODELCACHE_CORE_BYTES_H_
