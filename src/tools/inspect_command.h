// `modelcache inspect FILE [--json]`: what a safetensors file holds.
//
// Reads and validates the file's header (not its data) and prints every tensor
// (name, dtype, shape, data offsets, bytes), the metadata and the totals. With
// `json`, prints one JSON object on one line instead:
//
//   {"file": "...", "header_bytes": N, "data_bytes": D,
//    "metadata": {"key": "value", ...},
//    "tensors": [{"name": "...", "dtype": "F32", "shape": [2, 3],
//                 "data_offsets": [begin, end], "bytes": 24}, ...]}
//
// header_bytes is N, the JSON header length stored in the file's first 8
// bytes; the data buffer starts at byte 8 + N. Tensors are listed in data
// order (by begin offset).
#ifndef MODELCACHE_TOOLS_INSPECT_COMMAND_H_
#define MODELCACHE_TOOLS_INSPECT_COMMAND_H_

#include <ostream>
#include <string>

namespace modelcache::tools {

// Runs the subcommand on `file` and returns the exit status: 0 on success,
// with the listing on `out` and nothing on `err`; 1 when the file cannot be
// read or is not a valid safetensors file, with nothing on `out` and exactly
// one line on `err`: "error: <file>: <problem>".
int RunInspect(const std::string& file, bool json, std::ostream& out,
               std::ostream& err);

}  // namespace modelcache::tools

#endif  // MODELCACHE_TOOLS_INSPECT_COMMAND_H_
