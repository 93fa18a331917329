// Byte counts as people read them, for messages, reports and tools.
#ifndef MODELCACHE_BASE_BYTES_H_
#define MODELCACHE_BASE_BYTES_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace modelcache {

// Binary units with two decimals: "512 B", "1.50 KiB", "12.00 MiB",
// "1.50 GiB", up to PiB.
std::string FormatBytes(uint64_t bytes);

// "16GiB", "512 MiB", "1.5GiB", "4096" (bytes): binary units KiB, MiB, GiB,
// TiB and decimal KB, MB, GB, TB, optionally spaced, rounded to whole bytes.
// Throws Error kInvalidArgument on anything else, and on sizes of 2^64 bytes
// or more.
uint64_t ParseBytes(std::string_view text);

}  // namespace modelcache

#endif  // MODELCACHE_BASE_BYTES_H_
