// Helpers shared by the core test suites: fake models, counting loaders, and
// waits on observable cache state (never on time).
#ifndef MODELCACHE_TESTS_TEST_UTIL_H_
#define MODELCACHE_TESTS_TEST_UTIL_H_

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "modelcache/base/errors.h"
#include "modelcache/core/cache.h"

namespace modelcache::testing {

struct FakeModel {
  std::string key;
  int generation;
};

// A gate a loader or unloader blocks on until the test opens it.
class Gate {
 public:
  void Open() { promise_.set_value(); }
  // Blocks until Open(); fails the test instead of hanging forever.
  void Pass() {
    ASSERT_EQ(future_.wait_for(std::chrono::seconds(60)),
              std::future_status::ready)
        << "gate never opened";
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_{promise_.get_future().share()};
};

// Spins (yielding) until `condition` holds. Synchronises on cache state the
// test can observe; the bound only turns a hang into a failure.
inline void WaitUntil(const std::function<bool()>& condition,
                      const char* what) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!condition()) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "never: " << what;
    std::this_thread::yield();
  }
}

inline int WaitersOn(const ModelCache& cache, const std::string& key) {
  auto entry = cache.Entry(key);
  return entry ? entry->waiters : 0;
}

// Counts constructions, and the most that ever ran at once.
struct ConstructionCounter {
  std::atomic<int> started{0};
  std::atomic<int> running{0};
  std::atomic<int> max_running{0};

  void Enter() {
    started.fetch_add(1);
    int now = running.fetch_add(1) + 1;
    int seen = max_running.load();
    while (now > seen && !max_running.compare_exchange_weak(seen, now)) {
    }
  }
  void Leave() { running.fetch_sub(1); }
};

// Keeps caught exceptions alive until the test's threads are joined. A
// failed load hands all its waiters one exception object, freed by whichever
// thread lets go of it last through a reference count ThreadSanitizer cannot
// see (libstdc++ is not instrumented); holding every reference until after
// the join orders that free after every thread's reads.
class KeptErrors {
 public:
  void Keep(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    errors_.push_back(std::move(error));
  }

 private:
  std::mutex mu_;
  std::vector<std::exception_ptr> errors_;
};

inline Loader SimpleLoader(const std::string& key, uint64_t bytes,
                           std::atomic<int>* calls = nullptr,
                           std::function<void()> unload = {}) {
  return [=] {
    int generation = calls ? calls->fetch_add(1) + 1 : 1;
    return Loaded{std::make_shared<FakeModel>(FakeModel{key, generation}),
                  bytes, unload};
  };
}

// Options that make a full budget an immediate kCapacity error.
inline AcquireOptions FailAtOnce() {
  AcquireOptions options;
  options.when_full = WhenFull::kFail;
  return options;
}

// Runs `f`, which must throw modelcache::Error with `code`; returns its
// message.
template <typename F>
std::string ErrorMessage(F&& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << "message: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected modelcache::Error with code "
                << static_cast<int>(code) << ", nothing was thrown";
  return "";
}

// The keys of `cache`'s resident records, sorted.
inline std::vector<std::string> ResidentKeys(const ModelCache& cache) {
  std::vector<std::string> keys;
  for (const EntryInfo& e : cache.Entries()) {
    if (e.state == EntryState::kResident) keys.push_back(e.key);
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

// A fresh directory for the running test's files, removed with everything in
// it when the object goes away.
class TestDirectory {
 public:
  explicit TestDirectory(const std::string& prefix)
      : path_(
            std::filesystem::temp_directory_path() /
            (prefix + "_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    std::filesystem::create_directories(path_);
  }
  ~TestDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TestDirectory(const TestDirectory&) = delete;
  TestDirectory& operator=(const TestDirectory&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string PathFor(const std::string& name) const {
    return (path_ / name).string();
  }

 private:
  const std::filesystem::path path_;
};

}  // namespace modelcache::testing

#endif  // MODELCACHE_TESTS_TEST_UTIL_H_
