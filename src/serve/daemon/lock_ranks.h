// The daemon's lock ranks (base::LockRank; the order is in the design note
// at the top of daemon_internal.h): an outer mutex may be held while a leaf
// is taken, never the reverse, and no leaf while another leaf is held.
#ifndef MODELCACHE_SRC_SERVE_DAEMON_LOCK_RANKS_H_
#define MODELCACHE_SRC_SERVE_DAEMON_LOCK_RANKS_H_

namespace modelcache::serve::detail {

inline constexpr int kOuterLockRank = 1;
inline constexpr int kLeafLockRank = 2;

}  // namespace modelcache::serve::detail

#endif  // MODELCACHE_SRC_SERVE_DAEMON_LOCK_RANKS_H_
