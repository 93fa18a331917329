// Loading a 2 GiB safetensors file from a warm page cache, side by side with
// the baselines that bound it:
//
//   LoadSafetensors_sequential_read_*  read(2) of the whole file into one
//                                      buffer, as `cat` does
//   LoadSafetensors_memcpy_*/threads:N copying the same bytes from memory to
//                                      memory: the physical limit for a warm
//                                      page cache
//   LoadSafetensors_pread/threads:N  WeightSet::Open in pread mode, into a
//                                    new buffer from the default allocator
//   LoadSafetensors_pread_recycled/threads:N
//                                    the same through a
//                                    RecyclingHostBufferAllocator, so each
//                                    load after the first lands in the
//                                    buffer the previous one released
//   LoadSafetensors_mmap             WeightSet::Open in mmap mode, then one
//                                    read per 4 KiB page
//   LoadSafetensors_mmap_open/SIZE   WeightSet::Open in mmap mode alone, for a
//                                    1 MiB and a 2 GiB file: the cost of
//                                    opening must not depend on the size
//
// Every benchmark reports bytes_per_second. The file is generated once per
// run (in $TMPDIR, removed at exit) and read once before timing so that the
// page cache is warm.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "modelcache/weights/host_buffer.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"

namespace {

namespace fs = std::filesystem;
namespace w = modelcache::weights;

constexpr uint64_t kLargeBytes = uint64_t{2} << 30;
constexpr uint64_t kSmallBytes = uint64_t{1} << 20;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "load_safetensors_bench: %s\n", what.c_str());
  std::abort();
}

// A file of `bytes` data bytes: 64 F32 tensors, like a model's layers.
std::string MakeFile(const std::string& name, uint64_t bytes) {
  const std::string path =
      (fs::temp_directory_path() /
       ("modelcache_bench_" + std::to_string(::getpid()) + "_" + name))
          .string();
  w::SafetensorsWriter writer;
  const uint64_t per_tensor = bytes / 64 / 4;
  for (int i = 0; i < 64; ++i) {
    writer.AddTensor("layer." + std::to_string(i) + ".weight", w::Dtype::kF32,
                     {per_tensor}, w::PatternFill(i));
  }
  writer.Write(path);
  return path;
}

struct Files {
  std::string large = MakeFile("large.safetensors", kLargeBytes);
  std::string small = MakeFile("small.safetensors", kSmallBytes);
  ~Files() {
    fs::remove(large);
    fs::remove(small);
  }
};

// Made on first use, removed when the program exits.
const Files& TheFiles() {
  static const Files files;
  return files;
}

uint64_t FileSize(const std::string& path) { return fs::file_size(path); }

void SequentialRead(const std::string& path, char* buffer, uint64_t size) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) Die("cannot open " + path);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, buffer + done, size - done);
    if (n <= 0) Die("read failed");
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
}

void Warm(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) Die("cannot open " + path);
  std::vector<char> chunk(1 << 20);
  while (::read(fd, chunk.data(), chunk.size()) > 0) {
  }
  ::close(fd);
}

// The baselines come in two forms, each the bound for one pread form.
// "new buffer": into memory allocated for that copy by the allocator a pread
// load uses by default (2 MiB aligned, huge pages advised), so the
// destination's page faults and zeroing are part of the cost, as they are
// for LoadSafetensors_pread. "reused buffer": into memory already faulted
// in, as `cat` does and as LoadSafetensors_pread_recycled does: pure
// copying.

// A buffer from the allocator pread loads use by default.
class DefaultBuffer {
 public:
  explicit DefaultBuffer(uint64_t size)
      : size_(size),
        data_(static_cast<char*>(w::DefaultHostBufferAllocator()->Allocate(
            size, w::kHugePageBytes))) {}
  ~DefaultBuffer() {
    w::DefaultHostBufferAllocator()->Deallocate(data_, size_,
                                                w::kHugePageBytes);
  }
  DefaultBuffer(const DefaultBuffer&) = delete;
  DefaultBuffer& operator=(const DefaultBuffer&) = delete;
  char* get() const { return data_; }

 private:
  const uint64_t size_;
  char* const data_;
};

void SequentialReadLoop(benchmark::State& state, bool reuse) {
  const std::string& path = TheFiles().large;
  Warm(path);
  const uint64_t size = FileSize(path);
  std::unique_ptr<DefaultBuffer> reused;
  if (reuse) {
    reused = std::make_unique<DefaultBuffer>(size);
    std::memset(reused->get(), 1, size);  // nonzero, so really faulted in
  }
  for (auto _ : state) {
    std::unique_ptr<DefaultBuffer> fresh(
        reuse ? nullptr : std::make_unique<DefaultBuffer>(size));
    char* buffer = reuse ? reused->get() : fresh->get();
    SequentialRead(path, buffer, size);
    benchmark::DoNotOptimize(buffer[size / 2]);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size));
}

