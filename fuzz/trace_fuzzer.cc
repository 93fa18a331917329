// libFuzzer target: arbitrary bytes as each of the files `modelcache replay`
// reads.
//
// The input is written to a file and read as a CSV trace (with a sizes
// table for models it does not size), as a sizes table, as an Azure
// Functions invocations file (even arrivals and Poisson arrivals), and as the
// memory file and the durations file of a small, valid invocations file
// whose functions are those of the shared Azure trace (so that the real
// memory and durations files, given as seeds, match its rows).
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

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "modelcache/base/errors.h"
#include "modelcache/replay/replay.h"

namespace {

using modelcache::replay::AzureOptions;
using modelcache::replay::ReadAzureFunctionsTrace;
using modelcache::replay::ReadCsvTrace;
using modelcache::replay::ReadSizes;
using modelcache::replay::SizeTable;
using modelcache::replay::Trace;

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
  Expect([&] { CheckTrace(ReadCsvTrace(input, &kSizes)); });
  Expect([&] { ReadSizes(input); });
  for (bool poisson : {false, true}) {
    AzureOptions options;
    options.poisson = poisson;
    options.max_requests = kMaxRequests;
    Expect([&] { CheckTrace(ReadAzureFunctionsTrace(input, options)); });
  }
  AzureOptions memory;
  memory.memory_path = input;
  memory.memory_scale = 32;
  Expect([&] { CheckTrace(ReadAzureFunctionsTrace(invocations, memory)); });
  AzureOptions durations;
  durations.durations_path = input;
  Expect([&] { CheckTrace(ReadAzureFunctionsTrace(invocations, durations)); });
  return 0;
}
