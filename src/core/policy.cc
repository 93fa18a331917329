#include "modelcache/core/policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace modelcache {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

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
  explicit NextUsePolicy(size_t history_length)
      : history_length_(std::max<size_t>(1, history_length)) {}
  std::string name() const override { return "next-use"; }
  size_t history_length() const override { return history_length_; }
  bool time_dependent() const override { return true; }
  // Minus the predicted wait for the next request: the further it is, the
  // lower the priority.
  double Priority(const AccessInfo& entry, const PolicyClock&) const override {
    const RequestHistory* history = entry.history;
    if (history == nullptr || history->gaps().empty()) {
      return -std::numeric_limits<double>::infinity();
    }
    const double idle =
        std::max(0.0, entry.now_seconds - history->last_request_seconds());
    // Gaps no longer than the idle time so far are ruled out: the next
    // request is one of the longer ones, if the past is a guide. Bursts
    // followed by long pauses are why: right after a burst its short gaps
    // stop applying, and the pauses say when to expect the next burst.
    double sum = 0;
    size_t longer = 0;
    for (double gap : history->gaps()) {
      if (gap > idle) {
        sum += gap;
        ++longer;
      }
    }
    // Idle longer than any gap seen: the model has cooled, by as much as
    // it has been idle.
    const double wait =
        longer > 0 ? sum / static_cast<double>(longer) - idle : idle;
    return -wait;
  }
  void OnEvict(double, PolicyClock&) const override {}

 private:
  const size_t history_length_;
};

}  // namespace

RequestHistory::RequestHistory(size_t max_gaps)
    : max_gaps_(std::max<size_t>(1, max_gaps)) {}

void RequestHistory::Record(double now_seconds) {
  if (requests_ > 0) {
    const double gap = std::max(0.0, now_seconds - last_);
    if (gaps_.size() < max_gaps_) {
      gaps_.push_back(gap);
    } else {
      gaps_[next_] = gap;
      next_ = (next_ + 1) % max_gaps_;
    }
    last_ = std::max(last_, now_seconds);
  } else {
    last_ = now_seconds;
  }
  ++requests_;
}

std::shared_ptr<const EvictionPolicy> NewNextUsePolicy(size_t history_length) {
  return std::make_shared<NextUsePolicy>(history_length);
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

std::shared_ptr<const EvictionPolicy> PolicyByName(const std::string& name) {
  if (name == "lru") return NewLruPolicy();
  if (name == "gdsf") return NewGdsfPolicy(ReloadCost::kBytes);
  if (name == "gdsf-classic") return NewClassicGdsfPolicy();
  if (name == "faascache") return NewFaasCachePolicy(0.1, 2e9);
  if (name == "gdsf-time") return NewGdsfPolicy(ReloadCost::kLoadTime);
  if (name == "gdsf-uniform") return NewGdsfPolicy(ReloadCost::kUniform);
  if (name == "next-use") return NewNextUsePolicy();
  if (name == "belady") return NewBeladyPolicy();
  return nullptr;
}

}  // namespace modelcache
