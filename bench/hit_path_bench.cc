// Hit path: the cost of acquiring and releasing a model that is already
// resident, which an inference server pays on every request.
//
// 1,000 resident keys of 16 bytes each, looked up uniformly at random (the
// index sequence is pre-generated per thread from a fixed seed, outside the
// timed loop), at 1 and 2 threads. ModelCache::Acquire + Lease release is
// measured side by side with the lookup + release of general-purpose caches
// that do the same reference-counted pinning: RocksDB's LRU and HyperClock
// caches and leveldb's LRU cache. Every implementation has 16 shards
// (modelcache's default shard_bits = 4, RocksDB num_shard_bits = 4, leveldb
// fixed), and every lookup is checked to be a hit.
#include <benchmark/benchmark.h>
#include <leveldb/cache.h>
#include <leveldb/slice.h>
#include <rocksdb/cache.h>
#include <rocksdb/slice.h>
#include <rocksdb/status.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "modelcache/core/cache.h"

namespace {

constexpr int kNumKeys = 1000;
// HyperClock requires exactly 16-byte keys; every implementation uses them.
constexpr size_t kKeySize = 16;
// Length of each thread's pre-generated index sequence (a power of two).
constexpr size_t kSequenceLength = size_t{1} << 16;
constexpr size_t kSequenceMask = kSequenceLength - 1;
// Size of one modelcache model; the budget fits every model twice over.
constexpr uint64_t kModelBytes = uint64_t{1} << 20;
constexpr uint64_t kModelCacheCapacity = 2 * kNumKeys * kModelBytes;
// RocksDB and leveldb entries are charged 1 unit each, against a capacity
// with ample room, so that nothing is ever evicted.
constexpr size_t kEntryCharge = 1;
constexpr size_t kUnitCapacity = 4 * kNumKeys;
constexpr int kRocksDbShardBits = 4;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "hit_path_bench: %s\n", what);
  std::abort();
}

// "model-0000000042": 16 bytes.
const std::vector<std::string>& Keys() {
  static const std::vector<std::string>* const keys = [] {
    auto* k = new std::vector<std::string>();
    k->reserve(kNumKeys);
    for (int i = 0; i < kNumKeys; ++i) {
      char buf[kKeySize + 1];
      std::snprintf(buf, sizeof(buf), "model-%010d", i);
      k->emplace_back(buf, kKeySize);
    }
    return k;
  }();
  return *keys;
}

// Uniformly random key indices for one thread; deterministic per thread.
std::vector<uint32_t> IndexSequence(int thread_index) {
  std::mt19937_64 rng(0x6d6f64656cULL + static_cast<uint64_t>(thread_index));
  std::uniform_int_distribution<uint32_t> dist(0, kNumKeys - 1);
  std::vector<uint32_t> sequence(kSequenceLength);
  for (uint32_t& index : sequence) index = dist(rng);
  return sequence;
}

// ---- modelcache ----

std::unique_ptr<modelcache::ModelCache> g_modelcache;

// The loader handed to Acquire in the timed loop: every key is resident, so
// it must never run.
const modelcache::Loader& NeverCalledLoader() {
  static const modelcache::Loader* const loader = new modelcache::Loader(
      []() -> modelcache::Loaded { Die("modelcache loader called on a hit"); });
  return *loader;
}

void SetupModelCache(const benchmark::State&) {
  modelcache::CacheOptions options;
  options.name = "hit_path_bench";
  options.capacity_bytes = kModelCacheCapacity;
  g_modelcache = std::make_unique<modelcache::ModelCache>(std::move(options));
  for (int i = 0; i < kNumKeys; ++i) {
    g_modelcache->Prefetch(Keys()[i], kModelBytes, [i] {
      modelcache::Loaded loaded;
      loaded.value = std::make_shared<int>(i);
      loaded.bytes = kModelBytes;
      return loaded;
    });
  }
  if (g_modelcache->Stats().resident_entries != kNumKeys) {
    Die("modelcache: not every key is resident after preloading");
  }
}

void TeardownModelCache(const benchmark::State&) {
  const modelcache::CacheStats stats = g_modelcache->Stats();
  if (stats.loads != kNumKeys || stats.evictions != 0) {
    Die("modelcache: a key was loaded again or evicted during the run");
  }
  g_modelcache.reset();
}

void BM_HitPath_modelcache(benchmark::State& state) {
  const std::vector<std::string>& keys = Keys();
  const std::vector<uint32_t> sequence = IndexSequence(state.thread_index());
  const modelcache::Loader& loader = NeverCalledLoader();
  modelcache::ModelCache& cache = *g_modelcache;
  size_t i = 0;
  for (auto _ : state) {
    const std::string_view key = keys[sequence[i++ & kSequenceMask]];
    modelcache::Lease lease = cache.Acquire(key, kModelBytes, loader);
    if (!lease) Die("modelcache: Acquire returned an empty lease");
    benchmark::DoNotOptimize(lease.value());
  }  // The lease is released here, inside the timed loop.
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}

