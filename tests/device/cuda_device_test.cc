// The CUDA backend on a real GPU. Built only when CMake found the CUDA
// toolkit; every test skips, saying why, where CUDA is unavailable (no GPU,
// no driver, a driver older than the runtime), and fails instead under
// MODELCACHE_REQUIRE_GPU=1. Also runs the Device contract suite
// (device_contract_test.cc) over cuda:0 with a small accounting capacity.
//
// Every test checks bytes, not only books: what a copy leaves on the GPU is
// read back, where it matters on a stream of the test's own that the
// device's stream does not order.
//
// Scenarios: every GPU is enumerated as cuda:N with the default capacity's
// headroom; 64 MiB round trips byte-identical, also through many small
// staging chunks at odd offsets; a 1 GiB copy through small staging buffers
// is complete once Synchronize() returns, and a control copy read back
// without Synchronize() is seen incomplete (the device's stream is held
// back, so the control fails every time); a buffer freed right after its
// copy is never written by that copy; 8 threads copying at odd offsets, 2
// allocating and freeing and 1 synchronising lose no byte and leave the
// books at zero; the GPU memory really used is no more than the books say;
// an allocation beyond the GPU is kOutOfMemory, leaves no error behind for
// the caller and the device exact afterwards, while another library's
// pending error is left for it; Allocate(0) takes nothing; calls leave the
// calling thread's CUDA context as it was (none included); a kernel that
// writes to address 0 (in a child process) leaves the device kUnavailable,
// "context corrupted".

#include "modelcache/device/cuda_device.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device_test_util.h"
#include "gpu_test_util.h"
#include "modelcache/device/device.h"

extern char** environ;

namespace modelcache::device::testing {

std::vector<std::string> ContractBackends() { return {"Cuda"}; }

std::unique_ptr<Device> MakeContractDevice(const std::string& /*backend*/,
                                           uint64_t capacity_bytes,
                                           std::string* skip_reason) {
  const std::string why = GpuUnavailableReason();
  if (!why.empty()) {
    if (GpuRequired()) ADD_FAILURE() << "MODELCACHE_REQUIRE_GPU=1 but " << why;
    *skip_reason = why;
    return nullptr;
  }
  // Small staging buffers so the contract's MiB-sized copies go through the
  // chunked pipeline.
  return MakeCudaDevice(0, CudaDeviceOptions{.capacity_bytes = capacity_bytes,
                                             .staging_buffer_bytes = 256 << 10,
                                             .staging_buffers = 3});
}

namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

#define CUDA_ASSERT(call)                               \
  do {                                                  \
    const cudaError_t mc_error = (call);                \
    ASSERT_EQ(mc_error, cudaSuccess)                    \
        << #call << ": " << cudaGetErrorName(mc_error); \
  } while (false)

// Pinned host memory for the test's own reads.
class Pinned {
 public:
  explicit Pinned(size_t bytes) : bytes_(bytes) {
    if (cudaMallocHost(&data_, bytes) != cudaSuccess) data_ = nullptr;
  }
  ~Pinned() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

// Reads what has landed on the GPU, on a stream of the test's own that
// nothing orders after the device's stream. Its stream and pinned staging
// are made up front, so that a read never waits on anything else (some
// allocation calls synchronise the device).
class BehindTheDevicesBack {
 public:
  explicit BehindTheDevicesBack(size_t max_bytes) : staging_(max_bytes) {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
    EXPECT_NE(staging_.data(), nullptr);
  }
  ~BehindTheDevicesBack() { cudaStreamDestroy(stream_); }
  BehindTheDevicesBack(const BehindTheDevicesBack&) = delete;
  BehindTheDevicesBack& operator=(const BehindTheDevicesBack&) = delete;

