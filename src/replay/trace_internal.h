// What the Azure Functions readers (in memory, trace.cc, and as a stream,
// trace_stream.cc) share: the models and their sizes, and the service times
// drawn from the durations file.
#ifndef MODELCACHE_SRC_REPLAY_TRACE_INTERNAL_H_
#define MODELCACHE_SRC_REPLAY_TRACE_INTERNAL_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "modelcache/replay/replay.h"

namespace modelcache::replay {

// The models of an Azure Functions trace whose kept functions (those with a
// request) have `hashes`, in file order: "model-<i>", sized by
// options.sizes, else by the memory file, else by DefaultModelSize. Throws
// TraceError as ReadAzureFunctionsTrace documents.
void AzureModels(const std::string& path, const AzureOptions& options,
                 const std::vector<std::string>& hashes,
                 std::vector<std::string>* names, std::vector<uint64_t>* sizes);

// Service times from options.durations_path: one seeded draw per request,
// taken in the trace's order, from its function's duration percentiles.
class AzureDurations {
 public:
  // Reads the durations file; throws TraceError for a bad file or a function
  // it has no row for.
  AzureDurations(const AzureOptions& options,
                 const std::vector<std::string>& hashes);
  // The next request's service time, for a request of `function`.
  float Draw(uint32_t function);

 private:
  std::vector<std::vector<double>> per_function_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> uniform_{0, 1};
};

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_TRACE_INTERNAL_H_
