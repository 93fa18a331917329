// libFuzzer target: arbitrary bytes as each of the files `modelcache replay`
// reads.
//
// The input is written to a file and read as a CSV trace (with a sizes
// table for models it does not size), as a sizes table, as an Azure
// Functions invocations file (even arrivals and Poisson arrivals), and as the
// memory file and the durations file of a small, valid invocations file
// whose functions are those of the shared Azure trace (so that the real
// memory and durations files, given as seeds, match its rows). The CSV and
// Azure Functions files are read both in memory and as a stream
// (OpenCsvTrace, OpenAzureFunctionsTrace), which must agree: the same
// error, or the same header and requests. Input that starts with gzip's or
// zstd's magic bytes is decompressed first, so the decoders are fuzzed too.
// Then the input is compressed with each, and the copy must read as the
// input did; cut short, the copy must be an error.
//
// Each reader must either throw modelcache::Error (TraceError) with a
// message naming the file, or return a trace that holds together: one size
// per model, every request's model among them, requests sorted by time,
// service times (if any) one per request, finite and not negative. Any
// other exception escapes and counts as a crash, as do violations (a trap),
// memory errors (ASan) and undefined behaviour (UBSan, no recovery). The
// Azure reader is capped at kMaxRequests so that a large invocation count is
// an error here, not an allocation past the fuzzer's memory limit.
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/replay/replay.h"

namespace {

using modelcache::replay::AzureOptions;
using modelcache::replay::OpenAzureFunctionsTrace;
using modelcache::replay::OpenCsvTrace;
using modelcache::replay::ReadAzureFunctionsTrace;
using modelcache::replay::ReadCsvTrace;
using modelcache::replay::ReadSizes;
using modelcache::replay::Request;
using modelcache::replay::SizeTable;
using modelcache::replay::Trace;
using modelcache::replay::TraceSource;

constexpr uint64_t kMaxRequests = 1 << 20;

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

void CheckTrace(const Trace& trace) {
  Check(trace.sizes.size() == trace.models.size());
  Check(trace.hold_ms.empty() || trace.hold_ms.size() == trace.requests.size());
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    Check(trace.requests[i].model < trace.models.size());
    if (i > 0) Check(trace.requests[i - 1].t_ms <= trace.requests[i].t_ms);
  }
  for (float hold : trace.hold_ms) Check(std::isfinite(hold) && hold >= 0);
}

// Runs one reader; a modelcache::Error is the clear error bad input gets.
template <typename Read>
void Expect(Read read) {
  try {
    read();
  } catch (const modelcache::Error&) {
  }
}

// A reader's trace, or its error's message.
struct Outcome {
  std::string error;
  Trace trace;
};

Outcome Run(const std::function<Trace()>& read) {
  Outcome outcome;
  try {
    outcome.trace = read();
    CheckTrace(outcome.trace);
  } catch (const modelcache::Error& e) {
    outcome.error = e.what();
    Check(!outcome.error.empty());
  }
  return outcome;
}

// Everything a source gives, read a few requests at a time, as a Trace.
Trace Collect(const TraceSource& source) {
  Trace trace;
  trace.models = source.header().models;
  trace.sizes = source.header().sizes;
  auto reader = source.Read();
  Request requests[7];
  float hold[7];
  for (size_t n; (n = reader->Read(requests, hold, 7)) > 0;) {
    trace.requests.insert(trace.requests.end(), requests, requests + n);
    if (source.header().service_times)
      trace.hold_ms.insert(trace.hold_ms.end(), hold, hold + n);
  }
  const auto& header = source.header();
  Check(header.requests == trace.requests.size());
  Check(header.service_times == !trace.hold_ms.empty());
  if (!trace.requests.empty()) {
    Check(header.t_first_ms == trace.requests.front().t_ms);
    Check(header.t_last_ms == trace.requests.back().t_ms);
  }
  return trace;
}

bool Same(const Outcome& a, const Outcome& b) {
  if (a.error != b.error) return false;
  const Trace &x = a.trace, &y = b.trace;
  if (x.models != y.models || x.sizes != y.sizes || x.hold_ms != y.hold_ms ||
      x.requests.size() != y.requests.size()) {
    return false;
  }
  for (size_t i = 0; i < x.requests.size(); ++i) {
    if (x.requests[i].t_ms != y.requests[i].t_ms ||
        x.requests[i].model != y.requests[i].model) {
      return false;
    }
  }
  return true;
}

// Both compressors keep their state across inputs (allocating it is most of
// their cost on small inputs).
std::string Gzip(const uint8_t* data, size_t size) {
  static z_stream* const z = [] {
    auto* stream = new z_stream{};
    if (deflateInit2(stream, 1, Z_DEFLATED, 16 + 15, 8, Z_DEFAULT_STRATEGY) !=
        Z_OK) {
      __builtin_trap();
    }
    return stream;
  }();
  Check(deflateReset(z) == Z_OK);
  std::string out(deflateBound(z, size) + 64, '\0');
  z->next_in = const_cast<Bytef*>(data);
  z->avail_in = static_cast<uInt>(size);
  z->next_out = reinterpret_cast<Bytef*>(out.data());
  z->avail_out = static_cast<uInt>(out.size());
  Check(deflate(z, Z_FINISH) == Z_STREAM_END);
  out.resize(z->total_out);
  return out;
}

