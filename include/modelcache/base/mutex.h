// Mutex, MutexLock and CondVar: the thin annotated locking primitives every
// layer uses, in the manner of leveldb's port::Mutex and util/mutexlock.h.
//
// Lock ranks (debug builds). clang's -Wthread-safety-beta checks
// MC_ACQUIRED_BEFORE/AFTER only where both mutexes are taken in one
// function, and plain -Wthread-safety not at all; an order that runs
// through calls (a lock held across user code, such as a store's unloader,
// that takes another) is beyond it. A Mutex made with a LockRank is checked
// at run time instead: a thread may take it only while every ranked mutex
// it holds has a lower rank, so two of equal rank are never held together.
// A thread that breaks the order aborts, naming both mutexes, at the lock
// that breaks it (whether or not the run would have deadlocked). Without
// NDEBUG only; unranked mutexes are never checked.
//
// State: per thread, the ranked mutexes it holds, in the order taken
// (held_ranks); Lock adds one after checking it, Unlock removes it
// (wherever it is: unlocks need not nest). CondVar's waits keep the entry:
// the thread takes no other lock while it waits.
#ifndef MODELCACHE_BASE_MUTEX_H_
#define MODELCACHE_BASE_MUTEX_H_

#include <pthread.h>
#include <time.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "modelcache/base/thread_annotations.h"

namespace modelcache::base {

// A mutex's place in a lock order (see the note at the top). Rank 0: none.
struct LockRank {
  int rank = 0;
  const char* name = "";
};

namespace detail {

// The ranked mutexes this thread holds (debug builds).
struct HeldRanks {
  static constexpr int kMax = 16;
  const void* mutex[kMax];
  LockRank rank[kMax];
  int count = 0;
};
inline thread_local HeldRanks held_ranks;

[[noreturn]] inline void LockOrderBroken(const LockRank& taking,
                                         const LockRank& held) {
  std::fprintf(stderr,
               "lock order broken: %s (rank %d) taken while holding %s "
               "(rank %d)\n",
               taking.name, taking.rank, held.name, held.rank);
  std::abort();
}

inline void BeforeLock(const void* mutex, const LockRank& rank) {
  HeldRanks& held = held_ranks;
  for (int i = 0; i < held.count; ++i) {
    if (held.rank[i].rank >= rank.rank) LockOrderBroken(rank, held.rank[i]);
  }
  if (held.count == HeldRanks::kMax) {
    std::fprintf(stderr, "more than %d ranked locks held at once\n",
                 HeldRanks::kMax);
    std::abort();
  }
  held.mutex[held.count] = mutex;
  held.rank[held.count] = rank;
  ++held.count;
}

inline void AfterUnlock(const void* mutex) {
  HeldRanks& held = held_ranks;
  for (int i = held.count - 1; i >= 0; --i) {
    if (held.mutex[i] != mutex) continue;
    for (int j = i + 1; j < held.count; ++j) {
      held.mutex[j - 1] = held.mutex[j];
      held.rank[j - 1] = held.rank[j];
    }
    --held.count;
    return;
  }
}

}  // namespace detail

// A mutex the analysis can see.
//
// It is glibc's adaptive mutex: a contended Lock() spins briefly before it
// sleeps. Every critical section in modelcache is short (a hash lookup and a
// few counters on the hit path), so a waiter almost always gets the lock
// within the spin; without it, two threads colliding on one cache shard
// paid a futex sleep and wake-up (microseconds) for a 20 ns critical section.
class MC_CAPABILITY("mutex") Mutex {
 public:
  Mutex() : Mutex(LockRank{}) {}
  // A mutex whose lock order debug builds check (see the note at the top).
  explicit Mutex(LockRank rank) : rank_(rank) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
#if defined(PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP)
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
    pthread_mutex_init(&mu_, &attr);
    pthread_mutexattr_destroy(&attr);
  }
  ~Mutex() { pthread_mutex_destroy(&mu_); }
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() MC_ACQUIRE() {
#ifndef NDEBUG
    if (rank_.rank != 0) detail::BeforeLock(this, rank_);
#endif
    pthread_mutex_lock(&mu_);
  }
  void Unlock() MC_RELEASE() {
    pthread_mutex_unlock(&mu_);
#ifndef NDEBUG
    if (rank_.rank != 0) detail::AfterUnlock(this);
#endif
  }
  // Tells the analysis the lock is held where it cannot see that itself (in
  // a callback run under the lock). No runtime check.
  void AssertHeld() const MC_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  // The lock word first, the rank after it: a release build touches only
  // the lock word, so a struct may keep its hot fields in the lock word's
  // cache line and let the rank spill into the next (the cache's shards).
  pthread_mutex_t mu_;
  const LockRank rank_;
};

// Holds a Mutex for a scope.
class MC_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) MC_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() MC_RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable bound to a Mutex held by the caller. Deadlines are
// std::chrono::steady_clock time points, which on Linux is CLOCK_MONOTONIC:
// the clock the condition variable is created with.
class CondVar {
 public:
  CondVar() {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&cv_, &attr);
    pthread_condattr_destroy(&attr);
  }
  ~CondVar() { pthread_cond_destroy(&cv_); }
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) MC_REQUIRES(mu) { pthread_cond_wait(&cv_, &mu->mu_); }
  // Returns false when the deadline passed before a notification.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point deadline)
      MC_REQUIRES(mu) {
    if (deadline == std::chrono::steady_clock::time_point::max()) {
      Wait(mu);
      return true;
    }
    const auto since_epoch = deadline.time_since_epoch();
    const auto seconds =
        std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
    timespec ts;
    ts.tv_sec = static_cast<time_t>(seconds.count());
    ts.tv_nsec =
        static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              since_epoch - seconds)
                              .count());
    if (ts.tv_sec < 0) {  // a deadline before the clock's epoch: now
      ts.tv_sec = 0;
      ts.tv_nsec = 0;
    }
    return pthread_cond_timedwait(&cv_, &mu->mu_, &ts) != ETIMEDOUT;
  }
  void NotifyAll() { pthread_cond_broadcast(&cv_); }

 private:
  pthread_cond_t cv_;
};

}  // namespace modelcache::base

#endif  // MODELCACHE_BASE_MUTEX_H_