  std::vector<std::byte> Read(const DeviceBuffer& buffer, uint64_t offset,
                              size_t bytes) {
    std::vector<std::byte> out(bytes);
    if (staging_.data() == nullptr || bytes > staging_.size()) {
      ADD_FAILURE() << "no staging for the read";
      return out;
    }
    EXPECT_EQ(
        cudaMemcpyAsync(staging_.data(),
                        static_cast<const std::byte*>(buffer.data()) + offset,
                        bytes, cudaMemcpyDeviceToHost, stream_),
        cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::copy(staging_.data(), staging_.data() + bytes, out.begin());
    return out;
  }

 private:
  Pinned staging_;
  cudaStream_t stream_ = nullptr;
};

std::vector<std::byte> ReadBehindTheDevicesBack(const DeviceBuffer& buffer,
                                                uint64_t offset, size_t bytes) {
  BehindTheDevicesBack reader(bytes);
  return reader.Read(buffer, offset, bytes);
}

// Holds a stream back: work enqueued on it after the gate waits until
// Open(), the gate's destruction, or a minute (a watchdog that turns a hang
// into a failure).
class StreamGate {
 public:
  explicit StreamGate(void* stream) {
    EXPECT_EQ(
        cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &Wait, this),
        cudaSuccess);
    watchdog_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::minutes(1),
                        [this] { return open_; })) {
        expired_ = true;
        open_ = true;
        cv_.notify_all();
      }
    });
  }
  ~StreamGate() {
    Open();
    watchdog_.join();
    EXPECT_FALSE(expired_) << "the gate was held for a minute: a hang";
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  static void CUDART_CB Wait(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    std::unique_lock<std::mutex> lock(gate->mu_);
    gate->cv_.wait(lock, [gate] { return gate->open_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  bool expired_ = false;
  std::thread watchdog_;
};

size_t Mismatches(const std::vector<std::byte>& a,
                  const std::vector<std::byte>& b) {
  size_t n = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += a[i] != b[i];
  return n + (a.size() > b.size() ? a.size() - b.size() : b.size() - a.size());
}

// The driver's cuCtxGetCurrent, through the runtime (the tests link no
// libcuda either).
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
CtxGetCurrentFn CtxGetCurrent() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 11000,
                                   cudaEnableDefault, &status);
#else
  cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &status);
#endif
  return status == cudaDriverEntryPointSuccess
             ? reinterpret_cast<CtxGetCurrentFn>(fn)
             : nullptr;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { MC_SKIP_OR_FAIL_WITHOUT_GPU(); }
};

TEST_F(CudaDeviceTest, EnumeratesEveryGpuWithHeadroomLeftFree) {
  size_t free_before = 0;
  size_t total = 0;
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaMemGetInfo(&free_before, &total));
  std::vector<std::unique_ptr<Device>> devices = CudaDevices();
  ASSERT_EQ(devices.size(), static_cast<size_t>(CudaDeviceCount()));
  for (size_t i = 0; i < devices.size(); ++i) {
    EXPECT_EQ(devices[i]->name(), "cuda:" + std::to_string(i));
    EXPECT_EQ(devices[i]->kind(), DeviceKind::kCuda);
    EXPECT_EQ(devices[i]->allocation_granularity(), 2 * kMiB);
    EXPECT_GT(devices[i]->capacity_bytes(), 0u);
    EXPECT_EQ(devices[i]->capacity_bytes() % (2 * kMiB), 0u);
    EXPECT_EQ(devices[i]->bytes_allocated(), 0u);
    EXPECT_NE(CudaStreamOf(*devices[i]), nullptr);
    // And each copies exactly.
    const std::vector<std::byte> data = Pattern(20 + i, 1 * kMiB + 7);
    DeviceBuffer buffer = devices[i]->Allocate(data.size());
    devices[i]->CopyToDevice(buffer, 0, data);
    std::vector<std::byte> back(data.size());
    devices[i]->CopyToHost(back, buffer, 0);
    EXPECT_EQ(Mismatches(back, data), 0u) << devices[i]->name();
  }
  // The default leaves max(1 GiB, 5%) of what was free for others.
  const uint64_t headroom = std::max<uint64_t>(kGiB, total / 20);
  EXPECT_LE(devices[0]->capacity_bytes() + headroom, free_before);
  std::printf("cuda:0: %s total, %s free, default capacity %s\n",
              FormatBytes(total).c_str(), FormatBytes(free_before).c_str(),
              FormatBytes(devices[0]->capacity_bytes()).c_str());
  try {
    MakeCudaDevice(CudaDeviceCount());
    FAIL() << "a GPU past the last one was made";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kUnavailable);
    EXPECT_THAT(e.what(), HasSubstr("no such GPU"));
  }
}

