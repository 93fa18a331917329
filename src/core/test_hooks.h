// Points in the core where a test can run code at a moment no public call can
// reach. Null (and never called) unless a test sets them. Not part of the
// public API: tests include this file by its path in the source tree.
#ifndef MODELCACHE_SRC_CORE_TEST_HOOKS_H_
#define MODELCACHE_SRC_CORE_TEST_HOOKS_H_

#include <atomic>
#include <string_view>

namespace modelcache::detail {

// Called by a load's owner, with no lock held, after the record became
// resident and every waiter's lease was granted, and before the waiters are
// woken: the moment at which the waiters hold leases they have not yet seen.
inline std::atomic<void (*)(std::string_view key)> after_load_published{
    nullptr};

// Called by a cache's shutdown (its destructor) each time it finds a peer's
// eviction still unloading one of its records and is about to wait for it.
// Runs under a shard mutex: it must not call into the cache.
inline std::atomic<void (*)()> shutdown_waits_for_unload{nullptr};

// Called by Budget::Reserve, under the budget's mutex (it must not call into
// the budget or a cache), each time a reservation that could not get its
// bytes is about to sleep waiting for capacity (WhenFull::kWait): after it
// decided whether to evict, and only when nothing changed since it looked,
// so that once this is called it acts again only after a later change (which
// still wakes it), its deadline or its interrupt's turn.
inline std::atomic<void (*)()> reservation_waits_for_room{nullptr};

// Called by an acquire queued behind a draining record each time it is about
// to wait for the drain to end, under the record's shard mutex (it must not
// call into the cache). A drain that ends after this call still wakes it.
inline std::atomic<void (*)()> acquire_waits_behind_drain{nullptr};

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_TEST_HOOKS_H_
