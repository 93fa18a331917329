// The daemon's metric tables: a lock-free Prometheus histogram and the
// series' label names (daemon_metrics.cc renders /metrics with them).
#ifndef MODELCACHE_SRC_SERVE_DAEMON_DAEMON_METRICS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_DAEMON_METRICS_H_

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

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_DAEMON_METRICS_H_