std::string Zstd(const uint8_t* data, size_t size) {
  static ZSTD_CCtx* const cctx = ZSTD_createCCtx();
  std::string out(ZSTD_compressBound(size), '\0');
  const size_t n =
      ZSTD_compressCCtx(cctx, out.data(), out.size(), data, size, 1);
  Check(!ZSTD_isError(n));
  out.resize(n);
  return out;
}

std::string TempPath(const char* what) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/modelcache_trace_fuzzer." +
         std::to_string(getpid()) + "." + what;
}

// A file removed when the fuzzer exits.
class TempFile {
 public:
  explicit TempFile(const char* what) : path_(TempPath(what)) {}
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  const std::string path_;
};

void Write(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data),
            static_cast<std::streamsize>(size));
}

// Up to five function hashes of the shared Azure trace, for the small
// invocations file; made-up ones if the trace is not there.
std::string SmallInvocations() {
  std::string hashes[5] = {"f0", "f1", "f2", "f3", "f4"};
  std::ifstream in(std::string(MODELCACHE_SHARED_DATA) +
                   "/traces/azure-functions-2019-100fn.csv");
  std::string line;
  std::getline(in, line);  // header
  for (std::string& hash : hashes) {
    if (!std::getline(in, line)) break;
    // HashOwner,HashApp,HashFunction,...
    const size_t a = line.find(','), b = line.find(',', a + 1),
                 c = line.find(',', b + 1);
    if (c == std::string::npos) break;
    hash = line.substr(b + 1, c - b - 1);
  }
  std::string file = "HashOwner,HashApp,HashFunction,Trigger,0,1,2\n";
  for (size_t i = 0; i < 5; ++i) {
    file += "o,a," + hashes[i] + ",http," + std::to_string(i + 1) + ",0," +
            std::to_string(2 * i) + "\n";
  }
  return file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const TempFile input_file("input");
  static const TempFile invocations_file("invocations");
  static const bool written = [] {
    const std::string text = SmallInvocations();
    Write(invocations_file.path(),
          reinterpret_cast<const uint8_t*>(text.data()), text.size());
    return true;
  }();
  (void)written;
  const std::string& input = input_file.path();
  const std::string& invocations = invocations_file.path();
  Write(input, data, size);

  static const SizeTable kSizes = {{"a", 1}, {"b", 1 << 20}};
  // The CSV reader, in memory and as a stream.
  const Outcome csv = Run([&] { return ReadCsvTrace(input, &kSizes); });
  Check(Same(csv, Run([&] { return Collect(*OpenCsvTrace(input, &kSizes)); })));
  Expect([&] { ReadSizes(input); });
  for (bool poisson : {false, true}) {
    AzureOptions options;
    options.poisson = poisson;
    options.max_requests = kMaxRequests;
    const Outcome azure =
        Run([&] { return ReadAzureFunctionsTrace(input, options); });
    Check(Same(azure, Run([&] {
                 return Collect(*OpenAzureFunctionsTrace(input, options));
               })));
  }
  AzureOptions memory;
  memory.memory_path = input;
  memory.memory_scale = 32;
  Expect([&] { CheckTrace(ReadAzureFunctionsTrace(invocations, memory)); });
  AzureOptions durations;
  durations.durations_path = input;
  const Outcome with_durations =
      Run([&] { return ReadAzureFunctionsTrace(invocations, durations); });
  Check(Same(with_durations, Run([&] {
               return Collect(*OpenAzureFunctionsTrace(invocations, durations));
             })));

  // Compressed, the input reads as it did (the same path, so the same
  // messages); cut short, it is an error. (Unless the input is compressed
  // data itself: the readers undo one layer.)
  const bool packed_input =
      size >= 2 && ((data[0] == 0x1f && data[1] == 0x8b) ||
                    (size >= 4 && data[0] == 0x28 && data[1] == 0xb5 &&
                     data[2] == 0x2f && data[3] == 0xfd));
  if (packed_input) return 0;
  for (const std::string& packed : {Gzip(data, size), Zstd(data, size)}) {
    Write(input, reinterpret_cast<const uint8_t*>(packed.data()),
          packed.size());
    Check(Same(csv, Run([&] { return ReadCsvTrace(input, &kSizes); })));
    // Past the magic bytes, before the end.
    const size_t cut = 4 + (size > 0 ? data[0] : 0) % (packed.size() - 4);
    Write(input, reinterpret_cast<const uint8_t*>(packed.data()), cut);
    Check(!Run([&] { return ReadCsvTrace(input, &kSizes); }).error.empty());
    Check(!Run([&] {
             return Collect(*OpenCsvTrace(input, &kSizes));
           }).error.empty());
  }
  return 0;
}
