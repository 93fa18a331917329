// RunParallel (src/replay/parallel.h): every task once, progress from the
// calling thread, and every thread started joined before an error leaves,
// whether a task or the start of a thread threw it.
#include "../../src/replay/parallel.h"

#include <atomic>
#include <latch>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelcache::replay {
namespace {

TEST(RunParallel, RunsEveryTaskOnce) {
  for (unsigned threads : {0u, 1u, 3u, 64u}) {
    std::vector<std::atomic<int>> runs(200);
    RunParallel(runs.size(), threads, [&](size_t i) { ++runs[i]; });
    for (size_t i = 0; i < runs.size(); ++i) {
      ASSERT_EQ(runs[i].load(), 1) << "task " << i << ", threads " << threads;
    }
  }
  RunParallel(0, 4, [](size_t) { FAIL() << "no task to run"; });
}

TEST(RunParallel, StartsNoMoreThreadsThanTasks) {
  int started = 0;
  const ThreadStarter start = [&](std::function<void()> body) {
    ++started;
    return std::thread(std::move(body));
  };
  RunParallel(
      2, 8, [](size_t) {}, {}, start);
  EXPECT_EQ(started, 2);
}

TEST(RunParallel, ReportsProgressFromTheCallingThreadUpToTheCount) {
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<size_t> seen;
  bool elsewhere = false;
  RunParallel(
      50, 4, [](size_t) {},
      [&](size_t done) {
        if (std::this_thread::get_id() != caller) elsewhere = true;
        seen.push_back(done);
      });
  EXPECT_FALSE(elsewhere);
  ASSERT_FALSE(seen.empty());
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_EQ(seen.back(), 50u);
}

TEST(RunParallel, RethrowsATasksErrorOnceEveryTaskStartedHasEnded) {
  std::atomic<int> started{0}, ended{0};
  try {
    RunParallel(100, 4, [&](size_t i) {
      ++started;
      struct End {
        std::atomic<int>* ended;
        ~End() { ++*ended; }
      } end{&ended};
      if (i == 5) throw std::runtime_error("task five failed");
    });
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "task five failed");
  }
  EXPECT_EQ(started.load(), ended.load());
}

// The third start fails while the two workers started are inside a task:
// RunParallel must let them end, join them, and rethrow the start's error
// (a joinable std::thread destroyed on the way out would call
// std::terminate).
TEST(RunParallel, AFailedThreadStartJoinsTheWorkersStartedAndRethrows) {
  std::latch two_inside(2), release(1);
  std::atomic<int> started{0}, ended{0}, threads_ended{0};
  int starts = 0;
  const ThreadStarter start = [&](std::function<void()> body) {
    if (++starts == 3) {
      two_inside.wait();  // both workers hold a task now
      release.count_down();
      throw std::system_error(
          std::make_error_code(std::errc::resource_unavailable_try_again),
          "no thread for worker 3");
    }
    return std::thread([&threads_ended, body = std::move(body)] {
      body();
      ++threads_ended;
    });
  };
  try {
    RunParallel(
        1000, 4,
        [&](size_t i) {
          ++started;
          if (i < 2) {
            two_inside.count_down();
            release.wait();
          }
          ++ended;
        },
        {}, start);
    FAIL() << "no error";
  } catch (const std::system_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("no thread for worker 3"));
  }
  EXPECT_EQ(starts, 3);
  EXPECT_EQ(threads_ended.load(), 2);  // joined, not left running
  EXPECT_EQ(started.load(), ended.load());
  EXPECT_GE(ended.load(), 2);
}

TEST(RunParallel, AFailedFirstStartRunsNothing) {
  bool ran = false;
  const ThreadStarter start = [](std::function<void()>) -> std::thread {
    throw std::system_error(
        std::make_error_code(std::errc::resource_unavailable_try_again),
        "no thread");
  };
  EXPECT_THROW(RunParallel(
                   10, 2, [&](size_t) { ran = true; }, {}, start),
               std::system_error);
  EXPECT_FALSE(ran);
}

}  // namespace
}  // namespace modelcache::replay