TEST_F(CudaDeviceTest, RoundTripOf64MiBIsByteIdentical) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  const std::vector<std::byte> data = Pattern(1, 64 * kMiB);
  DeviceBuffer buffer = gpu->Allocate(data.size());
  EXPECT_EQ(gpu->bytes_allocated(), 64 * kMiB);
  gpu->CopyToDevice(buffer, 0, data);
  gpu->Synchronize();
  std::vector<std::byte> back(data.size());
  gpu->CopyToHost(back, buffer, 0);
  EXPECT_EQ(Mismatches(back, data), 0u);
  EXPECT_EQ(Mismatches(ReadBehindTheDevicesBack(buffer, 0, data.size()), data),
            0u);
  buffer.Reset();
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
}

TEST_F(CudaDeviceTest, ManySmallStagingChunksAtOddOffsets) {
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.staging_buffer_bytes = 1 * kMiB + 3,
                                          .staging_buffers = 3});
  const size_t size = 64 * kMiB + 123;
  const std::vector<std::byte> data = Pattern(2, size);
  DeviceBuffer buffer = gpu->Allocate(size + 5);
  gpu->CopyToDevice(buffer, 5, data);
  std::vector<std::byte> back(size);
  gpu->CopyToHost(back, buffer, 5);  // ordered after the copy in
  EXPECT_EQ(Mismatches(back, data), 0u);
  std::vector<std::byte> tail(10 * kMiB + 1);
  gpu->CopyToHost(tail, buffer, 5 + size - tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), data.end() - tail.size()));
}

TEST_F(CudaDeviceTest, A1GiBCopyIsCompleteAfterSynchronizeAndNotBefore) {
  constexpr uint64_t kStaging = 1 * kMiB;
  constexpr int kSlots = 3;
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.staging_buffer_bytes = kStaging,
                                          .staging_buffers = kSlots});
  const size_t size = kGiB + 77;  // 1025 staging chunks, the last odd
  DeviceBuffer buffer = gpu->Allocate(size);
  CUDA_ASSERT(cudaMemset(buffer.data(), 0x5A, size));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const std::vector<std::byte> data = Pattern(7, size);
  gpu->CopyToDevice(buffer, 0, data);
  gpu->Synchronize();
  EXPECT_EQ(Mismatches(ReadBehindTheDevicesBack(buffer, 0, size), data), 0u)
      << "bytes read on another stream after Synchronize() differ";

  // The control: the same kind of copy, read back the same way without
  // Synchronize(), while the device's stream is held back, so that none of
  // it can have landed. The check must see that.
  const size_t control = kSlots * kStaging;  // all of it staged at once
  const std::vector<std::byte> next = Pattern(8, control);
  std::vector<std::byte> before(data.end() - control, data.end());
  BehindTheDevicesBack reader(control);
  {
    StreamGate gate(CudaStreamOf(*gpu));
    gpu->CopyToDevice(buffer, size - control, next);
    const std::vector<std::byte> seen =
        reader.Read(buffer, size - control, control);
    const size_t landed = control - Mismatches(seen, next);
    std::printf("control without Synchronize(): %zu of %zu bytes landed\n",
                landed, control);
    EXPECT_GT(Mismatches(seen, next), control / 2)
        << "the read-back check cannot see a copy still in flight";
    EXPECT_EQ(Mismatches(seen, before), 0u);
    gate.Open();
    gpu->Synchronize();
  }
  EXPECT_EQ(Mismatches(reader.Read(buffer, size - control, control), next), 0u);
}

