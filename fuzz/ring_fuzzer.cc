// libFuzzer target: what `modelcache ring` parses, and the ring built from
// it; and the routes of `modelcache replay --nodes` (ParseRoute, Router).
//
// The input's first line is a --nodes list, its second a --hash-type, and
// the rest a --models file. Each parser must either throw modelcache::Error
// or return what its contract says: servers that pass ValidateRingServers;
// model ids that are non-empty, unique and free of the bytes a path segment
// cannot hold raw. Where both parse (and the ring is small enough to stay
// fast), every lookup must name a server that is up, with and without load
// and an avoided server; taking a server down must move only its models;
// and RunRing must exit 0, or 1 with one "error: " line and nothing on
// stdout. The second line is also a --route: it must parse to a route
// whose name parses back to it, or throw; a Router of each route over the
// servers must pick a server that is up (one other than the avoided one
// where HAProxy's algorithm guarantees it), whatever the requests in flight
// and servers going down and up. Any other exception, a failed check (a trap),
// a memory error (ASan) or undefined behaviour (UBSan, no recovery) is a crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/replay/cluster.h"
#include "modelcache/replay/ring.h"
#include "ring_command.h"

namespace {

using modelcache::replay::ConsistentHashRing;
using modelcache::replay::HaproxySampleKey;
using modelcache::replay::MapBasedHash;
using modelcache::replay::RingServer;

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

// A file removed when the fuzzer exits.
class TempFile {
 public:
  TempFile() {
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir && *dir ? dir : "/tmp") +
            "/modelcache_ring_fuzzer." + std::to_string(getpid());
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string_view NextLine(std::string_view* rest) {
  const size_t end = rest->find('\n');
  const std::string_view line = rest->substr(0, end);
  rest->remove_prefix(end == std::string_view::npos ? rest->size() : end + 1);
  return line;
}

void CheckRing(const std::vector<RingServer>& servers,
               const std::vector<std::string>& models, bool avalanche,
               std::string_view noise) {
  // Loads and choices from the input's bytes.
  const auto byte = [&](size_t i) -> uint32_t {
    return noise.empty() ? 0
                         : static_cast<unsigned char>(noise[i % noise.size()]);
  };
  const int64_t factor = byte(0) % 2 ? 101 + byte(1) * 4 : 0;
  ConsistentHashRing ring(servers, factor);
  MapBasedHash map(servers);
  std::vector<uint32_t> in_flight(servers.size());
  for (size_t i = 0; i < in_flight.size(); ++i) in_flight[i] = byte(i + 2) % 8;
  std::vector<size_t> owners;
  for (size_t m = 0; m < models.size() && m < 64; ++m) {
    const uint32_t key = HaproxySampleKey(models[m], avalanche);
    const size_t owner = ring.Owner(key);
    Check(owner < servers.size() && ring.is_up(owner));
    owners.push_back(owner);
    const size_t avoid = byte(m) % servers.size();
    const size_t chosen = ring.Select(key, in_flight, avoid);
    Check(chosen < servers.size() && ring.is_up(chosen));
    // Without load, an avoided server is passed over when another is up;
    // with load it may still be chosen (nobody else has room).
    if (factor == 0 && ring.up_count() > 1) Check(chosen != avoid);
    const size_t mapped = map.Select(key);
    Check(mapped < servers.size() && map.is_up(mapped));
  }
  if (servers.size() < 2) return;
  const size_t down = byte(3) % servers.size();
  ring.SetDown(down);
  map.SetDown(down);
  for (size_t m = 0; m < owners.size(); ++m) {
    const uint32_t key = HaproxySampleKey(models[m], avalanche);
    const size_t now = ring.Owner(key);
    Check(now != down && ring.is_up(now));
    if (owners[m] != down) Check(now == owners[m]);
    Check(map.Select(key) != down);
  }
}

// Every route over `servers`: picks, requests in flight taken and given
// back, servers down and up, all driven by the input's bytes.
void CheckRouters(const std::vector<RingServer>& servers,
                  const std::vector<std::string>& models,
                  std::string_view noise) {
  using modelcache::replay::ParseRoute;
  using modelcache::replay::Router;
  const auto byte = [&](size_t i) -> uint32_t {
    return noise.empty() ? 0
                         : static_cast<unsigned char>(noise[i % noise.size()]);
  };
  for (const char* name : {"roundrobin", "random", "p2c", "leastconn", "chash",
                           "chash-bl:125", "chash-map"}) {
    Router router(servers, ParseRoute(name), byte(0));
    std::vector<size_t> taken;
    for (size_t step = 0; step < 64; ++step) {
      const uint32_t b = byte(step + 1);
      const size_t server = b % servers.size();
      if (b % 7 == 0) {
        router.SetDown(server);
        continue;
      }
      if (b % 7 == 1) {
        router.SetUp(server);
        continue;
      }
      if (b % 7 == 2 && !taken.empty()) {
        router.Released(taken.back());
        taken.pop_back();
        continue;
      }
      const std::string& model = models[step % models.size()];
      const size_t avoid = b % 5 == 0 ? server : Router::kNone;
      const size_t chosen = router.Pick(router.Key(model), avoid);
      if (router.up_count() == 0) {
        Check(chosen == Router::kNone);
        continue;
      }
      Check(chosen < servers.size() && router.is_up(chosen));
      const bool may_return_avoided =
          router.route().kind == modelcache::replay::RouteKind::kChashMap ||
          router.route().kind ==
              modelcache::replay::RouteKind::kChashBoundedLoad;
      if (avoid != Router::kNone && router.is_up(avoid) &&
          router.up_count() > 1 && !may_return_avoided) {
        Check(chosen != avoid);
      }
      router.Took(chosen);
      taken.push_back(chosen);
    }
    uint64_t total = 0;
    for (size_t i = 0; i < servers.size(); ++i) total += router.in_flight(i);
    Check(total == taken.size() && total == router.total_in_flight());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const TempFile models_file;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  const std::string nodes(NextLine(&rest));
  const std::string hash_type(NextLine(&rest));
  {
    std::ofstream out(models_file.path(), std::ios::binary | std::ios::trunc);
    out.write(rest.data(), static_cast<std::streamsize>(rest.size()));
  }

  std::vector<RingServer> servers;
  bool servers_ok = false;
  try {
    servers = modelcache::tools::ParseNodeList(nodes);
    modelcache::replay::ValidateRingServers(servers);
    servers_ok = true;
  } catch (const modelcache::Error&) {
  }
  bool avalanche = true;
  try {
    avalanche = modelcache::tools::ParseHashType(hash_type).avalanche;
  } catch (const modelcache::Error&) {
  }
  try {
    const modelcache::replay::Route route =
        modelcache::replay::ParseRoute(hash_type);
    const modelcache::replay::Route again =
        modelcache::replay::ParseRoute(route.name());
    Check(again.kind == route.kind &&
          again.balance_factor == route.balance_factor);
  } catch (const modelcache::Error&) {
  }
  std::vector<std::string> models;
  try {
    models = modelcache::tools::ReadModelIds(models_file.path());
    Check(!models.empty());
    std::set<std::string> unique(models.begin(), models.end());
    Check(unique.size() == models.size());
    for (const std::string& id : models) {
      Check(!id.empty());
      for (const char ch : id) {
        const auto c = static_cast<unsigned char>(ch);
        Check(c > 0x20 && c < 0x7f && c != '/' && c != '?' && c != '#');
      }
    }
  } catch (const modelcache::Error&) {
  }

  // Keep each run fast: at most 4096 units of weight (65,536 points).
  int64_t weight = 0;
  for (const RingServer& s : servers) weight += s.weight;
  if (servers_ok && !models.empty() && weight <= 4096) {
    CheckRing(servers, models, avalanche, rest);
    if (servers.size() <= 64) CheckRouters(servers, models, rest);
    std::ostringstream out, err;
    modelcache::tools::RingFlags flags;
    flags.nodes = nodes;
    flags.models = models_file.path();
    flags.hash_type = hash_type;
    if (!rest.empty() && rest[0] % 2) flags.kill = {servers[0].name};
    const int status = modelcache::tools::RunRing(flags, out, err);
    if (status != 0) {
      Check(status == 1 && out.str().empty());
      const std::string e = err.str();
      Check(e.rfind("error: ", 0) == 0 && e.find('\n') == e.size() - 1);
    }
  }
  return 0;
}
