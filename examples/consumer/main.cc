// The smallest user of an installed modelcache: one cache, one fake model
// loaded on the first acquire and found resident on the second.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "modelcache/core/cache.h"

namespace {

struct FakeModel {
  std::string name;
  uint64_t bytes;
};

}  // namespace

int main() {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  modelcache::ModelCache cache(
      {.name = "consumer", .capacity_bytes = 64 * kMiB});
  int loads = 0;
  auto load = [&] {
    ++loads;
    auto model = std::make_shared<FakeModel>(FakeModel{"tiny", 16 * kMiB});
    return modelcache::Loaded{model, model->bytes};
  };
  for (int i = 0; i < 2; ++i) {
    modelcache::Lease lease = cache.Acquire("tiny", 16 * kMiB, load);
    if (lease.get<FakeModel>()->name != "tiny") return 1;
  }
  const modelcache::CacheStats stats = cache.Stats();
  std::printf("hits=%" PRIu64 " misses=%" PRIu64 " loads=%" PRIu64
              " resident_bytes=%" PRIu64 "\n",
              stats.hits, stats.misses, stats.loads, stats.resident_bytes);
  // One load, then a hit: the installed library behaves as in the tree.
  return loads == 1 && stats.hits == 1 && stats.loads == 1 ? 0 : 1;
}
