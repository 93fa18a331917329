// Host buffer allocators, alone and under WeightSet and HostWeightStore.
//
// The recycling allocator must hand a released buffer to the next load of a
// similar size, and that load must see only its own file's bytes; it must
// respect its byte cap (oldest retained buffers go first); every buffer it
// took from upstream must go back exactly once, with the size and alignment
// it was allocated with. A CheckingAllocator upstream records every call and
// fails the test on any mismatch.
#include "modelcache/weights/host_buffer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <barrier>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "modelcache/base/errors.h"
#include "modelcache/weights/host_store.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::weights {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Allocates through the default allocator and checks that every buffer comes
// back once, with the size and alignment it was allocated with.
class CheckingAllocator final : public HostBufferAllocator {
 public:
  void* Allocate(uint64_t bytes, size_t alignment) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fail_next_) {
        fail_next_ = false;
        throw std::bad_alloc();
      }
    }
    void* buffer = DefaultHostBufferAllocator()->Allocate(bytes, alignment);
    std::lock_guard<std::mutex> lock(mu_);
    live_[buffer] = {bytes, alignment};
    ++allocations_;
    return buffer;
  }
  void Deallocate(void* buffer, uint64_t bytes,
                  size_t alignment) noexcept override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(buffer);
      if (it == live_.end()) {
        ADD_FAILURE() << "Deallocate of a buffer that is not live";
        return;
      }
      EXPECT_EQ(it->second.first, bytes) << "size differs from Allocate's";
      EXPECT_EQ(it->second.second, alignment)
          << "alignment differs from Allocate's";
      live_.erase(it);
    }
    DefaultHostBufferAllocator()->Deallocate(buffer, bytes, alignment);
  }
  size_t live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }
  int allocations() {
    std::lock_guard<std::mutex> lock(mu_);
    return allocations_;
  }
  void FailNext() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_ = true;
  }

 private:
  std::mutex mu_;
  std::map<void*, std::pair<uint64_t, size_t>> live_;
  int allocations_ = 0;
  bool fail_next_ = false;
};

class HostBufferTest : public ::testing::Test {
 protected:
  // A file of `bytes` data bytes (a multiple of 4) filled from `seed`.
  std::string MakeFile(const std::string& name, uint64_t bytes, uint64_t seed) {
    const std::string path = (dir_.path() / name).string();
    SafetensorsWriter writer;
    writer.AddTensor("weight", Dtype::kF32, {bytes / 4}, PatternFill(seed));
    writer.Write(path);
    return path;
  }

  static bool HoldsPattern(const WeightSet& set, uint64_t seed) {
    std::vector<std::byte> expected(set.data_bytes());
    FillPattern(seed, 0, expected);
    return std::memcmp(set.data().data(), expected.data(), expected.size()) ==
           0;
  }

  static LoadOptions PreadWith(std::shared_ptr<HostBufferAllocator> a) {
    LoadOptions options;
    options.mode = LoadMode::kPread;
    options.threads = 2;
    options.chunk_bytes = 256 * 1024;
    options.allocator = std::move(a);
    return options;
  }

  modelcache::testing::TestDirectory dir_{"modelcache_host_buffer"};
};

TEST_F(HostBufferTest, AReleasedBufferServesTheNextLoadWhichSeesOnlyItsBytes) {
  const std::string a = MakeFile("a.safetensors", 4 * kMiB, 1);
  const std::string b = MakeFile("b.safetensors", 4 * kMiB, 2);
  auto upstream = std::make_shared<CheckingAllocator>();
  auto recycling =
      std::make_shared<RecyclingHostBufferAllocator>(16 * kMiB, upstream);
  const void* first_buffer = nullptr;
  {
    WeightSet set = WeightSet::Open(a, PreadWith(recycling));
    ASSERT_TRUE(HoldsPattern(set, 1));
    first_buffer = set.data().data();
  }
  EXPECT_EQ(recycling->Stats().retained_buffers, 1u);
  WeightSet set = WeightSet::Open(b, PreadWith(recycling));
  EXPECT_EQ(set.data().data(), first_buffer);  // the same memory, reused
  EXPECT_TRUE(HoldsPattern(set, 2));           // holding b's bytes only
  const RecyclingStats stats = recycling->Stats();
  EXPECT_EQ(stats.allocated, 1u);
  EXPECT_EQ(stats.reused, 1u);
  EXPECT_EQ(stats.retained_buffers, 0u);
  EXPECT_EQ(stats.outstanding_buffers, 1u);
  EXPECT_EQ(upstream->allocations(), 1);
}

TEST_F(HostBufferTest, ABufferIsReusedOnlyWithinAQuarterOfTheRequest) {
  auto upstream = std::make_shared<CheckingAllocator>();
  RecyclingHostBufferAllocator recycling(64 * kMiB, upstream);
  void* big = recycling.Allocate(8 * kMiB, 4096);
  recycling.Deallocate(big, 8 * kMiB, 4096);
  // 8 MiB is more than a quarter over 6 MiB: a new buffer.
  void* small = recycling.Allocate(6 * kMiB, 4096);
  EXPECT_NE(small, big);
  // 8 MiB is within a quarter of 7 MiB: the retained one, whose real size
  // goes back upstream whatever the caller says when it returns it.
  void* close = recycling.Allocate(7 * kMiB, 4096);
  EXPECT_EQ(close, big);
  // Larger than anything retained, or more aligned: new buffers.
  recycling.Deallocate(close, 7 * kMiB, 4096);
  void* larger = recycling.Allocate(9 * kMiB, 4096);
  void* aligned = recycling.Allocate(8 * kMiB, 2 * kMiB);
  EXPECT_NE(larger, big);
  EXPECT_NE(aligned, big);
  EXPECT_EQ(recycling.Stats().reused, 1u);
  EXPECT_EQ(recycling.Stats().allocated, 4u);
  recycling.Deallocate(small, 6 * kMiB, 4096);
  recycling.Deallocate(larger, 9 * kMiB, 4096);
  recycling.Deallocate(aligned, 8 * kMiB, 2 * kMiB);
  recycling.Trim();
  EXPECT_EQ(recycling.Stats().retained_bytes, 0u);
  EXPECT_EQ(upstream->live(), 0u);
}

