// The daemon's HTTP control API, independent of any HTTP server: HandleHttp
// maps a method, a path and a body to a status and a body. `modelcache serve`
// puts it behind cpp-httplib (src/tools/serve_command.cc).
//
// Reads come from the store (thread-safe), the lease table and the other
// books under their mutexes. A load or a pin that must load goes to the
// event loop as a command, so that it takes a load slot like any other load,
// and the handler waits for its result.
#include <sys/stat.h>

#include <algorithm>
#include <future>
#include <nlohmann/json.hpp>

#include "daemon_internal.h"
#include "modelcache/base/bytes.h"

namespace modelcache::serve {

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
                                     {"use", detail::UseName(lease.use)}});
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
                  {"draining", false},
                  {"drain_for", nullptr},
                  {"queued_behind_drain", 0},
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
      // A resident copy's waiters are loads queued behind its drain
      // (EntryInfo::waiters): it drains, and they wait for it.
      if (e.state == EntryState::kResident) {
        model["queued_behind_drain"] = e.waiters;
      }
      // Draining: no new lease until the request for room it drains for
      // (its key and the store's cache, "'B' in cache 'serve'") is served.
      model["draining"] = e.draining;
      if (e.draining) model["drain_for"] = e.drain_for;
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
      CapacityHoldHook();
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

}  // namespace modelcache::serve
