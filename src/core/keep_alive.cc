// The hybrid histogram keep-alive policy (Shahrad et al., ATC 2020) and the
// idle history it reads.
#include "modelcache/core/keep_alive.h"

#include <algorithm>
#include <cmath>

namespace modelcache {
namespace {

constexpr uint32_t kMinSamples = 5;
constexpr double kMinCv = 2.0;
constexpr double kFallbackKeepAliveMs = 4 * 60 * IdleHistory::kBinMs;

class HybridHistogramKeepAlive final : public KeepAlivePolicy {
 public:
  explicit HybridHistogramKeepAlive(HybridHistogramOptions options)
      : options_(options) {}

  std::string name() const override { return "hybrid-histogram"; }

  bool prewarm_evicts_lower_ranked() const override {
    return options_.prewarm_evicts_lower_ranked;
  }

  KeepAlivePlan Plan(const IdleHistory& h, double now_ms,
                     double load_ms) const override {
    double prewarm_in = 0, keep_for = kFallbackKeepAliveMs;
    bool representative = false;
    if (h.samples() >= kMinSamples) {
      if (h.out_of_range() * 2 > h.samples()) {
        // Most idle times fall beyond the histogram: predict the next from
        // the moving average of recent ones, with 15% margins either side.
        double sum = 0;
        for (double v : h.recent()) sum += v;
        const double predicted = sum / static_cast<double>(h.recent().size());
        prewarm_in = 0.85 * predicted;
        keep_for = 1.15 * predicted;
        representative = true;
      } else {
        const double in_bins = h.samples() - h.out_of_range();
        const double mean = in_bins / IdleHistory::kBins;
        const double var =
            std::max(0.0, h.sum_squares() / IdleHistory::kBins - mean * mean);
        const double cv = mean > 0 ? std::sqrt(var) / mean : 0;
        if (cv >= kMinCv) {
          // The 5th and 99th percentiles of the in-range idle times, as the
          // start and end of their bins.
          const uint32_t in_range = h.samples() - h.out_of_range();
          const auto at = [&](double p) {
            const uint32_t rank = static_cast<uint32_t>(
                std::max(1.0, std::ceil(p * static_cast<double>(in_range))));
            uint32_t seen = 0;
            for (int b = 0; b < IdleHistory::kBins; ++b) {
              seen += h.bin(b);
              if (seen >= rank) return b;
            }
            return IdleHistory::kBins - 1;
          };
          const double head = at(0.05) * IdleHistory::kBinMs;
          const double tail = (at(0.99) + 1) * IdleHistory::kBinMs;
          prewarm_in = 0.9 * head;
          keep_for = 1.1 * tail;
          if (options_.lead_by_load_time) {
            prewarm_in = std::max(0.0, prewarm_in - load_ms);
          }
          representative = true;
        }
      }
    }
    KeepAlivePlan plan;
    if (representative && prewarm_in > 0) {
      // Unload now and load again just before the next request is due.
      plan.unload_now = true;
      plan.prewarm_at = now_ms + prewarm_in;
    }
    plan.keep_until = now_ms + keep_for;
    return plan;
  }

 private:
  const HybridHistogramOptions options_;
};

}  // namespace

void IdleHistory::Record(double idle_ms) {
  const double bin = std::floor(idle_ms / kBinMs);
  if (bin < kBins) {
    if (bins_.empty()) bins_.assign(kBins, 0);
    uint32_t& count = bins_[static_cast<size_t>(bin)];
    sum_squares_ += 2.0 * count + 1;  // (c+1)^2 - c^2
    ++count;
  } else {
    ++out_of_range_;
  }
  ++samples_;
  recent_.push_back(idle_ms);
  if (recent_.size() > kRecent) recent_.pop_front();
}

std::shared_ptr<const KeepAlivePolicy> NewHybridHistogramKeepAlive(
    HybridHistogramOptions options) {
  return std::make_shared<HybridHistogramKeepAlive>(options);
}

}  // namespace modelcache
