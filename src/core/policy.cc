#include "modelcache/core/policy.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <system_error>

#include "modelcache/base/errors.h"

namespace modelcache {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// RequestHistory's bins: half-octaves from 1 ms up; every gap shorter than
// 1 ms is in bin 0.
int BinIndex(double gap) {
  constexpr double kFirstBinSeconds = 1e-3;
  return gap < kFirstBinSeconds
             ? 0
             : 1 + static_cast<int>(2.0 * std::log2(gap / kFirstBinSeconds));
}

// How RequestHistory::Score smooths the histogram: the share of a bin's
// weight that counts at a distance of 0, 1 and 2 bins from it, and the share
// of the probability spread evenly over kEveryLengthBins bins (1 ms to about
// 12 days), so that no gap is impossible.
constexpr double kNeighbourShare[3] = {0.5, 0.2, 0.05};
constexpr double kEveryLengthShare = 0.05;
constexpr double kEveryLengthBins = 60;
// Gaps shorter than this are scored as this long: the exponential's density
// per unit of log(gap) vanishes at 0.
constexpr double kShortestScoredGap = 5e-4;

// GreedyDual's L only rises: this is what ages entries nobody asks for any
// more.
void RaiseInflation(double victim_priority, PolicyClock& clock) {
  double current = clock.inflation.load(std::memory_order_relaxed);
  while (victim_priority > current &&
         !clock.inflation.compare_exchange_weak(current, victim_priority,
                                                std::memory_order_relaxed)) {
  }
}

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
    RaiseInflation(victim_priority, clock);
  }

 private:
  const ReloadCost cost_;
};

class ClassicGdsfPolicy final : public EvictionPolicy {
 public:
  std::string name() const override { return "gdsf-classic"; }
  double Priority(const AccessInfo& entry,
                  const PolicyClock& clock) const override {
    return clock.inflation.load(std::memory_order_relaxed) +
           static_cast<double>(std::max<uint64_t>(1, entry.accesses));
  }
  void OnEvict(double victim_priority, PolicyClock& clock) const override {
    RaiseInflation(victim_priority, clock);
  }
};

class FaasCachePolicy final : public EvictionPolicy {
 public:
  FaasCachePolicy(double latency_seconds, double bytes_per_second)
      : latency_seconds_(latency_seconds),
        bytes_per_second_(bytes_per_second) {}
  std::string name() const override { return "faascache"; }
  double Priority(const AccessInfo& entry,
                  const PolicyClock& clock) const override {
    const double bytes =
        std::max<double>(1.0, static_cast<double>(entry.bytes));
    // Seconds of reload per GiB held: the GiB scale keeps the terms of a
    // magnitude where adding them to L does not lose precision.
    const double cost_per_gib =
        (latency_seconds_ + bytes / bytes_per_second_) / (bytes / kGiB);
    return clock.inflation.load(std::memory_order_relaxed) +
           static_cast<double>(std::max<uint64_t>(1, entry.accesses)) *
               cost_per_gib;
  }
  void OnEvict(double victim_priority, PolicyClock& clock) const override {
    RaiseInflation(victim_priority, clock);
  }

 private:
  const double latency_seconds_;
  const double bytes_per_second_;
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

class NextUsePolicy final : public EvictionPolicy {
 public:
  NextUsePolicy(size_t history_length, double size_exponent)
      : history_length_(std::max<size_t>(1, history_length)),
        size_exponent_(size_exponent) {}
  std::string name() const override {
    return size_exponent_ == kNextUseUniformSizeExponent ? "next-use-uniform"
                                                         : "next-use";
  }
  size_t history_length() const override { return history_length_; }
  bool time_dependent() const override { return true; }
  // Minus the predicted wait for the next request over the size in GiB to
  // the power size_exponent_: with a positive exponent, the further the
  // request and the smaller the model, the lower the priority.
  double Priority(const AccessInfo& entry, const PolicyClock&) const override {
    const RequestHistory* history = entry.history;
    if (history == nullptr || !history->has_gaps()) {
      return -std::numeric_limits<double>::infinity();
    }
    const double idle =
        std::max(0.0, entry.now_seconds - history->last_request_seconds());
    if (history->LooksMemoryless()) {
      return Rank(history->MemorylessWait(idle), entry.bytes);
    }
    // Gaps no longer than the idle time so far are ruled out: the next
    // request is one of the longer ones, if the past is a guide. Bursts
    // followed by long pauses are why: right after a burst its short gaps
    // stop applying, and the pauses say when to expect the next burst.
    const double typical_longer = history->TypicalGapLongerThan(idle);
    // Idle longer than any gap seen: the model has cooled, by as much as
    // it has been idle.
    const double wait = typical_longer > 0 ? typical_longer - idle : idle;
    return Rank(wait, entry.bytes);
  }
  void OnEvict(double, PolicyClock&) const override {}

