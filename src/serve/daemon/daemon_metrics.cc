// The daemon's Prometheus metrics: GET /metrics (Metrics), its histograms,
// and the names of acquire results, disconnect reasons and lease uses.
//
// Reads come from the store (thread-safe), atomics, and the lease table and
// the other books under their mutexes, one at a time.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include "daemon_internal.h"

namespace modelcache::serve {

using detail::Disconnect;
using detail::Result;

namespace detail {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i] = 0;
}

void Histogram::Observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++buckets_[i];
  ++count_;
  sum_.fetch_add(value);
}

namespace {

std::string Number(double value) {
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "%.17g", value);
  return buffer;
}

}  // namespace

void Histogram::Render(const std::string& name, std::string* out) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += buckets_[i].load();
    const std::string le =
        i < bounds_.size() ? Number(bounds_[i]) : std::string("+Inf");
    *out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cumulative) +
            "\n";
  }
  *out += name + "_sum " + Number(sum_.load()) + "\n";
  *out += name + "_count " + std::to_string(count_.load()) + "\n";
}

const char* UseName(Use use) {
  switch (use) {
    case Use::kInUse:
      return "in_use";
    case Use::kIdle:
      return "idle";
    case Use::kRecalled:
      return "recalled";
  }
  return "in_use";
}

const char* ResultName(Result result) {
  switch (result) {
    case Result::kHit:
      return "hit";
    case Result::kLoaded:
      return "loaded";
    case Result::kNotFound:
      return "not_found";
    case Result::kTooLarge:
      return "too_large";
    case Result::kCapacity:
      return "capacity";
    case Result::kTimeout:
      return "timeout";
    case Result::kLoadFailed:
      return "load_failed";
    case Result::kBusy:
      return "busy";
    case Result::kInvalid:
      return "invalid";
    case Result::kUnavailable:
    case Result::kCount:
      break;
  }
  return "unavailable";
}

Result ResultOf(ServeCode code) {
  switch (code) {
    case ServeCode::kNotFound:
      return Result::kNotFound;
    case ServeCode::kTooLarge:
      return Result::kTooLarge;
    case ServeCode::kCapacity:
      return Result::kCapacity;
    case ServeCode::kTimeout:
      return Result::kTimeout;
    case ServeCode::kLoadFailed:
      return Result::kLoadFailed;
    case ServeCode::kBusy:
      return Result::kBusy;
    case ServeCode::kInvalid:
      return Result::kInvalid;
    case ServeCode::kUnavailable:
      return Result::kUnavailable;
  }
  return Result::kInvalid;
}

const char* DisconnectName(Disconnect reason) {
  switch (reason) {
    case Disconnect::kClosed:
      return "closed";
    case Disconnect::kProcessExit:
      return "process_exit";
    case Disconnect::kSlowReader:
      return "slow_reader";
    case Disconnect::kRefused:
      return "refused";
    case Disconnect::kError:
      return "error";
    case Disconnect::kShutdown:
    case Disconnect::kCount:
      break;
  }
  return "shutdown";
}

}  // namespace detail

