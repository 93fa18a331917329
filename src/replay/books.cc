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

Books::Books(const Trace& trace, double t_first, double t_last)
    : trace_(trace),
      t_first_(t_first),
      t_last_(t_last),
      requests_(trace.models.size(), 0),
      cold_starts_(trace.models.size(), 0) {
  result_.loads_per_model.assign(trace.models.size(), 0);
  if (t_last > t_first) {
    result_.bins.resize(kBins);
    bin_width_ = (t_last - t_first) / kBins;
  }
  waits_.reserve(trace.requests.size());
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
  std::vector<double> waits = std::move(waits_);
  std::sort(waits.begin(), waits.end());
  result.wait_ms = WaitSummary{
      Percentile(waits, 0.5), Percentile(waits, 0.95), Percentile(waits, 0.99),
      Percentile(waits, 0.999), waits.empty() ? 0 : waits.back()};
  if (!waits.empty()) {
    for (int q = 1; q <= 1000; ++q) {
      result.wait_quantiles.push_back(Percentile(waits, q / 1000.0));
    }
  }
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
