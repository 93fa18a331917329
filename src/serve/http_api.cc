// The daemon's HTTP control API and its Prometheus metrics, independent of
// any HTTP server: HandleHttp maps a method, a path and a body to a status
// and a body. `modelcache serve` puts it behind cpp-httplib
// (src/tools/serve_command.cc).
//
// Reads come from the store (thread-safe), the lease table and the other
// books under their mutexes. A load or a pin that must load goes to the
// event loop as a command, so that it takes a load slot like any other load,
// and the handler waits for its result.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>
#include <nlohmann/json.hpp>

#include "daemon_internal.h"
#include "modelcache/base/bytes.h"

namespace modelcache::serve {

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

}  // namespace detail

namespace {

using json = nlohmann::json;

constexpr size_t kMaxBodyBytes = size_t{64} << 10;
constexpr auto kLoadWait = std::chrono::minutes(10);

HttpResponse Json(int status, const json& body) {
  return {status, "application/json",
          body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"};
}

HttpResponse Problem(int status, const std::string& message) {
  return Json(status, json{{"error", message}});
}

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

const char* UseName(detail::Use use) {
  switch (use) {
    case detail::Use::kInUse:
      return "in_use";
    case detail::Use::kIdle:
      return "idle";
    case detail::Use::kRecalled:
      return "recalled";
  }
  return "in_use";
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

// Triton's model states.
const char* StateName(EntryState state) {
  switch (state) {
    case EntryState::kLoading:
      return "LOADING";
    case EntryState::kResident:
      return "READY";
    case EntryState::kUnloading:
      return "UNLOADING";
    case EntryState::kRetired:
      break;
  }
  return "UNAVAILABLE";
}

std::vector<std::string> Split(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 1;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    if (end > start) parts.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

}  // namespace

HttpResponse Daemon::Impl::HandleHttp(const HttpRequest& request) {
  if (request.body.size() > kMaxBodyBytes) {
    return Problem(413, "request bodies are at most " +
                            std::to_string(kMaxBodyBytes) + " bytes");
  }
  const std::vector<std::string> parts = Split(request.path);
  const bool get = request.method == "GET" || request.method == "HEAD";
  const auto mutation = [&]() -> std::optional<HttpResponse> {
    if (!request.admin) {
      return Problem(403,
                     "changes need the admin listener (--admin-socket or "
                     "--http-admin)");
    }
    return std::nullopt;
  };
  const auto wrong_method = [&](const char* allowed) {
    HttpResponse r = Problem(405, std::string("use ") + allowed);
    return r;
  };
  try {
    if (parts.size() == 1 && parts[0] == "healthz") {
      return get ? Health() : wrong_method("GET");
    }
    if (parts.size() == 1 && parts[0] == "readyz") {
      return get ? Ready() : wrong_method("GET");
    }
    if (parts.size() == 1 && parts[0] == "metrics") {
      return get ? Metrics() : wrong_method("GET");
    }
    if (parts.size() >= 2 && parts[0] == "v1" && parts[1] == "models") {
      if (parts.size() == 2) return get ? Models("") : wrong_method("GET");
      if (!IsValidModelId(parts[2])) {
        return Problem(400, "not a valid model id");
      }
      if (parts.size() == 3)
        return get ? Models(parts[2]) : wrong_method("GET");
      if (parts.size() == 4) {
        if (request.method != "POST") return wrong_method("POST");
        if (auto refused = mutation()) return *refused;
        return ModelAction(parts[2], parts[3]);
      }
    }
    if (parts.size() == 2 && parts[0] == "v1" && parts[1] == "budget") {
      if (request.method == "PUT") {
        if (auto refused = mutation()) return *refused;
        return BudgetEndpoint(request);
      }
      return get ? BudgetEndpoint(request) : wrong_method("GET or PUT");
    }
    if (parts.size() == 2 && parts[0] == "v1" && parts[1] == "copies") {
      return get ? Copies() : wrong_method("GET");
    }
  } catch (const std::exception& e) {
    return Problem(500, e.what());
  }
  return Problem(404, "no such endpoint: " + request.path);
}

HttpResponse Daemon::Impl::Health() {
  uint64_t ticket;
  {
    base::MutexLock lock(&inbox_mu_);
    ticket = ++health_asked_;
  }
  Wake();
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  base::MutexLock lock(&inbox_mu_);
  while (health_answered_ < ticket) {
    if (!health_cv_.WaitUntil(&inbox_mu_, deadline)) break;
  }
  if (health_answered_ < ticket) {
    return {503, "text/plain", "the event loop did not answer within 1 s\n"};
  }
  return {200, "text/plain", "ok\n"};
}

HttpResponse Daemon::Impl::Ready() {
  json reasons = json::array();
  if (shutting_down_.load()) reasons.push_back("shutting down");
  const auto age = Clock::now() - started_;
  if (age < options_.ready_grace) {
    reasons.push_back(
        "in the grace period after start (" +
        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                           options_.ready_grace - age)
                           .count()) +
        " ms left)");
  }
  if (const int pending = reclaiming_.load(); pending > 0) {
    reasons.push_back("awaiting the reclaim of " + std::to_string(pending) +
                      " models' copies a predecessor left mapped");
  }
  // A model whose files fail the checks is listed, not a reason: the other
  // models serve, and a 503 would take them all out of the balancer. So
  // is a pinned one (it would hold the node at 503 until its files come
  // back). Only when no model can be served at all is the node not ready.
  const std::shared_ptr<const Catalog> cat = catalog();
  const std::map<std::string, detail::Unavailable> unavailable =
      UnavailableModels();
  bool any_served = false;
  for (const CatalogModel& m : cat->models()) {
    if (unavailable.count(m.id) == 0) {
      any_served = true;
      break;
    }
    const auto entry = store_->Entry(m.id);
    if (entry && entry->state == EntryState::kResident) {
      any_served = true;  // its copy serves without its files
      break;
    }
  }
  if (!any_served && !cat->models().empty()) {
    reasons.push_back(
        "no model can be served: the files of every model of "
        "the catalog are unavailable");
  }
  for (const CatalogModel& m : cat->models()) {
    if (!m.pinned || unavailable.count(m.id) != 0) continue;
    const auto entry = store_->Entry(m.id);
    if (entry && entry->state == EntryState::kResident && entry->pinned) {
      continue;
    }
    // The real reason: its load runs, or failed (and why).
    std::string last_error;
    {
      base::MutexLock lock(&stats_mu_);
      const auto s = model_stats_.find(m.id);
      if (s != model_stats_.end()) last_error = s->second.last_error;
    }
    if (entry && entry->state == EntryState::kLoading) {
      reasons.push_back("pinned model '" + m.id + "' is loading");
    } else if (!last_error.empty()) {
      reasons.push_back("pinned model '" + m.id +
                        "' is not resident: load failed: " + last_error);
    } else {
      reasons.push_back("pinned model '" + m.id + "' is not resident yet");
    }
  }
  json body = {{"ready", reasons.empty()}, {"reasons", reasons}};
  if (!unavailable.empty()) {
    json models = json::object();
    for (const auto& [id, u] : unavailable) models[id] = u.problem.error;
    body["unavailable"] = models;
  }
  {
    base::MutexLock lock(&catalog_mu_);
    if (!reload_error_.empty()) body["catalog_reload_error"] = reload_error_;
  }
  return Json(reasons.empty() ? 200 : 503, body);
}

HttpResponse Daemon::Impl::Models(const std::string& only) {
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* single = nullptr;
  if (!only.empty()) {
    single = cat->Find(only);
    if (single == nullptr) {
      return Problem(404, "no model '" + only + "' in the catalog");
    }
  }
  std::map<std::string, json> leases;
  {
    base::MutexLock lock(&leases_mu_);
    for (const auto& [id, lease] : leases_) {
      leases[lease.model].push_back({{"lease", id},
                                     {"pid", lease.pid},
                                     {"uid", lease.uid},
                                     {"orphaned", lease.orphaned},
                                     {"use", UseName(lease.use)}});
    }
  }
  std::map<std::string, detail::ModelStats> stats;
  {
    base::MutexLock lock(&stats_mu_);
    stats = model_stats_;
  }
  const std::map<std::string, detail::Unavailable> unavailable =
      UnavailableModels();
  const std::vector<EntryInfo> entries = store_->Entries();
  const auto now = Clock::now();
  const auto seconds = [](Clock::duration d) {
    return std::chrono::duration<double>(d).count();
  };
  const auto describe = [&](const CatalogModel& m) {
    json model = {{"id", m.id},
                  {"aliases", m.aliases},
                  {"files", m.files},
                  {"pinned", false},
                  {"catalog_pinned", m.pinned},
                  {"priority", m.priority},
                  {"state", "UNAVAILABLE"},
                  {"reason", "not loaded"},
                  {"bytes", 0},
                  {"retired_bytes", 0},
                  {"leases", leases.count(m.id) ? leases[m.id] : json::array()},
                  {"loads", 0},
                  {"last_load_seconds", nullptr},
                  {"idle_seconds", nullptr},
                  {"unavailable", nullptr}};
    if (const auto s = stats.find(m.id); s != stats.end()) {
      model["loads"] = s->second.loads;
      if (s->second.loads > 0) {
        model["last_load_seconds"] = s->second.last_load_seconds;
      }
      if (!s->second.last_error.empty()) {
        model["reason"] = "load failed: " + s->second.last_error;
      }
    }
    uint64_t retired = 0;
    for (const EntryInfo& e : entries) {
      if (e.key != m.id) continue;
      if (e.state == EntryState::kRetired) {
        retired += e.bytes;
        continue;
      }
      model["state"] = StateName(e.state);
      model["reason"] = "";
      model["bytes"] = e.bytes;
      model["pinned"] = e.pinned;
      if (e.state == EntryState::kResident && e.leases == 0) {
        model["idle_seconds"] =
            std::chrono::duration<double>(now - e.last_use).count();
      }
    }
    model["retired_bytes"] = retired;
    if (retired > 0 && model["state"] == "UNAVAILABLE") {
      model["reason"] = "retired: a copy is freed when its last lease ends";
    }
    // Its files fail the checks: a resident copy still serves (READY), and
    // without one its acquires are refused until the files are valid.
    if (const auto u = unavailable.find(m.id); u != unavailable.end()) {
      model["unavailable"] = {
          {"error", u->second.problem.error},
          {"since_seconds", seconds(now - u->second.since)},
          {"retry_in_seconds",
           seconds(std::max(u->second.retry_at - now, Clock::duration{0}))}};
      if (model["state"] == "UNAVAILABLE") {
        model["reason"] = "files unavailable: " + u->second.problem.error;
      }
    }
    return model;
  };
  if (single != nullptr) return Json(200, describe(*single));
  json list = json::array();
  for (const CatalogModel& m : cat->models()) list.push_back(describe(m));
  return Json(200, json{{"models", list}});
}

HttpResponse Daemon::Impl::ModelAction(const std::string& id,
                                       const std::string& action) {
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* model = cat->Find(id);
  if (action != "load" && action != "unload" && action != "pin" &&
      action != "unpin") {
    return Problem(
        404, "no action '" + action + "' (known: load, unload, pin, unpin)");
  }
  if (model == nullptr) {
    return Problem(404, "no model '" + id + "' in the catalog");
  }
  const std::string key = model->id;
  const auto load = [&](bool pin) {
    auto done = std::make_shared<std::promise<detail::PrefetchResult>>();
    std::future<detail::PrefetchResult> result = done->get_future();
    {
      base::MutexLock lock(&inbox_mu_);
      if (loop_done_) return Problem(503, "the daemon is shutting down");
      commands_.push_back({key, pin, std::move(done)});
    }
    Wake();
    if (result.wait_for(kLoadWait) != std::future_status::ready) {
      return Problem(504, "'" + key + "' is still loading");
    }
    const detail::PrefetchResult r = result.get();
    if (r.status != 200) return Problem(r.status, r.error);
    return Json(200, json{{"model", key}, {"state", "READY"}, {"pinned", pin}});
  };
  if (action == "load") return load(false);
  if (action == "pin") {
    try {
      store_->Pin(key);
      return Json(200,
                  json{{"model", key}, {"state", "READY"}, {"pinned", true}});
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNotFound) throw;
    }
    return load(true);
  }
  if (action == "unpin") {
    try {
      store_->Unpin(key);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNotFound) throw;
    }
    return Json(200, json{{"model", key}, {"pinned", false}});
  }
  // unload
  int leases = 0;
  if (const auto entry = store_->Entry(key)) leases = entry->leases;
  RemoveOutcome outcome = RemoveOutcome::kNotFound;
  uint64_t recalls = RecallsStarted();
  RecallRetired(key);
  for (int attempt = 0;; ++attempt) {
    try {
      outcome = store_->Remove(key, Clock::now() + std::chrono::seconds(60));
      break;
    } catch (const Error& e) {
      // Its unloader refused: idle delegations of it were recalled. Wait for
      // their answers (bounded by the recall timeout) and try again.
      if (e.code() != ErrorCode::kFailedPrecondition || attempt >= 2) {
        return Problem(409, "'" + key + "' stays: " + e.what());
      }
      const uint64_t since = recalls;
      recalls = RecallsStarted();
      WaitForRecalls(since, Clock::now() + 2 * options_.recall_timeout);
    }
  }
  switch (outcome) {
    case RemoveOutcome::kRemoved:
      return Json(200, json{{"model", key}, {"outcome", "removed"}});
    case RemoveOutcome::kRetired:
      return Json(200, json{{"model", key},
                            {"outcome", "retired"},
                            {"leases", leases},
                            {"message", std::to_string(leases) +
                                            " leases hold it: it is freed "
                                            "when the last ends"}});
    case RemoveOutcome::kNotFound:
      break;
  }
  return Json(200, json{{"model", key}, {"outcome", "not_resident"}});
}

