// Takeover: a running daemon hands its listening sockets, copies and leases
// to a successor (design note: daemon_internal.h).
#include "daemon_internal.h"

namespace modelcache::serve {

void Daemon::Impl::HandleTakeover(detail::Connection& c,
                                  const protocol::Request& r) {
  SendError(c, r.id, ServeCode::kInvalid, "takeover is not supported yet");
}

void Daemon::Impl::HandleCommit(detail::Connection& c,
                                const protocol::Request& r) {
  SendError(c, r.id, ServeCode::kInvalid, "no takeover to commit");
}

void Daemon::Impl::SetHandoverListeners(
    std::vector<std::pair<std::string, int>> fds) {
  base::MutexLock lock(&handover_mu_);
  handover_listeners_ = std::move(fds);
}

int Daemon::Impl::TakeHandedOverListener(const std::string& name) {
  base::MutexLock lock(&handover_mu_);
  const auto it = taken_listeners_.find(name);
  if (it == taken_listeners_.end()) return -1;
  const int fd = it->second.release();
  taken_listeners_.erase(it);
  return fd;
}

}  // namespace modelcache::serve