 private:
  double Rank(double wait, uint64_t bytes) const {
    if (size_exponent_ == 0) return -wait;
    const double gib = std::max(static_cast<double>(bytes), 1.0) / kGiB;
    return -wait / std::pow(gib, size_exponent_);
  }

  const size_t history_length_;
  const double size_exponent_;
};

}  // namespace

RequestHistory::RequestHistory(size_t memory)
    : fade_(1.0 - 1.0 / static_cast<double>(std::max<size_t>(1, memory))) {}

void RequestHistory::Record(double now_seconds) {
  if (requests_ > 0) {
    const double gap = std::max(0.0, now_seconds - last_);
    const int index = BinIndex(gap);
    if (requests_ >= 2) Score(gap, index);
    Add(gap, index);
    last_ = std::max(last_, now_seconds);
  } else {
    last_ = now_seconds;
  }
  ++requests_;
}

void RequestHistory::Score(double gap, int index) {
  double weight = 0, sum = 0, near = 0;
  for (const Bin& bin : bins_) {
    weight += bin.weight;
    sum += bin.sum;
    const int distance = std::abs(bin.index - index);
    if (distance < 3) near += bin.weight * kNeighbourShare[distance];
  }
  if (weight <= 0) return;
  // Densities per unit of log(gap), so that the two compare.
  const double histogram = ((1 - kEveryLengthShare) * near / weight +
                            kEveryLengthShare / kEveryLengthBins) /
                           (0.5 * std::log(2.0));
  const double rate = weight / std::max(sum, 1e-6 * weight);
  const double scaled = rate * std::max(gap, kShortestScoredGap);
  // log(histogram) - log(scaled * exp(-scaled))
  score_ = score_ * fade_ + std::log(histogram / scaled) + scaled;
}

bool RequestHistory::LooksMemoryless() const {
  return requests_ >= 3 && score_ < 0;
}

double RequestHistory::MemorylessWait(double idle_seconds) const {
  double weight = 0, sum = 0;
  for (const Bin& bin : bins_) {
    weight += bin.weight;
    sum += bin.sum;
  }
  if (weight <= 0) return 0.0;
  return (sum + std::max(0.0, idle_seconds) * scale_) / weight;
}

void RequestHistory::Add(double gap, int index) {
  // Instead of fading every bin, weigh the new gap more: only ratios of
  // weights matter. Rescale before the numbers grow out of range, and let
  // bins that weigh nothing any more go.
  if (fade_ <= 0) {
    bins_.clear();
    scale_ = 1.0;
  } else {
    scale_ /= fade_;
    if (scale_ > 1e100) {
      for (Bin& bin : bins_) {
        bin.weight /= scale_;
        bin.sum /= scale_;
      }
      scale_ = 1.0;
      std::erase_if(bins_, [](const Bin& bin) { return bin.weight < 1e-9; });
    }
  }
  auto find = [&] {
    return std::lower_bound(
        bins_.begin(), bins_.end(), index,
        [](const Bin& bin, int wanted) { return bin.index < wanted; });
  };
  auto it = find();
  if (it == bins_.end() || it->index != index) {
    if (bins_.size() >= kMaxBins) {
      bins_.erase(std::min_element(
          bins_.begin(), bins_.end(),
          [](const Bin& x, const Bin& y) { return x.weight < y.weight; }));
      it = find();
    }
    it = bins_.insert(it, Bin{index, 0.0, 0.0});
  }
  it->weight += scale_;
  it->sum += scale_ * gap;
}

double RequestHistory::TypicalGapLongerThan(double seconds) const {
  double weight = 0;
  double sum_of_roots = 0;
  for (const Bin& bin : bins_) {
    if (bin.sum > seconds * bin.weight) {  // the bin's mean is longer
      weight += bin.weight;
      sum_of_roots += bin.weight * std::sqrt(bin.sum / bin.weight);
    }
  }
  if (weight == 0) return 0.0;
  const double mean_root = sum_of_roots / weight;
  return mean_root * mean_root;
}

std::shared_ptr<const EvictionPolicy> NewNextUsePolicy(size_t history_length,
                                                       double size_exponent) {
  return std::make_shared<NextUsePolicy>(history_length, size_exponent);
}

std::shared_ptr<const EvictionPolicy> NewBeladyPolicy() {
  return std::make_shared<BeladyPolicy>();
}

std::shared_ptr<const EvictionPolicy> NewLruPolicy() {
  return std::make_shared<LruPolicy>();
}

