// Unavailable models: a model whose files fail the checks of
// --check-catalog costs that model, not the daemon (design note:
// daemon_internal.h). The state is written on the loop (and in the
// constructor); the HTTP threads read it under unavailable_mu_.
#include <algorithm>
#include <cstdio>

#include "daemon_internal.h"

namespace modelcache::serve {

namespace {

// "800 ms", "2.0 s": how long until an acquire tries the files again.
std::string Wait(Clock::duration d) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  if (ms < 1000) return std::to_string(std::max<int64_t>(ms, 0)) + " ms";
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", static_cast<double>(ms) / 1000);
  return text;
}

}  // namespace

void Daemon::Impl::MarkUnavailable(const CatalogModel& model,
                                   const detail::FileProblem& problem,
                                   bool tried) {
  const Clock::time_point now = Clock::now();
  const Clock::duration first = options_.unavailable_retry;
  const Clock::duration most =
      std::max<Clock::duration>(first, detail::kUnavailableRetryMax);
  bool fresh;
  bool changed;
  Clock::time_point retry_at;
  {
    base::MutexLock lock(&unavailable_mu_);
    const auto [it, inserted] = unavailable_.try_emplace(model.id);
    detail::Unavailable& u = it->second;
    fresh = inserted;
    changed = !inserted && u.problem.error != problem.error;
    u.problem = problem;
    if (inserted) {
      u.since = now;
      u.backoff = first;
    }
    // A reload that finds it failing still leaves the acquires' schedule
    // as it was; a failed try of theirs waits longer for the next.
    if (inserted || tried) {
      u.retry_at = now + u.backoff;
      u.backoff = std::min<Clock::duration>(2 * u.backoff, most);
    }
    retry_at = u.retry_at;
  }
  if (!fresh && !changed) return;  // one line, not one per try
  Log(std::string(model.pinned ? "pinned model '" : "model '") + model.id +
      "' is unavailable: " + problem.error +
      (model.pinned ? "; it is not loaded, nor pinned, until its files are "
                      "valid"
                    : "") +
      "; its acquires fail with UNAVAILABLE; its files are checked again by "
      "a reload (SIGHUP) and by an acquire in " +
      Wait(retry_at - now));
}

void Daemon::Impl::MarkAvailable(const std::string& model) {
  {
    base::MutexLock lock(&unavailable_mu_);
    if (unavailable_.erase(model) == 0) return;
  }
  Log("model '" + model + "' is available again: its files are valid");
  if (stopping_) return;
  // A pinned one was not loaded while it was unavailable: pinned now (a hit
  // when the copy that made it available is resident).
  const std::shared_ptr<const Catalog> cat = catalog();
  const CatalogModel* spec = cat->Find(model);
  if (spec == nullptr || spec->id != model || !spec->pinned) return;
  const std::optional<EntryInfo> entry = store_->Entry(model);
  if (entry && entry->state == EntryState::kResident && entry->pinned) return;
  StartPrefetch(*spec, /*pin=*/true, nullptr);
}

bool Daemon::Impl::RefuseUnavailable(const std::string& model,
                                     std::string* message,
                                     std::string* cause) const {
  {
    base::MutexLock lock(&unavailable_mu_);
    const auto it = unavailable_.find(model);
    if (it == unavailable_.end()) return false;
    // Past its back-off: this acquire's load tries the files again.
    if (Clock::now() >= it->second.retry_at) return false;
    *cause = ErrorCodeName(it->second.problem.code);
  }
  *message = UnavailableMessage(model);
  return true;
}

std::string Daemon::Impl::UnavailableMessage(const std::string& model) const {
  base::MutexLock lock(&unavailable_mu_);
  const auto it = unavailable_.find(model);
  if (it == unavailable_.end()) return "model '" + model + "' is unavailable";
  const Clock::time_point now = Clock::now();
  const detail::Unavailable& u = it->second;
  return "model '" + model + "' is unavailable: " + u.problem.error +
         " (its files are checked again by a reload, and by " +
         (now >= u.retry_at ? std::string("the next acquire")
                            : "an acquire in " + Wait(u.retry_at - now)) +
         ")";
}

bool Daemon::Impl::IsUnavailable(const std::string& model) const {
  base::MutexLock lock(&unavailable_mu_);
  return unavailable_.count(model) != 0;
}

std::map<std::string, detail::Unavailable> Daemon::Impl::UnavailableModels()
    const {
  base::MutexLock lock(&unavailable_mu_);
  return unavailable_;
}

}  // namespace modelcache::serve