HttpResponse Daemon::Impl::BudgetEndpoint(const HttpRequest& request) {
  if (request.method == "PUT") {
    json body = json::parse(request.body, nullptr, false);
    if (body.is_discarded() || !body.is_object() || body.size() != 1 ||
        !body.contains("capacity_bytes")) {
      return Problem(400,
                     "want {\"capacity_bytes\": N} (a number, or a size such "
                     "as \"24GiB\")");
    }
    uint64_t capacity = 0;
    const json& value = body["capacity_bytes"];
    if (value.is_number_unsigned()) {
      capacity = value.get<uint64_t>();
    } else if (value.is_string()) {
      try {
        capacity = ParseBytes(value.get<std::string>());
      } catch (const Error& e) {
        return Problem(400, e.what());
      }
    } else {
      return Problem(400, "capacity_bytes must be a number or a size");
    }
    if (capacity == 0) return Problem(400, "capacity_bytes must be above 0");
    {
      base::MutexLock lock(&capacity_mu_);
      configured_ = capacity;
      ApplyCapacity(orphaned_.load());
    }
    store_->budget().EvictOverCapacity();  // with capacity_mu_ let go
  }
  const ModelCache& store = *store_;
  const uint64_t configured = configured_.load();
  const uint64_t orphaned = orphaned_.load();
  const uint64_t used = store.budget().used();
  const uint64_t capacity = store.budget().capacity();
  return Json(200, json{{"capacity_bytes", configured},
                        {"store_capacity_bytes", capacity},
                        {"used_bytes", used},
                        {"high_water_bytes", store.budget().high_water()},
                        {"orphaned_bytes", orphaned},
                        {"orphaned_leases", orphaned_leases_.load()},
                        {"over_bytes", used > capacity ? used - capacity : 0},
                        {"waiting_acquires", waiting_.load()}});
}

