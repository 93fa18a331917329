// Runs a batch of independent replays on a few threads, with progress: what
// ReplayAll, ReplayClusterAll and each round of the SLO search share.
//
// Design note.
//
// The workers take the tasks' numbers from one atomic counter, in order, so
// a task's result goes to its own slot and the results never depend on the
// number of threads. The calling thread runs no task: it waits on a
// condition variable, reporting progress as tasks end and every 100 ms (a
// run's own counters, read by the progress callback, move in between). The
// first error a task throws is kept and rethrown once every worker is
// joined; after it no new task starts. Starting a thread can throw too
// (std::system_error when the system has none to give): then no new task
// starts either, the workers already running finish the task they hold and
// are joined, and that error is rethrown. No thread is left joinable, so
// nothing calls std::terminate.
#ifndef MODELCACHE_SRC_REPLAY_PARALLEL_H_
#define MODELCACHE_SRC_REPLAY_PARALLEL_H_

#include <cstddef>
#include <functional>
#include <thread>

namespace modelcache::replay {

// Starts a thread that runs `body` and returns it, or throws having started
// none. The default is std::thread's constructor; a test passes one that
// fails.
using ThreadStarter = std::function<std::thread(std::function<void()> body)>;

// Runs task(i) for every i in [0, count), on min(threads, count) threads (at
// least one, none when count is 0), and returns when all have ended.
// `progress(done)`, when set, is called from the calling thread with the
// number of tasks ended so far: after each task ends (several that end
// together may be reported by one call) and at least every 100 ms until all
// have; never after RunParallel returns, nor after an error. Throws the first
// error of a task, or of `start`, once every thread started is joined; after an
// error no further task starts. An error `progress` throws is one too. `task`
// may be called from several threads at once.
void RunParallel(size_t count, unsigned threads,
                 const std::function<void(size_t task)>& task,
                 const std::function<void(size_t done)>& progress = {},
                 const ThreadStarter& start = {});

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_PARALLEL_H_
