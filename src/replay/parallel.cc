// RunParallel (parallel.h, whose design note this follows).
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <vector>

namespace modelcache::replay {

void RunParallel(size_t count, unsigned threads,
                 const std::function<void(size_t task)>& task,
                 const std::function<void(size_t done)>& progress,
                 const ThreadStarter& start) {
  if (count == 0) return;
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable changed;
  size_t done = 0;           // guarded by mu
  size_t running = 0;        // workers not yet ended; guarded by mu
  std::exception_ptr error;  // the first; guarded by mu
  const auto fail = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = std::move(e);
    stop.store(true);
  };
  const auto work = [&] {
    while (!stop.load()) {
      const size_t i = next.fetch_add(1);
      if (i >= count) break;
      try {
        task(i);
      } catch (...) {
        fail(std::current_exception());
      }
      std::lock_guard<std::mutex> lock(mu);
      ++done;
      changed.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu);
    --running;
    changed.notify_all();
  };

  const unsigned workers =
      static_cast<unsigned>(std::min<size_t>(std::max(1u, threads), count));
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (unsigned w = 0; w < workers; ++w) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++running;
    }
    try {
      pool.push_back(start ? start(work) : std::thread(work));
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu);
        --running;
      }
      fail(std::current_exception());
      break;
    }
  }
  {
    // The last report comes once every worker has ended, so that the final
    // count is always reported, even when the tasks end before this waits.
    std::unique_lock<std::mutex> lock(mu);
    for (bool last = false; !last;) {
      if (running > 0) changed.wait_for(lock, std::chrono::milliseconds(100));
      last = running == 0;
      if (!progress || error) continue;
      const size_t now = done;
      lock.unlock();
      try {
        progress(now);
      } catch (...) {
        fail(std::current_exception());
      }
      lock.lock();
    }
  }
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace modelcache::replay
