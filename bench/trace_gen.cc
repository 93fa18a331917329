// Writes a generated request trace as CSV (t_ms,model,size_bytes) on
// stdout, for the streaming replay's benchmark (docs/benchmarks.md):
//
//   modelcache_trace_gen REQUESTS MODELS [SEED] | zstd -T2 -o trace.csv.zst
//
// Models "m<i>" are sized like the embedded default's zoo
// (DefaultModelSize); model i is requested with probability proportional to
// 1 / (i + 1) (Zipf, s = 1); one request every 10 ms on average, times
// drawn as a Poisson process and written in whole ms (so several may share
// one). Deterministic for a seed.
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "modelcache/replay/replay.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s REQUESTS MODELS [SEED]\n", argv[0]);
    return 2;
  }
  const uint64_t requests = std::strtoull(argv[1], nullptr, 10);
  const uint32_t models =
      static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  const uint64_t seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1;
  if (models == 0) {
    std::fprintf(stderr, "MODELS must be positive\n");
    return 2;
  }
  std::vector<double> cdf(models);
  double sum = 0;
  for (uint32_t m = 0; m < models; ++m) cdf[m] = sum += 1.0 / (m + 1);
  for (double& c : cdf) c /= sum;
  std::vector<std::string> suffix(models);  // ",m<i>,<size>\n"
  for (uint32_t m = 0; m < models; ++m) {
    suffix[m] = ",m" + std::to_string(m) + "," +
                std::to_string(modelcache::replay::DefaultModelSize(m, seed)) +
                "\n";
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0, 1);
  std::exponential_distribution<double> gap(0.1);  // per ms
  std::string out = "t_ms,model,size_bytes\n";
  out.reserve(1 << 20);
  double t = 0;
  for (uint64_t i = 0; i < requests; ++i) {
    t += gap(rng);
    const auto m = static_cast<uint32_t>(
        std::lower_bound(cdf.begin(), cdf.end() - 1, uniform(rng)) -
        cdf.begin());
    char digits[24];
    const auto [end, ec] =
        std::to_chars(digits, digits + sizeof digits, static_cast<uint64_t>(t));
    out.append(digits, end);
    out += suffix[m];
    if (out.size() > (1 << 20) - 64) {
      if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size())
        return 1;
      out.clear();
    }
  }
  if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size()) return 1;
  return std::fflush(stdout) == 0 ? 0 : 1;
}
