// Clang thread-safety annotations, prefixed MC_ so that they never clash with
// another library's (abseil, for one, defines the unprefixed names).
//
// Lock discipline in modelcache is checked by the compiler: every member
// guarded by a mutex says so with MC_GUARDED_BY, and every function that needs
// a lock held says so with MC_REQUIRES. The clang build (preset `clang-tsa`)
// compiles with -Wthread-safety -Werror; other compilers see empty macros.
#ifndef MODELCACHE_BASE_THREAD_ANNOTATIONS_H_
#define MODELCACHE_BASE_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define MC_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define MC_THREAD_ANNOTATION_(x)
#endif

// A type that is a lock ("mutex").
#define MC_CAPABILITY(x) MC_THREAD_ANNOTATION_(capability(x))
// An RAII type that holds a lock for its lifetime.
#define MC_SCOPED_CAPABILITY MC_THREAD_ANNOTATION_(scoped_lockable)
// A member read and written only with the given lock held.
#define MC_GUARDED_BY(x) MC_THREAD_ANNOTATION_(guarded_by(x))
// A function that must be called with the given locks held.
#define MC_REQUIRES(...) MC_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
// A function that must be called without the given locks held.
#define MC_EXCLUDES(...) MC_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))

// The order of two mutexes: this one is taken before (after) those named,
// never while they are held. Checked by -Wthread-safety-beta where both are
// taken in one function.
#define MC_ACQUIRED_BEFORE(...) \
  MC_THREAD_ANNOTATION_(acquired_before(__VA_ARGS__))
#define MC_ACQUIRED_AFTER(...) \
  MC_THREAD_ANNOTATION_(acquired_after(__VA_ARGS__))
// A function that takes, or lets go of, the given locks.
#define MC_ACQUIRE(...) MC_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define MC_RELEASE(...) MC_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
// A function that asserts, to the analysis, that the lock is held.
#define MC_ASSERT_CAPABILITY(x) MC_THREAD_ANNOTATION_(assert_capability(x))

#endif  // MODELCACHE_BASE_THREAD_ANNOTATIONS_H_
