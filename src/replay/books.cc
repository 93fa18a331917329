#include "books.h"

#include <algorithm>
#include <cmath>

namespace modelcache::replay {
namespace {

constexpr double kGiB = 1073741824.0;
constexpr size_t kBins = 240;

}  // namespace

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p * static_cast<double>(sorted.size()));
  const size_t index = static_cast<size_t>(std::clamp(
                           rank, 1.0, static_cast<double>(sorted.size()))) -
                       1;
  return sorted[index];
}

void WaitDistribution::Add(double ms) {
  if (ms == 0) {
    ++zeros_;
    return;
  }
  ++nonzero_;
  max_ = std::max(max_, ms);
  if (buckets_.empty()) {
    if (exact_.size() < max_exact_) {
      exact_.push_back(ms);
      return;
    }
    // Too many to keep: into the buckets, these and the rest.
    buckets_.assign(
        static_cast<size_t>(kMaxExponent - kMinExponent) << kSubBits, 0);
    for (double w : exact_) ++buckets_[Bucket(w)];
    std::vector<double>().swap(exact_);
  }
  ++buckets_[Bucket(ms)];
}

size_t WaitDistribution::Bucket(double ms) {
  int exponent;
  const double fraction = std::frexp(ms, &exponent);  // in [0.5, 1)
  --exponent;  // ms = 2^exponent * [1, 2)
  if (exponent < kMinExponent) return 0;
  if (exponent >= kMaxExponent) {
    return (static_cast<size_t>(kMaxExponent - kMinExponent) << kSubBits) - 1;
  }
  const size_t sub = static_cast<size_t>((fraction * 2 - 1) * (1 << kSubBits));
  return (static_cast<size_t>(exponent - kMinExponent) << kSubBits) +
         std::min<size_t>(sub, (1 << kSubBits) - 1);
}

double WaitDistribution::UpperEdge(size_t bucket) {
  const int exponent = static_cast<int>(bucket >> kSubBits) + kMinExponent;
  const double sub = static_cast<double>(bucket & ((1 << kSubBits) - 1));
  return std::ldexp(1 + (sub + 1) / (1 << kSubBits), exponent);
}

std::vector<double> WaitDistribution::Percentiles(
    const std::vector<double>& p) && {
  std::vector<double> out;
  const uint64_t n = count();
  if (n == 0) return std::vector<double>(p.size(), 0.0);
  std::sort(exact_.begin(), exact_.end());
  std::vector<uint64_t> below;  // per bucket, the waits in those before it
  if (!buckets_.empty()) {
    below.resize(buckets_.size() + 1);
    for (size_t b = 0; b < buckets_.size(); ++b)
      below[b + 1] = below[b] + buckets_[b];
  }
  for (double q : p) {
    // Percentile's nearest rank.
    const double rank = std::ceil(q * static_cast<double>(n));
    const uint64_t index =
        static_cast<uint64_t>(std::clamp(rank, 1.0, static_cast<double>(n))) -
        1;
    if (index < zeros_) {
      out.push_back(0);
    } else if (buckets_.empty()) {
      out.push_back(exact_[index - zeros_]);
    } else {
      // The bucket holding the (index - zeros_)-th wait that is not 0.
      const size_t bucket =
          static_cast<size_t>(
              std::upper_bound(below.begin() + 1, below.end(), index - zeros_) -
              below.begin()) -
          1;
      // The last bucket also holds every wait beyond its range.
      out.push_back(bucket + 1 == buckets_.size()
                        ? max_
                        : std::min(UpperEdge(bucket), max_));
    }
  }
  return out;
}

Books::Books(const TraceHeader& trace, double t_first, double t_last,
             uint64_t max_exact_waits)
    : trace_(trace),
      t_first_(t_first),
      t_last_(t_last),
      requests_(trace.models.size(), 0),
      cold_starts_(trace.models.size(), 0),
      waits_(max_exact_waits) {
  result_.loads_per_model.assign(trace.models.size(), 0);
  if (t_last > t_first) {
    result_.bins.resize(kBins);
    bin_width_ = (t_last - t_first) / kBins;
  }
}

