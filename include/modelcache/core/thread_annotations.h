// Clang thread-safety annotations and a thin annotated mutex.
//
// Lock discipline in modelcache is checked by the compiler: every member
// guarded by a mutex says so with GUARDED_BY, and every function that needs a
// lock held says so with REQUIRES. The clang build (preset `clang-tsa`)
// compiles with -Wthread-safety -Werror; other compilers see empty macros.
#ifndef MODELCACHE_CORE_THREAD_ANNOTATIONS_H_
#define MODELCACHE_CORE_THREAD_ANNOTATIONS_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define MC_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define MC_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) MC_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY MC_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) MC_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) MC_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) MC_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) MC_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) MC_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) MC_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) MC_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) MC_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) MC_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS \
  MC_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace modelcache {

// A std::mutex the analysis can see.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // For documentation and for the analysis only; no runtime check.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for a scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable bound to a Mutex held by the caller.
class CondVar {
 public:
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Returns false when the deadline passed before a notification.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point deadline)
      REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool notified =
        cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return notified;
  }
  void NotifyAll() { cv_.notify_all(); }
  void NotifyOne() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace modelcache

#endif  // MODELCACHE_CORE_THREAD_ANNOTATIONS_H_
