// The test kit shared by the core suites (and the layers above that run a
// cache): fake models and counting loaders, waits on observable state (never
// on time), acquire options, gtest printers for the cache's records, and test
// files and directories.
#ifndef MODELCACHE_TESTS_TEST_UTIL_H_
#define MODELCACHE_TESTS_TEST_UTIL_H_

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "modelcache/base/errors.h"
#include "modelcache/core/cache.h"

namespace modelcache::testing {

// ---- Fake models and their counting loaders. ----

// A model of `key`. When given a counter, it counts itself live while it
// exists, so that a test can check that every model was freed.
class FakeModel {
 public:
  FakeModel(std::string model_key, int model_generation,
            std::atomic<int>* live = nullptr)
      : key(std::move(model_key)), generation(model_generation), live_(live) {
    if (live_ != nullptr) ++*live_;
  }
  ~FakeModel() {
    if (live_ != nullptr) --*live_;
  }
  FakeModel(const FakeModel&) = delete;
  FakeModel& operator=(const FakeModel&) = delete;

  const std::string key;
  const int generation;  // 1 for the first load of `key`, 2 for the next, ...

 private:
  std::atomic<int>* const live_;
};

// What an unloader made by Models throws when told to fail.
struct UnloadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// User code to run inside a loader or an unloader made by Models.
struct Hooks {
  std::function<void()> during_load;
  std::function<void()> during_unload;
};

// Makes loaders of fake models and counts loads and unloads per key, and the
// models still alive.
// REQUIRES: outlives every cache that holds its models.
class Models {
 public:
  // A loader of `key` whose model reports `real_bytes` as its size.
  Loader For(const std::string& key, uint64_t real_bytes, Hooks hooks = {}) {
    return [this, key, real_bytes, hooks] {
      if (hooks.during_load) hooks.during_load();
      int generation;
      {
        std::lock_guard<std::mutex> lock(mu_);
        generation = ++loads_[key];
      }
      auto model = std::make_shared<FakeModel>(key, generation, &live_);
      auto unload = [this, key, generation, during = hooks.during_unload] {
        if (during) during();
        bool fail;
        {
          std::lock_guard<std::mutex> lock(mu_);
          ++unload_attempts_[key];
          fail = failing_.count(key) > 0;
          if (!fail) unloaded_[key].push_back(generation);
        }
        if (fail) throw UnloadError("unload of " + key + " failed");
      };
      return Loaded{model, real_bytes, unload};
    };
  }

  // Makes every later unload of `key` throw UnloadError (or stop throwing).
  void FailUnloads(const std::string& key, bool fail) {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail) {
      failing_.insert(key);
    } else {
      failing_.erase(key);
    }
  }

  int loads(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(key);
    return it == loads_.end() ? 0 : it->second;
  }
  int unload_attempts(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = unload_attempts_.find(key);
    return it == unload_attempts_.end() ? 0 : it->second;
  }
  // Generations of `key` unloaded successfully, in order.
  std::vector<int> unloaded(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = unloaded_.find(key);
    return it == unloaded_.end() ? std::vector<int>{} : it->second;
  }
  // Successful unloads of `key`.
  int unloads(const std::string& key) const {
    return static_cast<int>(unloaded(key).size());
  }
  int total_loads() const {
    std::lock_guard<std::mutex> lock(mu_);
    int total = 0;
    for (const auto& [key, n] : loads_) total += n;
    return total;
  }
  int total_unloads() const {
    std::lock_guard<std::mutex> lock(mu_);
    int total = 0;
    for (const auto& [key, generations] : unloaded_) {
      total += static_cast<int>(generations.size());
    }
    return total;
  }
  // FakeModel objects not yet destroyed.
  int live() const { return live_.load(); }

 private:
  mutable std::mutex mu_;
  std::map<std::string, int> loads_;
  std::map<std::string, int> unload_attempts_;
  std::map<std::string, std::vector<int>> unloaded_;
  std::set<std::string> failing_;
  std::atomic<int> live_{0};
};

