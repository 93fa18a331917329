// `modelcache ring --nodes n1:1:100,n2:2:100,... --models FILE
//  [--kill n2,...] [--hash-type "consistent"]`: which node HAProxy 2.6 sends
// each model to (modelcache/replay/ring.h).
//
// Prints CSV on stdout. Without --kill, one row per model, in the file's
// order:
//
//   model,node
//   llama-3-8b,n2
//
// With --kill, the moved set: the models whose node changes when the named
// nodes go down at run time (as after a failed health check), with the node
// before and after:
//
//   model,from,to
//
// Only the killed nodes' models move under `hash-type consistent`; under
// `map-based` the whole map is rebuilt and most models move.
#ifndef MODELCACHE_TOOLS_RING_COMMAND_H_
#define MODELCACHE_TOOLS_RING_COMMAND_H_

#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/replay/ring.h"

namespace modelcache::tools {

struct RingFlags {
  std::string nodes;              // name:id:weight,...
  std::string models;             // FILE
  std::vector<std::string> kill;  // node names
  std::string hash_type = "consistent";
};

// "n1:1:100,n2:2:100": HAProxy `server` lines in declaration order, as
// name:id:weight. A name is letters, digits, '.', '-' and '_' (HAProxy's
// characters, less ':'); the id is 1..2147483647; the weight 1..256.
// Throws modelcache::Error kInvalidArgument ("--nodes: ...") on a malformed
// entry, and as replay::ValidateRingServers does (duplicate names or ids,
// ranges).
std::vector<replay::RingServer> ParseNodeList(std::string_view text);

// HAProxy's `hash-type` arguments, for the sdbm function it defaults to:
// "consistent" (sdbm with the avalanche step), "consistent sdbm" (without),
// "map-based" and "map-based sdbm" (without), and either with "sdbm
// avalanche". Throws Error kInvalidArgument for anything else (djb2, wt6
// and crc32 are not modelled).
struct HashType {
  bool consistent = true;
  bool avalanche = true;
};
HashType ParseHashType(std::string_view text);

// The model ids of FILE, each once, in order of first appearance. FILE is
// either one id per line, or a CSV whose first line is a header naming a
// `model` column (a `modelcache replay` trace, a sizes file); a first line
// with a comma is taken as a CSV header and must name `model`. Spaces and
// tabs around an id are dropped; blank lines are skipped. An id must be the
// bytes HAProxy hashes, as they stand in /v1/models/{id}/infer: printable
// ASCII without '/', '?' or '#' (percent-encode anything else, as clients
// do). Throws Error kInvalidData ("FILE:LINE: ...") on a bad id, a header
// without `model`, a short row or a file without ids, and kIo when FILE
// cannot be read.
std::vector<std::string> ReadModelIds(const std::string& path);

// Runs the subcommand and returns the exit status: 0 with the CSV on `out`,
// or 1 with nothing on `out` and one line on `err`, "error: <problem>" (bad
// flags as above, a --kill name not in --nodes, every node killed).
int RunRing(const RingFlags& flags, std::ostream& out, std::ostream& err);

}  // namespace modelcache::tools

#endif  // MODELCACHE_TOOLS_RING_COMMAND_H_