namespace {

// Prometheus label values: backslash, double quote and newline escaped.
std::string LabelValue(std::string_view value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void Metric(std::string* out, const std::string& name, const char* type,
            const std::string& help) {
  *out +=
      "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void Sample(std::string* out, const std::string& name, double value,
            const std::string& labels = "") {
  char buffer[40];
  if (value == std::floor(value) && std::fabs(value) < 1e18) {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.17g", value);
  }
  *out +=
      name + (labels.empty() ? "" : "{" + labels + "}") + " " + buffer + "\n";
}

}  // namespace

HttpResponse Daemon::Impl::Metrics() {
  const CacheStats stats = store_->Stats();
  const uint64_t configured = configured_.load();
  const uint64_t orphaned = orphaned_.load();
  int leases;
  std::array<int, 3> by_use{};  // in use, idle, recalled
  {
    base::MutexLock lock(&leases_mu_);
    leases = static_cast<int>(leases_.size());
    for (const auto& [id, lease] : leases_) {
      ++by_use[static_cast<size_t>(lease.use)];
    }
  }
  std::string out;
  const auto gauge = [&](const std::string& name, const std::string& help,
                         double value) {
    Metric(&out, name, "gauge", help);
    Sample(&out, name, value);
  };
  const auto counter = [&](const std::string& name, const std::string& help,
                           double value) {
    Metric(&out, name, "counter", help);
    Sample(&out, name, value);
  };
  gauge("modelcache_budget_capacity_bytes",
        "The configured host budget in bytes.",
        static_cast<double>(configured));
  gauge("modelcache_budget_used_bytes",
        "Bytes the store holds: resident and retired copies and loads in "
        "flight.",
        static_cast<double>(stats.budget_used_bytes));
  gauge("modelcache_budget_high_water_bytes", "The most bytes ever used.",
        static_cast<double>(stats.high_water_bytes));
  gauge("modelcache_resident_bytes", "Bytes of resident copies.",
        static_cast<double>(stats.resident_bytes));
  gauge("modelcache_retired_bytes", "Bytes of retired copies still leased.",
        static_cast<double>(stats.retired_bytes));
  gauge("modelcache_orphaned_bytes",
        "Bytes of a previous daemon's copies that processes still map, "
        "taken off the store's capacity.",
        static_cast<double>(orphaned));
  gauge("modelcache_resident_models", "Models resident.",
        static_cast<double>(stats.resident_entries));
  gauge("modelcache_leases", "Leases held, orphaned ones included.",
        static_cast<double>(leases));
  Metric(&out, "modelcache_delegated_leases", "gauge",
         "Leases by their use as the client last told it: in_use, idle "
         "(the copy counts as evictable) or recalled (awaiting the answer).");
  for (size_t i = 0; i < by_use.size(); ++i) {
    Sample(&out, "modelcache_delegated_leases", by_use[i],
           std::string("use=\"") +
               detail::UseName(static_cast<detail::Use>(i)) + "\"");
  }
  counter("modelcache_recalls_sent_total",
          "Recalls of idle leases sent to their clients.",
          static_cast<double>(recalls_sent_.load()));
  Metric(&out, "modelcache_recalls_total", "counter",
         "Recalls ended, by answer: release, busy (the client uses the lease "
         "again) or unanswered (taken as busy after the recall timeout).");
  Sample(&out, "modelcache_recalls_total",
         static_cast<double>(recalls_released_.load()), "answer=\"release\"");
  Sample(&out, "modelcache_recalls_total",
         static_cast<double>(recalls_busy_.load()), "answer=\"busy\"");
  Sample(&out, "modelcache_recalls_total",
         static_cast<double>(recalls_unanswered_.load()),
         "answer=\"unanswered\"");
  counter("modelcache_refused_unloads_total",
          "Evictions of a copy that delegated leases still map, refused (the "
          "store moved on to its next victim).",
          static_cast<double>(refused_unloads_.load()));
  gauge("modelcache_orphaned_leases",
        "Leases of closed connections whose processes still live.",
        orphaned_leases_.load());
  gauge("modelcache_clients", "Connected clients.", clients_.load());
  gauge("modelcache_waiting_acquires", "Acquires waiting for a load or room.",
        waiting_.load());
  // Swap scheduling (DaemonOptions::drain_after).
  const Budget& budget = store_->budget();
  counter("modelcache_drains_total",
          "Drains started: models that stopped taking leases so that a load "
          "waiting for room longer than --drain-after gets it.",
          static_cast<double>(budget.drains()));
  counter("modelcache_queued_behind_drain_total",
          "Loads that queued behind a drain (of a draining model, their "
          "acquires wait until the drain ends).",
          static_cast<double>(budget.queued_behind_drain()));
  const std::optional<std::chrono::steady_clock::time_point> oldest =
      budget.OldestWaitArrival();
  gauge("modelcache_oldest_room_wait_seconds",
        "How long the oldest load waiting for room has waited (0: none "
        "waits).",
        oldest ? std::chrono::duration<double>(budget.Now() - *oldest).count()
               : 0.0);

  Metric(&out, "modelcache_acquires_total", "counter",
         "Acquires answered, by result.");
  for (size_t i = 0; i < acquires_.size(); ++i) {
    Sample(&out, "modelcache_acquires_total",
           static_cast<double>(acquires_[i].load()),
           std::string("result=\"") +
               detail::ResultName(static_cast<detail::Result>(i)) + "\"");
  }
  counter("modelcache_loads_total",
          "Loads completed (copies adopted from a predecessor are no loads).",
          static_cast<double>(stats.loads -
                              std::min(stats.loads, adoptions_.load())));
  counter("modelcache_load_failures_total", "Loads that failed.",
          static_cast<double>(stats.load_failures));
  counter("modelcache_evictions_total", "Copies evicted to make room.",
          static_cast<double>(stats.evictions + stats.expirations));
  counter(
      "modelcache_loaded_bytes_total", "Bytes of the copies loaded.",
      static_cast<double>(stats.bytes_loaded -
                          std::min(stats.bytes_loaded, adopted_bytes_.load())));
  Metric(&out, "modelcache_adopted_bytes_total", "counter",
         "Bytes of copies a predecessor made, adopted with no byte loaded: "
         "taken over (handed over by the daemon before) or reclaimed (brought "
         "back by the clients that map them after a crash); refused: what "
         "reclaims brought that was not a recorded copy of the predecessor.");
  Sample(&out, "modelcache_adopted_bytes_total",
         static_cast<double>(bytes_taken_over_.load()),
         "origin=\"taken_over\"");
  Sample(&out, "modelcache_adopted_bytes_total",
         static_cast<double>(bytes_reclaimed_.load()), "origin=\"reclaimed\"");
  Sample(&out, "modelcache_adopted_bytes_total",
         static_cast<double>(bytes_refused_.load()), "origin=\"refused\"");
  Metric(&out, "modelcache_reclaims_total", "counter",
         "Reclaims of leases after a reconnect, by result.");
  Sample(&out, "modelcache_reclaims_total",
         static_cast<double>(reclaims_accepted_.load()), "result=\"accepted\"");
  Sample(&out, "modelcache_reclaims_total",
         static_cast<double>(reclaims_refused_.load()), "result=\"refused\"");
  counter("modelcache_record_write_failures_total",
          "Writes of the record of copies (SOCKET.state) that failed: a "
          "successor cannot reclaim the copies made since the last good one.",
          static_cast<double>(record_write_failures_.load()));
  gauge("modelcache_takeover_seconds",
        "How long the takeover that started this daemon took (0: none).",
        takeover_seconds_.load());
  gauge("modelcache_reclaim_pending_models",
        "Models whose copies may still be reclaimed (the grace period).",
        reclaiming_.load());
  {
    // One series per unavailable model, whatever --per-model-metrics says:
    // what an alert names, and as many as there are broken models.
    const std::map<std::string, detail::Unavailable> unavailable =
        UnavailableModels();
    gauge("modelcache_unavailable_models",
          "Models whose files cannot be opened or validated: their acquires "
          "fail with UNAVAILABLE unless a copy is resident.",
          static_cast<double>(unavailable.size()));
    Metric(&out, "modelcache_model_unavailable", "gauge",
           "1 for each model whose files cannot be opened or validated (the "
           "log, /v1/models and /readyz say why).");
    for (const auto& [model, u] : unavailable) {
      Sample(&out, "modelcache_model_unavailable", 1,
             "model=\"" + LabelValue(model) + "\"");
    }
  }
  Metric(&out, "modelcache_client_disconnects_total", "counter",
         "Connections ended, by reason.");
  for (size_t i = 0; i < disconnects_.size(); ++i) {
    Sample(&out, "modelcache_client_disconnects_total",
           static_cast<double>(disconnects_[i].load()),
           std::string("reason=\"") +
               detail::DisconnectName(static_cast<detail::Disconnect>(i)) +
               "\"");
  }
  counter("modelcache_protocol_errors_total", "Requests refused as malformed.",
          static_cast<double>(protocol_errors_.load()));
  Metric(&out, "modelcache_load_duration_seconds", "histogram",
         "How long loads took.");
  load_seconds_.Render("modelcache_load_duration_seconds", &out);
  Metric(&out, "modelcache_acquire_wait_seconds", "histogram",
         "How long acquires waited for their copy.");
  acquire_wait_seconds_.Render("modelcache_acquire_wait_seconds", &out);
  Metric(&out, "modelcache_loop_iteration_seconds", "histogram",
         "How long the event loop worked between two waits for events (from "
         "epoll_wait returning to the next call): every client waits this "
         "long at worst.");
  loop_iteration_seconds_.Render("modelcache_loop_iteration_seconds", &out);
  if (throttle_) {
    // A testing and sizing knob: its settings, and what it cost.
    if (std::isfinite(throttle_->bytes_per_second())) {
      gauge("modelcache_throttle_load_bandwidth_bytes_per_second",
            "The load throttle's bandwidth, shared by the loads moving "
            "bytes.",
            throttle_->bytes_per_second());
    }
    gauge("modelcache_throttle_load_latency_seconds",
          "The load throttle's fixed time per load.",
          std::chrono::duration<double>(throttle_->latency()).count());
    counter("modelcache_throttle_held_seconds_total",
            "Time loads were held by the load throttle after their real "
            "reads, summed over loads.",
            throttle_->held_seconds());
  }

  if (options_.per_model_metrics) {
    std::map<std::string, std::pair<uint64_t, int>> per_model;
    for (const EntryInfo& e : store_->Entries()) {
      if (e.state == EntryState::kRetired) continue;
      per_model[e.key] = {e.bytes, e.leases};
    }
    std::map<std::string, detail::ModelStats> model_stats;
    {
      base::MutexLock lock(&stats_mu_);
      model_stats = model_stats_;
    }
    Metric(&out, "modelcache_model_resident_bytes", "gauge",
           "Bytes of each resident model.");
    for (const auto& [model, v] : per_model) {
      Sample(&out, "modelcache_model_resident_bytes",
             static_cast<double>(v.first),
             "model=\"" + LabelValue(model) + "\"");
    }
    Metric(&out, "modelcache_model_leases", "gauge",
           "Leases of each resident model.");
    for (const auto& [model, v] : per_model) {
      Sample(&out, "modelcache_model_leases", v.second,
             "model=\"" + LabelValue(model) + "\"");
    }
    Metric(&out, "modelcache_model_loads_total", "counter",
           "Loads of each model.");
    for (const auto& [model, s] : model_stats) {
      Sample(&out, "modelcache_model_loads_total", static_cast<double>(s.loads),
             "model=\"" + LabelValue(model) + "\"");
    }
  }
  return {200, "text/plain; version=0.0.4; charset=utf-8", std::move(out)};
}

}  // namespace modelcache::serve
