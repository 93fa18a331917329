// Traces read as a stream: a TraceSource gives a trace's header before its
// requests, and its requests in passes (csv_trace.cc, azure_trace.cc,
// trace_stream.cc).
#ifndef MODELCACHE_REPLAY_TRACE_SOURCE_H_
#define MODELCACHE_REPLAY_TRACE_SOURCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/replay/trace.h"

namespace modelcache::replay {

// Every file replay reads (traces, sizes, memory and durations files) may be
// compressed: gzip and zstd are recognised by their first bytes, and data
// that is truncated or corrupt is a TraceError naming the file and the line
// being read.
//
// A trace too large to hold is read as a stream. A TraceSource knows the
// trace's models and extent (its TraceHeader) before any request is read,
// and gives its requests in order, once per pass, as many passes as asked:
// a replay holds memory in proportion to the models and to the requests in
// flight, never to the trace. OpenCsvTrace and OpenAzureFunctionsTrace read
// their file once when opened (to learn the header, with every check and
// message of ReadCsvTrace and ReadAzureFunctionsTrace: each format has one
// parser, which the in-memory reader uses too), and the CSV source reads it
// again for each pass; the requests of a pass are exactly those the
// in-memory reader gives.

// A trace without its requests: what a replay needs to know before the
// first request.
struct TraceHeader {
  std::vector<std::string> models;  // index -> name
  std::vector<uint64_t> sizes;      // index -> bytes
  uint64_t requests = 0;
  // The first and the last request's time (0 when there are none).
  int64_t t_first_ms = 0, t_last_ms = 0;
  // Each request carries its service time (Trace::hold_ms).
  bool service_times = false;
};

TraceHeader HeaderOf(const Trace& trace);

// One pass over a trace's requests.
class RequestReader {
 public:
  virtual ~RequestReader() = default;
  // Copies up to `max` (> 0) next requests into `requests`, and their
  // service times into `hold_ms` when the header says it has them (else
  // `hold_ms` is not used and may be null); returns how many, 0 only at the
  // end of the trace. Throws TraceError (a file that changed or broke since
  // the source was opened).
  virtual size_t Read(Request* requests, float* hold_ms, size_t max) = 0;
};

class TraceSource {
 public:
  virtual ~TraceSource() = default;
  virtual const TraceHeader& header() const = 0;
  // A new pass, from the first request. Passes are independent: several may
  // be open at once, on different threads.
  virtual std::unique_ptr<RequestReader> Read() const = 0;
};

struct StreamOptions {
  // Called now and then while a file is first read, from the calling
  // thread, with the bytes of the file read so far and its size (0 when it
  // is not a regular file).
  std::function<void(uint64_t done, uint64_t total)> progress;
  // The file the sizes table came from, for the error of a model it lacks.
  std::string sizes_path;
};

// The CSV of ReadCsvTrace, as a stream. Opening reads the whole file once
// (its models, sizes, requests and span); each pass reads it again.
// Holds the models' names and sizes, and one buffer of the file.
std::unique_ptr<TraceSource> OpenCsvTrace(const std::string& path,
                                          const SizeTable* sizes,
                                          const StreamOptions& stream = {});

// The Azure Functions layout of ReadAzureFunctionsTrace, as a stream.
// Opening reads the file: its non-zero counts are kept (memory in proportion
// to the file, not to the requests they stand for). A pass expands them a
// minute at a time, merging the functions' requests of each minute by time;
// with Poisson arrivals it keeps a random number generator per function
// (5 KB each) and the draws of the minute being read (at most 480 KB per
// function). options.max_requests caps the requests as it does there.
std::unique_ptr<TraceSource> OpenAzureFunctionsTrace(
    const std::string& path, const AzureOptions& options,
    const StreamOptions& stream = {});

// An in-memory trace as a source (no copy). REQUIRES: `trace` outlives it.
std::unique_ptr<TraceSource> SourceOf(const Trace& trace);

}  // namespace modelcache::replay

#endif  // MODELCACHE_REPLAY_TRACE_SOURCE_H_