TEST_F(CudaDeviceTest, AFreedBufferIsNeverWrittenByItsCopy) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  constexpr size_t kSize = 64 * kMiB;
  const std::vector<std::byte> old_data = Pattern(9, kSize);
  const std::vector<std::byte> new_data = Pattern(10, kSize);
  int reused = 0;
  constexpr int kRounds = 16;
  for (int round = 0; round < kRounds; ++round) {
    void* freed = nullptr;
    {
      DeviceBuffer a = gpu->Allocate(kSize);
      freed = a.data();
      gpu->CopyToDevice(a, 0, old_data);  // not synchronised
    }  // freed with the copy perhaps still in flight
    DeviceBuffer b = gpu->Allocate(kSize);
    reused += b.data() == freed;
    // Filled outside the device's stream, then everything on the GPU is
    // let finish: a stray chunk of the old copy would land on top.
    CUDA_ASSERT(cudaSetDevice(0));
    CUDA_ASSERT(
        cudaMemcpy(b.data(), new_data.data(), kSize, cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaDeviceSynchronize());
    ASSERT_EQ(Mismatches(ReadBehindTheDevicesBack(b, 0, kSize), new_data), 0u)
        << "round " << round;
  }
  std::printf(
      "the next allocation reused the freed address in %d of %d "
      "rounds\n",
      reused, kRounds);
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
}

TEST_F(CudaDeviceTest, ConcurrentCopiesAllocationsAndSynchronizeLoseNoByte) {
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.staging_buffer_bytes = 2 * kMiB,
                                          .staging_buffers = 3});
  constexpr int kCopiers = 8;
  constexpr int kRounds = 40;
  std::atomic<int> mismatches{0};
  std::atomic<int> copiers_left{kCopiers};
  std::atomic<uint64_t> bytes_copied{0};
  std::barrier start(kCopiers + 3);
  std::vector<std::thread> threads;
  for (int id = 0; id < kCopiers; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937_64 rng(id);
      DeviceBuffer mine = gpu->Allocate(9 * kMiB + 1);
      start.arrive_and_wait();
      for (int round = 0; round < kRounds; ++round) {
        const size_t bytes = 1 + rng() % (6 * kMiB);
        const size_t offset = 1 + 2 * (rng() % kMiB);  // odd
        const std::vector<std::byte> data = Pattern(id * 1000 + round, bytes);
        gpu->CopyToDevice(mine, offset, data);
        std::vector<std::byte> back(bytes);
        gpu->CopyToHost(back, mine, offset);
        if (back != data) mismatches.fetch_add(1);
        bytes_copied.fetch_add(bytes);
      }
      copiers_left.fetch_sub(1);
    });
  }
  for (int id = 0; id < 2; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937_64 rng(100 + id);
      start.arrive_and_wait();
      while (copiers_left.load() > 0) {
        DeviceBuffer scratch = gpu->Allocate(1 + rng() % (16 * kMiB));
        const std::vector<std::byte> data =
            Pattern(rng(), std::min<size_t>(scratch.size(), 4096));
        gpu->CopyToDevice(scratch, 0, data);
      }  // freed at once, its copy perhaps in flight
    });
  }
  threads.emplace_back([&] {
    start.arrive_and_wait();
    while (copiers_left.load() > 0) gpu->Synchronize();
  });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
  const DeviceStats stats = gpu->Stats();
  EXPECT_EQ(stats.bytes_allocated, 0u);
  EXPECT_EQ(stats.allocations, stats.frees);
  EXPECT_EQ(stats.failed_copies, 0u);
  std::printf("%llu bytes round-tripped by %d threads, %llu allocations\n",
              static_cast<unsigned long long>(bytes_copied.load()), kCopiers,
              static_cast<unsigned long long>(stats.allocations));
}