void Books::Advance(double from_t, double to_t, const State& state) {
  const double from = std::max(from_t, t_first_), to = std::min(to_t, t_last_);
  if (!(to > from)) return;
  const double dt = to - from;
  idle_byte_ms_ += static_cast<double>(state.idle_bytes) * dt;
  if (state.loading) busy_ms_ += dt;
  queue_ms_ += static_cast<double>(state.queued) * dt;
  const double resident = static_cast<double>(state.resident_bytes);
  double at = from;
  while (at < to && bin_ < result_.bins.size()) {
    const double bin_end =
        t_first_ + bin_width_ * static_cast<double>(bin_ + 1);
    const double step = std::min(to, bin_end) - at;
    bin_area_ += resident * step;
    bin_min_ = std::min(bin_min_, resident);
    bin_max_ = std::max(bin_max_, resident);
    at += step;
    if (at >= bin_end) {
      auto& b = result_.bins[bin_];
      b.t_ms = static_cast<int64_t>(bin_end);
      b.min_bytes = bin_min_;
      b.max_bytes = bin_max_;
      b.mean_bytes = bin_area_ / bin_width_;
      b.queue = std::max(bin_queue_max_, state.queued);
      bin_queue_max_ = state.queued;
      ++bin_;
      bin_min_ = std::numeric_limits<double>::infinity(), bin_max_ = 0,
      bin_area_ = 0;
    }
  }
}

void Books::NoteQueue(uint32_t queued) {
  bin_queue_max_ = std::max(bin_queue_max_, queued);
  result_.load_queue_peak = std::max<uint64_t>(result_.load_queue_peak, queued);
}

void Books::Requested(uint32_t m) {
  ++requests_[m];
  ++result_.requests;
  requested_bytes_ += trace_.sizes[m];
}

void Books::Hit(uint32_t m) {
  Requested(m);
  ++result_.hits;
}

void Books::TooLarge(uint32_t m) {
  Requested(m);
  ++result_.misses;
  ++result_.too_large;
  missed_bytes_ += trace_.sizes[m];
}

void Books::ColdStart(uint32_t m) {
  Requested(m);
  ++result_.misses;
  missed_bytes_ += trace_.sizes[m];
  ++result_.cold_starts;
  ++cold_starts_[m];
}

void Books::LoadEnded(double ms, bool prewarm) {
  if (prewarm) ++result_.prewarms;
  result_.load_seconds += ms / 1000.0;
}

RunResult Books::Finish(const CacheStats& cache, const TimeModel& time,
                        bool timed) && {
  RunResult result = std::move(result_);
  result.bins.resize(bin_);
  result.timed = timed;
  const double span = t_last_ - t_first_;
  result.idle_gib_hours = idle_byte_ms_ / kGiB / 3600000.0;
  result.disk_busy_ratio = span > 0 ? busy_ms_ / span : 0;
  result.load_queue_mean = span > 0 ? queue_ms_ / span : 0;
  std::vector<double> model_ratios;
  for (size_t m = 0; m < requests_.size(); ++m) {
    if (requests_[m] > 0) {
      model_ratios.push_back(static_cast<double>(cold_starts_[m]) /
                             static_cast<double>(requests_[m]));
    }
  }
  result.evictions = cache.evictions;
  result.peak_resident_bytes = cache.high_water_bytes;
  result.bytes_loaded = cache.bytes_loaded;
  if (span > 0 && std::isfinite(time.bandwidth_bytes_per_second) && timed) {
    const double link_ms = static_cast<double>(result.bytes_loaded) /
                           time.bandwidth_bytes_per_second * 1000.0;
    result.overloaded = link_ms >= 0.9 * span;
  }
  for (const auto& b : result.bins) {
    result.resident_over_time.emplace_back(b.t_ms,
                                           static_cast<uint64_t>(b.mean_bytes));
  }
  // p50, p95, p99, p99.9, then the 1000 quantiles.
  std::vector<double> p = {0.5, 0.95, 0.99, 0.999};
  for (int q = 1; q <= 1000; ++q) p.push_back(q / 1000.0);
  const bool any_wait = waits_.count() > 0;
  const double longest = waits_.max();
  std::vector<double> at = std::move(waits_).Percentiles(p);
  result.wait_ms = WaitSummary{at[0], at[1], at[2], at[3], longest};
  if (any_wait) result.wait_quantiles.assign(at.begin() + 4, at.end());
  std::sort(model_ratios.begin(), model_ratios.end());
  result.p75_model_cold_start_ratio = Percentile(model_ratios, 0.75);
  const double n = static_cast<double>(result.requests);
  result.hit_ratio = n > 0 ? static_cast<double>(result.hits) / n : 0;
  result.cold_start_ratio =
      n > 0 ? static_cast<double>(result.cold_starts) / n : 0;
  result.byte_miss_ratio = requested_bytes_
                               ? static_cast<double>(missed_bytes_) /
                                     static_cast<double>(requested_bytes_)
                               : 0;
  return result;
}

}  // namespace modelcache::replay