std::shared_ptr<const EvictionPolicy> NewGdsfPolicy(ReloadCost cost) {
  return std::make_shared<GdsfPolicy>(cost);
}

std::shared_ptr<const EvictionPolicy> NewClassicGdsfPolicy() {
  return std::make_shared<ClassicGdsfPolicy>();
}

std::shared_ptr<const EvictionPolicy> NewFaasCachePolicy(
    double latency_seconds, double bytes_per_second) {
  return std::make_shared<FaasCachePolicy>(latency_seconds, bytes_per_second);
}

namespace {

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

// "10m", "90s", "1.5h", "500ms": a positive, finite duration with a unit.
std::optional<std::chrono::nanoseconds> ParseTtl(std::string_view text) {
  double value = 0;
  const auto [end, ec] =
      std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end == text.data() || !std::isfinite(value) ||
      !(value > 0)) {
    return std::nullopt;
  }
  const std::string_view unit = text.substr(end - text.data());
  double ms_per_unit = 0;
  if (unit == "ms") ms_per_unit = 1;
  if (unit == "s") ms_per_unit = 1e3;
  if (unit == "m") ms_per_unit = 6e4;
  if (unit == "h") ms_per_unit = 3.6e6;
  const double ns = value * ms_per_unit * 1e6;
  if (!(ns >= 1) || ns > 9e18) return std::nullopt;
  return std::chrono::nanoseconds(static_cast<int64_t>(std::llround(ns)));
}

}  // namespace

std::vector<std::string> PolicyNames() {
  return {"lru",          "gdsf",      "gdsf-classic",     "gdsf-time",
          "gdsf-uniform", "faascache", "ttl-<N>m",         "hybrid-histogram",
          "gdsf-prewarm", "next-use",  "next-use-uniform", "next-use-prewarm"};
}

std::vector<std::string> OfflinePolicyNames() { return {"belady"}; }

NamedPolicy PolicyByName(std::string_view name, const LoadCostModel& cost) {
  NamedPolicy policy;
  policy.name = std::string(name);
  auto next_use_uniform = [] {
    return NewNextUsePolicy(kNextUseHistoryLength, kNextUseUniformSizeExponent);
  };
  if (name == "lru") {
    policy.eviction = NewLruPolicy();
  } else if (name == "gdsf") {
    policy.eviction = NewGdsfPolicy(ReloadCost::kBytes);
  } else if (name == "gdsf-classic") {
    policy.eviction = NewClassicGdsfPolicy();
  } else if (name == "gdsf-time") {
    policy.eviction = NewGdsfPolicy(ReloadCost::kLoadTime);
  } else if (name == "gdsf-uniform") {
    policy.eviction = NewGdsfPolicy(ReloadCost::kUniform);
  } else if (name == "faascache") {
    policy.eviction =
        NewFaasCachePolicy(cost.latency_seconds, cost.bytes_per_second);
  } else if (name.substr(0, 4) == "ttl-") {
    const auto ttl = ParseTtl(name.substr(4));
    if (!ttl) {
      throw Error(ErrorCode::kInvalidArgument,
                  "unknown policy '" + std::string(name) +
                      "': ttl takes a positive duration with a unit, as in "
                      "ttl-10m, ttl-90s or ttl-1h");
    }
    policy.eviction = NewLruPolicy();
    policy.idle_ttl = *ttl;
  } else if (name == "hybrid-histogram") {
    policy.eviction = NewLruPolicy();
    policy.keep_alive = NewHybridHistogramKeepAlive();
  } else if (name == "gdsf-prewarm") {
    policy.eviction = NewGdsfPolicy(ReloadCost::kBytes);
    policy.keep_alive =
        NewHybridHistogramKeepAlive({.lead_by_load_time = true});
  } else if (name == "next-use") {
    policy.eviction = NewNextUsePolicy();
  } else if (name == "next-use-uniform") {
    policy.eviction = next_use_uniform();
  } else if (name == "next-use-prewarm") {
    policy.eviction = next_use_uniform();
    policy.keep_alive = NewHybridHistogramKeepAlive(
        {.lead_by_load_time = true, .prewarm_evicts_lower_ranked = true});
  } else if (name == "belady") {
    policy.eviction = NewBeladyPolicy();
    policy.offline = true;
  } else {
    throw Error(ErrorCode::kInvalidArgument,
                "unknown policy '" + std::string(name) +
                    "' (known: " + Join(PolicyNames()) + "; offline, for " +
                    "replay only: " + Join(OfflinePolicyNames()) + ")");
  }
  return policy;
}

}  // namespace modelcache
