// Reclaim: copies a predecessor made, re-asserted by the clients that map
// them (design note: daemon_internal.h).
#include "daemon_internal.h"

namespace modelcache::serve {

void Daemon::Impl::HandleReclaim(detail::Connection& c,
                                 const protocol::Request& r,
                                 std::vector<base::UniqueFd> fds) {
  fds.clear();
  SendError(c, r.id, ServeCode::kInvalid, "reclaim is not supported yet");
}

void Daemon::Impl::HandleTakeover(detail::Connection& c,
                                  const protocol::Request& r) {
  SendError(c, r.id, ServeCode::kInvalid, "takeover is not supported yet");
}

void Daemon::Impl::HandleCommit(detail::Connection& c,
                                const protocol::Request& r) {
  SendError(c, r.id, ServeCode::kInvalid, "no takeover to commit");
}

}  // namespace modelcache::serve