TEST_F(CudaDeviceTest, TheGpuMemoryReallyUsedIsNoMoreThanTheBooks) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaDeviceSynchronize());
  auto free_now = [] {
    size_t free_bytes = 0;
    size_t total = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
    return static_cast<uint64_t>(free_bytes);
  };
  // The driver may take a page of its own for bookkeeping on the way.
  constexpr uint64_t kSlack = 2 * kMiB;
  struct Case {
    const char* what;
    uint64_t bytes;
    int count;
  };
  for (const Case& c : {Case{"1 B", 1, 1}, Case{"2 MiB + 1", 2 * kMiB + 1, 1},
                        Case{"100 x (1 MiB + 1)", kMiB + 1, 100}}) {
    const uint64_t before = free_now();
    std::vector<DeviceBuffer> held;
    for (int i = 0; i < c.count; ++i) held.push_back(gpu->Allocate(c.bytes));
    const uint64_t after = free_now();
    const uint64_t used = before > after ? before - after : 0;
    const uint64_t books = gpu->bytes_allocated();
    std::printf("%s: the books count %s, the GPU lost %s of free memory\n",
                c.what, FormatBytes(books).c_str(), FormatBytes(used).c_str());
    EXPECT_EQ(books, c.count * gpu->AllocationSize(c.bytes)) << c.what;
    EXPECT_LE(used, books + kSlack) << c.what;
    held.clear();
    EXPECT_EQ(gpu->bytes_allocated(), 0u);
  }
}

TEST_F(CudaDeviceTest, AllocationBeyondTheGpuIsOutOfMemoryAndLeavesNoError) {
  size_t free_bytes = 0;
  size_t total = 0;
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaMemGetInfo(&free_bytes, &total));
  // An accounting capacity beyond the GPU, so cudaMalloc itself refuses.
  std::unique_ptr<Device> gpu =
      MakeCudaDevice(0, CudaDeviceOptions{.capacity_bytes = uint64_t{1} << 60});
  try {
    gpu->Allocate(total + kGiB);
    FAIL() << "cudaMalloc of more than the GPU has succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.device_code(), DeviceErrorCode::kOutOfMemory);
    EXPECT_EQ(e.code(), ErrorCode::kCapacity);
    EXPECT_THAT(e.what(), HasSubstr("cudaMalloc"));
  }
  // Our failed cudaMalloc leaves no error for the caller's next check.
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  DeviceStats stats = gpu->Stats();
  EXPECT_EQ(stats.bytes_allocated, 0u);
  EXPECT_EQ(stats.allocations, 0u);
  EXPECT_EQ(stats.failed_allocations, 1u);
  EXPECT_FALSE(stats.unusable);
  // The device still works, exactly.
  DeviceBuffer buffer = gpu->Allocate(3 * kMiB + 1);
  const std::vector<std::byte> data = Pattern(4, 3 * kMiB + 1);
  gpu->CopyToDevice(buffer, 0, data);
  std::vector<std::byte> back(data.size());
  gpu->CopyToHost(back, buffer, 0);
  EXPECT_EQ(Mismatches(back, data), 0u);
}

TEST_F(CudaDeviceTest, AnotherLibrarysPendingErrorIsLeftForIt) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  CUDA_ASSERT(cudaSetDevice(0));
  void* huge = nullptr;
  // Another library's failed call leaves its error pending on this thread.
  ASSERT_NE(cudaMalloc(&huge, size_t{1} << 62), cudaSuccess);
  const cudaError_t pending = cudaPeekAtLastError();
  ASSERT_NE(pending, cudaSuccess);
  DeviceBuffer buffer = gpu->Allocate(1 * kMiB);
  const std::vector<std::byte> data = Pattern(5, 1 * kMiB);
  gpu->CopyToDevice(buffer, 0, data);
  gpu->Synchronize();
  std::vector<std::byte> back(data.size());
  gpu->CopyToHost(back, buffer, 0);
  EXPECT_EQ(Mismatches(back, data), 0u);
  EXPECT_EQ(cudaPeekAtLastError(), pending) << "modelcache cleared it";
  EXPECT_EQ(cudaGetLastError(), pending);
}

TEST_F(CudaDeviceTest, AllocatingZeroBytesTakesNothing) {
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  DeviceBuffer empty = gpu->Allocate(0);
  EXPECT_TRUE(empty);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(gpu->bytes_allocated(), 0u);
  empty.Reset();
  EXPECT_EQ(gpu->Stats().frees, 1u);
  // The device goes on copying exactly.
  const std::vector<std::byte> data = Pattern(21, 4 * kMiB + 1);
  DeviceBuffer buffer = gpu->Allocate(data.size());
  gpu->CopyToDevice(buffer, 0, data);
  gpu->Synchronize();
  EXPECT_EQ(Mismatches(ReadBehindTheDevicesBack(buffer, 0, data.size()), data),
            0u);
}

