// The daemon's metric tables: a lock-free Prometheus histogram and the
// series' label names (daemon_metrics.cc renders /metrics with them).
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_METRICS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/serve/errors.h"

namespace modelcache::serve::detail {

// A Prometheus histogram with fixed bounds; lock-free.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // Appends the _bucket, _sum and _count samples of `name`.
  void Render(const std::string& name, std::string* out) const;

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds + 1 (+Inf)
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0};
};

// Results of an acquire, for modelcache_acquires_total{result=...}.
enum class Result {
  kHit,
  kLoaded,
  kNotFound,
  kTooLarge,
  kCapacity,
  kTimeout,
  kLoadFailed,
  kBusy,
  kInvalid,
  kUnavailable,
  kCount
};
const char* ResultName(Result result);
Result ResultOf(ServeCode code);

// Why a connection ended, for modelcache_client_disconnects_total.
enum class Disconnect {
  kClosed,       // the client closed it
  kProcessExit,  // its process exited
  kSlowReader,   // it left more than max_queued_replies replies unread
  kRefused,      // at accept: too many clients, or a peer not allowed
  kError,        // a socket error
  kShutdown,     // the daemon shut down
  kCount
};
const char* DisconnectName(Disconnect reason);

// The counters and histograms of Daemon::Impl that /metrics renders (the
// rest it reads from the books). Daemon::Impl inherits them.
struct DaemonCounters {
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Result::kCount)>
      acquires_{};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Disconnect::kCount)>
      disconnects_{};
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> recalls_sent_{0};
  std::atomic<uint64_t> recalls_released_{0};
  std::atomic<uint64_t> recalls_busy_{0};
  std::atomic<uint64_t> recalls_unanswered_{0};
  std::atomic<uint64_t> refused_unloads_{0};  // by GateUnload
  Histogram load_seconds_{std::vector<double>{0.01, 0.05, 0.1, 0.25, 0.5, 1,
                                              2.5, 5, 10, 30, 60, 120, 300}};
  Histogram acquire_wait_seconds_{std::vector<double>{
      0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60}};
  Histogram loop_iteration_seconds_{
      std::vector<double>{0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01,
                          0.05, 0.1, 0.5, 1, 5}};
  std::atomic<int> clients_{0};
  std::atomic<int> waiting_{0};
  std::atomic<int> orphaned_leases_{0};
};

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_METRICS_H_