void MemcpyLoop(benchmark::State& state, bool reuse) {
  const int threads = static_cast<int>(state.range(0));
  const uint64_t size = kLargeBytes;
  DefaultBuffer from(size);
  std::memset(from.get(), 1, size);
  std::unique_ptr<DefaultBuffer> reused;
  if (reuse) {
    reused = std::make_unique<DefaultBuffer>(size);
    std::memset(reused->get(), 1, size);
  }
  for (auto _ : state) {
    std::unique_ptr<DefaultBuffer> fresh(
        reuse ? nullptr : std::make_unique<DefaultBuffer>(size));
    char* to = reuse ? reused->get() : fresh->get();
    std::vector<std::thread> workers;
    const uint64_t part = size / threads;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back(
          [&, t] { std::memcpy(to + t * part, from.get() + t * part, part); });
    }
    for (auto& worker : workers) worker.join();
    benchmark::DoNotOptimize(to[size / 2]);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size));
}

void BM_LoadSafetensors_sequential_read_new_buffer(benchmark::State& state) {
  SequentialReadLoop(state, false);
}
void BM_LoadSafetensors_sequential_read_reused_buffer(benchmark::State& state) {
  SequentialReadLoop(state, true);
}
void BM_LoadSafetensors_memcpy_new_buffer(benchmark::State& state) {
  MemcpyLoop(state, false);
}
void BM_LoadSafetensors_memcpy_reused_buffer(benchmark::State& state) {
  MemcpyLoop(state, true);
}

void PreadLoop(benchmark::State& state, bool recycle) {
  const std::string& path = TheFiles().large;
  Warm(path);
  w::LoadOptions options;
  options.mode = w::LoadMode::kPread;
  options.threads = static_cast<int>(state.range(0));
  if (recycle) {
    options.allocator =
        std::make_shared<w::RecyclingHostBufferAllocator>(kLargeBytes);
    w::WeightSet::Open(path, options);  // leaves its buffer to be recycled
  }
  uint64_t bytes = 0;
  for (auto _ : state) {
    w::WeightSet set = w::WeightSet::Open(path, options);
    bytes += set.data_bytes();
    benchmark::DoNotOptimize(set.data()[set.data_bytes() / 2]);
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
}

void BM_LoadSafetensors_pread(benchmark::State& state) {
  PreadLoop(state, false);
}
void BM_LoadSafetensors_pread_recycled(benchmark::State& state) {
  PreadLoop(state, true);
}

void BM_LoadSafetensors_mmap(benchmark::State& state) {
  const std::string& path = TheFiles().large;
  Warm(path);
  uint64_t bytes = 0;
  for (auto _ : state) {
    w::WeightSet set = w::WeightSet::Open(path);
    const auto data = set.data();
    unsigned sum = 0;
    for (size_t i = 0; i < data.size(); i += 4096) {
      sum += static_cast<unsigned>(data[i]);
    }
    benchmark::DoNotOptimize(sum);
    bytes += set.data_bytes();
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
}

void BM_LoadSafetensors_mmap_open(benchmark::State& state) {
  const std::string& path =
      state.range(0) == 0 ? TheFiles().small : TheFiles().large;
  Warm(path);
  uint64_t bytes = 0;
  for (auto _ : state) {
    w::WeightSet set = w::WeightSet::Open(path);
    benchmark::DoNotOptimize(set.data().data());
    bytes += set.data_bytes();
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.SetLabel(state.range(0) == 0 ? "1MiB" : "2GiB");
}

// Milliseconds of wall time, for `threads` 1 and 2 (copies) or 1, 2 and 4
// (loads).
void CopyThreads(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1)->Arg(2);
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}
void LoadThreads(benchmark::internal::Benchmark* b) {
  CopyThreads(b);
  b->Arg(4);
}

BENCHMARK(BM_LoadSafetensors_sequential_read_new_buffer)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_LoadSafetensors_sequential_read_reused_buffer)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_LoadSafetensors_memcpy_new_buffer)->Apply(CopyThreads);
BENCHMARK(BM_LoadSafetensors_memcpy_reused_buffer)->Apply(CopyThreads);
BENCHMARK(BM_LoadSafetensors_pread)->Apply(LoadThreads);
BENCHMARK(BM_LoadSafetensors_pread_recycled)->Apply(LoadThreads);
BENCHMARK(BM_LoadSafetensors_mmap)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_LoadSafetensors_mmap_open)
    ->ArgName("size")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