TEST_F(CudaDeviceTest, CallsLeaveTheCallersContextAsItWas) {
  const CtxGetCurrentFn get_current = CtxGetCurrent();
  ASSERT_NE(get_current, nullptr);
  std::unique_ptr<Device> gpu = MakeCudaDevice(0);
  const std::vector<std::byte> data = Pattern(6, 3 * kMiB);
  auto use = [&] {
    DeviceBuffer buffer = gpu->Allocate(data.size());
    gpu->CopyToDevice(buffer, 0, data);
    gpu->Synchronize();
    std::vector<std::byte> back(data.size());
    gpu->CopyToHost(back, buffer, 0);
    EXPECT_EQ(Mismatches(back, data), 0u);
  };
  // A thread that never chose a device has no context, before and after.
  std::thread fresh([&] {
    CUcontext current = reinterpret_cast<CUcontext>(1);
    ASSERT_EQ(get_current(&current), CUDA_SUCCESS);
    EXPECT_EQ(current, nullptr);
    use();
    ASSERT_EQ(get_current(&current), CUDA_SUCCESS);
    EXPECT_EQ(current, nullptr) << "a context was left current";
  });
  fresh.join();
  // A thread that chose a device keeps it, and its context.
  std::thread chosen([&] {
    const int last = CudaDeviceCount() - 1;
    ASSERT_EQ(cudaSetDevice(last), cudaSuccess);
    CUcontext before = nullptr;
    ASSERT_EQ(get_current(&before), CUDA_SUCCESS);
    use();
    CUcontext after = nullptr;
    ASSERT_EQ(get_current(&after), CUDA_SUCCESS);
    EXPECT_EQ(after, before);
    int device = -1;
    ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
    EXPECT_EQ(device, last);
  });
  chosen.join();
}

TEST_F(CudaDeviceTest, ACorruptedContextMakesTheDeviceUnavailable) {
  // The child makes cuda:0, runs a kernel that writes to address 0 (as a
  // faulty kernel of another library would), then checks that every call
  // of the device fails with kUnavailable "context corrupted" and that the
  // stats say so. A corrupted context is the process's for good, hence a
  // child.
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  const std::string child = MODELCACHE_CORRUPT_CONTEXT_CHILD;
  char* argv[] = {const_cast<char*>(child.c_str()), nullptr};
  pid_t pid = -1;
  const int spawned =
      posix_spawn(&pid, child.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  ASSERT_EQ(spawned, 0) << "cannot start " << child;
  // Read until the child exits (end of file), within a bound that only
  // turns a hang into a failure; the child is stopped by pid either way.
  std::string output;
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(2);
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        give_up - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd fd{pipe_fds[0], POLLIN, 0};
    if (poll(&fd, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(pipe_fds[0], chunk, sizeof chunk);
    if (n <= 0) break;
    output.append(chunk, static_cast<size_t>(n));
  }
  close(pipe_fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  std::printf("child output:\n%s\n", output.c_str());
  ASSERT_FALSE(timed_out) << "the child hung";
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 0) << output;
  EXPECT_THAT(output, HasSubstr("context corrupted"));
}

TEST_F(CudaDeviceTest, TwoDevicesCopyIndependently) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two GPUs";
  std::vector<std::unique_ptr<Device>> gpus = CudaDevices();
  const std::vector<std::byte> a = Pattern(5, 8 * kMiB);
  const std::vector<std::byte> b = Pattern(6, 8 * kMiB);
  DeviceBuffer on0 = gpus[0]->Allocate(a.size());
  DeviceBuffer on1 = gpus[1]->Allocate(b.size());
  gpus[0]->CopyToDevice(on0, 0, a);
  gpus[1]->CopyToDevice(on1, 0, b);
  std::vector<std::byte> back(a.size());
  gpus[1]->CopyToHost(back, on1, 0);
  EXPECT_TRUE(back == b);
  gpus[0]->CopyToHost(back, on0, 0);
  EXPECT_TRUE(back == a);
}

}  // namespace
}  // namespace modelcache::device::testing
