#include "modelcache/core/policy.h"

#include <algorithm>
#include <cmath>

namespace modelcache {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

class LruPolicy final : public EvictionPolicy {
 public:
  std::string name() const override { return "lru"; }
  // The epoch moves on at every load and eviction; within one epoch the
  // cache breaks ties by access sequence, which makes the order LRU.
  double Priority(const AccessInfo&, const PolicyClock& clock) const override {
    return static_cast<double>(clock.epoch.load(std::memory_order_relaxed));
  }
  void OnEvict(double, PolicyClock&) const override {}
};

class GdsfPolicy final : public EvictionPolicy {
 public:
  explicit GdsfPolicy(ReloadCost cost) : cost_(cost) {}

  std::string name() const override {
    switch (cost_) {
      case ReloadCost::kBytes:
        return "gdsf";
      case ReloadCost::kLoadTime:
        return "gdsf-time";
      case ReloadCost::kUniform:
        return "gdsf-uniform";
    }
    return "gdsf";
  }

  double Priority(const AccessInfo& entry,
                  const PolicyClock& clock) const override {
    const double inflation = clock.inflation.load(std::memory_order_relaxed);
    // Logarithmic, as in Redis's LFU counter: raw counts let a model that
    // was popular early keep its place for thousands of evictions after it
    // cooled, which on real traces loads more bytes than plain LRU.
    const double frequency = std::log2(
        1.0 + static_cast<double>(std::max<uint64_t>(1, entry.accesses)));
    const double size_gib =
        std::max<double>(1.0, static_cast<double>(entry.bytes)) / kGiB;
    double cost_per_size = 1.0;  // kBytes: cost == size
    switch (cost_) {
      case ReloadCost::kBytes:
        break;
      case ReloadCost::kLoadTime:
        cost_per_size = entry.load_seconds / size_gib;
        break;
      case ReloadCost::kUniform:
        cost_per_size = 1.0 / size_gib;
        break;
    }
    return inflation + frequency * cost_per_size;
  }

  void OnEvict(double victim_priority, PolicyClock& clock) const override {
    // L only rises: this is what ages entries nobody asks for any more.
    double current = clock.inflation.load(std::memory_order_relaxed);
    while (victim_priority > current &&
           !clock.inflation.compare_exchange_weak(current, victim_priority,
                                                  std::memory_order_relaxed)) {
    }
  }

 private:
  const ReloadCost cost_;
};

class BeladyPolicy final : public EvictionPolicy {
 public:
  std::string name() const override { return "belady"; }
  // The further the next request, the lower the priority.
  double Priority(const AccessInfo& entry, const PolicyClock&) const override {
    return -entry.hint;
  }
  void OnEvict(double, PolicyClock&) const override {}
  bool monotone() const override { return false; }
};

}  // namespace

std::shared_ptr<const EvictionPolicy> NewBeladyPolicy() {
  return std::make_shared<BeladyPolicy>();
}

std::shared_ptr<const EvictionPolicy> NewLruPolicy() {
  return std::make_shared<LruPolicy>();
}

std::shared_ptr<const EvictionPolicy> NewGdsfPolicy(ReloadCost cost) {
  return std::make_shared<GdsfPolicy>(cost);
}

std::shared_ptr<const EvictionPolicy> PolicyByName(const std::string& name) {
  if (name == "lru") return NewLruPolicy();
  if (name == "gdsf") return NewGdsfPolicy(ReloadCost::kBytes);
  if (name == "gdsf-time") return NewGdsfPolicy(ReloadCost::kLoadTime);
  if (name == "gdsf-uniform") return NewGdsfPolicy(ReloadCost::kUniform);
  if (name == "belady") return NewBeladyPolicy();
  return nullptr;
}

}  // namespace modelcache
