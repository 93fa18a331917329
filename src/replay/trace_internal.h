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

// The message for a model of a CSV trace that has no size: where to give
// one (a size_bytes column, --sizes, or the sizes file `sizes_path` that
// lacks it when `sizes` is given).
inline std::string NoSizeMessage(const std::string& model,
                                 const SizeTable* sizes,
                                 const std::string& sizes_path) {
  if (sizes == nullptr) {
    return "model '" + model +
           "' has no size: give a size_bytes column or --sizes FILE";
  }
  return "model '" + model + "' has no size: no size_bytes here, and the " +
         (sizes_path.empty() ? std::string("sizes file")
                             : "sizes file " + sizes_path) +
         " has no row for it (add '" + model + ",SIZE_BYTES' there)";
}

// The message for a CSV trace's header that lacks 't_ms' or 'model';
// `azure_like`: the header names HashFunction, as the Azure Functions
// trace's does.
inline std::string MissingColumnsMessage(bool has_t_ms, bool azure_like) {
  std::string message =
      std::string("the header must name the columns 't_ms' and 'model'") +
      (has_t_ms ? " (no 'model')" : " (no 't_ms')");
  if (azure_like) {
    message +=
        ": it looks like an Azure Functions trace (HashOwner, HashApp, "
        "HashFunction, then a count per minute); give --format "
        "azure-functions";
  }
  return message;
}

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
