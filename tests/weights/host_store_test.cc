// The host weight store: one canonical copy per file shared by every holder,
// counted once, returned exactly once, and returned in full when a holder
// goes away without shutting down (the InvokeAI SharedCpuWeightsStore
// scenarios).
#include "modelcache/weights/host_store.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "gtest/gtest.h"
#include "modelcache/weights/safetensors_writer.h"

namespace modelcache::weights {
namespace {

namespace fs = std::filesystem;

class HostStoreTest : public ::testing::Test {
 protected:
  // A safetensors file of `floats` F32 values; returns its path.
  std::string MakeFile(const std::string& name, uint64_t floats,
                       uint64_t seed = 1) {
    const std::string path = (dir_.path() / name).string();
    SafetensorsWriter writer;
    writer.AddTensor("weight", Dtype::kF32, {floats}, PatternFill(seed));
    writer.Write(path);
    return path;
  }

  HostStoreOptions Options(uint64_t capacity) {
    HostStoreOptions options;
    options.capacity_bytes = capacity;
    return options;
  }

  modelcache::testing::TestDirectory dir_{"modelcache_host_store"};
};

TEST_F(HostStoreTest, TwoHoldersShareOneCopyFreedOnlyWhenTheLastLetsGo) {
  const std::string path = MakeFile("a.safetensors", 1024);  // 4 KiB of data
  HostWeightStore store(Options(1 << 20));
  HostWeightHolder device0(store), device1(store);
  const WeightSet& w0 = device0.Acquire(path);
  const WeightSet& w1 = device1.Acquire(path);
  EXPECT_EQ(&w0, &w1);  // one canonical copy
  EXPECT_EQ(store.Stats().loads, 1u);
  EXPECT_EQ(store.budget().used(), 4096u);  // counted once

  EXPECT_TRUE(device0.Release(w0));
  EXPECT_EQ(store.Prune(), 0u);  // device1 still holds it
  EXPECT_EQ(store.budget().used(), 4096u);
  EXPECT_TRUE(device1.Release(w1));
  EXPECT_EQ(store.Prune(), 1u);
  EXPECT_EQ(store.budget().used(), 0u);
}

TEST_F(HostStoreTest, TwoPathsToOneFileShareOneCopy) {
  const std::string path = MakeFile("a.safetensors", 256);
  const std::string link = (dir_.path() / "link.safetensors").string();
  fs::create_hard_link(path, link);
  HostWeightStore store(Options(1 << 20));
  HostWeights a = store.Acquire(path);
  HostWeights b = store.Acquire(link);
  EXPECT_EQ(&a.weights(), &b.weights());
  EXPECT_EQ(store.Stats().loads, 1u);
}

TEST_F(HostStoreTest, HolderDestroyedWithoutShutdownReturnsEveryReference) {
  const std::string a = MakeFile("a.safetensors", 1024);
  const std::string b = MakeFile("b.safetensors", 2048);
  HostWeightStore store(Options(1 << 20));
  HostWeightHolder survivor(store);
  survivor.Acquire(a);
  {
    HostWeightHolder dropped(store);
    dropped.Acquire(a);
    dropped.Acquire(b);
    dropped.Acquire(b);
    EXPECT_EQ(dropped.held(), 3u);
  }  // no ReleaseAll()
  // Only the survivor's reference is left: b is unreferenced and goes.
  EXPECT_EQ(store.Prune(), 1u);
  EXPECT_EQ(store.budget().used(), 4096u);
  auto entry = store.cache().Entry(HostWeightStore::IdentityKey(a));
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->leases, 1);
}

TEST_F(HostStoreTest, EvictionThenLaterReleaseIsExactlyOnce) {
  const std::string path = MakeFile("a.safetensors", 1024);
  HostWeightStore store(Options(1 << 20));
  HostWeightHolder holder(store);
  const WeightSet& weights = holder.Acquire(path);
  EXPECT_TRUE(holder.Release(weights));
  EXPECT_EQ(store.Prune(), 1u);  // evicted
  EXPECT_EQ(store.budget().used(), 0u);
  EXPECT_FALSE(holder.Release(weights));  // a second release does nothing
  EXPECT_EQ(store.budget().used(), 0u);
  EXPECT_EQ(store.cache().CheckInvariants(), 0u);
}

TEST_F(HostStoreTest, RetiredCopyIsCountedUntilItsLastHolderLetsGo) {
  const std::string path = MakeFile("a.safetensors", 1024);
  HostWeightStore store(Options(1 << 20));
  HostWeightHolder old_user(store), new_user(store);
  const WeightSet& old_copy = old_user.Acquire(path);
  EXPECT_EQ(store.Invalidate(path), RemoveOutcome::kRetired);
  const WeightSet& new_copy = new_user.Acquire(path);
  EXPECT_NE(&old_copy, &new_copy);
  EXPECT_EQ(store.Stats().loads, 2u);
  EXPECT_EQ(store.Stats().retired_bytes, 4096u);
  EXPECT_EQ(store.budget().used(), 8192u);
  // Releasing the new copy through the old holder is a mismatch: no-op.
  EXPECT_FALSE(old_user.Release(new_copy));
  EXPECT_TRUE(old_user.Release(old_copy));  // the retired copy is freed
  EXPECT_EQ(store.Stats().retired_bytes, 0u);
  EXPECT_EQ(store.budget().used(), 4096u);
  EXPECT_EQ(new_user.held(), 1u);
}

TEST_F(HostStoreTest, AnotherHoldersWeightsAreNotReleased) {
  const std::string path = MakeFile("a.safetensors", 64);
  HostWeightStore store(Options(1 << 20));
  HostWeightHolder a(store), b(store);
  const WeightSet& mine = b.Acquire(path);
  EXPECT_FALSE(a.Release(mine));
  EXPECT_EQ(b.held(), 1u);
  EXPECT_EQ(store.cache().Entry(HostWeightStore::IdentityKey(path))->leases, 1);
}

TEST_F(HostStoreTest, RewrittenFileIsANewIdentity) {
  const std::string path = MakeFile("a.safetensors", 64, /*seed=*/1);
  HostWeightStore store(Options(1 << 20));
  HostWeights first = store.Acquire(path);
  const std::string first_key = HostWeightStore::IdentityKey(path);
  fs::remove(path);  // a new inode, as a fresh download would have
  MakeFile("a.safetensors", 128, /*seed=*/2);
  EXPECT_NE(HostWeightStore::IdentityKey(path), first_key);
  HostWeights second = store.Acquire(path);
  EXPECT_NE(&first.weights(), &second.weights());
  EXPECT_EQ(second.weights().data_bytes(), 512u);
}

TEST_F(HostStoreTest, InvalidFileIsAClearErrorAndCachesNothing) {
  const std::string path = (dir_.path() / "bad.safetensors").string();
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    const unsigned char bogus[16] = {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
    std::fwrite(bogus, 1, sizeof(bogus), f);
    std::fclose(f);
  }
  HostWeightStore store(Options(1 << 20));
  EXPECT_THROW(store.Acquire(path), FormatError);
  EXPECT_EQ(store.budget().used(), 0u);
  EXPECT_TRUE(store.cache().Entries().empty());
  EXPECT_THROW(store.Acquire((dir_.path() / "missing.safetensors").string()),
               IoError);
}

TEST_F(HostStoreTest, EightThreadsTimesTwoHundredAcquireReleaseStayConsistent) {
  std::vector<std::string> files;
  for (int i = 0; i < 3; ++i) {
    files.push_back(
        MakeFile("f" + std::to_string(i) + ".safetensors", 256 * (i + 1), i));
  }
  // Room for two of the three copies (1, 2 and 3 KiB), so loads evict. A
  // thread waiting for room while holding references can wait on one that
  // waits on it; the deadline breaks such cycles, and a timeout is an
  // allowed outcome here, unlike any other error.
  constexpr uint64_t kCapacity = 5120;
  HostWeightStore store(Options(kCapacity));
  std::atomic<int> failures{0};
  modelcache::testing::KeptErrors kept;  // declared before the threads
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      HostWeightHolder holder(store);
      std::mt19937 rng(t);
      std::vector<const WeightSet*> mine;
      for (int i = 0; i < 200; ++i) {
        if (mine.size() < 2 && rng() % 2 == 0) {
          AcquireOptions wait;
          wait.when_full = WhenFull::kWait;
          wait.deadline = Clock::now() + std::chrono::milliseconds(50);
          try {
            mine.push_back(&holder.Acquire(files[rng() % files.size()], wait));
          } catch (const Error& e) {
            kept.Keep(std::current_exception());
            if (e.code() != ErrorCode::kTimeout) failures.fetch_add(1);
          } catch (const std::exception&) {
            kept.Keep(std::current_exception());
            failures.fetch_add(1);
          }
        } else if (!mine.empty()) {
          if (!holder.Release(*mine.back())) failures.fetch_add(1);
          mine.pop_back();
        }
      }
      // Whatever is still held goes back with the holder.
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store.cache().CheckInvariants(), store.budget().used());
  for (const EntryInfo& e : store.cache().Entries()) EXPECT_EQ(e.leases, 0);
  EXPECT_LE(store.budget().high_water(), kCapacity);
  EXPECT_GT(store.Stats().evictions, 0u);
  store.Prune();
  EXPECT_EQ(store.budget().used(), 0u);
}

}  // namespace
}  // namespace modelcache::weights