// A loader of a FakeModel of `key`, generation 1 or, with `calls`, one more
// than the calls before it; `unload` is the model's unloader.
inline Loader SimpleLoader(const std::string& key, uint64_t bytes,
                           std::atomic<int>* calls = nullptr,
                           std::function<void()> unload = {}) {
  return [=] {
    int generation = calls ? calls->fetch_add(1) + 1 : 1;
    return Loaded{std::make_shared<FakeModel>(key, generation), bytes, unload};
  };
}

// ---- Synchronisation on observable state. ----

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

// Spins (yielding, never sleeping) until `condition` holds. Synchronises on
// state the test can observe; the bound only turns a hang into a failure
// naming `what`.
inline void SpinUntil(const std::function<bool()>& condition,
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

// ---- Acquire options. ----

// Options that make a full budget an immediate kCapacity error.
inline AcquireOptions FailAtOnce() {
  AcquireOptions options;
  options.when_full = WhenFull::kFail;
  return options;
}

// Options that make a full budget wait for room until `deadline`, then fail
// with kTimeout.
inline AcquireOptions WaitForRoom(
    Clock::time_point deadline = Clock::time_point::max()) {
  AcquireOptions options;
  options.when_full = WhenFull::kWait;
  options.deadline = deadline;
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

// The bytes of the file at `path`; empty when it cannot be read.
inline std::vector<std::byte> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

// A file in the temporary directory holding `contents`, named uniquely in
// the process (ending in `suffix`), removed when the object goes away.
class TempFile {
 public:
  explicit TempFile(const std::string& contents,
                    const std::string& suffix = ".csv")
      : path_((std::filesystem::temp_directory_path() /
               ("modelcache_test_" + std::to_string(::getpid()) + "_" +
                std::to_string(counter_.fetch_add(1)) + suffix))
                  .string()) {
    Write(contents);
  }
  ~TempFile() {
    std::error_code ignored;
    std::filesystem::remove(path_, ignored);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  // Replaces the file's contents.
  void Write(const std::string& contents) const {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << contents;
  }
  const std::string& path() const { return path_; }

 private:
  static inline std::atomic<uint64_t> counter_{0};
  const std::string path_;
};

// How a shell command exited (its status; -1 when a signal ended it) and
// what it wrote to stdout and stderr.
struct CommandResult {
  int status;
  std::string out, err;
};

// Runs `command` with /bin/sh, its stdout and stderr sent to files.
inline CommandResult RunShell(const std::string& command) {
  TempFile out("", ".out"), err("", ".err");
  const std::string line = command + " >" + out.path() + " 2>" + err.path();
  const int raw = std::system(line.c_str());
  auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  return CommandResult{WIFEXITED(raw) ? WEXITSTATUS(raw) : -1,
                       slurp(out.path()), slurp(err.path())};
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

namespace modelcache {

// gtest printers, found by argument-dependent lookup, so that a failed
// EXPECT_EQ on whole stats or entries names every field.
namespace print_detail {
inline void Value(std::ostream* os, const std::string& v) {
  *os << '"' << v << '"';
}
inline void Value(std::ostream* os, EntryState v) { *os << EntryStateName(v); }
inline void Value(std::ostream* os, bool v) { *os << (v ? "true" : "false"); }
inline void Value(std::ostream* os, Clock::time_point v) {
  *os << std::chrono::duration_cast<std::chrono::nanoseconds>(
             v.time_since_epoch())
             .count()
      << "ns";
}
template <typename T>
void Value(std::ostream* os, const T& v) {
  *os << v;
}
template <typename Record>
void Fields(const Record& r, std::ostream* os) {
  const char* sep = "{";
  ForEachField(r, [&](const char* name, const auto& value, const char*) {
    *os << sep << name << "=";
    Value(os, value);
    sep = " ";
  });
  *os << "}";
}
}  // namespace print_detail

inline void PrintTo(const CacheStats& s, std::ostream* os) {
  print_detail::Fields(s, os);
}

inline void PrintTo(const EntryInfo& e, std::ostream* os) {
  print_detail::Fields(e, os);
}

}  // namespace modelcache

#endif  // MODELCACHE_TESTS_TEST_UTIL_H_