// ---- RocksDB ----

std::shared_ptr<rocksdb::Cache> g_rocksdb_cache;

void DeleteRocksDbValue(const rocksdb::Slice& /*key*/, void* value) {
  delete static_cast<int*>(value);
}

void FillRocksDbCache(std::shared_ptr<rocksdb::Cache> cache) {
  for (int i = 0; i < kNumKeys; ++i) {
    const rocksdb::Status s =
        cache->Insert(Keys()[i], new int(i), kEntryCharge, &DeleteRocksDbValue);
    if (!s.ok()) Die(("rocksdb: Insert failed: " + s.ToString()).c_str());
  }
  for (const std::string& key : Keys()) {
    rocksdb::Cache::Handle* handle = cache->Lookup(key);
    if (handle == nullptr) Die("rocksdb: a key is missing after inserting");
    cache->Release(handle);
  }
  g_rocksdb_cache = std::move(cache);
}

void SetupRocksDbLru(const benchmark::State&) {
  rocksdb::LRUCacheOptions options;
  options.capacity = kUnitCapacity;
  options.num_shard_bits = kRocksDbShardBits;
  options.metadata_charge_policy = rocksdb::kDontChargeCacheMetadata;
  FillRocksDbCache(rocksdb::NewLRUCache(options));
}

void SetupRocksDbHyperClock(const benchmark::State&) {
  rocksdb::HyperClockCacheOptions options(
      kUnitCapacity, /*_estimated_entry_charge=*/kEntryCharge,
      kRocksDbShardBits, /*_strict_capacity_limit=*/false,
      /*_memory_allocator=*/nullptr, rocksdb::kDontChargeCacheMetadata);
  FillRocksDbCache(options.MakeSharedCache());
}

void TeardownRocksDb(const benchmark::State&) { g_rocksdb_cache.reset(); }

void RocksDbHitLoop(benchmark::State& state) {
  const std::vector<std::string>& keys = Keys();
  const std::vector<uint32_t> sequence = IndexSequence(state.thread_index());
  rocksdb::Cache& cache = *g_rocksdb_cache;
  size_t i = 0;
  for (auto _ : state) {
    const rocksdb::Slice key(keys[sequence[i++ & kSequenceMask]]);
    rocksdb::Cache::Handle* handle = cache.Lookup(key);
    if (handle == nullptr) Die("rocksdb: Lookup missed a resident key");
    benchmark::DoNotOptimize(cache.Value(handle));
    cache.Release(handle);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}

void BM_HitPath_rocksdb_lru(benchmark::State& state) { RocksDbHitLoop(state); }

void BM_HitPath_rocksdb_hyperclock(benchmark::State& state) {
  RocksDbHitLoop(state);
}

// ---- leveldb ----

std::unique_ptr<leveldb::Cache> g_leveldb_cache;

void DeleteLevelDbValue(const leveldb::Slice& /*key*/, void* value) {
  delete static_cast<int*>(value);
}

void SetupLevelDb(const benchmark::State&) {
  g_leveldb_cache.reset(leveldb::NewLRUCache(kUnitCapacity));
  for (int i = 0; i < kNumKeys; ++i) {
    g_leveldb_cache->Release(g_leveldb_cache->Insert(
        Keys()[i], new int(i), kEntryCharge, &DeleteLevelDbValue));
  }
  for (const std::string& key : Keys()) {
    leveldb::Cache::Handle* handle = g_leveldb_cache->Lookup(key);
    if (handle == nullptr) Die("leveldb: a key is missing after inserting");
    g_leveldb_cache->Release(handle);
  }
}

void TeardownLevelDb(const benchmark::State&) { g_leveldb_cache.reset(); }

void BM_HitPath_leveldb(benchmark::State& state) {
  const std::vector<std::string>& keys = Keys();
  const std::vector<uint32_t> sequence = IndexSequence(state.thread_index());
  leveldb::Cache& cache = *g_leveldb_cache;
  size_t i = 0;
  for (auto _ : state) {
    const leveldb::Slice key(keys[sequence[i++ & kSequenceMask]]);
    leveldb::Cache::Handle* handle = cache.Lookup(key);
    if (handle == nullptr) Die("leveldb: Lookup missed a resident key");
    benchmark::DoNotOptimize(cache.Value(handle));
    cache.Release(handle);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}

BENCHMARK(BM_HitPath_modelcache)
    ->Setup(SetupModelCache)
    ->Teardown(TeardownModelCache)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK(BM_HitPath_rocksdb_lru)
    ->Setup(SetupRocksDbLru)
    ->Teardown(TeardownRocksDb)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK(BM_HitPath_rocksdb_hyperclock)
    ->Setup(SetupRocksDbHyperClock)
    ->Teardown(TeardownRocksDb)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK(BM_HitPath_leveldb)
    ->Setup(SetupLevelDb)
    ->Teardown(TeardownLevelDb)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
