// A trace as a source (replay.h's TraceSource): an in-memory trace as one,
// and a source collected into memory.
#include <algorithm>
#include <memory>

#include "modelcache/replay/replay.h"
#include "trace_internal.h"

namespace modelcache::replay {
namespace {

class MemorySource : public TraceSource {
 public:
  explicit MemorySource(const Trace& trace)
      : trace_(trace), header_(HeaderOf(trace)) {}
  const TraceHeader& header() const override { return header_; }
  std::unique_ptr<RequestReader> Read() const override {
    return std::make_unique<Reader>(trace_);
  }

 private:
  class Reader : public RequestReader {
   public:
    explicit Reader(const Trace& trace) : trace_(trace) {}
    size_t Read(Request* requests, float* hold_ms, size_t max) override {
      const size_t n =
          std::min(max, trace_.requests.size() - static_cast<size_t>(next_));
      std::copy_n(trace_.requests.data() + next_, n, requests);
      if (!trace_.hold_ms.empty()) {
        std::copy_n(trace_.hold_ms.data() + next_, n, hold_ms);
      }
      next_ += n;
      return n;
    }

   private:
    const Trace& trace_;
    size_t next_ = 0;
  };

  const Trace& trace_;
  const TraceHeader header_;
};

}  // namespace

TraceHeader HeaderOf(const Trace& trace) {
  TraceHeader header;
  header.models = trace.models;
  header.sizes = trace.sizes;
  header.requests = trace.requests.size();
  if (!trace.requests.empty()) {
    header.t_first_ms = trace.requests.front().t_ms;
    header.t_last_ms = trace.requests.back().t_ms;
  }
  header.service_times = !trace.hold_ms.empty();
  return header;
}

Trace CollectTrace(const TraceSource& source) {
  const TraceHeader& header = source.header();
  Trace trace;
  trace.models = header.models;
  trace.sizes = header.sizes;
  trace.requests.resize(header.requests);
  if (header.service_times) trace.hold_ms.resize(header.requests);
  const std::unique_ptr<RequestReader> reader = source.Read();
  size_t at = 0;
  while (at < trace.requests.size()) {
    const size_t n =
        reader->Read(trace.requests.data() + at,
                     header.service_times ? trace.hold_ms.data() + at : nullptr,
                     trace.requests.size() - at);
    if (n == 0) break;
    at += n;
  }
  Request extra;
  float extra_hold = 0;
  if (at != trace.requests.size() ||
      reader->Read(&extra, &extra_hold, 1) != 0) {
    throw TraceError(
        "a trace source gave " +
        std::string(at == trace.requests.size() ? "more" : "fewer") +
        " requests than its header's " + std::to_string(header.requests));
  }
  return trace;
}

std::unique_ptr<TraceSource> SourceOf(const Trace& trace) {
  return std::make_unique<MemorySource>(trace);
}

}  // namespace modelcache::replay