HttpResponse Daemon::Impl::Copies() {
  json memfds = json::array();
  {
    base::MutexLock lock(&live_mu_);
    for (const detail::MemfdId& id : live_) {
      memfds.push_back({{"dev", id.dev}, {"inode", id.inode}});
    }
  }
  json orphans = json::array();
  int unreadable;
  {
    base::MutexLock lock(&orphans_mu_);
    for (const auto& [id, o] : restart_orphans_) {
      orphans.push_back({{"dev", id.dev},
                         {"inode", id.inode},
                         {"bytes", o.bytes},
                         {"name", o.name},
                         {"pids", o.pids}});
    }
    unreadable = unreadable_maps_;
  }
  json copies = json::array();
  {
    base::MutexLock lock(&record_mu_);
    for (const auto& [id, e] : record_) {
      copies.push_back({{"model", e.copy.model},
                        {"origin", e.origin},
                        {"bytes", e.bytes},
                        {"files", e.copy.files.size()}});
    }
  }
  return Json(200, json{{"memfd_prefix", memfd_prefix_},
                        {"copies", copies},
                        {"memfds", memfds},
                        {"orphans", orphans},
                        {"unreadable_maps", unreadable}});
}

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
           std::string("use=\"") + UseName(static_cast<detail::Use>(i)) + "\"");
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