TEST_F(HostBufferTest, RetainedBytesStayUnderTheCapOldestGoingFirst) {
  auto upstream = std::make_shared<CheckingAllocator>();
  RecyclingHostBufferAllocator recycling(10 * kMiB, upstream);
  void* first = recycling.Allocate(4 * kMiB, 4096);
  void* second = recycling.Allocate(4 * kMiB, 4096);
  void* third = recycling.Allocate(4 * kMiB, 4096);
  void* huge = recycling.Allocate(11 * kMiB, 4096);
  recycling.Deallocate(first, 4 * kMiB, 4096);
  recycling.Deallocate(second, 4 * kMiB, 4096);
  EXPECT_EQ(recycling.Stats().retained_bytes, 8 * kMiB);
  recycling.Deallocate(third, 4 * kMiB, 4096);  // pushes `first` out
  EXPECT_EQ(recycling.Stats().retained_bytes, 8 * kMiB);
  EXPECT_EQ(upstream->live(), 3u);              // second, third, huge
  recycling.Deallocate(huge, 11 * kMiB, 4096);  // over the cap: freed
  EXPECT_EQ(recycling.Stats().retained_buffers, 2u);
  EXPECT_EQ(upstream->live(), 2u);
  // The survivors are the two newest: both serve 4 MiB requests.
  void* again = recycling.Allocate(4 * kMiB, 4096);
  EXPECT_TRUE(again == second || again == third);
  recycling.Deallocate(again, 4 * kMiB, 4096);
  recycling.Trim();
  EXPECT_EQ(upstream->live(), 0u);
}

TEST_F(HostBufferTest, AFailedAllocationIsAnIoErrorNamingTheFile) {
  const std::string a = MakeFile("a.safetensors", 4 * kMiB, 1);
  auto upstream = std::make_shared<CheckingAllocator>();
  upstream->FailNext();
  try {
    WeightSet::Open(a, PreadWith(upstream));
    FAIL() << "Open succeeded without memory";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(a), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot allocate"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(upstream->live(), 0u);
  // A file that fails validation costs no buffer.
  fs::resize_file(a, fs::file_size(a) - 1);
  EXPECT_THROW(WeightSet::Open(a, PreadWith(upstream)), FormatError);
  EXPECT_EQ(upstream->allocations(), 0);
  EXPECT_EQ(upstream->live(), 0u);
}

TEST_F(HostBufferTest, ConcurrentLoadsThroughOneRecyclerBalanceTheirBuffers) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 20;
  std::vector<std::string> files;
  for (int i = 0; i < 4; ++i) {
    files.push_back(MakeFile("f" + std::to_string(i) + ".safetensors",
                             (1 + i % 2) * kMiB, i));
  }
  auto upstream = std::make_shared<CheckingAllocator>();
  auto recycling =
      std::make_shared<RecyclingHostBufferAllocator>(4 * kMiB, upstream);
  std::barrier round(kThreads);
  std::vector<std::thread> threads;
  std::vector<int> wrong(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const int f = (t + r) % 4;
        {
          WeightSet set = WeightSet::Open(files[f], PreadWith(recycling));
          if (!HoldsPattern(set, f)) ++wrong[t];
        }
        round.arrive_and_wait();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(wrong[t], 0) << "thread " << t;
  const RecyclingStats stats = recycling->Stats();
  EXPECT_EQ(stats.reused + stats.allocated, uint64_t{kThreads * kRounds});
  EXPECT_GT(stats.reused, 0u);
  EXPECT_LE(stats.retained_bytes, 4 * kMiB);
  EXPECT_EQ(stats.outstanding_buffers, 0u);
  EXPECT_EQ(upstream->live(), stats.retained_buffers);
  recycling->Trim();
  EXPECT_EQ(upstream->live(), 0u);
}

// The server's case: the host store evicts one model to make room for the
// next, and the next load lands in the evicted model's memory.
TEST_F(HostBufferTest, AHostStoreEvictionRecyclesItsBufferIntoTheNextLoad) {
  const std::string a = MakeFile("a.safetensors", 4 * kMiB, 1);
  const std::string b = MakeFile("b.safetensors", 4 * kMiB, 2);
  auto recycling = std::make_shared<RecyclingHostBufferAllocator>(8 * kMiB);
  HostStoreOptions options;
  options.capacity_bytes = 6 * kMiB;  // room for one model only
  options.load = PreadWith(recycling);
  HostWeightStore store(options);
  store.Acquire(a).Release();  // resident, unreferenced
  EXPECT_EQ(recycling->Stats().allocated, 1u);
  HostWeights held = store.Acquire(b);  // evicts a
  EXPECT_EQ(store.Stats().evictions, 1u);
  EXPECT_TRUE(HoldsPattern(held.weights(), 2));
  const RecyclingStats stats = recycling->Stats();
  EXPECT_EQ(stats.allocated, 1u);
  EXPECT_EQ(stats.reused, 1u);
}

}  // namespace
}  // namespace modelcache::weights
